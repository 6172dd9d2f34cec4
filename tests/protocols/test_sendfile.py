"""Tests for `gateway.protocols.sendfile` and `.sendnow`: bytes sent straight to a socket.

Real TCP connections on loopback and real files, each way of sending
(``os.sendfile``, as to a remote peer; read and ``sendmsg``, as on this
host). `FileSender.send` is given a `StringTransport` as the transport:
what the socket does not take must arrive there, after what went, whatever
the socket took. `idle_socket` is asked about real Twisted TCP connections
on the real reactor.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import PrivateCertificate
from twisted.internet.testing import StringTransport

from gateway.protocols.sendfile import FileSender, same_host
from gateway.protocols.sendnow import send_now, unsent
from tests.certs import make_pki

SENDFILE = pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "read-send"])
"""Each way of sending the body."""
DATA = bytes(range(256)) * 64 * 64
"""1 MiB the file holds: every span is checked byte for byte."""
HEAD = b"HEAD-of-the-frame"


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection on loopback: (sender, non-blocking as Twisted's; receiver)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        receiver = socket.create_connection(server.getsockname())
        sender, _ = server.accept()
    sender.setblocking(False)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[int]:
    """A read descriptor of a file holding `DATA`."""
    path = tmp_path / "segment"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def received(sock: socket.socket, count: int) -> bytes:
    """Exactly ``count`` bytes from a blocking socket."""
    sock.settimeout(10)
    parts = []
    while count:
        part = sock.recv(min(count, 1 << 20))
        assert part, "the connection closed"
        parts.append(part)
        count -= len(part)
    return b"".join(parts)


def fill(sock: socket.socket) -> int:
    """Write to a non-blocking socket until it takes no more; the bytes written."""
    written = 0
    block = b"f" * 65536
    while True:
        try:
            written += sock.send(block)
        except BlockingIOError:
            return written


@SENDFILE
def test_a_frame_with_room_goes_whole_to_the_socket(
    connection: tuple[socket.socket, socket.socket], data_file: int, sendfile: bool
) -> None:
    """Head and span in the socket, in order; the transport is given nothing."""
    sender, receiver = connection
    transport = StringTransport()
    assert FileSender(sendfile).send(transport, sender, HEAD, data_file, 1000, 5000)
    assert received(receiver, len(HEAD) + 5000) == HEAD + DATA[1000:6000]
    assert transport.value() == b""


@SENDFILE
def test_what_the_socket_does_not_take_goes_to_the_transport_after_it(
    connection: tuple[socket.socket, socket.socket], data_file: int, sendfile: bool
) -> None:
    """A span larger than the socket's buffers: the rest is in the transport, in order."""
    sender, receiver = connection
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    transport = StringTransport()
    assert not FileSender(sendfile).send(transport, sender, HEAD, data_file, 7, len(DATA) - 7)
    rest = transport.value()
    assert 0 < len(rest) < len(DATA)
    went = received(receiver, len(HEAD) + len(DATA) - 7 - len(rest))
    assert went + rest == HEAD + DATA[7:]


@SENDFILE
def test_a_full_socket_leaves_head_and_span_to_the_transport(
    connection: tuple[socket.socket, socket.socket], data_file: int, sendfile: bool
) -> None:
    """Not even the head fits: all of it goes to the transport, nothing is sent."""
    sender, receiver = connection
    filled = fill(sender)
    transport = StringTransport()
    assert not FileSender(sendfile).send(transport, sender, HEAD, data_file, 0, 3000)
    assert transport.value() == HEAD + DATA[:3000]
    assert received(receiver, filled) == b"f" * filled
    receiver.setblocking(False)
    with pytest.raises(BlockingIOError):
        receiver.recv(1)


@SENDFILE
def test_a_broken_connection_leaves_it_to_the_transport(
    connection: tuple[socket.socket, socket.socket], data_file: int, sendfile: bool
) -> None:
    """A socket that cannot send: the transport gets it all, and its write reports the error."""
    sender, _receiver = connection
    sender.shutdown(socket.SHUT_WR)
    transport = StringTransport()
    sending = FileSender(sendfile)
    assert not sending.send(transport, sender, HEAD, data_file, 10, 20)
    assert transport.value() == HEAD + DATA[10:30]
    assert sending.sendfile is sendfile


@SENDFILE
def test_a_span_past_the_end_of_the_file_is_an_error(
    connection: tuple[socket.socket, socket.socket], data_file: int, sendfile: bool
) -> None:
    """The file ends before the span: EOFError, never a frame quietly cut short."""
    sender, _receiver = connection
    with pytest.raises(EOFError, match="100 bytes before"):
        FileSender(sendfile).send(StringTransport(), sender, HEAD, data_file, len(DATA) - 50, 150)


def test_a_descriptor_sendfile_cannot_read_turns_it_off(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    """``sendfile`` refusing the file (a socket as the source: ESPIPE): not tried again."""
    sender, _receiver = connection
    source, other = socket.socketpair()
    sending = FileSender(sendfile=True)
    try:
        with pytest.raises(OSError):  # the rest cannot be read from it either
            sending.send(StringTransport(), sender, HEAD, source.fileno(), 0, 10)
    finally:
        source.close()
        other.close()
    assert sending.sendfile is False


def test_transports_other_than_plain_tcp_have_no_idle_socket() -> None:
    """A test's transport, or anything without Twisted's TCP buffers, is written as usual."""
    assert FileSender().idle_socket(StringTransport()) is None
    assert FileSender().idle_socket(None) is None


class _Ends(StringTransport):
    """A transport between two addresses."""

    def __init__(self, host: Any, peer: Any) -> None:
        super().__init__(hostAddress=host, peerAddress=peer)


@pytest.mark.parametrize(
    ("host", "peer", "same"),
    [
        (IPv4Address("TCP", "127.0.0.1", 5552), IPv4Address("TCP", "127.0.0.1", 40000), True),
        (IPv4Address("TCP", "10.0.0.1", 5552), IPv4Address("TCP", "127.0.0.2", 40000), True),
        (IPv4Address("TCP", "10.0.0.1", 5552), IPv4Address("TCP", "10.0.0.1", 40000), True),
        (IPv4Address("TCP", "10.0.0.1", 5552), IPv4Address("TCP", "10.0.0.2", 40000), False),
        (IPv6Address("TCP", "::1", 5552), IPv6Address("TCP", "::1", 40000), True),
        (IPv6Address("TCP", "2001:db8::1", 5552), IPv6Address("TCP", "2001:db8::2", 1), False),
        (UNIXAddress(b"/run/gw.sock"), UNIXAddress(None), True),
    ],
)
def test_same_host(host: Any, peer: Any, same: bool) -> None:
    """Loopback or our own address is this host (read and sent); anything else is remote."""
    assert same_host(_Ends(host, peer)) is same


class _Held(Protocol):
    """A server-side connection the test looks at."""

    def __init__(self, made: Deferred[Protocol]) -> None:
        self._made = made

    def connectionMade(self) -> None:
        self._made.callback(self)


@contextlib.asynccontextmanager
async def twisted_connection(
    tls: Any = None,
) -> AsyncIterator[tuple[Any, socket.socket]]:
    """A Twisted TCP connection on the real reactor: (its server-side transport, the client).

    With ``tls`` (a context factory) the server listens with ``listenSSL``;
    the client only connects, so the handshake never runs.
    """
    from twisted.internet import reactor

    made: Deferred[Protocol] = Deferred()
    factory = Factory.forProtocol(lambda: _Held(made))
    port: Any = (
        reactor.listenTCP(0, factory, interface="127.0.0.1")
        if tls is None
        else reactor.listenSSL(0, factory, tls, interface="127.0.0.1")
    )
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    try:
        server = await made
        yield server.transport, client
    finally:
        client.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_idle_socket_of_a_twisted_tcp_connection() -> None:
    """Its socket while nothing is unsent; None while the transport holds data or closes."""
    async with twisted_connection() as (transport, _client):
        sending = FileSender()
        assert sending.idle_socket(transport) is transport.socket
        assert sending.sendfile is False  # decided: the peer is on this host
        transport.write(b"unsent until the reactor polls")
        assert sending.idle_socket(transport) is None
        transport.doWrite()  # sent: nothing held again
        assert sending.idle_socket(transport) is transport.socket
        transport.loseConnection()
        assert sending.idle_socket(transport) is None


@pytest_twisted.ensureDeferred
async def test_a_tls_connection_has_no_idle_socket(tmp_path: Path) -> None:
    """Under TLS (``listenSSL``, the ``ssl:`` and ``mtls:`` endpoints) the bytes must be sealed."""
    pki = make_pki(tmp_path)
    certificate = PrivateCertificate.loadPEM(pki.server.certificate_pem() + pki.server.key_pem())
    async with twisted_connection(certificate.options()) as (transport, _client):
        assert hasattr(transport, "socket")  # a TCP connection, TLS inside
        assert FileSender().idle_socket(transport) is None


@SENDFILE
@pytest_twisted.ensureDeferred
async def test_nothing_goes_past_what_the_transport_holds(data_file: int, sendfile: bool) -> None:
    """A frame sent while the transport holds data goes after it, never ahead on the socket."""
    async with twisted_connection() as (transport, client):
        sending = FileSender(sendfile)
        sock = sending.idle_socket(transport)
        assert sock is not None
        transport.write(b"first")  # held until the reactor polls
        assert not sending.send(transport, sock, HEAD, data_file, 0, 100)
        transport.doWrite()
        assert received(client, 5 + len(HEAD) + 100) == b"first" + HEAD + DATA[:100]
        assert sending.whole == 0
        assert sending.send(transport, sock, HEAD, data_file, 100, 100)
        assert received(client, len(HEAD) + 100) == HEAD + DATA[100:200]
        assert sending.whole == 1


@pytest_twisted.ensureDeferred
async def test_send_now_goes_to_the_socket_and_the_rest_after_what_the_transport_holds() -> None:
    """`send_now`: at once, the reactor not asked to watch; behind held bytes, in order."""
    from twisted.internet import reactor

    async with twisted_connection() as (transport, client):
        send_now(transport, b"first ")
        assert transport not in reactor.getWriters()  # nothing held: no epoll_ctl
        assert received(client, 6) == b"first "
        transport.write(b"held ")  # until the reactor polls
        send_now(transport, b"then")
        assert unsent(transport)
        transport.doWrite()
        assert received(client, 9) == b"held then"
        held = StringTransport()  # no socket: written as usual
        send_now(held, b"as usual")
        assert held.value() == b"as usual"


def test_send_now_hands_what_a_full_socket_does_not_take_to_the_transport(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    """A full socket (``BlockingIOError``): the bytes go to the transport, none lost."""
    sender, receiver = connection
    filled = fill(sender)
    transport = _SocketTransport(sender)
    send_now(transport, b"x" * 100_000)
    assert transport.value() == b"x" * 100_000  # the socket was full: all of it held
    assert received(receiver, filled) == b"f" * filled


class _SocketTransport(StringTransport):
    """A StringTransport over a real socket, holding nothing, as `idle_socket` wants it."""

    TLS = False

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.socket = sock
        self.connected = True
        self.disconnecting = False
        self.producerPaused = False
        self._writeDisconnected = False
        self._tempDataLen = 0
