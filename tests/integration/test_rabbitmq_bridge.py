"""The gateway against a real RabbitMQ 3.10 with the stream plugin.

SSMP and QMQP clients send through the gateway into RabbitMQ streams, and
rstream, reading RabbitMQ directly, sees exactly those messages with bodies
and properties intact; what rstream publishes to RabbitMQ reaches SSMP
subscribers through the gateway. Then RabbitMQ is restarted in the middle of
a stream: a durable route loses and duplicates nothing, a direct one answers
"retry later" while the broker is away and never accepts falsely.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, LineClient, read_stream_until
from tests.integration.test_qmqp import QMQPSession, mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
subscribe = ["{inbound}"]
offset = "first"
store_offset_interval_seconds = 0.5
"""


def routes(stream: str, inbound: str) -> dict[str, str]:
    """SSMP topic and mail into ``stream`` (direct and durable), ``inbound`` out to SSMP."""
    return {
        "topic-direct": f'from = "hub"\nmatch = "ticks"\nto = "rabbit"\naddress = "{stream}"\n',
        "topic-durable": f'from = "hub"\nmatch = "ticks.durable"\nto = "rabbit"\n'
        f'address = "{stream}"\ndurable = true\n',
        "mail-direct": f'from = "mail"\nmatch = "#@direct.example"\nto = "rabbit"\n'
        f'address = "{stream}"\n',
        "mail-durable": f'from = "mail"\nmatch = "#@durable.example"\nto = "rabbit"\n'
        f'address = "{stream}"\ndurable = true\n',
        "inbound": f'from = "rabbit"\nmatch = "{inbound}"\nto = "hub"\naddress = "from-rabbit"\n',
    }


@pytest.fixture
def gateway(rabbitmq: Any, stream_name: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway whose stream upstream is the test's RabbitMQ node."""
    port = rabbitmq.stream_connection()["port"]
    inbound = stream_name + "-in"
    config = CONFIG.format(port=port, inbound=inbound)
    process = GatewayProcess(tmp_path, config, routes=routes(stream_name, inbound)).start()
    try:
        process.wait_for_log("upstream rabbit: connected")
        yield process
    finally:
        process.stop()


def run(coroutine: Any, seconds: float = 90) -> Any:
    """Run a coroutine with a time limit."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


async def read(rabbitmq: Any, stream: str, until: Callable[[list[Any]], bool]) -> list[Any]:
    """Read a RabbitMQ stream from the first offset with rstream until ``until(got)``."""
    got: list[Any] = []

    def take(message: Any, _context: Any) -> bool:
        got.append(message)
        return until(got)

    # Created first: the gateway may not have yet.
    await read_stream_until(rabbitmq.stream_connection(), stream, take, create=True)
    return got


def count(n: int) -> Callable[[list[Any]], bool]:
    """Read until ``n`` messages came."""
    return lambda got: len(got) >= n


def properties(message: Any) -> dict[str, Any]:
    """Rstream's application properties with text keys and values."""

    def text(value: Any) -> Any:
        return value.decode() if isinstance(value, bytes) else value

    return {text(k): text(v) for k, v in (message.application_properties or {}).items()}


def test_ssmp_and_qmqp_into_rabbitmq(
    gateway: GatewayProcess, rabbitmq: Any, stream_name: str
) -> None:
    """MCAST and mail reach the RabbitMQ stream; the 200 and the K come after the confirm."""
    with LineClient(gateway.address("hub")) as publisher:
        publisher.send("LOGIN sensor-7 open", "MCAST ticks price 42", "MCAST ticks.durable safe")
        publisher.expect("200")
        publisher.expect("200")
        publisher.expect("200")
    client = QMQPSession(gateway.address("mail"))
    try:
        client.send(mail("q1", "ops@direct.example", subject="hi") + b"1:D,")
        reply, done = client.read_blocks(2)
        assert isinstance(reply, qmqp.ReplyBlock) and reply.status == qmqp.K
        assert done == qmqp.DoneBlock()
    finally:
        client.close()
    messages = run(read(rabbitmq, stream_name, count(3)))
    bodies = sorted(bytes(message.body) for message in messages)
    assert bodies[1:] == [b"price 42", b"safe"]
    assert bodies[0].startswith(b"From: app@example.org\nSubject: hi\n")
    by_body = {bytes(message.body): message for message in messages}
    assert properties(by_body[b"price 42"])["x-gateway-sender"] == "sensor-7"
    mailed = next(m for m in messages if bytes(m.body).startswith(b"From:"))
    assert properties(mailed)["x-gateway-sender"] == "app@example.org"


def test_rabbitmq_to_ssmp(gateway: GatewayProcess, rabbitmq: Any, stream_name: str) -> None:
    """What rstream publishes to RabbitMQ reaches the gateway's SSMP subscribers."""
    with LineClient(gateway.address("hub")) as watcher:
        watcher.send("LOGIN watcher open", "SUBSCRIBE from-rabbit")
        watcher.expect("200")
        watcher.expect("200")

        async def publish() -> None:
            async with rstream.Producer(**rabbitmq.stream_connection()) as producer:
                await producer.create_stream(stream_name + "-in", exists_ok=True)
                await producer.send_wait(
                    stream_name + "-in",
                    rstream.AMQPMessage(body=b"from rstream", application_properties={"k": "v"}),
                )

        run(publish())
        watcher.expect("000 . MCAST from-rabbit from rstream")


def test_rabbitmq_replica_consumer_falls_back_to_the_leader(
    rabbitmq: Any, stream_name: str, tmp_path: Path
) -> None:
    """consume_from = "replica" on a single node reads from the leader over its own link."""
    port = rabbitmq.stream_connection()["port"]
    inbound = stream_name + "-in"
    config = CONFIG.format(port=port, inbound=inbound) + 'consume_from = "replica"\n'
    process = GatewayProcess(tmp_path, config, routes=routes(stream_name, inbound)).start()
    try:
        process.wait_for_log("upstream rabbit: connected")
        process.wait_for_log("upstream rabbit.consumer: connected")
        with LineClient(process.address("hub")) as watcher:
            watcher.send("LOGIN watcher open", "SUBSCRIBE from-rabbit", "MCAST ticks out")
            watcher.expect("200")
            watcher.expect("200")
            watcher.expect("200")  # published over the leader link, after the confirm

            async def publish() -> None:
                async with rstream.Producer(**rabbitmq.stream_connection()) as producer:
                    await producer.create_stream(inbound, exists_ok=True)
                    await producer.send_wait(inbound, rstream.AMQPMessage(body=b"via replica"))

            run(publish())
            watcher.expect("000 . MCAST from-rabbit via replica")
        assert [bytes(m.body) for m in run(read(rabbitmq, stream_name, count(1)))] == [b"out"]
    finally:
        process.stop()


@pytest.mark.timeout(300)
def test_broker_restart(gateway: GatewayProcess, rabbitmq: Any, stream_name: str) -> None:
    """Durable: every K'd message arrives once; direct: Z and SSMP 400 retry while it is away."""
    client = QMQPSession(gateway.address("mail"))
    try:
        before = [mail(f"d{i}", "ops@durable.example", subject=f"d{i}") for i in range(50)]
        client.send(b"".join(before))
        assert [b.status for b in client.read_blocks(50)] == [qmqp.K] * 50  # type: ignore[union-attr]
        rabbitmq.stop_broker()  # same ports and data when it starts again
        try:
            gateway.wait_for_log("upstream rabbit: connection lost")
            # While RabbitMQ is away: durable mail is still K (on disk here),
            # direct mail is Z (retry later), never K.
            client.send(
                b"".join(mail(f"e{i}", "ops@durable.example", subject=f"e{i}") for i in range(50))
                + mail("direct-while-down", "ops@direct.example")
            )
            replies = {b.id: b for b in client.read_blocks(51)}  # type: ignore[union-attr]
            assert replies[b"direct-while-down"].status == qmqp.Z  # type: ignore[union-attr]
            assert {r.status for k, r in replies.items() if k.startswith(b"e")} == {qmqp.K}  # type: ignore[union-attr]
            # An SSMP publisher on the direct route hears "retry" (400), not 200.
            with LineClient(gateway.address("hub")) as publisher:
                publisher.send("LOGIN sensor-8 open", "MCAST ticks while down")
                publisher.expect("200")
                answer = publisher.expect_code(400)
                assert answer.startswith(b"400 retry: "), answer
        finally:
            rabbitmq.start()  # the session's node must be running again, whatever happened
        client.send(b"1:D,")
        assert client.read_blocks(1) == [qmqp.DoneBlock()]
    finally:
        client.close()
    messages = run(read(rabbitmq, stream_name, count(100)), seconds=180)

    # Then a last message straight from rstream: anything the gateway had
    # published twice would be in the stream before it.
    async def sentinel() -> None:
        async with rstream.Producer(**rabbitmq.stream_connection()) as producer:
            await producer.send_wait(stream_name, rstream.AMQPMessage(body=b"the end"))

    run(sentinel())
    everything = run(
        read(rabbitmq, stream_name, lambda got: bytes(got[-1].body) == b"the end"), seconds=120
    )
    gateway_messages = [m for m in everything if bytes(m.body) != b"the end"]
    subjects = sorted(
        bytes(m.body).split(b"Subject: ")[1].split(b"\n")[0].decode() for m in gateway_messages
    )
    assert subjects == sorted([f"d{i}" for i in range(50)] + [f"e{i}" for i in range(50)])
    assert len({m.properties.message_id for m in gateway_messages}) == 100
    assert len(messages) == 100
