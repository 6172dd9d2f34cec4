"""What a tap costs the router's hot path (issue 17 part 4).

In one process, without a reactor (a `Clock`): batches of ``--batch-size``
messages (1,000 by default, on 50 topics) are routed through a real
`Router` with one route (``weather.*`` to ``archive.{1}``, so each message
is translated) to an in-memory destination that accepts at once, ``--batches``
times per measurement, under each of these:

- ``no tap``: the baseline, nobody taps;
- ``tap elsewhere``: one tap on another listener (the per-batch check and
  one comparison);
- ``tap, no match``: one tap on this listener whose pattern matches
  nothing (a cached pattern lookup per message);
- ``tap 1%``: one tap on this route sampling 1% of its messages, read by a
  `TapWriter` into a consumer that keeps nothing (JSON records included);
- ``tap 100%``: the same taking every message, for scale.

Time is this process's CPU time (the machine is shared: wall time would
count other processes' turns). Each round measures every variant once, in
the opposite order from the round before; the table gives the median over
``--rounds`` rounds of microseconds per batch and messages per second, the
spread (min-max) of the rate, and the rate as a share of the no-tap
baseline's. Bounded: a
fixed count of batches and rounds. Run with ``python -m bench.tap``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import DirectDelivery, Result, Route, Router, bind_routes
from gateway.core.tap import Tap, TapWriter

SOURCE: Final = "ssmp-in"
ROUTE: Final = Route(
    name="weather",
    source=SOURCE,
    pattern=AddressPattern("weather.*"),
    destination="archive",
    target=AddressTemplate("archive.{1}"),
)
TOPICS: Final = 50


@implementer(IDestination)
class _Memory:
    """A destination that accepts every message at once and keeps nothing."""

    name = "archive"

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Accept the batch."""
        return succeed([Outcome.accepted()] * len(messages))


class _Discard(StringTransport):
    """A consumer (an HTTP response that is never slow) that counts and drops what it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def write(self, data: bytes) -> None:
        """Count the bytes."""
        self.bytes += len(data)


def _ignore(index: int, result: Result) -> None:
    """What an adapter would do with each answer; nothing here."""


def _variants() -> dict[str, Callable[[Router, Clock], Callable[[], None]]]:
    """Each variant: sets a router up, returns what undoes it."""

    def no_tap(router: Router, clock: Clock) -> Callable[[], None]:
        return lambda: None

    def add(tap: Tap) -> Callable[[Router, Clock], Callable[[], None]]:
        def setup(router: Router, clock: Clock) -> Callable[[], None]:
            writer = TapWriter(tap, router, _Discard(), clock)
            writer.start()
            return writer.stop

        return setup

    return {
        "no tap": no_tap,
        "tap elsewhere": add(Tap(listener="qmqp-in")),
        "tap, no match": add(Tap(listener=SOURCE, pattern=AddressPattern("news.#"))),
        "tap 1%": add(Tap(route=ROUTE.name, sample=0.01)),
        "tap 100%": add(Tap(route=ROUTE.name)),
    }


def measure(
    setup: Callable[[Router, Clock], Callable[[], None]],
    batches: int,
    batch: list[Message],
) -> float:
    """Route ``batches`` batches under one variant; return the seconds it took."""
    clock = Clock()
    table = bind_routes([ROUTE], {"archive": _Memory()})
    assert isinstance(table.routes[0].delivery, DirectDelivery)
    router = Router(table, clock)
    undo = setup(router, clock)
    route = router.route
    try:
        route(SOURCE, batch, _ignore)  # warm the match cache
        gc.collect()
        started = time.process_time()
        for _ in range(batches):
            route(SOURCE, batch, _ignore)
        return time.process_time() - started
    finally:
        undo()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.tap", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--batch-size", type=int, default=1000, help="messages per batch")
    parser.add_argument("--batches", type=int, default=200, help="batches per measurement")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (each measures all)")
    args = parser.parse_args(argv)
    batch = [
        Message(body=b"x" * 100, address=f"weather.city{i % TOPICS}", sender="bench")
        for i in range(args.batch_size)
    ]
    variants = _variants()
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(args.rounds):
        order = names if round_number % 2 == 0 else names[::-1]
        for name in order:
            seconds[name].append(measure(variants[name], args.batches, batch))
    messages = args.batches * args.batch_size
    baseline = messages / statistics.median(seconds["no tap"])
    print(
        f"{args.rounds} rounds of {args.batches} batches of {args.batch_size} messages,"
        " CPU time, median per variant"
    )
    print(f"{'variant':<16}{'us/batch':>10}{'msg/s':>12}{'spread (msg/s)':>22}{'vs no tap':>11}")
    for name in names:
        rates = [messages / s for s in seconds[name]]
        rate = statistics.median(rates)
        per_batch = statistics.median(seconds[name]) / args.batches * 1e6
        spread = f"{min(rates):,.0f}-{max(rates):,.0f}"
        print(f"{name:<16}{per_batch:>10.0f}{rate:>12,.0f}{spread:>22}{rate / baseline:>10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
