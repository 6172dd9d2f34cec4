"""The TLS-terminating front-end, end to end: TLS with client certificates in, plaintext out.

Two gateways under twistd: a plaintext *backend* (SSMP with shared-secret
logins, QMQP routed into a stream, a stream listener) and a *front-end*
whose ``protocol = "frontend"`` listeners accept each protocol over
``mtls:`` (client certificates required) and relay it to the backend:

* SSMP: alice logs in with ``cert``; the backend sees ``LOGIN alice secret
  ...`` and serves her; a subscriber and a publisher meet through it; a
  LOGIN naming someone else is refused ``401 cert`` by the front-end.
* QMQP: blocks and replies pass with their ids; K from the backend.
* stream: rstream publishes with confirms and consumes over TLS through it.
* The bytes a backend sees: a recording server in place of the backend
  receives exactly what the client sent, the SSMP LOGIN line excepted.
* A backend that is down: QMQP gets Z for each message, then the done block.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.certs import Pki, make_pki
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_durable import free_port
from tests.integration.test_qmqp import mail

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

BACKEND = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["secret"]

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
advertised_host = "localhost"
advertised_port = {front_stream_port}
"""
BACKEND_SECRETS = '[logins]\n"*" = "front-door"\n'
BACKEND_ROUTES = {"in": 'from = "qmqp"\nmatch = "#"\nto = "streams"\naddress = "mail"\n'}

FRONT = """
[gateway]
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.ssmp]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={ssmp}"

[listeners.qmqp]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={qmqp}"

[listeners.streams]
protocol = "frontend"
speaks = "stream"
endpoint = "{stream_tls}"
backend = "tcp:host=127.0.0.1:port={streams}"

[listeners.rec-ssmp]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={recorder}"

[listeners.rec-qmqp]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={recorder}"

[listeners.rec-stream]
protocol = "frontend"
speaks = "stream"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={recorder}"

[listeners.down]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={down}"
"""
FRONT_SECRETS = '[upstreams]\nssmp = "front-door"\nrec-ssmp = "front-door"\n'


class Recorder(threading.Thread):
    """A plaintext server that keeps every byte of each connection, in order of arrival."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.done = threading.Semaphore(0)

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            chunks = []
            with conn:
                while data := conn.recv(65536):
                    chunks.append(data)
            self.received.append(b"".join(chunks))
            self.done.release()

    def next(self) -> bytes:
        """The bytes of the next connection to end."""
        assert self.done.acquire(timeout=30), "no connection reached the recorder"
        return self.received.pop(0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    """The recording backend."""
    server = Recorder()
    server.start()
    yield server
    server.server.close()


@pytest.fixture(scope="module")
def gateways(
    pki: Pki, recorder: Recorder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """The backend (plaintext), then the front-end pointing at it."""
    stream_port = free_port()
    backend = GatewayProcess(
        tmp_path_factory.mktemp("backend"),
        BACKEND.format(front_stream_port=stream_port),
        routes=BACKEND_ROUTES,
        secrets=BACKEND_SECRETS,
    ).start()
    tls = (
        f"mtls:0:interface=127.0.0.1:certKey={pki.server_cert}:privateKey={pki.server_key}"
        f":caCerts={pki.ca_cert}:verify=required"
    )
    try:
        front = GatewayProcess(
            tmp_path_factory.mktemp("front"),
            FRONT.format(
                tls=tls,
                stream_tls=tls.replace("mtls:0:", f"mtls:{stream_port}:"),
                ssmp=backend.address("ssmp")[1],
                qmqp=backend.address("qmqp")[1],
                streams=backend.address("streams")[1],
                recorder=recorder.port,
                down=free_port(),
            ),
            secrets=FRONT_SECRETS,
        ).start()
    except BaseException:
        backend.stop()
        raise
    yield backend, front
    front.stop()
    backend.stop()


def context(pki: Pki) -> ssl.SSLContext:
    """Alice's client context, trusting the test CA."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    return ctx


def tls_socket(front: GatewayProcess, listener: str, pki: Pki) -> ssl.SSLSocket:
    """A TLS connection to one of the front-end's listeners, as alice."""
    raw = socket.create_connection(front.address(listener), timeout=30)
    return context(pki).wrap_socket(raw, server_hostname="localhost")


def test_ssmp_logs_in_to_the_backend_for_the_certificate(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki
) -> None:
    """Alice (cert) subscribes, alice/2 publishes: the backend served both as themselves."""
    _, front = gateways
    with (
        LineClient(front.address("ssmp"), context(pki)) as reader,
        LineClient(front.address("ssmp"), context(pki)) as writer,
    ):
        reader.send("LOGIN alice cert", "SUBSCRIBE news")
        reader.expect_code(200)
        reader.expect_code(200)
        writer.send("LOGIN alice/2 cert", "MCAST news hello")
        writer.expect_code(200)
        writer.expect_code(200)
        assert reader.read_line() == b"000 alice/2 MCAST news hello"


def test_ssmp_login_for_another_name_is_refused(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki
) -> None:
    """The certificate does not name bob: 401 cert and the close, from the front-end."""
    _, front = gateways
    with LineClient(front.address("ssmp"), context(pki)) as client:
        client.send("LOGIN bob cert")
        assert client.read_line() == b"401 cert"
        client.expect_closed()


def test_qmqp_blocks_and_replies_pass_with_their_ids(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki
) -> None:
    """Three messages, three K replies with the same ids, then the done block."""
    _, front = gateways
    with tls_socket(front, "qmqp", pki) as sock:
        sock.sendall(b"".join(mail(f"id-{i}", "ops@example.org") for i in range(3)) + b"1:D,")
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        blocks: list[qmqp.Block] = []
        while len(blocks) < 4:
            data = sock.recv(65536)
            assert data, f"closed after {blocks}"
            blocks.extend(codec.receive_data(data))
    replies = blocks[:3]
    assert [(r.id, r.status) for r in replies] == [  # type: ignore[union-attr]
        (b"id-0", qmqp.K),
        (b"id-1", qmqp.K),
        (b"id-2", qmqp.K),
    ]
    assert blocks[3] == qmqp.DoneBlock()


async def _stream_round_trip(host: str, port: int, ctx: ssl.SSLContext) -> list[bytes]:
    connection: dict[str, Any] = {
        "host": host,
        "port": port,
        "ssl_context": ctx,
        "username": "guest",
        "password": "guest",
    }
    confirmed = asyncio.Event()
    count = 0

    async def on_confirm(status: Any) -> None:
        nonlocal count
        count += bool(status.is_confirmed)
        if count == 20:
            confirmed.set()

    async with rstream.Producer(**connection) as producer:
        await producer.create_stream("through-front", exists_ok=True)
        for i in range(20):
            await producer.send("through-front", f"m{i}".encode(), on_publish_confirm=on_confirm)
        await confirmed.wait()
    got: list[bytes] = []
    done = asyncio.Event()

    async def on_message(message: Any, _context: Any) -> None:
        got.append(bytes(message))
        if len(got) == 20:
            done.set()

    consumer = rstream.Consumer(**connection)
    await consumer.start()
    await consumer.subscribe(
        "through-front",
        on_message,
        offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
    )
    runner = asyncio.create_task(consumer.run())
    try:
        await done.wait()
    finally:
        await consumer.close()
        runner.cancel()
    return got


def test_stream_publish_and_consume_through_the_front_end(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki
) -> None:
    """Rstream over TLS: publish with confirms, then read back, through the front-end."""
    _, front = gateways
    _host, port = front.address("streams")
    got = asyncio.run(asyncio.wait_for(_stream_round_trip("localhost", port, context(pki)), 60))
    assert got == [f"m{i}".encode() for i in range(20)]


def test_the_backend_sees_the_protocol_unchanged(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki, recorder: Recorder
) -> None:
    """QMQP and stream bytes arrive as sent; SSMP's only change is the LOGIN line."""
    _, front = gateways
    qmqp_bytes = b"".join(mail(f"r{i}", "a@b.example", size=i * 100) for i in range(5)) + b"1:D,"
    stream_bytes = sp.encode(sp.PeerProperties(correlation_id=1, properties={"x": "y"})) * 3
    ssmp_rest = b"SUBSCRIBE a\nMCAST a one\nPING\nMCAST a " + b"z" * 500 + b"\n"
    for listener, sent, expected in (
        ("rec-qmqp", qmqp_bytes, qmqp_bytes),
        ("rec-stream", stream_bytes, stream_bytes),
        (
            "rec-ssmp",
            b"LOGIN alice cert\n" + ssmp_rest,
            b"LOGIN alice secret front-door\n" + ssmp_rest,
        ),
    ):
        with tls_socket(front, listener, pki) as sock:
            for at in range(0, len(sent), 7):  # in small pieces: framing is not the relay's
                sock.sendall(sent[at : at + 7])
            # A clean TLS close (close_notify), not a reset that would drop what is in flight.
            sock.unwrap()
        assert recorder.next() == expected, (listener, front.output()[-3000:])


def test_backend_down_qmqp_gets_z(
    gateways: tuple[GatewayProcess, GatewayProcess], pki: Pki
) -> None:
    """Nothing listens behind the front-end: each message gets Z with the reason, then done."""
    _, front = gateways
    with tls_socket(front, "down", pki) as sock:
        sock.sendall(mail("d1", "a@b.example") + mail("d2", "a@b.example") + b"1:D,")
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        blocks: list[qmqp.Block] = []
        while data := sock.recv(65536):
            blocks.extend(codec.receive_data(data))
    assert [(b.id, b.status) for b in blocks[:2]] == [(b"d1", qmqp.Z), (b"d2", qmqp.Z)]  # type: ignore[union-attr]
    assert b"cannot be reached" in blocks[0].description  # type: ignore[union-attr]
    assert blocks[2] == qmqp.DoneBlock()
