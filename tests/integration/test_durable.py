"""Durable routes and the log across crashes, end to end.

* QMQP into a durable route is answered K once the message is on disk; the
  gateway is then killed with SIGKILL while the destination (another
  gateway) is down; after both restart, every message arrives.
* The same with the destination up, the forwarder delivering each committed
  batch from memory as it comes: SIGKILL in the middle of the stream, and
  after a restart every message answered K has arrived.
* A durable QMQP route into a local stream, read back with rstream.
* What rstream publishes to a stream is routed on to SSMP from the log.
* SIGKILL while rstream publishes with confirms: after a restart every
  confirmed message is in the stream exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from gateway.codecs import qmqp
from tests.integration.harness import (
    GatewayProcess,
    LineClient,
    read_stream_until,
    stream_connection,
)
from tests.integration.test_qmqp import QMQPSession, mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

# The far side: an SSMP hub whose mail.* topics are kept in a stream we can read.
FAR = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:{port}:interface=127.0.0.1"
schemes = ["open"]

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
FAR_ROUTES = {"keep": 'from = "hub"\nmatch = "mail.#"\nto = "streams"\naddress = "received"\n'}

NEAR = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[upstreams.far]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port={far_port}"
identity = "near"
scheme = "open"
"""
NEAR_ROUTES = {
    "to-far": 'from = "mail"\nmatch = "#@far.example"\nto = "far"\naddress = "mail.{1}"\n'
    'body = "subject"\ndurable = true\n',
    "to-stream": 'from = "mail"\nmatch = "#@stream.example"\nto = "streams"\n'
    'address = "inbox"\ndurable = true\n',
    "events-out": 'from = "streams"\nmatch = "events"\nto = "hub"\naddress = "events"\n',
}


def free_port() -> int:
    """A loopback port that was free a moment ago (for a process started twice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def read_stream(process: GatewayProcess, stream: str, count: int) -> list[Any]:
    """Read ``count`` messages of a stream from the first offset (AMQP decoded)."""
    got: list[Any] = []

    def take(message: Any, _context: Any) -> bool:
        got.append(message)
        return len(got) >= count

    # Created first: routes may not have made it yet.
    await read_stream_until(stream_connection(process), stream, take, create=True)
    return got


async def read_until(process: GatewayProcess, stream: str, wanted: set[bytes]) -> set[bytes]:
    """Read a stream from the first offset until every body in ``wanted`` came; return all."""
    got: set[bytes] = set()

    def take(message: Any, _context: Any) -> bool:
        got.add(bytes(message.body))
        return wanted <= got

    await read_stream_until(stream_connection(process), stream, take)
    return got


def run(coroutine: Any, seconds: float = 60) -> Any:
    """Run a coroutine with a time limit."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


def send_mail(process: GatewayProcess, *recipients: str) -> list[qmqp.ReplyBlock]:
    """Send one message per recipient over QMQP; return the replies."""
    client = QMQPSession(process.address("mail"))
    try:
        client.send(
            b"".join(
                mail(f"m{i}", recipient, subject=f"hello {i}")
                for i, recipient in enumerate(recipients)
            )
            + b"1:D,"
        )
        blocks = client.read_blocks(len(recipients) + 1)
    finally:
        client.close()
    assert blocks[-1] == qmqp.DoneBlock()
    return blocks[:-1]  # type: ignore[return-value]


def test_store_and_forward_survives_sigkill(tmp_path: Path) -> None:
    """K while the destination is down; SIGKILL; after restarts everything arrives."""
    far_port = free_port()
    near = GatewayProcess(
        tmp_path / "near", NEAR.format(far_port=far_port), routes=NEAR_ROUTES
    ).start()
    try:
        replies = send_mail(near, "a@far.example", "b@far.example", "c@far.example")
        assert [reply.status for reply in replies] == [qmqp.K] * 3
    finally:
        near.kill()  # no clean shutdown: what was committed must survive
    far = GatewayProcess(tmp_path / "far", FAR.format(port=far_port), routes=FAR_ROUTES).start()
    near = GatewayProcess(
        tmp_path / "near", NEAR.format(far_port=far_port), routes=NEAR_ROUTES
    ).start()
    try:
        received = run(read_stream(far, "received", 3))
        assert sorted(bytes(m.body) for m in received) == [b"hello 0", b"hello 1", b"hello 2"]
    finally:
        near.stop()
        far.stop()


def test_sigkill_while_forwarding_from_memory(tmp_path: Path) -> None:
    """Destination up, batches forwarded as they commit; SIGKILL mid-stream loses no K."""
    far_port = free_port()
    far = GatewayProcess(tmp_path / "far", FAR.format(port=far_port), routes=FAR_ROUTES).start()
    config = NEAR.format(far_port=far_port)
    near = GatewayProcess(tmp_path / "near", config, routes=NEAR_ROUTES).start()
    try:
        client = QMQPSession(near.address("mail"))
        total = 5000
        payload = b"".join(mail(f"m{i}", "a@far.example", subject=f"n{i}") for i in range(total))

        def send_all() -> None:
            with contextlib.suppress(OSError):  # the gateway may be killed first
                client.send(payload)

        threading.Thread(target=send_all, daemon=True).start()
        acknowledged: list[bytes] = []
        with contextlib.suppress(OSError, EOFError):
            while len(acknowledged) < total // 3:
                for reply in client.read_blocks(1):
                    assert isinstance(reply, qmqp.ReplyBlock) and reply.status == qmqp.K
                    acknowledged.append(reply.id)
        near.kill()  # in the middle of the stream, with batches still being forwarded
        client.close()
        assert len(acknowledged) >= total // 3
        near = GatewayProcess(tmp_path / "near", config, routes=NEAR_ROUTES).start()
        wanted = {b"n" + ident[1:] for ident in acknowledged}
        received = run(read_until(far, "received", wanted))
        assert wanted <= received
    finally:
        near.stop()
        far.stop()


def test_durable_route_into_a_local_stream(tmp_path: Path) -> None:
    """Mail through a durable route lands in a stream, readable with rstream, with its envelope."""
    near = GatewayProcess(tmp_path, NEAR.format(far_port=free_port()), routes=NEAR_ROUTES).start()
    try:
        replies = send_mail(near, "ops@stream.example")
        assert [reply.status for reply in replies] == [qmqp.K]
        [stored] = run(read_stream(near, "inbox", 1))
        assert bytes(stored.body).startswith(b"From: app@example.org\nSubject: hello 0\n")
        properties = {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in (stored.application_properties or {}).items()
        }
        assert properties["x-gateway-sender"] in (b"app@example.org", "app@example.org")
        assert properties["x-gateway-recipients"] in (b"inbox", "inbox")
    finally:
        near.stop()


def test_stream_published_messages_are_routed_on(tmp_path: Path) -> None:
    """What rstream publishes to a routed stream reaches SSMP subscribers, from the log."""
    near = GatewayProcess(tmp_path, NEAR.format(far_port=free_port()), routes=NEAR_ROUTES).start()
    try:
        with LineClient(near.address("hub")) as watcher:
            watcher.send("LOGIN watcher open", "SUBSCRIBE events")
            watcher.expect("200")
            watcher.expect("200")

            async def publish() -> None:
                async with rstream.Producer(**stream_connection(near)) as producer:
                    await producer.create_stream("events", exists_ok=True)
                    await producer.send_wait("events", rstream.AMQPMessage(body=b"disk full"))
                    await producer.send_wait("events", b"raw bytes too")

            run(publish())
            watcher.expect("000 . MCAST events disk full")
            watcher.expect("000 . MCAST events raw bytes too")
    finally:
        near.stop()


def test_confirmed_messages_survive_sigkill(tmp_path: Path) -> None:
    """Every message confirmed before SIGKILL is in the stream once, in order, after restart."""
    config = NEAR.format(far_port=free_port())
    near = GatewayProcess(tmp_path, config, routes=NEAR_ROUTES).start()
    confirmed: list[int] = []
    killed = False

    async def publish_until_killed() -> None:
        nonlocal killed
        with contextlib.suppress(Exception):  # the connection dies with the gateway
            async with rstream.Producer(**stream_connection(near)) as producer:
                await producer.create_stream("crash", exists_ok=True)

                def on_confirm(status: Any) -> None:
                    nonlocal killed
                    if status.is_confirmed:
                        confirmed.append(status.message_id)
                    if len(confirmed) >= 20_000 and not killed:
                        killed = True
                        near.kill()

                for start in range(0, 200_000, 1000):
                    batch = [
                        rstream.AMQPMessage(body=b"%d" % i) for i in range(start, start + 1000)
                    ]
                    await producer.send_batch("crash", batch, on_publish_confirm=on_confirm)
                    await asyncio.sleep(0)  # let confirmations in between batches
                    if killed:
                        break

    run(publish_until_killed())
    assert killed, "the gateway was not killed: too few confirmations came"
    restarted = GatewayProcess(tmp_path, config, routes=NEAR_ROUTES).start()
    try:
        count = len(confirmed)
        got = run(read_stream(restarted, "crash", count))
        bodies = [int(bytes(m.body)) for m in got]
        assert bodies[:count] == list(range(count))  # in order, none missing, no duplicates
    finally:
        restarted.stop()
