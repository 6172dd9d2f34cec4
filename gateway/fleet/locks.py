"""Locks for work that must run once per fleet: one exclusive queue per lock.

DESIGN.md, "Scale: a fleet on RabbitMQ": consuming upstreams (a stream
upstream that subscribes, an SSMP upstream that logs in with a name, a DMP
``get``) run on one node at a time. Without a lock, N nodes would consume
everything N times (and a DMP feed's reader holds one while it reads,
`gateway.fleet.dmp`). RabbitMQ 3.10 has no single active consumer for
streams, so the lock is an exclusive AMQP 0-9-1 queue with a well-known
name, ``msggateway.lock.<name>`` (`lock_queue`), claimed on the node's
backbone connection (`gateway.fleet.exclusive`):

- **Asking.** Every node that wants a lock declares its queue exclusive;
  RabbitMQ lets one connection have it and refuses the others (405). A node
  refused asks again every `RETRY_SECONDS`, plus up to half as much again
  at random (nodes that lost a holder together do not ask in step). The
  holder's death deletes the queue, so the next ask after it succeeds.
- **Holding.** The holder confirms its hold every `check_interval` (at most
  `CHECK_SECONDS`) by declaring the queue again, which RabbitMQ answers
  only to the connection that holds it. The hold counts until one *lease*
  (``lease_seconds``, the backbone's heartbeat interval) after the last
  confirmed declare was sent; past that, unconfirmed, the holder takes the
  lock for lost (and asks again).
- **Losing.** When the backbone's connection is lost (`IBackbone.on_lost`),
  every lock held on it is lost with it (RabbitMQ deletes the queues with
  the connection). Either way the holder's ``lost()`` is called at once, in
  that reactor turn: its work stops before another node can have the lock.
- **Releasing.** A holder that stops (`FleetLock.stop`) deletes the queue
  once its work is over (stored offsets are out), so that the next node
  takes over within `RETRY_SECONDS` and goes on from there.

The guarantee: at most one node does a lock's work at any time. RabbitMQ
lets another node have the lock only once the holder's connection is gone:

1. closed by the holder (a stop: its work is over first), or by its death
   (then it does nothing any more);
2. ended by a socket error the holder's side sees too: pika reports it, and
   the work stops in that reactor turn (``lost()``), before another node
   can ask (at least a round trip later);
3. timed out by RabbitMQ for silence (a partition, a stalled host):
   RabbitMQ gives a connection up 2 to 3 heartbeat intervals after it last
   heard from it (``rabbit_heartbeat``), and the holder hears nothing back
   either. Its last confirmed declare was sent before RabbitMQ last heard
   it, and its hold ends one heartbeat interval after that send: at least
   one interval before RabbitMQ can give the lock to anyone.

What this assumes: RabbitMQ is one node, or a cluster that does not let
both sides of a network partition go on (``pause_minority``; with
``ignore``, each side has its own queue records and can grant the lock
once); and the holder's reactor is never stalled for a heartbeat interval
(the hold's end is a timer). What it does not cover: work handed on before
the stop still completes (messages already routed are delivered), and the
next holder goes on from what the last one left (a stream's stored offset),
so what was settled after the last stored offset, or in flight, comes again.

A RabbitMQ resource alarm that blocks the holder's connection stops its
confirmations, so it stops its work after one interval; RabbitMQ does not
time out a blocked connection, so no other node takes over until the alarm
clears: safe, not live.

Takeover time after a holder's ``kill -9`` (its socket closes at once):
at most `RETRY_SECONDS` plus its jitter plus a round trip, then whatever
the new holder's work takes to start (connecting, subscribing).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Final

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from gateway.core.interfaces import IBackbone, IFleetLock
from gateway.metrics import GatewayMetrics, LockStats

__all__ = [
    "CHECK_SECONDS",
    "LOCK_QUEUE_PREFIX",
    "RELEASE_SECONDS",
    "RETRY_JITTER",
    "RETRY_SECONDS",
    "FleetLock",
    "FleetLocks",
    "lock_queue",
]

LOCK_QUEUE_PREFIX: Final = "msggateway.lock."
RETRY_SECONDS: Final = 1.0
"""A node refused a lock asks for it again this often: a dead holder's lock is taken over
within this (plus jitter), for one small declare per second per waiting node."""
RETRY_JITTER: Final = 0.5
"""Up to this fraction of `RETRY_SECONDS` is added at random to each wait."""
CHECK_SECONDS: Final = 1.0
"""The holder confirms its hold at least this often (a third of the lease when shorter),
so that one slow answer does not end a hold."""
RELEASE_SECONDS: Final = 5.0
"""How long `FleetLocks.stop` waits for the locks' releases before the connection closes
(which releases them too)."""


def lock_queue(name: str) -> str:
    """The exclusive queue that is lock ``name``."""
    return LOCK_QUEUE_PREFIX + name


@implementer(IFleetLock)
class FleetLock:
    """One lock, as this node asks for it, holds it and lets it go (`FleetLocks.lock`).

    Args:
        locks: The node's locks (its backbone, clock and lease).
        name: The lock's name, the same on every node.
        stats: Its numbers.
    """

    _log = Logger()

    def __init__(self, locks: FleetLocks, name: str, stats: LockStats) -> None:
        self.name = name
        self.queue = lock_queue(name)
        self._locks = locks
        self._stats = stats
        self._acquired: Callable[[], None] | None = None
        self._lost: Callable[[], None] | None = None
        self._refused_by: Callable[[], None] | None = None
        self._wanted = False
        self._held_until: float | None = None
        """When the hold ends unless confirmed again (None: not held)."""
        self._pending = False
        """A claim is on its way on the current connection."""
        self._generation = 0
        """Bumped when the connection is lost: answers from before are not counted."""
        self._refused = False
        """Another node held it since this one last did (the next acquisition is a takeover)."""
        self._next_call: IDelayedCall | None = None
        self._expiry_call: IDelayedCall | None = None
        self._released: Deferred[None] | None = None

    @property
    def held(self) -> bool:
        """Whether this node holds the lock now."""
        return self._held_until is not None

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called (a lock of the same name may be made again)."""
        return self._released is not None

    # --- IFleetLock -----------------------------------------------------------------------

    def start(
        self,
        acquired: Callable[[], None],
        lost: Callable[[], None],
        refused: Callable[[], None] | None = None,
    ) -> None:
        """Ask for the lock now (if connected) and until `stop`; see `IFleetLock.start`.

        ``refused()``, if given, is called each time RabbitMQ answers that
        another connection holds the lock (work that only wants it now, such
        as a DMP feed's reader, stops asking then).
        """
        if self._wanted or self._released is not None:
            raise RuntimeError(f"lock {self.name} is started once")
        self._acquired = acquired
        self._lost = lost
        self._refused_by = refused
        self._wanted = True
        self._ask()

    def stop(self, finished: Deferred[Any] | None = None) -> Deferred[None]:
        """Stop asking; release the lock once ``finished`` fired; see `IFleetLock.stop`."""
        if self._released is not None:
            return self._released
        self._wanted = False
        self._acquired = self._lost = self._refused_by = None
        self._cancel_calls()
        done: Deferred[None] = Deferred()
        self._released = done

        def release(_: object = None) -> None:
            backbone = self._locks.backbone
            # A claim still on its way is answered first: the release deletes what it got.
            if (self.held or self._pending) and backbone.ready:
                backbone.release(self.queue).addBoth(released)
            else:
                released()

        def released(_: object = None) -> None:
            if self.held:
                self._log.info(
                    "fleet: node {node} released lock {lock}",
                    node=self._locks.node,
                    lock=self.name,
                )
            self._held_until = None
            self._stats.held = 0
            done.callback(None)

        if finished is None:
            release()
        else:
            finished.addBoth(release)
        return done

    def halt(self) -> Deferred[None]:
        """The node stops while this lock is still asked for: stop its work, then release it."""
        if self._released is None and self.held and self._lost is not None:
            self._lost()
        return self.stop()

    # --- the backbone's connection ----------------------------------------------------------

    def connected(self) -> None:
        """The backbone is (re)connected: ask at once."""
        self._ask()

    def connection_lost(self) -> None:
        """The backbone's connection is gone, and with it the queue if this node held it."""
        self._generation += 1
        self._pending = False
        self._cancel_calls()
        if self.held and self._wanted:
            self._lose("its connection to RabbitMQ was lost")
        elif self.held:  # stopping: nothing left to release
            self._held_until = None
            self._stats.held = 0

    # --- asking and holding -------------------------------------------------------------------

    def _ask(self) -> None:
        if self._next_call is not None and self._next_call.active():
            self._next_call.cancel()
        self._next_call = None
        backbone = self._locks.backbone
        if not self._wanted or self._pending or not backbone.ready:
            return
        self._pending = True
        sent = self._locks.clock.seconds()
        claimed = backbone.claim(self.queue)
        claimed.addCallback(self._answered, sent, self._generation)

    def _answered(self, claimed: bool, sent: float, generation: int) -> None:
        if generation != self._generation:
            return  # asked on a connection that is gone (its locks went with it)
        self._pending = False
        if not self._wanted:
            return
        locks = self._locks
        until = sent + locks.lease_seconds
        if claimed and until > locks.clock.seconds():
            self._hold(until)
            self._later(locks.check_interval)
        elif claimed:
            self._later(0)  # confirmed, but too late to count: ask again now
        else:
            if self.held:
                self._lose("RabbitMQ gave it to another connection")
            self._refused = True
            self._later(locks.retry_delay())
            if self._refused_by is not None:
                self._refused_by()

    def _hold(self, until: float) -> None:
        clock = self._locks.clock
        was_held = self.held
        self._held_until = until
        if self._expiry_call is not None and self._expiry_call.active():
            self._expiry_call.cancel()
        self._expiry_call = clock.callLater(until - clock.seconds(), self._expire)
        if was_held:
            return
        stats = self._stats
        stats.held = 1
        stats.acquired += 1
        if self._refused:
            stats.takeovers += 1
        self._log.info(
            "fleet: node {node} holds lock {lock} ({how})",
            node=self._locks.node,
            lock=self.name,
            how="taken over from another node" if self._refused else "nobody held it",
            takeover=self._refused,
        )
        self._refused = False
        if self._acquired is not None:
            self._acquired()

    def _expire(self) -> None:
        self._expiry_call = None
        until = self._held_until
        if until is None or self._locks.clock.seconds() < until:
            return
        self._lose(
            f"RabbitMQ did not confirm the hold within {self._locks.lease_seconds:g} s"
            " (the heartbeat interval)"
        )
        self._ask()  # unless the confirmation asked for is still on its way

    def _lose(self, reason: str) -> None:
        self._held_until = None
        if self._expiry_call is not None and self._expiry_call.active():
            self._expiry_call.cancel()
        self._expiry_call = None
        stats = self._stats
        stats.held = 0
        stats.lost += 1
        self._log.warn(
            "fleet: node {node} lost lock {lock}: {reason}; its work stops on this node",
            node=self._locks.node,
            lock=self.name,
            reason=reason,
        )
        if self._lost is not None:
            self._lost()

    def _later(self, seconds: float) -> None:
        if self._next_call is not None and self._next_call.active():
            self._next_call.cancel()
        self._next_call = self._locks.clock.callLater(seconds, self._ask)

    def _cancel_calls(self) -> None:
        for call in (self._next_call, self._expiry_call):
            if call is not None and call.active():
                call.cancel()
        self._next_call = self._expiry_call = None


class FleetLocks:
    """This node's fleet locks, over its backbone.

    Args:
        backbone: The node's connection to RabbitMQ.
        clock: Timers.
        lease_seconds: How long a confirmed hold counts from when its claim
            was sent: the backbone's AMQP heartbeat interval, which must
            stay below twice it (RabbitMQ gives a silent connection up
            after 2 to 3 intervals).
        metrics: Where each lock is counted (None: nowhere).
        random: A number in [0, 1) for the jitter of each retry.
    """

    def __init__(
        self,
        backbone: IBackbone,
        clock: IReactorTime,
        *,
        lease_seconds: float,
        metrics: GatewayMetrics | None = None,
        random: Callable[[], float] = random.random,
    ) -> None:
        self.backbone = backbone
        self.node: str = backbone.node
        self.clock = clock
        self.lease_seconds = lease_seconds
        self.check_interval = min(CHECK_SECONDS, lease_seconds / 3)
        """How often a holder confirms its hold."""
        self._metrics = metrics
        self._random = random
        self._locks: dict[str, FleetLock] = {}
        backbone.on_connected(self._connected)
        backbone.on_lost(self._lost)

    def lock(self, name: str) -> FleetLock:
        """The lock ``name`` (one object per name at a time; start it to ask for it).

        A lock that was stopped may be made again: the new one asks anew.
        The old one's release (if it held the lock) must be over first, or
        it would delete what the new one claims.
        """
        known = self._locks.get(name)
        if known is not None and not known.stopped:
            raise ValueError(f"lock {name} is made once per node")
        stats = self._metrics.fleet_lock(name) if self._metrics is not None else LockStats()
        lock = self._locks[name] = FleetLock(self, name, stats)
        return lock

    def retry_delay(self) -> float:
        """The wait before a refused node asks again."""
        return RETRY_SECONDS * (1.0 + RETRY_JITTER * self._random())

    def stop(self) -> Deferred[None]:
        """Stop every lock; fire once all are released, or after `RELEASE_SECONDS`.

        Their holders stop them first, once their work is over (an
        upstream's stop); a lock still held here has its work stopped
        (``lost()``) before it is released.
        """
        waiting: list[Deferred[None]] = []
        for lock in self._locks.values():
            stopped = lock.halt()
            if not stopped.called:
                waiting.append(stopped)
        if not waiting:
            return succeed(None)
        done: Deferred[None] = Deferred()

        def finish(_: object = None) -> None:
            if timer.active():
                timer.cancel()
            if not done.called:
                done.callback(None)

        timer = self.clock.callLater(RELEASE_SECONDS, finish)
        DeferredList(waiting, consumeErrors=True).addCallback(finish)
        return done

    def _connected(self) -> None:
        for lock in self._locks.values():
            lock.connected()

    def _lost(self) -> None:
        for lock in self._locks.values():
            lock.connection_lost()
