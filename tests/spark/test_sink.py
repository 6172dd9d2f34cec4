"""The sink ``df.write.format("msggateway")`` into a real gateway and a real RabbitMQ.

* Endpoint strings parsed as Twisted reads ``tcp:`` and ``tls:`` (no Spark).
* A batch write into a ``twistd msggateway`` stream listener, read back with
  rstream: every row once, with its headers and id; written again under the
  same producer, nothing is stored twice (every row ``stored-before``); the
  per-row outcome files say so.
* The same twice against RabbitMQ 3.10, which deduplicates by itself.
* ``writeStream`` with ``trigger(availableNow=True)`` over a Parquet
  directory, twice over one checkpoint as the directory grows.
* A refused publisher (no such stream): the write fails, naming how many
  rows and where their outcomes are; TLS with a client certificate.
* The writer on a Spark standalone master and worker.

What a stream holds is read with rstream up to a sentinel published after
the writes, so that "each row once" is checked without waiting for
something that should not come.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pyspark.sql import functions as F  # noqa: N812

from gateway.protocols.stream.blocking import Endpoint, parse_endpoint
from gateway.spark.sink import LogSinkMixin
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.conftest import rabbitmq  # noqa: F401 (the fixture)
from tests.integration.harness import GatewayProcess
from tests.rabbitmq import RabbitMQNode
from tests.spark.cluster import StandaloneCluster
from tests.spark.conftest import ROOT

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

T = TypeVar("T")

GATEWAY = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[log]
fsync = "never"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.secure]
protocol = "stream"
endpoint = "{tls}"
guest = true
"""
SENTINEL = b"sentinel"


def _run(coroutine: Awaitable[T], seconds: float = 120) -> T:
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


def register_sink(spark: Any) -> None:
    """Register the reader with the writer, until `gateway.spark.source` mixes it in itself."""
    from gateway.spark.source import LogDataSource

    if issubclass(LogDataSource, LogSinkMixin):
        spark.dataSource.register(LogDataSource)
        return

    class LogDataSourceWithSink(LogSinkMixin, LogDataSource):  # type: ignore[misc]
        """Defined here, so pickled by value: only the gateway package needs importing."""

    spark.dataSource.register(LogDataSourceWithSink)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The test PKI (CA, server certificate for localhost, client alice)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[GatewayProcess]:
    """A gateway with a plain stream listener and one over TLS with client certificates."""
    config = GATEWAY.format(tls=mtls_endpoint(pki))
    process = GatewayProcess(tmp_path_factory.mktemp("gw"), config).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def sink(spark: Any) -> Any:
    """The session, with the sink registered."""
    register_sink(spark)
    return spark


def _endpoint(address: tuple[str, int]) -> str:
    return f"tcp:host={address[0]}:port={address[1]}"


def _frame(spark: Any, rows: int, partitions: int, tag: str) -> Any:
    """Rows with a body, a header map and (every other row) a message id."""
    return (
        spark.range(rows, numPartitions=partitions)
        .select(
            F.format_string(f"{tag} body %d", "id").cast("binary").alias("body"),
            F.create_map(F.lit("n"), F.col("id").cast("string")).alias("headers"),
            F.when(F.col("id") % 2 == 0, F.format_string(f"{tag}-%d", "id")).alias("message_id"),
        )
        .cache()
    )


def _write(frame: Any, endpoint: str, stream: str, **options: str) -> None:
    writer = frame.write.format("msggateway").mode("append")
    for key, value in {"endpoint": endpoint, "stream": stream, **options}.items():
        writer = writer.option(key, value)
    writer.save()


async def _stored(connection: dict[str, Any], stream: str) -> list[Any]:
    """Every message of the stream before a sentinel published now (rstream)."""
    async with rstream.Producer(**connection) as producer:
        await producer.send_wait(stream, rstream.AMQPMessage(body=SENTINEL))
    received: list[Any] = []
    done = asyncio.Event()

    async def on_message(message: Any, context: Any) -> None:
        if bytes(message.body) == SENTINEL:
            done.set()
        elif not done.is_set():
            received.append(message)

    consumer = rstream.Consumer(**connection)
    await consumer.start()
    runner: asyncio.Task[None] | None = None
    try:
        first = rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST, None)
        await consumer.subscribe(
            stream, on_message, offset_specification=first, decoder=rstream.amqp_decoder
        )
        runner = asyncio.create_task(consumer.run())
        await done.wait()
    finally:
        await consumer.close()
        if runner is not None:
            runner.cancel()
    return received


def _outcomes(directory: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in directory.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]


def _check_once(messages: list[Any], rows: int, tag: str) -> None:
    bodies = sorted(bytes(m.body) for m in messages)
    assert len(bodies) == rows
    assert bodies == sorted(f"{tag} body {i}".encode() for i in range(rows))
    by_body = {bytes(m.body): m for m in messages}
    seven = by_body[f"{tag} body 7".encode()]
    eight = by_body[f"{tag} body 8".encode()]
    properties = {_str(k): _str(v) for k, v in seven.application_properties.items()}
    assert properties == {"n": "7"}
    assert _str(eight.properties.message_id) == f"{tag}-8"
    assert _str(seven.properties.message_id) == "import-1-0:8"  # producer-partition:position


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- endpoints -------------------------------------------------------------------------------


def test_endpoint_strings() -> None:
    """tcp: and tls: endpoints read as Twisted's clientFromString reads them; others refused."""
    assert parse_endpoint("tcp:host=127.0.0.1:port=5552") == Endpoint("127.0.0.1", 5552)
    assert parse_endpoint("tcp:localhost:5552:timeout=5") == Endpoint("localhost", 5552, timeout=5)
    escaped = parse_endpoint(
        r"tls:host=\:\:1:port=5551:trustRoots=C\:/ca:certificate=/c.pem:privateKey=/k.pem"
    )
    assert escaped == Endpoint(
        "::1", 5551, tls=True, trust_roots="C:/ca", certificate="/c.pem", private_key="/k.pem"
    )
    for bad, says in (
        ("unix:/tmp/s", "only tcp: and tls:"),
        ("tcp:host=h:port=5552:trustRoots=/x", "does not take trustRoots"),
        ("tls:host=h:port=1:bindAddress=x", "does not take bindAddress"),
        ("tcp:host=h", "port and timeout are numbers"),
        ("tcp:port=1", "no host"),
        ("tcp:h:70000", "not a TCP port"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_endpoint(bad)


# --- into the gateway ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_write_twice_into_the_gateway_stores_each_row_once(
    sink: Any, gateway: GatewayProcess, tmp_path: Path
) -> None:
    """20,000 rows in 4 partitions; the same write again stores nothing; outcomes per row."""
    rows, stream = 20_000, f"sink-{uuid.uuid4().hex[:8]}"
    frame = _frame(sink, rows, 4, "g")
    endpoint = _endpoint(gateway.address("streams"))
    _write(frame, endpoint, stream, producer="import-1", outcomes=str(tmp_path / "first"))
    _write(frame, endpoint, stream, producer="import-1", outcomes=str(tmp_path / "again"))
    host, port = gateway.address("streams")
    connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
    _check_once(_run(_stored(connection, stream)), rows, "g")
    first = _outcomes(tmp_path / "first")
    assert len(first) == rows and {r["status"] for r in first} == {"accepted"}
    assert {(r["partition"], r["position"]) for r in first} == {
        (p, i) for p in range(4) for i in range(1, rows // 4 + 1)
    }
    again = _outcomes(tmp_path / "again")
    assert len(again) == rows and {r["status"] for r in again} == {"stored-before"}


@pytest.mark.timeout(300)
def test_write_stream_available_now(sink: Any, gateway: GatewayProcess, tmp_path: Path) -> None:
    """A stream query over a growing Parquet directory: each micro-batch once, one checkpoint."""
    source, stream = tmp_path / "in", f"sink-stream-{uuid.uuid4().hex[:8]}"
    endpoint = _endpoint(gateway.address("streams"))

    def run_query() -> None:
        query = (
            sink.readStream.schema("body BINARY, headers MAP<STRING, STRING>")
            .parquet(str(source))
            .writeStream.format("msggateway")
            .option("endpoint", endpoint)
            .option("stream", stream)
            .option("producer", "query-1")
            .option("batch_size", "50")  # many frames, waits on a small window
            .option("max_unconfirmed", "120")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(240)
        assert query.exception() is None and not query.isActive

    sink.range(0, 300, numPartitions=2).select(
        F.format_string("s body %d", "id").cast("binary").alias("body"),
        F.create_map(F.lit("n"), F.col("id").cast("string")).alias("headers"),
    ).write.mode("append").parquet(str(source))
    run_query()
    sink.range(300, 500, numPartitions=1).select(
        F.format_string("s body %d", "id").cast("binary").alias("body"),
        F.create_map(F.lit("n"), F.col("id").cast("string")).alias("headers"),
    ).write.mode("append").parquet(str(source))
    run_query()
    host, port = gateway.address("streams")
    connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
    stored = sorted(bytes(m.body) for m in _run(_stored(connection, stream)))
    assert stored == sorted(f"s body {i}".encode() for i in range(500))


@pytest.mark.timeout(300)
def test_refused_rows_fail_the_write_and_tls(
    sink: Any, gateway: GatewayProcess, pki: Pki, tmp_path: Path
) -> None:
    """No such stream, or no server: the write fails saying why; TLS with a client certificate."""
    frame = _frame(sink, 50, 2, "t")
    endpoint = _endpoint(gateway.address("streams"))
    outcomes = tmp_path / "refused"
    with pytest.raises(Exception, match=r"50 of 50 rows were not stored .*code 2") as raised:
        _write(frame, endpoint, "nowhere", create_stream="false", outcomes=str(outcomes))
    assert str(outcomes) in str(raised.value)
    recorded = _outcomes(outcomes)
    assert len(recorded) == 50 and {(r["status"], r["code"]) for r in recorded} == {("rejected", 2)}

    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        nowhere = _endpoint(closed.getsockname())
        with pytest.raises(Exception, match=r"partition \d: cannot connect to tcp:127\.0\.0\.1"):
            _write(frame, nowhere, "s", outcomes=str(tmp_path / "unreachable"))
    unreachable = _outcomes(tmp_path / "unreachable")
    assert {r["status"] for r in unreachable} == {"error"} and len(unreachable) >= 25

    host, port = gateway.address("secure")
    secure = (
        f"tls:host=localhost:port={port}:trustRoots={pki.trust_dir}"
        f":certificate={pki.alice_cert}:privateKey={pki.alice_key}"
    )
    stream = f"sink-tls-{uuid.uuid4().hex[:8]}"
    _write(frame, secure, stream, producer="tls")
    connection = {"host": host, "port": gateway.address("streams")[1]}
    connection |= {"username": "guest", "password": "guest"}
    assert len(_run(_stored(connection, stream))) == 50


# --- into RabbitMQ ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_write_twice_into_rabbitmq_stores_each_row_once(
    sink: Any,
    rabbitmq: RabbitMQNode,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """RabbitMQ 3.10: 20,000 rows, written twice under one producer, stored once."""
    rows, stream = 20_000, f"sink-{uuid.uuid4().hex[:8]}"
    frame = _frame(sink, rows, 4, "r")
    endpoint = f"tcp:host={rabbitmq.host}:port={rabbitmq.stream_port}"
    _write(frame, endpoint, stream, producer="import-1")
    _write(frame, endpoint, stream, producer="import-1", outcomes=str(tmp_path / "again"))
    _check_once(_run(_stored(rabbitmq.stream_connection(), stream)), rows, "r")
    assert {r["status"] for r in _outcomes(tmp_path / "again")} == {"stored-before"}


# --- on a cluster ----------------------------------------------------------------------------


def cluster_write(master: str, dataset: str, endpoint: str, stream: str) -> None:
    """The driver of the cluster test (run in a process of its own): Parquet into the stream."""
    from gateway.spark.jobs import spark_session

    spark = spark_session(master, app="msggateway sink on a cluster")
    try:
        register_sink(spark)
        frame = spark.read.parquet(dataset)
        for _ in range(2):  # twice: the second stores nothing
            _write(frame, endpoint, stream, producer="cluster")
    finally:
        spark.stop()


@pytest.mark.timeout(600)
def test_write_on_a_standalone_cluster(gateway: GatewayProcess, sink: Any, tmp_path: Path) -> None:
    """A real master and worker: executors on the worker publish; each row once."""
    dataset = tmp_path / "rows.parquet"
    sink.range(3000, numPartitions=3).select(
        F.format_string("c body %d", "id").alias("body")
    ).write.parquet(str(dataset))
    stream = f"sink-cluster-{uuid.uuid4().hex[:8]}"
    endpoint = _endpoint(gateway.address("streams"))
    cluster = StandaloneCluster(tmp_path / "cluster").start()
    try:
        arguments = (cluster.url, str(dataset), endpoint, stream)
        code = f"from tests.spark.test_sink import cluster_write; cluster_write{arguments!r}"
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=400,
        )
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    finally:
        cluster.stop()
    host, port = gateway.address("streams")
    connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
    stored = sorted(bytes(m.body) for m in _run(_stored(connection, stream)))
    assert stored == sorted(f"c body {i}".encode() for i in range(3000))
    assert any((tmp_path / "cluster" / "work").iterdir())  # the worker ran the tasks
