"""Benchmark the msggateway data source against Spark reading the same rows from Parquet.

A log of ``--messages`` 100-byte messages (with sender, recipients and a
header, as the gateway writes them) is written by the gateway's own
LogStore; Spark (``local[2]`` unless ``--master``) then, in the same run and
the same session, alternately:

* reads it through the data source: ``spark.read.format("msggateway")``;
* reads the same rows from Parquet (written once from the data source).

Each read materialises every column (``write.format("noop")``), so neither
side can skip the work. Reported: rows per second of each, median of
``--rounds``, and the data source's rate as a ratio of Parquet's.

Bounded: fixed message count and rounds. Run with ``python bench/spark_read.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.spark.jobs import spark_session  # noqa: E402


def _timed(frame: object) -> float:
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()  # type: ignore[attr-defined]
    return time.perf_counter() - started


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as scratch:
        log = Path(scratch) / "log"
        spec = {"streams": {"orders": {"count": args.messages, "batch": 1000}}}
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "tests.spark.logmaker", str(log), json.dumps(spec)],
            cwd=ROOT,
            check=True,
        )
        print(f"log of {args.messages:,} messages written in {time.perf_counter() - started:.1f} s")
        spark = spark_session(args.master, app="bench spark read")
        source = spark.read.format("msggateway").load(str(log))
        parquet_path = str(Path(scratch) / "parquet")
        source.write.parquet(parquet_path)
        parquet = spark.read.parquet(parquet_path)
        assert parquet.count() == args.messages
        _timed(source), _timed(parquet)  # warm up both paths
        rates: dict[str, list[float]] = {"data source": [], "parquet": []}
        for _ in range(args.rounds):
            rates["data source"].append(args.messages / _timed(source))
            rates["parquet"].append(args.messages / _timed(parquet))
        spark.stop()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        rounds = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:12} {medians[name]:>12,.0f} rows/s (median; rounds: {rounds})")
    print(f"data source / parquet: {medians['data source'] / medians['parquet']:.2f}x")


if __name__ == "__main__":
    main()
