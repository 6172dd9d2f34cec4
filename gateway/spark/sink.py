r"""The sink of the data source ``msggateway``: DataFrame rows published into a stream.

::

    df.write.format("msggateway").mode("append")
        .option("endpoint", "tcp:host=127.0.0.1:port=5552").option("stream", "events")
        .option("producer", "nightly-import").save()
    df.writeStream.format("msggateway").option(...)
        .option("checkpointLocation", path).start()

Each partition publishes over one connection of the RabbitMQ stream protocol
(`gateway.protocols.stream.blocking`: the gateway's codec on a blocking
socket, as no reactor runs in an executor) to a gateway's stream listener or
to RabbitMQ 3.10+, which confirms what it stored.

Rows: ``body`` (binary or string; ``value`` is taken when there is no
``body``), and optionally ``headers`` or ``properties`` (a map; both when
both are there), ``message_id`` (or ``id``), ``sender``, ``recipients``
(array of strings) and ``timestamp`` (a timestamp, or seconds). They become
the AMQP 1.0 entry the gateway writes for a message
(`gateway.protocols.stream.mapping.entry_from_message`): the maps are the
application properties, so the reader's rows (``spark.read.format
("msggateway")``) can be written back as they are. A row without an id gets
``<producer>-<partition>:<position>`` (or the write's run id for the
producer), so that the same row keeps the same id.

Options: ``endpoint`` (``tcp:host=H:port=P`` or ``tls:host=H:port=P`` with
``trustRoots`` (a directory of PEM files, as Twisted reads it, or one PEM
file), ``certificate`` and ``privateKey``: the keys of Twisted's
`clientFromString`, ``\\`` escaping), ``stream``, ``username`` and
``password`` (``guest``), ``virtual_host`` (``/``), ``producer``,
``create_stream`` (``true``: a stream that exists is fine, a refusal is
left to the publisher's declaration to report), ``batch_size`` (1000 rows
per Publish frame, within the negotiated frame max), ``max_unconfirmed``
(20,000), ``timeout`` (60 seconds without progress) and ``outcomes``.

Deduplication: with ``producer`` a partition publishes as
``<producer>-<partition>`` with its rows' positions (from 1) as publishing
ids (in a micro-batch of ``writeStream``, ``batch << 32`` plus the position),
and first asks the server for that publisher's last stored id: rows up to it
are not sent again (``stored-before``). A task that Spark retries, and a
job run again over the same input partitioned the same way, store every row
once; the server deduplicates what is sent twice anyway. Without a producer
nothing is deduplicated. A producer name belongs to one dataset (and, for a
stream query, to one checkpoint): a new dataset under an old name is taken
for rows already stored. The server keeps only the highest id: a row it
refused cannot be sent again under the same name once later rows are stored.

Outcomes, per row, as ``msggateway spark send`` keeps them: with ``outcomes``
(a directory) each partition appends JSON lines (partition, position,
publishing id, message id, status, code, reason, time, run, batch) to
``RUN-part-NNNNN.jsonl`` there (``RUN-batch-B-part-NNNNN.jsonl`` for a stream
query) as confirms arrive. Statuses: ``accepted``, ``stored-before``,
``rejected`` (PublishError 2, 16, 17; a publisher the server refused),
``retry`` (the other codes), ``too-large`` (an entry over the frame max) and
``error`` (the connection failed or was lost: the task then fails, and a
retry by Spark skips what was stored). The write (or the micro-batch)
fails once every task has finished if any row was not stored, saying how
many, why, and where the outcomes are.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from gateway.codecs import stream as sp
from gateway.core.message import HeaderValue, Message
from gateway.protocols.stream.blocking import (
    ENTRY_OVERHEAD_BYTES,
    PUBLISH_OVERHEAD_BYTES,
    REJECTING_CODES,
    BlockingStreamClient,
    Endpoint,
    connect,
    parse_endpoint,
)
from gateway.protocols.stream.mapping import entry_from_message

__all__ = ["LogSinkMixin", "SinkCommitMessage", "SinkSettings", "sink_settings"]

DEFAULT_BATCH_SIZE: Final = 1000
DEFAULT_MAX_UNCONFIRMED: Final = 20_000
DEFAULT_TIMEOUT_SECONDS: Final = 60.0
CLOSE_TIMEOUT_SECONDS: Final = 5.0
"""At most this long (and at most ``timeout``) for the server's answer to our Close."""
MAX_POSITION: Final = 2**32 - 1
"""Rows per partition and micro-batch: the low half of a stream query's publishing ids."""
_NOT_STORED: Final = ("rejected", "retry", "too-large", "error")
_EXAMPLES: Final = 5
_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


# --- options ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SinkSettings:
    """The sink's options, checked on the driver; pickled to the executors."""

    endpoint: Endpoint
    stream: str
    columns: Mapping[str, str]
    """Row field to column: ``body``, ``id``, ``headers``, ``properties``, ``sender``..."""
    username: str = "guest"
    password: str = "guest"
    virtual_host: str = "/"
    producer: str | None = None
    create_stream: bool = True
    batch_size: int = DEFAULT_BATCH_SIZE
    max_unconfirmed: int = DEFAULT_MAX_UNCONFIRMED
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    outcomes: str | None = None
    run: str = ""


def _positive(options: Mapping[str, str], key: str, default: float) -> float:
    value = options.get(key)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1
    if number <= 0:
        raise ValueError(f"msggateway sink: {key} is a positive number, not {value!r}")
    return number


def _flag(options: Mapping[str, str], key: str, default: bool) -> bool:
    value = str(options.get(key, "")).strip().lower()
    if not value:
        return default
    if value not in _TRUE | _FALSE:
        raise ValueError(f"msggateway sink: {key} is true or false, not {value!r}")
    return value in _TRUE


def _columns(schema: StructType) -> dict[str, str]:
    """Which column holds what; raises ValueError for a missing body or a wrong type."""
    types: dict[str, DataType] = {field.name.lower(): field.dataType for field in schema.fields}
    names = {field.name.lower(): field.name for field in schema.fields}
    found: dict[str, str] = {}

    def take(role: str, candidates: Iterable[str], allowed: tuple[type[DataType], ...]) -> None:
        for candidate in candidates:
            if candidate in types:
                kind = types[candidate]
                if not isinstance(kind, allowed):
                    raise ValueError(
                        f"msggateway sink: column {names[candidate]} is {kind.simpleString()},"
                        f" not {' or '.join(a.typeName() for a in allowed)}"
                    )
                found[role] = names[candidate]
                return

    take("body", ("body", "value"), (BinaryType, StringType))
    if "body" not in found:
        raise ValueError("msggateway sink: the rows need a body column (binary or string)")
    take("id", ("message_id", "id"), (StringType,))
    take("headers", ("headers",), (MapType,))
    take("properties", ("properties",), (MapType,))
    take("sender", ("sender",), (StringType,))
    take("recipients", ("recipients",), (ArrayType,))
    times = (TimestampType, TimestampNTZType, DoubleType, FloatType, LongType, IntegerType)
    take("timestamp", ("timestamp",), times)
    return found


def sink_settings(options: Mapping[str, str], schema: StructType) -> SinkSettings:
    """Check the options and the rows' schema (on the driver, before any task runs).

    Raises:
        ValueError: What is missing or wrong, naming the option or column.
    """
    endpoint = options.get("endpoint")
    stream = options.get("stream")
    if not endpoint or not stream:
        raise ValueError("msggateway sink: give the options endpoint and stream")
    producer = options.get("producer") or None
    if producer is not None and len(producer.encode()) > 240:
        raise ValueError("msggateway sink: a producer name is at most 240 bytes")
    max_unconfirmed = int(_positive(options, "max_unconfirmed", DEFAULT_MAX_UNCONFIRMED))
    batch_size = int(_positive(options, "batch_size", DEFAULT_BATCH_SIZE))
    return SinkSettings(
        endpoint=parse_endpoint(endpoint),
        stream=stream,
        columns=_columns(schema),
        username=options.get("username", "guest"),
        password=options.get("password", "guest"),
        virtual_host=options.get("virtual_host", "/"),
        producer=producer,
        create_stream=_flag(options, "create_stream", True),
        batch_size=min(batch_size, max_unconfirmed),
        max_unconfirmed=max_unconfirmed,
        timeout=_positive(options, "timeout", DEFAULT_TIMEOUT_SECONDS),
        outcomes=options.get("outcomes") or None,
        run=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8],
    )


# --- one partition ----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class SinkCommitMessage(WriterCommitMessage):
    """What a task reports: its partition, rows by status, a few reasons, its outcome file."""

    partition: int
    counts: dict[str, int]
    examples: list[str]
    outcomes: str | None


class _Outcomes:
    """Counts by status; with a file, one JSON line per row (flushed per confirm frame)."""

    def __init__(self, path: Path | None, partition: int, run: str, batch: int | None) -> None:
        self.counts: dict[str, int] = {}
        self.examples: list[str] = []
        self.path = path
        self._tail = f',"run":{json.dumps(run)},"batch":{json.dumps(batch)}}}\n'
        self._head = f'{{"partition":{partition},"position":'
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def add(
        self,
        status: str,
        rows: Iterable[tuple[int, int, str]],
        code: int | None = None,
        reason: str | None = None,
    ) -> None:
        """Record ``(position, publishing id, message id)`` rows with one status."""
        count = 0
        if self._file is None:
            count = sum(1 for _ in rows)
        else:
            now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
            middle = (
                f',"status":"{status}","code":{json.dumps(code)},"reason":{json.dumps(reason)}'
                f',"time":"{now.replace("+00:00", "Z")}"'
            )
            head, tail = self._head, middle + self._tail
            lines = [
                f'{head}{position},"publishing_id":{ident},"message_id":{json.dumps(mid)}{tail}'
                for position, ident, mid in rows
            ]
            count = len(lines)
            self._file.writelines(lines)
        if count:
            self.counts[status] = self.counts.get(status, 0) + count
            if reason and len(self.examples) < _EXAMPLES and reason not in self.examples:
                self.examples.append(reason)

    def flush(self) -> None:
        """Hand the lines to the OS: a killed task keeps them."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()


def _text(value: object) -> HeaderValue:
    if isinstance(value, str | bytes | int | float | bool):
        return value
    return str(value)


def _seconds(value: object) -> float:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    return float(value) if isinstance(value, int | float) else 0.0


class _PartitionWrite:
    """One task's rows into the stream: publish within the window, settle each row once."""

    def __init__(self, settings: SinkSettings, partition: int, batch: int | None) -> None:
        self.settings = settings
        self.partition = partition
        self.base = 0 if batch is None else batch << 32
        name = f"{settings.run}-part-{partition:05d}.jsonl"
        if batch is not None:
            name = f"{settings.run}-batch-{batch}-part-{partition:05d}.jsonl"
        path = Path(settings.outcomes) / name if settings.outcomes else None
        self.outcomes = _Outcomes(path, partition, settings.run, batch)
        owner = settings.producer or settings.run
        self.reference = f"{settings.producer}-{partition}" if settings.producer else ""
        self.id_prefix = f"{owner}-{partition}:"
        self.in_flight: dict[int, str] = {}
        self.where = f"stream {settings.stream} at {settings.endpoint}"

    # -- rows

    def rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, str, Message]]:
        """``(publishing id, message id, message)`` per row, in order."""
        columns = self.settings.columns
        stream = self.settings.stream
        ident = self.base
        prefix = self.id_prefix
        for batch in batches:
            count = batch.num_rows
            if ident - self.base + count > MAX_POSITION:
                raise ValueError(f"msggateway sink: over {MAX_POSITION} rows in one partition")

            def column(role: str, count: int = count, batch: Any = batch) -> list[Any]:
                name = columns.get(role)
                return batch.column(name).to_pylist() if name else [None] * count

            bodies, ids, senders = column("body"), column("id"), column("sender")
            recipients, times = column("recipients"), column("timestamp")
            headers, properties = column("headers"), column("properties")
            for index in range(count):
                ident += 1
                body = bodies[index]
                if isinstance(body, str):
                    body = body.encode("utf-8", "surrogateescape")
                mid = ids[index] or f"{prefix}{ident - self.base}"
                fields: dict[str, HeaderValue] = {}
                for pairs in (headers[index], properties[index]):
                    if pairs:
                        fields.update((str(k), _text(v)) for k, v in pairs if v is not None)
                yield (
                    ident,
                    mid,
                    Message(
                        body=body or b"",
                        address=stream,
                        id=mid,
                        sender=senders[index],
                        recipients=tuple(r for r in recipients[index] or () if r),
                        headers=fields,
                        timestamp=_seconds(times[index]) if times[index] is not None else 0.0,
                    ),
                )

    # -- confirms

    def confirmed(self, confirm: sp.PublishConfirm) -> None:
        take, base = self.in_flight.pop, self.base
        ids = confirm.publishing_ids
        settled = [(i - base, i, take(i)) for i in ids if i in self.in_flight]
        self.outcomes.add("accepted", settled)

    def failed(self, error: sp.PublishError) -> None:
        take, base = self.in_flight.pop, self.base
        for ident, code in zip(error.publishing_ids, error.codes, strict=True):
            if ident in self.in_flight:
                status = "rejected" if code in REJECTING_CODES else "retry"
                reason = f"{self.where} refused the message (code {code})"
                self.outcomes.add(status, [(ident - base, ident, take(ident))], code, reason)

    # -- the run

    def run(self, batches: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        rows = self.rows(batches)
        first = next(rows, None)
        try:
            if first is not None:
                self._publish(first, rows)
        finally:
            self.outcomes.close()
        return SinkCommitMessage(
            partition=self.partition,
            counts=self.outcomes.counts,
            examples=self.outcomes.examples,
            outcomes=str(self.outcomes.path) if self.outcomes.path else None,
        )

    def _publish(
        self, first: tuple[int, str, Message], rows: Iterator[tuple[int, str, Message]]
    ) -> None:
        settings = self.settings
        remaining = _chain(first, rows)
        try:
            sock = connect(settings.endpoint)
        except OSError as exc:
            self._fail(remaining, f"cannot connect to {settings.endpoint}: {exc}")
        client = BlockingStreamClient(
            sock,
            timeout=settings.timeout,
            on_confirm=self.confirmed,
            on_error=self.failed,
            max_frame_bytes=sp.DEFAULT_FRAME_MAX_BYTES,
        )
        try:
            self._session(client, remaining)
        except OSError as exc:  # StreamClientError is one
            client.abandon()
            self._fail(remaining, f"{self.where}: {exc}")
        else:
            client.close(min(settings.timeout, CLOSE_TIMEOUT_SECONDS))

    def _session(
        self, client: BlockingStreamClient, rows: Iterator[tuple[int, str, Message]]
    ) -> None:
        settings = self.settings
        client.open(
            username=settings.username,
            password=settings.password,
            virtual_host=settings.virtual_host,
            properties={"product": "msggateway spark sink"},
            heartbeats=False,  # the rows come at Spark's pace: we may be silent for long
        )
        stream, reference = settings.stream, self.reference
        if settings.create_stream:
            client.request(lambda c: sp.Create(correlation_id=c, stream=stream, arguments={}))
        declared = client.request(
            lambda c: sp.DeclarePublisher(
                correlation_id=c, publisher_id=0, reference=reference, stream=stream
            )
        )
        if declared.code != sp.ResponseCode.OK:
            status = "rejected" if declared.code in REJECTING_CODES else "retry"
            reason = f"{self.where} refused the publisher (code {declared.code})"
            self.outcomes.add(
                status, ((i - self.base, i, m) for i, m, _ in rows), declared.code, reason
            )
            return
        sequence = 0
        if self.reference:
            answer = client.request(
                lambda c: sp.QueryPublisherSequence(
                    correlation_id=c, reference=reference, stream=stream
                )
            )
            sequence = answer.sequence if answer.code == sp.ResponseCode.OK else 0
        budget = client.frame_max - PUBLISH_OVERHEAD_BYTES
        ids: list[int] = []
        entries: list[bytes] = []
        size = 0
        batch_size = settings.batch_size
        for ident, mid, message in rows:
            if ident <= sequence:
                self.outcomes.add("stored-before", [(ident - self.base, ident, mid)])
                continue
            entry = entry_from_message(message)
            cost = ENTRY_OVERHEAD_BYTES + len(entry)
            if cost > budget:
                reason = f"an entry of {len(entry)} bytes does not fit a frame of {budget}"
                self.outcomes.add("too-large", [(ident - self.base, ident, mid)], None, reason)
                continue
            if len(ids) >= batch_size or size + cost > budget:
                self._send(client, ids, entries)
                ids, entries, size = [], [], 0
            ids.append(ident)
            entries.append(entry)
            self.in_flight[ident] = mid
            size += cost
        if ids:
            self._send(client, ids, entries)
        while self.in_flight:
            client.wait("publish confirms")
            self.outcomes.flush()

    def _send(self, client: BlockingStreamClient, ids: list[int], entries: list[bytes]) -> None:
        # Its rows are in_flight already; a frame is never larger than the window.
        limit = self.settings.max_unconfirmed
        while len(self.in_flight) > limit:
            client.wait("publish confirms")
        client.publish(0, ids, entries)
        client.poll()
        self.outcomes.flush()

    def _fail(self, rows: Iterator[tuple[int, str, Message]], reason: str) -> NoReturn:
        """Record the rows in flight and the rest as errors; fail the task (Spark may retry)."""
        base = self.base
        unsettled = [(i - base, i, m) for i, m in self.in_flight.items()]
        self.in_flight.clear()
        self.outcomes.add("error", unsettled, None, reason)
        self.outcomes.add("error", ((i - base, i, m) for i, m, _ in rows), None, reason)
        counts = ", ".join(f"{n} {status}" for status, n in sorted(self.outcomes.counts.items()))
        raise OSError(f"msggateway sink: partition {self.partition}: {reason} ({counts})")


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


# --- the writers -------------------------------------------------------------------------------


def _task() -> tuple[int, str | None]:
    """This task's partition and its micro-batch id (None outside a stream query)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return 0, None
    return context.partitionId(), context.getLocalProperty("streaming.sql.batchId")


def _check(settings: SinkSettings, messages: Iterable[WriterCommitMessage | None]) -> None:
    """Raise when a row was not stored: how many, why (some reasons), where the outcomes are."""
    counts: dict[str, int] = {}
    examples: list[str] = []
    for message in messages:
        if isinstance(message, SinkCommitMessage):
            for status, count in message.counts.items():
                counts[status] = counts.get(status, 0) + count
            examples += [e for e in message.examples if e not in examples]
    failed = sum(counts.get(status, 0) for status in _NOT_STORED)
    if not failed:
        return
    total = sum(counts.values())
    where = (
        f"per-row outcomes in {settings.outcomes}"
        if settings.outcomes
        else "set the option outcomes to a directory to keep per-row outcomes"
    )
    summary = ", ".join(f"{counts[s]} {s}" for s in sorted(counts))
    raise RuntimeError(
        f"msggateway sink: {failed} of {total} rows were not stored in stream"
        f" {settings.stream} at {settings.endpoint} ({summary}): {'; '.join(examples[:_EXAMPLES])};"
        f" {where}"
    )


class LogSinkWriter(DataSourceArrowWriter):
    """``df.write.format("msggateway")``: each task publishes its partition (module docs)."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        """Publish this task's rows; return their counts."""
        partition, _ = _task()
        return _PartitionWrite(self.settings, partition, None).run(iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Fail the write if any row was not stored."""
        _check(self.settings, messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: what was stored stays, and a re-run under the producer skips it."""


class LogSinkStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("msggateway")``: each micro-batch as a batch write (module docs)."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        """Publish this task's rows of the micro-batch, ids above the batch's base."""
        partition, batch = _task()
        return _PartitionWrite(self.settings, partition, int(batch or 0)).run(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Fail the micro-batch if any row was not stored."""
        _check(self.settings, messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Nothing to undo (see `LogSinkWriter.abort`)."""


class LogSinkMixin:
    """Gives a `pyspark.sql.datasource.DataSource` the ``msggateway`` sink.

    ``class LogDataSource(LogSinkMixin, DataSource)``: ``writer`` and
    ``streamWriter`` check the options and the rows' schema on the driver.
    """

    options: Any

    def writer(self, schema: StructType, overwrite: bool) -> LogSinkWriter:
        """The batch writer (append only: a stream keeps what it stored)."""
        return LogSinkWriter(_settings(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> LogSinkStreamWriter:  # noqa: N802
        """The micro-batch writer."""
        return LogSinkStreamWriter(_settings(self.options, schema, overwrite))


def _settings(options: Mapping[str, str], schema: StructType, overwrite: bool) -> SinkSettings:
    if overwrite:
        raise ValueError("msggateway sink: a stream is append-only: use mode append")
    return sink_settings(options, schema)
