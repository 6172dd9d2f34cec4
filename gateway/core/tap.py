"""Watching messages live as they pass a listener or a route (``msggateway tap``).

A `Tap` says which messages an operator wants to see: those arriving at
one listener (or upstream), or those one route takes, optionally only on
source addresses matching a route-style `AddressPattern`, and only a
sampled share of them. The router keeps its taps in a tuple and looks at
it once per batch (`Router.route`): when nobody taps, that check is all a
batch pays, with no per-message work, allocation, Deferred or timer.

When taps exist, `observe_batch` picks each tap's messages out of the
routed batch and returns a `BatchTap` that the router tells each route's
outcomes when that route's batch is answered (one call per route batch,
where the router already has them; no Deferred per message). Once every
route a message took has answered, each tap that picked it gets one
record: a JSON line (`Tap.offer`) saying when it arrived, where from, its
envelope (id, sender, address, recipients, body size, header names) and,
per route, where it went and the outcome.

A tap may also take at most ``per_second`` records a second (a token
bucket holding one second's worth): the status page's live view asks for a
few dozen, which a person can read and which cost the router next to
nothing however fast messages pass; past it, messages count as sampled out
and cost one comparison per batch.

Each tap keeps at most ``max_records`` records (and `MAX_TAP_BUFFER_BYTES`)
until its reader takes them (`Tap.take`); past that, records are dropped
and counted, so a slow reader never slows the router nor grows memory.
The counters (`Tap.seen`, `Tap.sampled_out`, `Tap.dropped`, `Tap.shown`)
let the reader say what it did not show. `TapWriter` is such a reader:
the push producer of a consumer (the admin endpoint's HTTP response) that
writes the records as they come, nothing while the consumer is paused, and
the counters once a second when they change.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, cast

from twisted.internet.interfaces import IConsumer, IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

from gateway.core.addressing import AddressPattern
from gateway.core.message import Message, Outcome, worst

if TYPE_CHECKING:
    from gateway.core.router import BoundRoute, Router, RouteTable, RouteTap

__all__ = [
    "DEFAULT_TAP_RECORDS",
    "MAX_TAP_BUFFER_BYTES",
    "MAX_TAP_PER_SECOND",
    "MAX_TAP_RECORDS",
    "UNROUTED",
    "BatchTap",
    "Sampler",
    "Tap",
    "TapWriter",
    "observe_batch",
]

DEFAULT_TAP_RECORDS: Final = 1000
"""Records a tap keeps for its reader unless asked for another number."""
MAX_TAP_RECORDS: Final = 100_000
"""The most records a tap may be asked to keep (each is a few hundred bytes)."""
MAX_TAP_PER_SECOND: Final = 100_000.0
"""The highest cap per second a tap may be given (no cap at all is allowed too)."""
MAX_TAP_BUFFER_BYTES: Final = 4 * 1024 * 1024
"""However many records are allowed, a tap keeps at most this many bytes of them."""
MAX_LISTED_ITEMS: Final = 20
"""Recipients or header names listed per record; the count says how many there were."""
MAX_PATTERN_CACHE_ENTRIES: Final = 4096
"""Distinct addresses a tap remembers the match of; past it the cache starts afresh."""
COUNTS_INTERVAL_SECONDS: Final = 1.0
"""How often a `TapWriter` writes the counters (when they changed)."""
_log: Final = Logger()
"""Only for failures of the taps themselves, which must never reach the router."""
_ADDRESS: Final = operator.attrgetter("address")
_RECIPIENTS: Final = operator.attrgetter("recipients")
_SAMPLE_EPSILON: Final = 1e-9
"""Rates such as 0.1 do not add up to exactly 1.0 in binary floating point."""

UNROUTED: Final = "unrouted"
"""The outcome of a message no route took (or that every route refused to translate)."""


class Sampler:
    """Takes a steady share of what it is offered: every 1/rate-th, by a counter.

    Cheaper than a random draw, and deterministic: rate 0.01 takes the
    first message and every hundredth after it.

    Args:
        rate: The share to take, above 0 and at most 1.

    Raises:
        ValueError: The rate is out of range.
    """

    __slots__ = ("_credit", "rate")

    def __init__(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"a sampling rate is above 0 and at most 1, not {rate:g}")
        self.rate = rate
        self._credit = 1.0

    def take(self) -> bool:
        """Whether to take the next one."""
        credit = self._credit
        if credit >= 1.0 - _SAMPLE_EPSILON:
            self._credit = credit - 1.0 + self.rate
            return True
        self._credit = credit + self.rate
        return False

    def take_many(self, count: int, limit: int | None = None) -> list[int]:
        """Which of the next ``count`` to take, by position; as `take` would, in O(taken).

        The offers between two takes are skipped by arithmetic, so that a
        batch of 1,000 at rate 0.01 costs ten steps, not a thousand.

        Args:
            count: Offers.
            limit: Take at most this many; the offers after the last one
                taken are then passed over without counting them.
        """
        rate = self.rate
        credit = self._credit
        threshold = 1.0 - _SAMPLE_EPSILON
        taken: list[int] = []
        position = 0
        while True:
            if credit < threshold:
                skip = math.ceil((threshold - credit) / rate)
                if position + skip >= count:
                    credit += (count - position) * rate
                    break
                position += skip
                credit += skip * rate
                continue  # rounding may leave it a hair short: look again
            if position >= count:
                break
            taken.append(position)
            credit += rate - 1.0
            position += 1
            if limit is not None and len(taken) >= limit:
                break
        self._credit = credit
        return taken


class Tap:
    """One watcher of the messages at a listener or on a route.

    Exactly one of ``listener`` and ``route`` is given. The router calls
    `pick` with each batch from that listener or route, and `offer` with
    each finished record; the reader sets `on_records`, is
    called once per batch that brought records, and calls `take`.

    Args:
        listener: Watch messages arriving at this listener or upstream.
        route: Watch messages this route takes.
        pattern: Only messages whose source address (or one of their
            recipients) matches it.
        sample: The share of matching messages to show (`Sampler`).
        max_records: Records kept until the reader takes them.
        per_second: Take at most this many records a second (None: no cap).
        clock: Times the cap (needed with ``per_second``).

    Raises:
        ValueError: Not exactly one of listener and route, a rate, record
            count or cap out of range, or a cap without a clock.
    """

    def __init__(
        self,
        *,
        listener: str | None = None,
        route: str | None = None,
        pattern: AddressPattern | None = None,
        sample: float = 1.0,
        max_records: int = DEFAULT_TAP_RECORDS,
        per_second: float | None = None,
        clock: IReactorTime | None = None,
    ) -> None:
        if (listener is None) == (route is None):
            raise ValueError("a tap watches either a listener or a route")
        if not 1 <= max_records <= MAX_TAP_RECORDS:
            raise ValueError(f"a tap keeps 1 to {MAX_TAP_RECORDS} records, not {max_records}")
        if per_second is not None:
            if not (math.isfinite(per_second) and 0.0 < per_second <= MAX_TAP_PER_SECOND):
                raise ValueError(
                    f"a tap takes above 0 and at most {MAX_TAP_PER_SECOND} records a second,"
                    f" not {per_second:g}"
                )
            if clock is None:
                raise ValueError("a tap with a cap per second needs a clock")
        self.per_second = per_second
        self._clock = clock
        self._allowance = per_second or 0.0
        """Records the cap lets through now (a token bucket of one second's worth)."""
        self._allowed_at = clock.seconds() if clock is not None else 0.0
        self.listener = listener
        self.route = route
        self.pattern = pattern
        self.max_records = max_records
        self._sampler = Sampler(sample)
        self._matches: dict[str, bool] = {}
        self._lines: list[bytes] = []
        self._bytes = 0
        self.on_records: Callable[[], None] | None = None
        """Called (once per batch) when records have come for `take`."""
        self.seen = 0
        """Messages at the listener or on the route that matched the pattern."""
        self.sampled_out = 0
        """Of those, left out by the sampling rate."""
        self.dropped = 0
        """Of those, lost because the reader was behind (the buffer was full)."""
        self.shown = 0
        """Records handed to the reader."""

    @property
    def sample(self) -> float:
        """The share of matching messages shown."""
        return self._sampler.rate

    def describe(self) -> dict[str, object]:
        """What the tap watches, as JSON: listener or route, pattern, rate, records kept, cap."""
        described: dict[str, object] = {
            "listener": self.listener,
            "route": self.route,
            "match": None if self.pattern is None else self.pattern.text,
            "sample": self.sample,
            "max": self.max_records,
        }
        if self.per_second is not None:
            described["per_second"] = self.per_second
        return described

    def counts(self) -> dict[str, int]:
        """The counters, as JSON."""
        return {
            "seen": self.seen,
            "shown": self.shown,
            "sampled_out": self.sampled_out,
            "dropped": self.dropped,
        }

    @property
    def full(self) -> bool:
        """Whether the next record would be dropped."""
        return len(self._lines) >= self.max_records or self._bytes >= MAX_TAP_BUFFER_BYTES

    def pick(self, messages: Sequence[Message], indices: Sequence[int] | None = None) -> list[int]:
        """Which messages to record: they match, are sampled, and there is room.

        Args:
            messages: The batch.
            indices: The candidates' indices in ``messages`` (ascending);
                None for all of them.

        Returns:
            The chosen indices, ascending.
        """
        if indices is None:
            indices = range(len(messages))
        if self.pattern is not None:
            indices = self._matching(messages, indices)
        count = len(indices)
        if not count:
            return []
        self.seen += count
        limit = None if self.per_second is None else self._allowed()
        if limit == 0:
            self.sampled_out += count
            return []
        chosen = [indices[position] for position in self._sampler.take_many(count, limit)]
        self.sampled_out += count - len(chosen)
        if limit is not None:
            self._allowance -= len(chosen)
        room = 0 if self._bytes >= MAX_TAP_BUFFER_BYTES else self.max_records - len(self._lines)
        if len(chosen) > room:
            self.dropped += len(chosen) - max(room, 0)
            del chosen[max(room, 0) :]
        return chosen

    def _allowed(self) -> int:
        """How many records the cap per second lets through now."""
        assert self._clock is not None and self.per_second is not None
        now = self._clock.seconds()
        allowance = self._allowance + (now - self._allowed_at) * self.per_second
        self._allowance = min(allowance, self.per_second)
        self._allowed_at = now
        return int(self._allowance + _SAMPLE_EPSILON)  # clock times are not exact either

    def _matching(self, messages: Sequence[Message], indices: Sequence[int]) -> Sequence[int]:
        """The candidates whose address (or a recipient) matches the pattern."""
        chosen = messages if len(indices) == len(messages) else [messages[i] for i in indices]
        if any(map(_RECIPIENTS, chosen)):
            match = self._match
            return [index for index, message in zip(indices, chosen, strict=True) if match(message)]
        # Messages without recipients (all but QMQP's): a cached lookup per
        # address, looped over at C speed; only new addresses are matched.
        cache = self._matches
        found = list(map(cache.get, map(_ADDRESS, chosen)))
        if None in found:
            for position, known in enumerate(found):
                if known is None:
                    found[position] = self._learn(chosen[position].address)
        if True not in found:
            return ()
        return list(itertools.compress(indices, found))

    def _learn(self, address: str) -> bool:
        cache = self._matches
        if len(cache) >= MAX_PATTERN_CACHE_ENTRIES:
            cache.clear()
        assert self.pattern is not None
        found = cache[address] = self.pattern.match(address) is not None
        return found

    def _match(self, message: Message) -> bool:
        cache = self._matches
        for address in message.recipients or (message.address,):
            found = cache.get(address)
            if found is None:
                found = self._learn(address)
            if found:
                return True
        return False

    def offer(self, record: dict[str, object]) -> None:
        """Keep a record for the reader, or count it dropped when the buffer is full."""
        if self.full:
            self.dropped += 1
            return
        line = _line(record)
        self._lines.append(line)
        self._bytes += len(line)
        self.shown += 1

    def take(self) -> bytes:
        """Return every record kept so far (JSON lines), and forget them."""
        lines, self._lines, self._bytes = self._lines, [], 0
        return b"".join(lines)

    @property
    def pending(self) -> int:
        """Records kept for the reader."""
        return len(self._lines)

    def wake(self) -> None:
        """Tell the reader that records have come."""
        if self._lines and self.on_records is not None:
            self.on_records()

    @staticmethod
    def observe_batch(
        taps: Sequence[RouteTap],
        source: str,
        messages: Sequence[Message],
        plan: dict[BoundRoute, tuple[list[int], list[Message]]],
        refused: dict[int, list[tuple[int, Outcome]]],
        table: RouteTable,
        clock: IReactorTime,
    ) -> BatchTap | None:
        """How the router shows a batch to its taps (`observe_batch`; the router's `RouteTap`)."""
        return observe_batch(
            cast("Sequence[Tap]", taps), source, messages, plan, refused, table, clock
        )


class _Entry:
    """One tapped message of a batch: who wants it, and its routes' outcomes so far."""

    __slots__ = ("message", "routes", "taps", "waiting")

    def __init__(self, message: Message) -> None:
        self.message = message
        self.taps: list[Tap] = []
        self.routes: list[tuple[int, str, dict[str, object], Outcome]] = []
        """(rank, route name, the route's part of the record, outcome), as they come."""
        self.waiting = 0


class BatchTap:
    """The tapped messages of one routed batch, until their routes answer.

    Built by `observe_batch`; the router calls `answered` once per route
    batch with that route's outcomes.
    """

    __slots__ = ("_by_route", "_clock", "_entries", "_rank", "_source", "_started")

    def __init__(self, source: str, clock: IReactorTime, rank: dict[BoundRoute, int]) -> None:
        self._source = source
        self._clock = clock
        self._rank = rank
        self._started = clock.seconds()
        self._entries: dict[int, _Entry] = {}
        self._by_route: dict[BoundRoute, list[tuple[int, _Entry, Message]]] = {}

    def _add(self, tap: Tap, index: int, message: Message) -> None:
        entry = self._entries.get(index)
        if entry is None:
            entry = self._entries[index] = _Entry(message)
        entry.taps.append(tap)

    def _start(
        self,
        plan: dict[BoundRoute, tuple[list[int], list[Message]]],
        refused: dict[int, list[tuple[int, Outcome]]],
        routes: Sequence[BoundRoute],
    ) -> None:
        """Note which route batches carry tapped messages; record those with none."""
        entries = self._entries
        for bound, (indices, batch) in plan.items():
            slots = []
            for index, entry in entries.items():  # a few of many: search, do not scan
                position = bisect.bisect_left(indices, index)
                if position < len(indices) and indices[position] == index:
                    slots.append((position, entry, batch[position]))
            if slots:
                self._by_route[bound] = slots
                for _position, entry, _message in slots:
                    entry.waiting += 1
        for index, entry in entries.items():
            for rank, outcome in refused.get(index, ()):
                route = routes[rank].route if rank < len(routes) else None
                name = "?" if route is None else route.name
                part: dict[str, object] = {"route": name, **_outcome(outcome)}
                if route is not None:
                    part["destination"] = route.destination
                entry.routes.append((rank, name, part, outcome))
        self._finish([entry for entry in entries.values() if not entry.waiting])

    def answered(self, bound: BoundRoute, outcomes: Sequence[Outcome]) -> None:
        """A route answered its batch: record the tapped messages that were waiting for it.

        Whatever goes wrong here is logged, never passed on: the senders'
        outcomes travel on the same callback chain.
        """
        try:
            self._answered(bound, outcomes)
        except Exception:
            _log.failure("a tap failed to record {route}'s outcomes", route=bound.route.name)

    def _answered(self, bound: BoundRoute, outcomes: Sequence[Outcome]) -> None:
        slots = self._by_route.pop(bound, None)
        if slots is None:
            return
        route = bound.route
        rank = self._rank.get(bound, 0)
        seconds = round(self._clock.seconds() - self._started, 6)
        done: list[_Entry] = []
        for position, entry, message in slots:
            outcome = outcomes[position]
            part: dict[str, object] = {
                "route": route.name,
                "destination": route.destination,
                "address": message.address,
                **_listed("recipients", message.recipients),
                "sender": message.sender,
                "size": len(message.body),
                **_outcome(outcome),
                "seconds": seconds,
            }
            entry.routes.append((rank, route.name, part, outcome))
            entry.waiting -= 1
            if not entry.waiting:
                done.append(entry)
        self._finish(done)

    def _finish(self, done: list[_Entry]) -> None:
        woken: list[Tap] = []
        for entry in done:
            for tap in entry.taps:
                tap.offer(self._record(entry, tap.route))
                if tap not in woken:
                    woken.append(tap)
        for tap in woken:
            tap.wake()

    def _record(self, entry: _Entry, only: str | None) -> dict[str, object]:
        """The JSON record of a message: all its routes, or ``only`` that one."""
        message = entry.message
        routes = sorted(
            (part for part in entry.routes if only is None or part[1] == only),
            key=lambda part: part[0],
        )
        headers = list(message.headers)
        outcome = worst(outcome for *_, outcome in routes).status.value if routes else UNROUTED
        return {
            "time": self._started,
            "listener": self._source,
            "id": message.id,
            "sender": message.sender,
            "address": message.address,
            **_listed("recipients", message.recipients),
            "size": len(message.body),
            "headers": len(headers),
            "header_keys": headers[:MAX_LISTED_ITEMS],
            "routes": [part for _rank, _name, part, _outcome in routes],
            "outcome": outcome,
        }


def _listed(name: str, items: tuple[str, ...]) -> dict[str, object]:
    """``name``: the first items; ``name_count`` too when there are more."""
    if len(items) <= MAX_LISTED_ITEMS:
        return {name: list(items)}
    return {name: list(items[:MAX_LISTED_ITEMS]), f"{name}_count": len(items)}


def _outcome(outcome: Outcome) -> dict[str, object]:
    return {"status": outcome.status.value, "code": outcome.code, "reason": outcome.reason}


def observe_batch(
    taps: Sequence[Tap],
    source: str,
    messages: Sequence[Message],
    plan: dict[BoundRoute, tuple[list[int], list[Message]]],
    refused: dict[int, list[tuple[int, Outcome]]],
    table: RouteTable,
    clock: IReactorTime,
) -> BatchTap | None:
    """Pick each tap's messages out of a routed batch.

    Messages without a route (or refused by every route they took) are
    recorded at once; the others when their routes answer
    (`BatchTap.answered`).

    Args:
        taps: The router's taps (at least one).
        source: The listener or upstream the batch arrived at.
        messages: The batch, as it arrived.
        plan: Each route's message indices and translated messages.
        refused: Messages a route refused to translate, by index, with
            the route's rank in ``routes`` and the refusal.
        table: The route table the batch was planned on.
        clock: For the records' times and each route's time to answer.

    Returns:
        What the router tells the outcomes to, or None when no tap took
        any message of the batch.
    """
    try:
        return _observe(taps, source, messages, plan, refused, table, clock)
    except Exception:
        # A tap must never cost the batch its routing.
        _log.failure("a tap failed to look at a batch from {source}", source=source)
        return None


def _observe(
    taps: Sequence[Tap],
    source: str,
    messages: Sequence[Message],
    plan: dict[BoundRoute, tuple[list[int], list[Message]]],
    refused: dict[int, list[tuple[int, Outcome]]],
    table: RouteTable,
    clock: IReactorTime,
) -> BatchTap | None:
    picked: list[tuple[Tap, int]] = []
    routes = table.routes
    for tap in taps:
        if tap.listener is not None:
            if tap.listener == source:
                picked.extend((tap, index) for index in tap.pick(messages))
            continue
        for bound, (indices, _batch) in plan.items():
            if bound.route.name == tap.route:
                picked.extend((tap, index) for index in tap.pick(messages, indices))
        refusals = [
            index
            for index, pairs in refused.items()
            if any(rank < len(routes) and routes[rank].route.name == tap.route for rank, _ in pairs)
        ]
        if refusals:
            picked.extend((tap, index) for index in tap.pick(messages, sorted(refusals)))
    if not picked:
        return None
    batch = BatchTap(source, clock, table.rank)
    for tap, index in picked:
        batch._add(tap, index, messages[index])
    batch._start(plan, refused, routes)
    return batch


_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""One encoder for every line: `json.dumps` with options builds a new one per call."""


def _line(value: dict[str, object]) -> bytes:
    return _ENCODER.encode(value).encode() + b"\n"


@implementer(IPushProducer)
class TapWriter:
    """Writes a tap's records to a consumer as they come, never faster than it reads.

    It registers as the consumer's streaming producer: while the consumer is
    paused (its transport's buffer is full), nothing is written and records
    wait in the tap's bounded buffer, past which they are dropped and
    counted. What it writes, one JSON object per line: first ``{"tap":
    WHAT, "time": T}`` (`Tap.describe`), then the records, and every
    `COUNTS_INTERVAL_SECONDS` the counters (``{"time": T, "seen": ...,
    "shown": ..., "sampled_out": ..., "dropped": ...}``) when they changed;
    `end` writes the counters with ``"end": REASON``.

    Args:
        tap: The tap to read.
        router: Shows the tap its batches from `start` to `stop`.
        consumer: Where the lines go (an HTTP response).
        clock: For the times and the counters' timer.
    """

    def __init__(self, tap: Tap, router: Router, consumer: IConsumer, clock: IReactorTime) -> None:
        self.tap = tap
        self._router = router
        self._consumer = consumer
        self._clock = clock
        self._paused = False
        self._stopped = False
        self._reported = tap.counts()
        self._timer: IDelayedCall | None = None

    def start(self) -> None:
        """Write the first line and start showing the tap the router's batches."""
        self._consumer.registerProducer(self, True)
        self._consumer.write(_line({"tap": self.tap.describe(), "time": self._clock.seconds()}))
        self.tap.on_records = self._flush
        self._router.add_tap(self.tap)
        self._timer = self._clock.callLater(COUNTS_INTERVAL_SECONDS, self._report)

    def stop(self, *, unregister: bool = True) -> None:
        """Stop tapping and writing; idempotent.

        Args:
            unregister: Unregister from the consumer; False when it is gone
                already (an HTTP request whose connection was lost).
        """
        if self._stopped:
            return
        self._stopped = True
        self._router.remove_tap(self.tap)
        self.tap.on_records = None
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if unregister:
            self._consumer.unregisterProducer()

    def end(self, reason: str) -> None:
        """Write what is left and the counters with ``"end": reason``, then `stop`."""
        if self._stopped:
            return
        # The last lines go out even when paused: a few hundred bytes at most
        # beyond the records, which are bounded.
        self._consumer.write(self.tap.take())
        self._consumer.write(
            _line({"time": self._clock.seconds(), **self.tap.counts(), "end": reason})
        )
        self.stop()

    def _flush(self) -> None:
        if self._paused or self._stopped:
            return
        data = self.tap.take()
        if data:
            self._consumer.write(data)

    def _report(self) -> None:
        self._timer = self._clock.callLater(COUNTS_INTERVAL_SECONDS, self._report)
        if self._paused:
            return
        counts = self.tap.counts()
        if counts != self._reported:
            self._reported = counts
            self._consumer.write(_line({"time": self._clock.seconds(), **counts}))

    def pauseProducing(self) -> None:
        """The consumer is full: write nothing until it resumes us."""
        self._paused = True

    def resumeProducing(self) -> None:
        """The consumer has room again: write what waited."""
        self._paused = False
        self._flush()

    def stopProducing(self) -> None:
        """The consumer will take nothing more."""
        self.stop()
