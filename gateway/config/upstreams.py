"""Upstreams (``[upstreams.NAME]``): the keys every upstream has, and its protocol's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs

from gateway.config import dmp, mtl, qmqp, ssmp, stream
from gateway.config.base import (
    Section,
    TableSchema,
    boolean,
    required_choice,
    required_string,
)
from gateway.config.endpoints import (
    UNVERIFIED_TLS_CLIENT_PREFIX,
    check_client_endpoint,
    check_client_tls,
    check_name,
    with_paths_resolved,
)

__all__ = ["PROTOCOLS", "UPSTREAM", "UpstreamConfig", "read_upstream"]


@attrs.frozen
class UpstreamConfig:
    """An upstream: a server the gateway connects to.

    Attributes:
        name: Its name, used by routes.
        protocol: ``ssmp``, ``qmqp``, ``stream``, ``dmp`` or ``mtl``.
        endpoint: A Twisted client endpoint string (``tcp:``, ``tls:``...).
        settings: The protocol's own settings object.
        allow_unverified_tls: Whether an ``ssl:`` endpoint (which does not
            verify the server) was accepted on purpose; logged at every start.
    """

    name: str
    protocol: str
    endpoint: str
    settings: Any
    allow_unverified_tls: bool = False

    @property
    def unverified_tls(self) -> bool:
        """Whether it connects over TLS without verifying the server (an ``ssl:`` endpoint)."""
        return self.endpoint.startswith(UNVERIFIED_TLS_CLIENT_PREFIX)


PROTOCOLS: Final[dict[str, tuple[TableSchema, Callable[[Section], Any]]]] = {
    "ssmp": (ssmp.UPSTREAM, ssmp.read_upstream),
    "qmqp": (qmqp.UPSTREAM, qmqp.read_upstream),
    "stream": (stream.UPSTREAM, stream.read_upstream),
    "dmp": (dmp.UPSTREAM, dmp.read_upstream),
    "mtl": (mtl.UPSTREAM, mtl.read_upstream),
}
"""Each upstream protocol: its own keys, and the function that reads them."""

PROTOCOL: Final = required_choice(
    "protocol", frozenset(PROTOCOLS), doc="The protocol spoken (its keys are below)."
)
ENDPOINT: Final = required_string(
    "endpoint",
    doc="A Twisted client endpoint string: ``tcp:host=H:port=P``, or"
    " ``tls:host=H:port=P:trustRoots=CA:certificate=C:privateKey=K``, which verifies the"
    " server's certificate and host name. ``ssl:`` is refused: it verifies neither.",
)
ALLOW_UNVERIFIED_TLS: Final = boolean(
    "allow_unverified_tls",
    False,
    doc="Accept an ``ssl:`` endpoint, which checks neither the server's host name nor (without"
    " caCertsDir) its certificate, so that anyone on the path can stand in for the server;"
    " logged as a warning at every start. Use ``tls:`` instead.",
)

UPSTREAM: Final = TableSchema(
    "Every upstream",
    "[upstreams.NAME]",
    (PROTOCOL, ENDPOINT, ALLOW_UNVERIFIED_TLS),
    doc="A server the gateway connects to. It reconnects with back-off: the first wait 0.5 s,"
    " growing to 30 s, counted from the last connection that finished its handshake. An"
    " upstream that logs in takes its secret from the secrets file's ``[upstreams]``.",
)


def read_upstream(name: str, section: Section, names: set[str]) -> UpstreamConfig | None:
    """One ``[upstreams.NAME]`` table; None when it is too broken to use."""
    check_name(section, name, names)
    protocol = section.read(PROTOCOL)
    endpoint = section.read(ENDPOINT)
    if protocol is None or endpoint is None:
        # No section.done(): without protocol and endpoint the protocol's own
        # settings were never read, and calling them unknown keys would mislead.
        return None
    endpoint = with_paths_resolved(endpoint, section)
    check_client_endpoint(section, ENDPOINT, endpoint)
    check_client_tls(section, ENDPOINT, endpoint, ALLOW_UNVERIFIED_TLS)
    schema, read_settings = PROTOCOLS[protocol]
    section = section.including(schema)
    settings = read_settings(section)
    section.done()
    return UpstreamConfig(
        name=name,
        protocol=protocol,
        endpoint=endpoint,
        settings=settings,
        allow_unverified_tls=section.read(ALLOW_UNVERIFIED_TLS),
    )
