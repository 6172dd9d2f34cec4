"""Benchmark what the outcome record costs the hot path (issue 9).

Two gateways under twistd, identical but for ``[log] record_outcomes``:
QMQP into a route to a local stream of the embedded log (``fsync =
"never"``, so the disk does not hide the difference). One client streams
``--count`` messages of about 1 KB to each, in alternating rounds, and
waits for every K. Reported per configuration (median of ``--rounds``):
messages per second and the gateway's CPU time per message (user + system,
from /proc, which the client's speed does not change), and the ratios
recording / not recording.

Bounded: fixed count, rounds and a time limit per round. Run with
``python bench/outcome_record.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.qmqp_stream import stream  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[log]
fsync = "never"
record_outcomes = {record}

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
ROUTES = {"to-stream": 'from = "mail"\nmatch = "#"\nto = "streams"\naddress = "inbox"\n'}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-outcomes-") as scratch:
        gateways = {
            name: GatewayProcess(
                Path(scratch) / name,
                CONFIG.format(record="true" if name == "on" else "false"),
                routes=ROUTES,
            ).start()
            for name in ("off", "on")
        }
        try:
            for process in gateways.values():  # warm up
                stream(process.address("mail"), 10_000, 60)
            for _ in range(args.rounds):
                for name, process in gateways.items():
                    before = cpu_seconds(process.pid)
                    seconds, statuses = stream(process.address("mail"), args.count, 120)
                    used = cpu_seconds(process.pid) - before
                    assert statuses.get(qmqp.K) == args.count, statuses
                    results[name].append((args.count / seconds, used / args.count * 1e6))
        finally:
            for process in gateways.values():
                process.stop()
    medians = {}
    for name, values in results.items():
        rate = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        medians[name] = (rate, cpu)
        label = "recording" if name == "on" else "not recording"
        print(f"{label:14} {rate:>10,.0f} msg/s   {cpu:6.2f} us CPU per message")
    print(
        f"recording / not: {medians['on'][0] / medians['off'][0]:.3f}x throughput,"
        f" {medians['on'][1] / medians['off'][1]:.3f}x CPU per message"
    )


if __name__ == "__main__":
    main()
