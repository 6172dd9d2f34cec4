"""Who is in the fleet (`gateway.fleet.members`), over the in-memory broker on a `Clock`.

Each node is a `Membership` over a `MemoryBackbone` (tests/fleet/broker.py);
``clock.advance(0)`` runs the world until it is quiet. Checked: nodes learn
of each other within a broker round trip, leave at once on a clean stop and
after `MEMBER_TIMEOUT_SECONDS` of silence otherwise (not while this node
hears nobody), configuration hashes that differ are logged once per change
and counted, and ``/healthz`` turns unavailable past ``unhealthy_after_seconds``
without RabbitMQ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs
from twisted.web.test.requesthelper import DummyRequest

from gateway.admin.health import HealthReport
from gateway.admin.site import make_admin_resource
from gateway.core.router import Router, RouteTable
from gateway.fleet.backbone import Delivery
from gateway.fleet.members import (
    ANNOUNCE_SECONDS,
    FLEET_EXCHANGE,
    MEMBER_TIMEOUT_SECONDS,
    Membership,
)
from gateway.metrics import GatewayMetrics
from tests.fleet.broker import MemoryBackbone, MemoryBroker

UNHEALTHY_AFTER_SECONDS = 10.0


class Node:
    """A node's backbone and membership, with a configuration hash the test sets."""

    def __init__(self, broker: MemoryBroker, name: str, config: str = "c1") -> None:
        self.backbone = MemoryBackbone(broker, name)
        self.config = config
        self.addresses: dict[str, tuple[str, int]] = {"streams": ("127.0.0.1", 5000)}
        self.metrics = GatewayMetrics()
        self.changes: list[tuple[frozenset[str], frozenset[str]]] = []
        self.members = Membership(
            self.backbone,
            broker.clock,
            config_hash=lambda: self.config,
            addresses=lambda: self.addresses,
            unhealthy_after_seconds=UNHEALTHY_AFTER_SECONDS,
            stats=self.metrics.fleet(),
        )
        self.members.on_change(lambda joined, left: self.changes.append((joined, left)))

    def gauge(self, name: str) -> float:
        """A metric's value in the node's registry."""
        value = self.metrics.registry.get_sample_value(name)
        assert value is not None, name
        return value


class World:
    """Nodes on one broker and one clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_000)
        self.broker = MemoryBroker(self.clock)

    def node(self, name: str, config: str = "c1", *, start: bool = True) -> Node:
        """A node, started and settled."""
        node = Node(self.broker, name, config)
        if start:
            node.members.start()
        self.settle()
        return node

    def settle(self) -> None:
        """Run what is due now."""
        self.clock.advance(0)

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass, a tenth of a second at a time (announcements go out)."""
        steps = round(seconds * 10)
        for _ in range(steps):
            self.clock.advance(0.1)


def test_nodes_learn_of_each_other_within_a_round_trip() -> None:
    """A node that starts hears the others' answers at once, not after a period."""
    world = World()
    a = world.node("a")
    b = world.node("b")
    c = world.node("c")
    for node in (a, b, c):
        assert node.members.nodes() == ("a", "b", "c")
    assert a.changes == [(frozenset({"b"}), frozenset()), (frozenset({"c"}), frozenset())]
    assert sorted(node for joined, _ in c.changes for node in joined) == ["a", "b"]
    member = b.members.member("c")
    assert member is not None and member.addresses == {"streams": ("127.0.0.1", 5000)}
    assert b.members.address("c", "streams") == ("127.0.0.1", 5000)
    assert b.members.address("c", "nope") is None
    assert b.members.address("b", "streams") == ("127.0.0.1", 5000)
    assert a.gauge("msggateway_fleet_nodes") == 3


def test_announcements_keep_a_node_alive_and_silence_drops_it() -> None:
    """Live while heard; a node whose connection died is dropped after the time-out."""
    world = World()
    a = world.node("a")
    b = world.node("b")
    world.wait(3 * MEMBER_TIMEOUT_SECONDS)
    assert a.members.nodes() == ("a", "b")
    b.backbone.kill()  # kill -9: its queue goes, and its announcements stop
    world.wait(MEMBER_TIMEOUT_SECONDS - ANNOUNCE_SECONDS)
    assert a.members.nodes() == ("a", "b")
    world.wait(2 * ANNOUNCE_SECONDS)
    assert a.members.nodes() == ("a",)
    assert a.changes[-1] == (frozenset(), frozenset({"b"}))
    assert a.gauge("msggateway_fleet_nodes") == 1


def test_a_clean_stop_leaves_at_once() -> None:
    """A stopping node says goodbye: the others drop it without waiting."""
    world = World()
    a = world.node("a")
    b = world.node("b")
    b.members.stop()
    world.settle()
    assert a.members.nodes() == ("a",)
    assert a.changes[-1] == (frozenset(), frozenset({"b"}))


def test_a_node_without_rabbitmq_keeps_its_view() -> None:
    """Hearing nobody says nothing of the others: no one expires until it hears again."""
    world = World()
    a = world.node("a")
    world.node("b")
    a.backbone.kill()
    world.wait(3 * MEMBER_TIMEOUT_SECONDS)
    assert a.members.nodes() == ("a", "b")
    a.backbone.reconnect()
    world.settle()
    world.wait(MEMBER_TIMEOUT_SECONDS)
    assert a.members.nodes() == ("a", "b")
    assert [left for _, left in a.changes if left] == []


def test_a_restarted_node_is_answered_at_once() -> None:
    """A new instance of a known node is told of the others at once, without a change."""
    world = World()
    a = world.node("a")
    b = world.node("b")
    b.backbone.kill()
    again = world.node("b")
    assert again.members.nodes() == ("a", "b")
    assert a.changes == [(frozenset({"b"}), frozenset())]


def test_configuration_hashes_that_differ_are_logged_once_and_counted() -> None:
    """Another hash is logged once per change of either, and counted; the same again, told."""
    world = World()
    a = world.node("a", "c1")
    with capturedLogs() as events:
        b = world.node("b", "c2")
        world.wait(3 * ANNOUNCE_SECONDS)
    warnings = [e for e in events if e["log_level"] == LogLevel.warn]
    assert len([e for e in warnings if e.get("other") == "b"]) == 1
    assert len([e for e in warnings if e.get("other") == "a"]) == 1
    assert a.gauge("msggateway_fleet_config_mismatch") == 1
    assert b.gauge("msggateway_fleet_config_mismatch") == 1
    assert a.members.mismatched() == ("b",)
    with capturedLogs() as events:
        b.config = "c3"  # a reload there
        world.wait(2 * ANNOUNCE_SECONDS)
    assert len([e for e in events if e.get("other") == "b" and e.get("theirs") == "c3"]) == 1
    with capturedLogs() as events:
        b.config = "c1"
        world.wait(2 * ANNOUNCE_SECONDS)
    assert [e["log_level"] for e in events if e.get("other") == "b"] == [LogLevel.info]
    assert a.gauge("msggateway_fleet_config_mismatch") == 0
    assert b.gauge("msggateway_fleet_config_mismatch") == 0


def test_a_clash_of_node_ids_is_logged() -> None:
    """Two processes announcing one node id: an error, once."""
    world = World()
    world.node("a")
    with capturedLogs() as events:
        world.node("a")
        world.wait(2 * ANNOUNCE_SECONDS)
    errors = [e for e in events if e["log_level"] == LogLevel.error]
    assert len(errors) == 2  # each hears the other once


def test_an_unreadable_announcement_is_logged_once_and_ignored() -> None:
    """A body that is not an announcement is skipped, logged once per origin."""
    world = World()
    a = world.node("a")
    bad = Delivery(FLEET_EXCHANGE, "all", "x", "hello", {}, b"not json")
    with capturedLogs() as events:
        a.members._delivered(bad)
        a.members._delivered(bad)
    assert len(events) == 1
    assert a.members.nodes() == ("a",)


def _health(node: Node) -> tuple[int, Mapping[str, object]]:
    state, problem = node.members.health()
    report = HealthReport(listeners={"streams": True}, fleet=state, fleet_problem=problem)
    resource = make_admin_resource(
        metrics=node.metrics,
        router=Router(RouteTable(), Clock(), node.metrics),
        health=lambda: report,
    )
    request = DummyRequest([b"healthz"])
    child = resource.getChildWithDefault(b"healthz", request)
    body = child.render(request)  # type: ignore[attr-defined]
    return request.responseCode or 200, json.loads(body)


def test_healthz_turns_unavailable_past_the_threshold_without_rabbitmq() -> None:
    """Connected: 200. Lost for exactly the threshold: still 200. Past it: 503 with the reason."""
    world = World()
    a = world.node("a")
    world.node("b")
    code, body = _health(a)
    assert code == 200 and body["status"] == "ok"
    fleet = body["fleet"]
    assert isinstance(fleet, dict)
    assert fleet["connected"] is True and fleet["nodes"] == ["a", "b"]
    a.backbone.kill()
    world.clock.advance(UNHEALTHY_AFTER_SECONDS)
    code, body = _health(a)
    assert code == 200 and "reason" not in body
    world.clock.advance(0.5)
    code, body = _health(a)
    assert code == 503 and body["status"] == "unavailable"
    assert body["reason"] == (
        "no connection to RabbitMQ for 10.5 s (more than [fleet] unhealthy_after_seconds = 10)"
    )
    a.backbone.reconnect()
    code, body = _health(a)
    assert code == 200


def test_a_node_that_never_connected_turns_unavailable() -> None:
    """From the start: a node that cannot reach RabbitMQ is unhealthy after the threshold."""
    world = World()
    a = world.node("a", start=False)
    a.backbone.lost_since = world.clock.seconds()
    a.backbone.ready = False
    world.clock.advance(UNHEALTHY_AFTER_SECONDS + 1)
    state, problem = a.members.health()
    assert problem is not None and state["connected"] is False
