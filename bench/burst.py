"""Back-pressure before loss: fast producers against one healthy, one slowed and one stuck consumer.

Each row runs on a fresh gateway (``twistd msggateway``, default limits, a
configuration written to a temporary directory, every listener on a port the
system picks) whose resident memory (``/proc/PID/status`` VmRSS) is sampled
all along.

Healthy consumers (one thread each, 4 MiB reads, reading as fast as they can):

* SSMP hub, MCAST 1->1 (the baseline of the run), 2->1, 4->4 and 4->1 with
  ``-window 1000``, all driven by the independent ``../shared/tools/ssmpload``
  (its publishers pipeline without limit unless ``-window``; its subscribers
  count deliveries, order and duplicates);
* QMQP -> SSMP: QMQP senders stream mail into a listener whose route publishes
  each Subject on a hub topic, one SSMP subscriber counts the MCAST lines; and
  the same while ssmpload publishers share the topic;
* DMP sink -> feed: writers into a sink routed to a feed, one reader; also
  with a slowed reader (4 KiB reads, a millisecond's pause after each: a
  fraction of what the writers send, so a backlog must build and drain);
* MTL test profile (writers to a reader of the same resource) and gateway
  profile (confirm=full writers, a route to a second MTL listener, a
  confirm=none reader);
* stream listener: publishers with confirms, one consumer from the first
  offset (it reads the log, so it should lose nothing).

Columns: ``sent``; ``acked``, what the producers were told was taken (SSMP
200, QMQP K, MTL Confirm, stream PublishConfirm; ``n/a`` where the protocol
has no answer: DMP writers, MTL test profile); ``delivered`` (for SSMP the
deliveries, one per subscriber); ``lost``, deliveries acknowledged and never
delivered (sent and never delivered where there is no answer); ``msg/s``,
what the producers got acknowledged a second (where nothing is answered:
sent, until the consumer had the last); ``wait s``, the longest a producer
went without an answer (or a write taken): how much it was slowed; ``RSS``
start and peak, MiB.

Stuck consumers (SSMP subscriber, DMP feed reader, MTL reader that never
read): how long until the gateway cut them (its
``msggateway_slow_consumer_disconnects_total``, the socket leaving
ESTABLISHED, or for MTL the dead-peer count), the gateway's RSS growth, and
what the producers were told (acknowledged, refused, their longest wait).

The targets (issue 22) are checked at the end: 0 lost for every healthy
consumer; the hub 4->4 delivering at least 1.5x the 1->1 rate of the same
run; producers slowed, never refused nor stopped, while a consumer drains;
RSS growth under 100 MB with a stuck consumer.

Bounded: every row has a message count and a time limit, every wait a
deadline. Run with ``python -m bench.burst [--quick] [--messages N]
[--ssmpload PATH] [--only ssmp,qmqp,dmp,mtl,stream,stuck]
[--set LISTENER.KEY=VALUE]``.

This module has the command line, the rows to run, the tables and the
targets; the rows themselves are in `bench.burst_healthy` and
`bench.burst_stuck`, on the producers and consumers of `bench.burst_clients`
and what `bench.burst_rows` has for every row.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.burst_healthy import dmp_row, hub_row, mtl_row, qmqp_row, stream_row  # noqa: E402
from bench.burst_rows import Row, Settings, Skipped  # noqa: E402
from bench.burst_stuck import stuck_dmp, stuck_mtl, stuck_ssmp  # noqa: E402
from bench.gateway_proc import add_set_option, stop_on_signals  # noqa: E402
from bench.ssmp_hub import build_ssmpload  # noqa: E402

__all__ = ["main", "scenarios", "table", "verdicts"]

STUCK_GROWTH_LIMIT_MIB: Final = 100 * 1e6 / (1 << 20)
"""The issue's 100 MB, in MiB."""
HUB_RATIO_TARGET: Final = 1.5


# --- the rows ------------------------------------------------------------------------------


def scenarios(settings: Settings, only: set[str]) -> list[tuple[str, str, Callable[[], Row]]]:
    """Every row to run: (group, label, how)."""
    s = settings
    rows: list[tuple[str, str, Callable[[], Row]]] = [
        ("ssmp", "SSMP 1->1", lambda: hub_row(s, 1, 1)),
        ("ssmp", "SSMP 2->1", lambda: hub_row(s, 2, 1)),
        ("ssmp", "SSMP 4->4", lambda: hub_row(s, 4, 4)),
        ("ssmp", "SSMP 4->1 -window 1000", lambda: hub_row(s, 4, 1, 1000)),
        ("qmqp", "QMQP 2->1", lambda: qmqp_row(s, 2)),
        ("qmqp", "QMQP 2 + SSMP 2 -> 1", lambda: qmqp_row(s, 2, 2)),
        ("dmp", "DMP 2->1", lambda: dmp_row(s, 2)),
        ("dmp", "DMP 4->1", lambda: dmp_row(s, 4)),
        ("dmp", "DMP 2->1 slowed", lambda: dmp_row(s, 2, slowed=True)),
        ("mtl", "MTL test 2->1", lambda: mtl_row(s, 2, "test")),
        ("mtl", "MTL gateway 2->1", lambda: mtl_row(s, 2, "gateway")),
        ("stream", "stream 2->1", lambda: stream_row(s, 2)),
        ("stuck", "SSMP stuck", lambda: stuck_ssmp(s, 2)),
        ("stuck", "DMP stuck", lambda: stuck_dmp(s, 2)),
        ("stuck", "MTL stuck", lambda: stuck_mtl(s, 2)),
    ]
    return [row for row in rows if row[0] in only]


# --- the tables ----------------------------------------------------------------------------


def number(value: float | None, digits: int = 0) -> str:
    """A figure with thousands separators, or ``-``."""
    return "-" if value is None else f"{value:,.{digits}f}"


@dataclass(frozen=True)
class Column:
    """A table's column: its title, its width, what a row puts in it, and its alignment."""

    title: str
    width: int
    cell: Callable[[Row], str]
    left: bool = False

    def fit(self, text: str) -> str:
        """``text`` padded to the column's width."""
        return text.ljust(self.width) if self.left else text.rjust(self.width)


def table(
    rows: list[Row], columns: Sequence[Column], notes_title: str, notes: Callable[[Row], list[str]]
) -> str:
    """``rows`` as a fixed-width table, each row's ``notes`` at the end, joined by ``;``."""
    head = " ".join(column.fit(column.title) for column in columns) + "  " + notes_title
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = " ".join(column.fit(column.cell(row)) for column in columns)
        lines.append(f"{cells}  {'; '.join(notes(row))}")
    return "\n".join(lines)


def acked_or_none(row: Row) -> str:
    """What was acknowledged; ``n/a`` where the protocol answers nothing."""
    return "n/a" if row.acked is None and row.sent is not None else number(row.acked)


def cut_after(row: Row) -> str:
    """Seconds until the stuck consumer was cut, or how long it was watched in vain."""
    if row.cut_after is None and row.watched:
        return f"not in {row.watched:.0f}"
    return number(row.cut_after, 1)


def told(row: Row) -> list[str]:
    """What a stuck row's producers were told (their refusals too), then its other notes."""
    return [row.told, *(note for note in row.notes if not note.startswith("refused: "))]


PATH: Final = Column("path", 20, lambda row: row.path, left=True)
SENT: Final = Column("sent", 10, lambda row: number(row.sent))
RATE: Final = Column("msg/s", 8, lambda row: number(row.rate))
RSS: Final = (
    Column("RSS start", 9, lambda row: f"{row.rss_start:.1f}"),
    Column("peak", 6, lambda row: f"{row.rss_peak:.1f}"),
)
HEALTHY_COLUMNS: Final = (
    PATH,
    Column("prod->cons", 19, lambda row: row.shape, left=True),
    Column("consumer", 19, lambda row: row.consumer, left=True),
    SENT,
    Column("acked", 10, acked_or_none),
    Column("delivered", 10, lambda row: number(row.delivered)),
    Column("lost", 9, lambda row: number(row.lost)),
    RATE,
    Column("wait s", 6, lambda row: number(row.stall, 1)),
    *RSS,
)
"""The healthy and slowed consumers' table, ``notes`` after."""
STUCK_COLUMNS: Final = (
    PATH,
    Column("prod->cons", 10, lambda row: row.shape, left=True),
    SENT,
    Column("acked", 10, lambda row: number(row.acked)),
    Column("cut after s", 11, cut_after),
    RATE,
    Column("longest wait s", 14, lambda row: number(row.stall, 1)),
    *RSS,
    Column("growth", 6, lambda row: f"{row.rss_peak - row.rss_start:.1f}"),
)
"""The stuck consumers' table, `told` after."""


# --- the targets ---------------------------------------------------------------------------


def verdicts(healthy: list[Row], stuck: list[Row]) -> list[str]:
    """The issue's targets, each with its figures and whether it is met."""
    lines = []
    ran = [row for row in healthy if row.lost is not None]
    if ran:
        lossy = [f"{r.path} {r.shape} {r.consumer} ({r.lost:,})" for r in ran if r.lost]
        lines.append("0 lost for every healthy consumer: " + met(lossy))
    rates = {row.shape: row.delivery_rate for row in healthy if row.path == "SSMP hub"}
    one, four = rates.get("1->1"), rates.get("4->4")
    if one and four:
        ratio = four / one
        verdict = "yes" if ratio >= HUB_RATIO_TARGET else "NO"
        lines.append(
            f"hub 4->4 delivers {four:,.0f}/s = {ratio:.2f}x the 1->1 {one:,.0f}/s of this run"
            f" (target >= {HUB_RATIO_TARGET}x): {verdict}"
        )
    if ran:
        failed = [
            f"{r.path} {r.shape} {r.consumer} ({r.refused:,} refused{', stopped' * stopped(r)})"
            for r in ran
            if r.refused or stopped(r)
        ]
        lines.append(
            "producers slowed, never refused or stopped, while a consumer drains: " + met(failed)
        )
    grown = [
        f"{r.path} ({r.rss_peak - r.rss_start:.0f} MiB)"
        for r in stuck
        if r.rss_peak - r.rss_start >= STUCK_GROWTH_LIMIT_MIB
    ]
    if stuck:
        lines.append("RSS growth < 100 MB with a stuck consumer: " + met(grown))
    return lines


def stopped(row: Row) -> bool:
    """Whether a producer of ``row`` failed or ran out of time."""
    return any(note.startswith("producer ") for note in row.notes)


def met(failures: list[str]) -> str:
    """``yes``, or ``NO:`` and what failed."""
    return "NO: " + "; ".join(failures) if failures else "yes"


def main() -> None:
    """Run the rows and print both tables with the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, help="per row, all producers (default 200,000)")
    parser.add_argument("--stuck-messages", type=int, help="per stuck row (default 1,000,000)")
    parser.add_argument("--size", type=int, default=100, help="body bytes (>= 32 for ssmpload)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time bound of a row")
    parser.add_argument("--stuck-seconds", type=float, default=35.0, help="of a stuck row")
    parser.add_argument("--quick", action="store_true", help="50,000 messages, stuck 200,000/20 s")
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    parser.add_argument("--only", default="ssmp,qmqp,dmp,mtl,stream,stuck", help="row groups")
    add_set_option(parser)
    args = parser.parse_args()
    stop_on_signals()
    tool = args.ssmpload
    if tool is None:
        try:
            tool = build_ssmpload()
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"no ssmpload, SSMP rows skipped: {exc}", file=sys.stderr)
    settings = Settings(
        messages=args.messages or (50_000 if args.quick else 200_000),
        stuck_messages=args.stuck_messages or (200_000 if args.quick else 1_000_000),
        size=args.size,
        seconds=args.seconds,
        stuck_seconds=20.0 if args.quick and args.stuck_seconds == 35.0 else args.stuck_seconds,
        ssmpload=tool,
        listener_settings=dict(args.set),
    )
    healthy: list[Row] = []
    stuck: list[Row] = []
    for group, label, run in scenarios(settings, set(args.only.split(","))):
        began = time.monotonic()
        try:
            row = run()
        except Skipped as exc:
            row = Row(label, "", "stuck" if group == "stuck" else "skipped", notes=[str(exc)])
        (stuck if group == "stuck" else healthy).append(row)
        print(f"{label}: {time.monotonic() - began:.1f} s", file=sys.stderr)
    print(
        f"{settings.messages:,} messages of {settings.size} bytes a row"
        f" ({settings.stuck_messages:,} or {settings.stuck_seconds:.0f} s with a stuck consumer);"
        " RSS in MiB"
    )
    if healthy:
        print(table(healthy, HEALTHY_COLUMNS, "notes", lambda row: row.notes))
    if stuck:
        print()
        print("Stuck consumers (never read):")
        print(table(stuck, STUCK_COLUMNS, "producers were told; notes", told))
    print()
    for line in verdicts(healthy, stuck):
        print(line)


if __name__ == "__main__":
    main()
