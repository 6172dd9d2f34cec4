"""Frames whose body lies in a file, sent to the socket at once (``os.sendfile`` to remote peers).

A stream consumer's Deliver frame carries a chunk exactly as the log stored
it. Read into memory and written through the transport, every chunk is
copied three times in the process (the read, Twisted's buffer, the send),
and waits for the reactor's next poll, with the transport's producer
paused and resumed around it. On a plain TCP connection whose transport
holds nothing unsent, `FileSender` sends the frame at once instead:

* to a peer on another host, the head, then the chunk from the file with
  ``os.sendfile``: the kernel hands its page cache to the network card, and
  nothing passes through Python;
* to a peer on this host (loopback, or our own address), the chunk read
  and sent with the head in one ``sendmsg``. Over loopback the file's pages
  travel to the consumer's process as they are, and the consumer pays for
  reading them from memory. Measured with one rstream consumer, passes of
  each way taking turns in one gateway: ``sendfile`` cost the gateway 25%
  less CPU a message than reading and sending, but the consumer 6% more,
  and its rate fell 5% (slower in 7 of 10 turns). Reading and sending
  costs the gateway less than the transport's write did, and costs the
  consumer nothing; ``sendfile`` would make a consumer on this host slower.
  (Sending from a memory map of the segment measured as reading does.)

What the socket does not take is written to the transport, after what went:
from there the transport's own writing, back-pressure and error reporting
go on as for any write. TLS connections, and transports holding data, are
written as usual (`FileSender.idle_socket` says None), as other writes are
(`gateway.protocols.sendnow`). docs/performance.rst
has the measurements.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import Any, Final

from gateway.protocols.sendnow import idle_socket, unsent

__all__ = ["FileSender", "same_host"]

_MSG_MORE: Final = getattr(socket, "MSG_MORE", 0)
"""Hold the head for the data that follows it (Linux), instead of a packet of its own."""
_UNSUPPORTED: Final = frozenset(
    {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK, errno.ESPIPE}
)
"""``sendfile`` errors that mean it cannot be used here (this file system, this socket, a
source that cannot seek)."""


def same_host(transport: Any) -> bool:
    """Whether a connection's peer is on this host: loopback, or our own address.

    Anything but an IP connection (a UNIX socket) is on this host.
    """
    try:
        peer = transport.getPeer().host
        local = transport.getHost().host
        return peer == local or ipaddress.ip_address(peer).is_loopback
    except (AttributeError, ValueError):
        return True


def _read_exactly(fd: int, length: int, position: int) -> bytes:
    """``length`` bytes of ``fd`` from ``position``.

    Raises:
        EOFError: The file ends first.
    """
    data = os.pread(fd, length, position)
    if len(data) != length:
        raise EOFError(f"the file ends {length - len(data)} bytes before the span to send")
    return data


class FileSender:
    """Sends frames whose body lies in a file straight to a plain TCP transport's socket.

    One per connection. ``sendfile`` says whether the body goes with
    ``os.sendfile`` (None: decided by the first transport, `same_host`); once
    ``sendfile`` says it cannot be used there, it is read and sent instead.
    ``whole`` counts the frames that went to the socket whole.
    """

    __slots__ = ("sendfile", "whole")

    def __init__(self, sendfile: bool | None = None) -> None:
        self.sendfile = sendfile if hasattr(os, "sendfile") else False
        self.whole = 0

    def idle_socket(self, transport: Any) -> socket.socket | None:
        """The socket under ``transport`` if it is plain TCP (no TLS), open, holding nothing."""
        sock = idle_socket(transport)
        if sock is not None and self.sendfile is None:
            self.sendfile = not same_host(transport)
        return sock

    def send(
        self, transport: Any, sock: socket.socket, head: bytes, fd: int, position: int, length: int
    ) -> bool:
        """Send ``head``, then ``length`` bytes of ``fd`` from ``position``.

        ``sock`` is what `idle_socket` returned for ``transport`` this turn. What
        the socket does not take now (it is full, or broken: the transport's
        write reports that) goes to the transport, in order; and once the
        transport holds something, everything goes after it there.

        Returns:
            True when it all went to the socket, False when the transport holds the rest.

        Raises:
            EOFError: The file ends before the span (what was sent is a frame cut short).
        """
        if unsent(transport):
            transport.write(head + _read_exactly(fd, length, position))
            return False
        if not self.sendfile:
            return self._send_read(transport, sock, head, _read_exactly(fd, length, position))
        try:
            sent = sock.send(head, _MSG_MORE)
        except OSError:  # full (BlockingIOError) or broken
            sent = 0
        if sent < len(head):
            transport.write(head[sent:] + _read_exactly(fd, length, position))
            return False
        try:
            done = os.sendfile(sock.fileno(), fd, position, length)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                self.sendfile = False
            done = 0
        if done == length:
            self.whole += 1
            return True
        transport.write(_read_exactly(fd, length - done, position + done))
        return False

    def _send_read(self, transport: Any, sock: socket.socket, head: bytes, data: bytes) -> bool:
        """`send` for a body already read: one ``sendmsg``, the rest to the transport."""
        try:
            sent = sock.sendmsg([head, data])
        except OSError:  # full (BlockingIOError) or broken
            sent = 0
        if sent == len(head) + len(data):
            self.whole += 1
            return True
        if sent < len(head):
            transport.write(head[sent:] + data)
        else:
            transport.write(data[sent - len(head) :])
        return False
