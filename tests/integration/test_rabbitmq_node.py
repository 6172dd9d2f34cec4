"""The private RabbitMQ node of the `rabbitmq` fixture, driven by rstream.

rstream (asyncio) talks to the node's stream listener as ``guest``: it
creates a stream, publishes with confirms and consumes from the first
offset. The broker is then restarted, gracefully and by SIGKILL, in the
middle of a stream's life: its messages survive and new ones are
confirmed on the same port. Every wait is an rstream await under a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest

from tests.integration.harness import read_stream_until
from tests.rabbitmq import RabbitMQNode

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

T = TypeVar("T")

COUNT = 1_000
BATCH = 100
DEADLINE_SECONDS = 60.0


def run(coroutine: Awaitable[T], seconds: float = DEADLINE_SECONDS) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


async def publish(node: RabbitMQNode, stream: str, bodies: list[bytes]) -> int:
    """Create the stream if needed, publish bodies in batches; return how many were confirmed."""
    confirmed = 0
    done = asyncio.Event()

    def on_confirm(status: Any) -> None:
        nonlocal confirmed
        if status.is_confirmed:
            confirmed += 1
        if confirmed >= len(bodies):
            done.set()

    async with rstream.Producer(**node.stream_connection()) as producer:
        await producer.create_stream(stream, exists_ok=True)
        for start in range(0, len(bodies), BATCH):
            messages = [rstream.AMQPMessage(body=body) for body in bodies[start : start + BATCH]]
            await producer.send_batch(stream, messages, on_publish_confirm=on_confirm)
        await done.wait()
    return confirmed


async def consume(node: RabbitMQNode, stream: str, count: int) -> list[bytes]:
    """Read ``count`` message bodies from the first offset."""
    received: list[bytes] = []

    def take(message: Any, _context: Any) -> bool:
        received.append(bytes(message.body))
        return len(received) >= count

    await read_stream_until(node.stream_connection(), stream, take)
    return received


def test_publish_confirm_and_consume(rabbitmq: RabbitMQNode, stream_name: str) -> None:
    """1,000 messages are confirmed by the node and read back in order; the CLI sees the stream."""
    bodies = [b"message %d" % i for i in range(COUNT)]

    assert run(publish(rabbitmq, stream_name, bodies)) == COUNT
    assert run(consume(rabbitmq, stream_name, COUNT)) == bodies

    assert rabbitmq.streams()[stream_name] == "running"
    rabbitmq.delete_stream(stream_name)
    assert stream_name not in rabbitmq.streams()


@pytest.mark.parametrize("graceful", [True, False], ids=["rabbitmqctl-stop", "sigkill"])
def test_restart_keeps_streams(rabbitmq: RabbitMQNode, stream_name: str, graceful: bool) -> None:
    """After a restart (clean or a crash) on the same ports, messages remain and more are taken."""
    before = [b"before %d" % i for i in range(COUNT // 2)]
    after = [b"after %d" % i for i in range(COUNT // 2)]
    ports = (rabbitmq.stream_port, rabbitmq.amqp_port, rabbitmq.node_name, rabbitmq.directory)
    assert run(publish(rabbitmq, stream_name, before)) == len(before)

    rabbitmq.restart(graceful=graceful)

    assert rabbitmq.running
    assert (rabbitmq.stream_port, rabbitmq.amqp_port, rabbitmq.node_name, rabbitmq.directory) == (
        ports
    )
    assert run(consume(rabbitmq, stream_name, len(before))) == before
    assert run(publish(rabbitmq, stream_name, after)) == len(after)
    assert run(consume(rabbitmq, stream_name, COUNT)) == before + after
