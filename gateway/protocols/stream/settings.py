"""Settings of stream listeners, as validated by `gateway.config`."""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["DEFAULT_FRAME_MAX", "StreamListenerSettings"]

DEFAULT_FRAME_MAX: Final = 1024 * 1024
"""RabbitMQ's default frame_max (1 MiB)."""


@attrs.frozen(kw_only=True)
class StreamListenerSettings:
    """How a RabbitMQ Stream protocol listener behaves.

    Attributes:
        advertised_host: The host clients are told to connect to in Metadata
            (default: the address the listener is bound to).
        advertised_port: The port they are told (default: the port it got).
        guest: Whether user ``guest`` with password ``guest`` may log in from
            loopback addresses only, as on a fresh RabbitMQ.
        anonymous: Whether SASL ANONYMOUS is offered.
        virtual_hosts: Virtual hosts Open accepts.
        frame_max: Largest frame accepted after Open (0: no limit).
        heartbeat_seconds: Heartbeat interval proposed in Tune (0: none).
        max_unconfirmed: Published messages not yet confirmed, per
            connection, before the listener stops reading from it.
    """

    advertised_host: str | None = None
    advertised_port: int | None = None
    guest: bool = False
    anonymous: bool = False
    virtual_hosts: frozenset[str] = frozenset({"/"})
    frame_max: int = DEFAULT_FRAME_MAX
    heartbeat_seconds: int = 60
    max_unconfirmed: int = 50_000
