"""DMP across nodes (`gateway.fleet.dmp`), over an in-memory broker on a `Clock`.

Each node is a real DMP listener (`DMPServerFactory`, connections on
`StringTransport`) with its fleet locks, revocations and `FleetDMP` over a
`MemoryBackbone`; the nodes meet on one `MemoryBroker` (tests/fleet/broker.py).
``clock.advance(0)`` runs the world until it is quiet. Checked, as
docs/fleet.rst and docs/protocols/dmp.rst say: a lease made on one node
(admin API, principal connection) opens a sink or feed on another; a
tampered, expired or revoked one is refused everywhere; one reader per feed
across nodes; deliveries to a feed read on another node reach its reader,
answered as it took them, with its back-pressure.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from gateway.codecs import dmp
from gateway.codecs.amqp091 import PROTOCOL_HEADER, FrameCodec
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Result, Route, Router, RouteTable, bind_routes
from gateway.fleet.dmp import CLAIM_SECONDS, FleetDMP, exchange_name, lock_name
from gateway.fleet.leases import REVOCATIONS_WAIT_SECONDS, FleetLeases, Revocations
from gateway.fleet.locks import FleetLocks, lock_queue
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.leases import LeaseDesk
from gateway.protocols.dmp.server import DMPServerFactory, DMPServerProtocol
from gateway.protocols.dmp.settings import DMPListenerSettings
from tests.doubles import NO_LOGIN_WAIT
from tests.fleet.broker import MemoryBackbone, MemoryBroker
from tests.protocols.test_dmp_principal import CHANNEL_OPEN, OPEN, TUNE_OK, get, start_ok

NOW = 1000.0
LEASE_SECONDS = 10.0
STALE_SECONDS = 10.0
SETTINGS = DMPListenerSettings(
    sinks=frozenset({"orders"}),
    feeds=frozenset({"alerts", "news"}),
    heartbeat_seconds=0,
    principals=frozenset({"alice"}),
    max_in_flight=8,
)
SECRETS = Secrets(logins={"alice": b"pw-a"}, admin_token=b"t" * 20, fleet_lease_secret=b"k" * 32)


class Node:
    """One gateway node: DMP listener ``dmp``, routes from its sink and from ``app`` to feeds."""

    def __init__(self, broker: MemoryBroker, name: str, secrets: Secrets = SECRETS) -> None:
        self.clock = broker.clock
        self.backbone = MemoryBackbone(broker, name, prefetch=4)
        self.locks = FleetLocks(self.backbone, self.clock, lease_seconds=LEASE_SECONDS)
        self.revocations = Revocations(self.backbone, self.clock, stale_after_seconds=STALE_SECONDS)
        self.metrics = GatewayMetrics()
        self.router = Router(RouteTable(), self.clock, self.metrics)
        self.factory = DMPServerFactory(
            name="dmp",
            settings=SETTINGS,
            router=self.router,
            secrets=secrets,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.factory.login_failures = NO_LOGIN_WAIT
        self.fleet = FleetDMP(
            self.factory,
            FleetLeases(secrets, self.revocations, self.clock),
            self.backbone,
            self.locks,
            self.clock,
        )
        self.factory.join_fleet(self.fleet)
        self.desk = LeaseDesk({"dmp": self.factory}, secrets, self.clock)
        routes = [
            Route(
                name="relay",
                source="dmp",
                pattern=AddressPattern("orders.#"),
                destination="dmp",
                target=AddressTemplate("alerts"),
            ),
            Route(name="app", source="app", pattern=AddressPattern("#"), destination="dmp"),
        ]
        self.router.replace_table(bind_routes(routes, {"dmp": self.factory}))

    def lease(self, kind: str = "feed", seconds: float = 60.0) -> str:
        """A lease made here with the admin API's desk."""
        target = "orders" if kind == "sink" else "alerts"
        made = self.desk.make("dmp", kind, target, seconds)
        return str(made["lease"])

    def open(self, lease: str) -> tuple[DMPServerProtocol, StringTransport]:
        """Connect, send the header and ``lease`` (nothing settled)."""
        protocol = self.factory.buildProtocol(None)
        assert isinstance(protocol, DMPServerProtocol)
        transport = StringTransport()
        protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
        raw = lease.encode("ascii")
        protocol.dataReceived(dmp.PROTOCOL_HEADER + bytes((len(raw),)) + raw)
        return protocol, transport

    def send(self, feed: str, *bodies: bytes) -> list[Result]:
        """Route messages from ``app`` to ``feed``; the results as they come."""
        results: list[Result] = []
        self.router.dispatch(
            "app", [Message(address=feed, body=body) for body in bodies]
        ).addCallback(results.extend)
        return results


class Fleet:
    """Nodes on one in-memory broker and one clock."""

    def __init__(self, count: int = 2) -> None:
        self.clock = Clock()
        self.clock.advance(NOW)
        self.broker = MemoryBroker(self.clock)
        self.nodes = [Node(self.broker, f"n{index}") for index in range(count)]
        self.settle()

    def settle(self) -> None:
        """Run the world until nothing is left to do now."""
        self.clock.advance(0)

    def opened(
        self, node: int, lease: str
    ) -> tuple[DMPServerProtocol, StringTransport, list[object]]:
        """Open on a node and settle; return what it answered (responses, envelopes)."""
        protocol, transport = self.nodes[node].open(lease)
        self.settle()
        return protocol, transport, read(transport)


def read(transport: StringTransport) -> list[object]:
    """Decode (client role) what the listener wrote since the last read."""
    data = transport.value()
    transport.clear()
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    events: list[object] = []
    while data:
        if not codec.flowing:
            size = 1 + data[0]
            events += codec.receive_data(data[:size])
            data = data[size:]
        else:
            events += codec.receive_data(data)
            data = b""
    return events


def bodies(transport: StringTransport) -> list[bytes]:
    """The bodies of the envelopes a reader got since the last read (its dialog read before)."""
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    codec.receive_data(b"\x0e200 OK DMP/0.1" + b"\x05200 X")
    events = codec.receive_data(transport.value())
    transport.clear()
    return [event.body for event in events if isinstance(event, dmp.Envelope)]


def last_code(events: Sequence[object]) -> int:
    """The code of the last response among ``events``."""
    responses = [event for event in events if isinstance(event, dmp.Response)]
    return responses[-1].code


READ = dmp.Response(200, 'Ready to read from "alerts"', "OK")
WRITE = dmp.Response(200, 'Ready to write to "orders"', "OK")


@pytest.fixture
def fleet() -> Fleet:
    """Two nodes, n0 and n1, settled."""
    return Fleet()


# --- leases ---------------------------------------------------------------------------------


def test_a_lease_made_on_one_node_opens_the_sink_and_the_feed_on_another(fleet: Fleet) -> None:
    """The admin API's leases on n0 open n1's sink and feed; no record was shared."""
    a, b = fleet.nodes
    assert a.factory.granted == {} and b.factory.granted == {}
    _, _, answers = fleet.opened(1, a.lease("sink"))
    assert answers[-1] == WRITE
    _, _, answers = fleet.opened(1, a.lease("feed"))
    assert answers[-1] == READ


def test_a_principals_lease_opens_the_feed_on_another_node(fleet: Fleet) -> None:
    """Direct.Get on n0's principal connection; the lease opens the feed on n1, as alice."""
    a = fleet.nodes[0]
    protocol = a.factory.buildProtocol(None)
    assert protocol is not None
    transport = StringTransport()
    protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
    protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + TUNE_OK + OPEN)
    protocol.dataReceived(CHANNEL_OPEN + get(b"alerts"))
    methods = FrameCodec().receive_data(transport.value())
    [got] = [m for m in methods if getattr(m, "name", "") == "direct.get-ok"]
    lease: str = got.arguments["lease"]  # type: ignore[union-attr]
    reader, _, answers = fleet.opened(1, lease)
    assert answers[-1] == READ
    assert reader.identity == "alice"


def test_tampered_expired_and_foreign_leases_are_refused(fleet: Fleet) -> None:
    """402 for a changed character, another fleet's secret, an expired lease."""
    a = fleet.nodes[0]
    text = a.lease("sink", seconds=5)
    tampered = text[:10] + ("A" if text[10] != "A" else "B") + text[11:]
    assert last_code(fleet.opened(1, tampered)[2]) == 402
    other = Node(
        fleet.broker, "other", Secrets(admin_token=b"t" * 20, fleet_lease_secret=b"o" * 32)
    )
    fleet.settle()
    assert last_code(fleet.opened(1, other.lease("sink"))[2]) == 402
    assert fleet.opened(1, text)[2][-1] == WRITE
    fleet.clock.advance(5)
    assert last_code(fleet.opened(1, text)[2]) == 402
    assert last_code(fleet.opened(0, text)[2]) == 402


def test_a_lease_revoked_on_one_node_is_refused_on_every_node(fleet: Fleet) -> None:
    """DELETE on n0: 402 on n0 at once and on n1 a broker round trip later; open ones stay."""
    a, _ = fleet.nodes
    text = a.lease("sink")
    _, writer_transport, answers = fleet.opened(1, text)
    assert answers[-1] == WRITE
    revoked = a.desk.revoke(text)
    assert isinstance(revoked, Deferred)
    answered: list[bool] = []
    revoked.addCallback(answered.append)
    assert last_code(fleet.opened(0, text)[2]) == 402
    assert answered == [True]
    assert last_code(fleet.opened(1, text)[2]) == 402
    assert not writer_transport.disconnecting
    assert a.desk.revoke("no-such-lease") is False


def test_a_node_that_starts_checks_leases_once_it_read_the_revocations(fleet: Fleet) -> None:
    """A lease presented before the node read the stream waits for it, then is checked."""
    a, _ = fleet.nodes
    revoked, kept = a.lease("sink"), a.lease("sink")
    a.desk.revoke(revoked)
    fleet.settle()
    late = Node(fleet.broker, "late")
    _, refused = late.open(revoked)
    _, accepted = late.open(kept)
    assert read(refused) == [dmp.Response(200, "DMP/0.1", "OK")]  # the lease waits
    assert read(accepted) == [dmp.Response(200, "DMP/0.1", "OK")]
    fleet.settle()
    assert last_code(read(refused)) == 402
    assert read(accepted) == [WRITE]


def test_a_node_that_cannot_read_the_revocations_refuses_run_time_leases(fleet: Fleet) -> None:
    """Cut off past stale_after: the lease waits REVOCATIONS_WAIT_SECONDS, then 402."""
    a, b = fleet.nodes
    text = a.lease("sink", seconds=600)
    b.backbone.kill()
    fleet.clock.advance(STALE_SECONDS)
    assert fleet.opened(1, text)[2][-1] == WRITE  # what it read still counts
    fleet.clock.advance(1)
    _, transport = b.open(text)
    fleet.clock.advance(REVOCATIONS_WAIT_SECONDS - 0.1)
    assert read(transport) == [dmp.Response(200, "DMP/0.1", "OK")]
    fleet.clock.advance(0.1)
    [answer] = read(transport)
    assert isinstance(answer, dmp.Response) and answer.code == 402
    assert transport.disconnecting


def test_a_lease_too_long_for_dmp_is_not_made(fleet: Fleet) -> None:
    """An identity that would make the lease longer than a short string: 400, nothing made."""
    a = fleet.nodes[0]
    with pytest.raises(ValueError, match="at most 255") as refused:
        a.desk.make("dmp", "sink", "orders", 60, identity="i" * 200)
    assert getattr(refused.value, "status", None) == 400


# --- one reader per feed --------------------------------------------------------------------


def test_a_second_reader_on_another_node_is_refused(fleet: Fleet) -> None:
    """n0 reads alerts: n1's reader is 403; when n0's reader leaves, n1 may read."""
    a, b = fleet.nodes
    reader, _, answers = fleet.opened(0, a.lease())
    assert answers[-1] == READ
    assert fleet.broker.exclusive[lock_queue(lock_name("dmp", "alerts"))] is a.backbone
    _, transport, answers = fleet.opened(1, b.lease())
    assert answers[-1] == dmp.Response(
        403, "feed 'alerts' already has a reader on another node", "NO-ACCESS"
    )
    assert transport.disconnecting
    reader.transport.loseConnection()  # type: ignore[union-attr]
    reader.connectionLost()
    fleet.settle()
    assert fleet.broker.bindings[(exchange_name("dmp"), "f.alerts")] == set()
    assert fleet.opened(1, b.lease())[2][-1] == READ


def test_the_lease_answer_waits_for_the_claim(fleet: Fleet) -> None:
    """No answer before the lock is held and bound; a local second reader is refused meanwhile."""
    a = fleet.nodes[0]
    _, transport = a.open(a.lease())
    assert read(transport) == [dmp.Response(200, "DMP/0.1", "OK")]
    _, second = a.open(a.lease())
    assert last_code(read(second)) == 403
    fleet.settle()
    assert read(transport) == [READ]


def test_a_claim_without_rabbitmq_is_answered_541(fleet: Fleet) -> None:
    """No connection: no answer from the fleet within CLAIM_SECONDS, then 541 and a close."""
    b = fleet.nodes[1]
    lease = b.lease()
    b.backbone.kill()
    _, transport = b.open(lease)
    fleet.clock.advance(CLAIM_SECONDS - 0.1)
    assert read(transport) == [dmp.Response(200, "DMP/0.1", "OK")]
    fleet.clock.advance(0.1)
    assert last_code(read(transport)) == 541
    assert transport.disconnecting
    assert b.factory.claiming == {}


def test_a_reader_that_leaves_while_claiming_gives_the_claim_up(fleet: Fleet) -> None:
    """The connection goes before the answer: the lock is released, the feed free."""
    a, b = fleet.nodes
    reader, _ = a.open(a.lease())
    reader.connectionLost()
    fleet.settle()
    assert fleet.broker.exclusive == {}
    assert a.factory.claiming == {} and a.factory.readers == {}
    assert fleet.opened(1, b.lease())[2][-1] == READ


def test_a_reader_whose_lock_is_lost_is_closed_and_another_node_takes_the_feed(
    fleet: Fleet,
) -> None:
    """n0 loses RabbitMQ: its reader is closed at once; n1's next reader gets the feed."""
    a, b = fleet.nodes
    _, transport, _ = fleet.opened(0, a.lease())
    a.backbone.kill()
    assert transport.disconnecting
    assert a.factory.readers == {}
    fleet.settle()
    assert fleet.opened(1, b.lease())[2][-1] == READ


# --- deliveries -----------------------------------------------------------------------------


def test_deliveries_to_a_feed_read_on_another_node(fleet: Fleet) -> None:
    """n1 routes to alerts, read on n0: each message once, in order, answered accepted."""
    a, b = fleet.nodes
    _, transport, _ = fleet.opened(0, a.lease())
    results = b.send("alerts", *(b"m%d" % n for n in range(20)))
    fleet.settle()
    assert bodies(transport) == [b"m%d" % n for n in range(20)]
    assert results == [Outcome.accepted()] * 20


def test_a_sink_writer_on_one_node_feeds_the_reader_on_another(fleet: Fleet) -> None:
    """A sink on n1 routed to the feed read on n0: every envelope arrives once, in order."""
    a, b = fleet.nodes
    _, reader_transport, _ = fleet.opened(0, a.lease())
    writer, writer_transport, _ = fleet.opened(1, b.lease("sink"))
    for start in range(0, 40, 5):
        writer.dataReceived(
            b"".join(
                dmp.encode_envelope(dmp.Envelope(body=b"%d" % n)) for n in range(start, start + 5)
            )
        )
        fleet.settle()
    assert bodies(reader_transport) == [b"%d" % n for n in range(40)]
    assert writer_transport.producerState == "producing"


def test_no_reader_on_any_node_is_retry_later(fleet: Fleet) -> None:
    """Nobody is bound for the feed: RabbitMQ returns the message, and the route retries."""
    results = fleet.nodes[1].send("alerts", b"x")
    fleet.settle()
    [result] = results
    assert isinstance(result, Outcome) and result.status is Status.RETRY
    assert "no reader" in result.reason


def test_a_reader_behind_holds_the_sender_until_it_drained(fleet: Fleet) -> None:
    """n0's reader congested: n1's route waits; n0 takes no further deliveries meanwhile."""
    a, b = fleet.nodes
    reader, transport, _ = fleet.opened(0, a.lease())
    reader.pauseProducing()
    results = b.send("alerts", b"first")
    fleet.settle()
    assert results == []
    assert a.backbone.receiving.held
    later = b.send("alerts", b"second")
    fleet.settle()
    assert bodies(transport) == [b"first"]  # the second waits in the broker
    reader.resumeProducing()
    fleet.settle()
    assert results == [Outcome.accepted()]
    assert later == [Outcome.accepted()]
    assert bodies(transport) == [b"second"]
    assert not a.backbone.receiving.held


def test_a_reader_cut_while_behind_answers_retry(fleet: Fleet) -> None:
    """The reader goes before it drained: what was written to it is answered retry later."""
    a, b = fleet.nodes
    reader, _, _ = fleet.opened(0, a.lease())
    reader.pauseProducing()
    results = b.send("alerts", b"x")
    fleet.settle()
    reader.connectionLost()
    fleet.settle()
    [result] = results
    assert isinstance(result, Outcome) and result.status is Status.RETRY
    assert "went away" in result.reason
    assert not a.backbone.receiving.held


def test_a_batch_for_feeds_here_and_elsewhere(fleet: Fleet) -> None:
    """Feed alerts read on n0, news on n1: n1's batch for both reaches each reader, in order."""
    a, b = fleet.nodes
    _, alerts, _ = fleet.opened(0, a.lease())
    made = b.desk.make("dmp", "feed", "news", 60)
    _, news, _ = fleet.opened(1, str(made["lease"]))
    results: list[Result] = []
    messages = [Message(address="alerts" if n % 2 else "news", body=b"%d" % n) for n in range(6)]
    b.router.dispatch("app", messages).addCallback(results.extend)
    fleet.settle()
    assert bodies(alerts) == [b"1", b"3", b"5"]
    assert bodies(news) == [b"0", b"2", b"4"]
    assert results == [Outcome.accepted()] * 6


def test_answers_lost_with_the_connection_are_retry(fleet: Fleet) -> None:
    """n1 loses RabbitMQ while it waits for n0's answer: retry later, at once."""
    a, b = fleet.nodes
    reader, _, _ = fleet.opened(0, a.lease())
    reader.pauseProducing()
    results = b.send("alerts", b"x")
    fleet.settle()
    b.backbone.kill()
    [result] = results
    assert isinstance(result, Outcome) and result.status is Status.RETRY
    reader.resumeProducing()
    fleet.settle()
