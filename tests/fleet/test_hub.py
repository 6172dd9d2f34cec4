"""The SSMP hub across nodes (`gateway.fleet.hub`), over an in-memory broker on a `Clock`.

Each node is a real hub listener (`SSMPServerFactory`, `Hub`, connections
on `StringTransport`) with a `FleetHub` over a `MemoryBackbone`; the nodes
meet on one `MemoryBroker` (tests/fleet/broker.py). ``clock.advance(0)``
runs the world until it is quiet. The behaviour checked is the spec's
(../shared/specs/ssmp.txt) across nodes, as docs/fleet.rst describes it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Final

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from zope.interface.verify import verifyObject

from gateway.core.flow import Congestion
from gateway.core.interfaces import IBackbone
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Router, RouteTable
from gateway.fleet.hub import COALESCE_SECONDS, ROLL_CALL_SECONDS, FleetHub
from gateway.fleet.quiet import INTEREST_SECONDS, QUIET_SWEEP_SECONDS
from gateway.metrics import GatewayMetrics
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.server import SSMPServerFactory, SSMPServerProtocol
from tests.doubles import NO_LOGIN_WAIT
from tests.fleet.broker import MemoryBackbone, MemoryBroker
from tests.protocols.test_ssmp_server import SECRETS, SETTINGS, Peer, fired


class Node:
    """One gateway node: an SSMP hub listener named ``hub`` and its seam."""

    def __init__(self, broker: MemoryBroker, name: str, coalesce_seconds: float = 0) -> None:
        self.clock = broker.clock
        self.backbone = MemoryBackbone(broker, name)
        self.hub = Hub("hub", self.clock)
        # Turn by turn (0): most tests step the world without moving its clock.
        self.seam = FleetHub(self.hub, self.backbone, self.clock, coalesce_seconds)
        self.factory = SSMPServerFactory(
            name="hub",
            settings=SETTINGS,
            hub=self.hub,
            router=Router(RouteTable(), self.clock, GatewayMetrics()),
            secrets=SECRETS,
            clock=self.clock,
        )
        self.factory.login_failures = NO_LOGIN_WAIT

    def login(self, identity: str, transport: StringTransport | None = None) -> Peer:
        """Connect and log in (``open``); the 200 is consumed."""
        transport = transport or StringTransport()
        protocol = self.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
        assert isinstance(protocol, SSMPServerProtocol)
        protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
        peer = Peer(protocol, transport)
        peer.send(f"LOGIN {identity} open\n".encode())
        assert peer.received() == b"200\n"
        return peer


class Fleet:
    """Nodes on one in-memory broker and one clock."""

    def __init__(self, count: int = 3, coalesce_seconds: float = 0) -> None:
        self.clock = Clock()
        self.broker = MemoryBroker(self.clock)
        self.nodes = [Node(self.broker, f"n{index}", coalesce_seconds) for index in range(count)]
        self.settle()

    def settle(self) -> None:
        """Run the world until nothing is left to do now."""
        self.clock.advance(0)

    def step(self) -> None:
        """Run one turn of the world: the calls due now, in order, not the ones they make."""
        now = self.clock.seconds()
        due = [call for call in self.clock.getDelayedCalls() if call.getTime() <= now]
        for call in due:
            if call.active():
                func, args, kw = call.func, call.args, call.kw
                call.cancel()
                func(*args, **kw)

    def subscriber(self, node: int, identity: str, *topics: str, presence: bool = False) -> Peer:
        """Log in on a node and subscribe (settled); every response is consumed."""
        peer = self.nodes[node].login(identity)
        flag = " PRESENCE" if presence else ""
        peer.send(b"".join(f"SUBSCRIBE {topic}{flag}\n".encode() for topic in topics))
        self.settle()  # 200 once the node's binding is in place
        assert peer.received().splitlines().count(b"200") == len(topics)
        return peer


@pytest.fixture
def fleet() -> Fleet:
    """Three nodes."""
    return Fleet()


def test_backbones_provide_the_interface(fleet: Fleet) -> None:
    """The in-memory backbone is an `IBackbone`, as the real one is."""
    assert verifyObject(IBackbone, fleet.nodes[0].backbone)


def test_mcast_reaches_other_nodes_once_per_run(fleet: Fleet) -> None:
    """A read's MCASTs to one topic cross as one message; each subscriber gets each once."""
    alice = fleet.subscriber(0, "alice", "news")
    carol = fleet.subscriber(2, "carol", "news")
    local = fleet.subscriber(1, "dave", "news")
    bob = fleet.nodes[1].login("bob")
    fleet.settle()  # its login is announced
    before = fleet.broker.published
    bob.send(b"MCAST news one\nMCAST news two\nMCAST news three\n")
    assert bob.received() == b"200\n" * 3
    expected = b"000 bob MCAST news one\n000 bob MCAST news two\n000 bob MCAST news three\n"
    assert local.received() == expected  # at once, on the publisher's node
    fleet.settle()
    assert alice.received() == expected
    assert carol.received() == expected
    assert local.received() == b""  # not again from the broker
    assert fleet.broker.published == before + 1


def test_runs_soon_after_a_flush_wait_for_the_rest_of_the_coalescing_window() -> None:
    """Reads that follow a flush within COALESCE_SECONDS cross together; a lone read at once.

    Paced MCASTs, each in a read of its own, would otherwise cost an AMQP
    message each. Order and copies are as without the window.
    """
    fleet = Fleet(2, coalesce_seconds=COALESCE_SECONDS)
    alice = fleet.subscriber(0, "alice", "news")
    bob = fleet.nodes[1].login("bob")
    fleet.settle()
    fleet.clock.advance(COALESCE_SECONDS)  # past the window of the login's announcement
    before = fleet.broker.published
    bob.send(b"MCAST news one\n")
    fleet.settle()  # nothing flushed lately: on the next turn
    assert fleet.broker.published == before + 1
    assert alice.received() == b"000 bob MCAST news one\n"
    for word in (b"two", b"three", b"four"):
        bob.send(b"MCAST news %s\n" % word)
        fleet.settle()
    assert fleet.broker.published == before + 1  # waiting for the window
    assert alice.received() == b""
    fleet.clock.advance(COALESCE_SECONDS)
    fleet.settle()
    assert fleet.broker.published == before + 2  # one message for the three reads
    assert alice.received() == b"".join(
        b"000 bob MCAST news %s\n" % word for word in (b"two", b"three", b"four")
    )
    fleet.clock.advance(COALESCE_SECONDS)
    bob.send(b"MCAST news five\n")
    fleet.settle()  # the window is over: at once again
    assert alice.received() == b"000 bob MCAST news five\n"


def test_mcast_to_a_topic_without_subscribers_anywhere(fleet: Fleet) -> None:
    """MCAST never answers 404 (spec), whoever subscribes where."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST nobody hello\n")
    assert bob.received() == b"200\n"
    fleet.settle()


def test_ucast_to_another_node_answers_when_that_node_has_it(fleet: Fleet) -> None:
    """UCAST to a peer on another node: 200 once the broker routed it, and it is delivered."""
    alice = fleet.nodes[0].login("alice")
    fleet.settle()
    bob = fleet.nodes[1].login("bob")
    bob.send(b"UCAST alice hi\nMCAST x y\n")
    assert bob.received() == b""  # the 200 waits for the confirm; the next answer after it
    fleet.settle()
    assert bob.received() == b"200\n200\n"
    assert alice.received() == b"000 bob UCAST alice hi\n"


def test_ucast_to_nobody_anywhere_is_404(fleet: Fleet) -> None:
    """UCAST to a peer no node has: 404 (spec, "Unicast")."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"UCAST ghost hi\n")
    fleet.settle()
    assert bob.received().startswith(b"404 ")


def test_bcast_reaches_each_peer_once_across_the_fleet(fleet: Fleet) -> None:
    """BCAST: every peer sharing a topic with the sender, once, whatever it shares (spec)."""
    both = fleet.subscriber(0, "both", "a", "b")
    only_b = fleet.subscriber(2, "onlyb", "b")
    other = fleet.subscriber(2, "other", "c")
    near = fleet.subscriber(1, "near", "a", "b")
    bob = fleet.subscriber(1, "bob", "a", "b")
    for peer in (both, only_b, near):
        peer.received()
    bob.send(b"BCAST hello\n")
    assert bob.received() == b"200\n"
    fleet.settle()
    for peer in (both, only_b, near):
        assert peer.received() == b"000 bob BCAST hello\n"
    assert other.received() == b""


def test_presence_across_nodes_keeps_the_order(fleet: Fleet) -> None:
    """The initial batch names subscribers on other nodes; later events follow in order."""
    bob = fleet.subscriber(1, "bob", "room")
    watcher = fleet.nodes[0].login("watcher")
    watcher.send(b"SUBSCRIBE room PRESENCE\n")
    fleet.settle()
    assert watcher.received() == b"200\n000 bob SUBSCRIBE room\n"
    carol = fleet.subscriber(2, "carol", "room")
    assert watcher.received() == b"000 carol SUBSCRIBE room\n"
    bob.send(b"UNSUBSCRIBE room\n")
    carol.lose()
    fleet.settle()
    assert watcher.received() == b"000 bob UNSUBSCRIBE room\n000 carol UNSUBSCRIBE room\n"


def test_presence_events_before_the_roll_call_answer_are_not_repeated(fleet: Fleet) -> None:
    """A subscriber announced live and in a node's answer is announced once."""
    bob = fleet.subscriber(1, "bob", "room")
    watcher = fleet.nodes[0].login("watcher")
    watcher.send(b"SUBSCRIBE room PRESENCE\n")
    # carol subscribes on bob's node in the same turn: she may be announced live, and
    # in bob's node's answer.
    carol = fleet.nodes[1].login("carol")
    carol.send(b"SUBSCRIBE room\n")
    fleet.settle()
    lines = watcher.received().splitlines()
    assert lines[0] == b"200"
    assert sorted(lines[1:]) == [b"000 bob SUBSCRIBE room", b"000 carol SUBSCRIBE room"]
    del bob
    fleet.clock.advance(ROLL_CALL_SECONDS)


def test_login_elsewhere_closes_the_older_connection(fleet: Fleet) -> None:
    """LOGIN of an identity logged in on another node closes the older connection (spec)."""
    old = fleet.subscriber(0, "alice", "news")
    watcher = fleet.subscriber(2, "watcher", "news", presence=True)
    watcher.received()
    fleet.clock.advance(1)
    new = fleet.nodes[1].login("alice")
    fleet.settle()
    assert old.transport.disconnecting
    assert watcher.received() == b"000 alice UNSUBSCRIBE news\n"
    bob = fleet.nodes[2].login("bob")
    bob.send(b"UCAST alice hi\n")
    fleet.settle()
    assert bob.received() == b"200\n"
    assert new.received() == b"000 bob UCAST alice hi\n"
    assert fleet.nodes[1].seam.evictions == 0
    assert fleet.nodes[0].seam.evictions == 1


def test_a_dead_node_takes_its_bindings_with_it(fleet: Fleet) -> None:
    """Once a node's connection dies, UCAST to its peers is 404 and MCAST reaches no one there."""
    alice = fleet.subscriber(0, "alice", "news")
    fleet.nodes[0].backbone.kill()
    bob = fleet.nodes[1].login("bob")
    bob.send(b"UCAST alice hi\nMCAST news x\n")
    fleet.settle()
    assert bob.received().startswith(b"404 ")
    assert alice.received() == b""


def test_a_node_back_from_a_gap_is_reachable_again(fleet: Fleet) -> None:
    """After a reconnection the node's bindings are declared again."""
    alice = fleet.subscriber(0, "alice", "news")
    node = fleet.nodes[0]
    node.backbone.kill()
    node.backbone.reconnect()
    fleet.settle()
    bob = fleet.nodes[1].login("bob")
    bob.send(b"UCAST alice hi\nMCAST news x\n")
    fleet.settle()
    assert bob.received() == b"200\n200\n"
    assert alice.received() == b"000 bob UCAST alice hi\n000 bob MCAST news x\n"


def test_ucast_without_a_broker_is_retry(fleet: Fleet) -> None:
    """With the node cut off from the broker, a UCAST to a peer not here is 400 retry."""
    fleet.nodes[1].backbone.kill()
    bob = fleet.nodes[1].login("bob")
    bob.send(b"UCAST alice hi\n")
    fleet.settle()
    assert bob.received().startswith(b"400 retry:")


def test_routed_ucast_and_bcast_take_the_same_path(fleet: Fleet) -> None:
    """Routes into the hub reach peers on other nodes: ``!ucast.<peer>`` and ``!bcast``."""
    alice = fleet.nodes[0].login("alice")
    fleet.settle()
    hub = fleet.nodes[1].hub
    outcomes = hub.deliver(
        [
            Message(body=b"hi", address="!ucast.alice", sender="app"),
            Message(body=b"hi", address="!ucast.ghost", sender="app"),
            Message(body=b"all", address="!bcast", sender="app"),
            Message(body=b"t", address="news", sender="app"),
        ]
    )
    fleet.settle()
    answered = fired(outcomes)
    statuses = [outcome.status for outcome in answered]
    assert statuses == [Status.ACCEPTED, Status.REJECTED, Status.ACCEPTED, Status.ACCEPTED]
    assert answered[1].code == "404"
    assert alice.received() == b"000 app UCAST alice hi\n000 app BCAST all\n"


def test_a_congested_subscriber_holds_what_other_nodes_send(fleet: Fleet) -> None:
    """A remote delivery that congests a local subscriber stops the node's deliveries."""
    slow = fleet.subscriber(0, "slow", "news")
    bob = fleet.nodes[1].login("bob")
    slow.protocol.pauseProducing()  # its transport's buffer is full
    bob.send(b"MCAST news 1\n")
    fleet.settle()
    backbone = fleet.nodes[0].backbone
    assert backbone.receiving.held
    bob.send(b"MCAST news 2\n")
    fleet.settle()
    assert slow.received() == b"000 bob MCAST news 1\n"
    slow.protocol.resumeProducing()
    fleet.settle()
    assert slow.received() == b"000 bob MCAST news 2\n"
    assert not backbone.receiving.held


def test_a_full_confirm_window_holds_local_publishers() -> None:
    """While the backbone is congested, a publisher is held after its read, then released."""
    world = Fleet(2)
    backbone = world.nodes[1].backbone
    bob = world.nodes[1].login("bob")
    backbone.congestion.begin()
    bob.send(b"MCAST news 1\n")
    assert bob.protocol.throttle.held
    backbone.congestion.drained()
    assert not bob.protocol.throttle.held
    world.settle()


# --- the property: random interleavings over three nodes ------------------------------------

_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["sub", "unsub", "pub", "pub", "pub", "step", "step", "settle", "hold", "release"]
        ),
        st.integers(0, 5),  # peer
        st.sampled_from(["a", "b", "c"]),  # topic
    ),
    min_size=10,
    max_size=100,
)


class _Watched:
    """What one peer asked for and got, as the property reads it after every action."""

    def __init__(self) -> None:
        self.requests: list[list[str]] = []
        """Requests not answered yet, in order: [verb, topic]; a SUBSCRIBE whose UNSUBSCRIBE
        was sent before its answer came has the verb ``cancelled``."""
        self.answered: dict[str, int] = {}
        """Topics whose SUBSCRIBE was answered 200, with when (the action's number)."""
        self.intervals: list[tuple[str, int, int]] = []
        """Finished subscriptions: (topic, answered at, unsubscribed at)."""
        self.got: dict[int, list[int]] = defaultdict(list)
        self.seen: set[int] = set()

    def read(self, data: bytes, now: int) -> None:
        """Take what the peer received, read after action number ``now``."""
        for line in data.splitlines():
            if line.startswith(b"000 "):
                if b" MCAST " in line:
                    sender, seq = (int(part) for part in line.rsplit(b" ", 1)[1].split(b"."))
                    assert seq not in self.seen, "at most once"
                    self.seen.add(seq)
                    self.got[sender].append(seq)
                continue
            verb, topic = self.requests.pop(0)
            assert line == b"200", (verb, topic, line)
            if verb == "sub":
                self.answered[topic] = now

    def unsubscribed(self, topic: str, now: int) -> None:
        """The peer sent UNSUBSCRIBE in action number ``now``."""
        if topic in self.answered:
            self.intervals.append((topic, self.answered.pop(topic), now))
            return
        for request in self.requests:  # not answered yet: no message was owed to it
            if request == ["sub", topic]:
                request[0] = "cancelled"

    def owed(self, topic: str, when: int, settles: list[int]) -> bool:
        """Whether the peer must have got the message sent in action number ``when``.

        It must if a subscription answered before is still on, or lasted
        until the world settled after it was sent (``settles``: when).
        """
        if self.answered.get(topic, when) < when:
            return True
        return any(
            t == topic and start < when and any(when < mark < end for mark in settles)
            for t, start, end in self.intervals
        )


_HELD_WHILE_QUIET: Final = [
    ("pub", 1, "b"), ("settle", 0, ""), ("hold", 1, ""), ("sub", 0, "b"), ("settle", 0, ""),
    ("pub", 1, "b"), ("release", 1, ""),
]  # fmt: skip
"""p1's node holds b quiet and its deliveries wait: p0's SUBSCRIBE b may be answered only once
that node let go of b (p0 would miss p1's next MCAST otherwise)."""
_BOUND_BEFORE_THE_PROBE: Final = [
    ("sub", 0, "a"), ("step", 0, ""), ("pub", 1, "b"), ("unsub", 0, "a"), ("step", 0, ""),
    ("sub", 0, "b"), ("settle", 0, ""), ("pub", 1, "b"),
]  # fmt: skip
"""p0's node binds b after p1's node's MCAST came back, before its probe: b is not quiet."""


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_ACTIONS)
@example(actions=_HELD_WHILE_QUIET)
@example(actions=_BOUND_BEFORE_THE_PROBE)
def test_random_interleavings_keep_per_sender_order_and_at_most_once(
    actions: list[tuple[str, int, str]],
) -> None:
    """Any interleaving of SUBSCRIBE, UNSUBSCRIBE and MCAST over three nodes, six peers.

    The broker makes progress a turn at a time (``step``) or until quiet
    (``settle``), between the peers' requests, so that topics are held quiet
    and let go of while MCASTs and SUBSCRIBEs are in flight; a node's
    deliveries may wait (``hold``, as behind a congested subscriber) while
    its peers go on publishing. Each receiver
    gets each sender's messages in the order they were sent and never
    twice; a subscriber gets every message another peer sent after its
    SUBSCRIBE was answered 200 (and had not unsubscribed before it was
    delivered).
    """
    world = Fleet(3)
    peers = [world.nodes[index % 3].login(f"p{index}") for index in range(6)]
    watched = [_Watched() for _ in peers]
    subscribed: list[set[str]] = [set() for _ in peers]
    sent: list[tuple[int, str, int, int]] = []  # (sender, topic, seq, when)
    settles: list[int] = []
    holds = [Congestion() for _ in world.nodes]
    for now, (action, index, topic) in enumerate(actions):
        peer = peers[index]
        if action == "sub" and topic not in subscribed[index]:
            peer.send(f"SUBSCRIBE {topic}\n".encode())
            watched[index].requests.append(["sub", topic])
            subscribed[index].add(topic)
        elif action == "unsub" and topic in subscribed[index]:
            peer.send(f"UNSUBSCRIBE {topic}\n".encode())
            watched[index].requests.append(["unsub", topic])
            watched[index].unsubscribed(topic, now)
            subscribed[index].discard(topic)
        elif action == "pub":
            peer.send(f"MCAST {topic} {index}.{len(sent)}\n".encode())
            watched[index].requests.append(["pub", topic])
            sent.append((index, topic, len(sent), now))
        elif action == "step":
            world.step()
        elif action == "settle":
            world.settle()
            if not any(node.backbone.receiving.held for node in world.nodes):
                settles.append(now)
        elif action == "hold":
            world.nodes[index % 3].backbone.receiving.hold(holds[index % 3])
        elif action == "release":
            world.nodes[index % 3].backbone.receiving.release(holds[index % 3])
        for who, other in enumerate(peers):
            watched[who].read(other.received(), now)
    for node, hold in zip(world.nodes, holds, strict=True):
        node.backbone.receiving.release(hold)
    world.settle()
    for who, other in enumerate(peers):
        mine = watched[who]
        mine.read(other.received(), len(actions))
        assert not mine.requests, "every request answered"
        for sequence in mine.got.values():
            assert sequence == sorted(sequence), "per-sender order"
        for sender, topic, seq, when in sent:
            if sender != who and mine.owed(topic, when, settles):
                assert seq in mine.seen, f"p{who} missed {seq} on {topic}"
    assert all(not node.seam.quiet._rounds for node in world.nodes)
    quiet = sum(node.seam.quiet.unpublished for node in world.nodes)
    event("MCAST runs held quiet: " + ("none" if not quiet else "some"))
    waited = sum(node.seam.quiet.waits for node in world.nodes)
    event("SUBSCRIBEs that waited for a node to let go: " + ("none" if not waited else "some"))


def test_answers_of_a_fleet_ucast_become_outcomes(fleet: Fleet) -> None:
    """A routed UCAST's outcome is given once the other nodes answered."""
    outcomes = fleet.nodes[0].hub.deliver([Message(body=b"x", address="!ucast.nobody")])
    assert not outcomes.called
    fleet.settle()
    assert fired(outcomes) == [
        Outcome.rejected("no peer 'nobody' is connected to any node", code="404")
    ]


def test_subscribe_is_answered_once_the_binding_is_in_place(fleet: Fleet) -> None:
    """The 200 waits for the node's binding: what other nodes publish after it arrives."""
    alice = fleet.nodes[0].login("alice")
    alice.send(b"SUBSCRIBE fresh\n")
    assert alice.received() == b""  # the binding is on its way
    fleet.settle()
    assert alice.received() == b"200\n"
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST fresh right after\n")
    assert bob.received() == b"200\n"
    fleet.settle()
    assert alice.received() == b"000 bob MCAST fresh right after\n"


# --- quiet topics ------------------------------------------------------------------------------


def test_a_node_never_receives_its_own_messages(fleet: Fleet) -> None:
    """What a node publishes reaches the other nodes bound for it, never the node itself."""
    alice = fleet.subscriber(0, "alice", "news")
    dave = fleet.subscriber(1, "dave", "news")
    bob = fleet.nodes[1].login("bob")
    fleet.settle()
    before = [node.backbone.deliveries for node in fleet.nodes]
    bob.send(b"MCAST news hi\n")
    fleet.settle()
    assert alice.received() == dave.received() == b"000 bob MCAST news hi\n"
    after = [node.backbone.deliveries for node in fleet.nodes]
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 0, 0]


def test_a_topic_subscribed_on_the_publishing_node_alone_stays_there(fleet: Fleet) -> None:
    """Once a run came back unroutable and the probe too, the topic's MCASTs stay on the node."""
    dave = fleet.subscriber(1, "dave", "news")
    bob = fleet.nodes[1].login("bob")
    fleet.settle()
    published = fleet.broker.published
    bob.send(b"MCAST news 1\n")
    fleet.settle()  # published, back unroutable; s.news bound; the probe back unroutable
    assert fleet.broker.published == published + 2
    for number in range(2, 5):
        bob.send(b"MCAST news %d\n" % number)
        fleet.settle()
    assert fleet.broker.published == published + 2
    assert fleet.nodes[1].seam.quiet.unpublished == 3
    assert dave.received() == b"".join(b"000 bob MCAST news %d\n" % n for n in range(1, 5))


def test_a_new_subscriber_elsewhere_is_answered_once_the_topic_is_let_go(fleet: Fleet) -> None:
    """The 200 waits until the node holding the topic quiet let go: nothing after it is missed."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST news 1\n")
    fleet.settle()
    bob.send(b"MCAST news 2\n")
    fleet.settle()
    assert fleet.nodes[1].seam.quiet.unpublished == 1
    alice = fleet.nodes[0].login("alice")
    alice.send(b"SUBSCRIBE news\n")
    fleet.step()  # the binding
    fleet.step()  # its barrier
    fleet.step()  # the interest, routed to bob's node
    assert alice.received() == b""
    fleet.settle()  # bob's node lets go, answers; the next interest comes back
    assert alice.received() == b"200\n"
    assert fleet.nodes[0].seam.quiet.waits == 1
    bob.send(b"MCAST news 3\n")
    fleet.settle()
    assert alice.received() == b"000 bob MCAST news 3\n"


def test_a_stalled_node_holding_the_topic_quiet_delays_the_answer_a_while(fleet: Fleet) -> None:
    """A node that cannot let go in time: the SUBSCRIBE is answered after INTEREST_SECONDS."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST news 1\n")
    fleet.settle()
    fleet.nodes[1].backbone.stall()  # what it sends no longer reaches the broker
    alice = fleet.nodes[0].login("alice")
    alice.send(b"SUBSCRIBE news\n")
    fleet.settle()
    assert alice.received() == b""
    fleet.clock.advance(INTEREST_SECONDS)
    assert alice.received() == b"200\n"
    assert fleet.nodes[0].seam.quiet.slow == 1
    fleet.nodes[1].backbone.unstall()
    fleet.settle()


def test_quiet_topics_not_published_to_are_forgotten(fleet: Fleet) -> None:
    """A quiet topic unused between two sweeps is forgotten, with its binding."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST news 1\n")
    fleet.settle()
    seam = fleet.nodes[1].seam
    key = (seam.exchange, "s.news")
    assert fleet.broker.bindings[key] == {fleet.nodes[1].backbone}
    fleet.clock.advance(QUIET_SWEEP_SECONDS)
    bob.send(b"MCAST news 2\n")  # used: kept
    fleet.settle()
    fleet.clock.advance(QUIET_SWEEP_SECONDS)
    fleet.settle()
    assert fleet.broker.bindings[key]
    fleet.clock.advance(QUIET_SWEEP_SECONDS)
    fleet.settle()
    assert not fleet.broker.bindings[key]
    assert seam.quiet.unpublished == 1
    assert fleet.clock.getDelayedCalls() == []


def test_a_node_back_from_a_gap_has_its_topics_let_go(fleet: Fleet) -> None:
    """Nodes may hold a topic quiet while its subscribers' node has no queue; not after."""
    alice = fleet.subscriber(0, "alice", "news")
    fleet.nodes[0].backbone.kill()
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST news lost\n")  # nobody bound any more: back unroutable
    fleet.settle()
    bob.send(b"MCAST news held\n")
    fleet.settle()
    assert fleet.nodes[1].seam.quiet.unpublished == 1
    fleet.nodes[0].backbone.reconnect()
    fleet.settle()  # node 0 binds again and announces news: bob's node lets go
    bob.send(b"MCAST news back\n")
    fleet.settle()
    assert alice.received() == b"000 bob MCAST news back\n"


def test_a_node_that_loses_its_connection_forgets_its_quiet_topics(fleet: Fleet) -> None:
    """Without a connection there is nothing to hold quiet; after it, topics are probed again."""
    bob = fleet.nodes[1].login("bob")
    bob.send(b"MCAST news 1\n")
    fleet.settle()
    backbone = fleet.nodes[1].backbone
    backbone.kill()
    backbone.reconnect()
    fleet.settle()
    assert fleet.nodes[1].seam.quiet._quiet == {}
    assert not fleet.broker.bindings[(fleet.nodes[1].seam.exchange, "s.news")]
