"""QMQP streaming end to end: real twistd processes, plain sockets.

The sample sessions of the spec are replayed byte for byte; bad input gets a
D for the block when it can be identified, or a close when the stream
cannot be resynchronised; messages cross to SSMP and back with honest
K/Z/D; and a 100,000-message stream gets exactly one reply per id.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from gateway.codecs import qmqp
from gateway.codecs.framing import encode_netstrings
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

# The spec's sample sessions, from its hex dumps (the prose had addresses scrubbed).
CLIENT_SESSION = bytes.fromhex(
    "3132323a313a4d2c343a6d7367312c37323a46726f6d3a20726f6f744064726"
    "82e6e65740a546f3a20646861727269734064726"
    "82e6e65740a7375626a6563743a2068690a0a74686973206973207468652"
    "06d6573736167650a2c31323a726f6f744064726"
    "82e6e65742c31353a646861727269734064726"
    "82e6e65742c2c3132323a313a4d2c343a6d7367322c37323a46726f6d3a20726f6f744064726"
    "82e6e65740a546f3a20646861727269734064726"
    "82e6e65740a7375626a6563743a2068690a0a74686973206973207468652"
    "06d6573736167650a2c31323a726f6f744064726"
    "82e6e65742c31353a646861727269734064726"
    "82e6e65742c2c313a442c"
)
SERVER_SESSION = b"19:1:R,4:msg1,1:K,1:1,,19:1:R,4:msg2,1:K,1:0,,1:D,"
AUTH_REQUEST = b"34:1:A,10:myusername,12:the_password,,"

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
max_message_bytes = 4096

[listeners.locked]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"
"""

SECRETS = """
[logins]
myusername = "the_password"
"""

ROUTES = {
    # The spec's recipients (drh.net) and ok.example go to the hub: K.
    "drh": 'from = "qmqp"\nmatch = "#@drh.net"\nto = "hub"\naddress = "mail.{address}"\n'
    'body = "subject"\n',
    "ok": 'from = "qmqp"\nmatch = "#@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "locked": 'from = "locked"\nmatch = "#"\nto = "hub"\naddress = "locked"\nbody = "subject"\n',
    # down.example goes to an SSMP server that is not there: Z.
    "down": 'from = "qmqp"\nmatch = "#@down.example"\nto = "nowhere"\nbody = "subject"\n',
    # Anything else has no route: D.
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway with QMQP listeners, an SSMP hub and the routes above."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("qmqp"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


def mail(block_id: str, *recipients: str, subject: str = "hi", size: int = 0) -> bytes:
    """One encoded message block."""
    body = f"From: app@example.org\nSubject: {subject}\n\n".encode() + b"x" * size + b"\n"
    return qmqp.encode(
        qmqp.MessageBlock(
            id=block_id.encode(),
            message=body,
            sender=b"app@example.org",
            recipients=tuple(r.encode() for r in recipients),
        )
    )


class QMQPSession:
    """A plain-socket QMQP client that reads replies with the codec."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=30)
        self.codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        self.blocks: list[qmqp.Block] = []
        self.raw = b""

    def send(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def read_blocks(self, count: int) -> list[qmqp.Block]:
        """Return the next ``count`` blocks from the server."""
        while len(self.blocks) < count:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError(f"closed after {self.blocks}")
            self.raw += data
            self.blocks.extend(self.codec.receive_data(data))
        taken, self.blocks = self.blocks[:count], self.blocks[count:]
        return taken

    def read_to_end(self) -> bytes:
        """Read until the server closes; return everything it sent."""
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                return self.raw
            self.raw += data

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


@pytest.fixture
def session(gateway: GatewayProcess) -> Iterator[QMQPSession]:
    """A fresh client connection to the open QMQP listener."""
    client = QMQPSession(gateway.address("qmqp"))
    yield client
    client.close()


# --- the spec's samples ---------------------------------------------------------------


def test_sample_session_byte_for_byte(session: QMQPSession) -> None:
    """The client sample in, exactly the server sample out, then the close."""
    session.send(CLIENT_SESSION)
    assert session.read_to_end() == SERVER_SESSION


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [
        (AUTH_REQUEST, b"8:1:A,1:1,,"),
        (AUTH_REQUEST.replace(b"the_password", b"the_passw0rd"), b"8:1:A,1:0,,"),
    ],
    ids=["right-password", "wrong-password"],
)
def test_sample_auth(gateway: GatewayProcess, request_bytes: bytes, reply: bytes) -> None:
    """The spec's A block; success is "1" as the prose says (its example shows "0")."""
    client = QMQPSession(gateway.address("locked"))
    try:
        client.send(request_bytes)
        client.read_blocks(1)
        assert client.raw == reply
    finally:
        client.close()


def test_required_auth(gateway: GatewayProcess) -> None:
    """Where authentication is required, M blocks before it get D, after it K."""
    client = QMQPSession(gateway.address("locked"))
    try:
        client.send(mail("early", "a@b.c") + AUTH_REQUEST + mail("late", "a@b.c") + b"1:D,")
        early, auth, late, done = client.read_blocks(4)
        assert isinstance(early, qmqp.ReplyBlock) and early.status == qmqp.D
        assert b"authentication required" in early.description
        assert auth == qmqp.AuthReplyBlock(success=True)
        assert isinstance(late, qmqp.ReplyBlock) and late.status == qmqp.K
        assert done == qmqp.DoneBlock()
    finally:
        client.close()


# --- honest replies -----------------------------------------------------------------------


def test_k_z_d_through_routes(gateway: GatewayProcess, session: QMQPSession) -> None:
    """K when the hub took it, Z when the destination is down, D without a route."""
    with LineClient(gateway.address("hub")) as watcher:
        watcher.send("LOGIN watcher open", "SUBSCRIBE mail.ops")
        watcher.expect("200")
        watcher.expect("200")
        session.send(
            mail("ok", "ops@ok.example", subject="disk full")
            + mail("down", "ops@down.example")
            + mail("nowhere", "ops@elsewhere.example")
            + mail("mixed", "ops@ok.example", "bob@elsewhere.example")
            + b"1:D,"
        )
        replies = {
            block.id: block
            for block in session.read_blocks(4)
            if isinstance(block, qmqp.ReplyBlock)
        }
        assert session.read_blocks(1) == [qmqp.DoneBlock()]
        watcher.expect("000 app@example.org MCAST mail.ops disk full")
    assert replies[b"ok"].status == qmqp.K
    assert replies[b"down"].status == qmqp.Z
    assert b"nowhere is not connected" in replies[b"down"].description
    assert replies[b"nowhere"].status == qmqp.D
    assert replies[b"nowhere"].description == b"no route for recipient ops@elsewhere.example"
    # One answer for the whole message: one recipient without a route stops it all.
    assert replies[b"mixed"].status == qmqp.D
    assert b"bob@elsewhere.example" in replies[b"mixed"].description
    assert sorted(reply.pending for reply in replies.values()) == [0, 1, 2, 3]


# --- bad input ---------------------------------------------------------------------------


def test_identifiable_bad_blocks_get_d_and_the_stream_goes_on(session: QMQPSession) -> None:
    """No recipient, too large, unknown type: D for that block; the rest is served."""
    session.send(
        encode_netstrings([b"M", b"norcpt", b"Subject: x\n\n", b"a@b.c"])
        + mail("huge", "ops@ok.example", size=10_000)
        + encode_netstrings([b"X", b"strange", b"what"])
        + mail("fine", "ops@ok.example")
        + b"1:D,"
    )
    replies = {block.id: block for block in session.read_blocks(4)}
    assert {key: reply.status for key, reply in replies.items()} == {  # type: ignore[union-attr]
        b"norcpt": qmqp.D,
        b"huge": qmqp.D,
        b"strange": qmqp.D,
        b"fine": qmqp.K,
    }
    assert session.read_blocks(1) == [qmqp.DoneBlock()]


@pytest.mark.parametrize(
    "garbage",
    [b"12x:1:M,", b"0012:", b"5:1:M,1:x;", b"99999999999999999999:"],
    ids=["non-digit", "leading-zeros", "missing-comma", "oversized-length"],
)
def test_unsynchronisable_input_closes_after_answering(
    gateway: GatewayProcess, garbage: bytes
) -> None:
    """Broken framing: earlier messages are answered, then the connection closes."""
    client = QMQPSession(gateway.address("qmqp"))
    try:
        client.send(mail("before", "ops@ok.example") + garbage)
        data = client.read_to_end()
        blocks = qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(data)
        assert [(b.id, b.status) for b in blocks] == [(b"before", qmqp.K)]  # type: ignore[union-attr]
    finally:
        client.close()
    other = QMQPSession(gateway.address("qmqp"))  # the gateway serves on
    try:
        other.send(mail("after", "ops@ok.example") + b"1:D,")
        assert [b.status for b in other.read_blocks(1)] == [qmqp.K]  # type: ignore[union-attr]
    finally:
        other.close()


# --- volume ---------------------------------------------------------------------------------


def test_hundred_thousand_messages_one_reply_each(gateway: GatewayProcess) -> None:
    """A 100,000-message stream gets exactly one reply per id, then the done block."""
    count = 100_000
    client = QMQPSession(gateway.address("qmqp"))
    stream = b"".join(mail(f"m{i}", "ops@ok.example") for i in range(count)) + b"1:D,"

    def send_all() -> None:
        client.send(stream)

    sender = threading.Thread(target=send_all)
    sender.start()  # the gateway reads while replies flow back
    try:
        blocks = client.read_blocks(count + 1)
    finally:
        sender.join(60)
        client.close()
    replies = blocks[:count]
    assert blocks[count] == qmqp.DoneBlock()
    ids = [reply.id for reply in replies]  # type: ignore[union-attr]
    assert len(set(ids)) == count == len(ids)
    assert {reply.status for reply in replies} == {qmqp.K}  # type: ignore[union-attr]
    assert replies[-1].pending == 0  # type: ignore[union-attr]
