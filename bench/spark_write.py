"""Benchmark the sink ``df.write.format("msggateway")`` against rstream, into one gateway.

In one run, a ``twistd msggateway`` with a stream listener (``[log] fsync =
"never"``, as a single RabbitMQ node) takes, round after round:

* ``--rows`` rows of a 100-byte body written by Spark (``local[2]``: two
  partitions, two connections) through the sink, under a producer name (so
  with deduplication: the sequence query and publishing ids), from a cached
  DataFrame;
* the same bodies published by rstream straight in: one ``Producer``,
  ``send_batch`` of 1,000 raw bodies, at most 20,000 unconfirmed, the
  fastest way rstream has (ENVIRONMENT.md), timed to the last confirm.

Each into a fresh stream. Reported: rows per second of each (median of
``--rounds``) and the sink's as a ratio of rstream's; the target is 0.5.
The Spark session starts once, before the first round, and is not timed.

``measure_write(rows, rounds)`` returns the figures (``bench/spark.py``
prints them with its own); ``python bench/spark_write.py`` prints a table.
Bounded: fixed counts and rounds, every wait with a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import GatewayProcess  # noqa: E402

BODY_BYTES: Final = 100
BATCH_MESSAGES: Final = 1_000
MAX_UNCONFIRMED: Final = 20_000
PUBLISH_TIMEOUT_SECONDS: Final = 600.0

GATEWAY_CONFIG: Final = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[log]
fsync = "never"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""


async def _rstream_publish(host: str, port: int, stream: str, rows: int) -> float:
    """Publish ``rows`` bodies with rstream; return the seconds to the last confirm."""
    import rstream

    bodies = [b"%09d " % i + bytes(BODY_BYTES - 10) for i in range(rows)]
    confirmed = sent = 0
    room = asyncio.Event()
    finished = asyncio.Event()

    def on_confirm(status: Any) -> None:
        nonlocal confirmed
        confirmed += 1
        if sent - confirmed + BATCH_MESSAGES <= MAX_UNCONFIRMED:
            room.set()
        if confirmed >= rows:
            finished.set()

    async with rstream.Producer(host, port=port, username="guest", password="guest") as producer:
        await producer.create_stream(stream)
        started = time.perf_counter()
        for start in range(0, rows, BATCH_MESSAGES):
            batch = bodies[start : start + BATCH_MESSAGES]
            while sent - confirmed + len(batch) > MAX_UNCONFIRMED:
                room.clear()
                await room.wait()
            sent += len(batch)
            await producer.send_batch(stream, batch, on_publish_confirm=on_confirm)  # type: ignore[arg-type]
        await finished.wait()
        return time.perf_counter() - started


def _sink_write(frame: Any, endpoint: str, stream: str) -> float:
    """Write the frame through the sink; return the seconds it took."""
    started = time.perf_counter()
    (
        frame.write.format("msggateway")
        .mode("append")
        .option("endpoint", endpoint)
        .option("stream", stream)
        .option("producer", f"bench-{uuid.uuid4().hex[:8]}")
        .save()
    )
    return time.perf_counter() - started


def measure_write(
    rows: int = 1_000_000, rounds: int = 3, master: str = "local[2]"
) -> dict[str, Any]:
    """Measure the sink and rstream into the same gateway, alternately (module docstring).

    Returns:
        ``rate`` and ``rstream_rate`` (rows per second, medians of the
        rounds), ``ratio`` (rate / rstream_rate), ``rows``, ``rounds`` and
        the per-round rates (``rates``, ``rstream_rates``).
    """
    from pyspark.sql import functions as F  # noqa: N812

    from gateway.spark.jobs import spark_session
    from tests.spark.test_sink import register_sink

    with tempfile.TemporaryDirectory(prefix="bench-spark-write-") as scratch:
        gateway = GatewayProcess(Path(scratch) / "gw", GATEWAY_CONFIG).start()
        spark = None
        try:
            host, port = gateway.address("streams")
            endpoint = f"tcp:host={host}:port={port}"
            spark = spark_session(master, app="bench spark write")
            register_sink(spark)
            frame = (
                spark.range(rows, numPartitions=2)
                .select(
                    F.concat(
                        F.format_string("%09d ", "id").cast("binary"),
                        F.unhex(F.lit("00" * (BODY_BYTES - 10))),
                    ).alias("body")
                )
                .cache()
            )
            assert frame.count() == rows
            _sink_write(frame, endpoint, "warm-up")  # start a worker per partition
            rates: list[float] = []
            rstream_rates: list[float] = []
            for round_number in range(rounds):
                stream = f"bench-{round_number}-{uuid.uuid4().hex[:6]}"
                rates.append(rows / _sink_write(frame, endpoint, f"{stream}-sink"))
                seconds = asyncio.run(
                    asyncio.wait_for(
                        _rstream_publish(host, port, f"{stream}-rstream", rows),
                        PUBLISH_TIMEOUT_SECONDS,
                    )
                )
                rstream_rates.append(rows / seconds)
        finally:
            if spark is not None:
                spark.stop()
            gateway.stop()
    rate, rstream_rate = statistics.median(rates), statistics.median(rstream_rates)
    return {
        "rows": rows,
        "rounds": rounds,
        "rate": rate,
        "rstream_rate": rstream_rate,
        "ratio": rate / rstream_rate,
        "rates": rates,
        "rstream_rates": rstream_rates,
    }


def main() -> None:
    """Run the benchmark and print its one-row table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    result = measure_write(args.rows, args.rounds, args.master)
    print(f"{'rows':>10} {'sink rows/s':>12} {'rstream rows/s':>15} {'sink/rstream':>13}")
    print(
        f"{result['rows']:>10,} {result['rate']:>12,.0f} {result['rstream_rate']:>15,.0f}"
        f" {result['ratio']:>12.2f}x"
    )
    rounds = ", ".join(
        f"{a:,.0f}/{b:,.0f}" for a, b in zip(result["rates"], result["rstream_rates"], strict=True)
    )
    print(f"rounds (sink/rstream): {rounds}")


if __name__ == "__main__":
    main()
