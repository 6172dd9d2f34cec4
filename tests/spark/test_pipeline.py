"""The pipeline end to end: a gateway under twistd, real clients, the Spark jobs from the CLI.

* Real traffic (QMQP mail and rstream publishers) through ``twistd
  msggateway``; Spark reads the gateway's log: every message once, bodies
  and headers intact; the report's counts match the replies the clients got.
* ``msggateway spark send`` with 100,000 messages, killed half way with
  SIGKILL (the whole process group: driver, JVM, workers) and run again:
  exactly one accepted outcome per id, and every id in the gateway's log.
* archive and report on a Spark standalone master and worker (started from
  the pyspark package's scripts), not only in-process; and there the
  streaming source too: ``python -m gateway.spark.streaming`` copies the log
  into Parquet (AvailableNow), and again after the log grew, each message
  once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F  # noqa: N812

from gateway.codecs import qmqp
from gateway.spark import jobs
from tests.integration.harness import GatewayProcess
from tests.integration.test_qmqp import QMQPSession, mail
from tests.spark.cluster import StandaloneCluster
from tests.spark.conftest import ROOT, make_log

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

GATEWAY = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[log]
fsync = "never"

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
ROUTES = {
    "to-inbox": 'from = "mail"\nmatch = "#@inbox.example"\nto = "streams"\naddress = "inbox"\n',
    "to-bulk": 'from = "mail"\nmatch = "#@bulk.example"\nto = "streams"\naddress = "bulk"\n',
}


def _cli(*arguments: str, **popen: Any) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "spark", *arguments],
        cwd=ROOT,
        env=env,
        start_new_session=True,  # one process group: driver, JVM and Python workers
        **popen,
    )


def _run_cli(*arguments: str, timeout: float = 300) -> dict[str, Any]:
    process = _cli(*arguments, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        raise
    assert process.returncode == 0, err.decode()[-3000:]
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def test_real_traffic_read_back_and_reported(spark: Any, tmp_path: Path) -> None:
    """QMQP and rstream into a gateway; Spark reads every message once; the report agrees."""
    gateway = GatewayProcess(tmp_path / "gw", GATEWAY, routes=ROUTES).start()
    try:
        client = QMQPSession(gateway.address("mail"))
        blocks = [
            mail(
                f"m{i}",
                "ops@inbox.example" if i % 10 else "nobody@nowhere.example",
                subject=f"n {i}",
            )
            for i in range(500)
        ]
        client.send(b"".join(blocks) + b"1:D,")
        replies = client.read_blocks(501)
        client.close()
        statuses = [r.status for r in replies[:-1]]  # type: ignore[union-attr]
        assert statuses.count(qmqp.K) == 450 and statuses.count(qmqp.D) == 50
        host, port = gateway.address("streams")
        confirmed = asyncio.run(asyncio.wait_for(_publish_confirmed(host, port, "events", 300), 60))
        assert confirmed == 300
    finally:
        gateway.stop()  # a clean stop: outcome records flushed, the log closed
    log = tmp_path / "gw" / "data" / "log"
    frame = spark.read.format("msggateway").load(str(log))
    inbox = frame.where(F.col("stream") == "inbox").collect()
    assert sorted(r.message_id for r in inbox) == sorted(f"m{i}" for i in range(500) if i % 10)
    m7 = next(r for r in inbox if r.message_id == "m7")
    assert m7.body == b"From: app@example.org\nSubject: n 7\n\n\n"
    assert m7.sender == "app@example.org" and m7.recipients == ["inbox"]
    events = frame.where(F.col("stream") == "events").orderBy("offset").collect()
    assert [r.body for r in events] == [f"event {i}".encode() for i in range(300)]
    assert [r.message_id for r in events][:2] == ["event-0", "event-1"]
    assert events[5].headers == {"seq": "5"}
    document = jobs.report(spark, log, tmp_path / "report")
    [route] = [r for r in document["routes"] if r["route"] == "to-inbox"]
    assert (route["messages"], route["accepted"], route["retry"], route["rejected"]) == (
        450,
        450,
        0,
        0,
    )
    assert route["latency_p99_ms"] is not None and route["latency_p99_ms"] >= 0
    streams = {s["stream"]: s["messages"] for s in document["streams"]}
    assert streams["inbox"] == 450 and streams["events"] == 300
    [domain] = [d for d in document["top_domains"] if d["route"] == "to-inbox"]
    assert domain["domain"] == "inbox" or domain["messages"] == 450


async def _publish_confirmed(host: str, port: int, stream: str, count: int) -> int:
    """Publish with confirms; return how many were confirmed."""
    confirmed = 0
    done = asyncio.Event()

    async def on_confirm(status: Any) -> None:
        nonlocal confirmed
        if status.is_confirmed:
            confirmed += 1
        if confirmed >= count:
            done.set()

    async with rstream.Producer(host, port=port, username="guest", password="guest") as producer:
        await producer.create_stream(stream, exists_ok=True)
        for i in range(count):
            message = rstream.AMQPMessage(
                body=f"event {i}".encode(),
                properties=rstream.Properties(message_id=f"event-{i}"),
                application_properties={"seq": str(i)},
            )
            await producer.send(stream, message, on_publish_confirm=on_confirm)
        await done.wait()
    return confirmed


def _kill_session(session: int) -> None:
    """SIGKILL every process of a session: PySpark's worker daemon leaves the process group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[3]) == session:  # after ")": state, ppid, pgrp, session
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _accepted_lines(outcomes: Path) -> int:
    total = 0
    for path in outcomes.glob("*.jsonl"):
        with open(path, "rb") as handle:
            total += sum(1 for line in handle if b'"accepted"' in line)
    return total


@pytest.mark.timeout(900)
def test_send_killed_half_way_and_run_again(spark: Any, tmp_path: Path) -> None:
    """100,000 messages; SIGKILL mid-send; the re-run ends with one accepted outcome per id."""
    total = 100_000
    dataset = tmp_path / "messages.parquet"
    spark.range(total).select(
        F.format_string("msg-%06d", "id").alias("id"),
        F.lit("bulk@example.org").alias("sender"),
        F.array(F.format_string("user%d@bulk.example", F.col("id") % 7)).alias("recipients"),
        F.format_string("Subject: number %d\n\nhello %d\n", "id", "id").alias("body"),
    ).repartition(4).write.parquet(str(dataset))
    gateway = GatewayProcess(tmp_path / "gw", GATEWAY, routes=ROUTES).start()
    try:
        host, port = gateway.address("mail")
        address = f"{host}:{port}"
        outcomes = jobs.outcomes_path(dataset)
        first = _cli("send", str(dataset), address, "--master", "local[2]", "--window", "20")
        try:
            # The outcome files are the only sign of progress: look at them every 50 ms
            # (bounded by a deadline) until a third are accepted, then kill everything.
            deadline = time.monotonic() + 300
            while _accepted_lines(outcomes) < total // 3 and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    first.wait(0.05)
                if first.poll() is not None:
                    break
            assert first.poll() is None, "the first run ended before it could be killed"
        finally:
            _kill_session(first.pid)
            first.wait()
        before = _accepted_lines(outcomes)
        assert total // 3 <= before < total
        summary = _run_cli("send", str(dataset), address, "--master", "local[2]", "--window", "50")
        assert summary["skipped"] == before
        assert summary["outcomes"] == {"accepted": total - before}
    finally:
        gateway.stop()
    recorded = spark.read.json(str(outcomes / "*.jsonl"))
    accepted = recorded.where("outcome = 'accepted'").groupBy("id").count()
    assert accepted.count() == total
    assert accepted.where("count != 1").count() == 0
    stored = (
        spark.read.format("msggateway")
        .option("streams", "bulk")
        .load(str(tmp_path / "gw" / "data" / "log"))
    )
    assert stored.select("message_id").distinct().count() == total  # at least once in the log


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A Spark master and worker on loopback, for this module's cluster tests."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
def test_archive_and_report_on_a_standalone_cluster(
    standalone: StandaloneCluster, tmp_path: Path
) -> None:
    """A real master and worker: the jobs run as an operator would run them."""
    log = make_log(
        tmp_path / "log",
        {
            "segment_bytes": 100_000,
            "streams": {"orders": {"count": 3000, "batch": 200}},
            "outcomes": [["r", "mail", "accepted", 10.0, 10.01, "a@b.example", ["c@d.example"], 5]]
            * 20,
        },
    )
    master = standalone.url
    archived = _run_cli("archive", str(log), str(tmp_path / "archive"), "--master", master)
    assert archived["rows"] == 3000
    reported = _run_cli("report", str(log), str(tmp_path / "report"), "--master", master)
    assert reported["messages"] == 20
    document = json.loads((tmp_path / "report" / "report.json").read_text())
    assert document["streams"][0]["messages"] == 3000
    # The work ran on the worker's executors, not in the driver.
    assert any((standalone.directory / "work").iterdir())


def _run_streaming(*arguments: str, timeout: float = 300) -> dict[str, Any]:
    """``python -m gateway.spark.streaming ...`` in its own process group; its JSON line."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.spark.streaming", *arguments],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        raise
    assert process.returncode == 0, err.decode()[-3000:]
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


@pytest.mark.timeout(900)
def test_a_streaming_query_on_a_standalone_cluster(
    spark: Any, standalone: StandaloneCluster, tmp_path: Path
) -> None:
    """The streaming source on a master and worker: the log into Parquet, then what it gained."""
    spec: dict[str, Any] = {"segment_bytes": 100_000, "streams": {"orders": {"count": 3000}}}
    log = make_log(tmp_path / "log", {**spec, "streams": {"orders": {"count": 3000, "batch": 200}}})
    out, checkpoint = tmp_path / "parquet", tmp_path / "checkpoint"
    arguments = [str(log), str(out), "--checkpoint", str(checkpoint), "--available-now"]
    arguments += ["--master", standalone.url, "--option", "max_records_per_trigger=2000"]
    first = _run_streaming(*arguments)
    assert (first["rows"], first["batches"]) == (3000, 2)
    make_log(log, {**spec, "streams": {"orders": {"count": 1500, "batch": 150, "first": 3000}}})
    again = _run_streaming(*arguments)
    assert again["rows"] == 1500
    assert again["offsets"]["orders"] > first["offsets"]["orders"]
    found = [r.message_id for r in spark.read.parquet(str(out)).select("message_id").collect()]
    assert sorted(found) == sorted(f"orders-{i}" for i in range(4500))
    applications = [p.name for p in (standalone.directory / "work").iterdir()]
    assert len(applications) >= 2  # each run was an application on the worker


def test_send_json_lines_and_rfc822_files(spark: Any, tmp_path: Path) -> None:
    """Each input format; D, Z-free errors and K recorded; a re-run retries only the failures."""
    lines = [
        {"id": "a1", "sender": "x@example.org", "recipients": ["u@inbox.example"], "body": "A\n"},
        {
            "id": "a2",
            "sender": "x@example.org",
            "recipients": "u@inbox.example, v@inbox.example",
            "body": "B\n",
        },
        {
            "id": "a3",
            "sender": "x@example.org",
            "recipients": ["u@unrouted.example"],
            "body": "C\n",
        },
        {"id": "a4", "sender": "x@example.org", "recipients": [], "body": "no recipient\n"},
    ]
    dataset = tmp_path / "mail.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({**line, "recipients": line["recipients"]}) + "\n"
            for line in lines[:1] + lines[2:]
        )
    )
    csv_dataset = tmp_path / "mail.csv"
    csv_dataset.write_text(
        'id,sender,recipients,body\na2,x@example.org,"u@inbox.example, v@inbox.example",B\n'
    )
    files = tmp_path / "rfc822"
    files.mkdir()
    (files / "letter-1.eml").write_bytes(
        b"Return-Path: <ops@example.org>\r\nTo: a@inbox.example\r\nSubject: one\r\n\r\nbody\r\n"
    )
    gateway = GatewayProcess(tmp_path / "gw", GATEWAY, routes=ROUTES).start()
    try:
        host, port = gateway.address("mail")
        address = f"{host}:{port}"
        first = jobs.send(spark, dataset, address, window=2)
        assert first["outcomes"] == {"accepted": 1, "rejected": 1, "error": 1}
        again = jobs.send(spark, dataset, address)
        assert again["skipped"] == 1 and again["outcomes"] == {"rejected": 1, "error": 1}
        assert jobs.send(spark, csv_dataset, address)["outcomes"] == {"accepted": 1}
        assert jobs.send(spark, files, address)["outcomes"] == {"accepted": 1}
    finally:
        gateway.stop()
    recorded = {
        (r["id"], r["outcome"]): r
        for path in jobs.outcomes_path(dataset).glob("*.jsonl")
        for r in map(json.loads, path.read_text().splitlines())
    }
    assert recorded[("a3", "rejected")]["code"] == "D"
    assert "no recipient" in recorded[("a4", "error")]["description"]
    frame = (
        spark.read.format("msggateway")
        .option("streams", "inbox")
        .load(str(tmp_path / "gw" / "data" / "log"))
    )
    stored = {r.message_id: r for r in frame.collect()}
    assert set(stored) == {"a1", "a2", "letter-1.eml"}
    assert stored["a2"].sender == "x@example.org" and stored["a2"].body == b"B"
    assert stored["letter-1.eml"].sender == "ops@example.org"
    assert (
        stored["letter-1.eml"].body
        == b"Return-Path: <ops@example.org>\nTo: a@inbox.example\nSubject: one\n\nbody\n"
    )


def test_send_cli_exit_status(tmp_path: Path) -> None:
    """Nothing listening: every message gets an error outcome and the command exits 1."""
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps({"id": "z", "recipients": ["a@b.example"], "body": "x"}) + "\n")
    process = _cli(
        "send",
        str(dataset),
        "127.0.0.1:9",
        "--master",
        "local[1]",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, err.decode()[-2000:]
    assert json.loads(out.decode().splitlines()[-1])["outcomes"] == {"error": 1}
    [line] = (
        (
            jobs.outcomes_path(dataset)
            / next(iter(p.name for p in jobs.outcomes_path(dataset).iterdir()))
        )
        .read_text()
        .splitlines()
    )
    assert "cannot connect to 127.0.0.1:9" in json.loads(line)["description"]
