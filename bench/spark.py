"""Benchmark the data pipeline on Spark against its baselines, in one run: one table.

A log of ``--messages`` 100-byte messages with sender, recipients and a
header (as the gateway writes them: `tests.spark.logmaker`, the gateway's
own LogStore, 64 MiB segments) is written once. Then, in one Spark session
(``local[2]`` unless ``--master``), round after round, alternately:

* read all columns: ``spark.read.format("msggateway")`` (columnar decode),
  then the same rows from Parquet (written once from the data source);
  also the row-by-row decode (``decode = rows``: what the reader did before
  issue 16) for comparison;
* read without body and headers: the ``columns`` option against Parquet
  reading the same columns; and the offset alone, which decodes nothing:
  what reading through a Python data source costs at least;
* filtered read, ``stream = 'orders' and offset >= 90%``: narrowed by the
  options (``streams``, ``start_offset``: only the slices that can hold
  such rows are planned; the table says how many of how many), and by a
  Spark ``where`` alone (every slice read), against Parquet with the
  ``where`` (row group statistics);

Each read materialises its columns with a ``noop`` write. Reported: rows
per second (the filtered reads: seconds), medians of ``--rounds``.

Then the streaming lag: a writer process appends ``--lag-rate`` messages a
second (chunks of 100) with the gateway's LogStore for ``--lag-seconds``,
while ``spark.readStream.format("msggateway")`` copies every column to a
Parquet sink with a 1 s processing-time trigger. A thread watches the
sink's ``_spark_metadata`` log: a row's lag is the time its batch became
visible there minus its chunk's timestamp (set as the chunk is written).
Reported: p50, p99 and max, after a 3 s warm-up.

Last, the write against rstream (``bench/spark_write.py``'s
``measure_write``, the sink engineer's; "not measured" when that module
is absent). Every wait has a deadline; counts and rounds are fixed.

Run with ``nice python -m bench.spark``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.spark.jobs import spark_session  # noqa: E402
from gateway.spark.source import LogReader  # noqa: E402

SLIM: Final = (
    "stream,offset,chunk_timestamp,publisher,message_id,route,address,sender,recipients,"
    "timestamp,size"
)
"""Every column but body and headers."""
LAG_TRIGGER: Final = "1 second"
LAG_WARM_UP_SECONDS: Final = 3.0
LAG_DRAIN_SECONDS: Final = 60.0
CHUNK_MESSAGES: Final = 100


def _timed(frame: Any) -> float:
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


class _Rates:
    """Timings of named reads, round after round."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    def run(self, name: str, frame: Any) -> None:
        self.seconds.setdefault(name, []).append(_timed(frame))

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def _reads(spark: Any, log: Path, parquet: Path, messages: int, rounds: int) -> dict[str, Any]:
    """The read measurements (module docstring), medians of ``rounds``."""

    def source() -> Any:
        return spark.read.format("msggateway")  # a reader's options stick: a new one each

    low = messages * 9 // 10
    narrow_options = {"path": str(log), "streams": "orders", "start_offset": str(low)}
    frames = {
        "all": source().load(str(log)),
        "all rows": source().option("decode", "rows").load(str(log)),
        "all parquet": spark.read.parquet(str(parquet)),
        "slim": source().option("columns", SLIM).load(str(log)),
        "slim parquet": spark.read.parquet(str(parquet)).select(*SLIM.split(",")),
        "offset": source().option("columns", "offset").load(str(log)),
        "offset parquet": spark.read.parquet(str(parquet)).select("offset"),
        "narrow": source().option("streams", "orders").option("start_offset", low).load(str(log)),
        "where": source().load(str(log)).where(f"stream = 'orders' and offset >= {low}"),
        "where parquet": spark.read.parquet(str(parquet)).where(
            f"stream = 'orders' and offset >= {low}"
        ),
    }
    for frame in frames.values():
        _timed(frame)  # warm up every path once
    rates = _Rates()
    for _ in range(rounds):
        for name, frame in frames.items():
            rates.run(name, frame)
    slices = len(LogReader({"path": str(log)}).partitions())
    narrowed = len(LogReader(narrow_options).partitions())
    matching = messages - low
    return {
        "rates": {name: messages / rates.median(name) for name in frames},
        "seconds": {name: rates.median(name) for name in frames},
        "all_rounds": {name: rates.seconds[name] for name in frames},
        "slices": slices,
        "narrowed": narrowed,
        "matching": matching,
    }


# --- streaming lag ----------------------------------------------------------------------


def _paced_writer(directory: str, stream: str, rate: int, seconds: float) -> None:
    """Append ``rate`` messages a second for ``seconds`` (chunks of 100); print what it did."""
    from twisted.internet import task
    from twisted.internet.defer import Deferred

    from gateway.core.log import LogStore
    from gateway.protocols.stream.mapping import entry_from_message
    from tests.spark.logmaker import message

    async def write(reactor: Any) -> None:
        store = LogStore(Path(directory), reactor)
        store.open()
        log = store.get(stream) or store.create(stream)
        interval = CHUNK_MESSAGES / rate
        started = time.time()
        sent = late = 0
        while time.time() - started < seconds:
            due = started + (sent // CHUNK_MESSAGES) * interval
            wait = due - time.time()
            if wait > 0:
                await task.deferLater(reactor, wait)
            else:
                late += 1
            entries = [
                entry_from_message(message(stream, i, started))
                for i in range(sent, sent + CHUNK_MESSAGES)
            ]
            await log.append(entries)
            sent += CHUNK_MESSAGES
        await store.close()
        elapsed = time.time() - started
        print(json.dumps({"sent": sent, "seconds": elapsed, "late_chunks": late}), flush=True)

    task.react(lambda reactor: Deferred.fromCoroutine(write(reactor)))


class _SinkWatch(threading.Thread):
    """Watches a Parquet sink's metadata log; notes when each file became visible."""

    def __init__(self, sink: Path) -> None:
        super().__init__(daemon=True)
        self.metadata = sink / "_spark_metadata"
        self.visible: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        seen: set[str] = set()
        while not self.done.is_set():
            if self.metadata.is_dir():
                for entry in sorted(self.metadata.iterdir()):
                    if entry.name.startswith(".") or entry.name in seen:
                        continue
                    now = time.time()
                    seen.add(entry.name)
                    for line in entry.read_text().splitlines()[1:]:
                        path = json.loads(line)["path"]
                        self.visible.setdefault(path, now)
            self.done.wait(0.01)


def _lag(spark: Any, scratch: Path, rate: int, seconds: float) -> dict[str, Any]:
    """Commit-to-sink lag of a streaming query while a writer appends at ``rate``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    log, sink = scratch / "lag-log", scratch / "lag-sink"
    subprocess.run(  # the stream, with one chunk, so the query starts on it
        [sys.executable, "-m", "tests.spark.logmaker", str(log),
         json.dumps({"streams": {"live": {"count": CHUNK_MESSAGES, "batch": CHUNK_MESSAGES}}})],
        cwd=ROOT, check=True, timeout=120,
    )  # fmt: skip
    watch = _SinkWatch(sink)
    watch.start()
    query = (
        spark.readStream.format("msggateway")
        .option("streams", "live")
        .load(str(log))
        .writeStream.format("parquet")
        .option("path", str(sink))
        .option("checkpointLocation", str(scratch / "lag-checkpoint"))
        .trigger(processingTime=LAG_TRIGGER)
        .start()
    )
    writer = None
    try:
        deadline = time.monotonic() + 120
        while not watch.visible:  # the first chunk is in the sink: the query runs
            if time.monotonic() > deadline or not query.isActive:
                raise RuntimeError(f"the streaming query never wrote: {query.exception()}")
            time.sleep(0.05)
        begin = time.time()
        writer = subprocess.run(
            [sys.executable, "-m", "bench.spark", "--paced-writer", str(log),
             "--lag-rate", str(rate), "--lag-seconds", str(seconds)],
            cwd=ROOT, check=True, timeout=seconds + 120, capture_output=True, text=True,
        )  # fmt: skip
        written = json.loads(writer.stdout.strip().splitlines()[-1])
        expected = CHUNK_MESSAGES + written["sent"]
        deadline = time.monotonic() + LAG_DRAIN_SECONDS
        while _rows(pq, watch) < expected:
            if time.monotonic() > deadline or not query.isActive:
                raise RuntimeError(f"the sink has {_rows(pq, watch)} of {expected} rows")
            time.sleep(0.1)
    finally:
        query.stop()
        watch.done.set()
        watch.join()
    lags: list[float] = []
    for path, visible in watch.visible.items():
        stamps = pq.read_table(path.removeprefix("file://"), columns=["chunk_timestamp"])
        # Spark may store timestamps as INT96 (nanoseconds): microseconds first.
        micros = stamps.column(0).cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        for stamp in micros.to_pylist():
            if stamp / 1e6 >= begin + LAG_WARM_UP_SECONDS:
                lags.append(visible - stamp / 1e6)
    lags.sort()
    return {
        "rate": written["sent"] / written["seconds"],
        "rows": len(lags),
        "p50": lags[len(lags) // 2],
        "p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
        "max": lags[-1],
    }


def _rows(pq: Any, watch: _SinkWatch) -> int:
    return sum(pq.read_metadata(p.removeprefix("file://")).num_rows for p in list(watch.visible))


# --- the table --------------------------------------------------------------------------


def _write(rows: int, rounds: int, master: str) -> dict[str, Any] | None:
    """``bench/spark_write.py``'s figures, or None when that bench is not there."""
    try:
        module = importlib.import_module("bench.spark_write")
    except ModuleNotFoundError:
        return None
    measure: Callable[..., dict[str, Any]] = module.measure_write
    return measure(rows, rounds, master)


def _table(rows: list[tuple[str, str, str, str, str]]) -> str:
    """An RST simple table (it prints as a plain table, and goes into the README as is)."""
    head = ("measurement", "msggateway", "baseline", "ratio", "target")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([*lines, rule])


def main() -> None:
    """Run every measurement and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--lag-rate", type=int, default=10_000)
    parser.add_argument("--lag-seconds", type=float, default=20.0)
    parser.add_argument("--write-rows", type=int, default=1_000_000)
    parser.add_argument("--skip", default="", help="comma separated: read, lag, write")
    parser.add_argument("--paced-writer", metavar="LOG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paced_writer:
        _paced_writer(args.paced_writer, "live", args.lag_rate, args.lag_seconds)
        return
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    table: list[tuple[str, str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as scratch_name:
        scratch = Path(scratch_name)
        log = scratch / "log"
        started = time.perf_counter()
        spec = {"streams": {"orders": {"count": args.messages, "batch": 1000}}}
        subprocess.run(
            [sys.executable, "-m", "tests.spark.logmaker", str(log), json.dumps(spec)],
            cwd=ROOT, check=True,
        )  # fmt: skip
        print(f"log of {args.messages:,} messages written in {time.perf_counter() - started:.1f} s")
        spark = spark_session(args.master, app="bench spark")
        if "read" not in skip:
            parquet = scratch / "parquet"
            spark.read.format("msggateway").load(str(log)).write.parquet(str(parquet))
            reads = _reads(spark, log, parquet, args.messages, args.rounds)
            print(json.dumps(reads["all_rounds"]))
            table += _read_rows(reads, args.messages)
        if "lag" not in skip:
            lag = _lag(spark, scratch, args.lag_rate, args.lag_seconds)
            table.append(
                (
                    f"streaming lag, {lag['rate']:,.0f} msg/s, 1 s trigger, Parquet sink",
                    f"p50 {lag['p50']:.2f} s, p99 {lag['p99']:.2f} s, max {lag['max']:.2f} s",
                    "-",
                    "-",
                    "p99 <= 2 s",
                )
            )
        write = None if "write" in skip else _write(args.write_rows, args.rounds, args.master)
        if write is None:
            table.append(("write, df.write vs rstream", "not measured", "-", "-", ">= 0.5x"))
        else:
            table.append(
                (
                    f"write {write['rows']:,} rows, sink vs rstream send_batch",
                    f"{write['rate']:,.0f} rows/s",
                    f"rstream {write['rstream_rate']:,.0f} rows/s",
                    f"{write['ratio']:.2f}x",
                    ">= 0.5x",
                )
            )
    print(f"{args.master}, medians of {args.rounds} rounds")
    print(_table(table))


def _read_rows(reads: dict[str, Any], messages: int) -> list[tuple[str, str, str, str, str]]:
    rates, seconds = reads["rates"], reads["seconds"]
    matching = reads["matching"]

    def rate(name: str) -> str:
        return f"{rates[name]:,.0f} rows/s"

    def ratio(name: str, baseline: str) -> str:
        return f"{rates[name] / rates[baseline]:.2f}x"

    return [
        (
            f"read all columns, {messages:,} messages",
            rate("all"),
            f"Parquet {rate('all parquet')}",
            ratio("all", "all parquet"),
            ">= 0.5x",
        ),
        (
            "same, row by row (decode = rows: before)",
            rate("all rows"),
            f"Parquet {rate('all parquet')}",
            ratio("all rows", "all parquet"),
            "-",
        ),
        (
            "read without body and headers",
            rate("slim"),
            f"Parquet {rate('slim parquet')}",
            ratio("slim", "slim parquet"),
            ">= 0.8x",
        ),
        (
            "read offset only (a Python source's floor)",
            rate("offset"),
            f"Parquet {rate('offset parquet')}",
            ratio("offset", "offset parquet"),
            "-",
        ),
        (
            f"filtered: {matching:,} rows, options",
            f"{seconds['narrow']:.2f} s, {reads['narrowed']} of {reads['slices']} slices",
            f"Parquet where {seconds['where parquet']:.2f} s",
            f"{seconds['where parquet'] / seconds['narrow']:.2f}x",
            "matching slices only",
        ),
        (
            "filtered: same, Spark where only",
            f"{seconds['where']:.2f} s, {reads['slices']} of {reads['slices']} slices",
            f"Parquet where {seconds['where parquet']:.2f} s",
            f"{seconds['where parquet'] / seconds['where']:.2f}x",
            "-",
        ),
    ]


if __name__ == "__main__":
    main()
