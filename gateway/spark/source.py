"""The PySpark data source ``msggateway``: the embedded log as a DataFrame.

Register it once per session with ``spark.dataSource.register(LogDataSource)``
(`register` does it), then::

    spark.read.format("msggateway").load("/var/lib/msggateway/log")
    spark.read.format("msggateway").option("kind", "outcomes").load(path)

Two kinds of rows (`MESSAGE_SCHEMA`, `OUTCOME_SCHEMA`):

* ``messages`` (the default): one row per message of every stream but the
  outcome stream (or of the streams named by the ``streams`` option, comma
  separated): stream, offset, chunk timestamp, publisher (the one publisher
  reference in the chunk's trailer; null when the chunk holds messages of
  none or of several), message id, route (for a durable route's stream),
  address, sender, recipients, timestamp, headers (a string map), body and
  its size. Entries are read with the stream listener's own mapping
  (`gateway.protocols.stream.mapping`), so a message reads the same here as
  through a stream consumer.
* ``outcomes``: the records of ``msggateway.outcomes`` (`gateway.core.outcomes`),
  one row per record (``offset`` is the entry's: one entry holds up to a
  thousand records): its kind, route, source, arrival, outcome and outcome
  time. A per-message record (a direct route's) has the message's id,
  address, sender, recipients and bytes; a range record (a durable route's
  committed batch, or a chunk its forwarder delivered) has instead the
  stream and offsets it covers (``log_stream``, ``first_offset``,
  ``last_offset``) and its ``exceptions``, the offsets whose outcome was
  another. `gateway.spark.jobs.message_outcomes` joins ranges to the
  stream's messages: one row per message, as the report counts them.

Partitions are slices of segments (`gateway.spark.logfiles`, at most
``max_slice_bytes`` of chunks each), read in parallel by Spark's workers. The
options ``streams``, ``start_offset``, ``end_offset`` (exclusive),
``start_time`` and ``end_time`` (exclusive; ISO 8601 or milliseconds) skip
whole segments and chunk ranges without reading them, from the index alone,
and bound the rows exactly. Rows come as Arrow record batches of up to
``batch_rows`` rows.

Spark filters (``where offset > N``) are applied by Spark to the rows read,
not pushed into the scan: PySpark 4.3 keeps a Python data source's pushed
filter state with the DataFrame and reuses its partitions for a later query
of the same DataFrame with other filters, which returns too few rows (seen
here: ``df.where("stream = 'a'").count()`` then ``df.count()``). The options
are the safe way to narrow a scan.

A live log is read safely: only chunks the index listed at planning, each
checked by its CRC; a torn tail ends a slice without an error.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from typing import Any, Final

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from gateway.core.durable import ROUTE_STREAM_PREFIX
from gateway.core.outcomes import OUTCOME_STREAM, decode_records
from gateway.protocols.stream.mapping import message_from_entry
from gateway.spark.logfiles import (
    DEFAULT_SLICE_BYTES,
    ChunkRecords,
    Range,
    Slice,
    list_streams,
    plan_slices,
    read_slice,
)

__all__ = [
    "MESSAGE_SCHEMA",
    "NAME",
    "OUTCOME_SCHEMA",
    "LogDataSource",
    "register",
]

NAME: Final = "msggateway"
"""The format name: ``spark.read.format("msggateway")``."""

MESSAGE_SCHEMA: Final = (
    "stream STRING, offset LONG, chunk_timestamp TIMESTAMP, publisher STRING,"
    " message_id STRING, route STRING, address STRING, sender STRING,"
    " recipients ARRAY<STRING>, timestamp TIMESTAMP, headers MAP<STRING, STRING>,"
    " body BINARY, size INT"
)
"""The rows of ``kind = messages``."""

OUTCOME_SCHEMA: Final = (
    "stream STRING, offset LONG, chunk_timestamp TIMESTAMP, kind STRING, route STRING,"
    " source STRING, message_id STRING, address STRING, sender STRING,"
    " recipients ARRAY<STRING>, bytes LONG, arrived TIMESTAMP, status STRING,"
    " code STRING, reason STRING, finished TIMESTAMP, latency_ms DOUBLE,"
    " log_stream STRING, first_offset LONG, last_offset LONG,"
    " exceptions ARRAY<STRUCT<offset: LONG, kind: STRING, status: STRING, code: STRING,"
    " reason: STRING, finished: TIMESTAMP, attempts: INT>>"
)
"""The rows of ``kind = outcomes``."""

_KINDS: Final = frozenset({"messages", "outcomes"})
_DEFAULT_BATCH_ROWS: Final = 8192
_TIMESTAMP: Final = pa.timestamp("us", tz="UTC")
_STRINGS: Final = pa.list_(pa.string())
_HEADERS: Final = pa.map_(pa.string(), pa.string())


def register(spark: Any) -> None:
    """Register the data source with a Spark session (idempotent)."""
    spark.dataSource.register(LogDataSource)


class LogDataSource(DataSource):
    """``spark.read.format("msggateway")``: see the module documentation."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return NAME

    def schema(self) -> str:
        """The schema of the chosen kind."""
        return OUTCOME_SCHEMA if _kind(self.options) == "outcomes" else MESSAGE_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader for this load's options."""
        return LogReader(dict(self.options))


class SlicePartition(InputPartition):
    """One slice of a segment."""

    def __init__(self, piece: Slice) -> None:
        super().__init__(piece)
        self.piece = piece


class LogReader(DataSourceReader):
    """Plans slices from the options; reads them as Arrow batches."""

    def __init__(self, options: dict[str, str]) -> None:
        self.root = options.get("path", "")
        if not self.root:
            raise ValueError("msggateway data source: give the log directory: .load(PATH)")
        self.kind = _kind(options)
        streams = options.get("streams")
        self.streams: list[str] | None = (
            [s.strip() for s in streams.split(",") if s.strip()] if streams else None
        )
        self.offsets = Range(
            _int_option(options, "start_offset"), _int_option(options, "end_offset")
        )
        self.timestamps = Range(
            _time_option(options, "start_time"), _time_option(options, "end_time")
        )
        self.max_slice_bytes = _int_option(options, "max_slice_bytes") or DEFAULT_SLICE_BYTES
        self.batch_rows = _int_option(options, "batch_rows") or _DEFAULT_BATCH_ROWS

    def partitions(self) -> Sequence[InputPartition]:
        """One partition per slice that can hold rows."""
        streams = self.streams
        if streams is None:
            names = list_streams(self.root)
            if self.kind == "outcomes":
                streams = [OUTCOME_STREAM] if OUTCOME_STREAM in names else []
            else:
                streams = [name for name in names if name != OUTCOME_STREAM]
        slices = plan_slices(
            self.root,
            streams=streams,
            offsets=self.offsets,
            timestamps=self.timestamps,
            max_slice_bytes=self.max_slice_bytes,
        )
        # Spark wants at least one partition; an empty one reads nothing.
        return [SlicePartition(piece) for piece in slices] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one slice, as Arrow record batches."""
        piece = getattr(partition, "piece", None)
        if piece is None:
            return
        rows = _OutcomeRows() if self.kind == "outcomes" else _MessageRows(piece.stream)
        for chunk in read_slice(piece):
            if chunk.header.timestamp not in self.timestamps:
                continue
            rows.add(chunk, piece.stream, self.offsets)
            if rows.count >= self.batch_rows:
                yield rows.batch()
        if rows.count:
            yield rows.batch()


def _kind(options: Any) -> str:
    kind = str(options.get("kind", "messages")).lower()
    if kind not in _KINDS:
        raise ValueError(f"msggateway data source: kind is messages or outcomes, not {kind!r}")
    return kind


def _int_option(options: dict[str, str], key: str) -> int | None:
    value = options.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"msggateway data source: {key} is a whole number, not {value!r}"
        ) from None


def _time_option(options: dict[str, str], key: str) -> int | None:
    value = options.get(key)
    if value is None or value == "":
        return None
    if value.lstrip("-").isdigit():
        return int(value)
    try:
        return _milliseconds(datetime.datetime.fromisoformat(value))
    except ValueError:
        raise ValueError(
            f"msggateway data source: {key} is ISO 8601 or milliseconds, not {value!r}"
        ) from None


def _milliseconds(value: Any) -> int:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return int(value.timestamp() * 1000)
    return int(value)


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _MessageRows:
    """Columns of message rows, turned into a record batch when full."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.route = (
            stream[len(ROUTE_STREAM_PREFIX) :] if stream.startswith(ROUTE_STREAM_PREFIX) else None
        )
        self.from_to = self.route is not None
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.offsets: list[int] = []
        self.chunk_times: list[int] = []
        self.publishers: list[str | None] = []
        self.ids: list[str] = []
        self.addresses: list[str] = []
        self.senders: list[str | None] = []
        self.recipients: list[list[str]] = []
        self.times: list[int] = []
        self.headers: list[list[tuple[str, str]]] = []
        self.bodies: list[bytes] = []

    def add(self, chunk: ChunkRecords, stream: str, offsets: Range) -> None:
        header = chunk.header
        seconds = header.timestamp / 1000
        chunk_time = header.timestamp * 1000
        publisher = chunk.publishers[0] if len(chunk.publishers) == 1 else None
        for offset, entry in enumerate(chunk.records, header.first_offset):
            if offset not in offsets:
                continue
            message = message_from_entry(
                entry, stream=stream, timestamp=seconds, offset=offset, address_from_to=self.from_to
            )
            self.offsets.append(offset)
            self.chunk_times.append(chunk_time)
            self.publishers.append(publisher)
            self.ids.append(message.id)
            self.addresses.append(message.address)
            self.senders.append(message.sender)
            self.recipients.append(list(message.recipients))
            self.times.append(_micros(message.timestamp))
            self.headers.append([(key, _text(value)) for key, value in message.headers.items()])
            self.bodies.append(message.body)
            self.count += 1

    def batch(self) -> pa.RecordBatch:
        count = self.count
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array([self.stream] * count, pa.string()),
                pa.array(self.offsets, pa.int64()),
                pa.array(self.chunk_times, _TIMESTAMP),
                pa.array(self.publishers, pa.string()),
                pa.array(self.ids, pa.string()),
                pa.array([self.route] * count, pa.string()),
                pa.array(self.addresses, pa.string()),
                pa.array(self.senders, pa.string()),
                pa.array(self.recipients, _STRINGS),
                pa.array(self.times, _TIMESTAMP),
                pa.array(self.headers, _HEADERS),
                pa.array(self.bodies, pa.binary()),
                pa.array([len(b) for b in self.bodies], pa.int32()),
            ],
            names=[
                "stream",
                "offset",
                "chunk_timestamp",
                "publisher",
                "message_id",
                "route",
                "address",
                "sender",
                "recipients",
                "timestamp",
                "headers",
                "body",
                "size",
            ],
        )
        self._reset()
        return batch


_OUTCOME_COLUMNS: Final = (
    ("stream", pa.string()),
    ("offset", pa.int64()),
    ("chunk_timestamp", _TIMESTAMP),
    ("kind", pa.string()),
    ("route", pa.string()),
    ("source", pa.string()),
    ("message_id", pa.string()),
    ("address", pa.string()),
    ("sender", pa.string()),
    ("recipients", _STRINGS),
    ("bytes", pa.int64()),
    ("arrived", _TIMESTAMP),
    ("status", pa.string()),
    ("code", pa.string()),
    ("reason", pa.string()),
    ("finished", _TIMESTAMP),
    ("latency_ms", pa.float64()),
    ("log_stream", pa.string()),
    ("first_offset", pa.int64()),
    ("last_offset", pa.int64()),
    (
        "exceptions",
        pa.list_(
            pa.struct(
                [
                    ("offset", pa.int64()),
                    ("kind", pa.string()),
                    ("status", pa.string()),
                    ("code", pa.string()),
                    ("reason", pa.string()),
                    ("finished", _TIMESTAMP),
                    ("attempts", pa.int32()),
                ]
            )
        ),
    ),
)


class _OutcomeRows:
    """Columns of outcome rows; a record that does not decode is skipped."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.columns: list[list[Any]] = [[] for _ in _OUTCOME_COLUMNS]

    def add(self, chunk: ChunkRecords, stream: str, offsets: Range) -> None:
        header = chunk.header
        chunk_time = header.timestamp * 1000
        columns = self.columns
        for offset, entry in enumerate(chunk.records, header.first_offset):
            if offset not in offsets:
                continue
            try:
                records = decode_records(entry)
            except ValueError:
                continue
            for r in records:
                self._add(columns, stream, offset, chunk_time, r)

    def _add(
        self, columns: list[list[Any]], stream: str, offset: int, chunk_time: int, r: dict[str, Any]
    ) -> None:
        row = (
            stream,
            offset,
            chunk_time,
            r["kind"],
            r["route"],
            r["source"],
            r["id"],
            r["address"],
            r["sender"],
            r["recipients"],
            r["bytes"],
            _micros(r["arrived"]),
            r["status"],
            r["code"],
            r["reason"],
            _micros(r["finished"]),
            (r["finished"] - r["arrived"]) * 1000.0,
            r["stream"],
            r["first"],
            r["last"],
            [
                {**exception, "finished": _micros(exception["finished"])}
                for exception in r["exceptions"]
            ],
        )
        for column, value in zip(columns, row, strict=True):
            column.append(value)
        self.count += 1

    def batch(self) -> pa.RecordBatch:
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(values, kind)
                for values, (_, kind) in zip(self.columns, _OUTCOME_COLUMNS, strict=True)
            ],
            names=[name for name, _ in _OUTCOME_COLUMNS],
        )
        self._reset()
        return batch
