"""The outcome record: what became of each message, kept for reports (issue 9).

With ``[log] record_outcomes = true`` (the default whenever the embedded log
is open), the gateway appends records to the stream `OUTCOME_STREAM` of its
own log: which route took a message, from which listener or upstream, when
it arrived, its outcome (as the sender learned it) and when that outcome was
known. The Spark report (`gateway.spark.jobs`) reads them.

Records are written per batch (DESIGN.md, "The batch is the unit of work"):

* A direct route has no log to point into, so its batch gives one record per
  message (``route``), with the message's details: id, destination address,
  sender, recipients and size (`OutcomeRecorder.record_batch`, one call per
  batch).
* A durable route's committed batch is one *range* record (``route``): the
  route's stream and the offsets the batch took there, all accepted when
  committed (`OutcomeRecorder.record_range`). The messages' details are in
  the stream itself; the report joins the two. A batch the log did not
  commit has no offsets: it is recorded per message, like a direct route's.
* A durable route's forwarder adds one range record per chunk it has
  forwarded (``forward``), listing the exceptions: the offsets that were
  delivered only after retries, or dead-lettered, each with its kind,
  status, code, reason, time and attempts (`OutcomeRecorder.forwarded`).

The hot path pays for a tuple appended to a list: records are encoded
together, at most every ``interval`` seconds or every ``batch`` records, into
log entries of up to `RECORDS_PER_ENTRY` records each (one offset per entry,
not per record: the log's per-entry work is paid once per thousand). They
are statistics, not messages: a crash loses at most the records of the last
interval, never a message, and when the log refuses writes (full disk)
records are dropped and counted rather than held without bound.

An entry is JSON, so that any reader (Spark's ``from_json``, jq) can read
it: ``[3, [RECORD, ...]]``, each record an array of kind, route, source,
message id, address, sender, recipients, body bytes, arrival and outcome
times (integer microseconds since the epoch), status (``accepted``,
``retry``, ``rejected``), the destination's code, the reason, then the
stream, first and last offset of a range (null for a per-message record)
and its exceptions (null, or arrays of offset, kind, status, code, reason,
outcome time and attempts). A range record leaves the message fields null.
Version 2 entries (the same without the last four fields, written by the
previous release) still decode. `decode_records` is the one reader.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.forwarder import Forwarded
from gateway.core.internal import OUTCOME_STREAM
from gateway.core.message import Message, Outcome, Status

__all__ = [
    "EXCEPTION_FIELDS",
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
    "range_row",
]

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
    "stream",
    "first",
    "last",
    "exceptions",
)
"""The fields of a decoded record, in their order after the version."""
EXCEPTION_FIELDS: Final = ("offset", "kind", "status", "code", "reason", "finished", "attempts")
"""The fields of a range record's exception, in their order."""
_VERSION: Final = 3
_V2_WIDTH: Final = 13
_RANGE_SOURCE: Final = "log"
RECORDS_PER_ENTRY: Final = 1000
"""Records in one log entry (one offset)."""
_encode: Final = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), check_circular=False
).encode

_Row = tuple[Any, ...]


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def outcome_row(
    kind: str,
    route: str,
    source: str,
    message: Message,
    arrived: float,
    outcome: Outcome,
    finished: float,
) -> _Row:
    """A per-message record's fields, as `encode_records` writes them.

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
        _micros(arrived),
        outcome.status.value,
        outcome.code,
        outcome.reason,
        _micros(finished),
        None,
        None,
        None,
        None,
    )


def range_row(
    kind: str,
    route: str,
    source: str,
    stream: str,
    first: int,
    last: int,
    arrived: float,
    outcome: Outcome,
    finished: float,
    exceptions: Sequence[Sequence[Any]] | None = None,
) -> _Row:
    """A range record's fields, as `encode_records` writes them.

    Args:
        kind: `KIND_ROUTE` or `KIND_FORWARD`.
        route: The route.
        source: Where the messages came from.
        stream: The stream holding them.
        first: The first offset of the range.
        last: The last one (consecutive offsets, all messages).
        arrived: When they arrived (seconds).
        outcome: What became of every message but the exceptions.
        finished: When that was known (seconds).
        exceptions: Per exception, `EXCEPTION_FIELDS` (time in integer
            microseconds), in offset order; None when there is none.
    """
    return (
        kind,
        route,
        source,
        None,
        None,
        None,
        None,
        None,
        _micros(arrived),
        outcome.status.value,
        outcome.code,
        outcome.reason,
        _micros(finished),
        stream,
        first,
        last,
        exceptions or None,
    )


def encode_records(rows: Sequence[_Row]) -> bytes:
    """One log entry holding records made by `outcome_row` and `range_row`."""
    return _encode((_VERSION, rows)).encode("utf-8", "surrogateescape")


def decode_records(data: bytes | memoryview) -> list[dict[str, Any]]:
    """An entry's records, each by field name (`FIELDS`; times in seconds).

    A record's ``exceptions`` is a list (empty when there is none) of
    dictionaries by `EXCEPTION_FIELDS`. Version 2 records (per message
    only) have no range: ``stream``, ``first`` and ``last`` are None.

    Raises:
        ValueError: Not a version 2 or 3 entry.
    """
    document = json.loads(bytes(data).decode("utf-8", "surrogateescape"))
    if not isinstance(document, list) or len(document) != 2 or document[0] not in (2, _VERSION):
        raise ValueError("not a version 2 or 3 outcome entry")
    version = document[0]
    width = len(FIELDS) if version == _VERSION else _V2_WIDTH
    records = []
    for row in document[1]:
        if not isinstance(row, list) or len(row) != width:
            raise ValueError(f"a version {version} outcome record without its {width} fields")
        if version == 2:
            row = [*row, None, None, None, None]
        record = dict(zip(FIELDS, row, strict=True))
        record["arrived"] /= 1_000_000
        record["finished"] /= 1_000_000
        listed = record["exceptions"] or []
        record["exceptions"] = [_exception(item) for item in listed]
        records.append(record)
    return records


def _exception(item: object) -> dict[str, Any]:
    if not isinstance(item, list) or len(item) != len(EXCEPTION_FIELDS):
        raise ValueError(f"an outcome exception without its {len(EXCEPTION_FIELDS)} fields")
    exception = dict(zip(EXCEPTION_FIELDS, item, strict=True))
    exception["finished"] /= 1_000_000
    return exception


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
        """Keep one message's record; it is appended with the next batch."""
        self.record_batch(kind, route, source, (message,), arrived, (outcome,))

    def record_batch(
        self,
        kind: str,
        route: str,
        source: str,
        messages: Sequence[Message],
        arrived: float,
        outcomes: Sequence[Outcome],
    ) -> None:
        """Keep a record per message of a batch that arrived together (a direct route's).

        Args:
            kind: The records' kind.
            route: The route.
            source: Where the batch arrived.
            messages: The messages, as the route delivered them.
            arrived: When the batch arrived.
            outcomes: One per message, in order.
        """
        count = len(messages)
        room = self._room(count)
        if not room:
            return
        if room < count:
            messages, outcomes = messages[:room], outcomes[:room]
        finished = _micros(self._clock.seconds())
        arrived_us = _micros(arrived)
        self._waiting.extend(
            [
                (
                    kind,
                    route,
                    source,
                    message.id,
                    message.address,
                    message.sender,
                    message.recipients,
                    len(message.body),
                    arrived_us,
                    outcome.status.value,
                    outcome.code,
                    outcome.reason,
                    finished,
                    None,
                    None,
                    None,
                    None,
                )
                for message, outcome in zip(messages, outcomes, strict=True)
            ]
        )
        self._queued()

    def record_range(
        self,
        kind: str,
        route: str,
        source: str,
        stream: str,
        first: int,
        last: int,
        arrived: float,
        outcome: Outcome,
        finished: float | None = None,
        exceptions: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        """Keep one record for the messages at offsets ``first`` to ``last`` of ``stream``.

        See `range_row`; ``finished`` is now unless given.
        """
        if not self._room(1):
            return
        when = self._clock.seconds() if finished is None else finished
        self._waiting.append(
            range_row(kind, route, source, stream, first, last, arrived, outcome, when, exceptions)
        )
        self._queued()

    def forwarded(self, route: str, stream: str) -> Callable[[Forwarded], None]:
        """What a durable route's forwarder calls with each chunk it has forwarded."""

        def chunk_done(chunk: Forwarded) -> None:
            exceptions = [
                (
                    exception.offset,
                    KIND_DEAD_LETTER if exception.dead else KIND_FORWARD,
                    (Status.REJECTED if exception.dead else Status.ACCEPTED).value,
                    exception.outcome.code,
                    exception.outcome.reason,
                    _micros(exception.finished),
                    exception.attempts,
                )
                for exception in chunk.exceptions
            ]
            self.record_range(
                KIND_FORWARD,
                route,
                _RANGE_SOURCE,
                stream,
                chunk.first_offset,
                chunk.last_offset,
                chunk.arrived,
                Outcome.accepted(),
                chunk.finished,
                exceptions,
            )

        return chunk_done

    def _room(self, wanted: int) -> int:
        """How many of ``wanted`` records may queue; the rest are dropped and counted."""
        room = min(wanted, self._max_pending - self._in_flight - len(self._waiting))
        if room < wanted:
            room = max(room, 0)
            self.dropped += wanted - room
        return room

    def _queued(self) -> None:
        if len(self._waiting) >= self._batch:
            self.flush()
        elif self._timer is None:
            self._timer = self._clock.callLater(self._interval, self.flush)

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
