"""Benchmark what the outcome record costs the hot path (issue 9).

Two gateways under twistd, identical but for ``[log] record_outcomes``:
QMQP into a route to a local stream of the embedded log (``fsync =
"never"``, so the disk does not hide the difference). One client streams
``--count`` messages of about 1 KB to each, in alternating rounds, and
waits for every K. Reported per configuration (median of ``--rounds``):
messages per second and the gateway's CPU time per message (user + system,
from /proc, which the client's speed does not change), and the ratios
recording / not recording.

Then, because whole-gateway rounds vary by several percent between two
identical gateways, the router alone: in one process, on the reactor, the
same ``--count`` messages dispatched in batches of ``--batch`` (what one
read hands the router) through a route to a destination that accepts at
once, with and without a recorder writing to a real log (``fsync =
never``), alternating; reported as microseconds per message.

Bounded: fixed count, rounds and a time limit per round. Run with
``python bench/outcome_record.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


async def _router_rounds(
    reactor: Any, count: int, rounds: int, batch: int, directory: Path
) -> None:
    """Dispatch ``count`` messages per round with and without a recorder; print us/message."""
    from collections.abc import Sequence

    from twisted.internet.defer import succeed
    from twisted.internet.task import deferLater
    from zope.interface import implementer

    from gateway.core.addressing import AddressPattern
    from gateway.core.interfaces import IDestination
    from gateway.core.log import FsyncPolicy, LogStore
    from gateway.core.message import Message, Outcome
    from gateway.core.outcomes import OUTCOME_STREAM, OutcomeRecorder
    from gateway.core.router import Route, Router, bind_routes
    from gateway.metrics import GatewayMetrics

    @implementer(IDestination)
    class Accepting:
        name = "sink"

        def deliver(self, messages: Sequence[Message]) -> Any:
            return succeed([Outcome.accepted()] * len(messages))

    store = LogStore(directory, reactor, fsync=FsyncPolicy.NEVER)
    store.open()
    route = Route(name="r", source="mail", pattern=AddressPattern("#"), destination="sink")
    router = Router(bind_routes([route], {"sink": Accepting()}), reactor, GatewayMetrics())
    recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), reactor)
    messages = [
        Message(
            body=b"x" * 1000,
            address="inbox",
            id=f"m{i}",
            sender="a@b.example",
            recipients=("ops@example.org",),
        )
        for i in range(count)
    ]
    timings: dict[str, list[float]] = {"off": [], "on": []}
    for number in range(rounds):
        for name in ("off", "on") if number % 2 == 0 else ("on", "off"):
            router.recorder = recorder if name == "on" else None
            started = time.process_time()
            for at in range(0, count, 5000):
                for read in range(at, min(at + 5000, count), batch):
                    router.dispatch("mail", messages[read : min(read + batch, at + 5000)])
                await deferLater(reactor, 0, lambda: None)  # let the log commit
            flushed = recorder.flush()
            if flushed is not None:
                await flushed
            timings[name].append((time.process_time() - started) / count * 1e6)
    await store.close()
    off, on = (statistics.median(timings[k]) for k in ("off", "on"))
    print(
        f"router alone, batches of {batch}: {off:.2f} us/message without, {on:.2f} with:"
        f" +{on - off:.2f} us"
    )


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--router-only", action="store_true")
    parser.add_argument("--batch", type=int, default=100, help="router alone: messages a read")
    args = parser.parse_args()
    if args.router_only:
        from twisted.internet import task
        from twisted.internet.defer import Deferred

        with tempfile.TemporaryDirectory(prefix="bench-router-") as scratch:
            task.react(
                lambda reactor: Deferred.fromCoroutine(
                    _router_rounds(reactor, args.count, args.rounds, args.batch, Path(scratch))
                )
            )
        return
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
            for number in range(args.rounds):
                # Alternate which goes first: two identical gateways differ by a few
                # percent depending on which runs first.
                order = ("off", "on") if number % 2 == 0 else ("on", "off")
                for name in order:
                    process = gateways[name]
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
