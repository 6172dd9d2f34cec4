"""The msggateway streaming source: offsets without Spark, then queries on local[2].

The log is written by the gateway's LogStore in a child process
(`tests.spark.logmaker`), appended to between micro-batches as the gateway
would append to it; retention is what the store does to old segments:
delete the segment file, then its index.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from gateway.spark.logfiles import list_streams
from gateway.spark.streaming import DataLossError, LogStreamReader
from tests.spark.conftest import make_log

SEGMENT_BYTES = 40_000  # about 300 of the test's messages: appends roll segments


def append(root: Path, stream: str, first: int, count: int, batch: int = 100) -> Path:
    """Append messages ``first`` to ``first + count - 1`` to a stream, as the gateway would."""
    spec = {
        "segment_bytes": SEGMENT_BYTES,
        "streams": {stream: {"count": count, "batch": batch, "first": first}},
    }
    return make_log(root, spec)


def retire_oldest(root: Path, stream: str, keep: int) -> None:
    """Delete all but the newest ``keep`` segments of a stream, as retention does."""
    directory = list_streams(root)[stream]
    for segment in sorted(directory.glob("*.segment"))[:-keep]:
        segment.unlink()
        segment.with_suffix(".index").unlink()


def reader(root: Path, **options: str) -> LogStreamReader:
    """A stream reader of the log, as Spark would make one."""
    return LogStreamReader({"path": str(root), **options})


def ids(stream_reader: LogStreamReader, start: dict[str, int], end: dict[str, int]) -> list[str]:
    """The message ids of one micro-batch, in the order read."""
    found = []
    for partition in stream_reader.partitions(start, end):
        for batch in stream_reader.read(partition):
            found += batch.column("message_id").to_pylist()
    return found


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """500 orders, in appends of 100, over several segments."""
    return append(tmp_path / "log", "orders", 0, 500)


# --- offsets, without Spark -------------------------------------------------------------


def test_micro_batches_read_each_message_once(log: Path) -> None:
    """Batch after batch, across appends and segment rolls: every message once, in order."""
    source = reader(log)
    start = source.initialOffset()
    assert start == {"orders": 0}
    end = source.latestOffset(start, ReadAllAvailable())
    seen = ids(source, start, end)
    append(log, "orders", 500, 450, batch=50)
    later = source.latestOffset(end, ReadAllAvailable())
    assert later["orders"] > end["orders"]
    seen += ids(source, end, later)
    assert source.latestOffset(later, ReadAllAvailable()) == later  # nothing new
    assert ids(source, later, later) == []
    assert seen == [f"orders-{i}" for i in range(950)]


def test_offsets_split_anywhere(log: Path) -> None:
    """Offsets that cut chunks in the middle still give each message once."""
    source = reader(log)
    end = source.latestOffset({"orders": 0}, ReadAllAvailable())["orders"]
    cuts = [0, 1, 37, 100, 101, 250, end - 1, end]
    seen = []
    for low, high in itertools.pairwise(cuts):
        seen += ids(source, {"orders": low}, {"orders": high})
    assert seen == [f"orders-{i}" for i in range(500)]


def test_starting_offsets(log: Path) -> None:
    """earliest, latest, or JSON per stream (others from their beginning)."""
    bounds = reader(log).latestOffset({}, ReadAllAvailable())
    assert reader(log, starting_offsets="latest").initialOffset() == bounds
    assert reader(log, starting_offsets='{"orders": 7}').initialOffset() == {"orders": 7}
    with pytest.raises(ValueError, match="starting_offsets is earliest, latest or JSON"):
        reader(log, starting_offsets="soon")
    with pytest.raises(ValueError, match="is not JSON"):
        reader(log, starting_offsets='{"orders": "x"}').initialOffset()


def test_read_limit_and_available_now(log: Path) -> None:
    """max_records_per_trigger bounds a batch; AvailableNow stops at what was there."""
    source = reader(log, max_records_per_trigger="120")
    limit = source.getDefaultReadLimit()
    assert limit == ReadMaxRows(120)
    source.prepareForTriggerAvailableNow()
    target = source.reportLatestOffset()
    append(log, "orders", 500, 100)  # comes after the target: not read
    start, seen = source.initialOffset(), []
    while True:
        end = source.latestOffset(start, limit)
        if end == start:
            break
        assert end["orders"] - start["orders"] <= 120
        seen += ids(source, start, end)
        start = end
    assert start == target
    assert seen == [f"orders-{i}" for i in range(500)]


def test_new_streams_are_read_from_their_start(log: Path) -> None:
    """A stream created after the query started is read from its first message."""
    source = reader(log)
    start = source.latestOffset({}, ReadAllAvailable())
    append(log, "events", 0, 30, batch=10)
    end = source.latestOffset(start, ReadAllAvailable())
    assert set(end) == {"orders", "events"}
    assert ids(source, start, end) == [f"events-{i}" for i in range(30)]


def test_retention_below_the_start_fails_with_the_offsets(log: Path) -> None:
    """Offsets retention deleted: an error naming stream, wanted and first kept offsets."""
    source = reader(log)
    append(log, "orders", 500, 600)
    retire_oldest(log, "orders", keep=2)
    first = source.initialOffset()["orders"]
    assert first > 0
    with pytest.raises(DataLossError, match=rf"'orders': offsets 10 to {first - 1} are gone"):
        source.partitions({"orders": 10}, {"orders": first + 5})
    lenient = reader(log, fail_on_data_loss="false")
    kept = ids(lenient, {"orders": 10}, lenient.latestOffset({"orders": 10}, ReadAllAvailable()))
    assert kept and kept[-1] == "orders-1099"
    assert kept[0] == f"orders-{1100 - len(kept)}"


def test_a_segment_deleted_after_planning(log: Path) -> None:
    """A slice whose segment goes before it is read: data loss, not an empty batch."""
    source = reader(log)
    end = source.latestOffset({"orders": 0}, ReadAllAvailable())
    [first, *_] = source.partitions({"orders": 0}, end)
    retire_oldest(log, "orders", keep=1)
    with pytest.raises(DataLossError, match="'orders': offsets from 0 are gone"):
        list(source.read(first))
    lenient = reader(log, fail_on_data_loss="false")
    assert list(lenient.read(first)) == []


# --- queries on local[2] ------------------------------------------------------------------

QUERY_TIMEOUT_SECONDS = 240


def start_query(spark: Any, log: Path, out: Path, trigger: dict[str, Any], **options: str) -> Any:
    """A query copying the log's orders into a Parquet sink, checkpointed under ``out``."""
    stream = spark.readStream.format("msggateway").option("streams", "orders")
    stream = stream.option("columns", "stream,offset,message_id,body")
    for key, value in options.items():
        stream = stream.option(key, value)
    return (
        stream.load(str(log))
        .writeStream.format("parquet")
        .option("path", str(out / "sink"))
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(**trigger)
        .start()
    )


def sink_ids(spark: Any, out: Path) -> list[str]:
    """The message ids in the sink, as Spark reads it (committed batches only)."""
    rows = spark.read.parquet(str(out / "sink")).select("message_id").collect()
    return [r.message_id for r in rows]


def numbers(found: list[str]) -> list[int]:
    """The message numbers of ``orders-N`` ids, sorted (duplicates kept)."""
    return sorted(int(i.rsplit("-", 1)[1]) for i in found)


@pytest.mark.timeout(900)
def test_available_now_restarts_where_it_stopped(spark: Any, log: Path, tmp_path: Path) -> None:
    """AvailableNow, restarted from its checkpoint after appends and rolls: each row once.

    Then retention deletes offsets the checkpoint still wants: the query
    fails saying which; with fail_on_data_loss false it reads on from the
    first offset kept.
    """
    out = tmp_path / "out"
    available_now = {"availableNow": True}
    start_query(spark, log, out, available_now).awaitTermination(QUERY_TIMEOUT_SECONDS)
    assert numbers(sink_ids(spark, out)) == list(range(500))
    append(log, "orders", 500, 450, batch=50)
    query = start_query(spark, log, out, available_now, max_records_per_trigger="200")
    query.awaitTermination(QUERY_TIMEOUT_SECONDS)
    assert numbers(sink_ids(spark, out)) == list(range(950))
    assert len(query.recentProgress) >= 3  # 450 new offsets in batches of at most 200

    append(log, "orders", 950, 900)
    retire_oldest(log, "orders", keep=2)
    failing = start_query(spark, log, out, available_now)
    with pytest.raises(Exception, match=r"'orders': offsets \d+ to \d+ are gone"):
        failing.awaitTermination(QUERY_TIMEOUT_SECONDS)
    lenient = start_query(spark, log, out, available_now, fail_on_data_loss="false")
    lenient.awaitTermination(QUERY_TIMEOUT_SECONDS)
    found = numbers(sink_ids(spark, out))
    assert len(found) == len(set(found)) and found[-1] == 1849
    assert found[:950] == list(range(950)) and 950 < len(found) < 1850


@pytest.mark.timeout(900)
def test_a_running_query_follows_the_log(spark: Any, log: Path, tmp_path: Path) -> None:
    """With a processing-time trigger, messages appended while it runs reach the sink once."""
    out = tmp_path / "out"
    query = start_query(spark, log, out, {"processingTime": "1 second"})
    try:
        wait_for_rows(query, 500)
        append(log, "orders", 500, 300, batch=30)
        wait_for_rows(query, 800)
    finally:
        query.stop()
    assert numbers(sink_ids(spark, out)) == list(range(800))
    assert len([p for p in query.recentProgress if p["numInputRows"]]) >= 2


def wait_for_rows(query: Any, rows: int) -> None:
    """Let the query process all the log holds now (Spark's own wait, no polling); count."""
    query.processAllAvailable()
    assert query.isActive, query.exception()
    assert rows_committed(query) >= rows, query.recentProgress[-3:]


def rows_committed(query: Any) -> int:
    """Rows of the query's finished micro-batches, each batch counted once."""
    batches = {p["batchId"]: p["numInputRows"] for p in query.recentProgress}
    return sum(batches.values())
