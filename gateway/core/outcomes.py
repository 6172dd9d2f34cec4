"""The outcome record: what became of each message, kept for reports (issue 9).

With ``[log] record_outcomes = true`` (the default whenever the embedded log
is open), the gateway appends one record per message and route to the
stream `OUTCOME_STREAM` of its own log: which route took it, from which
listener or upstream, when it arrived, its outcome (as the sender learned
it) and when that outcome was known. Durable routes add a second record when
their forwarder settles a message (``forward``: delivered downstream, or
``dead-letter``). The Spark report (`gateway.spark.jobs`) reads them.

The hot path pays for a tuple appended to a list: records are encoded
together, at most every ``interval`` seconds or every ``batch`` records, into
log entries of up to `RECORDS_PER_ENTRY` records each (one offset per entry,
not per record: the log's per-entry work is paid once per thousand). They
are statistics, not messages: a crash loses at most the records of the last
interval, never a message, and when the log refuses writes (full disk)
records are dropped and counted rather than held without bound.

An entry is JSON, so that any reader (Spark's ``from_json``, jq) can read
it: ``[2, [RECORD, ...]]``, each record an array of kind, route, source,
message id, address, sender, recipients, body bytes, arrival and outcome
times (integer microseconds since the epoch), status (``accepted``,
``retry``, ``rejected``), the destination's code and the reason.
`decode_records` is the one reader.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.message import Message, Outcome

__all__ = [
    "FIELDS",
    "KIND_DEAD_LETTER",
    "KIND_FORWARD",
    "KIND_ROUTE",
    "OUTCOME_STREAM",
    "RECORDS_PER_ENTRY",
    "OutcomeRecorder",
    "decode_records",
    "encode_records",
    "outcome_row",
]

OUTCOME_STREAM: Final = "msggateway.outcomes"
"""The stream the records go to."""
KIND_ROUTE: Final = "route"
"""A message's outcome on a route, as its sender learned it."""
KIND_FORWARD: Final = "forward"
"""A durable route's forwarder delivered the message downstream."""
KIND_DEAD_LETTER: Final = "dead-letter"
"""A durable route's forwarder gave up on the message (moved to the dead-letter stream)."""
FIELDS: Final = (
    "kind",
    "route",
    "source",
    "id",
    "address",
    "sender",
    "recipients",
    "bytes",
    "arrived",
    "status",
    "code",
    "reason",
    "finished",
)
"""The fields of a decoded record, in their order after the version."""
_VERSION: Final = 2
RECORDS_PER_ENTRY: Final = 1000
"""Records in one log entry (one offset)."""
_encode: Final = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), check_circular=False
).encode

_Row = tuple[Any, ...]


def outcome_row(
    kind: str,
    route: str,
    source: str,
    message: Message,
    arrived: float,
    outcome: Outcome,
    finished: float,
) -> _Row:
    """A record's fields, as `encode_records` writes them (times in integer microseconds).

    Only strings and numbers: a waiting record keeps no message alive, so
    the garbage collector has nothing more to track on the hot path.
    """
    return (
        kind,
        route,
        source,
        message.id,
        message.address,
        message.sender,
        message.recipients,
        len(message.body),
        round(arrived * 1_000_000),
        outcome.status.value,
        outcome.code,
        outcome.reason,
        round(finished * 1_000_000),
    )


def encode_records(rows: Sequence[_Row]) -> bytes:
    """One log entry holding records made by `outcome_row`."""
    return _encode((_VERSION, rows)).encode("utf-8", "surrogateescape")


def decode_records(data: bytes | memoryview) -> list[dict[str, Any]]:
    """An entry's records, each by field name (`FIELDS`; times in seconds).

    Raises:
        ValueError: Not a version 2 entry.
    """
    document = json.loads(bytes(data).decode("utf-8", "surrogateescape"))
    if not isinstance(document, list) or len(document) != 2 or document[0] != _VERSION:
        raise ValueError("not a version 2 outcome entry")
    records = []
    width = len(FIELDS)
    for row in document[1]:
        if not isinstance(row, list) or len(row) != width:
            raise ValueError("an outcome record without its 13 fields")
        record = dict(zip(FIELDS, row, strict=True))
        record["arrived"] /= 1_000_000
        record["finished"] /= 1_000_000
        records.append(record)
    return records


class _Stream(Protocol):
    def append(self, messages: list[bytes]) -> Deferred[Any]: ...


class OutcomeRecorder:
    """Collects records and appends them to the log in batches.

    Args:
        stream: Where records go (the log's `OUTCOME_STREAM`).
        clock: Schedules the batches.
        interval: Longest time a record waits before it is appended.
        batch: Append at once when this many records wait.
        max_pending: Records appended but not yet committed, past which new
            ones are dropped (and counted) instead of queued.
    """

    _log = Logger()

    def __init__(
        self,
        stream: _Stream,
        clock: IReactorTime,
        *,
        interval: float = 0.5,
        batch: int = 20_000,
        max_pending: int = 200_000,
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._interval = interval
        self._batch = batch
        self._max_pending = max_pending
        self._waiting: list[_Row] = []
        self._timer: IDelayedCall | None = None
        self._in_flight = 0
        self.recorded = 0
        self.dropped = 0

    def record(
        self, kind: str, route: str, source: str, message: Message, arrived: float, outcome: Outcome
    ) -> None:
        """Keep a record; it is appended with the next batch."""
        waiting = self._waiting
        if self._in_flight + len(waiting) >= self._max_pending:
            self.dropped += 1
            return
        waiting.append(
            outcome_row(kind, route, source, message, arrived, outcome, self._clock.seconds())
        )
        if len(waiting) >= self._batch:
            self.flush()
        elif self._timer is None:
            self._timer = self._clock.callLater(self._interval, self.flush)

    def forwarded(self, route: str) -> Callable[[Message, Outcome, bool], None]:
        """What a durable route's forwarder calls with each settled message."""

        def settled(message: Message, outcome: Outcome, dead: bool) -> None:
            kind = KIND_DEAD_LETTER if dead else KIND_FORWARD
            self.record(kind, route, "log", message, message.timestamp, outcome)

        return settled

    def flush(self) -> Deferred[Any] | None:
        """Append what waits now (also called at stop); None when nothing waits."""
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return None
        count = len(waiting)
        step = RECORDS_PER_ENTRY
        entries = [encode_records(waiting[at : at + step]) for at in range(0, count, step)]
        self._in_flight += count
        try:
            appended = self._stream.append(entries)
        except Exception as exc:  # the log refused at once (closed, say)
            self._in_flight -= count
            self.dropped += count
            self._log.warn("outcome records dropped: {error}", error=exc)
            return None

        def done(_: object) -> None:
            self._in_flight -= count
            self.recorded += count

        def failed(failure: Failure) -> None:
            self._in_flight -= count
            self.dropped += count
            self._log.warn(
                "{count} outcome records dropped: {error}",
                count=count,
                error=failure.getErrorMessage(),
            )

        return appended.addCallbacks(done, failed)
