"""RabbitMQ's own confirm latency while another process keeps part of a core busy.

The bridges table's SSMP to RabbitMQ row (`bench.bridges`) compares the
bridge's p99 at 10,000 messages a second with rstream's own, straight into
the same node, in the same pass. rstream's pass runs on an otherwise idle
machine; the bridge's runs beside the gateway, which at that rate keeps
over half a core busy (55 to 62 µs of CPU a message: each message is a
batch of its own, a read, a Publish, a confirm and a 200). On a 2-core
machine that shares the cores with RabbitMQ's VM and the client.

This bench measures what such a load alone does to RabbitMQ: rstream
publishes one message a frame at 10,000 a second and times each confirm
(`bench.bridges.rstream_paced`), with nothing else running (the baseline),
then beside a process that spins for a share of every 200 µs and sleeps
the rest (``--duties``: 0.25, 0.5 and 1.0 of a core by default). Each round
measures every case once, in the opposite order from the round before; the
table gives the median p50 and p99 over ``--rounds`` and each p50 as a
multiple of the idle machine's in the same run.

The spinning process stands for the gateway's CPU, not its pattern: the
gateway works when a message arrives, and its work is a few tens of
microseconds at a time. Bounded: a fixed count per pass (``--seconds`` at
the rate), a fixed number of rounds; the node, a private RabbitMQ on
loopback (`tests.rabbitmq.RabbitMQNode`, installed if missing), and every
spinning process are stopped on exit, SIGTERM or Ctrl-C. Run::

    .venv/bin/python -m bench.rabbitmq_contention            # about 2 minutes
    .venv/bin/python -m bench.rabbitmq_contention --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bridges  # noqa: E402
from bench.gateway_proc import stop_on_signals  # noqa: E402
from tests.rabbitmq import RabbitMQNode  # noqa: E402

PERIOD_SECONDS: Final = 0.0002
"""The spinning process's cycle: it spins for ``duty`` of it, then sleeps the rest."""

SPIN: Final = """
import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
clock, busy, idle = time.perf_counter, period * duty, period * (1 - duty)
while True:
    started = clock()
    while clock() - started < busy:
        pass
    if idle > 0:
        time.sleep(idle)
"""


@contextlib.contextmanager
def spinning(duty: float) -> Iterator[None]:
    """A process that keeps ``duty`` of a core busy while the block runs (none for 0)."""
    if duty <= 0:
        yield
        return
    process = subprocess.Popen([sys.executable, "-c", SPIN, str(duty), str(PERIOD_SECONDS)])
    try:
        time.sleep(0.3)  # started and spinning before the pass
        yield
    finally:
        process.kill()
        process.wait()


def measure(node: RabbitMQNode, duty: float, count: int) -> dict[str, float]:
    """One paced pass into a fresh stream beside ``duty`` of a busy core; its latency."""
    stream = f"contention-{uuid.uuid4().hex[:10]}"
    try:
        with spinning(duty):
            result = bridges.rstream_paced(node.stream_connection(), stream, count)
    finally:
        with contextlib.suppress(Exception):
            node.delete_stream(stream)
    if result["problems"]:
        raise RuntimeError(f"duty {duty}: {'; '.join(result['problems'])}")
    latency: dict[str, float] = result["latency"]
    return latency


def table(duties: list[float], passes: dict[float, list[dict[str, float]]]) -> str:
    """The medians of every case, each p50 against the idle machine's."""
    base = statistics.median(p["p50_us"] for p in passes[0.0])
    lines = [
        f"{'beside':<22}{'p50 ms':>8}{'p99 ms':>8}{'p99 range':>14}{'p50 vs idle':>13}",
    ]
    for duty in duties:
        figures = passes[duty]
        p50 = statistics.median(p["p50_us"] for p in figures)
        p99s = [p["p99_us"] for p in figures]
        label = "nothing (baseline)" if duty == 0 else f"{duty:.2f} of a core busy"
        spread = f"{min(p99s) / 1000:.2f}-{max(p99s) / 1000:.2f}"
        lines.append(
            f"{label:<22}{p50 / 1000:>8.2f}{statistics.median(p99s) / 1000:>8.2f}"
            f"{spread:>14}{p50 / base:>12.2f}x"
        )
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes per case (default 3)")
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="each pass publishes this long (default 4)"
    )
    parser.add_argument(
        "--duties",
        default="0.25,0.5,1.0",
        help="shares of a core kept busy beside RabbitMQ, comma-separated (default 0.25,0.5,1.0)",
    )
    parser.add_argument("--quick", action="store_true", help="one round of 1 s: a smoke run")
    return parser.parse_args()


def main() -> None:
    """Measure and print the table."""
    args = arguments()
    stop_on_signals()
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, args.seconds)
    duties = [0.0, *(float(duty) for duty in args.duties.split(",") if float(duty) > 0)]
    count = int(bridges.LATENCY_RATE * seconds)
    passes: dict[float, list[dict[str, float]]] = {duty: [] for duty in duties}
    with RabbitMQNode() as node:
        for index in range(rounds):
            order = duties if index % 2 == 0 else duties[::-1]
            for duty in order:
                latency = measure(node, duty, count)
                passes[duty].append(latency)
                print(
                    f"round {index + 1}, {duty:.2f} busy: p50 {latency['p50_us']:,.0f} µs,"
                    f" p99 {latency['p99_us']:,.0f} µs",
                    flush=True,
                )
        version = node.version()
    print()
    print(table(duties, passes))
    print()
    print(
        f"rstream, one message a Publish frame at {bridges.LATENCY_RATE:,} msg/s, {count:,} a pass;"
        f" median of {rounds} round(s); RabbitMQ {version} (private node)"
    )


if __name__ == "__main__":
    main()
