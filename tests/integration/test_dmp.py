"""DMP end to end: gateways under twistd and a raw-socket DMP peer written from the spec.

Gateway B (the DMP server) has a sink ``orders`` routed to its feed
``alerts``. Gateway A takes QMQP mail and writes it into B's sink through a
DMP upstream. The peer here speaks DMP with plain sockets and struct, from
the spec's dialog and envelope layout (not the project's codec): it reads
the feed, writes into the sink, presents bad leases and garbage.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

HEADER = b"AMQP\x0a\x01\x00\x01"  # "AMQP" %d10 1 0 1

SERVER = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]
feeds = ["alerts"]
heartbeat_seconds = 0.5
max_envelope_bytes = 65536
principals = ["app"]

[listeners.dmp.leases]
writer = { sink = "orders" }
reader = { feed = "alerts" }
expired = { sink = "orders", expires = "2001-01-01T00:00:00Z" }
"""
SERVER_SECRETS = (
    'admin_token = "t0ken"\n[logins]\napp = "app-pw"\n'
    '[leases]\nwriter = "lease-w"\nreader = "lease-r"\nexpired = "lease-x"\n'
)
SERVER_ROUTES = {
    "to-feed": 'from = "dmp"\nmatch = "orders.#"\nto = "dmp"\naddress = "alerts"\n',
    "ssmp-to-feed": 'from = "hub"\nmatch = "alerts.#"\nto = "dmp"\naddress = "alerts"\n',
}

CLIENT = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.orders]
protocol = "dmp"
endpoint = "tcp:host=127.0.0.1:port={port}"
mode = "put"
exchange = "orders"
"""
CLIENT_SECRETS = '[upstreams]\norders = "lease-w"\n'
CLIENT_ROUTES = {"mail": 'from = "mail"\nmatch = "#"\nto = "orders"\n'}


BASIC_PROPERTIES = (
    ("content_type", "shortstr"),
    ("content_encoding", "shortstr"),
    ("headers", "table"),
    ("delivery_mode", "octet"),
    ("priority", "octet"),
    ("correlation_id", "shortstr"),
    ("reply_to", "shortstr"),
    ("expiration", "shortstr"),
    ("message_id", "shortstr"),
    ("timestamp", "timestamp"),
    ("type", "shortstr"),
    ("user_id", "shortstr"),
    ("app_id", "shortstr"),
    ("cluster_id", "shortstr"),
)
"""AMQP 0-9-1 Basic properties in flag order, bit 15 first."""


class Peer:
    """A DMP client on a plain socket, written from the spec."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.buffer = b""

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed with {self.buffer!r} read")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def short_string(self) -> bytes:
        """One length octet, then that many bytes."""
        return self._read(self._read(1)[0])

    def open(self, lease: bytes) -> list[bytes]:
        """Header, then the lease; return both responses."""
        self.sock.sendall(HEADER)
        first = self.short_string()
        self.sock.sendall(bytes((len(lease),)) + lease)
        return [first, self.short_string()]

    def closed(self) -> bool:
        """Whether the server closed the connection."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def envelope(self) -> dict[str, object]:
        """The next non-null envelope, decoded field by field as the spec lays it out."""
        while True:
            (size,) = struct.unpack(">I", self._read(4))
            if size:
                break  # null messages are heartbeats
        data = self._read(size)
        pos = 0
        fields: dict[str, object] = {}
        for name in ("exchange", "routing_key"):
            fields[name] = data[pos + 1 : pos + 1 + data[pos]].decode()
            pos += 1 + data[pos]
        (flags,) = struct.unpack_from(">H", data, pos)
        pos += 2
        for index, (name, kind) in enumerate(BASIC_PROPERTIES):
            if not flags & (1 << (15 - index)):
                continue
            if kind == "shortstr":
                fields[name] = data[pos + 1 : pos + 1 + data[pos]].decode()
                pos += 1 + data[pos]
            elif kind == "table":  # kept raw: u32 length and the pairs
                (length,) = struct.unpack_from(">I", data, pos)
                fields[name] = data[pos + 4 : pos + 4 + length]
                pos += 4 + length
            elif kind == "octet":
                fields[name] = data[pos]
                pos += 1
            else:
                fields[name] = struct.unpack_from(">Q", data, pos)[0]
                pos += 8
        fields["options"] = data[pos]
        length = int.from_bytes(data[pos + 1 : pos + 4], "big")
        fields["body"] = data[pos + 4 : pos + 4 + length]
        assert pos + 4 + length == size, "the size counts everything up to the end of the body"
        return fields

    def write(self, routing_key: bytes, body: bytes, message_id: bytes = b"") -> None:
        """One envelope: empty exchange, the routing key, an optional message-id, the body."""
        flags = 0x0080 if message_id else 0  # bit 7: message-id
        props = bytes((len(message_id),)) + message_id if message_id else b""
        rest = (
            b"\x00"
            + bytes((len(routing_key),))
            + routing_key
            + struct.pack(">H", flags)
            + props
            + b"\x00"
            + len(body).to_bytes(3, "big")
            + body
        )
        self.sock.sendall(struct.pack(">I", len(rest)) + rest)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Gateway B: the DMP listener."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("dmp-server"), SERVER, routes=SERVER_ROUTES, secrets=SERVER_SECRETS
    ).start()
    yield process
    process.stop()


def test_the_dialog_and_bad_leases(server: GatewayProcess) -> None:
    """200 OK DMP/0.1 then 200 for a good lease; 402 for unknown and expired ones."""
    writer = Peer(server.address("dmp"))
    assert writer.open(b"lease-w") == [b"200 OK DMP/0.1", b'200 OK Ready to write to "orders"']
    for lease in (b"nope", b"lease-x"):
        peer = Peer(server.address("dmp"))
        answers = peer.open(lease)
        assert answers[0] == b"200 OK DMP/0.1" and answers[1].startswith(b"402 BAD-LEASE")
        assert peer.closed()
        peer.close()
    writer.close()


def test_many_writers_one_reader(server: GatewayProcess) -> None:
    """Three writers into the sink reach the one reader; a second reader gets 403."""
    reader = Peer(server.address("dmp"))
    assert reader.open(b"lease-r")[1] == b'200 OK Ready to read from "alerts"'
    second = Peer(server.address("dmp"))
    assert second.open(b"lease-r")[1].startswith(b"403 NO-ACCESS")
    assert second.closed()
    writers = [Peer(server.address("dmp")) for _ in range(3)]
    for index, writer in enumerate(writers):
        writer.open(b"lease-w")
        writer.write(b"eu", b"from writer %d" % index, message_id=b"w%d" % index)
    bodies = sorted(reader.envelope()["body"] for _ in writers)  # type: ignore[type-var]
    assert bodies == [b"from writer 0", b"from writer 1", b"from writer 2"]
    for peer in (reader, second, *writers):
        peer.close()


def test_garbage_and_oversized_envelopes_close_only_their_connection(
    server: GatewayProcess,
) -> None:
    """A wrong header gets 503; an envelope over the limit closes; others keep working."""
    peer = Peer(server.address("dmp"))
    peer.sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
    assert peer.short_string().startswith(b"503 INVALID")
    assert peer.closed()
    big = Peer(server.address("dmp"))
    big.open(b"lease-w")
    big.sock.sendall(struct.pack(">I", 1 << 20))
    assert big.closed()
    reader = Peer(server.address("dmp"))
    reader.open(b"lease-r")
    writer = Peer(server.address("dmp"))
    writer.open(b"lease-w")
    writer.write(b"", b"still served")
    assert reader.envelope()["body"] == b"still served"
    for each in (peer, big, reader, writer):
        each.close()


def test_qmqp_to_a_dmp_sink_to_the_feed_reader(server: GatewayProcess, tmp_path: Path) -> None:
    """QMQP mail through gateway A's DMP upstream into B's sink reaches B's feed reader."""
    reader = Peer(server.address("dmp"))
    reader.open(b"lease-r")
    client = GatewayProcess(
        tmp_path / "a",
        CLIENT.format(port=server.address("dmp")[1]),
        routes=CLIENT_ROUTES,
        secrets=CLIENT_SECRETS,
    ).start()
    try:
        client.wait_for_log("upstream orders: connected")
        session = QMQPSession(client.address("mail"))
        try:
            session.send(mail("q-17", "ops@example.org", "dev@example.org") + b"1:D,")
            reply, done = session.read_blocks(2)
            assert isinstance(reply, qmqp.ReplyBlock) and reply.status == qmqp.K
            assert done == qmqp.DoneBlock()
        finally:
            session.close()
        envelope = reader.envelope()
    finally:
        client.stop()
        reader.close()
    assert envelope["body"].startswith(b"From: app@example.org\nSubject: hi\n")  # type: ignore[union-attr]
    assert envelope["routing_key"] == "alerts"
    assert envelope["message_id"] == "q-17"
    assert envelope["app_id"] == "msggateway"
    headers = envelope["headers"]
    assert isinstance(headers, bytes)
    # x-gateway-sender: long string; x-gateway-recipients: an array of long strings.
    assert b"\x10x-gateway-senderS\x00\x00\x00\x0fapp@example.org" in headers
    recipients = b"S\x00\x00\x00\x0fops@example.orgS\x00\x00\x00\x0fdev@example.org"
    assert b"\x14x-gateway-recipientsA\x00\x00\x00\x28" + recipients in headers


def admin(
    server: GatewayProcess, method: str, path: str, body: object = None, token: str = "t0ken"
) -> tuple[int, dict[str, object]]:
    """One admin API request; the status and the JSON answer."""
    host, port = server.address("admin")
    request = urllib.request.Request(
        f"http://{host}:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refusal:
        return refusal.code, json.loads(refusal.read())


def test_leases_from_the_admin_api(server: GatewayProcess) -> None:
    """POST makes a lease that opens the sink; DELETE revokes it; the token is checked."""
    status, made = admin(server, "POST", "/leases", {"listener": "dmp", "sink": "orders"})
    assert status == 201 and made["sink"] == "orders"
    lease = str(made["lease"]).encode()
    peer = Peer(server.address("dmp"))
    assert peer.open(lease)[1] == b'200 OK Ready to write to "orders"'
    peer.close()
    assert admin(server, "DELETE", f"/leases/{made['lease']}")[0] == 200
    refused = Peer(server.address("dmp"))
    assert refused.open(lease)[1].startswith(b"402")
    refused.close()
    assert admin(server, "POST", "/leases", {"listener": "dmp", "sink": "x"})[0] == 404
    assert admin(server, "POST", "/leases", {"listener": "dmp", "feed": "alerts"}, "bad")[0] == 401
    assert admin(server, "DELETE", "/leases/unknown")[0] == 404


READER = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.alerts]
protocol = "dmp"
endpoint = "tcp:host=127.0.0.1:port={port}"
mode = "get"
dead_after_seconds = 5
"""


def test_an_upstream_reads_a_feed_into_ssmp(server: GatewayProcess, tmp_path: Path) -> None:
    """Gateway C reads B's feed through a DMP upstream and publishes it on its SSMP hub."""
    reader = GatewayProcess(
        tmp_path / "c",
        READER.format(port=server.address("dmp")[1]),
        routes={"feed": 'from = "alerts"\nmatch = "#"\nto = "hub"\naddress = "dmp.alerts"\n'},
        secrets='[upstreams]\nalerts = "lease-r"\n',
    ).start()
    try:
        reader.wait_for_log("upstream alerts: connected")
        with LineClient(reader.address("hub")) as watcher:
            watcher.send("LOGIN watcher open", "SUBSCRIBE dmp.alerts")
            watcher.expect("200")
            watcher.expect("200")
            writer = Peer(server.address("dmp"))
            writer.open(b"lease-w")
            writer.write(b"eu", b"to the hub")
            watcher.expect("000 . MCAST dmp.alerts to the hub")
            writer.close()
    finally:
        reader.stop()


def test_ssmp_topics_reach_a_feed(server: GatewayProcess) -> None:
    """An MCAST on an SSMP topic routed to the feed reaches its reader; 200 once written."""
    reader = Peer(server.address("dmp"))
    reader.open(b"lease-r")
    with LineClient(server.address("hub")) as publisher:
        publisher.send("LOGIN sensor-3 open", "MCAST alerts.fire smoke in hall 2")
        publisher.expect("200")
        publisher.expect("200")
    envelope = reader.envelope()
    reader.close()
    assert envelope["body"] == b"smoke in hall 2"
    assert envelope["routing_key"] == "alerts"
    assert b"sensor-3" in envelope["headers"]  # type: ignore[operator]


class Principal:
    """An AMQP 0-9-1 client on a plain socket, written from the 0-9-1 grammar.

    It logs in with PLAIN, opens channel 1 and asks for leases with the Direct
    class (61500: Put 10 / Put-Ok 11, Get 20 / Get-Ok 21).
    """

    def __init__(self, address: tuple[str, int], identity: bytes, password: bytes) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.buffer = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        start = self.method()
        assert start[:2] == (10, 10), start
        # server-properties: direct = 1, an integer written as RabbitMQ writes them ("l", int64).
        assert b"\x06directl" + struct.pack(">q", 1) in start[2]
        response = b"\0" + identity + b"\0" + password
        self.send(
            0,
            10,
            11,
            b"\0\0\0\0" + b"\x05PLAIN" + struct.pack(">I", len(response)) + response + b"\x05en_US",
        )
        self.tune = self.method()

    def open(self) -> None:
        """Tune-Ok, Open, Channel.Open; checks the -Ok replies."""
        self.send(0, 10, 31, struct.pack(">HIH", 1, 4096, 0))
        self.send(0, 10, 40, b"\x01/\x00\x00")
        assert self.method()[:2] == (10, 41)
        self.send(1, 20, 10, b"\x00")
        assert self.method()[:2] == (20, 11)

    def send(self, channel: int, class_id: int, method_id: int, arguments: bytes) -> None:
        """One method frame."""
        payload = struct.pack(">HH", class_id, method_id) + arguments
        self.sock.sendall(struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce")

    def method(self) -> tuple[int, int, bytes]:
        """The next method frame: class id, method id and the argument octets."""
        while True:
            while (
                len(self.buffer) < 7
                or len(self.buffer) < 8 + struct.unpack_from(">I", self.buffer, 3)[0]
            ):
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"closed with {self.buffer!r} read")
                self.buffer += chunk
            kind, _channel, size = struct.unpack_from(">BHI", self.buffer)
            payload, end = self.buffer[7 : 7 + size], self.buffer[7 + size]
            self.buffer = self.buffer[8 + size :]
            assert end == 0xCE
            if kind == 1:
                class_id, method_id = struct.unpack_from(">HH", payload)
                return class_id, method_id, payload[4:]

    def lease(self, method_id: int, name: bytes) -> tuple[int, int, bytes]:
        """Direct.Put (10) or Get (20); the reply (the -Ok's lease, or Channel.Close)."""
        self.send(1, 61500, method_id, bytes((len(name),)) + name)
        return self.method()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def test_leases_from_a_principal_amqp_connection(server: GatewayProcess) -> None:
    """Put-Ok and Get-Ok leases open the sink and the feed; a message goes from one to the other."""
    principal = Principal(server.address("dmp"), b"app", b"app-pw")
    assert principal.tune[:2] == (10, 30)
    principal.open()
    class_id, method_id, put_ok = principal.lease(10, b"orders")
    assert (class_id, method_id) == (61500, 11)
    writer_lease = put_ok[1 : 1 + put_ok[0]]
    # A reader of the feed from an earlier test may still be leaving: ask until it has.
    deadline = time.monotonic() + 10
    while True:
        class_id, method_id, get_ok = principal.lease(20, b"alerts")
        if (class_id, method_id) == (61500, 21) or time.monotonic() > deadline:
            break
        assert (class_id, method_id) == (20, 40)  # Channel.Close 405 RESOURCE_LOCKED
        principal.send(1, 20, 41, b"")
        principal.send(1, 20, 10, b"\x00")
        assert principal.method()[:2] == (20, 11)
    assert (class_id, method_id) == (61500, 21)
    reader = Peer(server.address("dmp"))
    assert reader.open(get_ok[1 : 1 + get_ok[0]])[1] == b'200 OK Ready to read from "alerts"'
    writer = Peer(server.address("dmp"))
    assert writer.open(writer_lease)[1] == b'200 OK Ready to write to "orders"'
    writer.write(b"eu", b"leased by AMQP")
    assert reader.envelope()["body"] == b"leased by AMQP"
    # An unknown sink: Channel.Close 404 NOT_FOUND naming Direct.Put.
    class_id, method_id, close = principal.lease(10, b"nope")
    assert (class_id, method_id) == (20, 40)
    assert struct.unpack_from(">H", close)[0] == 404
    for each in (principal, reader, writer):
        each.close()


def test_a_bad_principal_login_is_refused(server: GatewayProcess) -> None:
    """A wrong password gets Connection.Close 403 and the socket closes; DMP keeps serving."""
    principal = Principal(server.address("dmp"), b"app", b"wrong")
    class_id, method_id, close = principal.tune
    assert (class_id, method_id) == (10, 50)
    assert struct.unpack_from(">H", close)[0] == 403
    assert principal.sock.recv(1) == b""
    principal.close()
    writer = Peer(server.address("dmp"))
    assert writer.open(b"lease-w")[1] == b'200 OK Ready to write to "orders"'
    writer.close()


PRINCIPAL_CLIENT = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.orders]
protocol = "dmp"
endpoint = "tcp:host=127.0.0.1:port={port}"
mode = "put"
principal = "app"
target = "orders"
"""


def test_an_upstream_gets_its_lease_over_amqp(server: GatewayProcess, tmp_path: Path) -> None:
    """Our upstream logs in as a principal, gets a Put-Ok lease, opens the sink; mail flows."""
    reader = Peer(server.address("dmp"))
    assert reader.open(b"lease-r")[1] == b'200 OK Ready to read from "alerts"'
    client = GatewayProcess(
        tmp_path / "p",
        PRINCIPAL_CLIENT.format(port=server.address("dmp")[1]),
        routes=CLIENT_ROUTES,
        secrets='[upstreams]\norders = "app-pw"\n',
    ).start()
    try:
        client.wait_for_log("upstream orders: connected")
        session = QMQPSession(client.address("mail"))
        try:
            session.send(mail("q-21", "ops@example.org") + b"1:D,")
            reply, _ = session.read_blocks(2)
            assert isinstance(reply, qmqp.ReplyBlock) and reply.status == qmqp.K
        finally:
            session.close()
        envelope = reader.envelope()
    finally:
        client.stop()
        reader.close()
    assert envelope["message_id"] == "q-21"


DURABLE_CLIENT = CLIENT.replace(
    'secrets = "secrets.toml"\n', 'secrets = "secrets.toml"\ndata_dir = "data"\n', 1
)
DURABLE_ROUTES = {"mail": 'from = "mail"\nmatch = "#"\nto = "orders"\ndurable = true\n'}


def test_qmqp_to_a_dmp_sink_on_a_durable_route(server: GatewayProcess, tmp_path: Path) -> None:
    """On a durable route K comes after the local commit; the forwarder then writes to the sink."""
    reader = Peer(server.address("dmp"))
    assert reader.open(b"lease-r")[1] == b'200 OK Ready to read from "alerts"'
    client = GatewayProcess(
        tmp_path / "d",
        DURABLE_CLIENT.format(port=server.address("dmp")[1]),
        routes=DURABLE_ROUTES,
        secrets=CLIENT_SECRETS,
    ).start()
    try:
        session = QMQPSession(client.address("mail"))
        try:
            session.send(mail("q-31", "ops@example.org") + b"1:D,")
            reply, _ = session.read_blocks(2)
            assert isinstance(reply, qmqp.ReplyBlock) and reply.status == qmqp.K
        finally:
            session.close()
        envelope = reader.envelope()
    finally:
        client.stop()
        reader.close()
    assert envelope["message_id"] == "q-31"
