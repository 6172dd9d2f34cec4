"""Stream listeners of ``[fleet] processes = 2`` in a fleet: each worker reachable on its own port.

One real ``twistd msggateway`` supervising two workers (nodes ``wk-0`` and
``wk-1``) on one RabbitMQ node (a virtual host of this module's own), with
a stream listener and an SSMP hub on port 0: the supervisor holds one
shared port for each, and each worker's stream listener also listens on a
port of its own (``streams/worker`` in its ready line), which its Metadata
and Open advertise. The secrets file holds the fleet's ``relay_secret``.
Checked, as docs/fleet.rst says ("Streams across nodes"):

- Metadata from either worker names the owner worker's own port;
- rstream's Producer and Consumer, in normal mode, connected to the shared
  port, publish and consume streams owned by either worker: they follow
  Metadata to the owner's own port, whichever worker the shared port gave
  them first;
- in load-balancer mode through the shared port too (the kernel spreads
  the reconnections over the workers until one advertises the leader);
- routes from the hub into the stream listener, direct and durable, append
  at the stream's owner whichever worker took the SSMP message: every
  message is in the owner's log once.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Awaitable, Iterator
from contextlib import ExitStack
from typing import Any, Final, TypeVar

import pytest

from gateway.fleet.streams import rendezvous_owner
from tests.integration.harness import GatewayProcess, LineClient
from tests.rabbitmq import RabbitMQNode, StreamAdminClient

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

T = TypeVar("T")

WORKERS: Final = ("wk-0", "wk-1")
OWN: Final = "streams/worker"
COUNT: Final = 500
SENDERS: Final = 24
"""SSMP connections to the shared hub port: all on one worker has a chance of 2 in 2**24."""
JOINED_SECONDS: Final = 15.0

_names = itertools.count()


def owned_by(node: str, prefix: str) -> str:
    """A fresh stream name that worker ``node`` owns (the fleet's rule over both workers)."""
    while True:
        name = f"{prefix}-{next(_names)}-{secrets.token_hex(3)}"
        if rendezvous_owner(name, WORKERS) == node:
            return name


DIRECT_STREAM: Final = owned_by("wk-1", "routed")
DURABLE_STREAM: Final = owned_by("wk-0", "kept")
CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"
secrets = "secrets.toml"

[fleet]
node = "wk"
processes = 2
amqp = "tcp:host=127.0.0.1:port={amqp_port}"
vhost = "{vhost}"
heartbeat_seconds = 2

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""
SECRETS: Final = '[fleet]\nrelay_secret = "a relay secret for the workers of this test"\n'
ROUTES: Final = {
    "direct": f'from = "hub"\nmatch = "direct.#"\nto = "streams"\naddress = "{DIRECT_STREAM}"\n',
    "durable": (
        f'from = "hub"\nmatch = "durable.#"\nto = "streams"\naddress = "{DURABLE_STREAM}"\n'
        "durable = true\n"
    ),
}
_CONNECTIONS: Final = re.compile(r'msggateway_connections\{endpoint="hub",protocol="ssmp"\} (\S+)')


def run(coroutine: Awaitable[T], seconds: float = 60) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway(
    rabbitmq: RabbitMQNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The supervisor and its two workers, each knowing the other; stopped after the module."""
    vhost = f"fleet-workers-{secrets.token_hex(4)}"
    rabbitmq.rabbitmqctl("add_vhost", vhost)
    rabbitmq.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    config = CONFIG.format(amqp_port=rabbitmq.amqp_port, vhost=vhost)
    process = GatewayProcess(
        tmp_path_factory.mktemp("fleet-workers"),
        config,
        routes=ROUTES,
        secrets=SECRETS,
        supervised=True,
    )
    try:
        process.start()
        for node in WORKERS:
            other = next(name for name in WORKERS if name != node)
            process.wait_for_log(f"fleet: node {other} joined", timeout=JOINED_SECONDS)
        yield process
    finally:
        process.stop()
        rabbitmq.rabbitmqctl("delete_vhost", vhost)


def own_port(gateway: GatewayProcess, node: str) -> tuple[str, int]:
    """Worker ``node``'s own stream address, from its ready line."""
    return gateway.workers[WORKERS.index(node)].addresses[OWN]


def admin(address: tuple[str, int]) -> StreamAdminClient:
    """A blocking admin client of a stream listener's address, as guest."""
    return StreamAdminClient(*address, "guest", "guest", timeout=10)


def test_each_worker_has_a_stream_port_of_its_own(gateway: GatewayProcess) -> None:
    """One shared port, two own ports: the ready lines name them."""
    shared = {gateway.workers[index].addresses["streams"] for index in (0, 1)}
    own = {own_port(gateway, node) for node in WORKERS}
    assert len(shared) == 1 and len(own) == 2
    assert not shared & own


def test_metadata_from_either_worker_names_the_owners_own_port(gateway: GatewayProcess) -> None:
    """Asked on either worker's own port, or the shared one: the owner's own port leads."""
    streams = {node: owned_by(node, "metadata") for node in WORKERS}
    with admin(gateway.address("streams")) as client:
        for stream in streams.values():
            assert client.create_stream(stream) == 1
    askers = [own_port(gateway, node) for node in WORKERS] + [gateway.address("streams")] * 4
    for address in askers:
        with admin(address) as client:
            for node, stream in streams.items():
                assert client.metadata(stream) == (1, own_port(gateway, node), []), address


def test_rstream_in_normal_mode_through_the_shared_port(gateway: GatewayProcess) -> None:
    """Producer and Consumer find each stream's owner from Metadata: every message once."""
    streams = [owned_by(node, "normal") for node in WORKERS]
    received = run(_publish_and_consume(gateway.address("streams"), streams, balanced=False))
    for stream in streams:
        assert sorted(received[stream]) == sorted(f"{stream}:{i}".encode() for i in range(COUNT))


def test_rstream_in_load_balancer_mode_through_the_shared_port(gateway: GatewayProcess) -> None:
    """Reconnecting through the shared port until the worker it lands on leads the stream."""
    streams = [owned_by(node, "balanced") for node in WORKERS]
    received = run(_publish_and_consume(gateway.address("streams"), streams, balanced=True))
    for stream in streams:
        assert sorted(received[stream]) == sorted(f"{stream}:{i}".encode() for i in range(COUNT))


async def _publish_and_consume(
    address: tuple[str, int], streams: list[str], *, balanced: bool
) -> dict[str, list[bytes]]:
    host, port = address
    connection: dict[str, Any] = {
        "host": host,
        "port": port,
        "username": "guest",
        "password": "guest",
        "load_balancer_mode": balanced,
    }
    confirmed = 0
    all_confirmed = asyncio.Event()

    def on_confirm(status: Any) -> None:
        nonlocal confirmed
        if status.is_confirmed:
            confirmed += 1
        if confirmed >= COUNT * len(streams):
            all_confirmed.set()

    async with rstream.Producer(**connection) as producer:
        for stream in streams:
            await producer.create_stream(stream, exists_ok=True)
            batch = [rstream.AMQPMessage(body=f"{stream}:{i}".encode()) for i in range(COUNT)]
            await producer.send_batch(stream, batch, on_publish_confirm=on_confirm)
        await asyncio.wait_for(all_confirmed.wait(), 30)
    return await _consume(connection, streams, COUNT)


async def _consume(
    connection: dict[str, Any], streams: list[str], count: int
) -> dict[str, list[bytes]]:
    received: dict[str, list[bytes]] = {stream: [] for stream in streams}
    everything = asyncio.Event()

    async def on_message(body: Any, context: Any) -> None:
        received[context.stream].append(_body(body))
        if all(len(bodies) >= count for bodies in received.values()):
            everything.set()

    async with rstream.Consumer(**connection) as consumer:
        for stream in streams:
            await consumer.subscribe(
                stream,
                on_message,
                decoder=rstream.amqp_decoder,
                offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
            )
        await asyncio.wait_for(everything.wait(), 30)
        await asyncio.sleep(0.5)  # anything delivered twice would come now
    return received


def _body(message: Any) -> bytes:
    body = message.body
    if isinstance(body, list):
        return b"".join(bytes(part) for part in body)
    return bytes(body)


def test_routes_append_at_the_owner_from_every_worker(gateway: GatewayProcess) -> None:
    """SSMP messages taken by both workers: all of them in the owner's log, once."""
    sent: list[bytes] = []
    with ExitStack() as stack:
        for number in range(SENDERS):
            client = stack.enter_context(LineClient(gateway.address("hub")))
            client.send(f"LOGIN sender{number} open")
            client.expect("200")
            for kind in ("direct", "durable"):
                client.send(f"MCAST {kind}.x {kind}-{number}")
                client.expect("200")
            sent.append(f"{number}".encode())
        took = {
            index: int(float(found.group(1)))
            for index in (0, 1)
            if (found := _CONNECTIONS.search(gateway.metrics(worker=index)))
        }
    assert all(took.get(index, 0) > 0 for index in (0, 1)), took  # both workers routed some
    for stream, kind, owner in (
        (DIRECT_STREAM, "direct", "wk-1"),
        (DURABLE_STREAM, "durable", "wk-0"),
    ):
        connection = {"host": own_port(gateway, owner)[0], "port": own_port(gateway, owner)[1]}
        connection.update(username="guest", password="guest")
        received = run(_consume(connection, [stream], SENDERS))
        expected = sorted(f"{kind}-{number}".encode() for number in range(SENDERS))
        assert sorted(received[stream]) == expected


def test_no_worker_logged_a_failure(gateway: GatewayProcess) -> None:
    """After all of the above: no traceback, no unhandled error in any line."""
    output = gateway.output()
    assert "Traceback" not in output and "Unhandled" not in output, output
