"""Tests for `gateway.protocols.dmp.server`: sinks and feeds over in-memory connections.

Each connection is a `StringTransport`; the test writes what a DMP client
would (bytes from the spec's dialog, envelopes from the codec) and reads
what the listener wrote. A `Clock` drives heartbeats and time-outs. Routes
take sink messages to a recording destination and deliver to the feeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from gateway.codecs import dmp
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.flow import DISCONNECT, FlowPolicy
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Result, Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.server import DMPServerFactory, DMPServerProtocol
from gateway.protocols.dmp.settings import DMPListenerSettings, LeaseGrant
from tests.doubles import NO_LOGIN_WAIT
from tests.protocols.test_dmp_principal import Listener as PrincipalListener

SETTINGS = DMPListenerSettings(
    sinks=frozenset({"orders"}),
    feeds=frozenset({"alerts"}),
    leases={
        "writer": LeaseGrant(kind="sink", target="orders"),
        "reader": LeaseGrant(kind="feed", target="alerts"),
        "old": LeaseGrant(kind="sink", target="orders", expires=50.0),
        "gone": LeaseGrant(kind="feed", target="removed"),
    },
    heartbeat_seconds=5.0,
    idle_timeout_seconds=30.0,
    max_envelope_bytes=4096,
)
SECRETS = Secrets(leases={"writer": b"W-1", "reader": b"R-1", "old": b"O-1", "gone": b"G-1"})


@attrs.define
class Recorder:
    """A route destination that records messages and answers accepted."""

    messages: list[Message] = attrs.Factory(list)

    batches: list[int] = attrs.Factory(list)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Record the batch (and its size); accept every message."""
        self.messages.extend(messages)
        self.batches.append(len(messages))
        return succeed([Outcome.accepted()] * len(messages))


@implementer(IDestination)
class Holder:
    """A route destination that keeps each batch waiting until the test answers it."""

    name = "holder"

    def __init__(self) -> None:
        self.batches: list[tuple[list[Message], Deferred[list[Outcome]]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; its Deferred fires when the test says (or the deadline cancels it)."""
        d: Deferred[list[Outcome]] = Deferred()
        self.batches.append((list(messages), d))
        return d


class WriteCountingTransport(StringTransport):
    """A `StringTransport` that also keeps each write apart, to count them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Keep the write, then buffer it as StringTransport does."""
        self.writes.append(data)
        super().write(data)  # type: ignore[no-untyped-call]


class Listener:
    """A DMP listener with routes: sink ``orders`` to a recorder; ``to-feed`` into ``alerts``."""

    def __init__(self, settings: DMPListenerSettings = SETTINGS) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.metrics = GatewayMetrics()
        self.recorder = Recorder()
        self.router = Router(bind_routes([], {}), self.clock, self.metrics)
        self.factory = DMPServerFactory(
            name="dmp",
            settings=settings,
            router=self.router,
            secrets=SECRETS,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits
        routes = [
            Route(name="sink", source="dmp", pattern=AddressPattern("orders.#"), destination="rec"),
            Route(
                name="feed",
                source="app",
                pattern=AddressPattern("#"),
                destination="dmp",
                target=AddressTemplate("alerts"),
            ),
        ]
        self.router.replace_table(
            bind_routes(routes, {"rec": self.recorder, "dmp": self.factory})  # type: ignore[dict-item]
        )

    def route_sink_to(self, destination: Holder, timeout_seconds: float) -> None:
        """Send sink ``orders`` to ``destination`` instead, with this route time-out."""
        route = Route(
            name="held",
            source="dmp",
            pattern=AddressPattern("orders.#"),
            destination=destination.name,
            timeout_seconds=timeout_seconds,
        )
        self.router.replace_table(bind_routes([route], {destination.name: destination}))

    def connect(self) -> tuple[DMPServerProtocol, WriteCountingTransport]:
        """A new connection."""
        protocol = self.factory.buildProtocol(None)
        transport = WriteCountingTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def opened(
        self, lease: bytes
    ) -> tuple[DMPServerProtocol, WriteCountingTransport, list[object]]:
        """Connect, send the header and a lease; return what the listener answered."""
        protocol, transport = self.connect()
        protocol.dataReceived(dmp.PROTOCOL_HEADER + bytes((len(lease),)) + lease)
        return protocol, transport, read(transport)

    def errors(self, kind: str) -> float:
        """The protocol error count of a kind."""
        value = self.metrics.registry.get_sample_value(
            "msggateway_protocol_errors_total", {"endpoint": "dmp", "kind": kind}
        )
        return value or 0.0

    def sample(self, name: str) -> float:
        """A metric of this listener (0 when never set)."""
        value = self.metrics.registry.get_sample_value(name, {"endpoint": "dmp"})
        return value or 0.0


def read(transport: StringTransport) -> list[object]:
    """Decode (client role) what the listener wrote since the last read."""
    data = transport.value()
    transport.clear()
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    events: list[object] = []
    # The client codec expects the two dialog responses first; after them, envelopes.
    while data:
        if not codec.flowing:
            size = 1 + data[0]
            events += codec.receive_data(data[:size])
            data = data[size:]
        else:
            events += codec.receive_data(data)
            data = b""
    return events


def test_sink_dialog_and_routing() -> None:
    """200 DMP/0.1, 200 Ready to write; envelopes are routed by sink and routing key."""
    listener = Listener()
    protocol, transport, answers = listener.opened(b"W-1")
    assert answers == [
        dmp.Response(200, "DMP/0.1", "OK"),
        dmp.Response(200, 'Ready to write to "orders"', "OK"),
    ]
    envelope = dmp.Envelope(
        routing_key="eu",
        properties=dmp.BasicProperties(
            message_id="m-1", headers={"x-gateway-sender": "app@example.org", "k": "v"}
        ),
        body=b"payload",
    )
    protocol.dataReceived(dmp.encode_envelope(envelope) + dmp.HEARTBEAT_BYTES)
    [message] = listener.recorder.messages
    assert (message.address, message.id, message.body) == ("orders.eu", "m-1", b"payload")
    assert message.sender == "app@example.org" and message.headers["k"] == "v"
    assert message.headers["dmp.routing-key"] == "eu"
    assert not transport.disconnecting


def test_many_writers_into_one_sink() -> None:
    """Sinks are not exclusive."""
    listener = Listener()
    writers = [listener.opened(b"W-1")[0] for _ in range(3)]
    for index, writer in enumerate(writers):
        writer.dataReceived(dmp.encode_envelope(dmp.Envelope(body=b"%d" % index)))
    assert [m.body for m in listener.recorder.messages] == [b"0", b"1", b"2"]


def test_bad_leases() -> None:
    """Unknown or expired: 402; a sink or feed that does not exist: 404; each closes."""
    listener = Listener()
    for lease, code in ((b"nope", 402), (b"O-1", 402), (b"G-1", 404)):
        _protocol, transport, answers = listener.opened(lease)
        assert [getattr(a, "code", None) for a in answers] == [200, code]
        assert transport.disconnecting
    assert listener.errors("bad-lease") == 2 and listener.errors("not-found") == 1


def test_one_reader_per_feed_and_delivery() -> None:
    """A second reader gets 403; routed messages reach the reader; a free feed takes the next."""
    listener = Listener()
    reader, transport, answers = listener.opened(b"R-1")
    assert answers[-1] == dmp.Response(200, 'Ready to read from "alerts"', "OK")
    _second, second_transport, second = listener.opened(b"R-1")
    assert second[-1].code == 403 and second_transport.disconnecting  # type: ignore[attr-defined]
    outcome = listener.router.dispatch(
        "app",
        [
            Message(
                id="q1",
                address="x",
                body=b"hello",
                sender="a@b",
                headers={"x-gateway-recipients": "c@d,e@f"},
            )
        ],
    )
    results: list[Result] = []
    outcome.addCallback(results.extend)
    assert isinstance(results[0], Outcome) and results[0].status is Status.ACCEPTED
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    codec.receive_data(b"\x0e200 OK DMP/0.1" + b"\x05200 X")
    [envelope] = codec.receive_data(transport.value())
    assert isinstance(envelope, dmp.Envelope)
    assert (envelope.routing_key, envelope.body) == ("alerts", b"hello")
    assert envelope.properties.message_id == "q1"
    assert envelope.properties.headers == {
        "x-gateway-sender": "a@b",
        "x-gateway-recipients": ["c@d", "e@f"],
    }
    reader.connectionLost()
    again = listener.router.dispatch("app", [Message(address="x", body=b"later")])
    again.addCallback(results.extend)
    assert isinstance(results[1], Outcome)
    assert results[1].status is Status.RETRY and "no reader" in results[1].reason
    assert listener.opened(b"R-1")[2][-1].code == 200  # type: ignore[attr-defined]


def test_feed_heartbeats_and_backpressure() -> None:
    """Null messages every heartbeat; a batch for a congested reader is answered once it drained.

    DMP has no acknowledgement: a message refused for the reader's backlog
    would be lost to a sink writer. The batch is written (the transport
    holds it) and its outcomes wait, so that the route's sources stop; no
    null message is written while the reader is behind.
    """
    listener = Listener()
    reader, transport, _ = listener.opened(b"R-1")
    listener.clock.advance(5)
    assert transport.value() == dmp.HEARTBEAT_BYTES
    transport.clear()
    reader.pauseProducing()
    big = Message(address="alerts", body=b"x" * 60_000)
    outcomes: list[Outcome] = []
    listener.factory.deliver([big] * 80).addCallback(outcomes.extend)
    assert transport.value().count(b"x" * 60_000) == 80  # written, held by the transport
    assert outcomes == []
    transport.clear()
    listener.clock.advance(5)
    assert transport.value() == b""  # no heartbeat while it is behind
    reader.resumeProducing()
    assert outcomes == [Outcome.accepted()] * 80
    listener.clock.advance(5)
    assert transport.value() == dmp.HEARTBEAT_BYTES


def test_a_sink_writer_feeding_a_congested_reader_is_not_read_until_it_drained() -> None:
    """Sink to feed through a route: the writer runs out of in-flight room and is paused."""
    settings = attrs.evolve(SETTINGS, max_in_flight=4)
    listener = Listener(settings)
    route = Route(
        name="relay",
        source="dmp",
        pattern=AddressPattern("orders.#"),
        destination="dmp",
        target=AddressTemplate("alerts"),
    )
    listener.router.replace_table(bind_routes([route], {"dmp": listener.factory}))  # type: ignore[dict-item]
    reader, reader_transport, _ = listener.opened(b"R-1")
    reader_transport.clear()
    writer, writer_transport, _ = listener.opened(b"W-1")
    reader.pauseProducing()
    writer.dataReceived(
        b"".join(dmp.encode_envelope(dmp.Envelope(body=b"%d" % n)) for n in range(4))
    )
    assert writer_transport.producerState == "paused"
    reader.resumeProducing()
    assert writer_transport.producerState == "producing"
    assert reader_transport.value().count(b"\x01") >= 4


def test_the_bad_feed_checks_still_apply_while_a_reader_is_congested() -> None:
    """What DMP cannot carry is rejected at once, the rest waits for the drain."""
    listener = Listener()
    reader, _transport, _ = listener.opened(b"R-1")
    reader.pauseProducing()
    outcomes: list[Outcome] = []
    too_big = Message(address="alerts", body=b"x", headers={"k" * 300: "v"})
    listener.factory.deliver([Message(address="alerts", body=b"ok"), too_big]).addCallback(
        outcomes.extend
    )
    assert outcomes == []
    reader.resumeProducing()
    assert [o.status for o in outcomes] == [Status.ACCEPTED, Status.REJECTED]


def test_bad_input_gets_its_answer() -> None:
    """A wrong header: 503 and close; an oversized envelope or a writing reader: close."""
    listener = Listener()
    protocol, transport = listener.connect()
    protocol.dataReceived(b"GET / HTTP/1.1\r\n")
    assert read(transport)[0].code == 503  # type: ignore[attr-defined]
    assert transport.disconnecting
    writer, transport, _ = listener.opened(b"W-1")
    writer.dataReceived(b"\x00\x01\x00\x00")
    assert transport.disconnecting and listener.errors("too-large") == 1
    reader, transport, _ = listener.opened(b"R-1")
    reader.dataReceived(dmp.encode_envelope(dmp.Envelope(body=b"no")))
    assert transport.disconnecting and listener.errors("write-to-feed") == 1
    assert "alerts" not in listener.factory.readers  # free for the next reader at once


def test_timeouts() -> None:
    """No lease within the handshake time-out, or a silent sink writer: closed."""
    listener = Listener()
    _protocol, transport = listener.connect()
    listener.clock.advance(10)
    assert transport.disconnecting and listener.errors("handshake-timeout") == 1
    writer, transport, _ = listener.opened(b"W-1")
    listener.clock.advance(29.9)
    assert not transport.disconnecting
    listener.clock.advance(0.1)  # 30 s after the lease, to the second
    assert transport.disconnecting and listener.errors("idle-timeout") == 1
    del writer


def test_a_sink_writer_heard_is_closed_idle_timeout_seconds_after_it_was_heard() -> None:
    """The idle time counts from the last read, not from the last check (no overshoot)."""
    listener = Listener()
    writer, transport, _ = listener.opened(b"W-1")
    listener.clock.advance(20)
    writer.dataReceived(dmp.HEARTBEAT_BYTES)
    listener.clock.advance(29.9)  # 49.9 s: the check at 30 s re-armed for the 20 s left
    assert not transport.disconnecting
    listener.clock.advance(0.1)
    assert transport.disconnecting


def test_unknown_feed_is_rejected() -> None:
    """A route to a feed that does not exist is rejected, not retried."""
    listener = Listener()
    outcome = listener.factory.deliver([Message(address="nowhere", body=b"x")])
    results: list[Outcome] = []
    outcome.addCallback(results.extend)
    assert results[0].status is Status.REJECTED


def test_a_stalled_reader_is_cut_after_slow_consumer_seconds() -> None:
    """A feed reader that drains nothing for slow_consumer_seconds is cut; one that drains is not.

    What waited for it is answered retry later (a durable route keeps it),
    and the feed is free for the next reader at once.
    """
    listener = Listener()
    listener.factory.flow = FlowPolicy(slow_consumer_seconds=30)
    reader, transport, _ = listener.opened(b"R-1")
    reader.pauseProducing()
    listener.clock.advance(25)
    reader.resumeProducing()  # it read again in time
    listener.clock.advance(5)
    assert not transport.disconnecting
    reader.pauseProducing()
    outcomes: list[Outcome] = []
    listener.factory.deliver([Message(address="alerts", body=b"x")]).addCallback(outcomes.extend)
    listener.clock.advance(29.5)
    assert not transport.disconnecting and outcomes == []
    listener.clock.advance(0.5)  # 30 s without draining
    assert transport.disconnected  # aborted: given up on, it keeps nothing unwritten
    assert listener.sample("msggateway_slow_consumer_disconnects_total") == 1
    assert "alerts" not in listener.factory.readers
    [outcome] = outcomes
    assert outcome.status is Status.RETRY and "before it read" in outcome.reason


def test_the_disconnect_policy_cuts_a_reader_past_the_cap_and_waits_for_nothing() -> None:
    """``disconnect``: answered at once; a reader past ``max_backlog_bytes`` is cut."""
    listener = Listener()
    listener.factory.flow = FlowPolicy(policy=DISCONNECT, max_backlog_bytes=100_000)
    reader, transport, _ = listener.opened(b"R-1")
    reader.pauseProducing()
    outcomes: list[Outcome] = []
    big = Message(address="alerts", body=b"x" * 60_000)
    listener.factory.deliver([big]).addCallback(outcomes.extend)
    assert outcomes == [Outcome.accepted()] and not transport.disconnected
    listener.factory.deliver([big, big]).addCallback(outcomes.extend)
    assert transport.disconnected
    assert listener.sample("msggateway_slow_consumer_disconnects_total") == 1


# --- half-sent frames (issue 18) ----------------------------------------------------------


def test_a_half_sent_envelope_is_aborted_at_the_frame_time_out() -> None:
    """A sink writer that sends 9 bytes of a 500-byte envelope is aborted 30 s later.

    Issue 18: with no idle time-out (the default), such a writer was still
    connected after 155 s.
    """
    listener = Listener(attrs.evolve(SETTINGS, idle_timeout_seconds=0.0))
    writer, transport, _ = listener.opened(b"W-1")
    envelope = dmp.encode_envelope(dmp.Envelope(routing_key="eu", body=b"x" * 480))
    assert 490 < len(envelope) < 510
    writer.dataReceived(envelope[:9])
    listener.clock.advance(29.9)
    assert not transport.disconnecting
    listener.clock.advance(0.1)
    assert transport.disconnected
    assert listener.errors("frame-timeout") == 1
    assert listener.recorder.messages == []


def test_an_envelope_finished_in_time_is_routed_and_the_writer_stays() -> None:
    """Slow but complete within the frame time-out: routed; a quiet writer then stays."""
    listener = Listener(attrs.evolve(SETTINGS, idle_timeout_seconds=0.0))
    writer, transport, _ = listener.opened(b"W-1")
    envelope = dmp.encode_envelope(dmp.Envelope(routing_key="eu", body=b"x" * 480))
    writer.dataReceived(envelope[:9])
    listener.clock.advance(29)
    writer.dataReceived(envelope[9:])
    assert len(listener.recorder.messages) == 1
    listener.clock.advance(3600)
    assert not transport.disconnecting


def test_a_half_sent_header_or_principal_frame_is_aborted() -> None:
    """Before the lease, and on a principal AMQP 0-9-1 connection, a half frame is timed out too."""
    listener = Listener(attrs.evolve(SETTINGS, handshake_timeout_seconds=60.0))
    protocol, transport = listener.connect()
    protocol.dataReceived(b"AMQ")
    listener.clock.advance(30)
    assert transport.disconnected and listener.errors("frame-timeout") == 1

    principal = PrincipalListener()
    opened, transport, _ = principal.logged_in()
    opened.dataReceived(b"\x01\x00\x01")  # a method frame's first octets
    principal.clock.advance(29.9)
    assert not transport.disconnecting  # open principal connections have no other time-out
    principal.clock.advance(0.1)
    assert transport.disconnected
    counted = principal.metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "dmp", "kind": "frame-timeout"}
    )
    assert counted == 1


# --- batches ----------------------------------------------------------------------------------


def envelopes(count: int, routing_key: str = "eu") -> bytes:
    """``count`` envelopes with bodies ``0``, ``1``..., heartbeats between them."""
    return dmp.HEARTBEAT_BYTES.join(
        dmp.encode_envelope(dmp.Envelope(routing_key=routing_key, body=b"%d" % index))
        for index in range(count)
    )


def test_a_sink_read_of_many_envelopes_reaches_the_router_as_one_batch() -> None:
    """The envelopes one read decoded (heartbeats between them) are one batch, in order."""
    listener = Listener()
    writer, _transport, _ = listener.opened(b"W-1")
    writer.dataReceived(envelopes(50))
    assert listener.recorder.batches == [50]
    assert [m.body for m in listener.recorder.messages] == [b"%d" % i for i in range(50)]
    writer.dataReceived(envelopes(2))
    assert listener.recorder.batches == [50, 2]  # each read its own batch: nothing waits to fill


def test_the_lease_and_the_first_envelopes_in_one_read_are_one_batch() -> None:
    """A writer that sends its header, lease and envelopes at once has them routed as one batch."""
    listener = Listener()
    writer, transport = listener.connect()
    writer.dataReceived(dmp.PROTOCOL_HEADER + b"\x03W-1" + envelopes(3))
    assert [getattr(a, "code", None) for a in read(transport)] == [200, 200]
    assert listener.recorder.batches == [3]


def test_envelopes_before_bad_input_are_routed_then_the_writer_is_closed() -> None:
    """Bad input mid-read: what was decoded before it is routed as one batch, then close."""
    listener = Listener()
    writer, transport, _ = listener.opened(b"W-1")
    writer.dataReceived(envelopes(3) + b"\x00\x01\x00\x00")
    assert listener.recorder.batches == [3]
    assert transport.disconnecting and listener.errors("too-large") == 1


def test_a_sink_batch_with_unrouted_messages_counts_each() -> None:
    """In one batch, routed messages are delivered together and each unrouted one is counted."""
    listener = Listener()
    eu_only = Route(name="eu", source="dmp", pattern=AddressPattern("orders.eu"), destination="rec")
    listener.router.replace_table(bind_routes([eu_only], {"rec": listener.recorder}))  # type: ignore[dict-item]
    writer, _transport, _ = listener.opened(b"W-1")
    writer.dataReceived(envelopes(2) + envelopes(3, routing_key="us"))
    assert listener.recorder.batches == [2]
    assert listener.errors("unrouted") == 3


def test_reading_pauses_while_a_batch_awaits_its_outcomes_and_the_deadline_frees_it() -> None:
    """Past max_in_flight, reading pauses; the route's deadline answers the batch and resumes it.

    The outcomes that were not accepted (the time-out's retry later) are
    counted, one per message: DMP has no way to tell the writer.
    """
    listener = Listener(attrs.evolve(SETTINGS, max_in_flight=4))
    holder = Holder()
    listener.route_sink_to(holder, timeout_seconds=5.0)
    writer, transport, _ = listener.opened(b"W-1")
    writer.dataReceived(envelopes(5))
    [(batch, _d)] = holder.batches
    assert len(batch) == 5
    assert transport.producerState == "paused"
    listener.clock.advance(5)
    assert transport.producerState == "producing"
    assert listener.errors("not-delivered") == 5


def test_outcomes_known_at_once_never_pause_reading() -> None:
    """A read larger than max_in_flight whose outcomes come at once leaves reading on."""
    listener = Listener(attrs.evolve(SETTINGS, max_in_flight=4))
    writer, transport, _ = listener.opened(b"W-1")
    paused: list[str] = []
    transport.pauseProducing = lambda: paused.append("paused")  # type: ignore[method-assign]
    writer.dataReceived(envelopes(10))
    assert listener.recorder.batches == [10]
    assert paused == []


def test_a_writer_that_leaves_mid_batch_has_its_batch_answered_quietly() -> None:
    """A sink writer gone while its batch awaits outcomes: they still count; nothing breaks."""
    listener = Listener(attrs.evolve(SETTINGS, max_in_flight=2))
    holder = Holder()
    listener.route_sink_to(holder, timeout_seconds=5.0)
    writer, transport, _ = listener.opened(b"W-1")
    writer.dataReceived(envelopes(3))
    assert transport.producerState == "paused"
    writer.connectionLost()
    [(_batch, d)] = holder.batches
    d.callback([Outcome.accepted(), Outcome.retry("busy"), Outcome.accepted()])
    assert listener.errors("not-delivered") == 1
    assert transport.producerState == "paused"  # a closed connection is not read again


def test_a_feed_batch_is_one_write_with_an_outcome_per_message() -> None:
    """The messages of a batch for one feed go to its reader in one write, in order."""
    listener = Listener()
    _reader, transport, _ = listener.opened(b"R-1")
    transport.writes.clear()
    d = listener.factory.deliver([Message(address="alerts", body=b"%d" % i) for i in range(20)])
    outcomes: list[Outcome] = []
    d.addCallback(outcomes.extend)
    assert outcomes == [Outcome.accepted()] * 20
    assert len(transport.writes) == 1
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    codec.receive_data(b"\x0e200 OK DMP/0.1" + b"\x05200 X")
    bodies = [e.body for e in codec.receive_data(transport.value()) if isinstance(e, dmp.Envelope)]
    assert bodies == [b"%d" % i for i in range(20)]


def test_a_feed_batch_with_partial_refusals() -> None:
    """One batch over several feeds: each message gets its own feed's answer, in order.

    A message DMP cannot carry (a message id of more than 255 bytes) is
    rejected and its neighbours still written, in one write for the reader.
    """
    listener = Listener(attrs.evolve(SETTINGS, feeds=frozenset({"alerts", "spare"})))
    _reader, transport, _ = listener.opened(b"R-1")
    transport.writes.clear()
    batch = [
        Message(address="alerts", body=b"a"),
        Message(address="nowhere", body=b"b"),
        Message(address="alerts", body=b"c", id="\u00e9" * 200),
        Message(address="spare", body=b"d"),
        Message(address="alerts", body=b"e"),
    ]
    outcomes: list[Outcome] = []
    listener.factory.deliver(batch).addCallback(outcomes.extend)
    assert [o.status for o in outcomes] == [
        Status.ACCEPTED,
        Status.REJECTED,
        Status.REJECTED,
        Status.RETRY,
        Status.ACCEPTED,
    ]
    assert "no feed named 'nowhere'" in outcomes[1].reason
    assert "cannot carry" in outcomes[2].reason
    assert "no reader" in outcomes[3].reason
    assert len(transport.writes) == 1
    assert transport.value().count(b"\x01a") + transport.value().count(b"\x01e") == 2


def test_a_feed_reader_that_leaves_mid_batch_gets_nothing_more() -> None:
    """A reader gone before it drained: its batch is retry later, and so is the next (no reader)."""
    listener = Listener()
    reader, _transport, _ = listener.opened(b"R-1")
    reader.pauseProducing()
    outcomes: list[Outcome] = []
    listener.factory.deliver([Message(address="alerts", body=b"x")] * 3).addCallback(
        outcomes.extend
    )
    assert outcomes == []  # waiting for the reader to drain
    reader.connectionLost()
    assert [o.status for o in outcomes] == [Status.RETRY] * 3
    listener.factory.deliver([Message(address="alerts", body=b"y")] * 2).addCallback(
        outcomes.extend
    )
    assert [o.status for o in outcomes[3:]] == [Status.RETRY] * 2
    assert all("no reader" in o.reason for o in outcomes[3:])


def test_an_empty_batch_is_answered_at_once() -> None:
    """A batch of no messages answers an empty list."""
    listener = Listener()
    outcomes: list[list[Outcome]] = []
    listener.factory.deliver([]).addCallback(outcomes.append)
    assert outcomes == [[]]
