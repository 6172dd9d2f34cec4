"""The MTL listener's CPU per message at a paced 10,000 messages a second, not flooded.

bench/bridges.py's throughput rows flood the gateway, whose read bursts then
hold some eighty messages: what a burst costs is spread over them. At a
paced rate a burst holds one to three, and the gateway's work per read
burst and per reactor wake-up (ZeroMQ's receive that finds nothing, the
reactor's poll, the thread's sleep and wake-up) is most of its CPU.

Each pass starts a fresh gateway (``twistd msggateway``, bridges.py's MTL
config) and sends ``--count`` Contents at bridges.py's latency rate with its
paced client (`bridges.mtl_paced`): routed (confirm=full writer to
confirm=full reader across the route, each Content confirmed end to end)
and, as the baseline in the same run, the test profile's 1 to 1 fan-out.
Passes take turns. The table gives, per path, the gateway's CPU per message
(all its threads, and the reactor's thread alone) and the writer-to-reader
latency, medians over the passes; ``--before-tree DIR`` runs the routed
path on another checkout's code in the same turns (``git worktree add DIR
REV``).

Run: ``python bench/mtl_paced.py [--passes 3] [--count 40000] [--before-tree DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bridges  # noqa: E402
from bench.stream_vs_rabbitmq import _cpu_seconds  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402


def _thread_seconds(pid: int) -> float:
    """CPU seconds of the process's main thread (the reactor's)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / 100.0  # USER_HZ


def one_pass(tree: Path | None, routed: bool, count: int) -> dict[str, float]:
    """A fresh gateway, ``count`` paced Contents: CPU µs per message and latency."""
    launcher = None
    if tree is not None:
        launcher = [sys.executable, "-c", bridges.TREE_TWISTD, str(tree),
                    "--nodaemon", "--pidfile=", "--logfile=-", "msggateway"]  # fmt: skip
    routes = {"across": bridges.MTL_ROUTE} if routed else None
    with tempfile.TemporaryDirectory() as scratch:
        gateway = GatewayProcess(Path(scratch), bridges.MTL, routes=routes, launcher=launcher)
        gateway.start()
        try:
            started, main_started = _cpu_seconds(gateway.pid), _thread_seconds(gateway.pid)
            port2 = gateway.address("mtl2")[1] if routed else None
            result = bridges.mtl_paced(gateway.address("mtl")[1], port2, count)
            ended, main_ended = _cpu_seconds(gateway.pid), _thread_seconds(gateway.pid)
        finally:
            gateway.stop()
    if result["problems"]:
        raise SystemExit(f"{'routed' if routed else 'test profile'}: {result['problems']}")
    delivered = result["figures"]["delivered"]
    latency = result["latency"]
    assert started is not None and ended is not None
    return {
        "cpu": (ended - started) / delivered * 1e6,
        "main": (main_ended - main_started) / delivered * 1e6,
        "p50": latency["p50_us"] / 1000,
        "p99": latency["p99_us"] / 1000,
    }


def main() -> None:
    """Run the passes in turns and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--count", type=int, default=40_000, help="Contents a pass")
    parser.add_argument("--before-tree", type=Path, help="another checkout: its routed path too")
    args = parser.parse_args()
    paths: list[tuple[str, Path | None, bool]] = [("routed", None, True)]
    if args.before_tree is not None:
        paths.append(("routed, before", args.before_tree.resolve(), True))
    paths.append(("test profile", None, False))
    figures: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in paths}
    for number in range(args.passes):
        for name, tree, routed in paths if number % 2 == 0 else paths[::-1]:
            figures[name].append(one_pass(tree, routed, args.count))
            print(f"pass {number + 1}: {name:16} {figures[name][-1]['cpu']:6.1f} us/msg",
                  flush=True)  # fmt: skip
    medians: dict[str, dict[str, Any]] = {
        name: {key: statistics.median(f[key] for f in rows) for key in rows[0]}
        for name, rows in figures.items()
    }
    base = medians["test profile"]["cpu"]
    print(f"\n{'path':16} {'us/msg':>7} {'main thread':>12} {'vs test':>8} {'p50 ms':>7}"
          f" {'p99 ms':>7}")  # fmt: skip
    for name, row in medians.items():
        print(f"{name:16} {row['cpu']:7.1f} {row['main']:12.1f} {row['cpu'] / base:7.2f}x"
              f" {row['p50']:7.2f} {row['p99']:7.2f}")  # fmt: skip
    print(
        f"medians of {args.passes} passes of {args.count:,} Contents at"
        f" {bridges.LATENCY_RATE:,} msg/s; us/msg: the gateway's CPU per message delivered"
        " (all threads; main thread: the reactor's); p50/p99: writer to reader"
    )


if __name__ == "__main__":
    main()
