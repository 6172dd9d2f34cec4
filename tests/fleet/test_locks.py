"""Fleet locks (`gateway.fleet.locks`) over an in-memory broker on a `Clock`.

Each node is a `FleetLocks` over a `MemoryBackbone`; the nodes meet on one
`MemoryBroker` (tests/fleet/broker.py), whose exclusive queues are the
locks. ``clock.advance(0)`` runs the world until it is quiet. What a
holder does is a `Work` that records when it started and stopped, so that
"never two at once" is checked on the clock. The behaviour checked is the
module's docstring and docs/fleet.rst ("Work that runs once per fleet").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from zope.interface.verify import verifyObject

from gateway.core.interfaces import IBackbone, IFleetLock
from gateway.fleet.locks import (
    CHECK_SECONDS,
    RELEASE_SECONDS,
    RETRY_JITTER,
    RETRY_SECONDS,
    FleetLock,
    FleetLocks,
    lock_queue,
)
from gateway.metrics import GatewayMetrics
from tests.fleet.broker import MemoryBackbone, MemoryBroker

LOCK = "upstream.feed"
LEASE = 10.0
"""The lease: the backbone's heartbeat interval (RabbitMQ gives a silent connection up
after 2 to 3 of them)."""
LONGEST_RETRY = RETRY_SECONDS * (1 + RETRY_JITTER)


class Work:
    """What a lock's holder does: running while it holds the lock, as the clock saw it."""

    def __init__(self, clock: Clock, name: str, log: list[tuple[float, str, str]]) -> None:
        self.clock = clock
        self.name = name
        self.running = False
        self.starts = 0
        self.log = log

    def acquired(self) -> None:
        """The lock is this node's: start."""
        assert not self.running
        self.running = True
        self.starts += 1
        self.log.append((self.clock.seconds(), self.name, "start"))

    def lost(self) -> None:
        """The lock is gone: stop at once."""
        assert self.running
        self.finish()

    def finish(self) -> None:
        """Stop (told to, or of its own accord before releasing the lock)."""
        self.running = False
        self.log.append((self.clock.seconds(), self.name, "stop"))


class Node:
    """One node: its backbone, its locks, and the work under lock ``LOCK``."""

    def __init__(self, world: World, name: str, jitter: float) -> None:
        self.name = name
        self.metrics = GatewayMetrics()
        self.backbone = MemoryBackbone(world.broker, name)
        self.locks = FleetLocks(
            self.backbone,
            world.clock,
            lease_seconds=LEASE,
            metrics=self.metrics,
            random=lambda: jitter,
        )
        self.lock = self.locks.lock(LOCK)
        self.work = Work(world.clock, name, world.log)

    def start(self) -> None:
        """Ask for the lock."""
        self.lock.start(self.work.acquired, self.work.lost)

    def sample(self, name: str) -> float:
        """A lock metric of this node."""
        value = self.metrics.registry.get_sample_value(name, {"lock": LOCK})
        return 0.0 if value is None else value


class World:
    """Nodes on one in-memory broker and one clock."""

    def __init__(self, count: int = 3) -> None:
        self.clock = Clock()
        self.broker = MemoryBroker(self.clock)
        self.log: list[tuple[float, str, str]] = []
        # Different jitters: the nodes do not ask in step.
        self.nodes = [Node(self, f"n{index}", index / count) for index in range(count)]

    def settle(self) -> None:
        """Run the world until nothing is left to do now."""
        self.clock.advance(0)

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """Let ``seconds`` pass in small steps, settling after each."""
        for _ in range(round(seconds / step)):
            self.clock.advance(step)
            self.settle()

    def holders(self) -> list[str]:
        """The nodes that hold the lock, by their own account."""
        return [node.name for node in self.nodes if node.lock.held]

    def running(self) -> list[str]:
        """The nodes whose work runs."""
        return [node.name for node in self.nodes if node.work.running]

    def at_most_one_ran_at_a_time(self) -> bool:
        """No start while another node's work was running, over the whole log."""
        running: set[str] = set()
        for _, name, what in sorted(self.log, key=lambda entry: entry[0]):
            if what == "start":
                if running:
                    return False
                running.add(name)
            else:
                running.discard(name)
        return True


@pytest.fixture
def world() -> Iterator[World]:
    """Three nodes, all asking for the lock, settled: n0 holds it."""
    world = World()
    for node in world.nodes:
        node.start()
    world.settle()
    yield world
    assert world.at_most_one_ran_at_a_time(), world.log


def test_the_lock_provides_the_interface(world: World) -> None:
    """A `FleetLock` is an `IFleetLock`, and the memory backbone with claims an `IBackbone`."""
    assert verifyObject(IFleetLock, world.nodes[0].lock)
    assert verifyObject(IBackbone, world.nodes[0].backbone)


def test_one_node_holds_it(world: World) -> None:
    """Of three nodes asking, the first asks first and holds it; the others are refused."""
    assert world.holders() == ["n0"]
    assert world.running() == ["n0"]
    assert world.broker.exclusive == {lock_queue(LOCK): world.nodes[0].backbone}
    world.advance(30)
    assert world.holders() == ["n0"]
    assert world.nodes[0].work.starts == 1
    assert [node.sample("msggateway_fleet_lock_held") for node in world.nodes] == [1, 0, 0]
    assert world.nodes[0].sample("msggateway_fleet_lock_acquired_total") == 1
    assert world.nodes[0].sample("msggateway_fleet_lock_takeovers_total") == 0


def test_the_queue_has_a_well_known_name() -> None:
    """Every node asks for the same queue: ``msggateway.lock.<name>``."""
    assert lock_queue("upstream.feed") == "msggateway.lock.upstream.feed"


def test_the_holder_confirms_its_hold_every_check() -> None:
    """A holder claims again every `CHECK_SECONDS` (a third of a short lease)."""
    world = World(1)
    node = world.nodes[0]
    node.start()
    world.settle()
    claims: list[str] = []
    claim = node.backbone.claim

    def counting(queue: str) -> Deferred[bool]:
        claims.append(queue)
        return claim(queue)

    node.backbone.claim = counting  # type: ignore[method-assign]
    world.advance(10)
    assert len(claims) == pytest.approx(10 / CHECK_SECONDS, abs=1)
    assert node.lock.held
    short = FleetLocks(MemoryBackbone(world.broker, "short"), world.clock, lease_seconds=1.5)
    assert short.check_interval == 0.5


def test_takeover_after_the_holders_connection_dies(world: World) -> None:
    """The holder's death stops its work at once; another node takes over within a retry."""
    holder = world.nodes[0]
    with capturedLogs() as events:
        holder.backbone.kill()
    assert world.running() == []  # stopped in the same turn: nobody else can have it yet
    assert holder.sample("msggateway_fleet_lock_lost_total") == 1
    assert any("lost lock" in str(event.get("log_format")) for event in events)
    killed_at = world.clock.seconds()
    world.advance(LONGEST_RETRY + 0.1)
    assert len(world.holders()) == 1
    assert world.holders() == world.running()
    taker = next(node for node in world.nodes if node.lock.held)
    took_at = next(when for when, name, what in world.log if name == taker.name)
    assert took_at - killed_at <= LONGEST_RETRY
    assert taker.sample("msggateway_fleet_lock_takeovers_total") == 1
    assert taker.sample("msggateway_fleet_lock_held") == 1


def test_a_node_back_from_a_gap_does_not_take_it_back(world: World) -> None:
    """After its reconnection the old holder is refused while the new one holds the lock."""
    world.nodes[0].backbone.kill()
    world.advance(LONGEST_RETRY + 0.1)
    taker = world.holders()
    world.nodes[0].backbone.reconnect()
    world.advance(10)
    assert world.holders() == taker
    assert world.nodes[0].work.starts == 1


def test_a_gap_nobody_used_gives_it_back_to_the_same_node() -> None:
    """A lone node that reconnects holds its lock again (not counted as a takeover)."""
    world = World(1)
    node = world.nodes[0]
    node.start()
    world.settle()
    node.backbone.kill()
    assert not node.work.running
    node.backbone.reconnect()
    world.settle()
    assert node.work.running
    assert node.work.starts == 2
    assert node.sample("msggateway_fleet_lock_acquired_total") == 2
    assert node.sample("msggateway_fleet_lock_takeovers_total") == 0


def test_release_on_stop_after_the_work_finished(world: World) -> None:
    """A stopping holder keeps the lock until its work is over, then releases it; no lost()."""
    holder = world.nodes[0]
    finished: Deferred[None] = Deferred()
    holder.work.finish()  # the holder stops its own work first (an upstream's stop)
    with capturedLogs() as events:
        released = holder.lock.stop(finished)
        world.advance(5)
        assert world.holders() == ["n0"]  # still: its offsets may be on their way
        assert not released.called
        finished.callback(None)
        world.settle()
    assert released.called
    assert not holder.lock.held
    assert holder.sample("msggateway_fleet_lock_lost_total") == 0
    assert any("released lock" in str(event.get("log_format")) for event in events)
    world.advance(LONGEST_RETRY + 0.1)
    assert len(world.holders()) == 1 and world.holders() != ["n0"]
    assert holder.work.starts == 1  # no more calls after stop


def test_a_claim_answered_after_stop_is_released() -> None:
    """A stop while the first claim is on its way deletes what that claim got."""
    world = World(2)
    first, second = world.nodes
    first.start()
    released = first.lock.stop()  # before the broker answered
    world.settle()
    assert released.called
    assert world.broker.exclusive == {}
    assert not first.work.running
    second.start()
    world.settle()
    assert world.holders() == ["n1"]


def test_without_a_connection_it_asks_once_connected() -> None:
    """A lock started while the backbone is down is asked for on the next connection."""
    world = World(1)
    node = world.nodes[0]
    node.backbone.kill()
    node.start()
    world.advance(5)
    assert not node.lock.held
    node.backbone.reconnect()
    world.settle()
    assert node.lock.held and node.work.running


def test_an_unconfirmed_hold_ends_before_rabbitmq_can_give_it_away(world: World) -> None:
    """Cut off (a partition), the holder stops within the lease; RabbitMQ frees it later.

    RabbitMQ gives a silent connection up 2 to 3 heartbeat intervals after
    it last heard from it; the lease is one interval from the last confirmed
    claim's sending.
    """
    holder = world.nodes[0]
    holder.backbone.stall()
    stalled_at = world.clock.seconds()
    world.advance(LEASE + 0.1)
    assert not holder.work.running
    assert holder.sample("msggateway_fleet_lock_lost_total") == 1
    stopped_at = next(when for when, name, what in world.log if what == "stop")
    assert stopped_at <= stalled_at + LEASE + 1e-6
    assert world.holders() == []  # RabbitMQ still has it for n0: nobody runs
    world.advance(LEASE)  # 2 intervals: RabbitMQ times the connection out
    holder.backbone.kill()
    world.advance(LONGEST_RETRY + 0.1)
    assert len(world.running()) == 1 and world.running() != ["n0"]


def test_confirmation_back_after_a_stall_holds_it_again() -> None:
    """A stall shorter than RabbitMQ's time-out: the work stops, then starts again."""
    world = World(1)
    node = world.nodes[0]
    node.start()
    world.settle()
    node.backbone.stall()
    world.advance(LEASE + 1)
    assert not node.work.running
    node.backbone.unstall()
    world.advance(LONGEST_RETRY)
    assert node.work.running
    assert node.work.starts == 2
    assert node.sample("msggateway_fleet_lock_lost_total") == 1


def test_the_refused_ask_again_with_jitter(world: World) -> None:
    """A refused node asks every `RETRY_SECONDS`, plus up to `RETRY_JITTER` of it."""
    waiting = world.nodes[2]
    assert waiting.locks.retry_delay() == pytest.approx(RETRY_SECONDS * (1 + RETRY_JITTER * 2 / 3))
    claims: list[float] = []
    claim = waiting.backbone.claim

    def counting(queue: str) -> Deferred[bool]:
        claims.append(world.clock.seconds())
        return claim(queue)

    waiting.backbone.claim = counting  # type: ignore[method-assign]
    world.advance(10)
    gaps = [later - earlier for earlier, later in itertools.pairwise(claims)]
    assert gaps and all(RETRY_SECONDS <= gap <= LONGEST_RETRY + 0.1 for gap in gaps)


def test_stopping_the_locks_halts_work_still_running(world: World) -> None:
    """The node's locks stop: a holder that did not stop its lock has its work stopped first."""
    holder = world.nodes[0]
    stopped = holder.locks.stop()
    assert not holder.work.running
    world.settle()
    assert stopped.called
    assert world.broker.exclusive == {}


def test_stopping_the_locks_waits_for_releases_at_most_a_while(world: World) -> None:
    """A release that never comes (a stalled broker) holds the stop `RELEASE_SECONDS` at most."""
    holder = world.nodes[0]
    holder.backbone.stall()
    stopped = holder.locks.stop()
    world.advance(RELEASE_SECONDS - 0.1)
    assert not stopped.called
    world.advance(0.2)
    assert stopped.called


def test_a_lock_is_made_once_and_started_once(world: World) -> None:
    """Asking for the same lock twice on one node is a mistake of the assembly."""
    node = world.nodes[0]
    with pytest.raises(ValueError, match="once"):
        node.locks.lock(LOCK)
    with pytest.raises(RuntimeError, match="once"):
        node.start()
    assert isinstance(node.lock, FleetLock)


def test_a_node_told_refused_can_stop_asking() -> None:
    """``refused()`` comes with each refusal; a stopped lock of the name can be made again."""
    world = World(2)
    first, second = world.nodes
    first.start()
    world.settle()
    refusals: list[str] = []
    second.lock.start(second.work.acquired, second.work.lost, lambda: refusals.append("refused"))
    world.settle()
    assert refusals == ["refused"] and not second.lock.held
    with pytest.raises(ValueError, match="once per node"):
        second.locks.lock(LOCK)  # still asking
    second.lock.stop()
    world.advance(2 * LONGEST_RETRY)
    assert refusals == ["refused"]  # stopped: no more asking
    again = second.locks.lock(LOCK)
    assert again is not second.lock and not again.stopped
    first.work.finish()
    first.lock.stop()
    world.settle()
    again.start(second.work.acquired, second.work.lost)
    world.settle()
    assert again.held and second.work.running
    second.work.finish()
    again.stop()
    world.settle()
    assert world.broker.exclusive == {}
    assert world.at_most_one_ran_at_a_time(), world.log
