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
- ``tap 100%``: the same taking every message, for scale;
- ``page tap 20/s``: the status page's live tap on this route, at most 20
  records a second (``per_second=20&max=200``), opened through the admin
  site's ``/tap`` and streamed to an in-memory connection;
- ``status page``: that tap, and the page's poll when it opens and every
  ``--refresh`` seconds (1 s, the page's fastest; it polls every 5 s by
  default): ``/healthz``, ``/routes``, ``/listeners``, ``/upstreams``,
  ``/streams`` and ``/nodes`` over one keep-alive HTTP connection to the
  admin site (parsed, rendered and encoded as a browser's requests are).
  A measurement takes well under a second, so each has one poll: more
  often than the page polls, never less. The site describes a gateway
  assembled from a small configuration (three listeners, two upstreams,
  two routes).

Time is this process's CPU time (the machine is shared: wall time would
count other processes' turns), and the router's clock follows it: after
each batch it moves on by the CPU time the batch took, in every variant,
so that a cap per second, the tap's timers and the page's polls run as
they would in a gateway that spends all its time routing. Each round measures every variant once, in
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
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.admin.site import make_admin_site
from gateway.config import load_config
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import DirectDelivery, Result, Route, Router, bind_routes
from gateway.core.tap import Tap, TapWriter
from gateway.service import GatewayService, build_gateway

SOURCE: Final = "ssmp-in"
ROUTE: Final = Route(
    name="weather",
    source=SOURCE,
    pattern=AddressPattern("weather.*"),
    destination="archive",
    target=AddressTemplate("archive.{1}"),
)
TOPICS: Final = 50
TOKEN: Final = "bench-token"
PAGE_POLL: Final = ("healthz", "routes", "listeners", "upstreams", "streams", "nodes")
"""What the status page reads at each refresh (gateway/admin/static/status.js)."""
PAGE_TAP: Final = f"/tap?route={ROUTE.name}&per_second=20&max=200"
"""The status page's live tap, as it asks for it by default."""
ADMIN_ADDRESS: Final = IPv4Address("TCP", "127.0.0.1", 8790)
PAGE_CONFIG: Final = """
[admin]
endpoint = "tcp:8790:interface=127.0.0.1"

[listeners.ssmp-in]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.qmqp-in]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.archive]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"

[upstreams.mail]
protocol = "qmqp"
endpoint = "tcp:host=127.0.0.1:port=1"

[routes.weather]
from = "ssmp-in"
match = "weather.*"
to = "archive"
address = "archive.{1}"

[routes.mail]
from = "qmqp-in"
match = "#@example.org"
to = "mail"
"""


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


class _Page:
    """The status page open on the admin site: its live tap, and its polls every ``refresh``.

    Args:
        gateway: What the status API describes (assembled, not started).
        router: The router under test (its table and taps).
        clock: The router's clock, which the measurement moves on.
        refresh: Seconds between two polls.
    """

    def __init__(
        self, gateway: GatewayService, router: Router, clock: Clock, refresh: float
    ) -> None:
        site = make_admin_site(
            metrics=gateway.metrics,
            router=router,
            health=gateway.health,
            reactor=clock,
            secrets=Secrets(admin_token=TOKEN.encode()),
            gateway=gateway,
        )
        self._poller, self._polled = self._connect(site)
        self._tapping, self._tapped = self._connect(site)
        self._tapping.dataReceived(self._request(PAGE_TAP, token=True))
        assert self._tapped.value().startswith(b"HTTP/1.1 200 "), self._tapped.value()[:200]
        self._clock = clock
        self._refresh = refresh
        self.polls = 0
        self.poll()  # as the page does when it opens: at least one poll per measurement

    @staticmethod
    def _connect(site: object) -> tuple[object, StringTransport]:
        channel = site.buildProtocol(ADMIN_ADDRESS)  # type: ignore[attr-defined]
        transport = StringTransport(hostAddress=ADMIN_ADDRESS)
        channel.makeConnection(transport)
        return channel, transport

    @staticmethod
    def _request(path: str, *, token: bool = False) -> bytes:
        head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:8790\r\nAccept: application/json\r\n"
        if token:
            head += f"Authorization: Bearer {TOKEN}\r\n"
        return (head + "\r\n").encode()

    def poll(self) -> None:
        """One refresh: the page's six requests, answered; what came is dropped."""
        self._timer = self._clock.callLater(self._refresh, self.poll)
        for path in PAGE_POLL:
            self._poller.dataReceived(self._request(f"/{path}"))  # type: ignore[attr-defined]
        assert self._polled.value().count(b"HTTP/1.1 ") == len(PAGE_POLL)
        self._polled.clear()
        self._tapped.clear()  # the browser reads the tap's lines as they come
        self.polls += 1

    def close(self) -> None:
        """Close the page: its tap and its polls."""
        if self._timer.active():
            self._timer.cancel()
        gone = Failure(ConnectionDone("the page closed"))
        self._tapping.connectionLost(gone)  # type: ignore[attr-defined]
        self._poller.connectionLost(gone)  # type: ignore[attr-defined]


def _page_gateway(directory: Path) -> GatewayService:
    """A gateway assembled from `PAGE_CONFIG` on a memory reactor, for the status API."""
    (directory / "gateway.toml").write_text(PAGE_CONFIG)
    return build_gateway(load_config(directory / "gateway.toml"), MemoryReactorClock(), "bench")


def _variants(
    gateway: GatewayService, refresh: float
) -> dict[str, Callable[[Router, Clock], Callable[[], None]]]:
    """Each variant: sets a router up, returns what undoes it."""

    def no_tap(router: Router, clock: Clock) -> Callable[[], None]:
        return lambda: None

    def add(tap: Tap) -> Callable[[Router, Clock], Callable[[], None]]:
        def setup(router: Router, clock: Clock) -> Callable[[], None]:
            writer = TapWriter(tap, router, _Discard(), clock)
            writer.start()
            return writer.stop

        return setup

    def page_tap(router: Router, clock: Clock) -> Callable[[], None]:
        tap = Tap(route=ROUTE.name, per_second=20, max_records=200, clock=clock)
        writer = TapWriter(tap, router, _Discard(), clock)
        writer.start()
        return writer.stop

    def page(router: Router, clock: Clock) -> Callable[[], None]:
        return _Page(gateway, router, clock, refresh).close

    return {
        "no tap": no_tap,
        "tap elsewhere": add(Tap(listener="qmqp-in")),
        "tap, no match": add(Tap(listener=SOURCE, pattern=AddressPattern("news.#"))),
        "tap 1%": add(Tap(route=ROUTE.name, sample=0.01)),
        "tap 100%": add(Tap(route=ROUTE.name)),
        "page tap 20/s": page_tap,
        "status page": page,
    }


def measure(
    setup: Callable[[Router, Clock], Callable[[], None]],
    batches: int,
    batch: list[Message],
) -> tuple[int, float]:
    """Route ``batches`` batches under one variant.

    Returns:
        The messages routed and the CPU seconds it took.
    """
    clock = Clock()
    table = bind_routes([ROUTE], {"archive": _Memory()})
    assert isinstance(table.routes[0].delivery, DirectDelivery)
    router = Router(table, clock)
    undo = setup(router, clock)
    route = router.route
    advance = clock.advance
    cpu = time.process_time
    try:
        route(SOURCE, batch, _ignore)  # warm the match cache
        gc.collect()
        started = before = cpu()
        done = 0
        while done < batches:
            route(SOURCE, batch, _ignore)
            now = cpu()
            advance(now - before)
            before = now
            done += 1
        return done * len(batch), cpu() - started
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
    parser.add_argument(
        "--refresh", type=float, default=1.0, help="the status page's refresh, seconds"
    )
    args = parser.parse_args(argv)
    batch = [
        Message(body=b"x" * 100, address=f"weather.city{i % TOPICS}", sender="bench")
        for i in range(args.batch_size)
    ]
    with tempfile.TemporaryDirectory() as directory:
        gateway = _page_gateway(Path(directory))
        variants = _variants(gateway, args.refresh)
        names = list(variants)
        rates: dict[str, list[float]] = {name: [] for name in names}
        per_batch: dict[str, list[float]] = {name: [] for name in names}
        for round_number in range(args.rounds):
            order = names if round_number % 2 == 0 else names[::-1]
            for name in order:
                messages, seconds = measure(variants[name], args.batches, batch)
                rates[name].append(messages / seconds)
                per_batch[name].append(seconds / (messages / args.batch_size) * 1e6)
    baseline = statistics.median(rates["no tap"])
    print(
        f"{args.rounds} rounds of {args.batches} batches of {args.batch_size} messages"
        f" (the status page polled at the start and every {args.refresh:g} s),"
        " CPU time, median per variant"
    )
    print(f"{'variant':<16}{'us/batch':>10}{'msg/s':>12}{'spread (msg/s)':>22}{'vs no tap':>11}")
    for name in names:
        rate = statistics.median(rates[name])
        spread = f"{min(rates[name]):,.0f}-{max(rates[name]):,.0f}"
        print(
            f"{name:<16}{statistics.median(per_batch[name]):>10.0f}{rate:>12,.0f}"
            f"{spread:>22}{rate / baseline:>10.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
