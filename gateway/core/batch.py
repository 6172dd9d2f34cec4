"""The batch: what moves through the core (DESIGN.md, "The batch is the unit of work").

A listener hands on what one read decoded for one route as a list of
messages; a destination answers one `Outcome` per message, in the batch's
order, through one Deferred. A single message is a batch of one.

Destinations that learn their outcomes one by one (a broker's confirms,
pipelined replies) collect them in an `Answers`: one object per batch, no
Deferred per message. When the route's deadline passes, the router cancels
the batch's Deferred; `Answers` then fires at once with the outcomes it
knows and `UNANSWERED` for the rest, so a message the destination did
confirm is never reported as failed (the router words `UNANSWERED` as its
own time-out).

An `Answers` forgets its ``on_cancel`` once it has fired (as a Deferred
forgets its canceller): a destination's batch usually holds its `Answers`
and is that callback's owner, and a finished batch must leave no
reference circle. Reference counting then frees it at once; circles wait
for the cyclic garbage collector, whose collections, at paced rates (one
message a batch), came every few thousand batches and held the reactor
for about 2 ms each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from twisted.internet.defer import Deferred, succeed

from gateway.core.message import Outcome, Status

__all__ = ["UNANSWERED", "Answers", "all_same"]

UNANSWERED: Final = Outcome(Status.RETRY, "no outcome before the deadline")
"""The outcome of a message whose destination had not answered when its batch was cancelled."""


def all_same(count: int, outcome: Outcome) -> Deferred[list[Outcome]]:
    """A batch of ``count`` messages that all had the same outcome, already known."""
    return succeed([outcome] * count)


class Answers:
    """One batch's outcomes, filled in as the destination learns them.

    ``deferred`` fires with the whole list once every message has its
    outcome, or when it is cancelled (the route's deadline), with
    `UNANSWERED` for the messages still open.

    Args:
        count: Messages in the batch.
        on_cancel: Called when the batch is cancelled before it was
            complete (to forget the batch's open messages), if given.
            Dropped once the batch has fired.
    """

    __slots__ = ("_on_cancel", "deferred", "open", "outcomes")

    def __init__(self, count: int, on_cancel: Callable[[Answers], None] | None = None) -> None:
        self.outcomes: list[Outcome | None] = [None] * count
        self.open = count
        self._on_cancel = on_cancel
        self.deferred: Deferred[list[Outcome]] = Deferred(self._cancelled)
        if not count:
            self._fire()

    def settle(self, index: int, outcome: Outcome) -> None:
        """Give message ``index`` its outcome (a second outcome is ignored)."""
        outcomes = self.outcomes
        if outcomes[index] is not None:
            return
        outcomes[index] = outcome
        self.open -= 1
        if not self.open and not self.deferred.called:
            self._fire()

    def settle_all(self, indices: list[int], outcome: Outcome) -> None:
        """Give messages ``indices`` the same outcome (`settle` for each, in one call)."""
        outcomes = self.outcomes
        settled = 0
        for index in indices:
            if outcomes[index] is None:
                outcomes[index] = outcome
                settled += 1
        self.open -= settled
        if settled and not self.open and not self.deferred.called:
            self._fire()

    def settle_rest(self, outcome: Outcome) -> None:
        """Give every message still open the same outcome (the destination went away)."""
        if not self.open:
            return
        outcomes = self.outcomes
        for index, known in enumerate(outcomes):
            if known is None:
                outcomes[index] = outcome
        self.open = 0
        if not self.deferred.called:
            self._fire()

    def _cancelled(self, deferred: Deferred[list[Outcome]]) -> None:
        if self._on_cancel is not None:
            self._on_cancel(self)
        self.settle_rest(UNANSWERED)

    def _fire(self) -> None:
        self._on_cancel = None  # usually a bound method of what holds this batch
        self.deferred.callback(self.outcomes)  # type: ignore[arg-type]  # no None left
