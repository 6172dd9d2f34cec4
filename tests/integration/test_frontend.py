"""The TLS-terminating front-end end to end: two twistd gateways, and a recording backend.

A plaintext backend gateway serves SSMP, QMQP and the stream protocol on
``tcp:``. A front-end gateway serves each of them on an ``mtls:`` listener
(client certificates from the test CA required) and relays every connection
to the backend. A client with alice's certificate logs in to SSMP by ``cert``
(the backend sees a ``secret`` login as alice), sends QMQP mail that the
backend routes to its SSMP hub, and publishes to a stream with its confirm
coming back (and QMQP once more with the backend hop re-encrypted by a
``tls:`` backend endpoint). Other listeners relay to an in-test TCP server that records
bytes, to show the backend sees the protocol unchanged but for the SSMP
LOGIN; to a backend that never reads, to show the front-end then stops
reading from its client; and to nothing, for QMQP's Z replies. A client
without a certificate, or with one from another CA, is refused at TLS.
rstream, a client we did not write, publishes with confirms and consumes
through the front-end over TLS (the backend advertises the front-end's
address in Metadata).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import (
    READ_TIMEOUT_SECONDS,
    GatewayProcess,
    LineClient,
    read_stream_until,
)

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

BACKEND_CONFIG = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.hub]
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
# Metadata names the front-end, so stream clients stay behind it.
advertised_host = "localhost"
advertised_port = {front_stream_port}

[listeners.qmqp-tls]
protocol = "qmqp"
endpoint = "{tls}"
"""

BACKEND_SECRETS = """
[logins]
alice = "alice-at-the-backend"
bob = "bob-secret"
guest = "guest"
"""

BACKEND_ROUTES = {
    "mail": 'from = "qmqp"\nmatch = "#@example.org"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "mail-tls": 'from = "qmqp-tls"\nmatch = "#@example.org"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
}

FRONT_CONFIG = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.ssmp]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={hub}"
cert_identity = ["cn", "email"]

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

[listeners.recorded-ssmp]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={recorder}"

[listeners.recorded-qmqp]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={recorder}"

[listeners.stalled]
protocol = "frontend"
speaks = "stream"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={tarpit}"

[listeners.reencrypted]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "{tls_backend}"

[listeners.slow]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={hub}"
handshake_timeout_seconds = 0.5

[listeners.down]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={closed}"
"""

FRONT_SECRETS = """
[frontends.ssmp]
alice = "alice-at-the-backend"
"alice@example.org" = "not what the backend holds"

[frontends.slow]
"*" = "unused"

[frontends.recorded-ssmp]
"*" = "shared-backend-secret"
"""

RECORDER_REPLY = b"200\n000 bob MCAST news hello\n"
"""What the recording backend sends each connection, before it reads."""


class Recorder:
    """A plaintext TCP backend that records each connection's bytes until the peer closes.

    It sends `RECORDER_REPLY` on accepting, then reads; a connection's record
    is complete (and `received` returns it) once the peer closed its side.
    """

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self._records: list[bytes] = []
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(RECORDER_REPLY)
                data = b""
                conn.settimeout(READ_TIMEOUT_SECONDS)
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                except OSError:
                    pass
            with self._done:
                self._records.append(data)
                self._done.notify_all()

    def received(self, count: int) -> list[bytes]:
        """The first ``count`` complete connection records, waiting for them."""
        with self._done:
            assert self._done.wait_for(
                lambda: len(self._records) >= count, timeout=READ_TIMEOUT_SECONDS
            ), f"only {len(self._records)} connections recorded"
            return self._records[:count]

    def close(self) -> None:
        """Stop accepting."""
        self.sock.close()


def server_tls(pki: Pki) -> str:
    """An mtls: server endpoint requiring client certificates from the test CA."""
    return mtls_endpoint(pki)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    """The recording backend."""
    server = Recorder()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tarpit() -> Iterator[socket.socket]:
    """A backend that accepts connections and never reads from them."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server
    server.close()
    for conn in held:
        conn.close()


@pytest.fixture(scope="module")
def front_stream_port() -> int:
    """The front-end's stream port, chosen first: the backend advertises it."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def backend(
    pki: Pki, front_stream_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The backend gateway: plaintext listeners, and one QMQP over TLS."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("backend"),
        BACKEND_CONFIG.format(tls=server_tls(pki), front_stream_port=front_stream_port),
        routes=BACKEND_ROUTES,
        secrets=BACKEND_SECRETS,
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def front(
    pki: Pki,
    backend: GatewayProcess,
    recorder: Recorder,
    tarpit: socket.socket,
    front_stream_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """The front-end gateway: TLS with client certificates, relaying to the backends."""
    tls = server_tls(pki)
    tls_backend = (
        f"tls:host=127.0.0.1:port={backend.address('qmqp-tls')[1]}:trustRoots={pki.trust_dir}"
        f":certificate={pki.alice_cert}:privateKey={pki.alice_key}"
    )
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed = probe.getsockname()[1]  # nothing listens there once closed
    config = FRONT_CONFIG.format(
        tls=tls,
        stream_tls=tls.replace("mtls:0:", f"mtls:{front_stream_port}:"),
        hub=backend.address("hub")[1],
        qmqp=backend.address("qmqp")[1],
        streams=backend.address("streams")[1],
        recorder=recorder.port,
        tarpit=tarpit.getsockname()[1],
        tls_backend=tls_backend,
        closed=closed,
    )
    process = GatewayProcess(
        tmp_path_factory.mktemp("front"), config, secrets=FRONT_SECRETS
    ).start()
    yield process
    process.stop()


def context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context trusting the test CA, presenting ``cert`` if given."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def alice(pki: Pki) -> ssl.SSLContext:
    """Alice's client context."""
    return context(pki, pki.alice_cert, pki.alice_key)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_ssmp_login_by_certificate_reaches_the_backend(
    front: GatewayProcess, backend: GatewayProcess, pki: Pki
) -> None:
    """``LOGIN alice cert`` through the front-end logs in to the backend as alice; MCAST flows."""
    bob = LineClient(backend.address("hub"))
    bob.send("LOGIN bob secret bob-secret", "SUBSCRIBE news")
    bob.expect_code(200)
    bob.expect_code(200)
    client = LineClient(front.address("ssmp"), alice(pki))
    client.send("LOGIN alice cert")
    client.expect_code(200)
    client.send("SUBSCRIBE news", "MCAST news hello from alice")
    client.expect_code(200)
    client.expect_code(200)
    bob.expect("000 alice MCAST news hello from alice")
    bob.send("UCAST alice hi alice")
    bob.expect_code(200)
    client.expect("000 bob UCAST alice hi alice")


def test_ssmp_login_as_someone_else_is_refused(front: GatewayProcess, pki: Pki) -> None:
    """A LOGIN for a name the certificate does not hold gets ``401 cert`` and a close."""
    client = LineClient(front.address("ssmp"), alice(pki))
    client.send("LOGIN bob cert")
    client.expect("401 cert")
    with pytest.raises(EOFError):
        client.read_line()


def test_ssmp_login_the_backend_refuses_is_401_cert(front: GatewayProcess, pki: Pki) -> None:
    """A backend secret the backend does not accept: the client gets ``401 cert``, then a close."""
    client = LineClient(front.address("ssmp"), alice(pki))
    client.send("LOGIN alice@example.org cert")
    client.expect("401 cert")
    with pytest.raises(EOFError):
        client.read_line()
    front.wait_for_log("backend refused the login of alice@example.org")


@pytest.mark.parametrize("listener", ["qmqp", "reencrypted"])
def test_qmqp_mail_through_the_front_end(
    front: GatewayProcess, backend: GatewayProcess, pki: Pki, listener: str
) -> None:
    """QMQP blocks reach the backend with their ids; its K replies come back; the mail is routed.

    ``reencrypted`` relays to the backend over TLS (a ``tls:`` backend endpoint
    with a client certificate) instead of plaintext.
    """
    bob = LineClient(backend.address("hub"))
    bob.send("LOGIN bob secret bob-secret", "SUBSCRIBE mail.carol")
    bob.expect_code(200)
    bob.expect_code(200)
    mail = b"From: alice@example.org\nsubject: greetings\n\nbody\n"
    blocks = (
        b"".join(
            qmqp.encode(
                qmqp.MessageBlock(
                    id=ident,
                    message=mail,
                    sender=b"alice@example.org",
                    recipients=(b"carol@example.org",),
                )
            )
            for ident in (b"m-1", b"m-2")
        )
        + qmqp.DONE_BYTES
    )
    with (
        socket.create_connection(front.address(listener), timeout=READ_TIMEOUT_SECONDS) as raw,
        alice(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(blocks)
        replies = qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(read_until_closed(tls))
    statuses = {block.id: block.status for block in replies if isinstance(block, qmqp.ReplyBlock)}
    assert statuses == {b"m-1": b"K", b"m-2": b"K"}
    assert replies[-1] == qmqp.DONE
    delivered = bob.read_lines(2)
    assert all(b" MCAST mail.carol greetings" in line for line in delivered), delivered


def test_qmqp_backend_down_gets_z(front: GatewayProcess, pki: Pki) -> None:
    """With the backend unreachable, every QMQP block is answered Z, then the done block."""
    block = qmqp.encode(
        qmqp.MessageBlock(id=b"z-1", message=b"x\n", sender=b"a@b", recipients=(b"c@d",))
    )
    with (
        socket.create_connection(front.address("down"), timeout=READ_TIMEOUT_SECONDS) as raw,
        alice(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(block + qmqp.DONE_BYTES)
        replies = qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(read_until_closed(tls))
    assert [(r.id, r.status) for r in replies if isinstance(r, qmqp.ReplyBlock)] == [(b"z-1", b"Z")]
    assert replies[-1] == qmqp.DONE


class StreamSession:
    """A stream client over TLS, through our client codec."""

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self.tls = tls
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self.events: list[sp.Event] = []

    def ask(self, event: sp.Event) -> sp.Event:
        """Send a frame and return the next frame from the server."""
        self.tls.sendall(self.codec.send(event))
        return self.read()

    def read(self) -> sp.Event:
        """The next frame from the server."""
        while not self.events:
            data = self.tls.recv(65536)
            assert data, "closed"
            self.events.extend(self.codec.receive_data(data))
        return self.events.pop(0)


def test_stream_publish_and_confirm_through_the_front_end(front: GatewayProcess, pki: Pki) -> None:
    """The stream protocol end to end: PLAIN login at the backend, create, publish, confirm."""
    with (
        socket.create_connection(front.address("streams"), timeout=READ_TIMEOUT_SECONDS) as raw,
        alice(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        session = StreamSession(tls)
        assert isinstance(
            session.ask(sp.PeerProperties(correlation_id=1, properties={})),
            sp.PeerPropertiesResponse,
        )
        offered = session.ask(sp.SaslHandshake(correlation_id=2))
        assert isinstance(offered, sp.SaslHandshakeResponse) and "PLAIN" in offered.mechanisms
        answer = session.ask(
            sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest")
        )
        assert answer == sp.SaslAuthenticateResponse(correlation_id=3, code=1)
        tune = session.read()
        assert isinstance(tune, sp.Tune)
        tls.sendall(session.codec.send(sp.Tune(frame_max=tune.frame_max, heartbeat=0)))
        opened = session.ask(sp.Open(correlation_id=4, virtual_host="/"))
        assert isinstance(opened, sp.OpenResponse) and opened.code == 1
        created = session.ask(sp.Create(correlation_id=5, stream="orders"))
        assert isinstance(created, sp.Response) and created.code == 1
        declared = session.ask(
            sp.DeclarePublisher(correlation_id=6, publisher_id=1, reference="", stream="orders")
        )
        assert isinstance(declared, sp.Response) and declared.code == 1
        confirm = session.ask(
            sp.Publish(publisher_id=1, publishing_ids=[7, 8], messages=[b"a", b"b"])
        )
        assert confirm == sp.PublishConfirm(publisher_id=1, publishing_ids=[7, 8])


def test_the_backend_sees_the_protocol_unchanged(
    front: GatewayProcess, recorder: Recorder, pki: Pki
) -> None:
    """Bytes both ways are relayed verbatim, but for the SSMP LOGIN the front-end rewrites."""
    session = b"SUBSCRIBE news\nMCAST news caf\xc3\xa9 \x01 binary-ish\nPING\nCLOSE\n"
    qmqp_session = (
        qmqp.encode(
            qmqp.MessageBlock(id=b"r-1", message=b"m\n", sender=b"a@b", recipients=(b"c@d",))
        )
        + qmqp.DONE_BYTES
    )
    received: list[bytes] = []
    for listener, data in (
        ("recorded-ssmp", b"LOGIN alice/phone cert\n" + session),
        ("recorded-qmqp", qmqp_session),
    ):
        with (
            socket.create_connection(front.address(listener), timeout=READ_TIMEOUT_SECONDS) as raw,
            alice(pki).wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            tls.sendall(data)
            got = b""
            while len(got) < len(RECORDER_REPLY):
                chunk = tls.recv(65536)
                assert chunk, "closed early"
                got += chunk
            received.append(got)
    assert received == [RECORDER_REPLY, RECORDER_REPLY]
    ssmp_seen, qmqp_seen = recorder.received(2)
    assert ssmp_seen == b"LOGIN alice/phone secret shared-backend-secret\n" + session
    assert qmqp_seen == qmqp_session


@pytest.mark.parametrize("handshake", [False, True])
def test_silent_clients_are_closed_at_the_time_out(
    front: GatewayProcess, pki: Pki, handshake: bool
) -> None:
    """A client that never starts TLS, or never sends its LOGIN, is closed after 0.5 s."""
    started = time.monotonic()
    with socket.create_connection(front.address("slow"), timeout=READ_TIMEOUT_SECONDS) as raw:
        if handshake:
            with alice(pki).wrap_socket(raw, server_hostname="localhost") as tls:
                assert closed_by_peer(tls)
        else:
            assert closed_by_peer(raw)  # mid-handshake: aborted (a reset)
    assert time.monotonic() - started < READ_TIMEOUT_SECONDS


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed or reset the connection before sending anything."""
    try:
        return sock.recv(64) == b""
    except (ConnectionResetError, ssl.SSLEOFError):
        return True


STALL_LIMIT_BYTES = 64 * 1024 * 1024
"""What the stalled-backend test offers at most; a relay without flow control takes it all."""


def test_a_stalled_backend_stops_the_front_end_reading(front: GatewayProcess, pki: Pki) -> None:
    """A backend that never reads makes the front-end stop reading from the client.

    The client writes until its socket stays unwritable for a second (or the
    limit is offered); only what the kernel buffers on both connections and
    one buffer of the front-end's are taken, far below the limit.
    """
    chunk = b"\x00" * 65536
    sent = 0
    with (
        socket.create_connection(front.address("stalled"), timeout=READ_TIMEOUT_SECONDS) as raw,
        alice(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.setblocking(False)
        while sent < STALL_LIMIT_BYTES:
            _, writable, _ = select.select([], [tls], [], 1.0)
            if not writable:
                break
            with contextlib.suppress(ssl.SSLWantWriteError, ssl.SSLWantReadError):
                sent += tls.send(chunk)
    assert sent < STALL_LIMIT_BYTES // 2, f"{sent} bytes taken by a relay to a stalled backend"


@pytest.mark.parametrize("who", ["nobody", "mallory"])
def test_clients_without_a_good_certificate_are_refused_at_tls(
    front: GatewayProcess, pki: Pki, who: str
) -> None:
    """No certificate, or one from another CA: the TLS handshake fails and nothing is relayed."""
    ctx = context(pki) if who == "nobody" else context(pki, pki.mallory_cert, pki.mallory_key)
    with (
        socket.create_connection(front.address("qmqp"), timeout=READ_TIMEOUT_SECONDS) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, EOFError)),
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(qmqp.DONE_BYTES)
        if not tls.recv(64):  # TLS 1.3: the refusal arrives after the client's handshake
            raise EOFError("closed")


async def _rstream_round_trip(port: int, ctx: ssl.SSLContext) -> list[bytes]:
    """Rstream over TLS: publish 20 with confirms, then consume them from the first offset."""
    connection: dict[str, Any] = {
        "host": "localhost",
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

    def take(message: Any, _context: Any) -> bool:
        got.append(bytes(message))
        return len(got) == 20

    await read_stream_until(connection, "through-front", take, amqp=False)
    return got


def test_rstream_publishes_and_consumes_through_the_front_end(
    front: GatewayProcess, pki: Pki
) -> None:
    """A third-party client (rstream, over TLS) publishes with confirms and reads back."""
    _, port = front.address("streams")
    got = asyncio.run(asyncio.wait_for(_rstream_round_trip(port, alice(pki)), 60))
    assert got == [f"m{i}".encode() for i in range(20)]
