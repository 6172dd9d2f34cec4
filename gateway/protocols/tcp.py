"""Small helpers about the transports under our protocols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from twisted.internet.interfaces import ITCPTransport, ITransport
from twisted.internet.protocol import Factory, Protocol

__all__ = ["RefusedConnection", "UpstreamFactory", "disable_nagle"]

U = TypeVar("U")
P = TypeVar("P", bound=Protocol)


class UpstreamFactory(Factory, Generic[U, P]):
    """Builds an upstream's connections: ``protocol(upstream)`` each time.

    Quiet: the upstream logs its own connection events.
    """

    noisy = False

    def __init__(self, protocol: Callable[[U], P], upstream: U) -> None:
        self._protocol = protocol
        self.upstream = upstream

    def buildProtocol(self, addr: Any) -> P:
        """A new connection of the upstream."""
        return self._protocol(self.upstream)


class RefusedConnection(Protocol):
    """A connection a listener does not take (past ``max_connections``): closed at once.

    A factory's ``buildProtocol`` may return None to refuse, but only a plain
    TCP port honours that; Twisted's TLS wrapper (``mtls:``, ``ssl:``) wraps
    the None, fails on it, and leaves the connection open for ever. This
    protocol refuses the same way on every transport: it closes the
    connection as soon as it is made, before a byte is read or written. On
    TCP that is the orderly close a refused None got; a TLS wrapper whose
    handshake has not begun aborts its TCP connection instead.
    """

    def connectionMade(self) -> None:
        """Close at once: nothing was written, so nothing waits."""
        assert self.transport is not None
        self.transport.loseConnection()


def disable_nagle(transport: ITransport | None) -> None:
    """Turn off Nagle's algorithm on a TCP transport, TLS-wrapped or not.

    The protocols batch their own writes (one write per peer per batch), so
    Nagle's algorithm only adds latency: with delayed ACKs on the far side, a
    small write can wait for the previous one's acknowledgement. Transports
    that are not TCP (in-memory ones in tests, UNIX sockets) are left alone.
    """
    # A TLS connection's transport is a protocol wrapper whose own transport is TCP.
    for candidate in (transport, getattr(transport, "transport", None)):
        if ITCPTransport.providedBy(candidate):
            candidate.setTcpNoDelay(True)
            return
