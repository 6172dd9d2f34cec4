"""In-process tests of the stream listener: `gateway.protocols.stream.server` and `.bridge`.

Every connection is a `StreamServerProtocol` built by a `StreamServerFactory`
and attached to a `StringTransport` (peer 127.0.0.1, or another address where
loopback matters); the test speaks through our client codec. Server timers
(heartbeats, the close wait) run on a `Clock`. The log is the real one, in a
temporary directory: it commits in its writer thread and reports back through
the real reactor, so tests that append wait on Deferreds (the next frame the
server writes, or the log's own ``wait_for``); chunk timestamps come from a
second `Clock` given to the log. The behaviour checked is the one
docs/stream-protocol-notes.md describes (sections 3 to 9, 13 and 14).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.internal import FEED_REFERENCE_PREFIX, HOPS_HEADER
from gateway.core.log import FsyncPolicy, LogStore, StreamLog
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.bridge import StreamDestination, StreamRouteFeeds
from gateway.protocols.stream.mapping import entry_from_message, message_from_entry
from gateway.protocols.stream.server import (
    CLOSE_WAIT_SECONDS,
    COMMAND_VERSIONS,
    StreamServerFactory,
    StreamServerProtocol,
)
from gateway.protocols.stream.settings import DEFAULT_FRAME_MAX, StreamListenerSettings
from tests.doubles import NO_LOGIN_WAIT, deliver_each

LISTENER = "streams"
PORT = 5552
SECRETS = Secrets(logins={"alice": b"wonderland"})
GUEST = StreamListenerSettings(guest=True, heartbeat_seconds=0)
"""Guest allowed from loopback; no heartbeats unless a test asks for them."""
LOG_START_SECONDS = 1000.0


# --- test doubles and helpers ------------------------------------------------------------


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


class WatchedTransport(StringTransport):
    """A `StringTransport` that wakes a waiting test whenever something is written."""

    def __init__(self, peer: IPv4Address) -> None:
        super().__init__(
            hostAddress=IPv4Address("TCP", "127.0.0.1", PORT), peerAddress=peer, lenient=True
        )
        self._waiters: list[Deferred[None]] = []

    def write(self, data: bytes) -> None:
        """Buffer, then wake the waiters."""
        super().write(data)
        self._wake()

    def writeSequence(self, data: Sequence[bytes]) -> None:  # noqa: N802 (Twisted's name)
        """Buffer, then wake the waiters."""
        super().writeSequence(data)
        self._wake()

    def _wake(self) -> None:
        # On the next reactor turn: the test resumes once the server has
        # finished what it was doing, never inside one of its callbacks.
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _reactor().callLater(0, waiter.callback, None)

    def written(self) -> Deferred[None]:
        """Fire on the reactor turn after the next write."""
        waiter: Deferred[None] = Deferred()
        self._waiters.append(waiter)
        return waiter


class Peer:
    """One client connection: our client codec over a watched `StringTransport`."""

    def __init__(self, factory: StreamServerFactory, host: str = "127.0.0.1") -> None:
        address = IPv4Address("TCP", host, 40404)
        self.transport = WatchedTransport(address)
        self.protocol: StreamServerProtocol = factory.buildProtocol(address)
        self.protocol.makeConnection(self.transport)
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._events: list[sp.Event] = []
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """A fresh correlation id."""
        return next(self._ids)

    def send(self, *events: sp.Event) -> None:
        """Send frames in one read."""
        self.protocol.dataReceived(b"".join(self.codec.send(event) for event in events))

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.protocol.dataReceived(data)

    def _decode(self) -> None:
        data = self.transport.value()
        self.transport.clear()
        if data:
            self._events.extend(self.codec.receive_data(data))

    def frames(self) -> list[sp.Event]:
        """Every frame the server wrote that the test has not read yet."""
        self._decode()
        events, self._events = self._events, []
        return events

    async def next_frame(self) -> sp.Event:
        """The next frame, waiting for the server to write it."""
        self._decode()
        while not self._events:
            await self.transport.written()
            self._decode()
        return self._events.pop(0)

    def ask(self, event: sp.Event) -> sp.Event:
        """Send a request and return the one frame that answers it at once."""
        self.send(event)
        (answer,) = self.frames()
        return answer

    @property
    def closed(self) -> bool:
        """Whether the server closed the connection."""
        return bool(self.transport.disconnecting)

    def authenticate(self, user: bytes = b"guest", password: bytes = b"guest") -> list[sp.Event]:
        """Peer properties, SASL handshake and PLAIN; returns the server's frames."""
        self.send(
            sp.PeerProperties(correlation_id=self.next_id(), properties={"product": "test"}),
            sp.SaslHandshake(correlation_id=self.next_id()),
            sp.SaslAuthenticate(
                correlation_id=self.next_id(), mechanism="PLAIN", data=plain(user, password)
            ),
        )
        return self.frames()

    def open(self, *, frame_max: int = 0, heartbeat: int = 0, vhost: str = "/") -> sp.Event:
        """Authenticate as guest, answer Tune and Open; returns the OpenResponse."""
        self.authenticate()
        self.send(
            sp.Tune(frame_max=frame_max, heartbeat=heartbeat),
            sp.Open(correlation_id=self.next_id(), virtual_host=vhost),
        )
        (response,) = self.frames()
        return response

    def code(self, event: sp.Event) -> int:
        """Send a request answered by a plain `sp.Response`; return its code."""
        response = self.ask(event)
        assert isinstance(response, sp.Response)
        return response.code

    def lose(self) -> None:
        """The connection goes away (once)."""
        if self.transport.connected:
            self.transport.connected = False
            self.protocol.connectionLost(Failure(ConnectionDone()))


def plain(user: bytes, password: bytes) -> bytes:
    """SASL PLAIN data: NUL, user name, NUL, password."""
    return b"\0" + user + b"\0" + password


def frame(key: int, body: bytes = b"", version: int = 1) -> bytes:
    """A raw frame: size, key, version, body."""
    return struct.pack(">IHH", 4 + len(body), key, version) + body


@implementer(IDestination)
class RecordingDestination:
    """A route destination that accepts everything and lets the test await arrivals."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages: list[Message] = []
        self._waiters: list[tuple[int, Deferred[None]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Record the message; accepted."""
        self.messages.append(message)
        ready = [w for count, w in self._waiters if count <= len(self.messages)]
        self._waiters = [(c, w) for c, w in self._waiters if c > len(self.messages)]
        for waiter in ready:
            # On the next turn: the forwarder first finishes with the outcome.
            _reactor().callLater(0, waiter.callback, None)
        return succeed(Outcome.accepted())

    def received(self, count: int) -> Deferred[None]:
        """Fire (on a later reactor turn) once ``count`` messages arrived in all."""
        waiter: Deferred[None] = Deferred()
        if len(self.messages) >= count:
            _reactor().callLater(0, waiter.callback, None)
        else:
            self._waiters.append((count, waiter))
        return waiter


@attrs.define
class Listener:
    """A log, the clocks and the connections of one test."""

    store: LogStore
    log_clock: Clock
    clock: Clock = attrs.field(factory=Clock)
    peers: list[Peer] = attrs.field(factory=list)

    def factory(self, settings: StreamListenerSettings = GUEST) -> StreamServerFactory:
        """A listener factory over the log, advertising 127.0.0.1:5552."""
        factory = StreamServerFactory(
            name=LISTENER, settings=settings, store=self.store, secrets=SECRETS, clock=self.clock
        )
        factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits
        factory.listening_on(IPv4Address("TCP", "0.0.0.0", PORT))
        return factory

    def connect(self, factory: StreamServerFactory, host: str = "127.0.0.1") -> Peer:
        """A new connection to ``factory``."""
        peer = Peer(factory, host)
        self.peers.append(peer)
        return peer

    def opened(self, factory: StreamServerFactory | None = None) -> Peer:
        """A connection through the whole handshake."""
        peer = self.connect(factory or self.factory())
        response = peer.open()
        assert isinstance(response, sp.OpenResponse) and response.code == sp.ResponseCode.OK
        return peer

    async def fill(self, name: str, *chunks: list[bytes]) -> StreamLog:
        """Create a stream with one chunk per list, each 1000 s after the previous."""
        stream = self.store.get(name) or self.store.create(name)
        for messages in chunks:
            self.log_clock.advance(1000)
            await stream.append(messages)
        return stream


@pytest_twisted.async_yield_fixture
async def listener(tmp_path: Path) -> AsyncIterator[Listener]:
    """An open log in a temporary directory; closed (connections lost first) afterwards."""
    log_clock = Clock()
    log_clock.advance(LOG_START_SECONDS)
    store = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER, clock=log_clock)
    store.open()
    harness = Listener(store=store, log_clock=log_clock)
    yield harness
    for peer in harness.peers:
        peer.lose()
    await store.close()


def delivered(events: Sequence[sp.Event]) -> list[int]:
    """The chunk ids of the Deliver frames among ``events``."""
    return [
        osiris.ChunkHeader.unpack(bytes(event.chunk)).first_offset
        for event in events
        if isinstance(event, sp.Deliver)
    ]


def closes_with(events: Sequence[sp.Event]) -> int:
    """The code of the one server Close among ``events`` (correlation id 1)."""
    (close,) = events
    assert isinstance(close, sp.Close) and close.correlation_id == 1
    return close.code


def records(deliver: sp.Event) -> list[bytes]:
    """The messages a Deliver frame carries."""
    assert isinstance(deliver, sp.Deliver)
    data = bytes(deliver.chunk)[osiris.HEADER_BYTES :]
    return [bytes(message) for message in osiris.iter_entries(data)]


def subscribe(
    peer: Peer,
    stream: str,
    spec: sp.OffsetSpec,
    credit: int,
    subscription_id: int = 1,
    properties: dict[str, str] | None = None,
) -> sp.Subscribe:
    """A Subscribe request."""
    return sp.Subscribe(
        correlation_id=peer.next_id(),
        subscription_id=subscription_id,
        stream=stream,
        offset_spec=spec,
        credit=credit,
        properties={} if properties is None else properties,
    )


def declare(peer: Peer, publisher_id: int, stream: str, reference: str = "") -> sp.Event:
    """A DeclarePublisher request."""
    return sp.DeclarePublisher(
        correlation_id=peer.next_id(),
        publisher_id=publisher_id,
        reference=reference,
        stream=stream,
    )


def publish(publisher_id: int, ids: Sequence[int], messages: Sequence[bytes]) -> sp.Publish:
    """A Publish v1 frame."""
    return sp.Publish(publisher_id=publisher_id, publishing_ids=list(ids), messages=list(messages))


FIRST = sp.OffsetSpec(kind=sp.OffsetKind.FIRST)
LAST = sp.OffsetSpec(kind=sp.OffsetKind.LAST)
NEXT = sp.OffsetSpec(kind=sp.OffsetKind.NEXT)


# --- handshake ------------------------------------------------------------------------------


def test_protocol_provides_push_producer(listener: Listener) -> None:
    """The protocol is an IPushProducer, registered as the transport's streaming producer."""
    peer = listener.connect(listener.factory())
    assert verifyObject(IPushProducer, peer.protocol)
    assert peer.transport.producer is peer.protocol and peer.transport.streaming


def test_peer_properties(listener: Listener) -> None:
    """PeerProperties is answered OK with the server's product, version and cluster name."""
    peer = listener.connect(listener.factory())
    response = peer.ask(sp.PeerProperties(correlation_id=7, properties={"product": "x"}))
    assert isinstance(response, sp.PeerPropertiesResponse)
    assert (response.correlation_id, response.code) == (7, sp.ResponseCode.OK)
    assert response.properties["product"] == "msggateway"
    assert response.properties["cluster_name"] == LISTENER
    assert {"version", "platform", "copyright", "information"} <= set(response.properties)


@pytest.mark.parametrize(
    ("anonymous", "mechanisms"), [(False, ("PLAIN",)), (True, ("PLAIN", "ANONYMOUS"))]
)
def test_sasl_handshake_mechanisms(
    listener: Listener, anonymous: bool, mechanisms: tuple[str, ...]
) -> None:
    """SaslHandshake lists PLAIN, and ANONYMOUS only when it is enabled."""
    factory = listener.factory(StreamListenerSettings(anonymous=anonymous))
    peer = listener.connect(factory)
    response = peer.ask(sp.SaslHandshake(correlation_id=2))
    assert response == sp.SaslHandshakeResponse(
        correlation_id=2, code=sp.ResponseCode.OK, mechanisms=mechanisms
    )


def test_guest_from_loopback_then_tune(listener: Listener) -> None:
    """guest/guest from loopback is OK when enabled; the frame ends after the code; Tune follows."""
    factory = listener.factory(StreamListenerSettings(guest=True))
    peer = listener.connect(factory)
    peer.send(
        sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=plain(b"guest", b"guest"))
    )
    raw = peer.transport.value()
    assert raw.startswith(bytes.fromhex("0000000a 8013 0001 00000003 0001"))
    assert raw[14:] == bytes.fromhex("0000000c 0014 0001 00100000 0000003c")
    assert peer.frames() == [
        sp.SaslAuthenticateResponse(correlation_id=3, code=sp.ResponseCode.OK),
        sp.Tune(frame_max=DEFAULT_FRAME_MAX, heartbeat=60),
    ]
    assert peer.protocol.identity == "guest"
    assert not peer.closed


@pytest.mark.parametrize(
    ("settings", "host", "user", "password", "code"),
    [
        (GUEST, "10.1.2.3", b"guest", b"guest", 11),
        (StreamListenerSettings(), "127.0.0.1", b"guest", b"guest", 8),
        (GUEST, "127.0.0.1", b"guest", b"wrong", 8),
        (GUEST, "10.1.2.3", b"alice", b"wrong", 8),
        (GUEST, "10.1.2.3", b"mallory", b"wonderland", 8),
    ],
    ids=["guest-not-loopback", "guest-disabled", "guest-wrong", "wrong-password", "unknown-user"],
)  # fmt: skip
def test_plain_refused_then_closed(
    listener: Listener,
    settings: StreamListenerSettings,
    host: str,
    user: bytes,
    password: bytes,
    code: int,
) -> None:
    """Refused PLAIN logins get a code (11: guest off loopback, else 8), no Tune, and a close."""
    peer = listener.connect(listener.factory(settings), host)
    frames = peer.authenticate(user, password)
    assert frames[-1] == sp.SaslAuthenticateResponse(correlation_id=3, code=code)
    assert not any(isinstance(event, sp.Tune) for event in frames)
    assert peer.closed
    assert peer.protocol.identity is None


def test_secrets_file_user_from_anywhere(listener: Listener) -> None:
    """A user of the secrets file logs in with PLAIN from a non-loopback address."""
    peer = listener.connect(listener.factory(), "10.1.2.3")
    frames = peer.authenticate(b"alice", b"wonderland")
    assert frames[-2:] == [
        sp.SaslAuthenticateResponse(correlation_id=3, code=sp.ResponseCode.OK),
        sp.Tune(frame_max=DEFAULT_FRAME_MAX, heartbeat=0),
    ]
    assert peer.protocol.identity == "alice"


@pytest.mark.parametrize(("anonymous", "ok"), [(True, True), (False, False)])
def test_anonymous(listener: Listener, anonymous: bool, ok: bool) -> None:
    """ANONYMOUS logs in only when enabled; otherwise it is an unknown mechanism (7)."""
    peer = listener.connect(listener.factory(StreamListenerSettings(anonymous=anonymous)))
    peer.send(sp.SaslAuthenticate(correlation_id=1, mechanism="ANONYMOUS", data=None))
    frames = peer.frames()
    if ok:
        assert frames[0] == sp.SaslAuthenticateResponse(correlation_id=1, code=1)
        assert isinstance(frames[1], sp.Tune)
        assert peer.protocol.identity == "anonymous"
    else:
        assert frames == [sp.SaslAuthenticateResponse(correlation_id=1, code=7)]
        assert peer.closed


def test_unknown_mechanism(listener: Listener) -> None:
    """An unknown SASL mechanism is answered with code 7, and the connection closes."""
    peer = listener.connect(listener.factory())
    peer.send(sp.SaslAuthenticate(correlation_id=1, mechanism="EXTERNAL", data=b""))
    assert peer.frames() == [
        sp.SaslAuthenticateResponse(
            correlation_id=1, code=sp.ResponseCode.SASL_MECHANISM_NOT_SUPPORTED
        )
    ]
    assert peer.closed


def test_plain_without_two_nuls_is_a_sasl_error(listener: Listener) -> None:
    """PLAIN data that is not NUL user NUL password is a SASL error (9), then a close."""
    peer = listener.connect(listener.factory())
    peer.send(sp.SaslAuthenticate(correlation_id=1, mechanism="PLAIN", data=b"guestguest"))
    assert peer.frames() == [sp.SaslAuthenticateResponse(correlation_id=1, code=9)]
    assert peer.closed


def test_open_advertises_host_and_port(listener: Listener) -> None:
    """Open of "/" after the Tune reply is OK with advertised_host and advertised_port."""
    peer = listener.connect(listener.factory())
    response = peer.open()
    assert response == sp.OpenResponse(
        correlation_id=4,
        code=sp.ResponseCode.OK,
        properties={"advertised_host": "127.0.0.1", "advertised_port": str(PORT)},
    )


def test_open_advertises_configured_address(listener: Listener) -> None:
    """Configured advertised_host and advertised_port win over the bound address."""
    settings = StreamListenerSettings(
        guest=True, advertised_host="streams.example", advertised_port=1
    )
    peer = listener.connect(listener.factory(settings))
    response = peer.open()
    assert isinstance(response, sp.OpenResponse)
    assert response.properties == {"advertised_host": "streams.example", "advertised_port": "1"}


def test_open_unknown_vhost(listener: Listener) -> None:
    """Open of an unknown virtual host: code 12, the frame ends after the code, then a close."""
    peer = listener.connect(listener.factory())
    peer.authenticate()
    peer.send(sp.Tune(frame_max=0, heartbeat=0))
    peer.send(sp.Open(correlation_id=9, virtual_host="elsewhere"))
    assert peer.transport.value() == bytes.fromhex("0000000a 8015 0001 00000009 000c")
    assert peer.frames() == [sp.OpenResponse(correlation_id=9, code=12, properties=None)]
    assert peer.closed


def test_open_before_authentication_closes(listener: Listener) -> None:
    """Open without a successful authentication closes the connection without a frame."""
    peer = listener.connect(listener.factory())
    peer.send(sp.Open(correlation_id=1, virtual_host="/"))
    assert peer.transport.value() == b""
    assert peer.closed


@pytest.mark.parametrize("key", [sp.Key.TUNE, sp.Key.TUNE | sp.RESPONSE_BIT])
def test_tune_reply_keys_and_frame_max(listener: Listener, key: int) -> None:
    """The Tune reply is read as 0x0014 or 0x8014; its smaller frame_max applies after Open."""
    peer = listener.connect(listener.factory())
    peer.authenticate()
    peer.send_raw(frame(key, struct.pack(">II", 4096, 0)))
    assert peer.frames() == []
    response = peer.ask(sp.Open(correlation_id=5, virtual_host="/"))
    assert isinstance(response, sp.OpenResponse) and response.code == sp.ResponseCode.OK
    fits = peer.codec.send(publish(9, [1], [b"x" * (4096 - 21)]))
    assert len(fits) == 4 + 4096
    peer.send_raw(fits)
    assert peer.frames() == [
        sp.PublishError(publisher_id=9, publishing_ids=[1], codes=[18]),
    ]
    peer.send(publish(9, [1], [b"x" * (4096 - 20)]))
    assert closes_with(peer.frames()) == 14


def test_heartbeat_before_open(listener: Listener) -> None:
    """Heartbeats are accepted (and not answered) after the Tune reply, before Open."""
    peer = listener.connect(listener.factory())
    peer.authenticate()
    peer.send(sp.Tune(frame_max=0, heartbeat=0), sp.HEARTBEAT)
    peer.send(sp.HEARTBEAT)
    assert peer.frames() == []
    assert not peer.closed
    response = peer.ask(sp.Open(correlation_id=5, virtual_host="/"))
    assert isinstance(response, sp.OpenResponse) and response.code == sp.ResponseCode.OK


@pytest.mark.parametrize("stage", ["connected", "authenticated", "tuned"])
@pytest.mark.parametrize(
    "request_",
    [
        sp.Metadata(correlation_id=1, streams=("s1",)),
        sp.Create(correlation_id=1, stream="s1"),
        sp.DeclarePublisher(correlation_id=1, publisher_id=0, reference="", stream="s1"),
        sp.Route(correlation_id=1, routing_key="k", super_stream="s"),
        sp.Partitions(correlation_id=1, super_stream="s"),
        sp.ExchangeCommandVersions(correlation_id=1, versions=()),
        sp.CreateSuperStream(correlation_id=1, name="s", partitions=(), binding_keys=()),
        sp.StoreOffset(reference="c", stream="s1", offset=1),
    ],
    ids=lambda event: type(event).__name__,
)
def test_other_commands_before_open_close_silently(
    listener: Listener, stage: str, request_: sp.Event
) -> None:
    """Before Open only the handshake is read: anything else closes without a frame."""
    peer = listener.connect(listener.factory())
    if stage != "connected":
        peer.authenticate()
    if stage == "tuned":
        peer.send(sp.Tune(frame_max=0, heartbeat=0))
    peer.frames()
    peer.send(request_)
    assert peer.transport.value() == b""
    assert peer.closed
    assert listener.store.names() == []


def test_unknown_key_before_open_closes_silently(listener: Listener) -> None:
    """An unknown key before Open closes the connection without a frame."""
    peer = listener.connect(listener.factory())
    peer.send_raw(frame(0x0063, b"\0\0\0\1"))
    assert peer.transport.value() == b""
    assert peer.closed


def test_pre_open_frame_limit(listener: Listener) -> None:
    """Before Open a frame of 8192 bytes is read; one of 8193 closes the connection, no frame."""
    peer = listener.connect(listener.factory())
    base = len(peer.codec.send(sp.PeerProperties(correlation_id=1, properties={"k": ""}))) - 4
    filler = "v" * (8192 - base)
    peer.send(sp.PeerProperties(correlation_id=1, properties={"k": filler}))
    assert isinstance(peer.frames()[0], sp.PeerPropertiesResponse)
    big = peer.codec.send(
        sp.SaslAuthenticate(correlation_id=2, mechanism="PLAIN", data=b"\0guest\0" + b"g" * 9000)
    )
    peer.send_raw(big)
    assert peer.transport.value() == b""
    assert peer.closed


def test_frame_too_large_after_open_close_answered(listener: Listener) -> None:
    """After Open a frame over frame_max gets Close(1, 14); the client's answer ends it."""
    peer = listener.opened()
    peer.send_raw(struct.pack(">IHH", DEFAULT_FRAME_MAX + 1, sp.Key.PUBLISH, 1) + b"\0" * 100)
    assert closes_with(peer.frames()) == 14
    assert not peer.closed
    peer.send_raw(peer.codec.send(sp.CloseResponse(correlation_id=1, code=1)))
    assert peer.closed
    assert peer.frames() == []


def test_frame_too_large_after_open_close_wait(listener: Listener) -> None:
    """Without an answer to its Close, the server closes after the close wait."""
    peer = listener.opened()
    peer.send_raw(struct.pack(">IHH", DEFAULT_FRAME_MAX + 1, sp.Key.PUBLISH, 1))
    assert closes_with(peer.frames()) == 14
    listener.clock.advance(CLOSE_WAIT_SECONDS - 0.1)
    assert not peer.closed
    listener.clock.advance(0.1)
    assert peer.closed


def test_unknown_key_after_open(listener: Listener) -> None:
    """After Open an unknown key gets Close(1, 13, "unknown frame"); the answer closes."""
    peer = listener.opened()
    peer.send_raw(frame(0x0063, b"\0\0\0\1"))
    assert closes_with(peer.frames()) == 13
    assert not peer.closed
    peer.send(sp.CloseResponse(correlation_id=1, code=1))
    assert peer.closed


def test_bad_frame_reported_once(listener: Listener) -> None:
    """A bad frame is logged and counted once, however the client goes on before the close."""
    metrics = GatewayMetrics()
    factory = StreamServerFactory(
        name=LISTENER,
        settings=GUEST,
        store=listener.store,
        secrets=SECRETS,
        clock=listener.clock,
        metrics=metrics,
    )
    peer = listener.opened(factory)
    with capturedLogs() as events:
        peer.send_raw(frame(0x0063))
        assert closes_with(peer.frames()) == 13
        peer.send(sp.HEARTBEAT)
        peer.send(sp.CloseResponse(correlation_id=1, code=1))
    assert peer.closed
    warnings = [e for e in events if e["log_level"] == LogLevel.warn]
    assert [e["log_format"] for e in warnings] == ["{listener}: bad frame: {reason}"]
    counted = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": LISTENER, "kind": "unknown-frame"}
    )
    assert counted == 1


def test_client_close(listener: Listener) -> None:
    """A client's Close is answered OK and the connection closes."""
    peer = listener.opened()
    assert peer.ask(sp.Close(correlation_id=8, code=1, reason="OK")) == sp.CloseResponse(
        correlation_id=8, code=1
    )
    assert peer.closed


# --- heartbeats --------------------------------------------------------------------------


def test_heartbeats_sent_when_idle_and_silence_closes(listener: Listener) -> None:
    """With a tuned heartbeat, idle servers send Heartbeats; two silent intervals abort."""
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    response = peer.open(heartbeat=10)
    assert isinstance(response, sp.OpenResponse)
    heartbeats = 0
    for _ in range(3):  # up to 15 s
        listener.clock.advance(5)
        heartbeats += sum(isinstance(e, sp.Heartbeat) for e in peer.frames())
    assert heartbeats >= 2
    assert not peer.closed
    listener.clock.advance(4.9)
    assert not peer.closed
    listener.clock.advance(0.1)  # 20 s without a frame from the client
    assert peer.closed
    assert peer.transport.disconnected  # aborted: a peer given up on keeps nothing unwritten


def test_a_client_sending_no_heartbeats_is_aborted_when_the_log_says(listener: Listener) -> None:
    """Tuned to 60 s, then silent after Open: open at 119.5 s, aborted at 120 s, logged as 120 s.

    Not at the next once-an-interval check (180 s), as RabbitMQ would.
    """
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    peer.open(heartbeat=60)
    with capturedLogs() as events:
        listener.clock.advance(119.5)
        assert not peer.closed
        listener.clock.advance(0.5)
    assert peer.transport.disconnected
    (logged,) = [event for event in events if "heartbeat" in event]
    assert (logged["seconds"], logged["heartbeat"]) == (120, 60)


def test_silence_counts_from_the_last_read(listener: Listener) -> None:
    """A Heartbeat at 45 s moves the abort to 165 s exactly."""
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    peer.open(heartbeat=60)
    listener.clock.advance(45)
    peer.send(sp.HEARTBEAT)
    listener.clock.advance(119.5)
    assert not peer.closed
    listener.clock.advance(0.5)
    assert peer.transport.disconnected


def test_a_second_tune_replaces_the_heartbeat_timers(listener: Listener) -> None:
    """Tune again: its interval applies, and the first one's timers are gone."""
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    peer.open(heartbeat=10)
    timers = len(listener.clock.getDelayedCalls())
    peer.send(sp.Tune(frame_max=0, heartbeat=30))
    assert len(listener.clock.getDelayedCalls()) == timers
    listener.clock.advance(59.5)
    assert not peer.closed
    listener.clock.advance(0.5)
    assert peer.transport.disconnected


def test_client_heartbeats_keep_the_connection(listener: Listener) -> None:
    """A client that sends a Heartbeat every interval stays connected."""
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    peer.open(heartbeat=10)
    for _ in range(12):
        listener.clock.advance(10)
        peer.send(sp.HEARTBEAT)
    assert not peer.closed


def test_no_heartbeat_when_tuned_off(listener: Listener) -> None:
    """A Tune reply with heartbeat 0 means no heartbeats and no liveness check."""
    peer = listener.opened()
    listener.clock.advance(3600)
    assert peer.frames() == []
    assert not peer.closed


def test_connection_lost_cancels_timers(listener: Listener) -> None:
    """Losing the connection stops the heartbeat timers."""
    peer = listener.connect(listener.factory(StreamListenerSettings(guest=True)))
    peer.open(heartbeat=10)
    assert listener.clock.getDelayedCalls()
    peer.lose()
    assert listener.clock.getDelayedCalls() == []


# --- half-sent frames (issue 18) ---------------------------------------------------------------


def _counting_factory(listener: Listener) -> tuple[StreamServerFactory, GatewayMetrics]:
    """A listener factory with metrics, a frame time-out of 30 s (the default)."""
    metrics = GatewayMetrics()
    factory = StreamServerFactory(
        name=LISTENER,
        settings=GUEST,
        store=listener.store,
        secrets=SECRETS,
        clock=listener.clock,
        metrics=metrics,
    )
    factory.listening_on(IPv4Address("TCP", "0.0.0.0", PORT))
    return factory, metrics


def test_a_half_sent_frame_after_open_is_aborted(listener: Listener) -> None:
    """Heartbeat 0 and 8 bytes of a 1,000-byte frame: aborted 30 s later, counted and logged.

    Issue 18: such a client was still connected after 155 s.
    """
    factory, metrics = _counting_factory(listener)
    peer = listener.opened(factory)
    whole = frame(sp.Key.PUBLISH, b"x" * 996)
    assert len(whole) == 4 + 1000
    with capturedLogs() as events:
        peer.send_raw(whole[:8])
        listener.clock.advance(29.9)
        assert not peer.closed
        listener.clock.advance(0.1)
    assert peer.transport.disconnected  # aborted: it sent nothing complete
    counted = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": LISTENER, "kind": "frame-timeout"}
    )
    assert counted == 1
    assert [event["held"] for event in events if "held" in event] == [8]


def test_a_client_without_heartbeats_may_stay_quiet_between_frames(listener: Listener) -> None:
    """As RabbitMQ allows: heartbeat 0, a frame completed in time, then silence: still open."""
    factory, _ = _counting_factory(listener)
    peer = listener.opened(factory)
    request = peer.codec.send(sp.Metadata(correlation_id=peer.next_id(), streams=("s",)))
    peer.send_raw(request[:5])
    listener.clock.advance(29)
    peer.send_raw(request[5:])
    assert isinstance(peer.frames()[0], sp.MetadataResponse)
    listener.clock.advance(3600)
    assert not peer.closed


def test_the_frame_time_out_is_the_listeners(listener: Listener) -> None:
    """``frame_timeout_seconds`` from the listener's config: here 2 s."""
    factory, _ = _counting_factory(listener)
    factory.frame_timeout_seconds = 2
    peer = listener.opened(factory)
    peer.send_raw(b"\0\0")
    listener.clock.advance(2)
    assert peer.transport.disconnected


# --- streams -------------------------------------------------------------------------------


def test_create_and_exists(listener: Listener) -> None:
    """Create makes the stream (and tells the listener); creating it again is code 5."""
    factory = listener.factory()
    created: list[str] = []
    factory.on_stream_created.append(created.append)
    peer = listener.opened(factory)
    assert peer.code(sp.Create(correlation_id=peer.next_id(), stream="s1")) == 1
    assert listener.store.names() == ["s1"]
    assert created == ["s1"]
    assert peer.code(sp.Create(correlation_id=peer.next_id(), stream="s1")) == 5
    assert created == ["s1"]


@pytest.mark.parametrize("name", ["", "amq.stream", "\r\n", "amq.x\r\n"])
def test_create_bad_names(listener: Listener, name: str) -> None:
    """An empty name or one starting with "amq." is a precondition failure (17)."""
    peer = listener.opened()
    assert peer.code(sp.Create(correlation_id=peer.next_id(), stream=name)) == 17
    assert listener.store.names() == []


@pytest.mark.parametrize(
    ("arguments", "max_bytes", "max_age"),
    [
        ({}, None, None),
        ({"max-length-bytes": "1000"}, 1000, None),
        ({"max-age": "7D"}, None, 7 * 86400),
        ({"max-age": "1h", "max-length-bytes": "20000000"}, 20_000_000, 3600),
        ({"max-age": "30s", "queue-leader-locator": "balanced"}, None, 30),
    ],
)
def test_create_arguments_to_retention(
    listener: Listener, arguments: dict[str, str], max_bytes: int | None, max_age: int | None
) -> None:
    """Create arguments max-length-bytes and max-age become the stream's retention."""
    peer = listener.opened()
    request = sp.Create(correlation_id=peer.next_id(), stream="s1", arguments=arguments)
    assert peer.code(request) == 1
    stream = listener.store.get("s1")
    assert stream is not None
    assert (stream.retention.max_bytes, stream.retention.max_age_seconds) == (max_bytes, max_age)


def test_create_segment_size_argument(listener: Listener) -> None:
    """stream-max-segment-size-bytes sets the segment size."""
    peer = listener.opened()
    arguments = {"stream-max-segment-size-bytes": "500000"}
    assert peer.code(sp.Create(correlation_id=2, stream="s1", arguments=arguments)) == 1
    stream = listener.store.get("s1")
    assert stream is not None and stream.retention.max_segment_bytes == 500000


@pytest.mark.parametrize(
    "arguments",
    [
        {"max-length-bytes": "lots"},
        {"max-length-bytes": "-1"},
        {"max-length-bytes": "0"},
        {"max-age": "7"},
        {"max-age": "7X"},
        {"max-age": "D"},
        {"max-age": "-1h"},
        {"stream-max-segment-size-bytes": str(2**40)},
    ],
)
def test_create_bad_arguments(listener: Listener, arguments: dict[str, str]) -> None:
    """Arguments that cannot be understood are code 17 and nothing is created."""
    peer = listener.opened()
    assert peer.code(sp.Create(correlation_id=2, stream="s1", arguments=arguments)) == 17
    assert listener.store.names() == []


@pytest_twisted.ensureDeferred
async def test_delete_tells_users_of_the_stream(listener: Listener) -> None:
    """Delete is OK (2 when missing); connections publishing or consuming get MetadataUpdate 6."""
    await listener.fill("s1", [b"a"])
    listener.store.create("s2")
    factory = listener.factory()
    publisher, consumer, bystander, admin = (listener.opened(factory) for _ in range(4))
    assert publisher.code(declare(publisher, 1, "s1")) == 1
    assert consumer.code(subscribe(consumer, "s1", NEXT, 10)) == 1
    assert bystander.code(declare(bystander, 1, "s2")) == 1
    assert admin.code(sp.Delete(correlation_id=7, stream="s1")) == 1
    assert listener.store.names() == ["s2"]
    update = sp.MetadataUpdate(code=6, stream="s1")
    assert publisher.frames() == [update]
    assert consumer.frames() == [update]
    assert bystander.frames() == []
    # The publisher and the subscription are gone with the stream.
    publisher.send(publish(1, [1], [b"x"]))
    assert publisher.frames() == [sp.PublishError(publisher_id=1, publishing_ids=[1], codes=[18])]
    consumer.send(sp.Credit(subscription_id=1, credit=1))
    assert consumer.frames() == [sp.CreditResponse(code=4, subscription_id=1)]
    assert admin.code(sp.Delete(correlation_id=8, stream="s1")) == 2


def test_metadata(listener: Listener) -> None:
    """Metadata lists the advertised broker; known streams lead on it, missing ones are code 2."""
    listener.store.create("s1")
    settings = StreamListenerSettings(guest=True, advertised_host="localhost")
    peer = listener.opened(listener.factory(settings))
    peer.send(sp.Metadata(correlation_id=10, streams=("s1",)))
    assert peer.transport.value() == bytes.fromhex(
        "0000002d 800f 0001 0000000a 00000001 0000 0009 6c6f63616c686f7374 000015b0"
        " 00000001 0002 7331 0001 0000 00000000"
    )
    peer.frames()
    response = peer.ask(sp.Metadata(correlation_id=11, streams=("s1", "nope")))
    assert response == sp.MetadataResponse(
        correlation_id=11,
        brokers=(sp.Broker(reference=0, host="localhost", port=PORT),),
        streams=(
            sp.StreamMetadata(stream="s1", code=1, leader=0, replicas=()),
            sp.StreamMetadata(stream="nope", code=2, leader=sp.NO_LEADER, replicas=()),
        ),
    )


@pytest_twisted.ensureDeferred
async def test_stream_stats(listener: Listener) -> None:
    """StreamStats: -1 everywhere for an empty stream, chunk ids once written, 2 when missing."""
    peer = listener.opened()
    stream = await listener.fill("s1")
    empty = {"committed_chunk_id": -1, "first_chunk_id": -1, "last_chunk_id": -1}
    assert peer.ask(sp.StreamStats(correlation_id=1, stream="s1")) == sp.StreamStatsResponse(
        correlation_id=1, code=1, statistics=empty
    )
    await listener.fill("s1", [b"a", b"b"], [b"c"])
    assert stream.last_chunk_id == 2
    stats = {"committed_chunk_id": 2, "first_chunk_id": 0, "last_chunk_id": 2}
    assert peer.ask(sp.StreamStats(correlation_id=2, stream="s1")) == sp.StreamStatsResponse(
        correlation_id=2, code=1, statistics=stats
    )
    assert peer.ask(sp.StreamStats(correlation_id=3, stream="nope")) == sp.StreamStatsResponse(
        correlation_id=3, code=2, statistics={}
    )


def test_exchange_command_versions(listener: Listener) -> None:
    """ExchangeCommandVersions answers the reference list, publish (1..2) second."""
    peer = listener.opened()
    ours = (sp.CommandVersion(key=8, min_version=1, max_version=2),)
    response = peer.ask(sp.ExchangeCommandVersions(correlation_id=12, versions=ours))
    assert isinstance(response, sp.ExchangeCommandVersionsResponse)
    assert response.code == 1
    assert response.versions[1] == sp.CommandVersion(key=2, min_version=1, max_version=2)
    keys = [(v.key, v.min_version, v.max_version) for v in response.versions]
    assert keys == list(COMMAND_VERSIONS)
    assert [k for k, _, _ in keys] == [
        1, 2, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 22, 23, 24, 25, 28, 29, 30, 31,
    ]  # fmt: skip


def test_super_stream_commands_answered(listener: Listener) -> None:
    """Route and Partitions answer code 2 with no streams; super stream changes are refused (17)."""
    peer = listener.opened()
    assert peer.ask(sp.Route(correlation_id=1, routing_key="k", super_stream="ss")) == (
        sp.RouteResponse(correlation_id=1, code=2, streams=())
    )
    assert peer.ask(sp.Partitions(correlation_id=2, super_stream="ss")) == (
        sp.PartitionsResponse(correlation_id=2, code=2, streams=())
    )
    create = sp.CreateSuperStream(
        correlation_id=3, name="ss", partitions=("ss-0",), binding_keys=("0",)
    )
    assert peer.ask(create) == sp.Response(
        key=sp.Key.CREATE_SUPER_STREAM, correlation_id=3, code=17
    )
    assert peer.ask(sp.DeleteSuperStream(correlation_id=4, name="ss")) == sp.Response(
        key=sp.Key.DELETE_SUPER_STREAM, correlation_id=4, code=17
    )
    assert listener.store.names() == []


# --- publishing ------------------------------------------------------------------------------


def test_declare_publisher_checks(listener: Listener) -> None:
    """DeclarePublisher: OK; id taken 17; (stream, reference) taken 17; missing stream 2."""
    listener.store.create("s1")
    listener.store.create("s2")
    peer = listener.opened()
    other = listener.opened()
    assert peer.code(declare(peer, 1, "s1", "ref")) == 1
    assert peer.code(declare(peer, 1, "s2")) == 17
    assert peer.code(declare(peer, 2, "s1", "ref")) == 17
    assert peer.code(declare(peer, 2, "s2", "ref")) == 1
    assert peer.code(declare(peer, 3, "s1")) == 1
    assert peer.code(declare(peer, 4, "s1")) == 1  # no reference: no uniqueness
    assert peer.code(declare(peer, 5, "nope")) == 2
    assert other.code(declare(other, 1, "s1", "ref")) == 1  # per connection


def test_declare_publisher_reference_length(listener: Listener) -> None:
    """A reference of 255 bytes is fine; 256 bytes is code 17."""
    listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 1, "s1", "r" * 255)) == 1
    assert peer.code(declare(peer, 2, "s1", "r" * 256)) == 17


def test_declare_publisher_limit(listener: Listener) -> None:
    """256 publishers per connection; the next is refused (17) until one is deleted."""
    listener.store.create("s1")
    peer = listener.opened()
    for publisher_id in range(256):
        assert peer.code(declare(peer, publisher_id, "s1")) == 1
    assert peer.code(declare(peer, 7, "s1")) == 17
    assert peer.code(sp.DeletePublisher(correlation_id=1, publisher_id=7)) == 1
    assert peer.code(declare(peer, 7, "s1")) == 1


def test_delete_publisher(listener: Listener) -> None:
    """DeletePublisher is OK for a declared publisher and 18 for an unknown one."""
    listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 1, "s1")) == 1
    assert peer.code(sp.DeletePublisher(correlation_id=5, publisher_id=1)) == 1
    assert peer.code(sp.DeletePublisher(correlation_id=6, publisher_id=1)) == 18
    peer.send(publish(1, [1], [b"x"]))
    assert peer.frames() == [sp.PublishError(publisher_id=1, publishing_ids=[1], codes=[18])]


@pytest_twisted.ensureDeferred
async def test_publish_confirmed_after_commit(listener: Listener) -> None:
    """Publish is confirmed only once the log committed the messages, which are then readable."""
    stream = listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 3, "s1")) == 1
    peer.send(publish(3, [1, 2], [b"one", b"two"]), publish(3, [3], [b"three"]))
    assert peer.frames() == []
    assert stream.next_offset == 0
    confirms = [await peer.next_frame(), await peer.next_frame()]
    assert confirms == [
        sp.PublishConfirm(publisher_id=3, publishing_ids=[1, 2]),
        sp.PublishConfirm(publisher_id=3, publishing_ids=[3]),
    ]
    assert stream.next_offset == 3
    (chunk,) = stream.read_chunks(0, 10, 1 << 20)
    data = chunk.payload[osiris.HEADER_BYTES :]
    assert [bytes(m) for m in osiris.iter_entries(data)] == [b"one", b"two", b"three"]


@pytest_twisted.ensureDeferred
async def test_sub_batch_publish_is_stored_whole(listener: Listener) -> None:
    """Sub-batch entries (plain and gzip) are confirmed, stored as sent, one offset per record."""
    stream = listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 1, "s1")) == 1
    plain = osiris.encode_sub_batch([b"r1", b"r2", b"r3"])
    gzipped = osiris.encode_sub_batch([b"g1", b"g2"], compression=osiris.COMPRESSION_GZIP)
    peer.send(
        sp.Publish(
            publisher_id=1,
            publishing_ids=[1, 2, 3],
            messages=[plain, b"simple", gzipped],
            sub_batches=[True, False, True],
        )
    )
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 2, 3])
    assert stream.next_offset == 6
    (chunk,) = stream.read_chunks(0, 10, 1 << 20)
    data = chunk.payload[osiris.HEADER_BYTES :]
    assert data == b"".join((plain, b"\0\0\0\x06simple", gzipped))
    assert [bytes(m) for m in osiris.iter_entries(data)] == [
        b"r1", b"r2", b"r3", b"simple", b"g1", b"g2"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "records", "why"),
    [(0x80 | 2 << 4, 1, "compression type 2"), (0x80, 0, "no records")],
)
def test_sub_batch_publish_refused(listener: Listener, flags: int, records: int, why: str) -> None:
    """A compression the gateway cannot read (snappy) or an empty sub-batch: PublishError 17."""
    stream = listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 1, "s1")) == 1
    body = b"\0\0\0\x01x" * records
    batch = struct.pack(">BHII", flags, records, len(body), len(body)) + body
    with capturedLogs() as events:
        peer.send(
            sp.Publish(
                publisher_id=1,
                publishing_ids=[1, 2],
                messages=[b"ok", batch],
                sub_batches=[False, True],
            )
        )
    assert peer.frames() == [sp.PublishError(publisher_id=1, publishing_ids=[1, 2], codes=[17, 17])]
    assert any(why in str(event.get("reason")) for event in events)
    assert stream.read_chunks(0, 10, 1 << 20) == []


def test_publish_unknown_publisher(listener: Listener) -> None:
    """Publishing with an undeclared publisher id: one PublishError 18 listing every id."""
    peer = listener.opened()
    peer.send(publish(4, [10, 11, 12], [b"a", b"b", b"c"]))
    assert peer.frames() == [
        sp.PublishError(publisher_id=4, publishing_ids=[10, 11, 12], codes=[18, 18, 18])
    ]


def test_publish_to_deleted_stream(listener: Listener) -> None:
    """Messages not yet committed when their stream is deleted get PublishError 2."""
    listener.store.create("s1")
    factory = listener.factory()
    peer = listener.opened(factory)
    admin = listener.opened(factory)
    assert peer.code(declare(peer, 1, "s1")) == 1
    peer.send(publish(1, [1, 2], [b"a", b"b"]))
    assert admin.code(sp.Delete(correlation_id=2, stream="s1")) == 1
    assert peer.frames() == [
        sp.PublishError(publisher_id=1, publishing_ids=[1, 2], codes=[2, 2]),
        sp.MetadataUpdate(code=6, stream="s1"),
    ]


@pytest_twisted.ensureDeferred
async def test_deduplication_by_reference(listener: Listener) -> None:
    """With a reference, ids seen before are confirmed again but stored once."""
    stream = listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(declare(peer, 1, "s1", "producer-a")) == 1
    query = sp.QueryPublisherSequence(correlation_id=2, reference="producer-a", stream="s1")
    assert peer.ask(query) == sp.QueryPublisherSequenceResponse(
        correlation_id=2, code=1, sequence=0
    )
    peer.send(publish(1, [1, 2], [b"a", b"b"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 2])
    peer.send(publish(1, [1, 2], [b"a", b"b"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 2])
    peer.send(publish(1, [2, 3], [b"b", b"c"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[2, 3])
    messages = [
        bytes(m)
        for chunk in stream.read_chunks(0, 10, 1 << 20)
        for m in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])
    ]
    assert messages == [b"a", b"b", b"c"]
    assert peer.ask(query) == sp.QueryPublisherSequenceResponse(
        correlation_id=2, code=1, sequence=3
    )
    # Another connection sees the same sequence for the reference.
    other = listener.opened()
    assert other.ask(query) == sp.QueryPublisherSequenceResponse(
        correlation_id=2, code=1, sequence=3
    )


def test_query_publisher_sequence_unknown(listener: Listener) -> None:
    """An unknown reference is OK with sequence 0; a missing stream is code 2."""
    listener.store.create("s1")
    peer = listener.opened()
    assert peer.ask(
        sp.QueryPublisherSequence(correlation_id=1, reference="nobody", stream="s1")
    ) == sp.QueryPublisherSequenceResponse(correlation_id=1, code=1, sequence=0)
    assert peer.ask(
        sp.QueryPublisherSequence(correlation_id=2, reference="nobody", stream="nope")
    ) == sp.QueryPublisherSequenceResponse(correlation_id=2, code=2, sequence=0)


@pytest_twisted.ensureDeferred
async def test_flow_control_pauses_reading(listener: Listener) -> None:
    """More than max_unconfirmed unconfirmed messages pause reading until confirms arrive."""
    listener.store.create("s1")
    settings = StreamListenerSettings(guest=True, heartbeat_seconds=0, max_unconfirmed=4)
    peer = listener.opened(listener.factory(settings))
    assert peer.code(declare(peer, 1, "s1")) == 1
    peer.send(publish(1, [1, 2, 3, 4], [b"m"] * 4))
    assert peer.transport.producerState == "producing"  # 4 is not more than 4
    peer.send(publish(1, [5], [b"m"]))
    assert peer.transport.producerState == "paused"
    assert peer.frames() == []
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 2, 3, 4])
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[5])
    assert peer.transport.producerState == "producing"


# --- consuming ----------------------------------------------------------------------------------


async def three_chunks(listener: Listener) -> StreamLog:
    """Stream s1: chunks 0 (2 records, t=2000 s), 2 (1, t=3000 s), 3 (3, t=4000 s)."""
    return await listener.fill("s1", [b"a0", b"a1"], [b"b0"], [b"c0", b"c1", b"c2"])


@pytest.mark.parametrize(
    ("spec", "chunks"),
    [
        (FIRST, [0, 2, 3]),
        (LAST, [3]),
        (NEXT, []),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=0), [0, 2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=1), [0, 2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=2), [2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=5), [3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=99), []),
        (sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=0), [0, 2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=2_500_000), [2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=3_000_000), [2, 3]),
        (sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=4_000_001), []),
    ],
    ids=[
        "first", "last", "next", "offset-0", "offset-1", "offset-2", "offset-5", "offset-99",
        "timestamp-0", "timestamp-between", "timestamp-exact", "timestamp-after",
    ],
)  # fmt: skip
@pytest_twisted.ensureDeferred
async def test_subscribe_offset_specs(
    listener: Listener, spec: sp.OffsetSpec, chunks: list[int]
) -> None:
    """Each offset spec starts at the right chunk; new chunks follow as they are committed."""
    await three_chunks(listener)
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", spec, credit=10))
    frames = peer.frames()
    assert frames[0] == sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=5, code=1)
    assert delivered(frames[1:]) == chunks
    assert len(frames) == 1 + len(chunks)
    await listener.fill("s1", [b"d0"])
    new = await peer.next_frame()
    assert delivered([new]) == [6]
    assert records(new) == [b"d0"]


@pytest_twisted.ensureDeferred
async def test_one_deliver_per_credit(listener: Listener) -> None:
    """One Deliver per credit: nothing without credit, Credit resumes where it stopped."""
    await three_chunks(listener)
    peer = listener.opened()
    assert peer.ask(subscribe(peer, "s1", FIRST, credit=0)) == sp.Response(
        key=sp.Key.SUBSCRIBE, correlation_id=5, code=1
    )
    peer.send(sp.Credit(subscription_id=1, credit=1))
    first = peer.frames()
    assert delivered(first) == [0]
    assert records(first[0]) == [b"a0", b"a1"]
    peer.send(sp.Credit(subscription_id=1, credit=1))
    assert delivered(peer.frames()) == [2]
    peer.send(sp.Credit(subscription_id=1, credit=3))
    assert delivered(peer.frames()) == [3]  # the end: two credits left
    await listener.fill("s1", [b"d"])
    assert delivered([await peer.next_frame()]) == [6]
    await listener.fill("s1", [b"e"])
    assert delivered([await peer.next_frame()]) == [7]
    await listener.fill("s1", [b"f"])  # no credit left
    assert peer.frames() == []
    peer.send(sp.Credit(subscription_id=1, credit=1))
    assert delivered(peer.frames()) == [8]


@pytest_twisted.ensureDeferred
async def test_deliver_is_the_stored_chunk(listener: Listener) -> None:
    """A Deliver carries the stored 48-byte header then the data entries only, byte for byte."""
    stream = listener.store.create("s1")
    await stream.append([b"x", b"yy"], reference="producer", publishing_ids=[1, 2])
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", FIRST, credit=1, subscription_id=9))
    response = bytes.fromhex("0000000a 8007 0001 00000005 0001")
    raw = peer.transport.value()
    assert raw.startswith(response)
    raw = raw[len(response) :]
    segment = stream.segments[0]
    stored = segment.segment_path.read_bytes()
    position = segment.positions[0]
    header = osiris.ChunkHeader.unpack(stored, position)
    assert header.trailer_length > 0  # the reference's sequence, never sent
    start = position + header.data_start
    expected = (
        stored[position : position + osiris.HEADER_BYTES]
        + stored[start : start + header.data_length]
    )
    assert raw[:9] == struct.pack(">IHHB", 5 + len(expected), sp.Key.DELIVER, 1, 9)
    assert raw[9:] == expected
    (_, deliver) = peer.frames()
    assert isinstance(deliver, sp.Deliver) and deliver.subscription_id == 9
    chunk = bytes(deliver.chunk)
    parsed = osiris.ChunkHeader.unpack(chunk)
    data = chunk[osiris.HEADER_BYTES :]
    assert parsed == header
    assert parsed.chunk_type == osiris.USER
    assert parsed.data_length == len(data)
    assert parsed.crc == zlib.crc32(data)
    assert (parsed.num_entries, parsed.num_records, parsed.first_offset) == (2, 2, 0)
    assert parsed.timestamp == int((LOG_START_SECONDS) * 1000)
    assert [bytes(m) for m in osiris.iter_entries(data)] == [b"x", b"yy"]


@pytest_twisted.ensureDeferred
async def test_subscribe_skips_tracking_chunks(listener: Listener) -> None:
    """Stored offsets make tracking chunks; subscribers only ever get user chunks."""
    stream = await listener.fill("s1", [b"a"])
    other = listener.store.create("other")
    stream.store_offset("consumer", 0)
    await other.append([b"x"])  # the same commit: the offset alone makes a tracking chunk
    assert stream.next_offset == 2
    await listener.fill("s1", [b"b"])
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", FIRST, credit=10))
    frames = peer.frames()[1:]
    assert [records(f) for f in frames] == [[b"a"], [b"b"]]
    assert delivered(frames) == [0, 2]


def test_credit_unknown_subscription(listener: Listener) -> None:
    """Credit for an unknown subscription gets CreditResponse code 4 (no correlation id)."""
    peer = listener.opened()
    peer.send(sp.Credit(subscription_id=42, credit=1))
    assert peer.transport.value() == bytes.fromhex("00000007 8009 0001 0004 2a")
    assert peer.frames() == [sp.CreditResponse(code=4, subscription_id=42)]


@pytest_twisted.ensureDeferred
async def test_unsubscribe(listener: Listener) -> None:
    """Unsubscribe is OK, then 4; an unsubscribed tail gets nothing more."""
    await three_chunks(listener)
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", NEXT, credit=5))
    peer.frames()
    unsubscribe = sp.Unsubscribe(correlation_id=20, subscription_id=1)
    assert peer.ask(unsubscribe) == sp.Response(key=sp.Key.UNSUBSCRIBE, correlation_id=20, code=1)
    assert peer.ask(unsubscribe) == sp.Response(key=sp.Key.UNSUBSCRIBE, correlation_id=20, code=4)
    stream = await listener.fill("s1", [b"late"])
    await stream.wait_for(6)
    assert peer.frames() == []


def test_subscribe_refusals(listener: Listener) -> None:
    """Subscribe: id in use 3, missing stream 2, single active consumer and super streams 17."""
    listener.store.create("s1")
    peer = listener.opened()
    assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=1)) == 1
    assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=1)) == 3
    assert peer.code(subscribe(peer, "nope", NEXT, 1, subscription_id=2)) == 2
    sac = {"single-active-consumer": "true", "name": "group"}
    assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=3, properties=sac)) == 17
    sup = {"super-stream": "ss"}
    assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=4, properties=sup)) == 17
    assert (
        peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=5, properties={"name": "c"})) == 1
    )


def test_subscription_limit(listener: Listener) -> None:
    """256 subscriptions per connection; another is refused."""
    listener.store.create("s1")
    peer = listener.opened()
    for subscription_id in range(256):
        assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=subscription_id)) == 1
    assert peer.code(subscribe(peer, "s1", NEXT, 1, subscription_id=0)) == 17


@pytest_twisted.ensureDeferred
async def test_congestion_pauses_deliveries(listener: Listener) -> None:
    """While the transport is congested nothing is delivered; resuming delivers under credit."""
    await three_chunks(listener)
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", FIRST, credit=0))
    peer.frames()
    peer.protocol.pauseProducing()
    assert peer.transport.producerState == "paused"
    peer.send(sp.Credit(subscription_id=1, credit=2))
    assert peer.frames() == []
    peer.protocol.resumeProducing()
    assert peer.transport.producerState == "producing"
    assert delivered(peer.frames()) == [0, 2]


@pytest_twisted.ensureDeferred
async def test_congestion_holds_new_chunks_of_a_tail(listener: Listener) -> None:
    """A chunk committed while the client is congested waits for resumeProducing."""
    stream = await three_chunks(listener)
    peer = listener.opened()
    peer.send(subscribe(peer, "s1", NEXT, credit=5))
    peer.frames()
    peer.protocol.pauseProducing()
    committed = stream.wait_for(6)  # registered after the subscription's own wait
    await listener.fill("s1", [b"new"])
    await committed
    assert peer.frames() == []
    peer.protocol.resumeProducing()
    frames = peer.frames()
    assert delivered(frames) == [6]
    assert records(frames[0]) == [b"new"]


# --- offsets ----------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_store_and_query_offset(listener: Listener) -> None:
    """StoreOffset is never answered; QueryOffset returns it, before and after the commit."""
    stream = await listener.fill("s1", [b"a"])
    peer = listener.opened()
    peer.send(sp.StoreOffset(reference="consumer", stream="s1", offset=42))
    assert peer.frames() == []
    query = sp.QueryOffset(correlation_id=3, reference="consumer", stream="s1")
    assert peer.ask(query) == sp.QueryOffsetResponse(correlation_id=3, code=1, offset=42)
    await listener.fill("s1", [b"b"])  # the offset is committed with (or before) this chunk
    assert stream.query_offset("consumer") == 42
    assert peer.ask(query) == sp.QueryOffsetResponse(correlation_id=3, code=1, offset=42)


def test_query_offset_never_stored(listener: Listener) -> None:
    """QueryOffset without a stored offset is code 19 with 0; a missing stream is code 2."""
    listener.store.create("s1")
    peer = listener.opened()
    assert peer.ask(
        sp.QueryOffset(correlation_id=1, reference="consumer", stream="s1")
    ) == sp.QueryOffsetResponse(correlation_id=1, code=19, offset=0)
    assert peer.ask(
        sp.QueryOffset(correlation_id=2, reference="consumer", stream="nope")
    ) == sp.QueryOffsetResponse(correlation_id=2, code=2, offset=0)


def test_store_offset_ignored_when_invalid(listener: Listener) -> None:
    """StoreOffset to a missing stream or with a reference over 255 bytes is silently dropped."""
    listener.store.create("s1")
    peer = listener.opened()
    peer.send(
        sp.StoreOffset(reference="consumer", stream="nope", offset=1),
        sp.StoreOffset(reference="c" * 256, stream="s1", offset=1),
    )
    assert peer.frames() == []
    assert not peer.closed
    assert peer.ask(
        sp.QueryOffset(correlation_id=1, reference="c" * 256, stream="s1")
    ) == sp.QueryOffsetResponse(correlation_id=1, code=19, offset=0)


@pytest.mark.parametrize(
    ("spec", "offset"),
    [
        (FIRST, 0),
        (LAST, 3),
        (NEXT, 6),
        (sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=4), 3),
        (sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=2_500_000), 2),
    ],
    ids=["first", "last", "next", "offset", "timestamp"],
)
@pytest_twisted.ensureDeferred
async def test_resolve_offset_spec(listener: Listener, spec: sp.OffsetSpec, offset: int) -> None:
    """ResolveOffsetSpec answers offset type 4 and the chunk a subscription would start at."""
    await three_chunks(listener)
    peer = listener.opened()
    request = sp.ResolveOffsetSpec(correlation_id=6, stream="s1", offset_spec=spec)
    assert peer.ask(request) == sp.ResolveOffsetSpecResponse(
        correlation_id=6, code=1, offset_type=4, offset=offset
    )
    missing = sp.ResolveOffsetSpec(correlation_id=7, stream="nope", offset_spec=spec)
    assert peer.ask(missing) == sp.ResolveOffsetSpecResponse(
        correlation_id=7, code=2, offset_type=4, offset=0
    )


# --- bridge ------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_stream_destination_appends_amqp(listener: Listener) -> None:
    """StreamDestination creates the stream and appends an AMQP message, accepted once committed.

    The message comes back as it was, with one hop counted.
    """
    destination = StreamDestination(LISTENER, listener.store)
    assert verifyObject(IDestination, destination)
    message = Message(
        body=b"hello",
        address="routed",
        id="m-1",
        sender="sam",
        recipients=("a@example.org",),
        headers={"k": "v", "n": 3},
        timestamp=1_700_000_000.5,
    )
    outcome = (await destination.deliver([message]))[0]
    assert outcome.status is Status.ACCEPTED
    stream = listener.store.get("routed")
    assert stream is not None
    # Into the existing stream:
    assert (await destination.deliver([message]))[0] == Outcome.accepted()
    chunks = stream.read_chunks(0, 10, 1 << 20)
    entries = [
        bytes(e)
        for chunk in chunks
        for e in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])
    ]
    assert len(entries) == 2
    assert entries[0].startswith(b"\x00\x53")  # an AMQP section
    decoded = message_from_entry(entries[0], stream="routed", timestamp=0.0, offset=0)
    assert decoded == attrs.evolve(message, headers={**message.headers, HOPS_HEADER: 1})


@pytest_twisted.ensureDeferred
async def test_stream_destination_rejects_bad_names(listener: Listener) -> None:
    """A stream that cannot be created is a rejected outcome, not an error."""
    destination = StreamDestination(LISTENER, listener.store)
    outcome = (await destination.deliver([Message(body=b"x", address="")]))[0]
    assert outcome.status is Status.REJECTED
    assert listener.store.names() == []


def feeds_router(destination: RecordingDestination, clock: Clock) -> Router:
    """A router with one route: what the listener gets on "orders" goes to ``destination``."""
    route = Route(
        name="orders-out",
        source=LISTENER,
        pattern=AddressPattern("orders"),
        destination=destination.name,
    )
    return Router(bind_routes([route], {destination.name: destination}), clock)


@pytest_twisted.ensureDeferred
async def test_route_feeds_forward_and_resume(listener: Listener) -> None:
    """What clients publish to a routed stream goes along the router, from a stored offset.

    The forwarder starts when a client creates the routed stream, stores the
    offset of what it delivered, and after stop and start resumes after it.
    """
    sink = RecordingDestination("sink")
    clock = Clock()
    feeds = StreamRouteFeeds(LISTENER, listener.store, feeds_router(sink, clock), clock)
    factory = listener.factory()
    factory.on_stream_created.append(feeds.stream_created)
    feeds.start()
    assert feeds.forwarders == {}
    peer = listener.opened(factory)
    assert peer.code(sp.Create(correlation_id=1, stream="orders")) == 1
    assert peer.code(sp.Create(correlation_id=2, stream="unrouted")) == 1
    assert sorted(feeds.forwarders) == ["orders"]
    assert peer.code(declare(peer, 1, "orders")) == 1
    assert peer.code(declare(peer, 2, "unrouted")) == 1
    amqp = entry_from_message(Message(body=b"second", address="x", id="m-2", headers={"k": "v"}))
    peer.send(publish(1, [1, 2], [b"first", amqp]), publish(2, [1], [b"elsewhere"]))
    await sink.received(2)
    assert [(m.body, m.address, m.id, dict(m.headers)) for m in sink.messages] == [
        (b"first", "orders", "orders:0", {}),
        (b"second", "orders", "m-2", {"k": "v"}),
    ]
    clock.advance(0)
    stream = listener.store.get("orders")
    assert stream is not None
    reference = FEED_REFERENCE_PREFIX + LISTENER
    assert stream.query_offset(reference) == 1
    feeds.stop()
    assert feeds.forwarders == {}
    peer.frames()  # the first confirms
    peer.send(publish(1, [3], [b"third"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[3])
    assert len(sink.messages) == 2
    feeds.start()
    await sink.received(3)
    clock.advance(0)
    assert [m.body for m in sink.messages] == [b"first", b"second", b"third"]
    (third,) = stream.read_chunks(2, 10, 1 << 20)
    assert stream.query_offset(reference) == third.chunk_id
    feeds.stop()


@pytest_twisted.ensureDeferred
async def test_route_feeds_skip_own_streams_and_follow_reloads(listener: Listener) -> None:
    """Feeds never read the gateway's own streams, and stop when a reload drops the route."""
    sink = RecordingDestination("sink")
    clock = Clock()
    route = Route(name="all", source=LISTENER, pattern=AddressPattern("#"), destination="sink")
    router = Router(bind_routes([route], {"sink": sink}), clock)
    await listener.fill("msggateway.route.r", [b"internal"])
    await listener.fill("orders", [b"o"])
    feeds = StreamRouteFeeds(LISTENER, listener.store, router, clock)
    feeds.start()
    assert sorted(feeds.forwarders) == ["orders"]
    await sink.received(1)
    assert [m.body for m in sink.messages] == [b"o"]
    forwarder = feeds.forwarders["orders"]
    router.replace_table(bind_routes([], {"sink": sink}))
    feeds.refresh()
    assert feeds.forwarders == {}
    assert not forwarder.running
    feeds.stop()


def test_a_connection_not_open_in_time_is_closed(listener: Listener) -> None:
    """Silent (or slow) before Open: closed at the handshake time-out; an open one stays."""
    factory = listener.factory()
    silent = listener.connect(factory)
    opened = listener.opened(factory)
    listener.clock.advance(9.9)
    assert not silent.transport.disconnecting
    listener.clock.advance(0.1)
    assert silent.transport.disconnecting
    assert not opened.transport.disconnecting
