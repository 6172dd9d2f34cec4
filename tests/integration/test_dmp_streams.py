"""Streams into a DMP feed, end to end: rstream publishes, a raw DMP reader reads.

A gateway under twistd has a stream listener over its embedded log and a DMP
listener with feed ``alerts``; a route takes what is published to the stream
``events`` to that feed. Messages are published (and confirmed: committed to
the log) before the feed has a reader: the route's forwarder gets *retry
later* and delivers them, in order, once a reader attaches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.harness import GatewayProcess
from tests.integration.test_dmp import Peer

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
feeds = ["alerts"]

[listeners.dmp.leases]
reader = { feed = "alerts", text = "lease-r" }
"""
ROUTES = {"events": 'from = "streams"\nmatch = "events"\nto = "dmp"\naddress = "alerts"\n'}


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway with the stream-to-feed route."""
    process = GatewayProcess(tmp_path_factory.mktemp("dmp-streams"), CONFIG, routes=ROUTES).start()
    yield process
    process.stop()


async def publish(gateway: GatewayProcess, bodies: list[bytes]) -> int:
    """Publish to ``events``; return how many were confirmed."""
    host, port = gateway.address("streams")
    confirmed = 0
    done = asyncio.Event()

    def on_confirm(status: Any) -> None:
        nonlocal confirmed
        confirmed += bool(status.is_confirmed)
        if confirmed >= len(bodies):
            done.set()

    arguments = {"host": host, "port": port, "username": "guest", "password": "guest"}
    async with rstream.Producer(**arguments) as producer:
        await producer.create_stream("events", exists_ok=True)
        messages = [rstream.AMQPMessage(body=body) for body in bodies]
        await producer.send_batch("events", messages, on_publish_confirm=on_confirm)
        await done.wait()
    return confirmed


def test_published_before_the_reader_reaches_it_in_order(gateway: GatewayProcess) -> None:
    """Three confirmed messages wait in the log, then reach the feed's reader in order."""
    bodies = [b"first", b"second", b"third"]
    assert asyncio.run(asyncio.wait_for(publish(gateway, bodies), 60)) == 3
    reader = Peer(gateway.address("dmp"))
    try:
        assert reader.open(b"lease-r")[1] == b'200 OK Ready to read from "alerts"'
        reader.sock.settimeout(30)  # the forwarder's retry delay grows from 0.5 s
        got = [reader.envelope() for _ in bodies]
    finally:
        reader.close()
    assert [envelope["body"] for envelope in got] == bodies
    assert {envelope["routing_key"] for envelope in got} == {"alerts"}
