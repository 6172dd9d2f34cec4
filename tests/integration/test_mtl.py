"""MTL end to end: the gateway under twistd and raw pyzmq clients written from the spec.

The clients here use pyzmq directly (REQ for control, DEALER for data) and
encode data commands with struct from the spec's field lists, not with the
project's codec: the whole control dialogue, the test profile's fan-out
with several writers and readers, the gateway profile bridged to SSMP with
confirm=full (a rejection from the destination comes back as Reject), and
ill-formed requests that must not stop the listener.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
ping_interval_seconds = 0.5
dead_after_seconds = 30
"""
SECRETS = '[logins]\nalice = "wonderland"\n'
ROUTES = {
    # gateway-profile writers publish on SSMP topics; "bad.*" content cannot
    # be carried (an SSMP topic may not contain a space): rejected.
    "to-hub": 'from = "mtl"\nmatch = "#"\nto = "hub"\n',
    "from-hub": 'from = "hub"\nmatch = "news.#"\nto = "mtl"\naddress = "news"\n',
    "alerts": 'from = "hub"\nmatch = "alerts.#"\nto = "mtl"\naddress = "alerts"\n',
    "mail": 'from = "mail"\nmatch = "#@example.org"\nto = "mtl"\naddress = "mail"\n',
}

TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with an MTL listener (PLAIN required) and an SSMP hub."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("mtl"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZeroMQ context, closed after the test."""
    made: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield made
    made.destroy(linger=0)


def recv(socket: zmq.Socket[bytes]) -> list[bytes]:
    """One multipart message, within the time-out."""
    assert socket.poll(TIMEOUT_MS), "nothing arrived in time"
    return socket.recv_multipart()


class Control:
    """A REQ control client."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.socket = context.socket(zmq.REQ)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, command: str, body: object) -> tuple[int, dict[str, object]]:
        """Send a request; return the status and the JSON reply."""
        self.socket.send_multipart([command.encode(), json.dumps(body).encode()])
        status, reply = recv(self.socket)
        return int(status), json.loads(reply)

    def ready(
        self, profile: str, kind: str, resources: list[str], confirm: str = "none"
    ) -> tuple[int, str]:
        """Open, authorize as alice, pick a profile and get a lease; the data port and lease."""
        assert (
            self.ask(
                "Connection.Open", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "/"}
            )[0]
            == 401
        )
        plain = base64.b64encode(b"\0alice\0wonderland").decode()
        assert self.ask("connection.authorize", {"mechanism": "PLAIN", "response": plain})[0] == 201
        assert self.ask("Connection.Profile", {"profile": profile})[0] == 200
        status, reply = self.ask(f"Connection.{kind}", {"resources": resources, "confirm": confirm})
        assert status == 202, reply
        return int(reply["port"]), str(reply["lease"])  # type: ignore[call-overload]


def u64(value: int) -> bytes:
    """An MTL integer: 8 bytes, network order."""
    return struct.pack(">Q", value)


def short(text: str) -> bytes:
    """An MTL short string."""
    data = text.encode()
    return bytes((len(data),)) + data


class Data:
    """A DEALER data client."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def command(self, header: bytes, body: bytes = b"") -> None:
        """Send one data command."""
        self.socket.send_multipart([header, body])

    def next(self, skip_pings: bool = True) -> tuple[int, bytes, bytes]:
        """The next command: type, header fields, body (Pings are answered and skipped)."""
        while True:
            header, body = recv(self.socket)
            if header[0] == 0x08 and skip_pings:
                self.command(b"\x09")
                continue
            return header[0], header[1:], body

    def response(self, sequence: int) -> int:
        """Wait for the Response to ``sequence``; its code."""
        kind, fields, body = self.next()
        assert kind == 0x02 and fields == u64(sequence), (kind, fields, body)
        return int(body)

    def lease(self, lease: str) -> int:
        """Send Lease; the response code."""
        self.command(b"\x01" + u64(1) + short(lease))
        return self.response(1)

    def content(self, sequence: int, resource: str, body: bytes) -> None:
        """Send Content with no properties (an empty field table)."""
        self.command(b"\x05" + u64(sequence) + short(resource) + b"\0\0\0\0", body)


def test_the_control_dialogue(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Open, 401, wrong password, 402 for an empty response, 201, profiles, leases, 501, 400s."""
    control = Control(context, gateway.address("mtl")[1])
    assert control.ask("Connection.Profile", {"profile": "test"})[0] == 400  # before Open
    status, reply = control.ask(
        "CONNECTION.OPEN", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}
    )
    assert (status, reply) == (401, {"status": "Unauthorized", "mechanisms": ["PLAIN"]})
    wrong = base64.b64encode(b"\0alice\0nope").decode()
    assert control.ask("Connection.Authorize", {"mechanism": "PLAIN", "response": wrong})[0] == 401
    status, reply = control.ask("Connection.Authorize", {"mechanism": "PLAIN", "response": ""})
    assert (status, reply["status"]) == (402, "Challenged")
    right = base64.b64encode(b"\0alice\0wonderland").decode()
    status, reply = control.ask("Connection.Authorize", {"mechanism": "PLAIN", "response": right})
    assert status == 201 and sorted(reply["profiles"]) == ["gateway", "test"]  # type: ignore[arg-type]
    assert (
        control.ask("Connection.Reader", {"resources": [], "confirm": "none"})[0] == 400
    )  # no profile
    assert control.ask("Connection.Profile", {"profile": "nope"})[0] == 400
    assert control.ask("Connection.Profile", {"profile": "TEST"})[0] == 200
    assert (
        control.ask("Connection.Reader", {"resources": ["resource"], "confirm": "full"})[0] == 501
    )
    assert control.ask("Connection.Writer", {"resources": ["other"], "confirm": "none"})[0] == 400
    status, reply = control.ask("Connection.Writer", {"resources": [], "confirm": "none"})
    assert status == 202 and isinstance(reply["port"], int) and reply["lease"]


def test_ill_formed_requests_are_dropped(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Wrong frame counts and bad JSON get no reply; the listener serves the next peer."""
    port = gateway.address("mtl")[1]
    raw = context.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{port}")
    raw.send_multipart([b"", b"Connection.Open"])
    raw.send_multipart([b"", b"Connection.Open", b"{not json"])
    raw.send_multipart([b"", b"Connection.Open", b"{}", b"extra"])
    assert not raw.poll(300)
    other = Control(context, port)
    assert other.ask("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})[0] == 401
    raw.close(linger=0)


def test_test_profile_fans_out(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Two writers, three readers: every reader gets every writer's content."""
    port = gateway.address("mtl")[1]
    readers = []
    for _ in range(3):
        data_port, lease = Control(context, port).ready("test", "Reader", ["resource"])
        reader = Data(context, data_port)
        assert reader.lease(lease) == 200
        reader.command(b"\x03" + u64(2) + short("resource"))  # Summon
        assert reader.response(2) == 200
        reader.command(b"\x03" + u64(3) + short("resource"))  # twice: refused
        assert reader.response(3) == 400
        readers.append(reader)
    writers = []
    for _ in range(2):
        data_port, lease = Control(context, port).ready("test", "Writer", [])
        writer = Data(context, data_port)
        assert writer.lease(lease) == 200
        writers.append(writer)
    for index, writer in enumerate(writers):
        writer.content(1, "", b"from writer %d" % index)
    for reader in readers:
        got = sorted(reader.next()[2] for _ in writers)
        assert got == [b"from writer 0", b"from writer 1"]
    readers[0].command(b"\x04" + u64(9) + short("resource"))  # Dismiss
    assert readers[0].response(9) == 200


def test_gateway_profile_with_confirmations(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Writer content is routed to SSMP: Confirm when delivered, Reject when refused; and back."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Writer", [], confirm="full")
    writer = Data(context, data_port)
    assert writer.lease(lease) == 200
    assert Data(context, data_port).lease("forged") == 403
    with LineClient(gateway.address("hub")) as watcher:
        watcher.send("LOGIN watcher open", "SUBSCRIBE weather.paris")
        watcher.expect("200")
        watcher.expect("200")
        writer.content(41, "weather.paris", b"rain")
        kind, fields, _ = writer.next()
        assert (kind, fields) == (0x06, u64(41) + b"\x00")  # Confirm, not multiple
        watcher.expect("000 . MCAST weather.paris rain")
        writer.content(42, "weather.paris", b"two\nlines")  # SSMP cannot carry a LF
        kind, fields, _ = writer.next()
        assert (kind, fields) == (0x07, u64(42) + b"\x00\x00")  # Reject, no recycle
        data_port, lease = Control(context, port).ready(
            "gateway", "Reader", ["news"], confirm="full"
        )
        reader = Data(context, data_port)
        assert reader.lease(lease) == 200
        reader.command(b"\x03" + u64(2) + short("news"))
        assert reader.response(2) == 200
        watcher.send("MCAST news.local market opens")
        kind, fields, body = reader.next()
        assert kind == 0x05 and body == b"market opens"
        sequence = fields[:8]
        reader.command(b"\x06" + sequence + b"\x00")  # Confirm: the publisher hears 200
        watcher.expect("200")
        watcher.send("MCAST news.local second")
        kind, fields, body = reader.next()
        reader.command(b"\x07" + fields[:8] + b"\x00\x00")  # Reject: the publisher hears 400
        assert watcher.read_line().startswith(b"400 rejected")


CLIENT = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.far]
protocol = "mtl"
endpoint = "tcp:host=127.0.0.1:port={port}"
mode = "writer"
profile = "gateway"
confirm = "full"
username = "alice"
"""


def test_our_client_against_our_server(gateway: GatewayProcess, tmp_path: Path) -> None:
    """SSMP on gateway A through its MTL upstream into gateway B: 200 on Confirm, 400 on Reject."""
    client = GatewayProcess(
        tmp_path / "a",
        CLIENT.format(port=gateway.address("mtl")[1]),
        routes={
            "out": 'from = "hub"\nmatch = "weather.#"\nto = "far"\n',
            # B's hub cannot publish on a topic with a space: rejected there.
            "bad": 'from = "hub"\nmatch = "reject.#"\nto = "far"\naddress = "no good"\n',
        },
        secrets='[upstreams]\nfar = "wonderland"\n',
    ).start()
    try:
        client.wait_for_log("upstream far: connected")
        with (
            LineClient(gateway.address("hub")) as watcher,
            LineClient(client.address("hub")) as publisher,
        ):
            watcher.send("LOGIN watcher2 open", "SUBSCRIBE weather.rome")
            watcher.expect("200")
            watcher.expect("200")
            publisher.send("LOGIN sensor-9 open", "MCAST weather.rome sunny")
            publisher.expect("200")
            publisher.expect("200")  # B's hub took it: Confirm came back
            watcher.expect("000 sensor-9 MCAST weather.rome sunny")
            publisher.send("MCAST reject.me please")
            answer = publisher.read_line()
            assert answer.startswith(b"400 rejected"), answer
    finally:
        client.stop()


READER = CLIENT.replace('mode = "writer"', 'mode = "reader"\nresources = ["alerts"]')


def test_our_client_reading(gateway: GatewayProcess, tmp_path: Path) -> None:
    """Gateway C reads B's "alerts" through an MTL upstream; B's publisher hears C's answer."""
    client = GatewayProcess(
        tmp_path / "c",
        READER.format(port=gateway.address("mtl")[1]),
        routes={"in": 'from = "far"\nmatch = "alerts"\nto = "hub"\naddress = "relay.alerts"\n'},
        secrets='[upstreams]\nfar = "wonderland"\n',
    ).start()
    try:
        client.wait_for_log("upstream far: summoned alerts")
        with LineClient(client.address("hub")) as watcher:
            watcher.send("LOGIN watcher3 open", "SUBSCRIBE relay.alerts")
            watcher.expect("200")
            watcher.expect("200")
            with LineClient(gateway.address("hub")) as publisher:
                publisher.send("LOGIN sensor-4 open", "MCAST alerts.fire smoke")
                publisher.expect("200")
                publisher.expect("200")  # C's reader confirmed after its route delivered
            watcher.expect("000 sensor-4 MCAST relay.alerts smoke")
    finally:
        client.stop()


def test_qmqp_mail_to_an_mtl_reader(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """QMQP mail routed to resource "mail": the reader's Confirm is the K, its Reject the D."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Reader", ["mail"], confirm="full")
    reader = Data(context, data_port)
    assert reader.lease(lease) == 200
    reader.command(b"\x03" + u64(2) + short("mail"))
    assert reader.response(2) == 200
    session = QMQPSession(gateway.address("mail"))
    try:
        session.send(mail("m-1", "ops@example.org") + mail("m-2", "ops@example.org"))
        for answer in (b"\x06", b"\x07"):  # Confirm the first, Reject the second
            kind, fields, body = reader.next()
            assert kind == 0x05 and body.startswith(b"From: app@example.org")
            reader.command(answer + fields[:8] + (b"\x00" if answer == b"\x06" else b"\x00\x00"))
        replies = {block.id: block.status for block in session.read_blocks(2)}  # type: ignore[union-attr]
        assert replies == {b"m-1": qmqp.K, b"m-2": qmqp.D}
    finally:
        session.close()
