"""DMP across nodes: one DMP listener's leases, feed readers and feed deliveries.

One `FleetDMP` per DMP listener, made by the assembly when ``[fleet] amqp``
is set; it is the listener's ``fleet`` (`gateway.protocols.dmp.fleet.FleetLink`).
Every node runs the same configuration, so a listener has the same name,
sinks and feeds on every node.

**Leases** made at run time are signed texts any node checks, revoked on
every node through a RabbitMQ stream (`gateway.fleet.leases`).

**One reader per feed, fleet-wide.** A feed's reader holds the fleet lock
``dmp.<listener>.<feed>`` (`gateway.fleet.locks`: the exclusive queue
``msggateway.lock.dmp.<listener>.<feed>``) while it reads. The lease's
answer waits for the claim: held, the node binds its queue to the
listener's direct exchange ``msggateway.dmp.<listener>`` with
``f.<feed>``, and once that took effect answers ``200``; refused (another
node holds it), ``403 NO-ACCESS``, as a second reader on one node is; no
answer within `CLAIM_SECONDS` (RabbitMQ not reachable), ``541
INTERNAL-ERROR``. When the reader leaves, the node unbinds, and releases the
lock once the unbinding took effect, so that two nodes are never bound for
one feed. A node that loses the lock (its connection to RabbitMQ went, or
went unconfirmed) closes the reader at once: another node may take the feed.

**Deliveries to a feed read elsewhere.** A route on a node without the
feed's reader encodes the envelopes there (what DMP cannot carry is
rejected on the spot) and publishes them, at most `MAX_BODY_BYTES` per AMQP
message, to ``f.<feed>`` with ``mandatory``, an id, and its own ``n.<node>``
to answer to (every node binds that key). A return (no node is bound: the
feed has no reader) answers *retry later*, as a feed without a reader does
on one node. The holder writes the envelopes to its reader verbatim and
answers on ``n.<origin>``: *accepted* once they are written under the
reader's limit (a congested reader holds the answer until it drained, and
holds the backbone's deliveries, ``receiving``, so that the backlog waits in
RabbitMQ), *retry later* when the reader went before (cut as a slow
consumer, or gone). So a route's delivery is answered as on one node, and
its sources (a sink writer's ``max_in_flight``) are held while the reader
on the other node is behind. No answer within `ANSWER_SECONDS`, or the
connection lost first, answers *retry later*: the envelopes may have been
written (DMP has no acknowledgement to tell), so a route that retries may
deliver them twice.

Order: one node publishes on one channel, RabbitMQ keeps a channel's order
into a queue, and the holder writes in the order it gets them: what one
node forwards reaches the reader in the order it was routed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.core.batch import Answers
from gateway.core.interfaces import IBackbone
from gateway.core.message import Outcome
from gateway.fleet.backbone import Delivery, Published
from gateway.fleet.leases import FleetLeases
from gateway.fleet.locks import FleetLock, FleetLocks
from gateway.protocols.dmp.fleet import FeedListener, LeaseCheck
from gateway.protocols.dmp.settings import LeaseGrant

__all__ = [
    "ANSWER_SECONDS",
    "CLAIM_SECONDS",
    "MAX_BODY_BYTES",
    "FleetDMP",
    "exchange_name",
    "lock_name",
]

CLAIM_SECONDS: Final = 5.0
"""How long a feed reader's lease waits for the feed's lock: a broker round trip normally;
past this RabbitMQ is not reachable, and the reader is answered 541."""
ANSWER_SECONDS: Final = 60.0
"""How long forwarded envelopes wait for the holder's answer before they are answered retry
later: the holder answers within its reader's ``slow_consumer_seconds`` (10 s by default)
and a route's own deadline (30 s by default) comes first."""
MAX_BODY_BYTES: Final = 64 * 1024
"""Envelopes forwarded at once are cut into AMQP messages of at most this many bytes (one
envelope may be larger), as the SSMP hub's are."""

_DELIVER: Final = "deliver"
_ANSWER: Final = "answer"
_ALREADY_READ: Final = (403, "already has a reader on another node")
_NO_FLEET: Final = Outcome.retry("the fleet's broker is not reachable from this node")


def exchange_name(listener: str) -> str:
    """The direct exchange where the nodes of DMP listener ``listener`` meet."""
    return f"msggateway.dmp.{listener}"


def lock_name(listener: str, feed: str) -> str:
    """The fleet lock a reader of ``feed`` holds."""
    return f"dmp.{listener}.{feed}"


class _Feed:
    """A feed's lock on this node: claimed for a reader, then held while it reads."""

    __slots__ = ("bound", "claim", "lock", "timer")

    def __init__(self) -> None:
        self.claim: Deferred[tuple[int, str] | None] | None = None
        """The reader's claim, while it waits."""
        self.lock: FleetLock | None = None
        self.timer: IDelayedCall | None = None
        self.bound = False


class _Forwarded:
    """One AMQP message of envelopes forwarded, waiting for the holder's answer."""

    __slots__ = ("answers", "feed", "indices", "timer")

    def __init__(self, answers: Answers, feed: str, indices: range) -> None:
        self.answers = answers
        self.feed = feed
        self.indices = indices
        self.timer: IDelayedCall | None = None

    def settle(self, outcome: Outcome) -> None:
        """Give each of its messages ``outcome``."""
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        for index in self.indices:
            self.answers.settle(index, outcome)


class FleetDMP:
    """One DMP listener's seam to the other nodes of the fleet.

    Args:
        listener: The DMP listener; this becomes its ``fleet`` (`join_fleet`
            is the caller's).
        leases: The node's run-time leases.
        backbone: The node's backbone.
        locks: The node's fleet locks.
        clock: Timers.
    """

    _log = Logger()

    def __init__(
        self,
        listener: FeedListener,
        leases: FleetLeases,
        backbone: IBackbone,
        locks: FleetLocks,
        clock: IReactorTime,
    ) -> None:
        self._listener = listener
        self.name: str = listener.name
        self._leases = leases
        self.backbone = backbone
        self._locks = locks
        self._clock = clock
        self.node: str = backbone.node
        self.exchange = exchange_name(listener.name)
        self._feeds: dict[str, _Feed] = {}
        self._releasing: dict[str, Deferred[None]] = {}
        """Feeds whose last lock is being released: a new claim waits for that."""
        self._pending: dict[int, _Forwarded] = {}
        self._ids = 0
        backbone.declare_exchange(self.exchange)
        backbone.consume(self.exchange, self._delivered)
        backbone.bind(self.exchange, f"n.{self.node}")
        backbone.on_lost(self._connection_lost)

    # --- leases ---------------------------------------------------------------------------

    def issue(self, grant: LeaseGrant) -> str:
        """A signed lease text for ``grant`` (`FleetLeases.issue`)."""
        return self._leases.issue(self.name, grant)

    def check(self, text: str) -> LeaseGrant | LeaseCheck | None:
        """What a run-time lease of the fleet opens on this listener (`FleetLeases.check`)."""
        return self._leases.check(self.name, text)

    def when_known(self) -> Deferred[None]:
        """Fires once the node knows the revocations, or after a bounded wait."""
        return self._leases.revocations.when_known()

    def revoke(self, text: str) -> Deferred[bool] | None:
        """Revoke a run-time lease of this listener on every node (`FleetLeases.revoke`)."""
        return self._leases.revoke(self.name, text)

    # --- feed locks -----------------------------------------------------------------------

    def claim(self, feed: str) -> Deferred[tuple[int, str] | None]:
        """Take ``feed``'s lock for a reader here; see `FleetLink.claim`."""
        if feed in self._feeds:
            return succeed((403, "already has a reader"))
        state = self._feeds[feed] = _Feed()
        claim: Deferred[tuple[int, str] | None] = Deferred(lambda _: self._given_up(feed, state))
        state.claim = claim
        state.timer = self._clock.callLater(CLAIM_SECONDS, self._claim_timed_out, feed, state)
        releasing = self._releasing.get(feed)
        if releasing is not None:
            releasing.addCallback(lambda _: self._ask(feed, state))
        else:
            self._ask(feed, state)
        return claim

    def release(self, feed: str) -> None:
        """The reader of ``feed`` here is gone: unbind, then let the lock go."""
        state = self._feeds.get(feed)
        if state is not None and state.claim is None:
            self._end(feed, state, None)

    def _ask(self, feed: str, state: _Feed) -> None:
        if self._feeds.get(feed) is not state:
            return  # given up meanwhile
        lock = state.lock = self._locks.lock(lock_name(self.name, feed))
        lock.start(
            functools.partial(self._acquired, feed, state),
            functools.partial(self._lost, feed, state),
            functools.partial(self._end, feed, state, _ALREADY_READ),
        )

    def _acquired(self, feed: str, state: _Feed) -> None:
        """Held: bind ``f.<feed>``; the reader is answered once deliveries come here."""
        if state.bound:
            return
        state.bound = True
        self.backbone.bind(self.exchange, f"f.{feed}")
        self.backbone.when_bound(functools.partial(self._bound, feed, state))

    def _bound(self, feed: str, state: _Feed) -> None:
        claim = state.claim
        if self._feeds.get(feed) is not state or claim is None:
            return
        if state.lock is None or not state.lock.held:
            return  # lost meanwhile: `_lost` answered
        state.claim = None
        self._cancel_timer(state)
        claim.callback(None)

    def _lost(self, feed: str, state: _Feed) -> None:
        """The lock is lost: a reader here must go now; a claim is refused."""
        reading = state.claim is None
        self._end(feed, state, (541, "lost its fleet lock while claiming it"))
        if reading:
            self._listener.feed_lost(
                feed, "this node lost the feed's fleet lock (its connection to RabbitMQ)"
            )

    def _claim_timed_out(self, feed: str, state: _Feed) -> None:
        state.timer = None
        self._end(
            feed,
            state,
            (
                541,
                f"cannot be claimed: RabbitMQ did not answer within {CLAIM_SECONDS:g} s",
            ),
        )

    def _given_up(self, feed: str, state: _Feed) -> None:
        """The reader's connection went while it claimed."""
        state.claim = None
        self._end(feed, state, None)

    def _end(self, feed: str, state: _Feed, refusal: tuple[int, str] | None) -> None:
        """Forget ``state``: unbind, then stop its lock; answer its claim with ``refusal``."""
        if self._feeds.get(feed) is not state:
            return
        del self._feeds[feed]
        self._cancel_timer(state)
        lock = state.lock
        if lock is not None:
            finished: Deferred[None] = Deferred()
            if state.bound:
                self.backbone.unbind(self.exchange, f"f.{feed}")
            if state.bound and self.backbone.ready:
                # Released only once unbound: the next holder is the only node bound.
                self.backbone.when_bound(lambda: finished.callback(None))
            else:
                finished.callback(None)
            released = self._releasing[feed] = lock.stop(finished)

            def over(_: object) -> None:
                if self._releasing.get(feed) is released:
                    del self._releasing[feed]

            released.addCallback(over)
        claim, state.claim = state.claim, None
        if claim is not None:
            claim.callback(refusal)

    def _cancel_timer(self, state: _Feed) -> None:
        if state.timer is not None and state.timer.active():
            state.timer.cancel()
        state.timer = None

    # --- forwarding -----------------------------------------------------------------------

    def forward(self, feed: str, parts: Sequence[bytes]) -> Deferred[list[Outcome]]:
        """Send encoded envelopes to the node reading ``feed``; see `FleetLink.forward`."""
        answers = Answers(len(parts), self._forget)
        start = 0
        while start < len(parts):
            end, size = start + 1, len(parts[start])
            while end < len(parts) and size + len(parts[end]) <= MAX_BODY_BYTES:
                size += len(parts[end])
                end += 1
            self._ids += 1
            number = self._ids
            self._pending[number] = _Forwarded(answers, feed, range(start, end))
            self.backbone.publish(
                self.exchange,
                f"f.{feed}",
                b"".join(parts[start:end]),
                kind=_DELIVER,
                headers={"id": number, "n": end - start},
                mandatory=True,
                on_result=functools.partial(self._published, number),
            )
            start = end
        return answers.deferred

    def _published(self, number: int, result: Published) -> None:
        forwarded = self._pending.get(number)
        if forwarded is None:
            return  # answered already (the answer can overtake the confirm)
        if result is Published.ROUTED:
            forwarded.timer = self._clock.callLater(ANSWER_SECONDS, self._unanswered, number)
            return
        del self._pending[number]
        if result is Published.UNROUTABLE:
            outcome = Outcome.retry(f"feed {forwarded.feed!r} of {self.name} has no reader")
        elif result is Published.LOST:
            outcome = _NO_FLEET
        else:
            outcome = Outcome.retry("RabbitMQ refused the message (nack)")
        forwarded.settle(outcome)

    def _unanswered(self, number: int) -> None:
        forwarded = self._pending.pop(number, None)
        if forwarded is not None:
            forwarded.timer = None
            forwarded.settle(
                Outcome.retry(
                    f"the node reading feed {forwarded.feed!r} did not answer within"
                    f" {ANSWER_SECONDS:g} s"
                )
            )

    def _forget(self, answers: Answers) -> None:
        """A batch's deadline passed: its answers are no longer awaited."""
        for number in [n for n, f in self._pending.items() if f.answers is answers]:
            forwarded = self._pending.pop(number)
            if forwarded.timer is not None and forwarded.timer.active():
                forwarded.timer.cancel()

    def _connection_lost(self) -> None:
        """The answers awaited were lost with this node's queue."""
        pending, self._pending = self._pending, {}
        for forwarded in pending.values():
            forwarded.settle(_NO_FLEET)

    # --- receiving ------------------------------------------------------------------------

    def _delivered(self, delivery: Delivery) -> None:
        if delivery.kind == _DELIVER:
            self._got_envelopes(delivery)
        elif delivery.kind == _ANSWER:
            self._got_answer(delivery)

    def _got_envelopes(self, delivery: Delivery) -> None:
        """Write another node's envelopes to the feed's reader here; answer once it took them."""
        feed = delivery.routing_key[2:]
        number = delivery.headers.get("id", 0)
        reply = f"n.{delivery.origin}"
        reader = self._listener.readers.get(feed)
        if reader is None or not reader.write_envelopes(
            delivery.body, int(delivery.headers.get("n", 1))
        ):
            self._answer(reply, number, f"feed {feed!r} of {self.name} has no reader")
            return
        congestion = reader.congestion
        if not congestion.congested:
            self._answer(reply, number, None)
            return
        # Behind: what comes next waits in RabbitMQ, and the sender's route waits for the answer.
        congestion.hold(self.backbone.receiving)
        cut = f"the reader of feed {feed!r} of {self.name} went away before it read this"
        congestion.when_drained(
            lambda drained: self._answer(reply, number, None if drained else cut)
        )

    def _answer(self, reply: str, number: object, retry: str | None) -> None:
        headers: dict[str, object] = {"id": number}
        if retry is not None:
            headers["retry"] = retry
        self.backbone.publish(self.exchange, reply, b"", kind=_ANSWER, headers=headers)

    def _got_answer(self, delivery: Delivery) -> None:
        forwarded = self._pending.pop(int(delivery.headers.get("id", 0)), None)
        if forwarded is None:
            return  # its batch's deadline passed, or the connection was lost meanwhile
        retry = delivery.headers.get("retry")
        forwarded.settle(Outcome.accepted() if retry is None else Outcome.retry(str(retry)))
