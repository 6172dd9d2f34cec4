"""Small helpers about the transports under our protocols."""

from __future__ import annotations

from twisted.internet.interfaces import ITCPTransport, ITransport

__all__ = ["disable_nagle"]


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
