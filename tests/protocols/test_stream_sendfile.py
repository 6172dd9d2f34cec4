"""The stream listener's deliveries over real TCP, where chunks go from the log's file.

On a plain TCP connection `ServerSubscriptions` sends chunks with
`gateway.protocols.sendfile.FileSender` (read and sent on this host,
``os.sendfile`` to remote peers: both are run here); with a
`StringTransport` (the rest of the listener's tests) it writes them through
the transport. Here the
listener is on the real reactor, on loopback, with a client that speaks our
client codec: every Deliver must carry exactly what `StreamLog.read_chunks`
gives, in order, whether the socket takes everything or fills up (a client
that stops reading) and the transport holds the rest.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory, Protocol

from gateway.codecs import stream as sp
from gateway.protocols.stream.server import StreamServerFactory, StreamServerProtocol
from tests.doubles import NO_LOGIN_WAIT
from tests.protocols.test_stream_server import (
    FIRST,
    GUEST,
    LISTENER,
    SECRETS,
    Listener,
    _reactor,
    listener,  # noqa: F401 (the fixture)
    plain,
)

CHUNK_BYTES = 100_000
SMALL_BUFFER = 32 * 1024


class Client(Protocol):
    """A stream client on a real connection: our client codec, frames kept as they come."""

    def __init__(self) -> None:
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self.events: list[sp.Event] = []
        self._waiting: list[tuple[Callable[[], bool], Deferred[None]]] = []
        self.connected_: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.connected_.callback(None)

    def dataReceived(self, data: bytes) -> None:
        self.events.extend(self.codec.receive_data(data))
        waiting, self._waiting = self._waiting, []
        for condition, waiter in waiting:
            if condition():
                waiter.callback(None)
            else:
                self._waiting.append((condition, waiter))

    def send(self, *events: sp.Event) -> None:
        """Frames in one write."""
        assert self.transport is not None
        self.transport.write(b"".join(self.codec.send(event) for event in events))

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until what has arrived satisfies ``condition``."""
        if not condition():
            waiter: Deferred[None] = Deferred()
            self._waiting.append((condition, waiter))
            await waiter

    def of(self, kind: type) -> list[Any]:
        """The frames of one type received so far."""
        return [event for event in self.events if isinstance(event, kind)]


class Watched(StreamServerProtocol):
    """The server's connection, saying when its transport pauses it."""

    paused: Deferred[None] | None = None

    def pauseProducing(self) -> None:
        super().pauseProducing()
        if self.paused is not None:
            paused, self.paused = self.paused, None
            paused.callback(None)


class WatchedFactory(StreamServerFactory):
    """Keeps the connections it builds."""

    protocol = Watched
    built: list[Watched]

    def buildProtocol(self, addr: Any) -> Watched:
        built = super().buildProtocol(addr)
        assert isinstance(built, Watched)
        self.built.append(built)
        return built


async def connected(harness: Listener) -> tuple[Client, Watched, Any]:
    """A client through the handshake on a real TCP connection; its server side; the port."""
    factory = WatchedFactory(
        name=LISTENER, settings=GUEST, store=harness.store, secrets=SECRETS, clock=harness.clock
    )
    factory.built = []
    factory.login_failures = NO_LOGIN_WAIT
    port = _reactor().listenTCP(0, factory, interface="127.0.0.1")
    factory.listening_on(port.getHost())
    client = Client()
    _reactor().connectTCP(
        "127.0.0.1", port.getHost().port, ClientFactory.forProtocol(lambda: client)
    )
    await client.connected_
    client.send(
        sp.PeerProperties(correlation_id=1, properties={"product": "test"}),
        sp.SaslHandshake(correlation_id=2),
        sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=plain(b"guest", b"guest")),
    )
    await client.until(lambda: bool(client.of(sp.Tune)))
    client.send(sp.Tune(frame_max=0, heartbeat=0), sp.Open(correlation_id=4, virtual_host="/"))
    await client.until(lambda: bool(client.of(sp.OpenResponse)))
    (server,) = factory.built
    return client, server, port


def subscribe(credit: int) -> sp.Subscribe:
    """Subscription 1 to stream ``s`` from the first offset."""
    return sp.Subscribe(
        correlation_id=5, subscription_id=1, stream="s", offset_spec=FIRST, credit=credit,
        properties={},
    )  # fmt: skip


@pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "read-send"])
@pytest_twisted.ensureDeferred
async def test_deliveries_come_from_the_file_with_what_read_chunks_gives(
    listener: Listener,  # noqa: F811 (the fixture imported above)
    sendfile: bool,
) -> None:
    """Small and large chunks, all credit at once: the same bytes, in order, from the file."""
    stream = await listener.fill(
        "s", *[[b"m%d-" % n + b"x" * (n * 997 % 5000)] * (1 + n % 3) for n in range(40)]
    )
    expected = [bytes(chunk.payload) for chunk in stream.read_chunks(0, 100, 10**9)]
    client, server, port = await connected(listener)
    server._file_sender.sendfile = sendfile
    try:
        client.send(subscribe(credit=100))
        await client.until(lambda: len(client.of(sp.Deliver)) == len(expected))
        assert [bytes(deliver.chunk) for deliver in client.of(sp.Deliver)] == expected
        assert server._file_sender.whole > 0
    finally:
        client.transport.loseConnection()
        await port.stopListening()


@pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "read-send"])
@pytest_twisted.ensureDeferred
async def test_a_client_that_stops_reading_gets_the_rest_in_order_once_it_reads(
    listener: Listener,  # noqa: F811 (the fixture imported above)
    sendfile: bool,
) -> None:
    """The socket fills: the transport holds the rest and pauses the listener; nothing is lost."""
    stream = await listener.fill("s", *[[b"%04d" % n + b"y" * CHUNK_BYTES] for n in range(60)])
    expected = [bytes(chunk.payload) for chunk in stream.read_chunks(0, 100, 10**9)]
    client, server, port = await connected(listener)
    server._file_sender.sendfile = sendfile
    try:
        client.send(subscribe(credit=0))
        await client.until(lambda: bool(client.of(sp.Response)))
        client.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        server_socket: Any = server.transport
        server_socket.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        client.transport.pauseProducing()  # no reading from here on
        server.paused = Deferred()
        client.send(sp.Credit(subscription_id=1, credit=60))
        await server.paused
        assert server._subscriptions[1].credit > 0  # stopped by the full socket, not the credit
        assert server._file_sender.whole < len(expected)
        client.transport.resumeProducing()
        await client.until(lambda: len(client.of(sp.Deliver)) == len(expected))
        assert [bytes(deliver.chunk) for deliver in client.of(sp.Deliver)] == expected
    finally:
        client.transport.loseConnection()
        await port.stopListening()
