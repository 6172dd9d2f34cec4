"""Stream clients and the gateway's own streams (issue 26, defect 1), under twistd.

The gateway keeps its own streams in the embedded log it serves to stream
clients: a durable route's ``msggateway.route.<route>`` (its forwarder's
offset stored in it as ``msggateway.forwarder.<route>``), the outcome
records ``msggateway.outcomes``, the dead letters ``msggateway.dead-letter``;
and it writes into client streams under references of its own (a durable
route's forwarder publishes as ``msggateway.route.<route>``, a stream
listener's routes store their offsets as ``msggateway.routes.<listener>``).

Each test is one of the attacks an independent probe found, made with
rstream (a client we did not write), as guest on an open listener: each
is refused with code 16 (Access refused), and what the attack aimed at
still works. Reading an internal stream needs an explicit grant (a
``consume`` pattern naming ``msggateway.`` under the reader's own identity
in a listener's ``authorize`` table); ``#`` alone does not give it, and no
grant lets anyone write there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, Final, TypeVar

import pytest

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, read_stream_until, stream_connection
from tests.integration.test_qmqp import QMQPSession, mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")
from rstream import exceptions, schema  # noqa: E402  (after the skip)
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

[listeners.debug]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.debug.authorize.ops]
consume = ["msggateway.#"]

[listeners.debug.authorize.app]
publish = ["#"]
consume = ["#"]
"""

SECRETS = '[logins]\nops = "ops-secret"\napp = "app-secret"\n'

ROUTES = {
    "to-inbox": 'from = "mail"\nmatch = "#@inbox.example"\nto = "streams"\naddress = "inbox"\n'
    "durable = true\n",
    "events-out": 'from = "streams"\nmatch = "events"\nto = "debug"\naddress = "seen"\n',
}

ROUTE_STREAM: Final = "msggateway.route.to-inbox"
FORWARDER_REFERENCE: Final = "msggateway.forwarder.to-inbox"
ROUTE_PUBLISHER: Final = "msggateway.route.to-inbox"
FEED_REFERENCE: Final = "msggateway.routes.streams"
OUTCOMES: Final = "msggateway.outcomes"
ACCESS_REFUSED: Final = 16


def run(coroutine: Awaitable[T], seconds: float = 30) -> T:
    """Run one asyncio coroutine to completion, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A durable QMQP route into a stream listener, an open listener and a guarded one."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("internal-streams"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


@contextlib.asynccontextmanager
async def connected(
    gateway: GatewayProcess,
    listener: str = "streams",
    user: str = "guest",
    password: str = "guest",
) -> AsyncIterator[Client]:
    """A logged-in rstream client connection: the raw commands, one by one."""
    host, port = gateway.address(listener)
    client = Client(host=host, port=port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    try:
        await client.authenticate(vhost="/", username=user, password=password)
        yield client
    finally:
        await client.close()


async def code_of(request: Awaitable[object]) -> int:
    """The response code of a request: 1 (OK) when it succeeded."""
    try:
        await request
    except exceptions.ServerError as error:
        return int(error.code)
    return 1


_PUBLISHER_IDS = iter(range(1, 256))


async def publish(client: Client, stream: str, reference: str | None, entries: list[Any]) -> int:
    """Declare a publisher and publish ``(publishing id, entry)`` pairs; the declare's code.

    The confirms (or errors) are waited for when the declare succeeded.
    """
    publisher_id = next(_PUBLISHER_IDS)
    code = await code_of(client.declare_publisher(stream, reference, publisher_id))
    if code != 1:
        return code
    answered = asyncio.Event()
    expected = {publishing_id for publishing_id, _ in entries}

    def on_answer(frame: Any) -> None:
        ids = getattr(frame, "publishing_ids", None) or [
            error.publishing_id for error in getattr(frame, "errors", ())
        ]
        expected.difference_update(ids)
        if not expected:
            answered.set()

    client.add_handler(schema.PublishConfirm, on_answer, name=f"confirm-{publisher_id}")
    client.add_handler(schema.PublishError, on_answer, name=f"error-{publisher_id}")
    await client.publish(
        [
            schema.Message(publishing_id=publishing_id, filter_value=None, data=bytes(entry))
            for publishing_id, entry in entries
        ],
        publisher_id=publisher_id,
    )
    await answered.wait()
    return code


def send_mail(gateway: GatewayProcess, *recipients: str, subject: str) -> list[bytes]:
    """Send one message per recipient over QMQP; return the reply statuses."""
    client = QMQPSession(gateway.address("mail"))
    try:
        client.send(
            b"".join(mail(f"m{i}", to, subject=subject) for i, to in enumerate(recipients))
            + b"1:D,"
        )
        blocks = client.read_blocks(len(recipients) + 1)
    finally:
        client.close()
    return [block.status for block in blocks[:-1]]  # type: ignore[attr-defined]


async def arrives(gateway: GatewayProcess, stream: str, needle: bytes) -> None:
    """Read ``stream`` from the start until a body holding ``needle`` comes."""
    await read_stream_until(
        stream_connection(gateway),
        stream,
        lambda message, _context: needle in bytes(message.body),
        create=True,
    )


def protocol_errors(gateway: GatewayProcess, listener: str, kind: str) -> float:
    """A listener's ``msggateway_protocol_errors_total`` of one kind."""
    wanted = f'msggateway_protocol_errors_total{{endpoint="{listener}",kind="{kind}"}} '
    for line in gateway.metrics().splitlines():
        if line.startswith(wanted):
            return float(line[len(wanted) :])
    return 0.0


def test_the_forwarders_publisher_reference_cannot_silence_a_route(
    gateway: GatewayProcess,
) -> None:
    """Publishing id 10^12 under a route's reference is refused; the route still delivers.

    The attack: the durable route's forwarder publishes into ``inbox`` as
    ``msggateway.route.to-inbox`` with each message's offset plus one as
    its id; a client that stores id 10^12 under that reference first makes
    every later message of the route a "duplicate": K, and never delivered.
    """

    async def attack() -> tuple[int, int]:
        async with connected(gateway) as client:
            await code_of(client.create_stream("inbox"))
            forged = rstream.AMQPMessage(body=b"forged")
            on_inbox = await publish(client, "inbox", ROUTE_PUBLISHER, [(10**12, forged)])
            on_route_stream = await publish(client, ROUTE_STREAM, None, [(1, forged)])
            return on_inbox, on_route_stream

    assert run(attack()) == (ACCESS_REFUSED, ACCESS_REFUSED)
    assert send_mail(gateway, "ops@inbox.example", subject="after the attack") == [qmqp.K]
    run(arrives(gateway, "inbox", b"after the attack"))


def test_no_client_moves_the_gateways_offsets(gateway: GatewayProcess) -> None:
    """StoreOffset under a forwarder's or a route feed's reference changes nothing.

    A durable route's forwarder keeps its offset in its route's stream and
    resumes after it on a restart; a stream listener's routes keep theirs
    in the client stream they read. A moved offset would skip acknowledged
    messages. StoreOffset has no response: the offsets are read back (by
    the operator's grant, for the route's stream).
    """
    assert send_mail(gateway, "ops@inbox.example", subject="before the offset") == [qmqp.K]
    run(arrives(gateway, "inbox", b"before the offset"))

    async def stored(listener: str, user: str, password: str, stream: str, name: str) -> int:
        async with connected(gateway, listener, user, password) as client:
            for _ in range(200):  # stored once the chunk is delivered
                with contextlib.suppress(exceptions.ServerError):
                    return await client.query_offset(stream, name)
                await asyncio.sleep(0.05)
        raise AssertionError(f"no offset stored under {name} in {stream}")

    def offsets() -> tuple[int, int]:
        return (
            run(stored("debug", "ops", "ops-secret", ROUTE_STREAM, FORWARDER_REFERENCE)),
            run(stored("streams", "guest", "guest", "events", FEED_REFERENCE)),
        )

    async def publish_event() -> None:
        async with rstream.Producer(**stream_connection(gateway)) as producer:
            await producer.create_stream("events", exists_ok=True)
            await producer.send_wait("events", rstream.AMQPMessage(body=b"an event"))

    async def attack() -> int:
        async with connected(gateway) as client:
            await client.store_offset(ROUTE_STREAM, FORWARDER_REFERENCE, 10**6)
            await client.store_offset("events", FEED_REFERENCE, 10**6)
            # On one connection frames are handled in order: this answer
            # comes after both StoreOffsets were.
            return await code_of(client.query_offset(ROUTE_STREAM, FORWARDER_REFERENCE))

    run(publish_event())
    before = offsets()
    code = run(attack())
    assert offsets() == before
    assert code == ACCESS_REFUSED  # guest does not read internal streams either


def test_internal_streams_cannot_be_created_or_deleted(gateway: GatewayProcess) -> None:
    """Create and Delete of ``msggateway.*`` names are refused; the route keeps working."""

    async def attack() -> list[int]:
        async with connected(gateway) as client:
            return [
                await code_of(client.delete_stream(ROUTE_STREAM)),
                await code_of(client.delete_stream(OUTCOMES)),
                await code_of(client.create_stream("msggateway.route.new")),
                await code_of(client.create_stream("msggateway.mine")),
            ]

    assert run(attack()) == [ACCESS_REFUSED] * 4
    assert send_mail(gateway, "ops@inbox.example", subject="after a delete") == [qmqp.K]
    run(arrives(gateway, "inbox", b"after a delete"))


def test_forged_entries_cannot_enter_a_route_stream(gateway: GatewayProcess) -> None:
    """A publisher on a route's stream is refused, even for an identity granted to read it.

    A crafted entry there (``to`` an address of the attacker's choice)
    would be delivered by the route's forwarder, which creates the stream.
    """
    forged = bytes(rstream.AMQPMessage(body=b"forged", properties=rstream.Properties(to="stolen")))

    async def attack() -> list[int]:
        codes = []
        async with connected(gateway) as client:
            codes.append(await publish(client, ROUTE_STREAM, None, [(1, forged)]))
        async with connected(gateway, "debug", "ops", "ops-secret") as ops:
            codes.append(await publish(ops, ROUTE_STREAM, "ops", [(1, forged)]))
            codes.append(await code_of(ops.query_publisher_sequence(ROUTE_STREAM, "ops")))
        async with connected(gateway, "debug", "app", "app-secret") as app:
            codes.append(await publish(app, ROUTE_STREAM, None, [(1, forged)]))
        return codes

    codes = run(attack())
    assert codes[:2] == [ACCESS_REFUSED] * 2
    assert codes[3] == ACCESS_REFUSED

    async def stolen_exists() -> bool:
        async with connected(gateway) as client:
            return bool(await client.stream_exists("stolen"))

    assert not run(stolen_exists())


def test_reading_internal_streams_needs_an_explicit_grant(gateway: GatewayProcess) -> None:
    """Guest and a ``#`` grant read no mail from a route's stream; ``msggateway.#`` does."""
    assert send_mail(gateway, "ops@inbox.example", subject="private") == [qmqp.K]
    run(arrives(gateway, "inbox", b"private"))

    async def subscribe_code(client: Client, stream: str) -> int:
        return await code_of(client.subscribe(stream, subscription_id=3, initial_credit=1))

    async def attempts() -> list[int]:
        async with connected(gateway) as guest:
            codes = [
                await subscribe_code(guest, ROUTE_STREAM),
                await subscribe_code(guest, OUTCOMES),
            ]
        async with connected(gateway, "debug", "app", "app-secret") as app:
            codes.append(await subscribe_code(app, ROUTE_STREAM))
        return codes

    assert run(attempts()) == [ACCESS_REFUSED] * 3

    ops = dict(stream_connection(gateway, "debug"), username="ops", password="ops-secret")
    run(
        read_stream_until(
            ops, ROUTE_STREAM, lambda message, _context: b"private" in bytes(message.body)
        )
    )


def test_refusals_are_counted_and_logged(gateway: GatewayProcess) -> None:
    """Each refusal is a protocol error of kind internal-stream, logged with peer and identity."""
    before = protocol_errors(gateway, "streams", "internal-stream")

    async def attempt() -> int:
        async with connected(gateway) as client:
            return await code_of(client.delete_stream(OUTCOMES))

    assert run(attempt()) == ACCESS_REFUSED
    assert protocol_errors(gateway, "streams", "internal-stream") == before + 1
    gateway.wait_for_log(
        r"streams: guest from 127\.0\.0\.1:\d+ may not delete 'msggateway\.outcomes'"
    )
