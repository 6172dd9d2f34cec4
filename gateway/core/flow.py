"""Back-pressure before loss: congested consumers slow their producers (DESIGN.md).

One policy for every listener and destination. A *consumer* (an SSMP
subscriber, a DMP feed reader, an MTL reader) is *congested* while its
transport's buffer (or its queue) is over its soft limit. While it is:

- the connections whose messages are waiting on it are *held*: each
  producer has a `Throttle`, and a producer held by any consumer reads
  nothing (as lipwig's publisher blocks on a subscriber's write, and
  RabbitMQ's credit flow blocks a channel on a slow queue);
- a route's delivery into it is answered only once it drained
  (`answer_when_drained`): the route's sources run out of in-flight room
  and stop reading too, so a QMQP sender's ``K`` means "written under the
  limit", never "dropped later".

When it drains, every producer it held is released and every waiting
answer given. A consumer that is *stuck* (no progress for
``slow_consumer_seconds``, or past the hard byte cap) is disconnected
instead (`Congestion.gone`), which releases its producers too: a stuck
consumer stalls its producers for at most that window.

The other policy, ``disconnect`` (NATS's "slow consumers are cut"), holds
nobody and makes nobody wait; a consumer past the hard cap is cut at once.

Nothing here is per message: a producer is held once per congested
consumer, a batch waits once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final

import attrs
from twisted.internet.defer import Deferred, succeed

from gateway.core.message import Outcome

__all__ = [
    "DEFAULT_FLOW",
    "DEFAULT_MAX_BACKLOG_BYTES",
    "DEFAULT_SLOW_CONSUMER_SECONDS",
    "DISCONNECT",
    "PAUSE_PRODUCERS",
    "POLICIES",
    "Congestion",
    "FlowPolicy",
    "Throttle",
    "answer_when_drained",
]

PAUSE_PRODUCERS: Final = "pause-producers"
"""Slow the producers of a congested consumer; cut only a stuck one (the default)."""
DISCONNECT: Final = "disconnect"
"""Never slow a producer; cut a consumer once its backlog passes the hard cap."""
POLICIES: Final = frozenset({PAUSE_PRODUCERS, DISCONNECT})

DEFAULT_SLOW_CONSUMER_SECONDS: Final = 10.0
"""How long a congested consumer may go without draining before it is cut as stuck. Long
enough for a healthy reader to empty what its held producers could add (a read each), short
enough that a hung one stalls a topic's publishers only briefly."""
DEFAULT_MAX_BACKLOG_BYTES: Final = 64 * 1024 * 1024
"""Bytes written to a congested consumer past which it is cut whatever the policy (the
hard cap; NATS's default pending limit per subscription is the same 64 MiB)."""


@attrs.frozen(kw_only=True)
class FlowPolicy:
    """How a listener treats a consumer that reads more slowly than its producers write.

    Attributes:
        policy: `PAUSE_PRODUCERS` or `DISCONNECT`.
        slow_consumer_seconds: A consumer congested this long without
            draining is cut as stuck (0: never for that reason).
        max_backlog_bytes: Bytes written to a congested consumer past
            which it is cut (0: no cap).
    """

    policy: str = attrs.field(default=PAUSE_PRODUCERS, validator=attrs.validators.in_(POLICIES))
    slow_consumer_seconds: float = DEFAULT_SLOW_CONSUMER_SECONDS
    max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES

    @property
    def pauses_producers(self) -> bool:
        """Whether congestion holds producers and delays answers (else it only counts)."""
        return self.policy == PAUSE_PRODUCERS


DEFAULT_FLOW: Final = FlowPolicy()


class Throttle:
    """A producer's holds: it reads nothing while any consumer holds it.

    Args:
        pause: Stops reading from the producer (called when the first hold begins).
        resume: Lets it read again (called when the last hold ends); the
            producer still checks its own reasons not to.
    """

    __slots__ = ("_holders", "_pause", "_resume")

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause = pause
        self._resume = resume
        self._holders: dict[Congestion, None] = {}

    @property
    def held(self) -> bool:
        """Whether some consumer holds the producer now."""
        return bool(self._holders)

    def hold(self, holder: Congestion) -> None:
        """Hold the producer for ``holder`` (a second hold by the same one is nothing)."""
        holders = self._holders
        if holder in holders:
            return
        holders[holder] = None
        if len(holders) == 1:
            self._pause()

    def release(self, holder: Congestion) -> None:
        """End ``holder``'s hold; the producer resumes when it was the last."""
        holders = self._holders
        if holders.pop(holder, 0) is None and not holders:
            self._resume()

    def forget(self) -> None:
        """The producer is gone: no consumer need release it any more."""
        for holder in list(self._holders):
            holder.forget(self)
        self._holders.clear()


class Congestion:
    """One consumer's congestion: the producers it holds and the answers waiting on it.

    ``congested`` is set by the consumer's connection (its transport paused
    it, or its queue passed the soft limit); `drained` and `gone` end it.
    """

    __slots__ = ("_held", "_waiting", "congested")

    def __init__(self) -> None:
        self.congested = False
        self._held: dict[Throttle, None] = {}
        self._waiting: list[Callable[[bool], None]] = []

    @property
    def held_count(self) -> int:
        """Producers held now (for metrics and tests)."""
        return len(self._held)

    def hold(self, producer: Throttle) -> None:
        """Hold ``producer`` until this consumer drains or goes."""
        if producer not in self._held:
            self._held[producer] = None
            producer.hold(self)

    def forget(self, producer: Throttle) -> None:
        """A held producer went away: nothing to release for it."""
        self._held.pop(producer, None)

    def when_drained(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True)`` when it drains, ``callback(False)`` if it is cut first."""
        self._waiting.append(callback)

    def begin(self) -> None:
        """The consumer is congested from now."""
        self.congested = True

    def drained(self) -> None:
        """The consumer caught up: release its producers, give the waiting answers."""
        self._end(True)

    def gone(self) -> None:
        """The consumer was cut or closed: release its producers and waiters all the same."""
        self._end(False)

    def _end(self, drained: bool) -> None:
        self.congested = False
        if self._held:
            held, self._held = self._held, {}
            for producer in held:
                producer.release(self)
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for callback in waiting:
                callback(drained)


def answer_when_drained(
    consumers: Iterable[Congestion],
    outcomes: Sequence[Outcome],
    if_cut: Outcome | None = None,
) -> Deferred[list[Outcome]]:
    """A batch's outcomes, given once every congested consumer it was written to drained.

    A route's delivery into congested consumers thereby holds its sources
    (their in-flight room runs out) until the data is written under the
    limit. The route's deadline cancels the wait: what was written is
    answered as it stands.

    Args:
        consumers: The consumers the batch was written to.
        outcomes: The batch's outcomes as the write left them.
        if_cut: What a message answers instead of *accepted* when one of
            its consumers was cut before it drained (None: as it stands,
            for a fan-out where the others had it).

    Returns:
        A Deferred with one outcome per message, fired at once when none
        of ``consumers`` is congested.
    """
    congested = [consumer for consumer in consumers if consumer.congested]
    if not congested:
        return succeed(list(outcomes))
    left = len(congested)
    cut = False

    def answered(_: Deferred[list[Outcome]] | None = None) -> None:
        if waiting.called:
            return
        if cut and if_cut is not None:
            waiting.callback([if_cut if outcome.is_accepted else outcome for outcome in outcomes])
        else:
            waiting.callback(list(outcomes))

    def one(drained: bool) -> None:
        nonlocal left, cut
        left -= 1
        cut = cut or not drained
        if not left:
            answered()

    waiting: Deferred[list[Outcome]] = Deferred(answered)
    for consumer in congested:
        consumer.when_drained(one)
    return waiting
