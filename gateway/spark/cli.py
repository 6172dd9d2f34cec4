"""``msggateway spark archive|report|send``: the Spark jobs from the command line.

PySpark is imported only when one of these runs, so the rest of the command
line (and the gateway) works without it. Each prints a one-line JSON
summary on success; errors are one line on stderr and exit status 1.
``send`` also exits with 1 when any message of the run was not accepted (its
outcome says why; running it again retries exactly those).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

__all__ = ["add_spark_commands", "run_spark"]

_MASTER_HELP = "Spark master URL (default local[*]; e.g. spark://127.0.0.1:7077)"


def add_spark_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``spark`` command and its actions."""
    command = commands.add_parser(
        "spark",
        help="data pipeline jobs on Spark",
        description="The data pipeline's jobs on Spark, over the gateway's durable log: archive"
        " what it gained to Parquet, report counts, outcomes and latency, or send a dataset"
        " into a gateway over QMQP streaming. They need PySpark (pip install"
        " 'msggateway[spark]') and a Java 17 runtime. 'msggateway spark ACTION --help' says"
        " more about each.",
    )
    actions = command.add_subparsers(dest="action", required=True, metavar="ACTION")

    archive = actions.add_parser(
        "archive",
        help="copy what the log gained since the last run to Parquet",
        description="Copy what the gateway's log gained since the last run to Parquet, by"
        " stream and day; print a one-line JSON summary.",
    )
    archive.add_argument("log", help="the gateway's log directory (DATA_DIR/log)")
    archive.add_argument("out", help="the archive directory (Parquet, by stream and day)")
    archive.add_argument("--stream", action="append", dest="streams", help="only this stream")

    report = actions.add_parser(
        "report",
        help="counts, outcomes, latency: JSON, CSV and PNG",
        description="Report each route's counts, outcomes and latency, and its top senders"
        " and domains, from the log, as JSON, CSV and PNG charts; print a one-line JSON"
        " summary.",
    )
    report.add_argument("log", help="the gateway's log directory (DATA_DIR/log)")
    report.add_argument("out", help="where the report goes")
    report.add_argument("--since", help="messages that arrived at or after (ISO 8601)")
    report.add_argument("--until", help="messages that arrived before (ISO 8601)")
    report.add_argument("--top", type=int, default=10, help="senders and domains per route")

    send = actions.add_parser(
        "send",
        help="push a dataset of messages into a gateway over QMQP streaming",
        description="Push a dataset of messages (Parquet, CSV, JSON lines or RFC 822 files)"
        " into a gateway over QMQP streaming; print a one-line JSON summary. Exit status 1"
        " when a message was not accepted (running it again retries exactly those).",
    )
    send.add_argument("input", help="Parquet, CSV, JSON lines, or a directory of RFC 822 files")
    send.add_argument("address", help="the gateway's QMQP listener, HOST:PORT")
    send.add_argument("--format", choices=("parquet", "csv", "json", "rfc822"))
    send.add_argument("--window", type=int, default=100, help="unanswered messages per connection")
    send.add_argument("--partitions", type=int, help="connections (default: as the input reads)")
    send.add_argument("--timeout", type=float, default=60.0, help="seconds without progress")
    send.add_argument("--tls", action="store_true", help="connect over TLS")
    send.add_argument("--ca", help="CA file to verify the gateway with (implies --tls)")
    send.add_argument("--cert", help="client certificate, PEM (implies --tls)")
    send.add_argument("--key", help="the client certificate's key, PEM")

    for action in (archive, report, send):
        action.add_argument("--master", default="local[*]", help=_MASTER_HELP)


def run_spark(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run one ``spark`` action; return the exit status."""
    try:
        from gateway.spark import jobs
    except ImportError as exc:
        err.write(
            f"msggateway spark: PySpark is not installed ({exc});"
            " install msggateway[spark] and a Java 17 runtime\n"
        )
        return 1
    spark = None
    try:
        spark = jobs.spark_session(args.master, app=f"msggateway {args.action}")
        result: dict[str, Any]
        if args.action == "archive":
            result = jobs.archive(spark, args.log, args.out, streams=args.streams)
        elif args.action == "report":
            document = jobs.report(
                spark, args.log, args.out, since=args.since, until=args.until, top=args.top
            )
            result = {
                "routes": len(document["routes"]),
                "messages": sum(r["messages"] for r in document["routes"]),
                "out": args.out,
            }
        else:
            tls = None
            if args.tls or args.ca or args.cert:
                tls = {"tls": True, "ca": args.ca, "cert": args.cert, "key": args.key}
            result = jobs.send(
                spark,
                args.input,
                args.address,
                fmt=args.format,
                window=args.window,
                partitions=args.partitions,
                timeout=args.timeout,
                tls=tls,
            )
    except (OSError, ValueError) as exc:
        err.write(f"msggateway spark {args.action}: {exc}\n")
        return 1
    finally:
        if spark is not None:
            spark.stop()
    out.write(json.dumps(result, default=str) + "\n")
    if args.action == "send" and set(result["outcomes"]) - {"accepted"}:
        return 1  # some message was not accepted: its outcome says why; run again to retry
    return 0
