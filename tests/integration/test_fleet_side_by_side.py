"""Two gateways with one configuration, side by side on one RabbitMQ: nothing acknowledged is lost.

Each gateway has an SSMP hub routed directly to a RabbitMQ stream upstream,
and a QMQP listener on a durable route into RabbitMQ; their configurations
are the same text, in two directories (so two data dirs, and ports the system
chose). Both are fed at the same time, then rstream reads the two streams
from RabbitMQ: every message a gateway acknowledged (SSMP 200, QMQP K) must
be stored exactly once.

RabbitMQ keeps one last publishing id per publisher reference and stream,
and drops a message whose id is not above it. Each gateway numbers its ids
on its own (a durable route's are its log's offsets, the same in both), so
two processes under one reference lose about half of what they acknowledged;
each process's node id in its references (`gateway.fleet.node`) keeps them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import pytest

from gateway.codecs import qmqp
from gateway.fleet.node import NODE_ID_FILE
from tests.integration.harness import GatewayProcess, LineClient, read_stream_until
from tests.integration.test_qmqp import QMQPSession, mail

pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

MESSAGES: Final = 2000
"""Messages per gateway and protocol: enough for both to publish at once, small enough for CI."""
FEED_SECONDS: Final = 30.0
"""The longest one read of a feeder may wait (all of them take a few seconds)."""
READ_SECONDS: Final = 10.0
"""How long reading a stream back may wait for what is missing (only a failure waits it out)."""

CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

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
"""


def routes(ticks: str, mails: str) -> dict[str, str]:
    """SSMP ``ticks`` directly into stream ``ticks``; mail, durably, into stream ``mails``."""
    return {
        "ticks-direct": f'from = "hub"\nmatch = "ticks"\nto = "rabbit"\naddress = "{ticks}"\n',
        "mail-durable": f'from = "mail"\nmatch = "#@example.org"\nto = "rabbit"\n'
        f'address = "{mails}"\ndurable = true\n',
    }


def feed_ssmp(process: GatewayProcess, tag: str, start: threading.Barrier) -> list[str]:
    """MCAST ``MESSAGES`` pipelined ticks (bodies ``<tag>-<i>``); return the bodies answered 200.

    One tick goes first, alone, so that the gateway's publisher is declared
    before ``start``, as it is on a gateway that has been running a while.
    """
    bodies = [f"{tag}-{i}" for i in range(MESSAGES)]
    with LineClient(process.address("hub"), timeout=FEED_SECONDS) as client:
        client.send(f"LOGIN feeder-{tag} open", f"MCAST ticks {bodies[0]}")
        client.expect_code(200)
        first = client.read_line()
        start.wait()
        # Written by another thread while this one reads the replies, in order.
        writer = threading.Thread(
            target=client.send, args=[f"MCAST ticks {body}" for body in bodies[1:]]
        )
        writer.start()
        replies = [first, *client.read_lines(MESSAGES - 1)]
        writer.join()
    return [body for body, reply in zip(bodies, replies, strict=True) if reply[:3] == b"200"]


def feed_qmqp(process: GatewayProcess, tag: str, start: threading.Barrier) -> list[str]:
    """Send ``MESSAGES`` mails (subjects ``<tag>-<i>``); return the subjects answered K.

    The first mail goes alone in a session of its own before ``start``, the
    others pipelined in one session after it.
    """
    subjects = [f"{tag}-{i}" for i in range(MESSAGES)]
    blocks = _mail(process, subjects[:1], None)
    return [
        block.id.decode()
        for block in [*blocks, *_mail(process, subjects[1:], start)]
        if isinstance(block, qmqp.ReplyBlock) and block.status == qmqp.K
    ]


def _mail(
    process: GatewayProcess, subjects: list[str], start: threading.Barrier | None
) -> list[qmqp.Block]:
    """One QMQP session sending a mail per subject, after ``start``; the replies."""
    data = b"".join(mail(subject, "ops@example.org", subject=subject) for subject in subjects)
    client = QMQPSession(process.address("mail"))
    try:
        if start is not None:
            start.wait()
        writer = threading.Thread(target=client.send, args=(data + b"1:D,",))
        writer.start()
        blocks = client.read_blocks(len(subjects) + 1)
        writer.join()
    finally:
        client.close()
    assert blocks[-1] == qmqp.DoneBlock()
    return blocks[:-1]


def subject(body: bytes) -> str:
    """A mail's subject (the feeder's id for it)."""
    return body.split(b"Subject: ", 1)[1].split(b"\n", 1)[0].decode()


async def create(connection: dict[str, Any], *streams: str) -> None:
    """Create streams in RabbitMQ, as they are on a broker in use."""
    import rstream

    async with rstream.Producer(**connection) as producer:
        for stream in streams:
            await producer.create_stream(stream, exists_ok=True)


async def stored(
    connection: dict[str, Any], stream: str, key: Callable[[bytes], str], wanted: set[str]
) -> Counter[str]:
    """How often each message is in ``stream``: read until all of ``wanted`` came, or time is up."""
    counts: Counter[str] = Counter()

    def take(message: Any, _context: Any) -> bool:
        counts[key(bytes(message.body))] += 1
        return wanted <= counts.keys()

    with contextlib.suppress(TimeoutError):  # what is missing is reported by the caller
        await asyncio.wait_for(
            read_stream_until(connection, stream, take, create=True), READ_SECONDS
        )
    return counts


def report(what: str, acknowledged: list[str], counts: Counter[str]) -> str:
    """One line of figures: acknowledged, stored, missing, stored twice."""
    missing = set(acknowledged) - counts.keys()
    twice = sum(1 for count in counts.values() if count > 1)
    return (
        f"{what}: {len(acknowledged)} acknowledged, {sum(counts.values())} stored,"
        f" {len(missing)} acknowledged but missing, {twice} stored more than once"
    )


def test_two_gateways_with_one_configuration_lose_nothing(
    rabbitmq: Any, stream_name: str, tmp_path: Path
) -> None:
    """Fed at once, two gateways store every acknowledged message once, under their own ids."""
    ticks, mails = f"{stream_name}-ticks", f"{stream_name}-mail"
    config = CONFIG.format(port=rabbitmq.stream_connection()["port"])
    asyncio.run(create(rabbitmq.stream_connection(), ticks, mails))
    gateways = {
        tag: GatewayProcess(tmp_path / tag, config, routes=routes(ticks, mails))
        for tag in ("a", "b")
    }
    try:
        with ThreadPoolExecutor() as pool:  # side by side; a failed start raises here
            list(pool.map(GatewayProcess.start, gateways.values()))
        for process in gateways.values():
            process.wait_for_log("upstream rabbit: connected")
        start = threading.Barrier(2 * len(gateways))
        acknowledged: dict[str, list[str]] = {"ssmp": [], "qmqp": []}
        finished: list[str] = []

        def feed(protocol: str, tag: str, process: GatewayProcess) -> None:
            feeder = feed_ssmp if protocol == "ssmp" else feed_qmqp
            acknowledged[protocol].extend(feeder(process, tag, start))
            finished.append(f"{protocol} {tag}")

        feeders = [
            threading.Thread(target=feed, args=(protocol, tag, process))
            for tag, process in gateways.items()
            for protocol in acknowledged
        ]
        for feeder in feeders:
            feeder.start()
        for feeder in feeders:
            feeder.join(FEED_SECONDS * 2)
        assert len(finished) == len(feeders), f"only {finished} finished (errors are above)"
        direct, durable = acknowledged["ssmp"], acknowledged["qmqp"]

        async def read_both() -> tuple[Counter[str], Counter[str]]:
            connection = rabbitmq.stream_connection()
            return await asyncio.gather(
                stored(connection, ticks, bytes.decode, set(direct)),
                stored(connection, mails, subject, set(durable)),
            )

        direct_counts, durable_counts = asyncio.run(read_both())
        figures = "\n".join(
            (
                report("SSMP MCAST, direct route", direct, direct_counts),
                report("QMQP, durable route", durable, durable_counts),
            )
        )
        # Nearly everything is acknowledged (a direct route may answer "retry
        # later" while its upstream is busy): what was, is stored, once.
        assert len(direct) > MESSAGES and len(durable) == 2 * MESSAGES, figures
        assert set(direct) <= direct_counts.keys(), figures
        assert set(durable) <= durable_counts.keys(), figures
        assert max(direct_counts.values()) == 1, figures
        assert max(durable_counts.values()) == 1, figures
        # Each has a node id of its own, kept in its data dir and shown in /metrics.
        nodes = {
            (p.directory / "data" / NODE_ID_FILE).read_text().strip(): p for p in gateways.values()
        }
        assert len(nodes) == len(gateways)
        for node, process in nodes.items():
            assert f'msggateway_node_info{{node="{node}"}} 1.0' in process.metrics()
    finally:
        for process in gateways.values():
            process.stop()
