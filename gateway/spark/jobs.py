"""The Spark jobs: ``msggateway spark archive|report|send``.

archive
    The log to Parquet under ``OUT/stream=S/day=D/``, incremental and
    exactly once: ``OUT/_msggateway_archive.json`` holds, per stream, the
    offset the next run starts from. A run writes into ``OUT/_staging/RUN``,
    records what it wrote as *pending* in the state file, moves its files
    into place (named ``RUN-part-...``, so a move done twice is a no-op),
    then commits the new offsets. A run killed before the pending record
    leaves only staging, which the next run deletes and redoes; one killed
    after it is finished by the next run before it starts its own.
report
    From the outcome records (`gateway.core.outcomes`) and the log: per route
    and destination, messages, bytes, outcomes (accepted = K / 200 /
    confirm, retry = Z / 4xx, rejected = D / 5xx / PublishError; durable
    routes' forwarded and dead-lettered), latency percentiles from arrival to
    outcome; per stream counts; per hour; top senders and recipient domains.
    Written as ``report.json``, one CSV per table and PNG charts. A durable
    route's records name ranges of its stream: each is joined to the
    stream's messages (`message_outcomes`), so that every message of a range
    counts as one, with its address, sender, recipients and size.
send
    A dataset of messages (Parquet, CSV, JSON lines with id, sender,
    recipients and body; or a directory of RFC 822 files) pushed into a
    gateway over QMQP streaming, one connection per partition with at most
    ``window`` messages unanswered. Each outcome (id, outcome, code,
    description, time, run) is appended to ``INPUT.outcomes/`` as it
    arrives, so a killed job loses no outcome it has seen; a re-run skips
    every id already accepted there.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from gateway.cli.connection import connect, parse_address, tls_context
from gateway.cli.qmqp.mail import Item, LocalFailure, prepare
from gateway.cli.qmqp.session import QMQPSender
from gateway.core.outcomes import OUTCOME_STREAM
from gateway.spark.logfiles import list_streams
from gateway.spark.source import NAME, register

__all__ = [
    "ARCHIVE_STATE",
    "archive",
    "message_outcomes",
    "report",
    "send",
    "spark_session",
]

ARCHIVE_STATE: Final = "_msggateway_archive.json"
"""The archive's state file, in its output directory (Spark skips ``_`` names)."""
_STAGING: Final = "_staging"
_TOP: Final = 10
_OUTCOMES: Final = {"K": "accepted", "Z": "retry", "D": "rejected", "error": "error"}


# --- the session ---------------------------------------------------------------------


def spark_session(master: str = "local[*]", app: str = "msggateway") -> SparkSession:
    """A Spark session for the jobs: loopback only, no UI, UTC, the data source registered.

    Workers run this Python (``PYSPARK_PYTHON``); on a master other than
    ``local`` the ``gateway`` package is shipped to them as a zip.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "8")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    if not master.startswith("local"):
        spark.sparkContext.addPyFile(_package_zip())
    register(spark)
    return spark


def _package_zip() -> str:
    """The ``gateway`` package as a zip, for workers of a remote cluster."""
    package = Path(__file__).resolve().parent.parent
    target = Path(tempfile.mkdtemp(prefix="msggateway-")) / "gateway.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive_file:
        for path in package.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                archive_file.write(path, Path("gateway") / path.relative_to(package))
    return str(target)


def read_log(spark: SparkSession, log: str | Path, **options: Any) -> DataFrame:
    """The log as a DataFrame (`gateway.spark.source`)."""
    reader = spark.read.format(NAME)
    for key, value in options.items():
        if value is not None:
            reader = reader.option(key, str(value))
    return reader.load(str(log))


# --- archive -------------------------------------------------------------------------


def _run_id() -> str:
    """A run's name: its UTC start time and a random suffix, sortable and unique."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def _load_state(out: Path) -> dict[str, Any]:
    path = out / ARCHIVE_STATE
    try:
        state = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {"version": 1, "streams": {}, "pending": None}
    except ValueError as exc:
        raise ValueError(f"{path}: not an archive state file: {exc}") from None
    if not isinstance(state, dict) or state.get("version") != 1:
        raise ValueError(f"{path}: not a version 1 archive state file")
    return state


def _save_state(out: Path, state: dict[str, Any]) -> None:
    """Write the state atomically and durably (temporary file, fsync, rename)."""
    path = out / ARCHIVE_STATE
    temporary = out / (ARCHIVE_STATE + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _move_staged(out: Path, run: str) -> int:
    """Move a run's staged files into place; idempotent. Returns files moved."""
    staging = out / _STAGING / run
    moved = 0
    if not staging.exists():
        return 0
    for path in sorted(staging.rglob("*.parquet")):
        relative = path.relative_to(staging)
        target = out / relative.parent / f"{run}-{relative.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        moved += 1
    shutil.rmtree(staging)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()  # _staging, when no other run is staged
    return moved


def _finish_pending(out: Path, state: dict[str, Any]) -> None:
    pending = state.get("pending")
    if pending:
        _move_staged(out, pending["run"])
        state["streams"].update(pending["next"])
        state["pending"] = None
        _save_state(out, state)


def archive(
    spark: SparkSession,
    log: str | Path,
    out: str | Path,
    *,
    streams: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Archive what the log gained since the last run (see the module documentation).

    Args:
        spark: The session.
        log: The log directory.
        out: The archive directory.
        streams: Only these streams (default: all but the outcome stream).

    Returns:
        ``{"run", "rows", "streams": {name: [first, next]}}``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = _load_state(out)
    _finish_pending(out, state)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(out / _STAGING)  # writes of a run killed before its pending record
    names = list(streams) if streams is not None else list(list_streams(log))
    names = [n for n in names if streams is not None or n != OUTCOME_STREAM]
    frames = [
        read_log(spark, log, streams=name, start_offset=state["streams"].get(name, 0))
        for name in names
    ]
    run = _run_id()
    if not frames:
        return {"run": run, "rows": 0, "streams": {}}
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    staging = out / _STAGING / run
    (
        frame.withColumn("day", F.to_date("chunk_timestamp"))
        .write.partitionBy("stream", "day")
        .parquet(str(staging))
    )
    if not any(staging.rglob("*.parquet")):  # nothing new since the last run
        shutil.rmtree(out / _STAGING)
        return {"run": run, "rows": 0, "streams": {}}
    written = (
        spark.read.parquet(str(staging))
        .groupBy("stream")
        .agg(F.min("offset").alias("first"), F.max("offset").alias("last"), F.count("*").alias("n"))
        .collect()
    )
    ranges = {row["stream"]: [row["first"], row["last"] + 1] for row in written}
    state["pending"] = {"run": run, "next": {name: r[1] for name, r in ranges.items()}}
    _save_state(out, state)
    _finish_pending(out, state)
    return {"run": run, "rows": sum(row["n"] for row in written), "streams": ranges}


# --- report --------------------------------------------------------------------------


def report(
    spark: SparkSession,
    log: str | Path,
    out: str | Path,
    *,
    since: str | None = None,
    until: str | None = None,
    top: int = _TOP,
) -> dict[str, Any]:
    """Write the report (see the module documentation); return what ``report.json`` holds.

    Args:
        spark: The session.
        log: The log directory.
        out: Where report.json, the CSVs and the PNGs go.
        since: Only messages that arrived at or after this (ISO 8601).
        until: Only messages that arrived before this (ISO 8601).
        top: How many senders and recipient domains per route.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = message_outcomes(spark, log)
    if since:
        outcomes = outcomes.where(F.col("arrived") >= F.lit(since).cast("timestamp"))
    if until:
        outcomes = outcomes.where(F.col("arrived") < F.lit(until).cast("timestamp"))
    outcomes.cache()
    routed = outcomes.where(F.col("kind") == "route")
    forwarded = outcomes.where(F.col("kind") != "route")

    def count_if(condition: Any) -> Any:
        return F.sum(F.when(condition, 1).otherwise(0))

    quantiles = F.percentile_approx("latency_ms", [0.5, 0.9, 0.99], 10000)
    routes = (
        routed.groupBy("route", "address")
        .agg(
            F.count("*").alias("messages"),
            F.sum("bytes").alias("bytes"),
            count_if(F.col("status") == "accepted").alias("accepted"),
            count_if(F.col("status") == "retry").alias("retry"),
            count_if(F.col("status") == "rejected").alias("rejected"),
            quantiles.alias("q"),
            F.max("latency_ms").alias("latency_max_ms"),
            F.min("arrived").alias("first"),
            F.max("arrived").alias("last"),
        )
        .join(
            forwarded.groupBy("route", "address").agg(
                count_if(F.col("kind") == "forward").alias("forwarded"),
                count_if(F.col("kind") == "dead-letter").alias("dead_lettered"),
                F.percentile_approx("latency_ms", 0.99, 10000).alias("forward_p99_ms"),
            ),
            ["route", "address"],
            "left",
        )
        .orderBy("route", "address")
    )
    route_rows = [_route_row(row) for row in routes.collect()]
    hourly = [
        row.asDict()
        for row in routed.groupBy("route", F.date_trunc("hour", "arrived").alias("hour"))
        .agg(
            F.count("*").alias("messages"),
            F.sum("bytes").alias("bytes"),
            count_if(F.col("status") == "accepted").alias("accepted"),
            count_if(F.col("status") == "retry").alias("retry"),
            count_if(F.col("status") == "rejected").alias("rejected"),
        )
        .orderBy("route", "hour")
        .collect()
    ]
    senders = _top(routed.where(F.col("sender").isNotNull()), "sender", top)
    domains = _top(
        routed.select("route", F.explode("recipients").alias("recipient")).select(
            "route", F.lower(F.substring_index("recipient", "@", -1)).alias("domain")
        ),
        "domain",
        top,
    )
    streams = [
        row.asDict()
        for row in read_log(spark, log)
        .groupBy("stream")
        .agg(
            F.count("*").alias("messages"),
            F.sum("size").alias("bytes"),
            F.min("chunk_timestamp").alias("first"),
            F.max("chunk_timestamp").alias("last"),
        )
        .orderBy("stream")
        .collect()
    ]
    outcomes.unpersist()
    document: dict[str, Any] = {
        "generated": _iso(datetime.datetime.now(datetime.UTC)),
        "log": str(log),
        "since": since,
        "until": until,
        "routes": route_rows,
        "streams": streams,
        "hourly": hourly,
        "top_senders": senders,
        "top_domains": domains,
    }
    document = dict(json.loads(json.dumps(document, default=_json_default)))
    (out / "report.json").write_text(json.dumps(document, indent=2) + "\n", "utf-8")
    for table in ("routes", "streams", "hourly", "top_senders", "top_domains"):
        _write_csv(out / f"{table}.csv", document[table])
    _charts(out, document)
    return document


_MESSAGE_OUTCOME_COLUMNS: Final = (
    "kind",
    "route",
    "source",
    "message_id",
    "address",
    "sender",
    "recipients",
    "bytes",
    "arrived",
    "status",
    "code",
    "reason",
    "finished",
    "latency_ms",
)


def message_outcomes(spark: SparkSession, log: str | Path) -> DataFrame:
    """The outcome records, one row per message and record: what the report counts.

    A per-message record is one row as it is. A range record becomes a row
    per offset of its range, joined to the message at that offset in its
    stream for the id, address, sender, recipients and bytes; an offset
    listed in its exceptions takes the exception's kind, status, code,
    reason and time. A forwarder's row (``forward``, ``dead-letter``)
    counts from the message's own arrival (its timestamp), as the
    per-message records did; a committed batch's (``route``) from the
    batch's. A message no longer in the log (retention) still counts, with
    its details null.

    Returns:
        ``kind, route, source, message_id, address, sender, recipients,
        bytes, arrived, status, code, reason, finished, latency_ms``.
    """
    records = read_log(spark, log, kind="outcomes")
    single = records.where(F.col("first_offset").isNull()).select(*_MESSAGE_OUTCOME_COLUMNS)
    ranges = records.where(F.col("first_offset").isNotNull())
    spans = (
        ranges.groupBy("log_stream")
        .agg(F.min("first_offset").alias("low"), F.max("last_offset").alias("high"))
        .collect()
    )
    if not spans:
        return single
    frames = [
        read_log(
            spark,
            log,
            streams=span["log_stream"],
            start_offset=span["low"],
            end_offset=span["high"] + 1,
        ).select(
            F.col("stream").alias("log_stream"),
            F.col("offset").alias("message_offset"),
            "message_id",
            "address",
            "sender",
            "recipients",
            F.col("size").cast("long").alias("bytes"),
            F.col("timestamp").alias("sent"),
        )
        for span in spans
    ]
    messages = frames[0]
    for other in frames[1:]:
        messages = messages.unionByName(other)
    offset = F.col("message_offset")
    expanded = ranges.select(
        "kind",
        "route",
        "source",
        "arrived",
        "status",
        "code",
        "reason",
        "finished",
        "log_stream",
        "exceptions",
        F.explode(F.sequence("first_offset", "last_offset")).alias("message_offset"),
    ).withColumn(
        "exception",
        F.try_element_at(F.filter("exceptions", lambda e: e["offset"] == offset), F.lit(1)),
    )
    exception = F.col("exception")
    listed = exception.isNotNull()
    arrived = F.when(F.col("kind") == "route", F.col("arrived")).otherwise(
        F.coalesce(F.col("sent"), F.col("arrived"))
    )
    finished = F.coalesce(exception["finished"], F.col("finished"))
    per_message = expanded.join(messages, ["log_stream", "message_offset"], "left").select(
        F.coalesce(exception["kind"], F.col("kind")).alias("kind"),
        "route",
        "source",
        "message_id",
        "address",
        "sender",
        "recipients",
        "bytes",
        arrived.alias("arrived"),
        F.coalesce(exception["status"], F.col("status")).alias("status"),
        F.when(listed, exception["code"]).otherwise(F.col("code")).alias("code"),
        F.when(listed, exception["reason"]).otherwise(F.col("reason")).alias("reason"),
        finished.alias("finished"),
        ((F.unix_micros(finished) - F.unix_micros(arrived)) / 1000.0).alias("latency_ms"),
    )
    return single.unionByName(per_message)


def _route_row(row: Any) -> dict[str, Any]:
    values: dict[str, Any] = row.asDict()
    q = values.pop("q") or [None, None, None]
    values["latency_p50_ms"], values["latency_p90_ms"], values["latency_p99_ms"] = q
    values["forwarded"] = values.get("forwarded") or 0
    values["dead_lettered"] = values.get("dead_lettered") or 0
    return values


def _top(frame: DataFrame, column: str, top: int) -> list[dict[str, Any]]:
    counted = frame.groupBy("route", column).agg(F.count("*").alias("messages"))
    ranked = counted.withColumn(
        "rank",
        F.row_number().over(Window.partitionBy("route").orderBy(F.desc("messages"), F.asc(column))),
    ).where(F.col("rank") <= top)
    return [row.asDict() for row in ranked.orderBy("route", "rank").collect()]


def _iso(value: datetime.datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return value.isoformat().replace("+00:00", "Z")


def _json_default(value: object) -> object:
    if isinstance(value, datetime.datetime):
        return _iso(value)
    if isinstance(value, datetime.date):
        return value.isoformat()
    raise TypeError(f"cannot write {type(value).__name__} in a report")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _charts(out: Path, document: dict[str, Any]) -> None:
    """The PNGs: messages per hour, outcomes and latency per route, top domains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routes = document["routes"]
    labels = [f"{r['route']}\n-> {r['address']}" for r in routes]

    figure, axes = plt.subplots(figsize=(10, 5))
    series: dict[str, list[tuple[str, int]]] = {}
    for row in document["hourly"]:
        series.setdefault(row["route"], []).append((row["hour"], row["messages"]))
    for route, points in sorted(series.items()):
        hours = [datetime.datetime.fromisoformat(h.replace("Z", "+00:00")) for h, _ in points]
        axes.plot(hours, [n for _, n in points], marker="o", label=route)  # type: ignore[arg-type]
    axes.set_title("Messages per hour, by route")
    axes.set_ylabel("messages")
    if series:
        axes.legend()
    figure.autofmt_xdate()
    figure.tight_layout()
    figure.savefig(out / "messages_per_hour.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(10, max(3, 0.6 * len(routes) + 1.5)))
    left = [0] * len(routes)
    for key, colour in (
        ("accepted", "#2e7d32"),
        ("retry", "#f9a825"),
        ("rejected", "#c62828"),
        ("dead_lettered", "#4a148c"),
    ):
        values = [r[key] or 0 for r in routes]
        axes.barh(labels, values, left=left, color=colour, label=key)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.set_title("Outcomes by route (accepted = K/200/confirm, retry = Z, rejected = D)")
    axes.set_xlabel("messages")
    axes.invert_yaxis()
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "outcomes.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(10, max(3, 0.6 * len(routes) + 1.5)))
    height = 0.25
    for number, key in enumerate(("latency_p50_ms", "latency_p90_ms", "latency_p99_ms")):
        positions = [i + (number - 1) * height for i in range(len(routes))]
        axes.barh(positions, [r[key] or 0 for r in routes], height=height, label=key[8:11])
    axes.set_yticks(range(len(routes)), labels)
    axes.set_title("Latency from arrival to outcome, by route")
    axes.set_xlabel("milliseconds")
    axes.invert_yaxis()
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "latency.png", dpi=100)
    plt.close(figure)

    domains = document["top_domains"]
    figure, axes = plt.subplots(figsize=(10, max(3, 0.35 * len(domains) + 1.5)))
    axes.barh([f"{d['domain']} ({d['route']})" for d in domains], [d["messages"] for d in domains])
    axes.set_title("Top recipient domains")
    axes.set_xlabel("messages")
    axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(out / "top_domains.png", dpi=100)
    plt.close(figure)


# --- send ----------------------------------------------------------------------------

_SPLIT: Final = r"[\s,;]+"
"""What separates recipients in a CSV or string column."""


def outcomes_path(source: str | Path) -> Path:
    """Where ``send`` keeps the outcomes of a dataset: beside it."""
    return Path(str(source).rstrip("/") + ".outcomes")


def _input_format(source: Path, given: str | None) -> str:
    if given:
        return given
    if source.is_dir():
        names = [p.name for p in source.iterdir() if not p.name.startswith((".", "_"))]
        suffixes = {Path(n).suffix.lower() for n in names}
        for suffix, kind in ((".parquet", "parquet"), (".csv", "csv"), (".json", "json")):
            if suffix in suffixes:
                return kind
        if ".jsonl" in suffixes:
            return "json"
        return "rfc822"
    suffix = source.suffix.lower()
    return {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}.get(
        suffix, "rfc822"
    )


def load_messages(spark: SparkSession, source: str | Path, fmt: str | None = None) -> DataFrame:
    """The dataset as ``id STRING, sender STRING, recipients ARRAY<STRING>, body BINARY``.

    Formats: ``parquet``, ``csv`` (a header line; recipients separated by
    commas, semicolons or spaces), ``json`` (JSON lines; recipients an array
    or a string) and ``rfc822`` (a directory of message files: the id is
    the file name, the envelope is read from the headers as ``msggateway
    qmqp send`` does).
    """
    source = Path(source)
    kind = _input_format(source, fmt)
    if kind == "rfc822":
        files = spark.read.format("binaryFile").load(str(source))
        return files.select(
            F.regexp_extract("path", r"([^/]+)$", 1).alias("id"),
            F.lit(None).cast("string").alias("sender"),
            F.lit(None).cast("array<string>").alias("recipients"),
            F.col("content").alias("body"),
        )
    if kind == "csv":
        frame = spark.read.option("header", True).option("multiLine", True).csv(str(source))
    elif kind == "json":
        frame = spark.read.json(str(source))
    elif kind == "parquet":
        frame = spark.read.parquet(str(source))
    else:
        raise ValueError(f"unknown input format {kind!r}: parquet, csv, json or rfc822")
    missing = {"id", "body"} - set(frame.columns)
    if missing:
        raise ValueError(f"{source}: the dataset lacks the column(s) {', '.join(sorted(missing))}")
    fields = dict(frame.dtypes)
    kind_of_recipients = fields.get("recipients", "")
    if kind_of_recipients.startswith("array"):
        recipients = F.col("recipients").cast("array<string>")
    elif kind_of_recipients:
        listed = F.split(F.coalesce(F.col("recipients").cast("string"), F.lit("")), _SPLIT)
        recipients = F.filter(listed, lambda r: r != "")
    else:
        recipients = F.lit(None).cast("array<string>")
    sender = F.col("sender").cast("string") if "sender" in fields else F.lit(None).cast("string")
    return frame.select(
        F.col("id").cast("string").alias("id"),
        sender.alias("sender"),
        recipients.alias("recipients"),
        F.col("body").cast("binary").alias("body"),
    )


def _accepted_ids(spark: SparkSession, outcomes: Path) -> DataFrame | None:
    if not outcomes.exists() or not any(outcomes.glob("*.jsonl")):
        return None
    recorded = spark.read.schema(
        "id STRING, outcome STRING, code STRING, description STRING, time STRING, run STRING"
    ).json(str(outcomes / "*.jsonl"))
    return recorded.where(F.col("outcome") == "accepted").select("id").distinct()


def send(
    spark: SparkSession,
    source: str | Path,
    address: str,
    *,
    fmt: str | None = None,
    window: int = 100,
    partitions: int | None = None,
    timeout: float = 60.0,
    tls: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send a dataset into a gateway over QMQP streaming (see the module documentation).

    Args:
        spark: The session.
        source: The dataset.
        address: The gateway's QMQP listener, ``HOST:PORT``.
        fmt: The dataset's format (default: from its file names).
        window: Most messages unanswered per connection.
        partitions: Repartition to this many connections (default: as read).
        timeout: Seconds a connection may make no progress.
        tls: ``{"tls": bool, "ca": path, "cert": path, "key": path}``, or None.

    Returns:
        Counts of this run's outcomes, the ids skipped as already accepted,
        and where the outcomes are.
    """
    outcomes = outcomes_path(source)
    outcomes.mkdir(parents=True, exist_ok=True)
    messages = load_messages(spark, source, fmt)
    total = messages.count()
    accepted = _accepted_ids(spark, outcomes)
    if accepted is not None:
        messages = messages.join(accepted, "id", "left_anti")
    if partitions:
        messages = messages.repartition(partitions)
    run = _run_id()
    settings = {
        "address": address,
        "window": window,
        "timeout": timeout,
        "tls": tls or {},
        "outcomes": str(outcomes),
        "run": run,
    }
    counts: dict[str, int] = {}
    for partition_counts in messages.rdd.mapPartitionsWithIndex(
        lambda index, rows: _send_partition(index, iter(rows), settings)
    ).collect():
        for key, value in partition_counts.items():
            counts[key] = counts.get(key, 0) + value
    to_send = sum(counts.values())
    return {
        "run": run,
        "total": total,
        "skipped": total - to_send if accepted is not None else 0,
        "outcomes": counts,
        "path": str(outcomes),
    }


def _send_partition(
    index: int, rows: Iterator[Any], settings: dict[str, Any]
) -> Iterator[dict[str, int]]:
    """One partition: one QMQP connection; each outcome appended to a file as it comes."""
    counts: dict[str, int] = {}
    path = Path(settings["outcomes"]) / f"{settings['run']}-part-{index:05d}.jsonl"
    run = settings["run"]
    with open(path, "a", encoding="utf-8") as handle:

        def record(code: str, ident: bytes, description: str) -> None:
            outcome = _OUTCOMES.get(code, "error")
            counts[outcome] = counts.get(outcome, 0) + 1
            handle.write(
                json.dumps(
                    {
                        "id": ident.decode("utf-8", "surrogateescape"),
                        "outcome": outcome,
                        "code": code,
                        "description": description,
                        "time": _iso(datetime.datetime.now(datetime.UTC)),
                        "run": run,
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
            handle.flush()  # in the OS now: a killed job keeps it

        def items() -> Iterator[Item]:
            # As ``msggateway qmqp send`` prepares a file: LF lines, the envelope
            # from the row or else the headers, Bcc removed.
            for row in rows:
                ident = str(row["id"]).encode("utf-8", "surrogateescape")
                listed = [r for r in (row["recipients"] or []) if r]
                item = prepare(
                    ident, bytes(row["body"] or b""), sender=row["sender"], recipients=listed
                )
                if isinstance(item, LocalFailure):
                    item = LocalFailure(id=ident, reason="no recipient in the dataset or headers")
                yield item

        first = next(rows, None)
        if first is None:
            yield counts
            return
        rows = itertools.chain([first], rows)
        context = tls_context(**settings["tls"]) if settings["tls"] else None
        try:
            sock = connect(parse_address(settings["address"]), context, settings["timeout"])
        except OSError as exc:
            for item in items():
                record("error", item.id, f"cannot connect to {settings['address']}: {exc}")
            yield counts
            return
        with QMQPSender(
            sock, window=settings["window"], timeout=settings["timeout"], on_outcome=record
        ) as sender:
            sender.send(items())
    yield counts
