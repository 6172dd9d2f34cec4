"""In-memory tests of the stream upstream: `gateway.protocols.stream.client`.

The upstream's `ClientService` (the upstream role's,
`gateway.protocols.upstream`) connects through a `TCP4ClientEndpoint` (and
`HostnameEndpoint` for a leader elsewhere, or `TCP4ClientEndpoint` again
where a test relocates through its own function) on a `MemoryReactorClock`,
which is also its clock: each connection attempt shows up in ``tcpClients``
and the test builds the protocol itself over a `StringTransport`. The
test plays the stream node with the sans-IO codec in the server role: it
decodes what the client wrote and answers with encoded frames, so every
await of the client's handshake resumes synchronously. Chunks delivered to
subscriptions are built with `gateway.codecs.osiris`. The behaviour checked
is the module's docstring, the settings' and docs/protocols/stream.rst
("RabbitMQ Stream upstream"). One test pairs the upstream with the gateway's own
stream listener over a real log in a temporary directory through
`twisted.test.iosim`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.batch import Answers, all_same
from gateway.core.interfaces import IDestination, IFleetLock
from gateway.core.internal import HOP_LIMIT, HOPS_HEADER, MAX_HOPS
from gateway.core.log import FsyncPolicy, LogStore
from gateway.core.message import Message, Origin, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.bridge import StreamDestination
from gateway.protocols.stream.client import (
    ENTRY_OVERHEAD_BYTES,
    PUBLISH_OVERHEAD_BYTES,
    REQUEST_TIMEOUT_SECONDS,
    StreamClientProtocol,
    StreamUpstream,
    parse_offset,
)
from gateway.protocols.stream.mapping import entry_from_message, message_from_entry
from gateway.protocols.stream.server import StreamServerFactory
from gateway.protocols.stream.settings import StreamListenerSettings, StreamUpstreamSettings

T = TypeVar("T")

UPSTREAM = "rabbit"
NODE = "gw-test0001"
"""The node id the upstreams here run on: in every publisher reference."""
SINK = "sink"
HOST = "127.0.0.1"
PORT = 5552
STREAM = "events"
SETTINGS = StreamUpstreamSettings(stream=STREAM, heartbeat_seconds=0, batch_size=3)
"""Publish everything to ``events``; no heartbeats unless a test asks for them."""
CONSUMED = Route(name="consumed", source=UPSTREAM, pattern=AddressPattern("#"), destination=SINK)


# --- helpers ---------------------------------------------------------------------------------


@implementer(IDestination)
class Sink:
    """A destination that keeps what it gets and answers when the test says so."""

    def __init__(self, name: str = SINK) -> None:
        self.name = name
        self.messages: list[Message] = []
        self.batches: list[list[Message]] = []
        self.pending: list[tuple[Answers, int]] = []
        self.auto = True

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; accept it at once unless ``auto`` is off."""
        self.messages.extend(messages)
        self.batches.append(list(messages))
        if self.auto:
            return all_same(len(messages), Outcome.accepted())
        answers = Answers(len(messages))
        self.pending.extend((answers, index) for index in range(len(messages)))
        return answers.deferred

    def answer(self, number: int, outcome: Outcome) -> None:
        """Answer the ``number``-th message kept while ``auto`` was off."""
        answers, index = self.pending[number]
        answers.settle(index, outcome)


class CountingTransport(StringTransport):
    """A StringTransport that counts the client's writes (one per batch, not per frame)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.writes = 0

    def write(self, data: bytes) -> None:
        """Count and keep one write."""
        self.writes += 1
        super().write(data)

    def writeSequence(self, data: Iterable[bytes]) -> None:  # noqa: N802 (Twisted's name)
        """Count and keep one write of several pieces."""
        self.writes += 1
        for piece in data:
            super().write(piece)


def unwrap(wrapper: Any) -> StreamClientProtocol:
    """The upstream's connection inside the endpoint's and the ClientService's wrappers."""
    protocol = wrapper._wrappedProtocol._protocol
    assert isinstance(protocol, StreamClientProtocol)
    return protocol


class Node:
    """One connection of the upstream, with the test playing the stream node."""

    def __init__(self, wrapper: Any, transport: CountingTransport) -> None:
        self.wrapper = wrapper
        self.protocol: StreamClientProtocol = unwrap(wrapper)
        self.transport = transport
        self.codec = sp.StreamCodec(sp.Role.SERVER, frame_max=0)
        self.seen: list[sp.Event] = []

    def received(self) -> list[sp.Event]:
        """Decode the frames the client wrote since the last call."""
        data = self.transport.value()
        self.transport.clear()
        events = list(self.codec.receive_data(data)) if data else []
        self.seen.extend(events)
        return events

    def one(self, kind: type[T]) -> T:
        """The single frame the client wrote since the last call, of type ``kind``."""
        events = self.received()
        assert len(events) == 1 and isinstance(events[0], kind), events
        return events[0]

    def of(self, kind: type[T]) -> list[T]:
        """The frames of type ``kind`` the client wrote since the last call (others dropped).

        Metadata asked before declaring a publisher on a stream named by an
        address is answered first (the stream has a leader, this node).
        """
        events = self.leaders(self.received())
        return [event for event in events if isinstance(event, kind)]

    def leaders(self, events: list[sp.Event], leader: bool = True) -> list[sp.Event]:
        """Answer the Metadata requests among ``events``; return the rest and what follows."""
        asked = [event for event in events if isinstance(event, sp.Metadata)]
        if not asked:
            return events
        for request in asked:
            self.say(
                sp.MetadataResponse(
                    correlation_id=request.correlation_id,
                    brokers=(sp.Broker(reference=0, host=HOST, port=PORT),),
                    streams=tuple(
                        sp.StreamMetadata(
                            stream=name, code=1, leader=0 if leader else 7, replicas=()
                        )
                        for name in request.streams
                    ),
                )
            )
        rest = [event for event in events if not isinstance(event, sp.Metadata)]
        return rest + self.received()

    def say(self, *events: sp.Event) -> None:
        """Send frames to the client in one read."""
        self.wrapper.dataReceived(b"".join(self.codec.send(event) for event in events))

    def lose(self) -> None:
        """The connection ends (after the client closed it, or not)."""
        self.wrapper.connectionLost(Failure(ConnectionLost("gone")))

    # --- the handshake, step by step ---------------------------------------------------

    def login(
        self, *, code: int = 1, mechanisms: tuple[str, ...] = ("PLAIN",), name: str = UPSTREAM
    ) -> bytes | None:
        """Answer PeerProperties, SaslHandshake and SaslAuthenticate; return the PLAIN data."""
        peer = self.one(sp.PeerProperties)
        assert peer.properties["connection_name"] == name
        self.say(
            sp.PeerPropertiesResponse(correlation_id=peer.correlation_id, code=1, properties={})
        )
        hello = self.one(sp.SaslHandshake)
        self.say(
            sp.SaslHandshakeResponse(
                correlation_id=hello.correlation_id, code=1, mechanisms=mechanisms
            )
        )
        if "PLAIN" not in mechanisms:
            return None
        auth = self.one(sp.SaslAuthenticate)
        assert auth.mechanism == "PLAIN"
        self.say(sp.SaslAuthenticateResponse(correlation_id=auth.correlation_id, code=code))
        return auth.data

    def tune(self, frame_max: int = 1024 * 1024, heartbeat: int = 0, open_code: int = 1) -> sp.Tune:
        """Send Tune, answer Open; return the client's Tune."""
        self.say(sp.Tune(frame_max=frame_max, heartbeat=heartbeat))
        events = self.received()
        assert [type(event) for event in events] == [sp.Tune, sp.Open], events
        reply, opened = events
        assert isinstance(reply, sp.Tune) and isinstance(opened, sp.Open)
        assert opened.virtual_host == "/"
        self.say(
            sp.OpenResponse(correlation_id=opened.correlation_id, code=open_code, properties={})
        )
        return reply

    def metadata(
        self,
        brokers: dict[int, tuple[str, int]] | None = None,
        leader: int = 0,
        replicas: tuple[int, ...] = (),
    ) -> sp.Metadata:
        """Answer the Metadata request: every stream asked for has ``leader``."""
        asked = self.one(sp.Metadata)
        brokers = brokers if brokers is not None else {0: (HOST, PORT)}
        self.say(
            sp.MetadataResponse(
                correlation_id=asked.correlation_id,
                brokers=tuple(
                    sp.Broker(reference=ref, host=host, port=port)
                    for ref, (host, port) in brokers.items()
                ),
                streams=tuple(
                    sp.StreamMetadata(stream=name, code=1, leader=leader, replicas=replicas)
                    for name in asked.streams
                ),
            )
        )
        return asked

    def declare(
        self, sequence: int = 0, code: int = 1, sequence_code: int = 1
    ) -> sp.DeclarePublisher:
        """Answer DeclarePublisher and QueryPublisherSequence."""
        events = self.leaders(self.received())
        assert len(events) == 1 and isinstance(events[0], sp.DeclarePublisher), events
        declared = events[0]
        self.say(
            sp.Response(
                key=sp.Key.DECLARE_PUBLISHER, correlation_id=declared.correlation_id, code=code
            )
        )
        if code != 1:
            return declared
        query = self.one(sp.QueryPublisherSequence)
        assert (query.reference, query.stream) == (declared.reference, declared.stream)
        self.say(
            sp.QueryPublisherSequenceResponse(
                correlation_id=query.correlation_id, code=sequence_code, sequence=sequence
            )
        )
        return declared

    def subscribe(self, stored: int | None = None, code: int = 1) -> sp.Subscribe:
        """Answer QueryOffset (``stored`` None: no offset) and Subscribe."""
        query = self.one(sp.QueryOffset)
        self.say(
            sp.QueryOffsetResponse(
                correlation_id=query.correlation_id,
                code=1 if stored is not None else 19,
                offset=stored or 0,
            )
        )
        subscribe = self.one(sp.Subscribe)
        self.say(
            sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=subscribe.correlation_id, code=code)
        )
        return subscribe

    def confirm(self, publisher_id: int, *ids: int) -> None:
        """Confirm publishing ids."""
        self.say(sp.PublishConfirm(publisher_id=publisher_id, publishing_ids=list(ids)))

    def deliver_chunk(self, subscription_id: int, first_offset: int, *bodies: bytes) -> None:
        """Deliver one chunk of AMQP entries made from ``bodies``."""
        entries = [
            entry_from_message(Message(body=body, address="ignored", id=body.decode()))
            for body in bodies
        ]
        chunk = osiris.encode_chunk(entries, first_offset=first_offset, timestamp_ms=1_000)
        self.say(sp.Deliver(subscription_id=subscription_id, chunk=chunk))


class World:
    """One stream upstream with a router, a sink for consumed messages and a clock."""

    def __init__(
        self,
        settings: StreamUpstreamSettings = SETTINGS,
        secret: bytes | None = None,
        relocate: Callable[[str, int], TCP4ClientEndpoint] | None = None,
        node: str = NODE,
        reactor: MemoryReactorClock | None = None,
        lock: IFleetLock | None = None,
    ) -> None:
        self.reactor = reactor or MemoryReactorClock()
        self.metrics = GatewayMetrics()
        self.sink = Sink()
        self.upstream = StreamUpstream(
            name=UPSTREAM,
            settings=settings,
            endpoint=TCP4ClientEndpoint(self.reactor, HOST, PORT),
            router=Router(bind_routes([], {}), self.reactor),
            secrets=Secrets(upstreams={UPSTREAM: secret}) if secret else Secrets(),
            node=node,
            clock=self.reactor,
            reactor=self.reactor,
            metrics=self.metrics,
            relocate=relocate,
            lock=lock,
        )
        self.upstream.router.replace_table(
            bind_routes([CONSUMED], {SINK: self.sink, UPSTREAM: self.upstream})
        )
        self._taken = 0

    def attempts(self) -> list[tuple[str, int]]:
        """Where the upstream tried to connect, in order."""
        return [(host, port) for host, port, *_ in self.reactor.tcpClients]

    def accept(self) -> Node:
        """Accept the newest connection attempt not taken yet."""
        assert len(self.reactor.tcpClients) > self._taken, "no connection attempt"
        host, port, factory, *_ = self.reactor.tcpClients[self._taken]
        self._taken += 1
        address = IPv4Address("TCP", host, port)
        wrapper = factory.buildProtocol(address)
        transport = CountingTransport(peerAddress=address)
        wrapper.makeConnection(transport)
        return Node(wrapper, transport)

    def open(self, *, frame_max: int = 1024 * 1024, sequence: int = 0) -> Node:
        """Start the upstream (first call) and take a connection through to ready."""
        if not self.upstream.running:
            self.upstream.start()
        node = self.accept()
        node.login()
        node.tune(frame_max=frame_max)
        if self.upstream.settings.create_streams:
            for _ in self.upstream._streams_used():
                create = node.one(sp.Create)
                node.say(
                    sp.Response(key=sp.Key.CREATE, correlation_id=create.correlation_id, code=1)
                )
        if self.upstream._streams_used():
            node.metadata()
        for _ in self.upstream.publishers.streams():
            node.declare(sequence=sequence)
        for _ in self.upstream.settings.subscribe:
            node.subscribe()
        assert self.upstream.connected
        return node

    def publish(self, name: str, body: bytes = b"hello") -> Deferred[Outcome]:
        """Deliver a message with id ``name`` to the upstream, as a batch of one."""
        return self.publish_batch([name], body).addCallback(lambda outcomes: outcomes[0])

    def publish_batch(
        self, names: Sequence[str], body: bytes = b"hello", address: str = "anything"
    ) -> Deferred[list[Outcome]]:
        """Deliver one batch of messages with ids ``names`` to the upstream."""
        return self.upstream.deliver(
            [Message(body=body, address=address, id=name) for name in names]
        )

    def sample(self, name: str, **labels: str) -> float:
        """A metric's current value (0 when never set)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def tracked(deferred: Deferred[T]) -> list[T | Failure]:
    """Collect what the Deferred fires with."""
    results: list[T | Failure] = []
    deferred.addBoth(results.append)
    return results


def status(results: list[Any]) -> Status | None:
    """The status of the one outcome collected, or None when none yet."""
    assert len(results) <= 1
    return results[0].status if results else None


def ids_of(node: Node) -> list[str]:
    """Message ids of the Publish frames the client wrote since the last look."""
    found: list[str] = []
    for publish in node.of(sp.Publish):
        for entry in publish.messages:
            found.append(message_from_entry(bytes(entry), stream=STREAM, timestamp=0).id)
    return found


@pytest.fixture
def world() -> World:
    """An upstream publishing to ``events`` in batches of 3, no heartbeats."""
    return World()


# --- connecting -----------------------------------------------------------------------------


def test_upstream_is_a_destination(world: World) -> None:
    """The upstream is a real IDestination named after its config entry."""
    assert verifyObject(IDestination, world.upstream)
    assert world.upstream.name == UPSTREAM


def test_guest_login_by_default_then_tune_open_and_metadata(world: World) -> None:
    """Without a secret user guest logs in with password guest; tune, open, metadata follow."""
    world.upstream.start()
    assert world.attempts() == [(HOST, PORT)]
    node = world.accept()
    assert node.login() == b"\0guest\0guest"
    assert not world.upstream.connected
    node.tune()
    assert node.metadata().streams == (STREAM,)
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 1


def test_sasl_plain_sends_the_secret() -> None:
    """The upstream's secret is the password for the configured user."""
    world = World(attrs.evolve(SETTINGS, username="gw"), secret=b"s3cret")
    world.upstream.start()
    assert world.accept().login() == b"\0gw\0s3cret"


def test_no_plain_mechanism_closes() -> None:
    """A server that offers no PLAIN is left."""
    world = World()
    world.upstream.start()
    node = world.accept()
    node.login(mechanisms=("ANONYMOUS",))
    assert node.transport.disconnecting
    assert not world.upstream.connected


def test_refused_login_closes_and_retries_with_backoff(world: World) -> None:
    """A refused login closes; attempts follow after 0.5, 1, 2 s; success resets the delay."""
    world.upstream.start()
    for delay in (0.5, 1.0, 2.0):
        node = world.accept()
        node.login(code=8)
        assert node.transport.disconnecting
        node.lose()
        before = len(world.attempts())
        world.reactor.advance(delay - 0.01)
        assert len(world.attempts()) == before
        world.reactor.advance(0.01)
        assert len(world.attempts()) == before + 1
    assert (
        world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="auth-refused")
        == 3
    )
    node = world.open()
    node.lose()
    world.reactor.advance(0.5)
    assert len(world.attempts()) == 5


@pytest.mark.parametrize(
    ("theirs", "ours", "agreed"),
    [
        (1_048_576, 131_072, 131_072),
        (65_536, 1_048_576, 65_536),
        (0, 131_072, 131_072),
        (65_536, 0, 65_536),
    ],
)
def test_tune_takes_the_smaller_frame_max_where_zero_is_no_limit(
    theirs: int, ours: int, agreed: int
) -> None:
    """The client's Tune carries the smaller frame_max; 0 on one side means the other's applies."""
    world = World(attrs.evolve(SETTINGS, frame_max=ours))
    world.upstream.start()
    node = world.accept()
    node.login()
    assert node.tune(frame_max=theirs).frame_max == agreed


def test_tune_heartbeat_smaller_of_both() -> None:
    """The heartbeat agreed is the smaller non-zero one."""
    world = World(attrs.evolve(SETTINGS, heartbeat_seconds=30))
    world.upstream.start()
    node = world.accept()
    node.login()
    assert node.tune(heartbeat=60).heartbeat == 30


def test_open_refused_closes_and_retries(world: World) -> None:
    """A refused virtual host closes the connection and tries again later."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune(open_code=12)
    assert node.transport.disconnecting
    assert not world.upstream.connected
    node.lose()
    world.reactor.advance(0.5)
    assert len(world.attempts()) == 2


@pytest.mark.parametrize("code", [1, 5])
def test_streams_created_when_configured(code: int) -> None:
    """With create_streams each stream used is created; 1 (created) and 5 (exists) are fine."""
    world = World(attrs.evolve(SETTINGS, create_streams=True, subscribe=("in",)))
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    for name in (STREAM, "in"):
        create = node.one(sp.Create)
        assert create.stream == name
        node.say(sp.Response(key=sp.Key.CREATE, correlation_id=create.correlation_id, code=code))
    assert node.metadata().streams == (STREAM, "in")
    node.subscribe()
    assert world.upstream.connected


def test_no_create_unless_configured(world: World) -> None:
    """Without create_streams the client goes straight to Metadata."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    assert not [event for event in node.seen if isinstance(event, sp.Create)]


def test_moves_to_a_leader_on_another_host_and_port(world: World) -> None:
    """Metadata naming a leader elsewhere: close, connect there, stay there."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata({0: ("127.0.0.1", PORT), 7: ("127.0.0.1", 5553)}, leader=7)
    assert node.transport.disconnecting
    assert not world.upstream.connected
    node.lose()
    world.reactor.advance(0.5)
    assert world.attempts()[-1][1] == 5553
    leader = world.accept()
    leader.login()
    leader.tune()
    leader.metadata({7: ("127.0.0.1", 5553)}, leader=7)
    assert world.upstream.connected


def test_leader_gone_goes_back_to_the_locator(world: World) -> None:
    """When the leader cannot be reached, the next attempt asks the locator again."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata({7: ("127.0.0.1", 5553)}, leader=7)
    node.lose()
    world.reactor.advance(0.5)
    _host, port, factory, *_ = world.reactor.tcpClients[-1]
    assert port == 5553
    world._taken += 1
    factory.clientConnectionFailed(world.reactor.connectors[-1], Failure(ConnectionLost("refused")))
    world.reactor.advance(1)  # the endpoint reports the failure a little later
    world.reactor.advance(30)
    assert world.attempts()[-1] == (HOST, PORT)


# --- publishing -----------------------------------------------------------------------------


def test_not_connected_is_retry_later_at_once(world: World) -> None:
    """Before the connection is open a delivery is answered retry later at once."""
    results = tracked(world.publish("m1"))
    assert status(results) is Status.RETRY


def test_publishes_in_batches_and_confirms_accept(world: World) -> None:
    """Messages queued before the publisher is ready go in Publish frames of batch_size.

    No timer: they are written as soon as the publisher is declared. Confirms
    accept the messages they name, and only those.
    """
    node = world.open()
    outcomes = [tracked(world.publish(f"m{i}")) for i in range(7)]
    declared = node.declare()
    assert declared.stream == STREAM
    assert declared.reference == f"msggateway.{UPSTREAM}.{NODE}"
    frames = node.of(sp.Publish)
    assert [list(frame.publishing_ids) for frame in frames] == [[1, 2, 3], [4, 5, 6], [7]]
    ids = [
        message_from_entry(bytes(entry), stream=STREAM, timestamp=0).id
        for frame in frames
        for entry in frame.messages
    ]
    assert ids == [f"m{i}" for i in range(7)]
    assert all(status(results) is None for results in outcomes)
    node.confirm(declared.publisher_id, 1, 2, 3, 5)
    assert [status(results) for results in outcomes] == [Status.ACCEPTED] * 3 + [
        None,
        Status.ACCEPTED,
        None,
        None,
    ]


def test_batches_stay_within_frame_max() -> None:
    """A Publish frame never grows past the negotiated frame_max."""
    world = World(attrs.evolve(SETTINGS, batch_size=1000))
    node = world.open(frame_max=4096)
    body = b"x" * 1000
    for i in range(10):
        world.publish(f"m{i}", body)
    node.declare()
    node.codec = sp.StreamCodec(sp.Role.SERVER, frame_max=4096)  # it refuses larger frames
    frames = node.of(sp.Publish)
    assert sum(len(frame.publishing_ids) for frame in frames) == 10
    assert len(frames) > 1
    for frame in frames:
        size = PUBLISH_OVERHEAD_BYTES + sum(ENTRY_OVERHEAD_BYTES + len(m) for m in frame.messages)
        assert size <= 4096


def test_small_frame_max_is_honoured() -> None:
    """A frame_max under 4 KiB still bounds each Publish frame."""
    world = World(attrs.evolve(SETTINGS, batch_size=1000))
    node = world.open(frame_max=1024)
    for i in range(6):
        world.publish(f"m{i}", b"y" * 300)
    node.declare()
    node.codec = sp.StreamCodec(sp.Role.SERVER, frame_max=1024)
    frames = node.of(sp.Publish)
    assert sum(len(frame.publishing_ids) for frame in frames) == 6


def test_message_larger_than_frame_max_is_rejected(world: World) -> None:
    """A message that can never fit in a frame is rejected, not sent to break the connection."""
    node = world.open(frame_max=2048)
    big = tracked(world.publish("big", b"z" * 4000))
    world.publish("small")
    node.declare()
    assert status(big) is Status.REJECTED
    assert ids_of(node) == ["small"]
    assert not node.transport.disconnecting


def test_max_unconfirmed_holds_messages_until_confirms() -> None:
    """At most max_unconfirmed messages are in flight; confirms let the next go."""
    world = World(attrs.evolve(SETTINGS, max_unconfirmed=2))
    node = world.open()
    for i in range(5):
        world.publish(f"m{i}")
    declared = node.declare()
    assert ids_of(node) == ["m0", "m1"]
    node.confirm(declared.publisher_id, 1)
    assert ids_of(node) == ["m2"]
    node.confirm(declared.publisher_id, 2, 3)
    assert ids_of(node) == ["m3", "m4"]


def test_max_queue_answers_retry_later() -> None:
    """Past max_queue waiting messages, a delivery is answered retry later at once."""
    world = World(attrs.evolve(SETTINGS, max_queue=3))
    world.open()
    outcomes = [tracked(world.publish(f"m{i}")) for i in range(4)]
    assert [status(results) for results in outcomes] == [None, None, None, Status.RETRY]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (2, Status.REJECTED),
        (16, Status.REJECTED),
        (17, Status.REJECTED),
        (6, Status.RETRY),
        (18, Status.RETRY),
    ],
)
def test_publish_error_codes(world: World, code: int, expected: Status) -> None:
    """PublishError 2, 16 and 17 reject; other codes ask for a retry."""
    node = world.open()
    results = tracked(world.publish("m1"))
    declared = node.declare()
    node.of(sp.Publish)
    node.say(sp.PublishError(publisher_id=declared.publisher_id, publishing_ids=[1], codes=[code]))
    assert status(results) is expected
    assert results[0].code == str(code)


def test_refused_publisher_fails_its_queue(world: World) -> None:
    """A DeclarePublisher refused with code 2 rejects what waited for it."""
    node = world.open()
    results = tracked(world.publish("m1"))
    node.declare(code=2)
    assert status(results) is Status.REJECTED


def test_publisher_ids_stay_unique_after_a_refused_publisher() -> None:
    """A publisher dropped after a refusal does not hand its id to a stream still in use."""
    world = World(attrs.evolve(SETTINGS, stream=None))
    node = world.open()
    world.upstream.deliver([Message(body=b"a", address="a", id="a")])
    world.upstream.deliver([Message(body=b"b", address="b", id="b")])
    first, second = node.of(sp.DeclarePublisher)
    node.say(sp.Response(key=sp.Key.DECLARE_PUBLISHER, correlation_id=first.correlation_id, code=2))
    node.say(
        sp.Response(key=sp.Key.DECLARE_PUBLISHER, correlation_id=second.correlation_id, code=1)
    )
    query = node.one(sp.QueryPublisherSequence)
    node.say(
        sp.QueryPublisherSequenceResponse(correlation_id=query.correlation_id, code=1, sequence=0)
    )
    world.upstream.deliver([Message(body=b"c", address="c", id="c")])
    third = node.of(sp.DeclarePublisher)
    assert [event.stream for event in third] == ["c"]
    assert third[0].publisher_id != second.publisher_id


def test_reconnect_confirms_stored_and_resends_the_rest_with_their_ids(world: World) -> None:
    """After a reconnect, ids up to the sequence are accepted, the others resent once, same ids."""
    node = world.open()
    outcomes = [tracked(world.publish(f"m{i}")) for i in range(5)]
    declared = node.declare()
    assert ids_of(node) == [f"m{i}" for i in range(5)]
    node.confirm(declared.publisher_id, 1)
    node.lose()
    assert not world.upstream.connected
    assert status(tracked(world.publish("late"))) is Status.RETRY

    world.reactor.advance(0.5)
    node = world.open(sequence=3)  # the broker stored 1 to 3 (2 and 3 unconfirmed)
    assert [status(results) for results in outcomes] == [Status.ACCEPTED] * 3 + [None, None]
    frames = node.of(sp.Publish)
    assert [list(frame.publishing_ids) for frame in frames] == [[4, 5]]
    node.confirm(declared.publisher_id, 4, 5)
    assert all(status(results) is Status.ACCEPTED for results in outcomes)
    after = tracked(world.publish("next"))
    frames = node.of(sp.Publish)
    assert [list(frame.publishing_ids) for frame in frames] == [[6]]
    node.confirm(declared.publisher_id, 6)
    assert status(after) is Status.ACCEPTED


def declared_references(world: World) -> list[str]:
    """The references a world's upstream declares for a plain message and route r's."""
    node = world.open()
    world.publish("plain")
    plain = node.declare().reference
    node.of(sp.Publish)
    world.upstream.deliver_once([Message(body=b"b", address="a", id="durable")], "r", [1])
    return [plain, node.declare().reference]


def test_two_nodes_with_one_configuration_never_share_a_reference() -> None:
    """The node id ends the plain publisher's reference and comes before a route's.

    RabbitMQ keeps one last publishing id per reference and stream, and each
    process numbers its ids on its own: two gateways with one configuration
    would otherwise have one's messages dropped as duplicates of the other's.
    """
    assert declared_references(World(node="gw-aaaaaaaa")) == [
        f"msggateway.{UPSTREAM}.gw-aaaaaaaa",
        f"msggateway.{UPSTREAM}.gw-aaaaaaaa.route.r",
    ]
    assert declared_references(World(node="gw-bbbbbbbb")) == [
        f"msggateway.{UPSTREAM}.gw-bbbbbbbb",
        f"msggateway.{UPSTREAM}.gw-bbbbbbbb.route.r",
    ]


def test_a_configured_reference_gets_the_node_id_too() -> None:
    """``publisher_reference = "orders"`` publishes as ``orders.NODE``; offsets keep their name.

    A consumer name carries no node id: whichever node consumes goes on from
    the offset stored last.
    """
    settings = attrs.evolve(SETTINGS, publisher_reference="orders", consumer_name="reader")
    world = World(settings)
    assert declared_references(world) == [f"orders.{NODE}", f"orders.{NODE}.route.r"]
    assert world.upstream.consumer_name == "reader"
    assert World().upstream.consumer_name == f"msggateway.{UPSTREAM}"


def test_sequence_above_local_ids_moves_the_next_id(world: World) -> None:
    """A broker sequence past our ids (an earlier run of this node's) is respected."""
    node = world.open()
    world.publish("m1")
    node.declare(sequence=41)
    assert [list(frame.publishing_ids) for frame in node.of(sp.Publish)] == [[42]]


# --- consuming -----------------------------------------------------------------------------


def consuming(**changes: Any) -> World:
    """An upstream consuming ``in`` (credit 2, offsets stored every 5 s)."""
    return World(attrs.evolve(SETTINGS, stream=None, subscribe=("in",), credit=2, **changes))


def test_subscribes_with_credit_and_the_configured_offset() -> None:
    """Without a stored offset the subscription starts at the configured spec, with credit."""
    world = consuming(offset="first")
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    subscribe = node.subscribe(stored=None)
    assert subscribe.stream == "in"
    assert subscribe.credit == 2
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.FIRST)
    assert subscribe.properties == {"name": f"msggateway.{UPSTREAM}"}


def test_resumes_after_the_stored_offset() -> None:
    """A stored offset N resumes at N + 1, and entries up to N in that chunk are skipped."""
    world = consuming()
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    subscribe = node.subscribe(stored=11)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=12)
    node.deliver_chunk(subscribe.subscription_id, 10, b"a", b"b", b"c", b"d")
    assert [m.body for m in world.sink.messages] == [b"c", b"d"]
    assert world.sink.messages[0].address == "in"


def test_chunks_routed_and_credit_granted_once_settled() -> None:
    """Credit 1 is granted only when every message of the chunk has an outcome."""
    world = consuming()
    node = world.open()
    world.sink.auto = False
    node.deliver_chunk(0, 0, b"a", b"b")
    assert [m.body for m in world.sink.messages] == [b"a", b"b"]
    assert node.of(sp.Credit) == []
    world.sink.answer(0, Outcome.accepted())
    assert node.of(sp.Credit) == []
    world.sink.answer(1, Outcome.retry("later"))
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]


def test_offsets_stored_as_chunks_settle_at_most_once_an_interval_and_at_stop() -> None:
    """A settled chunk's offset is stored on the next turn, then at most once per interval.

    And again at stop.
    """
    world = consuming(store_offset_interval_seconds=5.0)
    node = world.open()
    node.deliver_chunk(0, 0, b"a", b"b")
    world.reactor.advance(0)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=1)
    ]
    node.deliver_chunk(0, 2, b"c")
    world.reactor.advance(4.9)
    assert node.of(sp.StoreOffset) == []
    world.reactor.advance(0.1)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=2)
    ]
    world.reactor.advance(10)
    assert node.of(sp.StoreOffset) == []
    node.deliver_chunk(0, 3, b"d")
    stopped = tracked(world.upstream.stop())
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=3)
    ]
    assert node.transport.disconnecting
    node.lose()
    assert stopped == [None]
    world.reactor.advance(60)
    assert len(world.attempts()) == 1


def test_offsets_not_stored_past_unsettled_messages() -> None:
    """An offset is stored only once its chunk's messages all have outcomes."""
    world = consuming()
    node = world.open()
    world.sink.auto = False
    node.deliver_chunk(0, 0, b"a")
    world.reactor.advance(5)
    assert node.of(sp.StoreOffset) == []
    world.sink.answer(0, Outcome.accepted())
    world.reactor.advance(5)
    assert [event.offset for event in node.of(sp.StoreOffset)] == [0]


def test_bad_chunk_closes() -> None:
    """A chunk whose CRC does not match closes the connection."""
    world = consuming()
    node = world.open()
    chunk = bytearray(osiris.encode_chunk([b"x"], first_offset=0, timestamp_ms=0))
    chunk[-1] ^= 0xFF
    node.say(sp.Deliver(subscription_id=0, chunk=bytes(chunk)))
    assert node.transport.disconnecting
    assert world.sink.messages == []


# --- heartbeats, close, requests -----------------------------------------------------------


def test_heartbeats_sent_and_silence_closes() -> None:
    """A heartbeat goes out every period; two periods without a frame close the connection."""
    world = World(attrs.evolve(SETTINGS, stream=None, heartbeat_seconds=10))
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune(heartbeat=10)
    world.reactor.advance(10)
    assert node.of(sp.Heartbeat) == [sp.Heartbeat()]
    node.say(sp.Heartbeat())
    world.reactor.advance(10)
    assert node.of(sp.Heartbeat) == [sp.Heartbeat()]
    assert not node.transport.disconnecting
    world.reactor.advance(9.5)
    assert not node.transport.disconnecting
    world.reactor.advance(0.5)  # 30 s: 20 s since the server's Heartbeat at 10 s
    assert node.transport.disconnecting


def test_silence_closes_when_the_log_says() -> None:
    """Tuned to 60 s, a server silent after Open is left at 120 s, not at a later check."""
    world = World(attrs.evolve(SETTINGS, stream=None, heartbeat_seconds=60))
    world.upstream.start()
    node = world.accept()
    node.login()
    with capturedLogs() as events:
        node.tune(heartbeat=60)
        world.reactor.advance(119.5)
        assert not node.transport.disconnecting
        world.reactor.advance(0.5)
    assert node.transport.disconnecting
    assert [event["why"] for event in events if "why" in event] == [
        "no frame from the server for 120 s"
    ]


def test_server_close_is_answered() -> None:
    """The server's Close gets a CloseResponse with the same correlation id, then we close."""
    world = World()
    node = world.open()
    node.say(sp.Close(correlation_id=77, code=1, reason="bye"))
    assert node.one(sp.CloseResponse) == sp.CloseResponse(correlation_id=77, code=1)
    assert node.transport.disconnecting
    node.lose()
    assert not world.upstream.connected


def test_metadata_update_reconnects(world: World) -> None:
    """MetadataUpdate on a stream in use closes the connection to look again."""
    node = world.open()
    node.say(sp.MetadataUpdate(code=6, stream=STREAM))
    assert node.transport.disconnecting


def test_a_stream_without_a_leader_is_not_made_ready() -> None:
    """Metadata naming no leader (an election under way): closed, and asked again at the locator.

    RabbitMQ 3.10 crashes a connection that declares a publisher then.
    """
    world = World()
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    asked = node.one(sp.Metadata)
    node.say(
        sp.MetadataResponse(
            correlation_id=asked.correlation_id,
            brokers=(sp.Broker(reference=0, host=HOST, port=PORT),),
            streams=(sp.StreamMetadata(stream=STREAM, code=1, leader=3, replicas=(0,)),),
        )
    )
    assert node.transport.disconnecting
    assert not world.upstream.connected
    assert status(tracked(world.publish("m1"))) is Status.RETRY
    node.lose()
    world.reactor.advance(0.5)
    assert world.attempts()[-1] == (HOST, PORT)
    assert not [event for event in node.seen if isinstance(event, sp.DeclarePublisher)]


def test_an_address_named_stream_without_a_leader_is_retry_later_and_not_declared() -> None:
    """Streams named by addresses are looked up before their publisher is declared."""
    world = World(attrs.evolve(SETTINGS, stream=None))
    node = world.open()
    results = tracked(world.upstream.deliver([Message(body=b"a", address="a", id="a")]))
    events = node.leaders(node.received(), leader=False)
    assert not [event for event in events if isinstance(event, sp.DeclarePublisher)]
    [outcomes] = results
    assert isinstance(outcomes, list)
    assert [outcome.status for outcome in outcomes] == [Status.RETRY]
    assert "stream a has no leader now" in outcomes[0].reason
    assert not node.transport.disconnecting
    again = tracked(world.upstream.deliver([Message(body=b"b", address="a", id="b")]))
    declared = node.declare()
    assert declared.stream == "a"
    node.confirm(declared.publisher_id, 1)
    assert [outcome.status for outcome in again[0]] == [Status.ACCEPTED]  # type: ignore[union-attr]


def test_unanswered_request_times_out_and_closes(world: World) -> None:
    """A request without an answer fails after the time-out and the connection is closed."""
    world.upstream.start()
    node = world.accept()
    node.one(sp.PeerProperties)
    world.reactor.advance(REQUEST_TIMEOUT_SECONDS)
    assert node.transport.disconnecting
    node.lose()
    world.reactor.advance(0.5)
    assert len(world.attempts()) == 2


def test_request_timing_out_on_an_open_connection(world: World) -> None:
    """A publisher declaration without an answer closes the connection; the loss is clean."""
    node = world.open()
    results = tracked(world.publish("m1"))
    node.one(sp.DeclarePublisher)
    world.reactor.advance(REQUEST_TIMEOUT_SECONDS)
    assert node.transport.disconnecting
    node.lose()
    assert status(results) is None  # still queued: it goes out after the reconnect
    world.reactor.advance(0.5)
    node = world.open()
    assert ids_of(node) == ["m1"]


def test_metadata_update_asks_the_locator_again(world: World) -> None:
    """After a leader moved, the next connection goes through the locator to find it."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata({7: (HOST, 5553)}, leader=7)
    node.lose()
    world.reactor.advance(0.5)
    leader = world.accept()
    leader.login()
    leader.tune()
    leader.metadata({7: (HOST, 5553)}, leader=7)
    leader.say(sp.MetadataUpdate(code=6, stream=STREAM))
    leader.lose()
    world.reactor.advance(0.5)
    assert world.attempts()[-1] == (HOST, PORT)


def test_parse_offset() -> None:
    """Offset specifications from the config."""
    assert parse_offset("last") == sp.OffsetSpec(kind=sp.OffsetKind.LAST)
    assert parse_offset("offset:5") == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=5)
    assert parse_offset("timestamp:-1") == sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=-1)
    for bad in ("offset:-1", "offset:", "later", "first:1"):
        with pytest.raises(ValueError, match="is not first"):
            parse_offset(bad)


def test_stop_during_the_handshake_closes_that_connection(world: World) -> None:
    """A connection still in its handshake when the upstream stops is closed, not kept."""
    world.upstream.start()
    node = world.accept()
    node.login()
    stopped = tracked(world.upstream.stop())
    assert node.transport.disconnecting
    assert stopped == []  # the stop is done once the connection is closed
    node.lose()
    assert stopped == [None]
    world.reactor.advance(60)
    assert len(world.attempts()) == 1
    assert not world.upstream.connected


# --- relocating and the service's life, through the upstream's ClientService ----------------

LEADER_PORT = 5553
ELSEWHERE = {0: (HOST, PORT), 7: (HOST, LEADER_PORT)}
"""The locator's node, and the leader on another port."""


def tcp_world(settings: StreamUpstreamSettings = SETTINGS) -> World:
    """A world whose relocated endpoints are plain TCP (a refused attempt fails at once)."""
    world: World

    def relocate(host: str, port: int) -> TCP4ClientEndpoint:
        return TCP4ClientEndpoint(world.reactor, host, port)

    world = World(settings, relocate=relocate)
    return world


def refuse_newest(world: World) -> None:
    """The newest connection attempt fails (nobody listens there)."""
    _host, _port, factory, *_ = world.reactor.tcpClients[-1]
    world._taken += 1
    factory.clientConnectionFailed(world.reactor.connectors[-1], Failure(ConnectionLost("refused")))


def at_the_leader(world: World) -> Node:
    """Start; the locator's Metadata names the leader elsewhere; connect there after 0.5 s."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata(ELSEWHERE, leader=7)
    node.lose()
    world.reactor.advance(0.5)
    leader = world.accept()
    leader.login()
    leader.tune()
    leader.metadata(ELSEWHERE, leader=7)
    assert world.upstream.connected
    return leader


def test_relocating_sets_the_target_and_the_service_connects_there_after_its_first_wait() -> None:
    """The leader Metadata names becomes the service's target; the connection closes to get there.

    The service, not a timer of the upstream's own, connects after its first
    wait (0.5 s), to the leader, and stays there.
    """
    world = tcp_world()
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata(ELSEWHERE, leader=7)
    endpoint = world.upstream.endpoint
    assert endpoint.moved and endpoint.target is not endpoint.home
    assert node.transport.disconnecting and node.transport.producer is None
    node.lose()
    world.reactor.advance(0.49)
    assert world.attempts() == [(HOST, PORT)]
    world.reactor.advance(0.01)
    assert world.attempts() == [(HOST, PORT), (HOST, LEADER_PORT)]
    leader = world.accept()
    leader.login()
    leader.tune()
    leader.metadata(ELSEWHERE, leader=7)
    assert world.upstream.connected and endpoint.moved


def test_a_relocation_starts_the_back_off_over() -> None:
    """After refused logins (0.5 s, then 1 s), a move waits the first back-off again, not 2 s."""
    world = tcp_world()
    world.upstream.start()
    for wait in (0.5, 1.0):
        node = world.accept()
        node.login(code=8)
        node.lose()
        world.reactor.advance(wait)
    node = world.accept()
    node.login()
    node.tune()
    node.metadata(ELSEWHERE, leader=7)
    node.lose()
    world.reactor.advance(0.5)
    assert world.attempts()[-1] == (HOST, LEADER_PORT)


def test_a_lost_connection_at_the_leader_connects_to_the_leader_again() -> None:
    """The leader's connection ends: the next attempt goes to the leader, where it moved."""
    world = tcp_world()
    leader = at_the_leader(world)
    leader.lose()
    assert not world.upstream.connected
    world.reactor.advance(0.5)
    assert world.attempts()[-1] == (HOST, LEADER_PORT)


def test_an_attempt_at_the_leader_that_fails_goes_back_to_the_locator() -> None:
    """A refused attempt at the leader is logged; the service's next attempt asks the locator.

    The wait before it is the back-off's second (1 s): nothing was ready in between.
    """
    world = tcp_world()
    leader = at_the_leader(world)
    leader.lose()
    world.reactor.advance(0.5)
    with capturedLogs() as events:
        refuse_newest(world)
    assert (
        f"upstream {UPSTREAM}: cannot connect: Connection to the other side was lost"
        in " ".join(str(e["log_format"]).format(**e) for e in events)
    )
    assert not world.upstream.endpoint.moved
    world.reactor.advance(0.99)
    assert world.attempts()[-1] == (HOST, LEADER_PORT)
    world.reactor.advance(0.01)
    assert world.attempts()[-1] == (HOST, PORT)
    node = world.accept()
    node.login()
    node.tune()
    node.metadata({7: (HOST, PORT)}, leader=7)  # the leader moved to the locator's node
    assert world.upstream.connected


def test_the_service_is_the_upstreams_life() -> None:
    """Starting the service connects; stopping it stores the offsets, closes, and then fires."""
    world = consuming()
    world.upstream.service.startService()
    node = world.open()
    node.deliver_chunk(0, 0, b"a", b"b")
    stopped: list[object] = []
    with capturedLogs() as events:
        world.upstream.service.stopService().addCallback(stopped.append)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=1)
    ]
    assert f"upstream {UPSTREAM}: closing: the gateway is stopping" in [
        str(e["log_format"]).format(**e) for e in events
    ]
    assert node.transport.disconnecting and stopped == []
    node.lose()
    assert stopped == [None]
    world.reactor.advance(60)
    assert len(world.attempts()) == 1
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 0


def test_stopping_while_waiting_to_reconnect_is_at_once() -> None:
    """Between attempts there is nothing to close: the stop fires at once, nothing connects."""
    world = World()
    node = world.open()
    node.lose()
    stopped = tracked(world.upstream.stop())
    assert stopped == [None]
    world.reactor.advance(60)
    assert len(world.attempts()) == 1


def test_connections_are_counted_like_every_upstreams() -> None:
    """An open connection counts in the connection gauges, labelled with the stream protocol."""
    world = World()
    node = world.open()
    labels = {"endpoint": UPSTREAM, "protocol": "stream"}
    assert world.sample("msggateway_connections", **labels) == 1
    assert world.sample("msggateway_connections_opened_total", **labels) == 1
    node.lose()
    assert world.sample("msggateway_connections", **labels) == 0


# --- consuming from a replica ---------------------------------------------------------------

REPLICA_PORT = 5554
CLUSTER = {0: (HOST, PORT), 1: (HOST, REPLICA_PORT)}
"""The leader is the locator's node; the one replica listens on another port."""


def replica_world() -> World:
    """An upstream publishing to ``events`` and consuming ``in`` from a replica."""
    return World(
        attrs.evolve(SETTINGS, subscribe=("in",), consume_from="replica", credit=2),
        secret=b"s3cret",
    )


def test_replica_consumer_reads_from_a_replica_while_publishing_stays_on_the_leader() -> None:
    """Subscriptions move to the replica Metadata names; Publish stays on the leader link."""
    world = replica_world()
    consumer = world.upstream.consumer
    assert consumer is not None
    world.upstream.start()
    assert world.attempts() == [(HOST, PORT), (HOST, PORT)]

    leader = world.accept()
    leader.login()
    leader.tune()
    assert leader.metadata(CLUSTER, leader=0, replicas=(1,)).streams == (STREAM,)
    assert not leader.transport.disconnecting
    assert world.upstream.connection is not None  # publishing is ready; no Subscribe here

    locator = world.accept()
    assert locator.login(name=f"{UPSTREAM}.consumer") == b"\0guest\0s3cret"
    locator.tune()
    assert locator.metadata(CLUSTER, leader=0, replicas=(1,)).streams == ("in",)
    assert locator.transport.disconnecting
    locator.lose()
    assert not world.upstream.connected
    world.reactor.advance(0.5)
    assert world.attempts()[-1] == (HOST, REPLICA_PORT)

    replica = world.accept()
    replica.login(name=f"{UPSTREAM}.consumer")
    replica.tune()
    replica.metadata(CLUSTER, leader=0, replicas=(1,))
    subscribe = replica.subscribe(stored=None)
    assert subscribe.stream == "in"
    assert subscribe.properties == {"name": f"msggateway.{UPSTREAM}"}
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=f"{UPSTREAM}.consumer") == 1

    published = tracked(world.publish("m1"))
    declared = leader.declare()
    assert ids_of(leader) == ["m1"]
    assert replica.of(sp.Publish) == [] and replica.of(sp.DeclarePublisher) == []
    leader.confirm(declared.publisher_id, 1)
    assert status(published) is Status.ACCEPTED

    replica.deliver_chunk(subscribe.subscription_id, 0, b"a", b"b")
    assert [(m.body, m.address) for m in world.sink.messages] == [(b"a", "in"), (b"b", "in")]
    assert leader.of(sp.Subscribe) == []
    world.reactor.advance(SETTINGS.store_offset_interval_seconds)
    stored = replica.of(sp.StoreOffset)
    assert stored == [sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=1)]
    assert leader.of(sp.StoreOffset) == []

    stopped = tracked(world.upstream.stop())
    assert leader.transport.disconnecting and replica.transport.disconnecting
    assert stopped == []
    leader.lose()
    assert stopped == []
    replica.lose()
    assert stopped == [None]


def test_replica_consumer_falls_back_to_the_leader_without_replicas() -> None:
    """A stream with no replica (a single node) is consumed from the leader it is on."""
    world = replica_world()
    world.upstream.start()
    leader = world.accept()
    leader.login()
    leader.tune()
    leader.metadata()
    consumer = world.accept()
    consumer.login(name=f"{UPSTREAM}.consumer")
    consumer.tune()
    consumer.metadata({0: (HOST, PORT)}, leader=0, replicas=())
    assert not consumer.transport.disconnecting
    consumer.subscribe(stored=4)
    assert world.upstream.connected
    consumer.deliver_chunk(0, 5, b"x")
    assert [m.body for m in world.sink.messages] == [b"x"]


def test_replica_consumer_stays_on_the_replica_it_reached() -> None:
    """Connected to one of the replicas already, the consumer link does not move."""
    world = replica_world()
    consumer = world.upstream.consumer
    assert consumer is not None
    consumer.start()
    node = world.accept()
    node.login(name=f"{UPSTREAM}.consumer")
    node.tune()
    node.metadata({0: (HOST, 6000), 1: (HOST, PORT)}, leader=0, replicas=(1,))
    assert not node.transport.disconnecting
    node.subscribe()
    assert consumer.connected


def test_leader_consumption_is_one_connection_by_default() -> None:
    """With consume_from leader (the default) there is no consumer link."""
    world = World(attrs.evolve(SETTINGS, subscribe=("in",)))
    assert world.upstream.consumer is None
    world.upstream.start()
    assert world.attempts() == [(HOST, PORT)]


def test_reconnect_resumes_after_what_was_settled_but_not_stored() -> None:
    """Messages settled before a reconnect are not routed again; their offset is stored next."""
    world = consuming()
    node = world.open()
    node.deliver_chunk(0, 0, b"a", b"b")
    node.lose()
    world.reactor.advance(0.5)
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    subscribe = node.subscribe(stored=None)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=2)
    node.deliver_chunk(0, 0, b"a", b"b", b"c")
    assert [m.body for m in world.sink.messages] == [b"a", b"b", b"c"]
    world.reactor.advance(5)
    assert [event.offset for event in node.of(sp.StoreOffset)] == [2]


def test_reconnect_goes_on_after_what_was_routed() -> None:
    """A chunk routed before the connection ended is not read again: its outcomes still come.

    Reading goes on after it; it counts against the credit until it
    settles, then gives it back on the new connection and its offset is
    stored.
    """
    world = consuming(offset="first")
    node = world.open()
    world.sink.auto = False
    node.deliver_chunk(0, 0, b"a")
    node.lose()
    world.reactor.advance(0.5)
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    subscribe = node.subscribe(stored=None)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=1)
    assert subscribe.credit == 1  # of 2: the open chunk holds one
    world.sink.answer(0, Outcome.accepted())
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]
    world.reactor.advance(SETTINGS.store_offset_interval_seconds)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=0)
    ]
    world.sink.auto = True
    node.deliver_chunk(0, 1, b"b")
    assert [m.body for m in world.sink.messages] == [b"a", b"b"]


def test_reconnect_makes_up_for_credit_settled_while_subscribing() -> None:
    """A routed chunk that settles while the new subscription is made gives its credit back."""
    world = consuming(offset="first")
    node = world.open()
    world.sink.auto = False
    node.deliver_chunk(0, 0, b"a")
    node.deliver_chunk(0, 1, b"b")
    node.lose()
    world.reactor.advance(0.5)
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    query = node.one(sp.QueryOffset)
    node.say(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=19, offset=0))
    subscribe = node.one(sp.Subscribe)
    assert subscribe.credit == 1  # both open: at least one
    world.sink.answer(0, Outcome.accepted())
    world.sink.answer(1, Outcome.accepted())
    node.say(sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=subscribe.correlation_id, code=1))
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]


def test_an_offset_held_by_a_durable_route_is_stored_once_it_delivered() -> None:
    """The stored offset stays below what a durable route committed and has not delivered.

    It is stored as far as it may, and again once the route let go.
    """
    world = consuming()
    node = world.open()
    lowest: list[int | None] = [1]
    asked: list[tuple[str, str]] = []

    def unforwarded(source: str, reader: str) -> int | None:
        asked.append((source, reader))
        return lowest[0]

    world.upstream.router.unforwarded = unforwarded  # type: ignore[method-assign]
    node.deliver_chunk(0, 0, b"a", b"b")
    world.reactor.advance(0)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=0)
    ]
    assert asked == [(UPSTREAM, f"msggateway.{UPSTREAM}@in")]
    lowest[0] = None
    world.reactor.advance(SETTINGS.store_offset_interval_seconds)
    assert node.of(sp.StoreOffset) == [
        sp.StoreOffset(reference=f"msggateway.{UPSTREAM}", stream="in", offset=1)
    ]


def test_consumed_messages_carry_their_origin() -> None:
    """Each consumed message says where it was read: the consumer's name, the stream, the offset."""
    world = consuming()
    node = world.open()
    node.deliver_chunk(0, 7, b"a", b"b")
    assert [m.origin for m in world.sink.messages] == [
        Origin(f"msggateway.{UPSTREAM}@in", 7),
        Origin(f"msggateway.{UPSTREAM}@in", 8),
    ]


# --- paired with the gateway's own stream listener ------------------------------------------


POLL_SECONDS = 0.005
POLL_LIMIT = 2000
"""At most 10 s of polling: the log commits in its writer thread."""


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


@pytest_twisted.ensureDeferred
async def test_paired_with_our_own_listener_over_a_real_log(tmp_path: Path) -> None:
    """Against our listener: stream created, publishes confirmed, read back, offset stored."""
    store = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER)
    store.open()
    try:
        listener = StreamServerFactory(
            name="streams",
            settings=StreamListenerSettings(guest=True, heartbeat_seconds=0),
            store=store,
            secrets=Secrets(),
            clock=Clock(),
        )
        listener.listening_on(IPv4Address("TCP", HOST, PORT))
        world = World(
            attrs.evolve(
                SETTINGS, create_streams=True, subscribe=(STREAM,), offset="first", batch_size=2
            )
        )
        world.upstream.start()
        _host, _port, factory, *_ = world.reactor.tcpClients[0]
        here, there = IPv4Address("TCP", HOST, 40404), IPv4Address("TCP", HOST, PORT)
        client = factory.buildProtocol(there)
        server = listener.buildProtocol(here)
        pump = iosim.connect(
            server,
            iosim.FakeTransport(server, isServer=True, hostAddress=there, peerAddress=here),
            client,
            iosim.FakeTransport(client, isServer=False, hostAddress=here, peerAddress=there),
            greet=False,
        )

        async def until(condition: Callable[[], bool]) -> None:
            for _ in range(POLL_LIMIT):
                pump.flush()
                world.reactor.advance(0)
                pump.flush()
                if condition():
                    return
                await deferLater(_reactor(), POLL_SECONDS, lambda: None)
            raise AssertionError("the condition never held")

        pump.flush()
        await until(lambda: world.upstream.connected)
        assert store.get(STREAM) is not None
        outcomes = [tracked(world.publish(f"m{i}", b"body %d" % i)) for i in range(5)]
        await until(lambda: all(outcomes))
        assert [status(results) for results in outcomes] == [Status.ACCEPTED] * 5
        await until(lambda: len(world.sink.messages) == 5)
        assert [(m.id, m.body) for m in world.sink.messages] == [
            (f"m{i}", b"body %d" % i) for i in range(5)
        ]
        log = store.get(STREAM)
        assert log is not None
        assert log.writer_sequence(f"msggateway.{UPSTREAM}.{NODE}") == 5
        stopped = tracked(world.upstream.stop())
        await until(lambda: bool(stopped) and log.query_offset(f"msggateway.{UPSTREAM}") == 4)
    finally:
        await store.close()


def test_the_published_stream_decides_where_the_connection_goes() -> None:
    """With a leader-consumed stream elsewhere, the publishing stream's leader wins."""
    world = World(attrs.evolve(SETTINGS, subscribe=("in",)))
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    asked = node.one(sp.Metadata)
    assert asked.streams == (STREAM, "in")
    node.say(
        sp.MetadataResponse(
            correlation_id=asked.correlation_id,
            brokers=(
                sp.Broker(reference=0, host=HOST, port=PORT),
                sp.Broker(reference=1, host=HOST, port=5553),
            ),
            streams=(
                sp.StreamMetadata(stream=STREAM, code=1, leader=0, replicas=()),
                sp.StreamMetadata(stream="in", code=1, leader=1, replicas=()),
            ),
        )
    )
    assert not node.transport.disconnecting
    node.subscribe()
    assert world.upstream.connected


# --- added with the lead's work: relocation and unreadable sub-batches ------------------------


def test_moves_through_the_relocate_function() -> None:
    """A leader elsewhere is reached through ``relocate`` (the service keeps TLS settings there)."""
    reactor = MemoryReactorClock()
    moved: list[tuple[str, int]] = []

    def relocate(host: str, port: int) -> TCP4ClientEndpoint:
        moved.append((host, port))
        return TCP4ClientEndpoint(reactor, host, port)

    upstream = StreamUpstream(
        name=UPSTREAM,
        settings=SETTINGS,
        endpoint=TCP4ClientEndpoint(reactor, HOST, PORT),
        router=Router(bind_routes([], {}), reactor),
        secrets=Secrets(),
        node=NODE,
        clock=reactor,
        reactor=reactor,
        relocate=relocate,
    )
    upstream.start()
    host, port, factory, *_ = reactor.tcpClients[0]
    address = IPv4Address("TCP", host, port)
    wrapper = factory.buildProtocol(address)
    transport = CountingTransport(peerAddress=address)
    wrapper.makeConnection(transport)
    node = Node(wrapper, transport)
    node.login()
    node.tune()
    node.metadata({0: (HOST, PORT), 7: ("10.0.0.8", 5553)}, leader=7)
    assert moved == [("10.0.0.8", 5553)] and transport.disconnecting


def test_an_unreadable_sub_batch_is_skipped_not_fatal() -> None:
    """A sub-batch compressed with a codec the gateway lacks: what precedes it is routed."""
    world = consuming()
    node = world.open()
    readable = entry_from_message(Message(body=b"readable", address="in", id="r"))
    body = b"\0\0\0\x01x"
    snappy = struct.pack(">BHII", 0x80 | 2 << 4, 1, len(body), len(body)) + body
    data = osiris.encode_mixed_entries([readable, osiris.SubBatch.parse(snappy)])
    chunk = osiris.frame_chunk(
        data, num_entries=2, num_records=2, first_offset=0, timestamp_ms=1_000
    )
    node.say(sp.Deliver(subscription_id=0, chunk=chunk))
    assert [m.body for m in world.sink.messages] == [b"readable"]
    assert not node.transport.disconnecting
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]


# --- batches (issue 15): a batch in, one Answers, Publish frames per batch ------------------


BIG = attrs.evolve(SETTINGS, batch_size=1000)
"""Frames as large as frame_max allows."""
PUBLISHED = Route(
    name="published",
    source="src",
    pattern=AddressPattern("#"),
    destination=UPSTREAM,
    timeout_seconds=5.0,
)
"""A route from ``src`` into the upstream, with a deadline of 5 s."""


def ready(world: World) -> tuple[Node, int]:
    """Open the world and declare the publisher (one message, confirmed); return node and id."""
    node = world.open()
    first = tracked(world.publish("warm-up"))
    declared = node.declare()
    [frame] = node.of(sp.Publish)
    node.confirm(declared.publisher_id, *frame.publishing_ids)
    assert status(first) is Status.ACCEPTED
    node.transport.writes = 0
    return node, declared.publisher_id


def entries_of(names: Sequence[str], body: bytes = b"hello") -> list[bytes]:
    """The entries the upstream writes for messages with ids ``names`` (one hop counted)."""
    return [
        entry_from_message(Message(body=body, address="anything", id=name), 1) for name in names
    ]


def test_a_batch_is_one_publish_frame_in_one_write() -> None:
    """A batch of N messages for one stream is one Publish frame with N ids, in one write."""
    world = World(BIG)
    node, publisher_id = ready(world)
    names = [f"m{i}" for i in range(50)]
    outcomes = tracked(world.publish_batch(names))
    expected = sp.encode(
        sp.Publish(
            publisher_id=publisher_id,
            publishing_ids=list(range(2, 52)),
            messages=entries_of(names),
        )
    )
    assert node.transport.writes == 1
    assert node.transport.value() == expected
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == list(range(2, 52))
    assert outcomes == []
    node.confirm(publisher_id, *range(2, 52))
    assert outcomes == [[Outcome.accepted()] * 50]


def test_a_message_that_loops_is_refused_not_published() -> None:
    """Each publish counts a hop; one written into streams MAX_HOPS times already is refused.

    The batch's other messages are published; the refusal is final
    (dead-lettered at once on a durable route), counted as ``hop-limit``.
    """
    world = World(BIG)
    node, publisher_id = ready(world)
    looped = Message(body=b"x", address="anything", id="looped", headers={HOPS_HEADER: MAX_HOPS})
    outcomes = tracked(
        world.upstream.deliver([Message(body=b"hello", address="anything", id="m0"), looped])
    )
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [2]
    assert [bytes(entry) for entry in frame.messages] == entries_of(["m0"])
    node.confirm(publisher_id, 2)
    [[accepted, refused]] = outcomes  # type: ignore[misc]
    assert accepted == Outcome.accepted()
    assert (refused.status, refused.code) == (Status.REJECTED, HOP_LIMIT)
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind=HOP_LIMIT) == 1


def test_a_batch_past_batch_size_is_several_frames_in_one_write(world: World) -> None:
    """Past batch_size (3 here) a batch takes several Publish frames, still one write."""
    node, _ = ready(world)
    tracked(world.publish_batch([f"m{i}" for i in range(7)]))
    assert node.transport.writes == 1
    frames = node.of(sp.Publish)
    assert [list(frame.publishing_ids) for frame in frames] == [[2, 3, 4], [5, 6, 7], [8]]


def test_confirms_in_pieces_settle_each_message() -> None:
    """Confirms arriving in pieces, out of order, settle their messages; the batch fires last."""
    world = World(BIG)
    node, publisher_id = ready(world)
    outcomes = tracked(world.publish_batch([f"m{i}" for i in range(5)]))
    node.of(sp.Publish)
    node.confirm(publisher_id, 3)
    node.confirm(publisher_id, 2, 5)
    assert outcomes == []
    node.confirm(publisher_id, 3, 4)  # 3 again: ignored
    assert outcomes == []
    node.confirm(publisher_id, 6)
    assert outcomes == [[Outcome.accepted()] * 5]
    assert world.upstream.publishers.unconfirmed == 0


def test_publish_errors_give_those_messages_their_own_outcome() -> None:
    """A PublishError for some ids answers those messages with its codes; the rest accepted."""
    world = World(BIG)
    node, publisher_id = ready(world)
    outcomes = tracked(world.publish_batch([f"m{i}" for i in range(5)]))
    node.of(sp.Publish)
    node.say(
        sp.PublishError(publisher_id=publisher_id, publishing_ids=[3, 5], codes=[6, 16]),
        sp.PublishConfirm(publisher_id=publisher_id, publishing_ids=[2, 4, 6]),
    )
    [results] = outcomes
    assert not isinstance(results, Failure)
    assert [(outcome.status, outcome.code) for outcome in results] == [
        (Status.ACCEPTED, None),
        (Status.RETRY, "6"),
        (Status.ACCEPTED, None),
        (Status.REJECTED, "16"),
        (Status.ACCEPTED, None),
    ]


def test_a_batch_over_max_queue_refuses_only_what_does_not_fit() -> None:
    """With room for 3 queued messages, a batch of 5 queues 3 and refuses the last 2 at once."""
    world = World(attrs.evolve(BIG, max_queue=3, max_unconfirmed=1))
    node, publisher_id = ready(world)
    tracked(world.publish_batch(["first"]))  # in flight: the queue stays empty
    outcomes = tracked(world.publish_batch([f"m{i}" for i in range(5)]))
    assert world.upstream.publishers.queued == 3
    node.confirm(publisher_id, 2)
    node.confirm(publisher_id, 3)
    node.confirm(publisher_id, 4)
    node.confirm(publisher_id, 5)
    [results] = outcomes
    assert not isinstance(results, Failure)
    assert [outcome.status for outcome in results] == [Status.ACCEPTED] * 3 + [Status.RETRY] * 2
    assert "queued already" in results[3].reason


def test_a_batch_to_several_streams_is_answered_in_its_order() -> None:
    """Without a fixed stream, each address gets its publisher; outcomes keep the batch's order."""
    world = World(attrs.evolve(BIG, stream=None))
    node = world.open()
    messages = [Message(body=b"x", address=address, id=str(i)) for i, address in enumerate("abab")]
    outcomes = tracked(world.upstream.deliver(messages))
    first, second = node.of(sp.DeclarePublisher)
    assert (first.stream, second.stream) == ("a", "b")
    node.say(
        *(
            sp.Response(key=sp.Key.DECLARE_PUBLISHER, correlation_id=d.correlation_id, code=1)
            for d in (first, second)
        )
    )
    queries = node.of(sp.QueryPublisherSequence)
    node.say(
        *(
            sp.QueryPublisherSequenceResponse(correlation_id=q.correlation_id, code=1, sequence=0)
            for q in queries
        )
    )
    frames = node.of(sp.Publish)
    assert [(frame.publisher_id, list(frame.publishing_ids)) for frame in frames] == [
        (first.publisher_id, [1, 2]),
        (second.publisher_id, [1, 2]),
    ]
    node.confirm(second.publisher_id, 1, 2)
    node.say(sp.PublishError(publisher_id=first.publisher_id, publishing_ids=[2], codes=[2]))
    assert outcomes == []
    node.confirm(first.publisher_id, 1)
    [results] = outcomes
    assert not isinstance(results, Failure)
    assert [outcome.status for outcome in results] == [
        Status.ACCEPTED,
        Status.ACCEPTED,
        Status.REJECTED,
        Status.ACCEPTED,
    ]


def test_the_router_deadline_answers_what_is_known_and_forgets_the_rest() -> None:
    """Cut by the route's deadline: the confirmed are accepted, only the others retry.

    ``max_unconfirmed`` 4 holds 2 of the 6 messages in the queue until
    confirms make room. At the deadline the 3 confirmed are accepted and the
    3 unconfirmed are answered "retry later" by the route's time-out; the
    counts are back to 0 and a late confirm changes nothing.
    """
    world = World(attrs.evolve(BIG, max_unconfirmed=4))
    world.upstream.router.replace_table(
        bind_routes([CONSUMED, PUBLISHED], {SINK: world.sink, UPSTREAM: world.upstream})
    )
    node, publisher_id = ready(world)
    messages = [Message(body=b"x", address="out", id=f"m{i}") for i in range(6)]
    results = tracked(world.upstream.router.dispatch("src", messages))
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [2, 3, 4, 5]
    assert world.upstream.publishers.queued == 2
    node.confirm(publisher_id, 2, 4)
    assert ids_of(node) == ["m4", "m5"]  # room for the queued two, which go out now
    world.reactor.advance(4.9)
    assert results == []
    node.confirm(publisher_id, 6)
    world.reactor.advance(0.1)
    [answered] = results
    assert not isinstance(answered, Failure)
    assert [result.status for result in answered if isinstance(result, Outcome)] == [
        Status.ACCEPTED,
        Status.RETRY,
        Status.ACCEPTED,
        Status.RETRY,
        Status.ACCEPTED,
        Status.RETRY,
    ]
    late = answered[1]
    assert isinstance(late, Outcome) and "within 5 seconds" in late.reason
    assert world.upstream.publishers.queued == 0
    node.confirm(publisher_id, 3, 5, 7)  # late: nothing changes, nothing more is sent
    assert node.of(sp.Publish) == []
    assert world.upstream.publishers.unconfirmed == 0


def test_the_deadline_drops_what_is_still_queued() -> None:
    """A batch cut while its messages wait for max_unconfirmed: they are never published."""
    world = World(attrs.evolve(BIG, max_unconfirmed=2))
    world.upstream.router.replace_table(
        bind_routes([CONSUMED, PUBLISHED], {SINK: world.sink, UPSTREAM: world.upstream})
    )
    node, publisher_id = ready(world)
    messages = [Message(body=b"x", address="out", id=f"m{i}") for i in range(5)]
    results = tracked(world.upstream.router.dispatch("src", messages))
    assert ids_of(node) == ["m0", "m1"]
    world.reactor.advance(5)
    [answered] = results
    assert not isinstance(answered, Failure)
    assert all(isinstance(r, Outcome) and r.status is Status.RETRY for r in answered)
    assert world.upstream.publishers.queued == 0
    node.confirm(publisher_id, 2, 3)
    assert node.of(sp.Publish) == []
    after = tracked(world.publish("next"))
    assert ids_of(node) == ["next"]
    node.confirm(publisher_id, 4)
    assert status(after) is Status.ACCEPTED


def test_a_dropped_connection_resends_only_the_unconfirmed_of_a_batch_with_their_ids() -> None:
    """Mid-batch the connection ends: after the reconnect only the unconfirmed go again, same ids.

    Of 6 messages (ids 2 to 7), 2 and 3 were confirmed before the drop and the
    broker's sequence says it stored up to 5: 4 and 5 are accepted from it,
    6 and 7 are published again in one frame with their ids and entries.
    """
    world = World(BIG)
    node, publisher_id = ready(world)
    names = [f"m{i}" for i in range(6)]
    outcomes = tracked(world.publish_batch(names))
    node.of(sp.Publish)
    node.confirm(publisher_id, 2, 3)
    node.lose()
    world.reactor.advance(0.5)
    node = world.open(sequence=5)
    frames = node.of(sp.Publish)
    assert [list(frame.publishing_ids) for frame in frames] == [[6, 7]]
    assert [bytes(entry) for entry in frames[0].messages] == entries_of(names[4:])
    assert outcomes == []
    node.confirm(publisher_id, 6, 7)
    assert outcomes == [[Outcome.accepted()] * 6]


def test_a_deliver_chunk_reaches_the_router_as_one_batch() -> None:
    """The N entries of a Deliver chunk are one batch for the routes (and credit comes once)."""
    world = consuming()
    node = world.open()
    node.deliver_chunk(0, 0, b"a", b"b", b"c", b"d")
    assert [[m.body for m in batch] for batch in world.sink.batches] == [[b"a", b"b", b"c", b"d"]]
    assert [m.id for m in world.sink.messages] == ["a", "b", "c", "d"]
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]
    node.deliver_chunk(0, 4, b"e")
    assert [len(batch) for batch in world.sink.batches] == [4, 1]


def test_a_chunk_with_partial_refusals_is_settled_once_all_have_outcomes() -> None:
    """Some entries refused, some accepted later: credit and the stored offset wait for all."""
    world = consuming()
    node = world.open()
    world.sink.auto = False
    node.deliver_chunk(0, 0, b"a", b"b", b"c")
    world.sink.answer(1, Outcome.rejected("no"))
    world.sink.answer(0, Outcome.accepted())
    world.reactor.advance(5)
    assert node.of(sp.Credit) == []
    assert node.of(sp.StoreOffset) == []
    world.sink.answer(2, Outcome.retry("later"))
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]
    world.reactor.advance(5)
    assert [event.offset for event in node.of(sp.StoreOffset)] == [2]


def test_an_unrouted_chunk_is_settled_at_once() -> None:
    """Entries no route takes are counted and the chunk settled: credit comes back at once."""
    world = consuming()
    world.upstream.router.replace_table(bind_routes([], {}))
    node = world.open()
    node.deliver_chunk(0, 0, b"a", b"b")
    assert world.sink.messages == []
    assert node.of(sp.Credit) == [sp.Credit(subscription_id=0, credit=1)]
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="unrouted") == 2


BATCH = 6
"""Messages in the property's batch (publishing ids 2 to 7 after the warm-up's 1)."""
PUBLISH_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("confirm"), st.lists(st.integers(1, 2 * BATCH + 2), max_size=BATCH)),
        st.tuples(
            st.just("error"),
            st.lists(
                st.tuples(st.integers(1, 2 * BATCH + 2), st.sampled_from([2, 6, 16, 18])),
                max_size=3,
                unique_by=lambda pair: pair[0],
            ),
        ),
        st.tuples(st.just("drop"), st.integers(0, BATCH + 1)),
    ),
    max_size=8,
)


def play(events: list[tuple[Any, ...]], max_unconfirmed: int, *, batched: bool) -> list[Any]:
    """Publish BATCH messages (one batch, or one batch each), play ``events``, confirm the rest.

    Returns each message's (status, code, reason), in order.
    """
    world = World(attrs.evolve(BIG, max_unconfirmed=max_unconfirmed))
    node, publisher_id = ready(world)
    names = [f"m{i}" for i in range(BATCH)]
    if batched:
        whole = tracked(world.publish_batch(names))
    else:
        each = [tracked(world.publish(name)) for name in names]
    for kind, argument in events:
        if kind == "confirm":
            node.confirm(publisher_id, *argument)
        elif kind == "error":
            node.say(
                sp.PublishError(
                    publisher_id=publisher_id,
                    publishing_ids=[i for i, _ in argument],
                    codes=[code for _, code in argument],
                )
            )
        else:
            node.lose()
            world.reactor.advance(0.5)
            node = world.open(sequence=argument)
    for _ in range(BATCH + 1):  # the broker confirms whatever is still in flight
        node.confirm(publisher_id, *range(1, 3 * BATCH))
    outcomes = [] if batched else [results[0] for results in each]
    if batched:
        [outcomes] = whole
    assert len(outcomes) == BATCH
    return [(outcome.status, outcome.code, outcome.reason) for outcome in outcomes]


@settings(max_examples=150, deadline=None)
@given(events=PUBLISH_EVENTS, max_unconfirmed=st.integers(1, BATCH + 1))
def test_a_batch_gets_the_outcomes_one_message_at_a_time_would(
    events: list[tuple[Any, ...]], max_unconfirmed: int
) -> None:
    """Any confirms, errors and drops: a batch's outcomes are those of batches of one."""
    assert play(events, max_unconfirmed, batched=True) == play(
        events, max_unconfirmed, batched=False
    )


# --- the route into a listener's own streams (bridge.StreamDestination) ---------------------


@pytest_twisted.ensureDeferred
async def test_a_deadline_before_the_commit_is_the_routes_time_out_not_an_error(
    tmp_path: Path,
) -> None:
    """A batch into a local stream cut by its route's deadline: a time-out, no failure logged.

    The append goes on in the log's writer thread; the sender is told to
    retry by the route's own time-out, and nothing is logged as a failure.
    """
    store = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER)
    store.open()
    try:
        destination = StreamDestination("streams", store)
        clock = Clock()
        route = Route(
            name="into-log",
            source="src",
            pattern=AddressPattern("#"),
            destination="streams",
            timeout_seconds=5.0,
        )
        router = Router(bind_routes([route], {"streams": destination}), clock)
        messages = [Message(body=b"x", address="local", id=f"m{i}") for i in range(3)]
        with capturedLogs() as events:
            results = tracked(router.dispatch("src", messages))
            clock.advance(5)  # before the writer thread's commit can be answered
        [answered] = results
        assert not isinstance(answered, Failure)
        assert [result.status for result in answered if isinstance(result, Outcome)] == [
            Status.RETRY
        ] * 3
        assert all(
            isinstance(result, Outcome) and "within 5 seconds" in result.reason
            for result in answered
        )
        assert [event for event in events if event.get("log_failure")] == []
    finally:
        await store.close()


def test_a_connection_ending_before_tune_leaves_no_unhandled_error(world: World) -> None:
    """A login refused before Tune: the wait for Tune ends without a failure left in it.

    Nothing awaits Tune once the login failed; a failure left in that
    Deferred is logged as "Unhandled error in Deferred" whenever it is
    collected, which may be much later (the log buffer keeps the connection).
    """
    world.upstream.start()
    node = world.accept()
    node.login(code=8)
    node.lose()
    tune = node.protocol.tuned()
    assert tune.called
    assert not isinstance(tune.result, Failure)
