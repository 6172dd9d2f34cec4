"""The time-outs of a route's deliveries (`RouteDeadlines`), which the router keeps per route.

A delivery still waiting at its route's deadline is cancelled, and its
messages answer `UNANSWERED`, which the router turns into retry later
naming the route and its destination.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from gateway.core.batch import UNANSWERED
from gateway.core.message import Outcome

__all__ = ["RouteDeadlines", "TimedRoute"]


class TimedRoute(Protocol):
    """What the deadlines need of a route (`gateway.core.router.Route` is one)."""

    @property
    def name(self) -> str:
        """The route's name, for the retry's reason."""

    @property
    def destination(self) -> str:
        """Where it delivers, for the retry's reason."""

    @property
    def timeout_seconds(self) -> float:
        """How long a delivery may take."""


class RouteDeadlines:
    """The time-outs of one route's deliveries: one timer, not one per message.

    A route's time-out is the same for all its messages, so their deadlines
    come in the order the messages do: a queue whose head is the next to
    expire. A delivery still waiting at its deadline is cancelled, and the
    sender told to retry later.
    """

    __slots__ = ("_call", "_clock", "_queue", "_route")

    def __init__(self, route: TimedRoute, clock: IReactorTime) -> None:
        self._route = route
        self._clock = clock
        self._queue: deque[tuple[float, Deferred[list[Outcome]]]] = deque()
        self._call: IDelayedCall | None = None

    @property
    def busy(self) -> bool:
        """Whether some delivery is still watched."""
        return bool(self._queue)

    def watch(self, d: Deferred[list[Outcome]], count: int) -> Deferred[list[Outcome]]:
        """Watch a batch's delivery; return it with its time-out turned into outcomes."""
        queue = self._queue
        while queue and queue[0][1].called:
            queue.popleft()  # answered in time: forget it
        queue.append((self._clock.seconds() + self._route.timeout_seconds, d))
        if self._call is None:
            self._call = self._clock.callLater(self._route.timeout_seconds, self._expire)
        return d.addErrback(self._timed_out, count)

    def _expire(self) -> None:
        self._call = None
        queue = self._queue
        now = self._clock.seconds()
        while queue and (queue[0][1].called or queue[0][0] <= now):
            _deadline, d = queue.popleft()
            if not d.called:
                d.cancel()
        if queue:
            self._call = self._clock.callLater(max(queue[0][0] - now, 0.0), self._expire)

    def timed_out_outcome(self) -> Outcome:
        """What a message without an outcome at its deadline answers."""
        route = self._route
        return Outcome.retry(
            f"route {route.name}: no outcome from {route.destination}"
            f" within {route.timeout_seconds:g} seconds"
        )

    def _timed_out(self, failure: Failure, count: int) -> list[Outcome]:
        failure.trap(CancelledError)
        return [UNANSWERED] * count
