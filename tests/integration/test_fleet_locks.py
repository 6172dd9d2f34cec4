"""Work that runs once per fleet, on a real RabbitMQ node (the session's `rabbitmq`).

First the locks' building block alone: exclusive queues claimed on two
backbones (`gateway.fleet.backbone`), refused with 405 to the second,
confirmed by the holder, released, and freed when the holder's connection
closes. Then the issue's test, "the once-per-fleet consumer taken over
after a kill": two ``twistd msggateway`` nodes of one fleet, each with a
stream upstream ``rabbit`` that subscribes to an input stream, and a route
from it to a second stream upstream ``out`` that publishes to an output
stream (routed messages are accepted once RabbitMQ confirmed them, so a
consumed offset is stored only after its copy is in the output). Only one
node consumes; ``kill -9`` of it, and the other takes over within seconds
from the stored offset; rstream reads the output stream and counts each
input message's copies: none is lost and none is stored twice, since
both nodes publish what the consumer read under one reference with its
offsets as ids (`gateway.core.origins`), through a direct route and
through a durable one. A clean stop hands over too, with no duplicate.

The measured takeover times, losses and duplicates are kept as the test
suite's properties (``--junitxml``).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.task import deferLater

from gateway.fleet.backbone import Backbone
from gateway.fleet.locks import RETRY_JITTER, RETRY_SECONDS, lock_queue
from tests.integration.harness import GatewayProcess, read_stream_until
from tests.rabbitmq import RabbitMQNode

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[fleet]
node = "{node}"
amqp = ["tcp:host=127.0.0.1:port={amqp}"]
heartbeat_seconds = 2

[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
subscribe = ["{inbound}"]
offset = "first"
store_offset_interval_seconds = 0.2

[upstreams.out]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
stream = "{outbound}"
"""
ROUTE: Final = 'from = "rabbit"\nmatch = "{inbound}"\nto = "out"\n'
DURABLE_ROUTE: Final = ROUTE + "durable = true\n"
LOCK: Final = "upstream.rabbit"
CONSUMER: Final = "msggateway.rabbit"
"""Where the upstream stores its offsets: the same name on every node."""
TAKEOVER_SECONDS: Final = 5.0
"""The issue's "within a few seconds": the lock's retry (1 to 1.5 s) plus a subscription."""
SENTINEL: Final = b"sentinel"

_names = itertools.count()


# --- exclusive queues on the backbone -------------------------------------------------------


def backbone(rabbitmq: RabbitMQNode) -> Backbone:
    """A backbone on the session's node (not started)."""
    endpoint = f"tcp:host=127.0.0.1:port={rabbitmq.amqp_port}"
    clock: Any = reactor
    return Backbone(
        node=f"locks{next(_names)}",
        endpoints=[(endpoint, clientFromString(clock, endpoint))],
        clock=clock,
    )


async def ready(node: Backbone) -> None:
    """Start the backbone and wait until it is connected."""
    connected: Deferred[None] = Deferred()
    node.on_connected(lambda: None if connected.called else connected.callback(None))
    node.start()
    await connected


@pytest_twisted.ensureDeferred
async def test_exclusive_queues_on_rabbitmq(rabbitmq: RabbitMQNode) -> None:
    """One connection holds the queue; the other is refused, and asks again; a close frees it."""
    first, second = backbone(rabbitmq), backbone(rabbitmq)
    queue = lock_queue(f"test.{first.node}")
    await ready(first)
    await ready(second)
    try:
        assert await first.claim(queue) is True
        assert await second.claim(queue) is False  # 405, on the claims' own channel
        assert await second.claim(queue) is False  # a new channel after the refusal
        assert await first.claim(queue) is True  # the holder confirms its hold
        assert first.ready and second.ready  # the publishing channels were not touched
        await first.release(queue)
        assert await second.claim(queue) is True
        assert await first.claim(queue) is False
        await second.stop()
        # Gone with the holder's connection: RabbitMQ deletes an exclusive queue once
        # it has seen the connection end, a moment after the close is answered.
        deadline = time.monotonic() + 5.0
        while not await first.claim(queue):
            assert time.monotonic() < deadline, "the queue outlived its holder's connection"
            await deferLater(reactor, 0.02, lambda: None)
    finally:
        await first.stop()
        await second.stop()


# --- the once-per-fleet consumer ------------------------------------------------------------


class Fleet:
    """Gateway nodes of one fleet consuming ``inbound`` into ``outbound``."""

    def __init__(
        self, rabbitmq: RabbitMQNode, stream: str, directory: Path, route: str = ROUTE
    ) -> None:
        self.rabbitmq = rabbitmq
        self.inbound = stream + "-in"
        self.outbound = stream + "-out"
        self.directory = directory
        self.route = route
        self.nodes: list[GatewayProcess] = []

    def start(self, node: str) -> GatewayProcess:
        """Start gateway node ``node``; wait until it is connected to RabbitMQ."""
        config = CONFIG.format(
            node=node,
            amqp=self.rabbitmq.amqp_port,
            port=self.rabbitmq.stream_connection()["port"],
            inbound=self.inbound,
            outbound=self.outbound,
        )
        process = GatewayProcess(
            self.directory / node, config, routes={"copy": self.route.format(inbound=self.inbound)}
        ).start()
        self.nodes.append(process)
        process.wait_for_log(f"fleet: node {node} connected to RabbitMQ")
        return process

    def stop(self) -> None:
        """Stop every node still running."""
        for process in self.nodes:
            process.stop()

    def publish(self, bodies: list[bytes], stream: str | None = None) -> None:
        """Publish ``bodies`` to the input stream (or ``stream``), confirmed."""
        run(publish(self.rabbitmq, stream or self.inbound, bodies))

    def stored(self) -> int:
        """The offset stored for the consumer of the input stream (-1: none)."""
        return int(run(query_offset(self.rabbitmq, self.inbound)))

    def offsets(self, count: int) -> dict[bytes, int]:
        """The offset of each of the first ``count`` input messages, by body.

        Not its index: each StoreOffset takes an offset of the stream too.
        """
        found: dict[bytes, int] = {}

        def take(message: Any, context: Any) -> bool:
            found[bytes(message.body)] = context.offset
            return len(found) >= count

        run(read_stream_until(self.rabbitmq.stream_connection(), self.inbound, take))
        return found

    def wait_consumed(self, count: int, seconds: float = 30.0) -> None:
        """Wait until the offset of the ``count``-th input message is stored: all were copied."""
        last = max(self.offsets(count).values())
        deadline = time.monotonic() + seconds
        while self.stored() < last:
            assert time.monotonic() < deadline, f"offset {last} not stored in {seconds} s"
            time.sleep(0.1)

    def copies(self) -> Counter[bytes]:
        """Each body in the output stream, with how often it is there (up to the sentinel)."""
        self.publish([SENTINEL], self.outbound)
        seen: list[bytes] = []

        def take(message: Any, _context: Any) -> bool:
            body = bytes(message.body)
            if body == SENTINEL:
                return True
            seen.append(body)
            return False

        run(read_stream_until(self.rabbitmq.stream_connection(), self.outbound, take))
        return Counter(seen)


def run(coroutine: Any, seconds: float = 60) -> Any:
    """Run a coroutine with a time limit."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


async def publish(rabbitmq: RabbitMQNode, stream: str, bodies: list[bytes]) -> None:
    """Publish with rstream, confirmed (the stream created if need be)."""
    async with rstream.Producer(**rabbitmq.stream_connection()) as producer:
        await producer.create_stream(stream, exists_ok=True)
        for start in range(0, len(bodies), 100):
            batch = [rstream.AMQPMessage(body=body) for body in bodies[start : start + 100]]
            await producer.send_batch(stream, batch)


async def query_offset(rabbitmq: RabbitMQNode, stream: str) -> int:
    """The offset stored under the gateways' consumer name, or -1."""
    consumer = rstream.Consumer(**rabbitmq.stream_connection())
    await consumer.start()
    try:
        return int(await consumer.query_offset(stream, CONSUMER))
    except rstream.exceptions.OffsetNotFound:
        return -1
    finally:
        await consumer.close()


def bodies(start: int, stop: int) -> list[bytes]:
    """Message bodies ``m<start>`` to ``m<stop - 1>``."""
    return [b"m%d" % index for index in range(start, stop)]


def held(process: GatewayProcess) -> float:
    """The node's ``msggateway_fleet_lock_held`` for the upstream's lock."""
    pattern = rf'^msggateway_fleet_lock_held{{lock="{re.escape(LOCK)}"}} (\S+)$'
    found = re.search(pattern, process.metrics(), re.MULTILINE)
    assert found is not None, process.metrics()
    return float(found.group(1))


def wait_for(condition: Callable[[], bool], seconds: float) -> float:
    """Poll ``condition`` until it holds; return how long that took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - started


def two_nodes(fleet: Fleet) -> Iterator[Fleet]:
    """Nodes gw0 (holding the lock: started first) and gw1; stopped after the test."""
    try:
        first = fleet.start("gw0")
        first.wait_for_log(f"fleet: node gw0 holds lock {LOCK}")
        fleet.start("gw1")
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def fleet(rabbitmq: RabbitMQNode, stream_name: str, tmp_path: Path) -> Iterator[Fleet]:
    """Two nodes copying through a direct route."""
    yield from two_nodes(Fleet(rabbitmq, stream_name, tmp_path))


@pytest.fixture
def durable_fleet(rabbitmq: RabbitMQNode, stream_name: str, tmp_path: Path) -> Iterator[Fleet]:
    """Two nodes copying through a durable route (each commits to its own log first)."""
    yield from two_nodes(Fleet(rabbitmq, stream_name, tmp_path, DURABLE_ROUTE))


def test_one_node_consumes(fleet: Fleet) -> None:
    """With two nodes up, every input message is copied once: only the holder reads."""
    gw0, gw1 = fleet.nodes
    fleet.publish(bodies(0, 200))
    fleet.wait_consumed(200)
    assert (held(gw0), held(gw1)) == (1, 0)
    assert fleet.copies() == Counter(bodies(0, 200))
    assert "upstream rabbit: cannot subscribe" not in gw1.output()


@pytest.mark.timeout(180)
def test_kill_9_of_the_consuming_node(fleet: Fleet, record_testsuite_property: Any) -> None:
    """The holder is killed: the other node takes over within seconds, from the stored offset.

    What the dead node had stored is not read again: every message once.
    """
    gw0, gw1 = fleet.nodes
    fleet.publish(bodies(0, 300))
    fleet.wait_consumed(300)
    gw0.kill()
    killed = time.monotonic()
    gw1.wait_for_log(f"fleet: node gw1 holds lock {LOCK} \\(taken over", TAKEOVER_SECONDS)
    took = time.monotonic() - killed
    record_testsuite_property("kill_takeover_seconds", round(took, 3))
    assert took < TAKEOVER_SECONDS
    fleet.publish(bodies(300, 600))
    fleet.wait_consumed(600)
    assert fleet.copies() == Counter(bodies(0, 600))
    assert held(gw1) == 1


@pytest.mark.timeout(180)
def test_kill_9_with_messages_in_flight(fleet: Fleet, record_testsuite_property: Any) -> None:
    """Killed while it consumes: nothing is lost, and nothing is stored twice.

    The next holder reads on after the offset the dead one stored last:
    what the dead one had copied past it (settled since its last store,
    or in flight) is read and published again, under the same reference
    and ids, which RabbitMQ drops.
    """
    kill_while_consuming(fleet, record_testsuite_property, "in_flight")


@pytest.mark.timeout(180)
def test_kill_9_with_messages_in_flight_through_a_durable_route(
    durable_fleet: Fleet, record_testsuite_property: Any
) -> None:
    """Through a durable route too: nothing lost, nothing twice.

    The dead node's log keeps what it committed and had not delivered; the
    consumer's offset was held below it, so the next holder reads it again
    and delivers it under the same ids.
    """
    kill_while_consuming(durable_fleet, record_testsuite_property, "durable_in_flight")


def kill_while_consuming(fleet: Fleet, record_testsuite_property: Any, name: str) -> None:
    """Publish 3,000 messages, kill the holder half way, and count what the output holds."""
    gw0, gw1 = fleet.nodes
    total = 3000

    async def publish_and_kill() -> tuple[int, int]:
        """Publish in batches of 50; kill the holder half way.

        Returns:
            The offset it had stored, and the last id it had published.
        """
        stored = sent = -2
        consumer = rstream.Consumer(**fleet.rabbitmq.stream_connection())
        await consumer.start()
        try:
            async with rstream.Producer(**fleet.rabbitmq.stream_connection()) as producer:
                await producer.create_stream(fleet.inbound, exists_ok=True)
                for start in range(0, total, 50):
                    batch = [rstream.AMQPMessage(body=body) for body in bodies(start, start + 50)]
                    await producer.send_batch(fleet.inbound, batch)
                    await asyncio.sleep(0.01)
                    if start == total // 2:
                        gw0.kill()
                        # At once: the next holder asks 1 to 1.5 s after its last try.
                        stored = int(await consumer.query_offset(fleet.inbound, CONSUMER))
                        client = await consumer.default_client
                        sent = int(await client.query_publisher_sequence(fleet.outbound, reference))
        finally:
            await consumer.close()
        return stored, sent

    # Where both nodes publish what the consumer read: no node id in it.
    reference = f"{CONSUMER}@{fleet.inbound}.route.copy"
    stored, sent = run(publish_and_kill(), 120)
    assert stored >= 0  # it had consumed, and stored, before the kill
    gw1.wait_for_log(f"fleet: node gw1 holds lock {LOCK} \\(taken over", TAKEOVER_SECONDS)
    fleet.wait_consumed(total, 60)
    offsets = fleet.offsets(total)
    copies = fleet.copies()
    lost = set(bodies(0, total)) - set(copies)
    twice = sorted(offsets[body] for body, count in copies.items() if count > 1)
    record_testsuite_property(f"{name}_lost", len(lost))
    record_testsuite_property(f"{name}_duplicates", sum(copies.values()) - len(copies))
    record_testsuite_property(f"{name}_stored_at_kill", stored)
    # Published by the dead node past its stored offset: the next holder read them again.
    again = [body for body, offset in offsets.items() if stored < offset < sent]
    record_testsuite_property(f"{name}_read_again", len(again))
    assert not lost
    assert set(copies) == set(bodies(0, total))
    assert not twice, (stored, twice[:5])


@pytest.mark.timeout(180)
def test_a_clean_stop_hands_over_without_duplicates(
    fleet: Fleet, record_testsuite_property: Any
) -> None:
    """The holder stops (SIGTERM): it stores, releases, and the other goes on at once."""
    gw0, gw1 = fleet.nodes
    fleet.publish(bodies(0, 300))
    fleet.wait_consumed(300)
    stopping = time.monotonic()
    gw0.stop()
    gw1.wait_for_log(f"fleet: node gw1 holds lock {LOCK}", TAKEOVER_SECONDS)
    record_testsuite_property("handover_seconds", round(time.monotonic() - stopping, 3))
    assert f"fleet: node gw0 released lock {LOCK}" in gw0.output()
    fleet.publish(bodies(300, 600))
    fleet.wait_consumed(600)
    assert fleet.copies() == Counter(bodies(0, 600))
    assert RETRY_SECONDS * (1 + RETRY_JITTER) < TAKEOVER_SECONDS
