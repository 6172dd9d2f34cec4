"""Tests for `gateway.protocols.dmp.client`: the DMP upstream against a scripted server.

The upstream's protocol runs over a `StringTransport`; the test plays the
server with the sans-IO codec (server role), and drives time with a `Clock`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import dmp
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.client import MAX_IN_FLIGHT, DMPClientProtocol, DMPUpstream
from gateway.protocols.dmp.settings import DMPUpstreamSettings


@attrs.define
class Recorder:
    """A route destination recording what the upstream read."""

    messages: list[Message] = attrs.Factory(list)

    batches: list[int] = attrs.Factory(list)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Record the batch (and its size); accept every message."""
        self.messages.extend(messages)
        self.batches.append(len(messages))
        return succeed([Outcome.accepted()] * len(messages))


def upstream(mode: str = "put", **changes: object) -> tuple[DMPUpstream, Recorder, Clock]:
    """An upstream with lease ``L-1`` and a route from it to a recorder."""
    clock = Clock()
    metrics = GatewayMetrics()
    recorder = Recorder()
    router = Router(bind_routes([], {}), clock, metrics)
    made = DMPUpstream(
        name="remote",
        settings=DMPUpstreamSettings(mode=mode, heartbeat_seconds=5.0, **changes),  # type: ignore[arg-type]
        endpoint=TCP4ClientEndpoint(clock, "127.0.0.1", 1),  # type: ignore[arg-type]
        router=router,
        secrets=Secrets(upstreams={"remote": b"L-1"}),
        clock=clock,
        metrics=metrics,
    )
    route = Route(name="in", source="remote", pattern=AddressPattern("#"), destination="rec")
    router.replace_table(bind_routes([route], {"rec": recorder}))  # type: ignore[dict-item]
    return made, recorder, clock


class Server:
    """The test playing a DMP server on the upstream's connection."""

    def __init__(self, up: DMPUpstream, transport: StringTransport | None = None) -> None:
        self.protocol = DMPClientProtocol(up)
        self.transport = StringTransport() if transport is None else transport
        self.protocol.makeConnection(self.transport)
        self.codec = dmp.DMPCodec(dmp.Role.SERVER)

    def read(self) -> list[dmp.Event]:
        """What the upstream wrote since the last read."""
        data = self.transport.value()
        self.transport.clear()
        return self.codec.receive_data(data)

    def say(self, *events: dmp.Event) -> None:
        """Responses or envelopes from the server."""
        self.protocol.dataReceived(b"".join(self.codec.send(event) for event in events))

    def dialog(self) -> None:
        """Play the dialog to the end."""
        assert self.read() == [dmp.ProtocolHeader()]
        self.say(dmp.Response(200, "DMP/0.1"))
        assert self.read() == [dmp.Lease("L-1")]
        self.say(dmp.Response(200, 'Ready to write to "orders"'))


def test_the_dialog_then_put() -> None:
    """Header; the lease only after the first 200; then routed messages become envelopes."""
    up, _recorder, _clock = upstream()
    outcome: list[Outcome] = []
    up.deliver([Message(address="x", body=b"early")]).addCallback(outcome.extend)
    assert outcome[0].status is Status.RETRY
    server = Server(up)
    server.dialog()
    assert up.connected
    up.deliver(
        [Message(id="m1", address="orders.eu", body=b"hi", sender="a@b", recipients=("c@d",))]
    ).addCallback(outcome.extend)
    assert outcome[1].status is Status.ACCEPTED
    [envelope] = server.read()
    assert isinstance(envelope, dmp.Envelope)
    assert (envelope.routing_key, envelope.body, envelope.properties.message_id) == (
        "orders.eu",
        b"hi",
        "m1",
    )
    assert envelope.properties.headers == {
        "x-gateway-sender": "a@b",
        "x-gateway-recipients": ["c@d"],
    }


def test_a_refusal_closes_and_reconnects_later() -> None:
    """402 to the lease: counted, closed; the connection is not used."""
    up, _recorder, _clock = upstream()
    server = Server(up)
    server.read()
    server.say(dmp.Response(200, "DMP/0.1"))
    server.read()
    server.say(dmp.Response(402, "unknown or expired lease"))
    assert server.transport.disconnecting and not up.connected
    server.protocol.connectionLost(Failure(ConnectionLost("gone")))
    assert not up.connected


def test_heartbeats_and_backlog() -> None:
    """Null messages every heartbeat; a server that does not read: answers wait, retry past the cap.

    In one batch as one at a time: each message counts what the ones
    before it added to the backlog. What was written is answered once the
    server reads again (DMP has no acknowledgement: accepted would be a
    guess while it does not read).
    """
    up, _recorder, clock = upstream(max_backlog_bytes=65536)
    server = Server(up)
    server.dialog()
    clock.advance(5)
    assert server.read() == [dmp.Heartbeat()]
    server.protocol.pauseProducing()
    results: list[Outcome] = []
    up.deliver([Message(address="x", body=b"y" * 30_000)] * 4).addCallback(results.extend)
    assert results == []
    assert server.read() == []
    server.protocol.resumeProducing()
    assert [r.status for r in results] == [Status.ACCEPTED] * 3 + [Status.RETRY]
    assert len(server.read()) == 3


def test_deliveries_waiting_when_the_connection_ends_are_retry_later() -> None:
    """Written but held for a server that did not read, then the connection is lost: retry."""
    up, _recorder, _clock = upstream()
    server = Server(up)
    server.dialog()
    server.protocol.pauseProducing()
    results: list[Outcome] = []
    up.deliver([Message(address="x", body=b"y")] * 2).addCallback(results.extend)
    server.protocol.connectionLost()
    assert [r.status for r in results] == [Status.RETRY] * 2
    assert "before the server read this" in results[0].reason


def test_get_routes_what_the_feed_sends_and_notices_a_dead_feed() -> None:
    """Mode get: envelopes are routed; a feed silent for dead_after_seconds is closed."""
    up, recorder, clock = upstream(mode="get", dead_after_seconds=8.0)
    server = Server(up)
    server.dialog()
    server.say(dmp.Envelope(routing_key="k", body=b"from the feed"), dmp.Heartbeat())
    assert [(m.address, m.body) for m in recorder.messages] == [("remote.k", b"from the feed")]
    clock.advance(4)
    server.say(dmp.Heartbeat())  # heard at 4 s
    clock.advance(4)
    assert not server.transport.disconnecting  # 4 s of silence
    clock.advance(4)
    assert server.transport.disconnecting  # 8 s of silence


def test_a_dead_feed_is_closed_at_dead_after_seconds_not_at_the_next_beat() -> None:
    """Heard at 3 s, dead after 30 s: open at 32.5 s, closed at 33 s (not at the 35 s beat)."""
    up, _recorder, clock = upstream(mode="get", dead_after_seconds=30.0)
    server = Server(up)
    server.dialog()
    clock.advance(3)
    server.say(dmp.Heartbeat())
    with capturedLogs() as events:
        clock.advance(29.5)
        assert not server.transport.disconnecting
        clock.advance(0.5)
    assert server.transport.disconnecting
    assert [event["why"] for event in events if "why" in event] == [
        "the feed sent nothing for 30 s"
    ]


def test_a_sink_that_sends_is_closed() -> None:
    """Mode put: the server has nothing to send but null messages."""
    up, _recorder, _clock = upstream()
    server = Server(up)
    server.dialog()
    server.say(dmp.Heartbeat())
    assert not server.transport.disconnecting
    server.say(dmp.Envelope(body=b"?"))
    assert server.transport.disconnecting


# --- batches ----------------------------------------------------------------------------------


class WriteCountingTransport(StringTransport):
    """A `StringTransport` that also keeps each write apart, to count them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Keep the write, then buffer it as StringTransport does."""
        self.writes.append(data)
        super().write(data)  # type: ignore[no-untyped-call]


@implementer(IDestination)
class Holder:
    """A route destination that keeps each batch waiting until the test answers it."""

    name = "holder"

    def __init__(self) -> None:
        self.batches: list[tuple[list[Message], Deferred[list[Outcome]]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; its Deferred fires when the test says."""
        d: Deferred[list[Outcome]] = Deferred()
        self.batches.append((list(messages), d))
        return d


def counted_server(up: DMPUpstream) -> tuple[Server, WriteCountingTransport]:
    """A scripted server whose transport counts the upstream's writes, past its dialog."""
    transport = WriteCountingTransport()
    server = Server(up, transport)
    server.dialog()
    transport.writes.clear()
    return server, transport


def test_put_writes_a_batch_in_one_write() -> None:
    """Mode put: a batch's envelopes go out in one write, in order, each accepted."""
    up, _recorder, _clock = upstream()
    server, transport = counted_server(up)
    outcomes: list[Outcome] = []
    up.deliver([Message(address="k", body=b"%d" % i) for i in range(25)]).addCallback(
        outcomes.extend
    )
    assert outcomes == [Outcome.accepted()] * 25
    assert len(transport.writes) == 1
    bodies = [e.body for e in server.read() if isinstance(e, dmp.Envelope)]
    assert bodies == [b"%d" % i for i in range(25)]


def test_put_batch_with_a_message_dmp_cannot_carry() -> None:
    """One message of a batch DMP cannot carry (id over 255 bytes) is rejected, the rest written."""
    up, _recorder, _clock = upstream()
    server, transport = counted_server(up)
    outcomes: list[Outcome] = []
    batch = [
        Message(address="k", body=b"a"),
        Message(address="k", body=b"b", id="\u00e9" * 200),
        Message(address="k", body=b"c"),
    ]
    up.deliver(batch).addCallback(outcomes.extend)
    assert [o.status for o in outcomes] == [Status.ACCEPTED, Status.REJECTED, Status.ACCEPTED]
    assert outcomes[1].reason.startswith("upstream remote: ")
    assert len(transport.writes) == 1
    assert [e.body for e in server.read() if isinstance(e, dmp.Envelope)] == [b"a", b"c"]


def test_put_batch_after_the_connection_dropped_is_retry_for_each() -> None:
    """A batch after the connection dropped: retry later for every message, nothing written."""
    up, _recorder, _clock = upstream()
    server, transport = counted_server(up)
    server.protocol.connectionLost(Failure(ConnectionLost("gone")))
    outcomes: list[Outcome] = []
    up.deliver([Message(address="k", body=b"x")] * 3).addCallback(outcomes.extend)
    assert [o.status for o in outcomes] == [Status.RETRY] * 3
    assert transport.writes == []


def test_get_mode_takes_no_batch() -> None:
    """Mode get: a batch routed to the upstream is rejected, message by message."""
    up, _recorder, _clock = upstream(mode="get")
    outcomes: list[Outcome] = []
    up.deliver([Message(address="k", body=b"x")] * 2).addCallback(outcomes.extend)
    assert [o.status for o in outcomes] == [Status.REJECTED] * 2


def test_get_routes_the_envelopes_of_one_read_as_one_batch() -> None:
    """Mode get: the envelopes of one read reach the router as one batch, in order."""
    up, recorder, _clock = upstream(mode="get")
    server = Server(up)
    server.dialog()
    server.say(*(dmp.Envelope(routing_key="k", body=b"%d" % i) for i in range(30)))
    assert recorder.batches == [30]
    assert [m.body for m in recorder.messages] == [b"%d" % i for i in range(30)]


def test_get_dialog_end_and_envelopes_in_one_read_are_one_batch() -> None:
    """The feed's last dialog response and its first envelopes in one read: one batch."""
    up, recorder, _clock = upstream(mode="get")
    server = Server(up)
    assert server.read() == [dmp.ProtocolHeader()]
    server.say(dmp.Response(200, "DMP/0.1"))
    assert server.read() == [dmp.Lease("L-1")]
    server.say(
        dmp.Response(200, 'Ready to read from "f"'),
        dmp.Envelope(body=b"1"),
        dmp.Envelope(body=b"2"),
    )
    assert up.connected
    assert recorder.batches == [2]


def test_get_reading_pauses_while_too_many_await_outcomes() -> None:
    """Mode get: past MAX_IN_FLIGHT messages awaiting outcomes, reading pauses until they drain."""
    up, _recorder, _clock = upstream(mode="get")
    holder = Holder()
    route = Route(name="in", source="remote", pattern=AddressPattern("#"), destination="holder")
    up.router.replace_table(bind_routes([route], {"holder": holder}))
    server = Server(up)
    server.dialog()
    server.say(*(dmp.Envelope(body=b"x") for _ in range(MAX_IN_FLIGHT)))
    [(batch, d)] = holder.batches
    assert len(batch) == MAX_IN_FLIGHT
    assert server.transport.producerState == "paused"
    d.callback([Outcome.accepted()] * MAX_IN_FLIGHT)
    assert server.transport.producerState == "producing"
