"""The stream listener against rstream, a RabbitMQ Stream client we did not write.

A real gateway process (twistd) serves the stream protocol over its embedded
log; rstream (asyncio) connects as it would to RabbitMQ: creates a stream,
publishes 100,000 messages with confirms, consumes them from the first
offset, from an offset and from a timestamp, stores and queries an offset,
and publishes twice with the same publisher name and ids without getting
duplicates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from tests.integration.harness import GatewayProcess, read_stream_until, stream_connection

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

T = TypeVar("T")

CONFIG = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[log]
fsync = "always"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""

COUNT = 100_000
BATCH = 1_000


def run(coroutine: Awaitable[T], seconds: float = 120) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with a stream listener where guest/guest may log in from loopback."""
    process = GatewayProcess(tmp_path_factory.mktemp("streams"), CONFIG).start()
    yield process
    process.stop()


async def publish(gateway: GatewayProcess, stream: str, bodies: list[bytes], **send: Any) -> int:
    """Publish bodies in batches; return how many were confirmed."""
    confirmed = 0
    done = asyncio.Event()

    def on_confirm(status: Any) -> None:
        nonlocal confirmed
        if status.is_confirmed:
            confirmed += 1
        if confirmed >= len(bodies):
            done.set()

    async with rstream.Producer(**stream_connection(gateway)) as producer:
        await producer.create_stream(stream, exists_ok=True)
        for start in range(0, len(bodies), BATCH):
            messages = [rstream.AMQPMessage(body=body) for body in bodies[start : start + BATCH]]
            await producer.send_batch(stream, messages, on_publish_confirm=on_confirm, **send)
        await done.wait()
    return confirmed


async def consume(
    gateway: GatewayProcess,
    stream: str,
    spec: Any,
    until: Callable[[list[tuple[int, int, bytes]]], bool],
) -> list[tuple[int, int, bytes]]:
    """Subscribe with an offset specification; collect (offset, timestamp, body) until done."""
    received: list[tuple[int, int, bytes]] = []

    def take(message: Any, context: Any) -> bool:
        received.append((context.offset, context.timestamp, bytes(message.body)))
        return until(received)

    await read_stream_until(stream_connection(gateway), stream, take, offset=spec)
    return received


def message(body: bytes, publishing_id: int) -> Any:
    """An AMQP message with the publishing id we choose (rstream picks one otherwise)."""
    made = rstream.AMQPMessage(body=body)
    made.publishing_id = publishing_id
    return made


def spec(kind: str, value: int | None = None) -> Any:
    """An rstream offset specification."""
    return rstream.ConsumerOffsetSpecification(getattr(rstream.OffsetType, kind), value)


def test_publish_and_consume_a_hundred_thousand(gateway: GatewayProcess) -> None:
    """100,000 messages are confirmed, then read back in order from first, offset, timestamp."""
    bodies = [b"message %d" % i for i in range(COUNT)]
    assert run(publish(gateway, "orders", bodies)) == COUNT

    everything = run(consume(gateway, "orders", spec("FIRST"), lambda got: len(got) >= COUNT))
    assert [body for _, _, body in everything] == bodies
    offsets = [offset for offset, _, _ in everything]
    assert offsets == sorted(offsets) and len(set(offsets)) == COUNT

    middle = offsets[COUNT // 2]
    tail = run(
        consume(gateway, "orders", spec("OFFSET", middle), lambda got: got[-1][0] == offsets[-1])
    )
    assert tail[0][0] == middle  # rstream drops the chunk's messages before the offset
    assert [body for _, _, body in tail] == bodies[COUNT // 2 :]

    # Chunk timestamps are commit times: from a timestamp, every message at
    # or after it comes, and nothing from an earlier chunk.
    timestamps = [timestamp for _, timestamp, _ in everything]
    since = timestamps[COUNT * 3 // 4]
    expected = [body for (_, timestamp, body) in everything if timestamp >= since]
    later = run(
        consume(gateway, "orders", spec("TIMESTAMP", since), lambda got: got[-1][0] == offsets[-1])
    )
    assert [body for _, _, body in later] == expected
    assert min(timestamp for _, timestamp, _ in later) >= since


def test_store_and_query_offset(gateway: GatewayProcess) -> None:
    """An offset stored under a name is returned by query_offset, also on a new connection."""

    async def scenario() -> tuple[int, bool]:
        async with rstream.Producer(**stream_connection(gateway)) as producer:
            await producer.create_stream("tracked", exists_ok=True)
            await producer.send_wait("tracked", rstream.AMQPMessage(body=b"x"))
        consumer = rstream.Consumer(**stream_connection(gateway))
        await consumer.start()
        missing = False
        try:
            await consumer.query_offset("tracked", "reader-1")
        except rstream.OffsetNotFound:
            missing = True
        await consumer.store_offset("tracked", "reader-1", 42)
        await consumer.close()
        # StoreOffset has no answer: a query on a new connection shows it arrived.
        again = rstream.Consumer(**stream_connection(gateway))
        await again.start()
        try:
            return await again.query_offset("tracked", "reader-1"), missing
        finally:
            await again.close()

    stored, missing = run(scenario())
    assert missing
    assert stored == 42


def test_deduplication_by_publisher_name(gateway: GatewayProcess) -> None:
    """Publishing the same ids twice under one publisher name stores them once."""

    async def send_twice() -> None:
        for _ in range(2):
            async with rstream.Producer(**stream_connection(gateway)) as producer:
                await producer.create_stream("dedup", exists_ok=True)
                messages = [message(b"d%d" % i, i) for i in range(1, 101)]
                await producer.send_batch("dedup", messages, publisher_name="p1")
                await producer.send_wait("dedup", message(b"d100", 100), publisher_name="p1")

    run(send_twice())
    got = run(consume(gateway, "dedup", spec("FIRST"), lambda got: len(got) >= 100))
    assert [body for _, _, body in got] == [b"d%d" % i for i in range(1, 101)]

    async def sequence() -> int:
        async with rstream.Producer(**stream_connection(gateway)) as producer:
            await producer.create_stream("dedup", exists_ok=True)
            await producer.send_wait(
                "dedup", rstream.AMQPMessage(body=b"d101"), publisher_name="p1"
            )
        return 0

    run(sequence())  # resumes after 100: the next id rstream picks is 101
    after = run(consume(gateway, "dedup", spec("FIRST"), lambda got: len(got) >= 101))
    assert [body for _, _, body in after][-1] == b"d101"
    assert len(after) == 101


def test_sub_entry_batches(gateway: GatewayProcess) -> None:
    """Rstream's sub-entry batching, plain and gzip: confirmed, and consumed record by record."""
    stream = "sub-entries"
    batches = [
        ([f"plain-{i}".encode() for i in range(100)], rstream.CompressionType.No),
        ([f"gzip-{i}".encode() for i in range(100)], rstream.CompressionType.Gzip),
    ]

    async def send() -> int:
        confirmed = 0
        done = asyncio.Event()

        def on_confirm(status: Any) -> None:
            nonlocal confirmed
            confirmed += 1 if status.is_confirmed else 0
            if confirmed == len(batches):
                done.set()

        async with rstream.Producer(**stream_connection(gateway)) as producer:
            await producer.create_stream(stream, exists_ok=True)
            for bodies, compression in batches:
                await producer.send_sub_entry(
                    stream,
                    [rstream.AMQPMessage(body=body) for body in bodies],
                    compression_type=compression,
                    on_publish_confirm=on_confirm,
                )
            await done.wait()
        return confirmed

    assert run(send()) == 2
    received = run(consume(gateway, stream, spec("FIRST"), lambda got: len(got) >= 200))
    assert [offset for offset, _, _ in received] == list(range(200))
    assert [body for _, _, body in received] == batches[0][0] + batches[1][0]
