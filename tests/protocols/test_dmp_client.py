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
from twisted.python.failure import Failure

from gateway.codecs import dmp
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.batch import deliver_each
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.client import DMPClientProtocol, DMPUpstream
from gateway.protocols.dmp.settings import DMPUpstreamSettings


@attrs.define
class Recorder:
    """A route destination recording what the upstream read."""

    messages: list[Message] = attrs.Factory(list)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Record it."""
        self.messages.append(message)
        return succeed(Outcome.accepted())


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

    def __init__(self, up: DMPUpstream) -> None:
        self.protocol = DMPClientProtocol(up)
        self.transport = StringTransport()
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
    up.deliver_one(Message(address="x", body=b"early")).addCallback(outcome.append)
    assert outcome[0].status is Status.RETRY
    server = Server(up)
    server.dialog()
    assert up.connected
    up.deliver_one(
        Message(id="m1", address="orders.eu", body=b"hi", sender="a@b", recipients=("c@d",))
    ).addCallback(outcome.append)
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
    """Null messages every heartbeat; a server that does not read: retry later past the limit."""
    up, _recorder, clock = upstream(max_backlog_bytes=65536)
    server = Server(up)
    server.dialog()
    clock.advance(5)
    assert server.read() == [dmp.Heartbeat()]
    server.protocol.pauseProducing()
    outcomes = [up.deliver_one(Message(address="x", body=b"y" * 30_000)) for _ in range(4)]
    results: list[Outcome] = []
    for outcome in outcomes:
        outcome.addCallback(results.append)
    assert [r.status for r in results] == [Status.ACCEPTED] * 3 + [Status.RETRY]
    assert server.read() == []
    server.protocol.resumeProducing()
    assert len(server.read()) == 3


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


def test_a_sink_that_sends_is_closed() -> None:
    """Mode put: the server has nothing to send but null messages."""
    up, _recorder, _clock = upstream()
    server = Server(up)
    server.dialog()
    server.say(dmp.Heartbeat())
    assert not server.transport.disconnecting
    server.say(dmp.Envelope(body=b"?"))
    assert server.transport.disconnecting
