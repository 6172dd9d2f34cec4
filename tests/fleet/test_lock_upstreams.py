"""The consuming upstreams under fleet locks, over an in-memory broker on a memory reactor.

Each test's upstream gets a `FleetLock` of a `FleetLocks` over a
`MemoryBackbone` (tests/fleet/broker.py); "another node" is a second
backbone asking for the same lock on the same broker. Time is one
`MemoryReactorClock`, the broker's clock too. The stream upstream is
played by the helpers of tests/protocols/test_stream_client.py (the test
is the stream node), the SSMP and DMP upstreams connect through their
`ClientService` on the memory reactor. Checked: a stream upstream
publishes on every node and subscribes only on the holder, from the
stored offset; losing the lock stores the settled offsets, unsubscribes
and drops what still comes, in that reactor turn; stopping releases the
lock only once the offsets are out and the connection closed; a named
SSMP upstream and a DMP ``get`` connect only on the holder and close the
moment the lock is lost (docs/fleet.rst, "Work that runs once per fleet").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
from prometheus_client import generate_latest
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from gateway.codecs import dmp
from gateway.codecs import stream as sp
from gateway.config import load_config
from gateway.core.auth import Secrets
from gateway.core.message import Outcome
from gateway.core.router import Router, RouteTable, bind_routes
from gateway.fleet.locks import RETRY_JITTER, RETRY_SECONDS, FleetLock, FleetLocks, lock_queue
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.client import DMPUpstream
from gateway.protocols.dmp.settings import DMPUpstreamSettings
from gateway.protocols.ssmp.client import SSMPClientProtocol, SSMPUpstream
from gateway.protocols.ssmp.settings import SSMPUpstreamSettings
from gateway.service import build_gateway
from tests.fleet.broker import MemoryBackbone, MemoryBroker
from tests.protocols.test_stream_client import SETTINGS, UPSTREAM, Node, World, tracked

LOCK = f"upstream.{UPSTREAM}"
LEASE = 10.0
TAKEOVER = RETRY_SECONDS * (1 + RETRY_JITTER) + 0.1
CONSUMER = f"msggateway.{UPSTREAM}"


class Fleet:
    """This node's locks and another node's, on one broker and one memory reactor."""

    def __init__(self) -> None:
        self.reactor = MemoryReactorClock()
        self.broker = MemoryBroker(self.reactor)
        self.backbone = MemoryBackbone(self.broker, "here")
        self.locks = FleetLocks(
            self.backbone, self.reactor, lease_seconds=LEASE, metrics=GatewayMetrics()
        )
        self.other = MemoryBackbone(self.broker, "there")
        self.other_locks = FleetLocks(self.other, self.reactor, lease_seconds=LEASE)
        self.other_running = False

    def lock(self) -> FleetLock:
        """This node's lock for the upstream."""
        return self.locks.lock(LOCK)

    def held_elsewhere(self) -> None:
        """The other node holds the lock (and does the work)."""

        def acquired() -> None:
            self.other_running = True

        def lost() -> None:
            self.other_running = False

        self.other_locks.lock(LOCK).start(acquired, lost)
        self.settle()
        assert self.other_running

    def settle(self) -> None:
        """Run the world until nothing is left to do now."""
        self.reactor.advance(0)

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """Let time pass in small steps."""
        for _ in range(round(seconds / step)):
            self.reactor.advance(step)

    def holder(self) -> str | None:
        """The node the broker gave the lock to."""
        holder = self.broker.exclusive.get(lock_queue(LOCK))
        return holder.node if holder is not None else None


# --- the stream upstream ------------------------------------------------------------------------


def stream_world(fleet: Fleet, **changes: Any) -> World:
    """A stream upstream consuming ``in`` (credit 2) under this node's lock."""
    settings = attrs.evolve(SETTINGS, stream=None, subscribe=("in",), credit=2, **changes)
    return World(settings, reactor=fleet.reactor, lock=fleet.lock())


def connect(world: World) -> Node:
    """Start the upstream and take its first connection through to ready (no subscribing)."""
    world.upstream.start()
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    assert world.upstream.connected
    return node


def test_without_the_lock_it_connects_but_does_not_subscribe() -> None:
    """Another node holds the lock: this one is connected (it publishes), and reads nothing."""
    fleet = Fleet()
    fleet.held_elsewhere()
    world = stream_world(fleet)
    node = connect(world)
    fleet.advance(5)
    assert node.received() == []  # no QueryOffset, no Subscribe
    assert not world.upstream.reading.allowed


def test_taking_over_subscribes_after_the_stored_offset() -> None:
    """The holder dies: within a retry this node subscribes from the offset stored before."""
    fleet = Fleet()
    fleet.held_elsewhere()
    world = stream_world(fleet)
    node = connect(world)
    fleet.other.kill()
    fleet.advance(TAKEOVER)
    assert fleet.holder() == "here"
    query = node.one(sp.QueryOffset)
    assert (query.reference, query.stream) == (CONSUMER, "in")
    node.say(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=1, offset=41))
    subscribe = node.one(sp.Subscribe)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=42)
    node.say(sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=subscribe.correlation_id, code=1))
    node.deliver_chunk(subscribe.subscription_id, 40, b"old", b"seen", b"new")
    assert [message.body for message in world.sink.messages] == [b"new"]


def test_losing_the_lock_stores_unsubscribes_and_drops_what_still_comes() -> None:
    """In the turn the lock goes: StoreOffset of what was settled, Unsubscribe; then nothing."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    subscribe = node.subscribe(stored=None)
    node.deliver_chunk(subscribe.subscription_id, 0, b"a", b"b")
    assert len(world.sink.messages) == 2
    node.received()  # the credit
    fleet.backbone.kill()
    stored, unsubscribe = node.received()
    assert stored == sp.StoreOffset(reference=CONSUMER, stream="in", offset=1)
    assert isinstance(unsubscribe, sp.Unsubscribe)
    assert unsubscribe.subscription_id == subscribe.subscription_id
    node.deliver_chunk(subscribe.subscription_id, 2, b"late")  # sent before RabbitMQ unsubscribed
    assert len(world.sink.messages) == 2
    assert node.received() == []  # no credit for it
    assert world.upstream.connected  # publishing goes on


def test_a_chunk_settled_after_the_loss_gets_no_credit_and_no_stored_offset() -> None:
    """What was in flight when the lock went still gets its outcomes; nothing more is asked."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    subscribe = node.subscribe(stored=None)
    world.sink.auto = False
    node.deliver_chunk(subscribe.subscription_id, 0, b"a")
    fleet.backbone.kill()
    assert [type(event) for event in node.received()] == [sp.Unsubscribe]
    world.sink.answer(0, Outcome.accepted())
    fleet.advance(10)
    assert node.received() == []


def test_lost_while_subscribing_leaves_no_subscription() -> None:
    """The lock goes between QueryOffset and its answer: no Subscribe is sent."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    query = node.one(sp.QueryOffset)
    fleet.backbone.kill()
    node.say(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=19, offset=0))
    assert node.received() == []


def test_lost_before_the_subscribe_answer_unsubscribes() -> None:
    """The lock goes while Subscribe is on its way: once it succeeds, it is cancelled."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    query = node.one(sp.QueryOffset)
    node.say(sp.QueryOffsetResponse(correlation_id=query.correlation_id, code=19, offset=0))
    subscribe = node.one(sp.Subscribe)
    fleet.backbone.kill()
    node.say(sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=subscribe.correlation_id, code=1))
    unsubscribe = node.one(sp.Unsubscribe)
    assert unsubscribe.subscription_id == subscribe.subscription_id
    node.deliver_chunk(subscribe.subscription_id, 0, b"a")
    assert world.sink.messages == []


def test_held_again_subscribes_again_on_the_same_connection() -> None:
    """Lost, then held again (after a gap nobody used): it subscribes from the stored offset."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    node.subscribe(stored=None)
    fleet.backbone.kill()
    node.received()
    fleet.backbone.reconnect()
    fleet.settle()
    subscribe = node.subscribe(stored=7)
    assert subscribe.offset_spec == sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=8)


def test_a_new_connection_of_the_holder_subscribes_in_its_handshake() -> None:
    """Holding the lock, a reconnection subscribes as without a fleet (once)."""
    fleet = Fleet()
    world = stream_world(fleet)
    world.upstream.start()
    fleet.settle()  # the lock is held before the first connection is ready
    assert world.upstream.reading.allowed
    node = world.accept()
    node.login()
    node.tune()
    node.metadata()
    node.subscribe(stored=None)
    assert node.received() == []


def test_stop_releases_the_lock_once_offsets_are_stored_and_the_connection_closed() -> None:
    """The next holder must find the last offset stored: release comes after the close."""
    fleet = Fleet()
    world = stream_world(fleet)
    node = connect(world)
    fleet.settle()
    subscribe = node.subscribe(stored=None)
    node.deliver_chunk(subscribe.subscription_id, 0, b"a", b"b", b"c")
    node.received()
    stopped = tracked(world.upstream.stop())
    assert sp.StoreOffset(reference=CONSUMER, stream="in", offset=2) in node.received()
    fleet.settle()
    assert fleet.holder() == "here"  # the connection is not closed yet
    node.lose()
    fleet.settle()
    assert fleet.holder() is None
    assert stopped == [None]


def test_a_replica_consumer_is_the_one_gated() -> None:
    """With consume_from = replica the consumer link's subscriptions wait for the lock."""
    fleet = Fleet()
    fleet.held_elsewhere()
    world = stream_world(fleet, consume_from="replica")
    consumer = world.upstream.consumer
    assert consumer is not None
    assert world.upstream.reading is consumer.subscriptions
    world.upstream.start()
    assert not consumer.subscriptions.allowed
    fleet.other.kill()
    fleet.advance(TAKEOVER)
    assert consumer.subscriptions.allowed


# --- upstreams whose connection is once per fleet ------------------------------------------------


def ssmp_upstream(fleet: Fleet) -> SSMPUpstream:
    """A named SSMP upstream (``gw``) subscribing to ``news``, under this node's lock."""
    upstream = SSMPUpstream(
        name=UPSTREAM,
        settings=SSMPUpstreamSettings(identity="gw", scheme="open", subscribe=("news",)),
        endpoint=TCP4ClientEndpoint(fleet.reactor, "central", 8787),
        router=Router(RouteTable(), fleet.reactor),
        secrets=Secrets(),
        clock=fleet.reactor,
        lock=fleet.lock(),
    )
    return upstream


def accept_ssmp(fleet: Fleet) -> tuple[Any, SSMPClientProtocol, StringTransport]:
    """Complete the newest connection attempt: the endpoint's protocol, ours, its transport."""
    host, port, factory, *_ = fleet.reactor.tcpClients[-1]
    wrapper = factory.buildProtocol(IPv4Address("TCP", host, port))
    transport = StringTransport()
    wrapper.makeConnection(transport)
    protocol = wrapper._wrappedProtocol._protocol
    assert isinstance(protocol, SSMPClientProtocol)
    return wrapper, protocol, transport


def test_a_named_ssmp_upstream_connects_only_on_the_holder() -> None:
    """On standby it makes no connection; taking the lock over, it connects and subscribes."""
    fleet = Fleet()
    fleet.held_elsewhere()
    upstream = ssmp_upstream(fleet)
    upstream.start()
    fleet.advance(5)
    assert fleet.reactor.tcpClients == []
    assert upstream.standby and not upstream.connected
    fleet.other.kill()
    fleet.advance(TAKEOVER)
    assert not upstream.standby
    assert len(fleet.reactor.tcpClients) == 1
    _, protocol, transport = accept_ssmp(fleet)
    assert transport.value() == b"LOGIN gw open\n"
    transport.clear()
    protocol.dataReceived(b"200\n")
    assert transport.value() == b"SUBSCRIBE news\n"
    assert upstream.connected


def test_losing_the_lock_closes_the_ssmp_connection_at_once() -> None:
    """The lock goes: the connection closes in that turn, and nothing read after is routed."""
    fleet = Fleet()
    upstream = ssmp_upstream(fleet)
    upstream.start()
    fleet.settle()
    _, protocol, transport = accept_ssmp(fleet)
    protocol.dataReceived(b"200\n200\n")
    assert upstream.connected
    fleet.backbone.kill()
    assert transport.disconnecting
    assert upstream.standby
    read = upstream.traffic.messages_in
    protocol.dataReceived(b"000 alice MCAST news late\n")
    assert upstream.traffic.messages_in == read


def test_stopping_the_ssmp_upstream_releases_the_lock_after_the_close() -> None:
    """A clean stop closes the connection, then releases the lock for the next node."""
    fleet = Fleet()
    upstream = ssmp_upstream(fleet)
    upstream.start()
    fleet.settle()
    wrapper, _, transport = accept_ssmp(fleet)
    stopped = tracked(upstream.stop())
    fleet.settle()
    assert transport.disconnecting
    assert fleet.holder() == "here"
    wrapper.connectionLost(Failure(ConnectionLost("closed")))
    fleet.settle()
    assert stopped == [None]
    assert fleet.holder() is None


def test_a_dmp_get_upstream_connects_only_on_the_holder() -> None:
    """A feed has one reader: the ``get`` upstream connects where the lock is held."""
    fleet = Fleet()
    fleet.held_elsewhere()
    router = Router(bind_routes([], {}), fleet.reactor)
    upstream = DMPUpstream(
        name=UPSTREAM,
        settings=DMPUpstreamSettings(mode="get"),
        endpoint=TCP4ClientEndpoint(fleet.reactor, "feeds", 5555),
        router=router,
        secrets=Secrets(upstreams={UPSTREAM: b"L-1"}),
        clock=fleet.reactor,
        lock=fleet.lock(),
    )
    upstream.start()
    fleet.advance(5)
    assert fleet.reactor.tcpClients == [] and upstream.standby
    fleet.other.kill()
    fleet.advance(TAKEOVER)
    host, port, factory, *_ = fleet.reactor.tcpClients[-1]
    wrapper = factory.buildProtocol(IPv4Address("TCP", host, port))
    transport = StringTransport()
    wrapper.makeConnection(transport)
    assert dmp.DMPCodec(dmp.Role.SERVER).receive_data(transport.value()) == [dmp.ProtocolHeader()]


# --- the assembly ---------------------------------------------------------------------------------

ASSEMBLED = """
[gateway]
secrets = "secrets.toml"

[fleet]
node = "edge-1"
amqp = "tcp:host=127.0.0.1:port=5672"

[upstreams.reader]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port=5552"
subscribe = ["in"]

[upstreams.writer]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port=5552"
stream = "out"

[upstreams.named]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=8787"
identity = "gw"
scheme = "open"

[upstreams.anonymous]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=8787"
identity = "."
scheme = "open"

[upstreams.feed]
protocol = "dmp"
endpoint = "tcp:host=127.0.0.1:port=5555"
mode = "get"

[upstreams.sink]
protocol = "dmp"
endpoint = "tcp:host=127.0.0.1:port=5555"
mode = "put"
"""


def locks_of(main: str, tmp_path: Path) -> set[str]:
    """The fleet locks a gateway built from ``main`` asks for (as its metrics show them)."""
    path = tmp_path / "gateway.toml"
    path.write_text(main)
    (tmp_path / "secrets.toml").write_text('[upstreams]\nfeed = "L-1"\nsink = "L-2"\n')
    gateway = build_gateway(load_config(path), MemoryReactorClock())
    text = generate_latest(gateway.metrics.registry).decode()
    return set(re.findall(r'^msggateway_fleet_lock_held\{lock="([^"]+)"\}', text, re.MULTILINE))


def test_consuming_upstreams_get_a_lock_each(tmp_path: Path) -> None:
    """Stream with subscribe, named SSMP, DMP get: ``upstream.<name>``; the others none."""
    assert locks_of(ASSEMBLED, tmp_path) == {"upstream.reader", "upstream.named", "upstream.feed"}


def test_without_a_fleet_there_are_no_locks(tmp_path: Path) -> None:
    """Without ``[fleet] amqp`` nothing waits for a lock."""
    single = ASSEMBLED.replace('amqp = "tcp:host=127.0.0.1:port=5672"\n', "")
    assert locks_of(single, tmp_path) == set()
