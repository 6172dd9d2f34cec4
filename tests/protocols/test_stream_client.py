"""Tests for `gateway.protocols.stream.client`: the stream upstream against a scripted broker.

The upstream connects through a `MemoryReactorClock`; the test accepts each
connection on a `StringTransport` and plays the broker with the sans-IO codec
in the server role: it reads the frames the upstream wrote and answers them
frame by frame. Time (reconnect backoff, heartbeats, offset storing, route
time-outs) is the same clock, advanced by the tests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.client import StreamClientProtocol, StreamUpstream
from gateway.protocols.stream.mapping import entry_from_message, message_from_entry
from gateway.protocols.stream.settings import StreamUpstreamSettings

T = TypeVar("T")
E = TypeVar("E")

UPSTREAM = "rabbit"
HOST, PORT = "10.0.0.1", 5552
SETTINGS = StreamUpstreamSettings(
    stream="ticks",
    batch_size=3,
    max_unconfirmed=5,
    max_queue=8,
    heartbeat_seconds=10,
    store_offset_interval_seconds=2.0,
)


DEFAULT_TUNE = sp.Tune(frame_max=1_048_576, heartbeat=60)


class Broker:
    """One accepted connection, with the test playing the broker."""

    def __init__(self, protocol: StreamClientProtocol, transport: StringTransport) -> None:
        self.protocol = protocol
        self.transport = transport
        self._codec = sp.StreamCodec(sp.Role.SERVER, frame_max=0)
        self._unread: list[sp.Event] = []

    def frames(self) -> list[sp.Event]:
        """Every frame the upstream wrote that the test has not read yet."""
        data: bytes = self.transport.value()
        self.transport.clear()
        frames = self._unread + self._codec.receive_data(data)
        self._unread = []
        return frames

    def expect(self, kind: type[E]) -> E:
        """The next frame, which must be a ``kind``."""
        if not self._unread:
            self._unread = self.frames()
        assert self._unread, f"expected a {kind.__name__}, the upstream wrote nothing"
        frame = self._unread.pop(0)
        assert isinstance(frame, kind), f"expected a {kind.__name__}, got {frame!r}"
        return frame

    def send(self, *events: sp.Event) -> None:
        """Frames from the broker, as the reactor would deliver them."""
        self.protocol.dataReceived(b"".join(sp.encode(event) for event in events))

    def answer(self, request: Any, code: int = 1) -> None:
        """Answer a request that gets a plain response with ``code``."""
        key = sp.Key[_KEYS[type(request)]]
        self.send(sp.Response(key=key, correlation_id=request.correlation_id, code=code))

    def handshake(
        self,
        *,
        streams: Sequence[str] = ("ticks",),
        leader: tuple[str, int] = (HOST, PORT),
        tune: sp.Tune = DEFAULT_TUNE,
        login: int = 1,
    ) -> sp.SaslAuthenticate:
        """Play the broker through peer properties, SASL, tune, open and metadata."""
        asked = self.expect(sp.PeerProperties)
        self.send(
            sp.PeerPropertiesResponse(correlation_id=asked.correlation_id, code=1, properties={})
        )
        mechanisms = self.expect(sp.SaslHandshake)
        self.send(
            sp.SaslHandshakeResponse(
                correlation_id=mechanisms.correlation_id, code=1, mechanisms=("PLAIN", "AMQPLAIN")
            )
        )
        plain = self.expect(sp.SaslAuthenticate)
        self.send(
            sp.SaslAuthenticateResponse(
                correlation_id=plain.correlation_id, code=login, challenge=None
            )
        )
        if login != 1:
            return plain
        self.send(tune)
        self.expect(sp.Tune)
        opened = self.expect(sp.Open)
        self.send(sp.OpenResponse(correlation_id=opened.correlation_id, code=1, properties={}))
        if streams:
            metadata = self.expect(sp.Metadata)
            assert tuple(metadata.streams) == tuple(streams)
            self.send(
                sp.MetadataResponse(
                    correlation_id=metadata.correlation_id,
                    brokers=(sp.Broker(reference=0, host=leader[0], port=leader[1]),),
                    streams=tuple(
                        sp.StreamMetadata(stream=name, code=1, leader=0, replicas=())
                        for name in streams
                    ),
                )
            )
        return plain

    def declared(self, sequence: int = 0, publisher_id: int = 0) -> sp.DeclarePublisher:
        """Accept the next DeclarePublisher and answer the sequence query with ``sequence``."""
        declare = self.expect(sp.DeclarePublisher)
        assert declare.publisher_id == publisher_id
        self.answer(declare)
        query = self.expect(sp.QueryPublisherSequence)
        assert query.reference == declare.reference
        self.send(
            sp.QueryPublisherSequenceResponse(
                correlation_id=query.correlation_id, code=1, sequence=sequence
            )
        )
        return declare

    def published(self) -> list[sp.Publish]:
        """The Publish frames written since the last read (nothing else may be there)."""
        frames = self.frames()
        assert all(isinstance(frame, sp.Publish) for frame in frames), frames
        return frames  # type: ignore[return-value]

    def lose(self) -> None:
        """The connection goes away."""
        self.protocol.connectionLost(Failure(ConnectionLost("gone")))


_KEYS = {
    sp.DeclarePublisher: "DECLARE_PUBLISHER",
    sp.Create: "CREATE",
    sp.Subscribe: "SUBSCRIBE",
}


@attrs.define
class Recorder:
    """A route destination recording what the upstream consumed."""

    messages: list[Message] = attrs.Factory(list)
    name: str = "sink"
    answers: list[Deferred[Outcome]] = attrs.Factory(list)
    hold: bool = False

    def deliver(self, message: Message) -> Deferred[Outcome]:
        """Record; answer accepted at once unless holding."""
        self.messages.append(message)
        answer: Deferred[Outcome] = Deferred()
        if self.hold:
            self.answers.append(answer)
        else:
            answer.callback(Outcome.accepted())
        return answer


class World:
    """A stream upstream, a router around it, a clock and metrics."""

    def __init__(self, settings: StreamUpstreamSettings = SETTINGS, secret: bytes | None = None):
        self.clock = MemoryReactorClock()
        self.metrics = GatewayMetrics()
        self.sink = Recorder()
        self.upstream = StreamUpstream(
            name=UPSTREAM,
            settings=settings,
            endpoint=TCP4ClientEndpoint(self.clock, HOST, PORT),
            router=Router(bind_routes([], {}), self.clock, self.metrics),
            secrets=Secrets(upstreams={UPSTREAM: secret} if secret else {}),
            clock=self.clock,
            reactor=self.clock,
            metrics=self.metrics,
        )
        routes = [
            Route(
                name="in",
                source=UPSTREAM,
                pattern=AddressPattern("#"),
                destination="sink",
                timeout_seconds=30.0,
            )
        ]
        self.upstream.router.replace_table(
            bind_routes(routes, {UPSTREAM: self.upstream, "sink": self.sink})  # type: ignore[dict-item]
        )
        self.connections = 0

    def accept(self) -> Broker:
        """Accept the connection the upstream is making now."""
        attempts = self.clock.tcpClients
        assert len(attempts) > self.connections, "the upstream is not connecting"
        host, port, factory, _timeout, _bind = attempts[self.connections]
        self.connections += 1
        self.last_address = (host, port)
        transport = StringTransport(peerAddress=IPv4Address("TCP", host, port))
        protocol = factory.buildProtocol(None)
        protocol.makeConnection(transport)
        return Broker(
            protocol.wrappedProtocol if hasattr(protocol, "wrappedProtocol") else protocol,
            transport,
        )

    def refuse(self) -> None:
        """Fail the connection attempt the upstream is making now."""
        _host, _port, factory, _timeout, _bind = self.clock.tcpClients[self.connections]
        self.connections += 1
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError("refused")))

    def connected(self, **handshake: Any) -> Broker:
        """Start the upstream and complete a handshake."""
        self.upstream.start()
        broker = self.accept()
        broker.handshake(**handshake)
        assert self.upstream.connected
        return broker

    def send(self, body: bytes, address: str = "ticks") -> Deferred[Outcome]:
        """Deliver one message to the upstream."""
        return self.upstream.deliver(Message(id=body.decode(), address=address, body=body))

    def sample(self, name: str, **labels: str) -> float:
        """A metric's value (0 when never set)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def result(deferred: Deferred[T]) -> T:
    """The result of a Deferred that must have fired successfully."""
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    assert not isinstance(results[0], Failure), results[0]
    return results[0]  # type: ignore[no-any-return]


def bodies(publish: sp.Publish) -> list[bytes]:
    """The message bodies of a Publish frame."""
    return [
        message_from_entry(bytes(m), stream="ticks", timestamp=0.0).body for m in publish.messages
    ]


def chunk(first_offset: int, bodies: Sequence[bytes]) -> bytes:
    """A user chunk of AMQP entries, as a broker delivers it."""
    entries = [
        entry_from_message(Message(id=f"m{first_offset + i}", address="in", body=body))
        for i, body in enumerate(bodies)
    ]
    return osiris.encode_chunk(entries, first_offset=first_offset, timestamp_ms=1_700_000_000_000)


# --- handshake -------------------------------------------------------------------------------


def test_handshake_logs_in_with_the_secret_and_tunes_to_the_smaller_values() -> None:
    """PLAIN with the upstream's secret; frame max and heartbeat are the smaller of both."""
    world = World(
        attrs.evolve(SETTINGS, username="gw", frame_max=65536, heartbeat_seconds=10), b"pw"
    )
    world.upstream.start()
    broker = world.accept()
    plain = broker.handshake(tune=sp.Tune(frame_max=1_048_576, heartbeat=60))
    assert plain.mechanism == "PLAIN" and plain.data == b"\0gw\0pw"
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 1


def test_zero_means_no_limit_on_either_side() -> None:
    """A broker tuning 0 (no limit) leaves our own values."""
    world = World()
    world.upstream.start()
    broker = world.accept()
    asked = broker.expect(sp.PeerProperties)
    broker.send(
        sp.PeerPropertiesResponse(correlation_id=asked.correlation_id, code=1, properties={})
    )
    hs = broker.expect(sp.SaslHandshake)
    broker.send(
        sp.SaslHandshakeResponse(correlation_id=hs.correlation_id, code=1, mechanisms=("PLAIN",))
    )
    auth = broker.expect(sp.SaslAuthenticate)
    assert auth.data == b"\0guest\0guest"  # guest without a secret
    broker.send(
        sp.SaslAuthenticateResponse(correlation_id=auth.correlation_id, code=1, challenge=None)
    )
    broker.send(sp.Tune(frame_max=0, heartbeat=0))
    assert broker.expect(sp.Tune) == sp.Tune(frame_max=SETTINGS.frame_max, heartbeat=10)


def test_refused_login_closes_and_retries_with_backoff() -> None:
    """Code 8 to SASL: the connection closes, the upstream tries again later, longer each time."""
    world = World()
    world.upstream.start()
    broker = world.accept()
    broker.handshake(login=8)
    assert broker.transport.disconnecting
    broker.lose()
    assert not world.upstream.connected
    assert (
        world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="auth-refused")
        == 1
    )
    assert len(world.clock.tcpClients) == 1
    world.clock.advance(0.5)
    assert len(world.clock.tcpClients) == 2
    world.refuse()
    world.clock.advance(0.99)
    assert len(world.clock.tcpClients) == 2
    world.clock.advance(0.01)
    assert len(world.clock.tcpClients) == 3


def test_not_connected_is_retry_later_at_once() -> None:
    """Before the handshake completes, a delivery is answered retry later."""
    world = World()
    world.upstream.start()
    outcome = result(world.send(b"early"))
    assert outcome.status is Status.RETRY and "not connected" in outcome.reason


def test_creates_streams_when_configured() -> None:
    """create_streams: Create before metadata; 1 and 5 (exists) are both fine."""
    world = World(attrs.evolve(SETTINGS, create_streams=True))
    world.upstream.start()
    broker = world.accept()
    broker.handshake(streams=())  # stops before metadata: Create comes first
    create = broker.expect(sp.Create)
    assert create.stream == "ticks"
    broker.answer(create, code=5)
    metadata = broker.expect(sp.Metadata)
    broker.send(
        sp.MetadataResponse(
            correlation_id=metadata.correlation_id,
            brokers=(sp.Broker(reference=0, host=HOST, port=PORT),),
            streams=(sp.StreamMetadata(stream="ticks", code=1, leader=0, replicas=()),),
        )
    )
    assert world.upstream.connected


def test_moves_to_a_leader_elsewhere() -> None:
    """Metadata naming another node: close and connect there."""
    world = World()
    world.upstream.start()
    broker = world.accept()
    broker.handshake(leader=("10.0.0.9", 5553))
    assert broker.transport.disconnecting and not world.upstream.connected
    broker.lose()
    world.clock.advance(0.5)
    # MemoryReactorClock resolves every name to 127.0.0.1: the port tells.
    assert world.clock.tcpClients[-1][1] == 5553


# --- publishing ------------------------------------------------------------------------------


def test_batches_within_batch_size_and_confirms_accept() -> None:
    """Messages of one turn share Publish frames of at most batch_size; confirms accept."""
    world = World()
    broker = world.connected()
    outcomes = [world.send(b"m%d" % i) for i in range(4)]
    declare = broker.declared()
    assert declare.stream == "ticks" and declare.reference == "msggateway.rabbit"
    world.clock.advance(0)
    frames = broker.published()
    assert [bodies(frame) for frame in frames] == [[b"m0", b"m1", b"m2"], [b"m3"]]
    assert [list(frame.publishing_ids) for frame in frames] == [[1, 2, 3], [4]]
    broker.send(sp.PublishConfirm(publisher_id=0, publishing_ids=[1, 2, 3, 4]))
    assert [result(o).status for o in outcomes] == [Status.ACCEPTED] * 4


def test_frames_stay_within_frame_max() -> None:
    """A Publish frame never outgrows the tuned frame max."""
    world = World(attrs.evolve(SETTINGS, batch_size=100, max_unconfirmed=100, max_queue=100))
    broker = world.connected(tune=sp.Tune(frame_max=4096, heartbeat=0))
    for i in range(20):
        world.send(bytes([65 + i]) * 500)
    broker.declared()
    world.clock.advance(0)
    frames = broker.published()
    assert len(frames) > 1
    assert all(len(sp.encode(frame)) <= 4096 for frame in frames)
    assert sum(len(frame.publishing_ids) for frame in frames) == 20


def test_unconfirmed_and_queue_limits() -> None:
    """At most max_unconfirmed in flight; past max_queue waiting, retry later at once."""
    world = World()
    broker = world.connected()
    outcomes = [world.send(b"m%d" % i) for i in range(9)]
    assert result(outcomes[8]).status is Status.RETRY  # 8 queued already
    broker.declared()
    world.clock.advance(0)
    sent = [i for frame in broker.published() for i in frame.publishing_ids]
    assert sent == [1, 2, 3, 4, 5]
    broker.send(sp.PublishConfirm(publisher_id=0, publishing_ids=[1, 2]))
    sent = [i for frame in broker.published() for i in frame.publishing_ids]
    assert sent == [6, 7]


@pytest.mark.parametrize(
    ("code", "status"),
    [(2, Status.REJECTED), (16, Status.REJECTED), (17, Status.REJECTED), (6, Status.RETRY)],
)
def test_publish_error_codes(code: int, status: Status) -> None:
    """Stream missing, access refused, precondition failed reject; the rest retry."""
    world = World()
    broker = world.connected()
    outcome = world.send(b"x")
    broker.declared()
    world.clock.advance(0)
    broker.published()
    broker.send(sp.PublishError(publisher_id=0, publishing_ids=[1], codes=[code]))
    answer = result(outcome)
    assert answer.status is status and f"code {code}" in answer.reason


def test_reconnect_resends_only_what_the_broker_lacks() -> None:
    """After a reconnect: ids up to the broker's sequence accepted, the rest resent as they were."""
    world = World()
    broker = world.connected()
    outcomes = [world.send(b"m%d" % i) for i in range(5)]
    broker.declared()
    world.clock.advance(0)
    broker.published()  # ids 1..5 in flight
    broker.lose()
    world.clock.advance(0.5)
    again = world.accept()
    again.handshake()
    again.declared(sequence=3)
    assert [result(o).status for o in outcomes[:3]] == [Status.ACCEPTED] * 3
    assert not outcomes[3].called
    frames = again.published()
    assert [list(f.publishing_ids) for f in frames] == [[4, 5]]
    assert bodies(frames[0]) == [b"m3", b"m4"]
    later = world.send(b"m5")
    world.clock.advance(0)
    assert [list(f.publishing_ids) for f in again.published()] == [[6]]
    again.send(sp.PublishConfirm(publisher_id=0, publishing_ids=[4, 5, 6]))
    assert [result(o).status for o in [*outcomes[3:], later]] == [Status.ACCEPTED] * 3


def test_a_refused_publisher_fails_its_queue_and_its_id_is_not_reused_while_taken() -> None:
    """DeclarePublisher refused: the queued messages get the code's outcome; ids stay unique."""
    world = World(attrs.evolve(SETTINGS, stream=None))
    broker = world.connected(streams=())
    first = world.send(b"a", address="one")
    second = world.send(b"b", address="two")
    declare_one = broker.expect(sp.DeclarePublisher)
    declare_two = broker.expect(sp.DeclarePublisher)
    assert (declare_one.publisher_id, declare_two.publisher_id) == (0, 1)
    broker.answer(declare_one, code=2)  # stream "one" does not exist
    assert result(first).status is Status.REJECTED
    third = world.send(b"c", address="three")
    declare_three = broker.expect(sp.DeclarePublisher)
    assert declare_three.publisher_id != 1  # publisher "two" still has it
    broker.answer(declare_two)
    query = broker.expect(sp.QueryPublisherSequence)
    broker.send(
        sp.QueryPublisherSequenceResponse(correlation_id=query.correlation_id, code=1, sequence=0)
    )
    world.clock.advance(0)
    (frame,) = broker.published()
    assert frame.publisher_id == 1 and bodies(frame) == [b"b"]
    assert not second.called and not third.called


# --- consuming -------------------------------------------------------------------------------


def consuming_world(**changes: Any) -> tuple[World, Broker, sp.Subscribe]:
    """An upstream subscribed to ``in`` (nothing stored yet), its broker and the Subscribe."""
    settings = attrs.evolve(SETTINGS, stream=None, subscribe=("in",), credit=2, **changes)
    world = World(settings)
    world.upstream.start()
    broker = world.accept()
    broker.handshake(streams=("in",))
    query = broker.expect(sp.QueryOffset)
    assert query.reference == world.upstream.consumer_name and query.stream == "in"
    broker.send(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=19, offset=0))
    subscribe = broker.expect(sp.Subscribe)
    broker.answer(subscribe)
    return world, broker, subscribe


def test_subscribes_from_the_configured_offset_and_grants_credit_after_outcomes() -> None:
    """First time: the configured offset; a chunk's messages are routed, then one credit."""
    world, broker, subscribe = consuming_world(offset="first", consumer_name="gw1")
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.FIRST)
    assert subscribe.credit == 2 and subscribe.properties == {"name": "gw1"}
    world.sink.hold = True
    broker.send(sp.Deliver(subscription_id=subscribe.subscription_id, chunk=chunk(0, [b"a", b"b"])))
    assert [m.body for m in world.sink.messages] == [b"a", b"b"]
    assert broker.frames() == []
    for answer in world.sink.answers:
        answer.callback(Outcome.accepted())
    assert broker.frames() == [sp.Credit(subscription_id=subscribe.subscription_id, credit=1)]


def test_offsets_stored_at_the_interval_and_at_stop() -> None:
    """StoreOffset every store_offset_interval_seconds when it moved, and once more at stop."""
    world, broker, subscribe = consuming_world(offset="first", consumer_name="gw1")
    broker.send(sp.Deliver(subscription_id=subscribe.subscription_id, chunk=chunk(0, [b"a", b"b"])))
    broker.frames()
    world.clock.advance(2.0)
    assert broker.frames() == [sp.StoreOffset(reference="gw1", stream="in", offset=1)]
    world.clock.advance(2.0)
    assert broker.frames() == []  # nothing new
    broker.send(sp.Deliver(subscription_id=subscribe.subscription_id, chunk=chunk(2, [b"c"])))
    broker.frames()
    stopped = world.upstream.stop()
    assert sp.StoreOffset(reference="gw1", stream="in", offset=2) in broker.frames()
    broker.lose()
    assert stopped.called


def test_resumes_after_the_stored_offset_and_skips_what_came_before() -> None:
    """A stored offset N: subscribe from N+1; a chunk starting before it is routed from N+1 on."""
    settings = attrs.evolve(SETTINGS, stream=None, subscribe=("in",), offset="first")
    world = World(settings)
    world.upstream.start()
    broker = world.accept()
    broker.handshake(streams=("in",))
    query = broker.expect(sp.QueryOffset)
    broker.send(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=1, offset=4))
    subscribe = broker.expect(sp.Subscribe)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=5)
    broker.answer(subscribe)
    broker.send(
        sp.Deliver(subscription_id=subscribe.subscription_id, chunk=chunk(3, [b"3", b"4", b"5"]))
    )
    assert [m.body for m in world.sink.messages] == [b"5"]


def test_a_bad_chunk_closes_the_connection() -> None:
    """A chunk whose CRC does not match is counted and the connection closed."""
    world, broker, subscribe = consuming_world()
    damaged = bytearray(chunk(0, [b"a"]))
    damaged[-1] ^= 0xFF
    broker.send(sp.Deliver(subscription_id=subscribe.subscription_id, chunk=bytes(damaged)))
    assert world.sink.messages == []
    assert broker.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="bad-crc") == 1


# --- connection life -------------------------------------------------------------------------


def test_heartbeats_and_a_silent_broker() -> None:
    """Heartbeats every tuned period; two silent periods close the connection."""
    world = World()
    broker = world.connected(tune=sp.Tune(frame_max=0, heartbeat=10))
    world.clock.advance(10)
    assert broker.frames() == [sp.Heartbeat()]
    broker.send(sp.Heartbeat())
    world.clock.advance(10)
    world.clock.advance(10)
    assert not broker.transport.disconnecting
    world.clock.advance(10)
    assert broker.transport.disconnecting


def test_the_broker_closing_is_answered() -> None:
    """A Close from the broker gets CloseResponse, then the upstream reconnects."""
    world = World()
    broker = world.connected()
    broker.send(sp.Close(correlation_id=7, code=1, reason="shutdown"))
    assert broker.frames() == [sp.CloseResponse(correlation_id=7, code=1)]
    assert broker.transport.disconnecting
    broker.lose()
    world.clock.advance(0.5)
    assert len(world.clock.tcpClients) == 2


# --- consumers on a replica ------------------------------------------------------------------


def metadata_with_replica(broker: Broker, stream: str, replica: tuple[str, int] | None) -> None:
    """Answer Metadata: the leader is where we are; ``replica`` (if any) elsewhere."""
    metadata = broker.expect(sp.Metadata)
    assert tuple(metadata.streams) == (stream,)
    nodes = [sp.Broker(reference=0, host=HOST, port=PORT)]
    if replica is not None:
        nodes.append(sp.Broker(reference=1, host=replica[0], port=replica[1]))
    broker.send(
        sp.MetadataResponse(
            correlation_id=metadata.correlation_id,
            brokers=tuple(nodes),
            streams=(
                sp.StreamMetadata(
                    stream=stream, code=1, leader=0, replicas=(1,) if replica else ()
                ),
            ),
        )
    )


def test_subscriptions_move_to_a_replica_and_publishing_stays_on_the_leader() -> None:
    """consume_from = replica: subscriptions get a link of their own, moved to a replica."""
    settings = attrs.evolve(SETTINGS, subscribe=("in",), consume_from="replica")
    world = World(settings)
    moved: list[tuple[str, int]] = []

    def relocate(host: str, port: int) -> TCP4ClientEndpoint:
        moved.append((host, port))
        return TCP4ClientEndpoint(world.clock, host, port)

    world.upstream = StreamUpstream(
        name=UPSTREAM,
        settings=settings,
        endpoint=TCP4ClientEndpoint(world.clock, HOST, PORT),
        router=world.upstream.router,
        secrets=Secrets(),
        clock=world.clock,
        reactor=world.clock,
        metrics=world.metrics,
        relocate=relocate,
    )
    world.upstream.start()
    publisher, consumer = world.accept(), world.accept()
    publisher.handshake(streams=("ticks",))  # the publishing link uses only its stream
    assert world.upstream.connected
    consumer.handshake(streams=())
    metadata_with_replica(consumer, "in", ("10.0.0.7", 5552))
    assert consumer.transport.disconnecting and moved == [("10.0.0.7", 5552)]
    consumer.lose()
    world.clock.advance(0.5)
    assert world.clock.tcpClients[-1][:2] == ("10.0.0.7", 5552)
    on_replica = world.accept()
    on_replica.handshake(streams=())
    metadata_with_replica(on_replica, "in", ("10.0.0.7", 5552))
    query = on_replica.expect(sp.QueryOffset)
    assert query.stream == "in"
    assert world.sample("msggateway_upstream_connected", upstream=f"{UPSTREAM}.consumer") == 1
    assert not publisher.transport.disconnecting


def test_a_stream_without_replicas_is_read_from_its_leader() -> None:
    """consume_from = replica on a single node: the consumer link stays on the leader."""
    settings = attrs.evolve(SETTINGS, stream=None, subscribe=("in",), consume_from="replica")
    world = World(settings)
    world.upstream.start()
    _publisher, consumer = world.accept(), world.accept()
    consumer.handshake(streams=())
    metadata_with_replica(consumer, "in", None)
    assert not consumer.transport.disconnecting
    assert consumer.expect(sp.QueryOffset).stream == "in"


def test_an_unreadable_sub_batch_is_skipped_not_fatal() -> None:
    """A sub-batch compressed with a codec the gateway lacks: what precedes it is routed, logged."""
    world, broker, subscribe = consuming_world()
    first = entry_from_message(Message(id="m0", address="in", body=b"readable"))
    body = b"\0\0\0\x01x"
    snappy = struct.pack(">BHII", 0x80 | 2 << 4, 1, len(body), len(body)) + body
    data = osiris.encode_mixed_entries([first, osiris.SubBatch.parse(snappy)])
    damaged = osiris.frame_chunk(
        data, num_entries=2, num_records=2, first_offset=0, timestamp_ms=1_700_000_000_000
    )
    with capturedLogs() as events:
        broker.send(sp.Deliver(subscription_id=subscribe.subscription_id, chunk=damaged))
    assert [m.body for m in world.sink.messages] == [b"readable"]
    assert not broker.transport.disconnecting
    assert broker.frames() == [sp.Credit(subscription_id=subscribe.subscription_id, credit=1)]
    assert [e["read"] for e in events if "skipping the rest" in e.get("log_format", "")] == [1]
