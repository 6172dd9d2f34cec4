"""The stream listener in a fleet: two ``twistd msggateway`` nodes on one RabbitMQ node.

Both nodes (``gw-a``, ``gw-b``) share one configuration but their node
ids, on a virtual host of this module's own (the session's RabbitMQ is
shared with other modules), each with a stream listener on a port of its
own. The streams used are chosen so that the owner (by the fleet's rule,
`gateway.fleet.streams.rendezvous_owner`) is known. Checked, as
docs/fleet.rst says: Metadata from either node names the owner; a publisher
on the other node lands at the owner, exactly once with deduplication
(through the gateway's own blocking client); Subscribe there is refused
with code 6 (stream not available), as RabbitMQ refuses a consumer on a
node with no member of the stream; and rstream's Producer and Consumer in
load-balancer mode, through one address (a round-robin TCP balancer in
front of both nodes, as a fleet on many hosts has), publish and consume
every message once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, Final, TypeVar

import pytest

from gateway.codecs import stream as sp
from gateway.fleet.streams import rendezvous_owner
from gateway.protocols.stream.blocking import BlockingStreamClient
from tests.integration.harness import GatewayProcess
from tests.rabbitmq import RabbitMQNode, StreamAdminClient

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

T = TypeVar("T")

NODES: Final = ("gw-a", "gw-b")
CONFIG: Final = """
[gateway]
data_dir = "data"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[fleet]
node = "{node}"
amqp = "tcp:host=127.0.0.1:port={amqp_port}"
vhost = "{vhost}"
heartbeat_seconds = 2

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
JOINED_SECONDS: Final = 10.0
COUNT: Final = 2_000
BATCH: Final = 200
NOT_AVAILABLE: Final = 6


def run(coroutine: Awaitable[T], seconds: float = 60) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fleet(
    rabbitmq: RabbitMQNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, GatewayProcess]]:
    """Two nodes of one fleet, each knowing the other; stopped after the module."""
    vhost = f"fleet-streams-{secrets.token_hex(4)}"
    rabbitmq.rabbitmqctl("add_vhost", vhost)
    rabbitmq.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    directory = tmp_path_factory.mktemp("fleet-streams")
    started: dict[str, GatewayProcess] = {}
    try:
        for node in NODES:
            config = CONFIG.format(node=node, amqp_port=rabbitmq.amqp_port, vhost=vhost)
            started[node] = GatewayProcess(directory / node, config).start()
        for node, process in started.items():
            other = next(name for name in NODES if name != node)
            process.wait_for_log(f"fleet: node {other} joined", timeout=JOINED_SECONDS)
        yield started
    finally:
        for process in started.values():
            process.stop()
        rabbitmq.rabbitmqctl("delete_vhost", vhost)


_names = itertools.count()


def owned_by(node: str, prefix: str) -> str:
    """A fresh stream name that ``node`` owns (the fleet's rule over both nodes)."""
    while True:
        name = f"{prefix}-{next(_names)}-{secrets.token_hex(3)}"
        if rendezvous_owner(name, NODES) == node:
            return name


def admin(process: GatewayProcess) -> StreamAdminClient:
    """A blocking admin client of a node's stream listener, as guest."""
    host, port = process.address("streams")
    return StreamAdminClient(host, port, "guest", "guest", timeout=10)


def blocking(process: GatewayProcess) -> BlockingStreamClient:
    """An open blocking client of a node's stream listener, as guest."""
    client = BlockingStreamClient(
        socket.create_connection(process.address("streams"), timeout=10), timeout=10
    )
    client.open(username="guest", password="guest", virtual_host="/")
    return client


def test_metadata_from_either_node_names_the_owner(fleet: dict[str, GatewayProcess]) -> None:
    """Created through the other node; Metadata on both names the owner's advertised address."""
    stream = owned_by("gw-b", "metadata")
    with admin(fleet["gw-a"]) as client:
        assert client.create_stream(stream) == 1
    for process in fleet.values():
        with admin(process) as client:
            assert client.metadata(stream) == (1, fleet["gw-b"].address("streams"), [])
            assert client.metadata(f"{stream}-missing")[0] == 2


def test_publish_through_the_non_owner_lands_at_the_owner_once(
    fleet: dict[str, GatewayProcess],
) -> None:
    """Publishes relayed under the client's reference: stored at the owner, deduplicated."""
    stream = owned_by("gw-b", "relayed")
    with admin(fleet["gw-a"]) as client:
        assert client.create_stream(stream) == 1
    client = blocking(fleet["gw-a"])
    try:
        declared = client.request(
            lambda c: sp.DeclarePublisher(
                correlation_id=c, publisher_id=1, reference="relayed-producer", stream=stream
            )
        )
        assert declared.code == 1
        confirmed: set[int] = set()
        for first, last in ((1, 100), (51, 150)):  # ids 51 to 100 a second time
            ids = list(range(first, last + 1))
            client.publish(1, ids, [f"m{i}".encode() for i in ids])
            while not set(ids) <= confirmed:
                event = client.next("confirms")
                assert isinstance(event, sp.PublishConfirm), event
                confirmed.update(event.publishing_ids)
        sequence = client.request(
            lambda c: sp.QueryPublisherSequence(
                correlation_id=c, reference="relayed-producer", stream=stream
            )
        )
        assert sequence.sequence == 150
    finally:
        client.close()
    bodies = run(read_all(fleet["gw-b"], stream, 150))
    assert bodies == [f"m{i}".encode() for i in range(1, 151)]


def test_subscribe_on_the_non_owner_is_not_available(fleet: dict[str, GatewayProcess]) -> None:
    """As RabbitMQ answers a consumer on a node without the stream: code 6."""
    stream = owned_by("gw-b", "subscribe")
    with admin(fleet["gw-b"]) as created:
        assert created.create_stream(stream) == 1
    client = blocking(fleet["gw-a"])
    try:
        answer = client.request(
            lambda c: sp.Subscribe(
                correlation_id=c,
                subscription_id=1,
                stream=stream,
                offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
                credit=1,
            )
        )
        assert answer.code == NOT_AVAILABLE
    finally:
        client.close()


async def read_all(process: GatewayProcess, stream: str, count: int) -> list[bytes]:
    """The first ``count`` messages of ``stream``, read at ``process`` (its owner)."""
    host, port = process.address("streams")
    got: list[bytes] = []
    done = asyncio.Event()

    async def on_message(body: Any, context: Any) -> None:
        got.append(bytes(body))
        if len(got) >= count:
            done.set()

    async with rstream.Consumer(host, port, username="guest", password="guest") as consumer:
        await consumer.subscribe(
            stream,
            on_message,
            offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
        )
        await done.wait()
    return got


# --- rstream's load-balancer mode through a round-robin balancer --------------------------------


class RoundRobin:
    """A TCP load balancer on 127.0.0.1: each connection goes to the next backend in turn."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self._turn = itertools.count()
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RoundRobin]:
        """Listen until the block ends."""
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        async with self._server:
            yield self

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        host, port = self.backends[next(self._turn) % len(self.backends)]
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def test_rstream_in_load_balancer_mode_through_one_address(
    fleet: dict[str, GatewayProcess],
) -> None:
    """Producer and Consumer with ``load_balancer_mode=True``: every message once, at its owner."""
    streams = [owned_by("gw-a", "balanced"), owned_by("gw-b", "balanced")]
    backends = [fleet[node].address("streams") for node in NODES]
    received = run(_balanced(backends, streams))
    for stream in streams:
        assert sorted(received[stream]) == sorted(f"{stream}:{i}".encode() for i in range(COUNT))
        assert len(received[stream]) == COUNT
    for node, stream in zip(NODES, streams, strict=True):
        with admin(fleet[node]) as client:
            assert client.metadata(stream)[1] == fleet[node].address("streams")


async def _balanced(backends: list[tuple[str, int]], streams: list[str]) -> dict[str, list[bytes]]:
    received: dict[str, list[bytes]] = {stream: [] for stream in streams}
    async with RoundRobin(backends).running() as balancer:
        connection: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": balancer.port,
            "username": "guest",
            "password": "guest",
            "load_balancer_mode": True,
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
            for stream in streams:
                for start in range(0, COUNT, BATCH):
                    batch = [
                        rstream.AMQPMessage(body=f"{stream}:{i}".encode())
                        for i in range(start, start + BATCH)
                    ]
                    await producer.send_batch(stream, batch, on_publish_confirm=on_confirm)
            await asyncio.wait_for(all_confirmed.wait(), 30)

        everything = asyncio.Event()

        async def on_message(body: Any, context: Any) -> None:
            stream = context.stream
            received[stream].append(_body(body))
            if all(len(bodies) >= COUNT for bodies in received.values()):
                everything.set()

        async with rstream.Consumer(**connection) as consumer:
            for stream in streams:
                await consumer.subscribe(
                    stream,
                    on_message,
                    decoder=rstream.amqp_decoder,
                    offset_specification=rstream.ConsumerOffsetSpecification(
                        rstream.OffsetType.FIRST
                    ),
                )
            await asyncio.wait_for(everything.wait(), 30)
            await asyncio.sleep(0.5)  # anything delivered twice would come now
    return received


def _body(message: Any) -> bytes:
    body = message.body
    if isinstance(body, list):
        return b"".join(bytes(part) for part in body)
    return bytes(body)


def test_no_node_logged_a_failure(fleet: dict[str, GatewayProcess]) -> None:
    """After all of the above: no traceback, no unhandled error in either node's log."""
    for process in fleet.values():
        output = process.output()
        assert "Traceback" not in output and "Unhandled" not in output, output
