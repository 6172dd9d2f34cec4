"""What becomes of a DMP sink writer's messages, which DMP cannot tell the writer.

Every envelope a sink reads is routed from the listener (see
`gateway.protocols.dmp.mapping` for its address and headers); the envelopes
one read decoded go to the router as one batch (`gateway.core.inbox`). DMP
has no acknowledgement, so outcomes other than accepted are counted one by
one (``unrouted``, ``not-delivered``) but logged at most once in ten seconds
per connection, with how many (`gateway.protocols.dmp.flow.LogTally`); a
connection with ``max_in_flight`` messages awaiting outcomes is not read
from until half of them have theirs (`InFlight`). A route's batch is
answered in one go (`SinkOutcomes.batch`): its accepted messages cost a
count, not a call each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from gateway.core.inbox import Result
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Unrouted
from gateway.protocols.dmp.flow import InFlight, LogTally

__all__ = ["SinkOutcomes"]

_ACCEPTED: Final = Outcome.accepted()


class SinkOutcomes:
    """A sink connection's messages on their way: how many await outcomes, and what went wrong.

    Args:
        listener: The listener's name, for the log.
        clock: Time, for the log's pace.
        limit: ``max_in_flight``: messages awaiting outcomes at which reading pauses.
        pause: Stops reading from the writer.
        resume: Reads from the writer again.
        count_error: Counts a protocol error of some kind (the listener's).
        idle: Called when the last outcome owed came (the idle time counts from then).
    """

    _log = Logger(namespace="gateway.protocols.dmp.server")

    def __init__(
        self,
        listener: str,
        clock: IReactorTime,
        limit: int,
        pause: Callable[[], None],
        resume: Callable[[], None],
        count_error: Callable[[str], None],
        idle: Callable[[], None],
    ) -> None:
        self._listener = listener
        self._in_flight = InFlight(limit, pause, resume)
        self._count_error = count_error
        self._idle = idle
        self._unrouted = LogTally(clock)
        self._not_delivered = LogTally(clock)
        self.sink = ""
        """The sink the connection writes to, once opened."""

    @property
    def count(self) -> int:
        """Messages read and awaiting their outcomes."""
        return self._in_flight.count

    def dispatch(self, count: int, dispatch: Callable[[], None]) -> None:
        """Count a read's ``count`` messages in flight while ``dispatch`` routes them."""
        self._in_flight.track(count, dispatch)

    def one(self, message: Message, result: Result) -> None:
        """One message's routes answered: count and log what was not accepted."""
        in_flight = self._in_flight
        in_flight.done()
        if not in_flight.count:
            self._idle()
        if type(result) is Outcome and result.status is Status.ACCEPTED:
            return
        if isinstance(result, Unrouted):
            self._unrouted_one(message)
        else:
            self._not_delivered_one(message, result)

    def batch(self, messages: list[Message], outcomes: list[Outcome]) -> None:
        """A route's batch answered: count and log what was not accepted."""
        in_flight = self._in_flight
        in_flight.done(len(messages))
        if not in_flight.count:
            self._idle()
        if outcomes.count(_ACCEPTED) == len(outcomes):  # the common case, at C speed
            return
        for message, outcome in zip(messages, outcomes, strict=True):
            if outcome.status is not Status.ACCEPTED:
                self._not_delivered_one(message, outcome)

    def last_lines(self, kind: str | None) -> None:
        """The connection ends: log what was counted and not logged yet."""
        for tally, what in ((self._unrouted, "unrouted"), (self._not_delivered, "not delivered")):
            if tally.count:
                self._log.warn(
                    "{listener}: {kind} {target}: {count} more message(s) {what}"
                    " since the last such line",
                    listener=self._listener,
                    kind=kind,
                    target=self.sink,
                    count=tally.count,
                    what=what,
                )

    def _unrouted_one(self, message: Message) -> None:
        self._count_error("unrouted")
        count = self._unrouted.add()
        if count:
            self._log.warn(
                "{listener}: sink {sink}: no route for {address}; message {id} dropped"
                " ({count} unrouted since the last such line)",
                listener=self._listener,
                sink=self.sink,
                address=message.address,
                id=message.id,
                count=count,
            )

    def _not_delivered_one(self, message: Message, outcome: Outcome) -> None:
        self._count_error("not-delivered")
        count = self._not_delivered.add()
        if count:
            self._log.warn(
                "{listener}: sink {sink}: message {id} not delivered: {reason}"
                " ({count} not delivered since the last such line)",
                listener=self._listener,
                sink=self.sink,
                id=message.id,
                reason=outcome.reason,
                count=count,
            )
