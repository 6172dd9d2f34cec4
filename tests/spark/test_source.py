"""The msggateway data source on a local[2] Spark session."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    EqualTo,
    Filter,
    InputPartition,
)
from pyspark.sql.types import StructType

from gateway.spark.source import LogReader
from tests.spark.conftest import make_log

START = 1_700_000_000.0
SPEC = {
    "segment_bytes": 40_000,
    "streams": {
        "orders": {"count": 2000, "batch": 100, "publisher": "pub-1", "start": START},
        "events": {"count": 300, "batch": 50},
    },
    "outcomes": [
        ["to-stream", "mail", "accepted", 100.0, 100.002, "a@x.example", ["b@y.example"], 10],
        ["to-stream", "mail", "retry", 100.0, 100.5, "a@x.example", ["c@y.example"], 20],
    ],
}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log these tests read, written once by the gateway's LogStore."""
    return make_log(tmp_path_factory.mktemp("log") / "log", SPEC)


def test_every_message_with_its_fields(spark: Any, log: Path) -> None:
    """Every message with its fields."""
    frame = spark.read.format("msggateway").load(str(log))
    rows = frame.where(F.col("stream") == "orders").orderBy("offset").collect()
    assert [r.message_id for r in rows] == [f"orders-{i}" for i in range(2000)]
    row = rows[7]
    assert row.body == b"body orders 7".ljust(100, b".")
    assert row.size == 100
    assert row.headers == {"n": "7"}
    assert row.sender == "sender1@example.org"
    assert row.recipients == ["r1@domain3.example"]
    assert row.publisher == "pub-1"
    assert (
        row.timestamp
        == datetime.datetime.fromtimestamp(START + 7, datetime.UTC).replace(tzinfo=None)
        or row.timestamp.timestamp() == START + 7
    )
    assert row.route is None and row.address == "orders"
    assert frame.where(F.col("stream") == "events").count() == 300
    # The outcome stream is not messages.
    assert frame.select("stream").distinct().count() == 2


def test_a_dataframe_reused_with_other_filters(spark: Any, log: Path) -> None:
    """Spark filters are applied to rows, never used to prune a reused DataFrame's scan.

    PySpark 4.3 keeps what a Python reader's pushFilters planned on the
    DataFrame's provider (`test_pushdown_is_not_per_scan_in_this_pyspark`):
    a later query, or a second scan in the same query, would read the
    partitions planned for the first one's filters.
    """
    frame = spark.read.format("msggateway").load(str(log))
    picked = frame.where("stream = 'orders' and offset >= 1000 and offset < 1010")
    assert {r.offset for r in picked.collect()} <= set(range(1000, 1010))
    assert picked.count() > 0
    assert frame.select("stream").distinct().count() == 2
    assert frame.count() == 2300
    both = frame.where("stream = 'orders'").union(frame.where("stream = 'events'"))
    assert both.groupBy("stream").count().orderBy("stream").collect() == [
        ("events", 300),
        ("orders", 2000),
    ]


class ProbeSource(DataSource):
    """A source whose reader keeps its pushed filters itself, as the API documents."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "msggateway-pushdown-probe"

    def schema(self) -> str:
        """Two streams of three rows."""
        return "stream STRING, n INT"

    def reader(self, schema: StructType) -> DataSourceReader:
        """A fresh reader per scan."""
        return ProbeReader()


class ProbeReader(DataSourceReader):
    """Plans only the streams an ``EqualTo`` filter on ``stream`` allows."""

    def __init__(self) -> None:
        self.streams: set[str] | None = None

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        """Keep stream equality filters (on this reader), leave the rest to Spark."""
        for condition in filters:
            if isinstance(condition, EqualTo) and condition.attribute == ("stream",):
                self.streams = {condition.value}
            else:
                yield condition

    def partitions(self) -> list[InputPartition]:
        """A partition per stream the filters allow."""
        names = ["a", "b"]
        return [InputPartition(n) for n in names if self.streams is None or n in self.streams]

    def read(self, partition: InputPartition) -> Iterator[tuple[str, int]]:
        """Three rows of the partition's stream."""
        for n in range(3):
            yield (partition.value, n)


def test_pushdown_is_not_per_scan_in_this_pyspark(spark: Any) -> None:
    """The evidence: pushed filters leak between scans of one DataFrame (PySpark 4.3).

    With per-reader state, exactly as the API documents it, a union of two
    filtered scans of one DataFrame reads one filter's partitions twice,
    and a later unfiltered query reads the last filter's partitions. If
    this fails, PySpark scopes pushdown to the scan, and the msggateway
    source can implement pushFilters.
    """
    spark.dataSource.register(ProbeSource)
    key = "spark.sql.python.filterPushdown.enabled"
    spark.conf.set(key, "true")
    try:
        frame = spark.read.format(ProbeSource.name()).load()
        union = frame.where("stream = 'a'").union(frame.where("stream = 'b'"))
        assert sorted(r.stream for r in union.collect()) == ["b"] * 6  # not a, a, a, b, b, b
        again = spark.read.format(ProbeSource.name()).load()
        assert again.where("stream = 'a'").count() == 3
        assert again.count() == 3  # not 6: the filtered scan's partitions, reused
    finally:
        spark.conf.unset(key)


def test_options_prune_slices(log: Path) -> None:
    """Options prune slices."""
    everything = len(LogReader({"path": str(log)}).partitions())
    reader = LogReader(
        {"path": str(log), "streams": "orders", "start_offset": "1000", "end_offset": "1010"}
    )
    partitions = reader.partitions()
    assert len(partitions) <= 2 < everything
    offsets = [
        o for p in partitions for b in reader.read(p) for o in b.column("offset").to_pylist()
    ]
    assert offsets and all(1000 <= o < 1010 for o in offsets)


def test_options_bound_offsets_and_time(spark: Any, log: Path) -> None:
    """Options bound offsets and time."""
    reader = spark.read.format("msggateway").option("streams", "orders")
    assert reader.option("start_offset", 1900).load(str(log)).where("offset >= 1900").count() > 0
    future = "2999-01-01T00:00:00+00:00"
    assert reader.option("start_time", future).load(str(log)).count() == 0


def test_outcomes(spark: Any, log: Path) -> None:
    """Outcomes."""
    frame = spark.read.format("msggateway").option("kind", "outcomes").load(str(log))
    rows = sorted(frame.collect(), key=lambda r: r.status)
    assert [r.status for r in rows] == ["accepted", "retry"]
    assert rows[0].latency_ms == pytest.approx(2.0, abs=0.01)
    assert rows[1].route == "to-stream" and rows[1].recipients == ["c@y.example"]


def test_range_outcomes(spark: Any, tmp_path: Path) -> None:
    """A range record's row names its stream, offsets and exceptions; no message fields."""
    root = make_log(
        tmp_path / "log",
        {
            "durable": {
                "route": "r",
                "source": "mail",
                "count": 3,
                "batch": 3,
                "start": 10.0,
                "committed": [20.0, 20.001],
                "forwarded": 21.0,
                "dead": [1],
            }
        },
    )
    frame = spark.read.format("msggateway").option("kind", "outcomes").load(str(root))
    routed, forwarded = frame.orderBy("kind", ascending=False).collect()
    assert (routed.kind, routed.log_stream, routed.first_offset, routed.last_offset) == (
        "route",
        "msggateway.route.r",
        0,
        2,
    )
    assert routed.message_id is None and routed.exceptions == []
    assert routed.latency_ms == pytest.approx(1.0)
    assert (forwarded.kind, forwarded.first_offset, forwarded.last_offset) == ("forward", 0, 2)
    [dead] = forwarded.exceptions
    assert (dead.offset, dead.kind, dead.status, dead.reason, dead.attempts) == (
        1,
        "dead-letter",
        "rejected",
        "gone",
        3,
    )
    assert (dead.finished - routed.finished).total_seconds() == pytest.approx(23 - 20.001)


def test_arrow_batches(log: Path) -> None:
    """Arrow batches."""
    reader = LogReader({"path": str(log), "streams": "orders", "batch_rows": "500"})
    batches = [b for p in reader.partitions() for b in reader.read(p)]
    assert all(isinstance(b, pa.RecordBatch) and b.num_rows <= 500 for b in batches)
    assert sum(b.num_rows for b in batches) == 2000


def test_bad_options(spark: Any, log: Path) -> None:
    """Bad options."""
    with pytest.raises(Exception, match="kind is messages or outcomes"):
        spark.read.format("msggateway").option("kind", "nope").load(str(log)).count()
    with pytest.raises(ValueError, match="start_offset is a whole number"):
        LogReader({"path": str(log), "start_offset": "x"})


def test_columns_option_and_schema(spark: Any, log: Path) -> None:
    """A scan produces only the columns asked for, by option or by schema."""
    by_option = (
        spark.read.format("msggateway")
        .option("streams", "orders")
        .option("columns", "offset, sender,stream")
        .load(str(log))
    )
    assert by_option.columns == ["offset", "sender", "stream"]
    first = by_option.orderBy("offset").first()
    assert (first.offset, first.sender, first.stream) == (0, "sender0@example.org", "orders")
    by_schema = (
        spark.read.format("msggateway")
        .schema("body BINARY, offset LONG")
        .option("streams", "events")
        .load(str(log))
    )
    assert by_schema.orderBy("offset").first().body == b"body events 0".ljust(100, b".")
    with pytest.raises(Exception, match="no column 'bodies' in messages rows"):
        spark.read.format("msggateway").option("columns", "bodies").load(str(log)).count()
    with pytest.raises(Exception, match="column 'offset' is bigint, not string"):
        spark.read.format("msggateway").schema("offset STRING").load(str(log)).count()


def test_row_by_row_decode_reads_the_same(log: Path) -> None:
    """Decode = rows (every entry through the mapping) gives the columnar batches."""
    columnar = LogReader({"path": str(log), "streams": "orders"})
    rows = LogReader({"path": str(log), "streams": "orders", "decode": "rows"})
    for partition in columnar.partitions():
        assert list(columnar.read(partition)) == list(rows.read(partition))
