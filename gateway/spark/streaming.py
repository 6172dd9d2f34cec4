"""Structured Streaming over the log: ``spark.readStream.format("msggateway").load(LOG)``.

The same options and schema as the batch reader (`gateway.spark.source`:
``kind``, ``streams``, ``columns``, ``batch_rows``, ...), and three of its own:

``starting_offsets``
    Where a new query starts: ``earliest`` (the default: every message
    still kept), ``latest`` (only what comes after), or JSON naming a
    stream's next offset, ``{"orders": 1200}`` (other streams: earliest).
    A query restarted from its checkpoint continues where it stopped
    instead.
``max_records_per_trigger``
    At most this many offsets per micro-batch, over all streams (offsets
    count tracking chunks too, so a batch can hold a few rows less).
    ``Trigger.AvailableNow`` reads everything in batches of this size.
``fail_on_data_loss``
    ``true`` (the default): a micro-batch that wants offsets retention has
    deleted fails, naming the stream, the first offset wanted and the first
    one still kept. ``false``: it reads from the first kept one on, and
    logs a warning saying the same.

Offsets are the log's own, per stream, as JSON: ``{"stream": next_offset,
...}``; each micro-batch reads ``[start, end)`` of each stream exactly
(whole chunks are planned, rows outside are dropped), so a query restarted
from its checkpoint reads no row twice and misses none, across segment
rolls. ``latestOffset`` follows the log as the gateway writes it: each
stream's next offset is the one after the last chunk its index lists
(`gateway.spark.logfiles.stream_bounds`). Streams that appear later are
read from their first offset. The log is never changed: ``commit`` has
nothing to do.

`copy_to_parquet` runs such a query into a Parquet directory, and
``python -m gateway.spark.streaming LOG OUT --checkpoint DIR`` runs it from
the command line (``--available-now`` to stop when caught up; otherwise
``--seconds`` bounds it), printing one JSON line of what it did.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any, Final

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from gateway.spark.logfiles import Range, SegmentGoneError, list_streams, plan_slices, stream_bounds
from gateway.spark.source import ReadOptions, SlicePartition, read_piece

__all__ = ["DataLossError", "LogStreamReader", "copy_to_parquet", "main"]

_log = logging.getLogger(__name__)

_STARTS: Final = ("earliest", "latest")


class DataLossError(Exception):
    """Offsets a micro-batch wants are gone (retention), and ``fail_on_data_loss`` is on."""


class LogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of the log's streams, by their offsets (see the module documentation)."""

    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.settings = ReadOptions.parse(options, schema)
        self.starting = str(options.get("starting_offsets", "earliest")).strip()
        self.fail_on_data_loss = _flag(options, "fail_on_data_loss", True)
        limit = options.get("max_records_per_trigger")
        self.max_records = int(limit) if limit else None
        if self.max_records is not None and self.max_records < 1:
            raise ValueError("msggateway stream: max_records_per_trigger is at least 1")
        if self.starting.lower() not in _STARTS and not self.starting.startswith("{"):
            raise ValueError(
                "msggateway stream: starting_offsets is earliest, latest or JSON"
                f' like {{"stream": 0}}, not {self.starting!r}'
            )
        self.target: dict[str, int] | None = None

    # --- offsets ------------------------------------------------------------------

    def _bounds(self) -> dict[str, tuple[int, int]]:
        """(first kept, next) offsets of the streams this query reads, now."""
        directories = list_streams(self.settings.root)
        return {
            name: (bounds.first, bounds.next)
            for name in self.settings.stream_names()
            if name in directories
            for bounds in (stream_bounds(directories[name]),)
        }

    def initialOffset(self) -> dict[str, int]:  # noqa: N802
        """Where a new query starts (``starting_offsets``)."""
        bounds = self._bounds()
        choice = self.starting.lower()
        if choice == "earliest":
            return {name: first for name, (first, _next) in bounds.items()}
        if choice == "latest":
            return {name: following for name, (_first, following) in bounds.items()}
        try:
            given = json.loads(self.starting)
            if not isinstance(given, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in given.values()
            ):
                raise ValueError("not an object of whole numbers")
        except ValueError as exc:
            raise ValueError(
                f"msggateway stream: starting_offsets {self.starting!r} is not JSON"
                f' like {{"stream": 0}}: {exc}'
            ) from None
        start = {name: first for name, (first, _next) in bounds.items()}
        start.update({str(name): int(offset) for name, offset in given.items()})
        return start

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802
        """Each stream's next offset now (at most the AvailableNow target), within ``limit``."""
        bounds = self._bounds()
        end = dict(start)
        for name, (first, following) in bounds.items():
            if self.target is not None:
                if name not in self.target:
                    continue
                following = min(following, self.target[name])
            end[name] = max(following, start.get(name, first))
        if isinstance(limit, ReadMaxRows):
            budget = limit.max_rows
            for name in sorted(end):
                begin = start.get(name, bounds.get(name, (0, 0))[0])
                taken = max(min(end[name] - begin, budget), 0)
                end[name] = max(begin + taken, start.get(name, begin))
                budget -= taken
        return end

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802
        """``max_records_per_trigger`` as a read limit, if given."""
        if self.max_records is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records)

    def reportLatestOffset(self) -> dict[str, int]:  # noqa: N802
        """The streams' next offsets, for the query's progress reports."""
        return {name: following for name, (_first, following) in self._bounds().items()}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        """Fix the offsets an AvailableNow query reads up to: the streams' next ones now."""
        self.target = self.reportLatestOffset()

    # --- reading ------------------------------------------------------------------

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        """The slices holding ``[start, end)`` of each stream.

        Raises:
            DataLossError: Retention deleted offsets of the range, and
                ``fail_on_data_loss`` is on.
        """
        settings = self.settings
        directories = list_streams(settings.root)
        partitions: list[InputPartition] = []
        for name, stop in sorted(end.items()):
            if name not in directories:
                continue  # deleted: nothing left to read
            first = stream_bounds(directories[name]).first
            begin = start.get(name, first)  # a stream new since start: from its beginning
            if begin >= stop:
                continue
            if first > begin:
                self._lost(name, begin, first)
                begin = first
                if begin >= stop:
                    continue
            offsets = Range(begin, stop)
            for piece in plan_slices(
                settings.root,
                streams=[name],
                offsets=offsets,
                timestamps=settings.timestamps,
                max_slice_bytes=settings.max_slice_bytes,
            ):
                partitions.append(SlicePartition(piece, offsets))
        return partitions

    def _lost(self, stream: str, wanted: int, first: int) -> None:
        message = (
            f"msggateway stream {stream!r}: offsets {wanted} to {first - 1} are gone"
            f" (retention deleted them); the first offset still kept is {first}"
        )
        if self.fail_on_data_loss:
            raise DataLossError(
                message + ". Start a new query (another checkpoint), or set"
                " fail_on_data_loss to false to read on from there."
            )
        _log.warning("%s: reading on from %s (fail_on_data_loss is false)", message, first)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one slice within the micro-batch's offsets.

        Raises:
            DataLossError: The slice's segment was deleted since planning,
                and ``fail_on_data_loss`` is on.
        """
        piece = partition.piece  # type: ignore[attr-defined]
        offsets: Range = partition.offsets  # type: ignore[attr-defined]
        try:
            yield from read_piece(self.settings, piece, offsets, missing_ok=False)
        except SegmentGoneError as exc:
            begin = max(offsets.low or 0, piece.first_offset)
            message = f"msggateway stream {piece.stream!r}: offsets from {begin} are gone: {exc}"
            if self.fail_on_data_loss:
                raise DataLossError(message) from None
            _log.warning("%s (fail_on_data_loss is false: skipped)", message)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the log is the gateway's, and a reader never changes it."""


def _flag(options: dict[str, str], key: str, default: bool) -> bool:
    value = options.get(key)
    if value is None or value == "":
        return default
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"msggateway stream: {key} is true or false, not {value!r}")


def copy_to_parquet(
    spark: Any,
    log: str,
    out: str,
    checkpoint: str,
    *,
    options: dict[str, str] | None = None,
    available_now: bool = True,
    trigger_seconds: float = 1.0,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Copy the log's messages into Parquet under ``out`` with a streaming query.

    Args:
        spark: A session with the data source registered.
        log: The log directory.
        out: The Parquet directory (the file sink's, with its ``_spark_metadata``).
        checkpoint: The query's checkpoint: a rerun continues from it.
        options: Reader options (module documentation, `gateway.spark.source`).
        available_now: Stop once caught up (Trigger.AvailableNow); else run
            micro-batches every ``trigger_seconds`` for ``seconds``.
        trigger_seconds: The processing-time trigger's interval.
        seconds: How long a query that is not ``available_now`` runs.

    Returns:
        ``batches`` (micro-batches that read rows), ``rows`` and ``offsets``
        (the end offsets of the last batch).

    Raises:
        pyspark.errors.StreamingQueryException: The query failed (a
            `DataLossError` among others).
    """
    reader = spark.readStream.format("msggateway")
    for key, value in (options or {}).items():
        reader = reader.option(key, value)
    writer = (
        reader.load(log)
        .writeStream.format("parquet")
        .option("path", out)
        .option("checkpointLocation", checkpoint)
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{trigger_seconds} seconds")
    query = writer.start()
    try:
        if available_now:
            query.awaitTermination()  # until caught up, or failed (raises)
        else:
            query.awaitTermination(seconds)
    finally:
        query.stop()
    batches = {p["batchId"]: p for p in query.recentProgress if p["numInputRows"]}
    last = batches[max(batches)] if batches else None
    return {
        "batches": len(batches),
        "rows": sum(p["numInputRows"] for p in batches.values()),
        "offsets": json.loads(last["sources"][0]["endOffset"]) if last else None,
    }


def main(argv: Sequence[str] | None = None, out: IO[str] = sys.stdout) -> int:
    """``python -m gateway.spark.streaming LOG OUT --checkpoint DIR [...]``: see the module docs."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.spark.streaming",
        description="Copy the log's messages into Parquet with a Spark streaming query.",
    )
    parser.add_argument("log", help="the gateway's log directory (data_dir/log)")
    parser.add_argument("out", help="the Parquet directory")
    parser.add_argument("--checkpoint", required=True, help="the query's checkpoint directory")
    parser.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    parser.add_argument("--streams", help="only these streams (comma separated)")
    parser.add_argument("--columns", help="only these columns (comma separated)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--available-now", action="store_true", help="stop once caught up")
    parser.add_argument("--trigger-seconds", type=float, default=1.0)
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="run this long (no --available-now)"
    )
    args = parser.parse_args(argv)
    from gateway.spark.jobs import spark_session

    options = dict(item.split("=", 1) for item in args.option)
    for key in ("streams", "columns"):
        if getattr(args, key):
            options[key] = getattr(args, key)
    spark = spark_session(args.master, app="msggateway stream to parquet")
    try:
        summary = copy_to_parquet(
            spark,
            args.log,
            args.out,
            args.checkpoint,
            options=options,
            available_now=args.available_now,
            trigger_seconds=args.trigger_seconds,
            seconds=args.seconds,
        )
    finally:
        spark.stop()
    out.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
