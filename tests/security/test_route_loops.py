"""Routes that write into the gateway's own streams, or loop (issue 26, defect 2), under twistd.

The probe's route: mail to ``<anything>@any.example`` goes, durably, to the
stream listener's stream named by the local part. One QMQP message to
``msggateway.route.<that route>@any.example`` got K, and from then on the
route's forwarder appended to its own stream without end; the same route
wrote into ``msggateway.outcomes`` and ``msggateway.dead-letter``. Now an
address in the internal namespace is rejected: D on a direct route, and
on a durable route (which answered K once the message was committed) the
forwarder dead-letters it at once, with the reason.

A loop that does not go through the gateway's own streams (a route from
one stream listener into a stream it reads itself, through a second
listener on the same log) is stopped by the hop count: each write of a
routed message into a stream counts one in ``x-gateway-hops``, and a
message written 16 times is refused and dead-lettered, logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, TypeVar

import pytest

from bench.gateway_proc import metric
from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, read_stream_until, stream_connection
from tests.integration.test_qmqp import QMQPSession, mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")
from rstream import exceptions  # noqa: E402  (after the skip)
from rstream.client import Client  # noqa: E402

pytestmark = pytest.mark.integration

T = TypeVar("T")

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.mirror]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.debug]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.debug.authorize.ops]
consume = ["msggateway.#"]
"""

SECRETS = '[logins]\nops = "ops-secret"\n'

ROUTES = {
    "loop": 'from = "mail"\nmatch = "#@any.example"\nto = "streams"\naddress = "{1}"\n'
    "durable = true\n",
    "direct": 'from = "mail"\nmatch = "#@direct.example"\nto = "streams"\naddress = "{1}"\n',
    # What the stream listener's clients publish to "echo" is written to
    # "echo" again, through the second listener on the same log: a loop.
    "echo": 'from = "streams"\nmatch = "echo"\nto = "mirror"\naddress = "echo"\n',
}

ROUTE_STREAM: Final = "msggateway.route.loop"
DEAD_LETTER: Final = "msggateway.dead-letter"
REASON: Final = "x-gateway-dead-letter-reason"
MAX_HOPS: Final = 16


def run(coroutine: Awaitable[T], seconds: float = 30) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A fresh gateway per test: a loop left running would spoil the next test."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("route-loops"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


def send_mail(gateway: GatewayProcess, *recipients: str) -> list[bytes]:
    """Send one message per recipient over QMQP; return the reply statuses."""
    client = QMQPSession(gateway.address("mail"))
    try:
        client.send(
            b"".join(mail(f"m{i}", to, subject=f"to {to}") for i, to in enumerate(recipients))
            + b"1:D,"
        )
        blocks = client.read_blocks(len(recipients) + 1)
    finally:
        client.close()
    return [block.status for block in blocks[:-1]]  # type: ignore[attr-defined]


def ops(gateway: GatewayProcess) -> dict[str, Any]:
    """Rstream's connection arguments for the operator granted reading internal streams."""
    return dict(stream_connection(gateway, "debug"), username="ops", password="ops-secret")


def properties(message: Any) -> dict[str, Any]:
    """A message's application properties with text keys and values."""
    return {
        (key.decode() if isinstance(key, bytes) else key): (
            value.decode() if isinstance(value, bytes) else value
        )
        for key, value in (message.application_properties or {}).items()
    }


async def dead_letters(gateway: GatewayProcess, done: Callable[[list[Any]], bool]) -> list[Any]:
    """Read the dead-letter stream (as the operator) until ``done`` says it has enough."""
    got: list[Any] = []

    def take(message: Any, _context: Any) -> bool:
        got.append(message)
        return done(got)

    for _ in range(200):  # created by the first dead letter
        try:
            await read_stream_until(ops(gateway), DEAD_LETTER, take)
        except exceptions.StreamDoesNotExist:
            await asyncio.sleep(0.05)
        else:
            return got
    raise AssertionError("no dead-letter stream")


async def stored_offset(gateway: GatewayProcess, stream: str, reference: str) -> int:
    """The offset stored under ``reference`` in ``stream``, once there is one (as the operator)."""
    connection = ops(gateway)
    client = Client(
        host=connection["host"], port=connection["port"], frame_max=1024 * 1024, heartbeat=60
    )
    await client.start()
    try:
        await client.authenticate(
            vhost="/", username=connection["username"], password=connection["password"]
        )
        for _ in range(200):
            with contextlib.suppress(exceptions.ServerError):
                return await client.query_offset(stream, reference)
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    raise AssertionError(f"no offset under {reference} in {stream}")


def test_a_durable_route_never_writes_into_its_own_stream(gateway: GatewayProcess) -> None:
    """The probe's message: K (committed), then dead-lettered at once, never copied.

    Its forwarder is done with it (an offset stored) and the route goes on:
    the route's stream holds that message and the next one, nothing between.
    """
    assert send_mail(gateway, f"{ROUTE_STREAM}@any.example") == [qmqp.K]
    [dead] = run(dead_letters(gateway, lambda got: len(got) >= 1))
    reason = properties(dead)[REASON]
    assert "msggateway.route.loop" in reason and "internal namespace" in reason
    run(stored_offset(gateway, ROUTE_STREAM, "msggateway.forwarder.loop"))
    assert send_mail(gateway, "inbox@any.example") == [qmqp.K]  # the route still works

    def take(message: Any, _context: Any) -> bool:
        return b"Subject: to inbox@" in bytes(message.body)

    run(read_stream_until(stream_connection(gateway), "inbox", take, create=True))
    stored: list[bytes] = []

    def keep(message: Any, _context: Any) -> bool:
        stored.append(bytes(message.body))
        return b"Subject: to inbox@" in stored[-1]

    run(read_stream_until(ops(gateway), ROUTE_STREAM, keep))
    assert [body.split(b"\n")[1] for body in stored] == [
        b"Subject: to msggateway.route.loop@any.example",
        b"Subject: to inbox@any.example",
    ]


def test_no_route_writes_into_the_outcomes_or_the_dead_letters(gateway: GatewayProcess) -> None:
    """Direct: D at once. Durable: K, then dead-lettered with its reason, never appended as is."""
    assert send_mail(
        gateway, "msggateway.outcomes@direct.example", "msggateway.dead-letter@direct.example"
    ) == [qmqp.D, qmqp.D]
    refused = metric(
        gateway.metrics(),
        "msggateway_protocol_errors_total",
        endpoint="streams",
        kind="internal-stream",
    )
    assert refused == 2  # the stream listener's destination counts what routes may not write
    assert send_mail(
        gateway, "msggateway.outcomes@any.example", "msggateway.dead-letter@any.example"
    ) == [qmqp.K, qmqp.K]
    letters = run(dead_letters(gateway, lambda got: len(got) >= 2))
    assert all(REASON in properties(letter) for letter in letters)
    assert sorted(properties(letter)["x-gateway-dead-letter-route"] for letter in letters) == [
        "loop",
        "loop",
    ]


def test_a_loop_between_streams_stops_at_the_hop_limit(gateway: GatewayProcess) -> None:
    """One message into a loop: 16 copies, each a hop more; the 17th write is refused.

    The refused message is dead-lettered with the reason, and the refusal
    is logged once; nothing more is written.
    """

    async def publish() -> None:
        async with rstream.Producer(**stream_connection(gateway)) as producer:
            await producer.create_stream("echo", exists_ok=True)
            await producer.send_wait("echo", rstream.AMQPMessage(body=b"round and round"))

    run(publish())
    [dead] = run(dead_letters(gateway, lambda got: len(got) >= 1))
    assert properties(dead)["x-gateway-hops"] == MAX_HOPS
    assert "loop" in properties(dead)[REASON]
    copies: list[Any] = []

    def take(message: Any, _context: Any) -> bool:
        copies.append(message)
        return len(copies) > MAX_HOPS

    run(read_stream_until(stream_connection(gateway), "echo", take))
    assert [properties(copy).get("x-gateway-hops") for copy in copies] == [
        None,
        *range(1, MAX_HOPS + 1),
    ]
    gateway.wait_for_log(r"mirror: refused 1 message\(s\) bound for echo .* routes loop")
    assert gateway.output().count("(x-gateway-hops): routes loop") == 1
