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

from gateway.codecs import dmp
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.batch import deliver_each
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.server import DMPServerFactory, DMPServerProtocol
from gateway.protocols.dmp.settings import DMPListenerSettings, LeaseGrant

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
SECRETS = Secrets(logins={"writer": b"W-1", "reader": b"R-1", "old": b"O-1", "gone": b"G-1"})


@attrs.define
class Recorder:
    """A route destination that records messages and answers accepted."""

    messages: list[Message] = attrs.Factory(list)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Record it."""
        self.messages.append(message)
        return succeed(Outcome.accepted())


class Listener:
    """A DMP listener with routes: sink ``orders`` to a recorder; ``to-feed`` into ``alerts``."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.metrics = GatewayMetrics()
        self.recorder = Recorder()
        self.router = Router(bind_routes([], {}), self.clock, self.metrics)
        self.factory = DMPServerFactory(
            name="dmp",
            settings=SETTINGS,
            router=self.router,
            secrets=SECRETS,
            clock=self.clock,
            metrics=self.metrics,
        )
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

    def connect(self) -> tuple[DMPServerProtocol, StringTransport]:
        """A new connection."""
        protocol = self.factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def opened(self, lease: bytes) -> tuple[DMPServerProtocol, StringTransport, list[object]]:
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
    outcome = listener.router.dispatch_one(
        "app",
        Message(
            id="q1",
            address="x",
            body=b"hello",
            sender="a@b",
            headers={"x-gateway-recipients": "c@d,e@f"},
        ),
    )
    assert isinstance(outcome, Deferred)
    results: list[Outcome] = []
    outcome.addCallback(results.append)
    assert results[0].status is Status.ACCEPTED
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
    again = listener.router.dispatch_one("app", Message(address="x", body=b"later"))
    assert isinstance(again, Deferred)
    again.addCallback(results.append)
    assert results[1].status is Status.RETRY and "no reader" in results[1].reason
    assert listener.opened(b"R-1")[2][-1].code == 200  # type: ignore[attr-defined]


def test_feed_heartbeats_and_backpressure() -> None:
    """Null messages every heartbeat; a reader that does not read holds messages, then refuses."""
    listener = Listener()
    reader, transport, _ = listener.opened(b"R-1")
    listener.clock.advance(5)
    assert transport.value() == dmp.HEARTBEAT_BYTES
    transport.clear()
    reader.pauseProducing()
    big = Message(address="alerts", body=b"x" * 60_000)
    outcomes = [reader.deliver(big) for _ in range(80)]
    assert transport.value() == b""
    assert outcomes[0].status is Status.ACCEPTED
    assert outcomes[-1].status is Status.RETRY and "behind" in outcomes[-1].reason
    reader.resumeProducing()
    assert transport.value().count(b"x" * 60_000) == sum(o.is_accepted for o in outcomes)


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
    listener.clock.advance(30)
    assert not transport.disconnecting  # it was heard in the last period
    listener.clock.advance(30)
    assert transport.disconnecting and listener.errors("idle-timeout") == 1
    del writer


def test_unknown_feed_is_rejected() -> None:
    """A route to a feed that does not exist is rejected, not retried."""
    listener = Listener()
    outcome = listener.factory.deliver_one(Message(address="nowhere", body=b"x"))
    results: list[Outcome] = []
    outcome.addCallback(results.append)
    assert results[0].status is Status.REJECTED


def test_a_stalled_reader_is_closed_after_the_idle_timeout() -> None:
    """A feed reader reading nothing for idle_timeout_seconds is closed; one that resumes is not."""
    listener = Listener()
    reader, transport, _ = listener.opened(b"R-1")
    reader.pauseProducing()
    listener.clock.advance(25)
    reader.resumeProducing()  # it read again in time
    listener.clock.advance(5)
    assert not transport.disconnecting
    reader.pauseProducing()
    for _ in range(5):
        listener.clock.advance(5)
    assert not transport.disconnecting
    listener.clock.advance(5)  # 30 s without reading
    assert transport.disconnecting and listener.errors("reader-stalled") == 1
    assert "alerts" not in listener.factory.readers
