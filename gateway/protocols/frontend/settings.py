"""Settings of TLS front-end listeners, as validated by `gateway.config`."""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["SPEAKS", "FrontendSettings"]

SPEAKS: Final = frozenset({"ssmp", "qmqp", "stream"})
"""The protocols a front-end relays (the value of ``speaks``)."""


@attrs.frozen(kw_only=True)
class FrontendSettings:
    """How a TLS front-end listener relays its clients to a plaintext backend.

    Attributes:
        speaks: The protocol on both sides: ``ssmp``, ``qmqp`` or ``stream``.
        backend: A Twisted client endpoint string for the backend
            (``tcp:host=...:port=...``, or ``tls:`` to re-encrypt).
        connect_timeout_seconds: How long one backend connection may take.
        handshake_timeout_seconds: How long a client has to finish its TLS
            handshake (and, for SSMP, to send its LOGIN line).
    """

    speaks: str
    backend: str
    connect_timeout_seconds: float = 10.0
    handshake_timeout_seconds: float = 10.0
