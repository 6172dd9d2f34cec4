"""Writes sent to a plain TCP connection's socket at once, when its transport holds nothing.

A Twisted transport's ``write`` keeps the bytes and asks the reactor to
watch the socket for room (an ``epoll_ctl``); on the next poll the reactor
sends them and stops watching (another). A write that is to reach the
socket now (a listener's answers pushed outside a read:
`gateway.protocols.listener.ListenerConnection.flush_now`) need not take
that way: on a connection whose transport holds nothing unsent, `send_now`
sends the bytes to the socket and writes to the transport only what the
socket did not take, so the transport's back-pressure and its error
reporting (a broken connection found by its next send) go on as for any
write, and the order holds. `gateway.protocols.sendfile` sends a stream
chunk's file span the same way.

Only for plain TCP (`idle_socket`): TLS connections, transports holding
bytes, closing or paused ones, and test transports are written as usual.
Not for every write: sent at once, the writes a read makes (the hub's
deliveries, a route's answers in the read) answered sooner at 10,000
messages a second (the hub's p99 0.38 against 0.50 ms), but the test of
a subscriber that never reads no longer saw it cut off (2 MB went by
without the slow-consumer timer starting: congestion is what Twisted's
buffer signals, and the bytes had gone past it; not traced further), and
an SSMP route into RabbitMQ at full speed spent about 5% more CPU a
message (docs/performance.rst).
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.interfaces import ISSLTransport

__all__ = ["idle_socket", "send_now", "unsent"]


def unsent(transport: Any) -> bool:
    """Whether a Twisted transport holds bytes it has not sent; False for any other.

    What write() took, and what doWrite() has not sent of its current buffer.
    """
    left = len(getattr(transport, "dataBuffer", b"")) - getattr(transport, "offset", 0)
    return bool(left or getattr(transport, "_tempDataLen", 0))


def idle_socket(transport: Any) -> socket.socket | None:
    """The socket under ``transport`` if it is plain TCP (no TLS), open, holding nothing."""
    # Only twisted.internet.abstract.FileDescriptor's have these buffers (a test's
    # transport has none); a TCP connection says whether it is TLS (``listenSSL``,
    # ``startTLS``). Twisted's TLS wrapper passes the TCP connection's attributes
    # through (``TLS`` False, its socket): it says it is TLS by providing
    # ISSLTransport.
    if getattr(transport, "_tempDataLen", None) is None:
        return None
    sock = getattr(transport, "socket", None)
    if (
        not isinstance(sock, socket.socket)
        or getattr(transport, "TLS", True)
        or ISSLTransport.providedBy(transport)
        or unsent(transport)
        or not transport.connected
        or transport.disconnecting
        or transport.producerPaused
        or transport._writeDisconnected
    ):
        return None
    return sock


def send_now(transport: Any, data: bytes) -> None:
    """Write ``data``: to the socket at once if `idle_socket`, the rest to the transport."""
    sock = idle_socket(transport)
    if sock is not None:
        try:
            sent = sock.send(data)
        except OSError:  # full (BlockingIOError) or broken: the transport's write reports it
            sent = 0
        if sent == len(data):
            return
        if sent:
            data = data[sent:]
    transport.write(data)
