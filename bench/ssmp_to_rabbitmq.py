"""SSMP MCAST through the gateway into RabbitMQ, against rstream straight in.

Starts a private RabbitMQ 3.10 node (`tests.rabbitmq`) and a gateway whose
SSMP hub routes topic ``ticks`` to a stream upstream on that node (a direct
route: each SSMP ``200`` comes after RabbitMQ confirmed the message). Then,
in the same run:

* the independent Go load generator ``ssmpload`` publishes MCASTs to the hub
  (one publisher, a bounded window of unanswered requests) and reports the
  acknowledged rate: messages per second confirmed by RabbitMQ end to end;
* the baseline: rstream publishing the same number of 100-byte messages
  straight into RabbitMQ with ``send_batch`` of 1,000 and at most 20,000
  unconfirmed.

Bounded by the message count and ssmpload's own limits. Run with
``python bench/ssmp_to_rabbitmq.py [--count N] [--window W]`` (``./dev
bench`` builds ssmpload first; give ``--ssmpload PATH`` otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rstream  # noqa: E402

from bench.ssmp_hub import build_ssmpload, run_load  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402
from tests.rabbitmq import RabbitMQNode  # noqa: E402

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
max_pending_replies = 100000

[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
"""
ROUTE = 'from = "hub"\nmatch = "bench"\nto = "rabbit"\naddress = "ssmp-bench"\n'


async def rstream_baseline(connection: dict[str, object], count: int) -> float:
    """Publish ``count`` raw 100-byte messages with rstream; return confirmed msg/s."""
    confirmed = 0
    done = asyncio.Event()

    def on_confirm(status: object) -> None:
        nonlocal confirmed
        confirmed += 1
        if confirmed >= count:
            done.set()

    body = b"x" * 100
    async with rstream.Producer(**connection) as producer:  # type: ignore[arg-type]
        await producer.create_stream("rstream-bench", exists_ok=True)
        started = time.monotonic()
        for start in range(0, count, 1000):
            while start - confirmed > 20_000:
                await asyncio.sleep(0.001)  # the unconfirmed bound of the figure
            batch = [body] * min(1000, count - start)
            await producer.send_batch("rstream-bench", batch, on_publish_confirm=on_confirm)
        await asyncio.wait_for(done.wait(), 120)
        return count / (time.monotonic() - started)


def main() -> None:
    """Measure both paths into the same RabbitMQ and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=5000, help="ssmpload's unanswered requests")
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    args = parser.parse_args()
    ssmpload = args.ssmpload or build_ssmpload()
    with RabbitMQNode() as node, tempfile.TemporaryDirectory() as directory:
        port = node.stream_connection()["port"]
        gateway = GatewayProcess(
            Path(directory), CONFIG.format(port=port), routes={"bench": ROUTE}
        ).start()
        try:
            gateway.wait_for_log("upstream rabbit: connected")
            figures = run_load(
                ssmpload,
                gateway.address("hub")[1],
                gateway.pid,
                ["-mode", "mcast", "-pubs", "1", "-subs", "1", "-topic", "bench",
                 "-max", str(args.count), "-window", str(args.window), "-duration", "60s"],
            )  # fmt: skip
        finally:
            gateway.stop()
        baseline = asyncio.run(rstream_baseline(node.stream_connection(), args.count))
        version = node.version()
    through = figures["ack_rate"]
    print(f"RabbitMQ {version}, {args.count} messages of 100 bytes, 2 cores shared")
    print(f"SSMP MCAST -> gateway -> RabbitMQ (200 after confirm): {through:9.0f} msg/s")
    print(f"rstream straight into RabbitMQ (send_batch):           {baseline:9.0f} msg/s")
    print(f"ratio: {through / baseline:.2f}x of the baseline")
    print(f"gateway CPU {figures['srv_cpu_pct']:.0f}% of a core; ssmpload window {args.window}")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"ssmpload failed: {exc.stderr}") from None
