"""The PySpark data source ``msggateway``: the embedded log as a DataFrame.

Register it once per session with ``spark.dataSource.register(LogDataSource)``
(`register` does it), then::

    spark.read.format("msggateway").load("/var/lib/msggateway/log")
    spark.read.format("msggateway").option("kind", "outcomes").load(path)
    spark.readStream.format("msggateway").load(path)      # gateway.spark.streaming

Two kinds of rows (`MESSAGE_SCHEMA`, `OUTCOME_SCHEMA`):

* ``messages`` (the default): one row per message of every stream but the
  outcome stream (or of the streams named by the ``streams`` option, comma
  separated): stream, offset, chunk timestamp, publisher (the one publisher
  reference in the chunk's trailer; null when the chunk holds messages of
  none or of several), message id, route (for a durable route's stream),
  address, sender, recipients, timestamp, headers (a string map), body and
  its size. Entries read as the stream listener's own mapping
  (`gateway.protocols.stream.mapping`) reads them, so a message reads the
  same here as through a stream consumer; `gateway.spark.columnar` decodes
  them a block of chunks at a time into Arrow columns.
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
and bound the rows exactly. Rows come as Arrow record batches of about
``batch_rows`` rows (whole chunks).

Columns: a scan decodes only the columns of its schema. PySpark 4.3 does
not tell a Python data source which columns a query uses (its scan builder
has no ``pruneColumns``), so a query says so itself, either with the
``columns`` option (``.option("columns", "stream,offset,sender")``: the
DataFrame has those columns, in that order) or with a schema of some of
the kind's columns (``.schema("stream STRING, offset LONG")``). Without
``body`` and ``headers`` the entries' bodies are never copied and their
headers never turned into strings.

Filters: Spark ``where`` clauses are applied by Spark to the rows read, not
pushed into the scan. PySpark 4.3's JVM side keeps what a Python reader's
``pushFilters`` planned (partitions and read function) on the provider
that every scan of one DataFrame shares, not on the scan: a later query of
the same DataFrame without filters reuses the narrowed partitions, and two
scans of one DataFrame in one query (a union, a self-join) both read the
partitions of whichever was planned last, even when each reader keeps its
own filters (``tests/spark/test_source.py`` shows both with a probe source).
No reader-side state can undo that, so the options are the way to narrow a
scan here.

A live log is read safely: only chunks the index listed at planning, each
checked by its CRC; a torn tail ends a slice without an error.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from gateway.core.outcomes import OUTCOME_STREAM, decode_records
from gateway.spark.columnar import MESSAGE_COLUMNS, message_batch, reference_batch
from gateway.spark.logfiles import (
    DEFAULT_SLICE_BYTES,
    ChunkRecords,
    Range,
    SegmentGoneError,
    Slice,
    list_streams,
    plan_slices,
    read_blocks,
    read_slice,
)
from gateway.spark.sink import LogSinkMixin

__all__ = [
    "MESSAGE_SCHEMA",
    "NAME",
    "OUTCOME_SCHEMA",
    "LogDataSource",
    "LogReader",
    "ReadOptions",
    "SlicePartition",
    "read_piece",
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
_DECODERS: Final = frozenset({"columnar", "rows"})
_DEFAULT_BATCH_ROWS: Final = 32768  # fewer, larger Arrow batches cross to the JVM faster
_TIMESTAMP: Final = pa.timestamp("us", tz="UTC")
_STRINGS: Final = pa.list_(pa.string())


def register(spark: Any) -> None:
    """Register the data source with a Spark session (idempotent)."""
    spark.dataSource.register(LogDataSource)


class LogDataSource(LogSinkMixin, DataSource):
    """``spark.read.format("msggateway")``: see the module documentation.

    Also ``spark.readStream`` (`gateway.spark.streaming`) and, through
    `LogSinkMixin`, ``df.write`` and ``df.writeStream`` (`gateway.spark.sink`).
    """

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return NAME

    def schema(self) -> str:
        """The schema of the chosen kind, or of its ``columns``."""
        kind = _kind(self.options)
        wanted = _column_option(self.options)
        if wanted is None:
            return OUTCOME_SCHEMA if kind == "outcomes" else MESSAGE_SCHEMA
        types = _COLUMN_TYPES[kind]
        unknown = [name for name in wanted if name not in types]
        if unknown:
            raise ValueError(
                f"msggateway data source: no column {unknown[0]!r} in {kind} rows;"
                f" columns: {', '.join(types)}"
            )
        return ", ".join(f"`{name}` {types[name]}" for name in wanted)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader for this load's options and schema."""
        return LogReader(dict(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802
        """A stream reader (`gateway.spark.streaming`) for these options."""
        from gateway.spark.streaming import LogStreamReader

        return LogStreamReader(dict(self.options), schema)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """A load's options, checked.

    Attributes:
        root: The log directory.
        kind: ``messages`` or ``outcomes``.
        streams: The streams named by ``streams``, or None for all.
        offsets: ``start_offset`` and ``end_offset``.
        timestamps: ``start_time`` and ``end_time`` (ms).
        max_slice_bytes: Most bytes of chunks in one partition.
        batch_rows: Rows per Arrow batch, about (whole chunks).
        columns: The columns to produce, in order.
        decode: ``columnar``, or ``rows`` (every entry through the mapping:
            the row-by-row path, for comparison).
    """

    root: str
    kind: str
    streams: list[str] | None
    offsets: Range
    timestamps: Range
    max_slice_bytes: int
    batch_rows: int
    columns: tuple[str, ...]
    decode: str

    @classmethod
    def parse(cls, options: dict[str, str], schema: StructType | None = None) -> ReadOptions:
        """Check the options (and a schema, if given).

        Raises:
            ValueError: An option or column that is not what it should be.
        """
        root = options.get("path", "")
        if not root:
            raise ValueError("msggateway data source: give the log directory: .load(PATH)")
        kind = _kind(options)
        streams = options.get("streams")
        decode = str(options.get("decode", "columnar")).lower()
        if decode not in _DECODERS:
            raise ValueError(f"msggateway data source: decode is columnar or rows, not {decode!r}")
        return cls(
            root=root,
            kind=kind,
            streams=[s.strip() for s in streams.split(",") if s.strip()] if streams else None,
            offsets=Range(_int_option(options, "start_offset"), _int_option(options, "end_offset")),
            timestamps=Range(
                _time_option(options, "start_time"), _time_option(options, "end_time")
            ),
            max_slice_bytes=_int_option(options, "max_slice_bytes") or DEFAULT_SLICE_BYTES,
            batch_rows=_int_option(options, "batch_rows") or _DEFAULT_BATCH_ROWS,
            columns=_columns(kind, schema, options),
            decode=decode,
        )

    def stream_names(self) -> list[str]:
        """The streams to read: those named, or all of the kind's."""
        if self.streams is not None:
            return self.streams
        names = list_streams(self.root)
        if self.kind == "outcomes":
            return [OUTCOME_STREAM] if OUTCOME_STREAM in names else []
        return [name for name in names if name != OUTCOME_STREAM]


class SlicePartition(InputPartition):
    """One slice of a segment, with the offsets to read from it."""

    def __init__(self, piece: Slice, offsets: Range | None = None) -> None:
        super().__init__(piece)
        self.piece = piece
        self.offsets = offsets


class LogReader(DataSourceReader):
    """Plans slices from the options; reads them as Arrow batches."""

    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.settings = ReadOptions.parse(options, schema)

    def partitions(self) -> Sequence[InputPartition]:
        """One partition per slice that can hold rows."""
        settings = self.settings
        slices = plan_slices(
            settings.root,
            streams=settings.stream_names(),
            offsets=settings.offsets,
            timestamps=settings.timestamps,
            max_slice_bytes=settings.max_slice_bytes,
        )
        # Spark wants at least one partition; an empty one reads nothing.
        return [SlicePartition(piece) for piece in slices] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one slice, as Arrow record batches."""
        piece = getattr(partition, "piece", None)
        if piece is None:
            return
        offsets = getattr(partition, "offsets", None) or self.settings.offsets
        yield from read_piece(self.settings, piece, offsets)


def read_piece(
    settings: ReadOptions, piece: Slice, offsets: Range, *, missing_ok: bool = True
) -> Iterator[pa.RecordBatch]:
    """The rows of one slice with offsets in ``offsets``, as Arrow record batches.

    Raises:
        SegmentGoneError: The slice's segment is gone and not ``missing_ok``.
        LogReadError: The segment is damaged.
    """
    columns = settings.columns
    if settings.kind == "outcomes":
        if not missing_ok and not os.path.exists(piece.segment):
            raise SegmentGoneError(f"{piece.segment}: deleted before it was read (retention)")
        yield from _outcome_batches(settings, piece, offsets)
        return
    batch = reference_batch if settings.decode == "rows" else message_batch
    for block in read_blocks(
        piece,
        offsets=offsets,
        timestamps=settings.timestamps,
        max_records=settings.batch_rows,
        missing_ok=missing_ok,
    ):
        if block.count:
            yield batch(block, piece.stream, columns)


def _outcome_batches(
    settings: ReadOptions, piece: Slice, offsets: Range
) -> Iterator[pa.RecordBatch]:
    rows = _OutcomeRows()
    for chunk in read_slice(piece):
        if chunk.header.timestamp not in settings.timestamps:
            continue
        rows.add(chunk, piece.stream, offsets)
        if rows.count >= settings.batch_rows:
            yield rows.batch().select(list(settings.columns))
    if rows.count:
        yield rows.batch().select(list(settings.columns))


def _column_option(options: Any) -> list[str] | None:
    value = options.get("columns")
    if value is None or not str(value).strip():
        return None
    return [name.strip() for name in str(value).split(",") if name.strip()]


def _columns(kind: str, schema: StructType | None, options: Any) -> tuple[str, ...]:
    """The columns a scan produces: its schema's (checked against the kind's), else all."""
    types = _COLUMN_TYPES[kind]
    if schema is None:
        wanted = _column_option(options)
        return tuple(types) if wanted is None else tuple(wanted)
    for field in schema.fields:
        expected = types.get(field.name)
        if expected is None:
            raise ValueError(
                f"msggateway data source: no column {field.name!r} in {kind} rows;"
                f" columns: {', '.join(types)}"
            )
        if field.dataType.simpleString() != expected:
            raise ValueError(
                f"msggateway data source: column {field.name!r} is {expected},"
                f" not {field.dataType.simpleString()}"
            )
    return tuple(schema.fieldNames())


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


def _simple(kind: pa.DataType) -> str:
    """Spark's simple string of the type Spark hands over as ``kind``."""
    if pa.types.is_timestamp(kind):
        return "timestamp"
    if pa.types.is_map(kind):
        return f"map<{_simple(kind.key_type)},{_simple(kind.item_type)}>"
    if pa.types.is_list(kind):
        return f"array<{_simple(kind.value_type)}>"
    if pa.types.is_struct(kind):
        fields = ",".join(f"{f.name}:{_simple(f.type)}" for f in kind)
        return f"struct<{fields}>"
    return {
        pa.string(): "string",
        pa.int64(): "bigint",
        pa.int32(): "int",
        pa.float64(): "double",
        pa.binary(): "binary",
    }[kind]


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


_COLUMN_TYPES: Final = {
    "messages": {name: _simple(kind) for name, kind in MESSAGE_COLUMNS},
    "outcomes": {name: _simple(kind) for name, kind in _OUTCOME_COLUMNS},
}
"""Each kind's columns and Spark's simple string (also DDL) of their types."""


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
