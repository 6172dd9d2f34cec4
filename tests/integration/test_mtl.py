"""MTL end to end: the gateway under twistd and raw pyzmq clients written from the spec.

The clients here use pyzmq directly (REQ for control, DEALER for data) and
encode data commands with struct from the spec's field lists, not with the
project's codec: the whole control dialogue, the test profile's fan-out
with several writers and readers, the gateway profile bridged to SSMP with
confirm=full (a rejection from the destination comes back as Reject),
QMQP mail to a confirm=full reader (Confirm K, Reject D, recycle Z), pings
and dead-peer detection, ill-formed requests that must not stop the
listener; and our upstream against our server, including a server killed
and started again on the same port.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator
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
    "bulk": 'from = "hub"\nmatch = "bulk.#"\nto = "mtl"\naddress = "bulk"\n',
    "gone": 'from = "hub"\nmatch = "gone.#"\nto = "mtl"\naddress = "gone"\n',
    # QMQP mail for anyone at mtl.example goes to MTL readers of "inbox".
    "mail-in": 'from = "mail"\nmatch = "#@mtl.example"\nto = "mtl"\naddress = "inbox"\n',
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

    @staticmethod
    def learn(
        answers: dict[int, tuple[int, bytes]], kind: int, fields: bytes, sent: Iterable[int]
    ) -> None:
        """Note what a Confirm or Reject tells of the Contents ``sent``, in ``answers``.

        With ``multiple`` it answers every one up to its sequence not
        answered before (spec, "Content Confirmation"); each is noted as if
        answered alone: (type, its fields after the sequence, not multiple).
        """
        (sequence,) = struct.unpack(">Q", fields[:8])
        alone = b"\x00" + fields[9:]
        if fields[8]:
            covered = [s for s in sent if s <= sequence and s not in answers]
        else:
            covered = [sequence]
        for each in covered:
            answers[each] = (kind, alone)


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


def test_invalid_control_requests_are_answered(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Well-formed but invalid requests get 400 or 401 with a reason; the session goes on."""
    control = Control(context, gateway.address("mtl")[1])
    status, reply = control.ask("Connection.Open", {"protocol": {"name": "AMQP", "version": 1}})
    assert status == 400 and "MTL" in str(reply["reason"])
    status, reply = control.ask("Connection.Open", {"protocol": {"name": "MTL", "version": 2}})
    assert status == 400
    assert control.ask("Connection.Open", {"protocol": {"name": "mtl", "version": 1}})[0] == 401
    status, reply = control.ask("Connection.Authorize", {"mechanism": "GSSAPI", "response": ""})
    assert (status, reply["mechanisms"]) == (401, ["PLAIN"])
    status, reply = control.ask("Connection.Authorize", {"mechanism": "plain", "response": "!!"})
    assert status == 400 and "base64" in str(reply["reason"])
    no_separators = base64.b64encode(b"alice wonderland").decode()
    status, reply = control.ask(
        "Connection.Authorize", {"mechanism": "PLAIN", "response": no_separators}
    )
    assert status == 400 and "NUL" in str(reply["reason"])
    assert control.ask("Connection.Profile", {"profile": "test"})[0] == 401  # not logged in
    right = base64.b64encode(b"\0alice\0wonderland").decode()
    assert control.ask("Connection.Authorize", {"mechanism": "PLAIN", "response": right})[0] == 201
    status, reply = control.ask("Connection.Frobnicate", {})
    assert status == 400 and "connection.frobnicate" in str(reply["reason"])
    assert control.ask("Connection.Profile", {"profile": "Gateway"})[0] == 200
    status, reply = control.ask("Connection.Reader", {"resources": "news", "confirm": "none"})
    assert status == 400 and "list" in str(reply["reason"])
    status, reply = control.ask("Connection.Reader", {"resources": [], "confirm": "some"})
    assert status == 400
    assert control.ask("Connection.Reader", {"resources": [], "confirm": "FULL"})[0] == 202


def test_data_flow_garbage_and_invalid_commands(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Ill-formed data commands get nothing; invalid ones 403, 400 or Reject; the peer goes on."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("test", "Reader", ["resource"])
    data = Data(context, data_port)
    for frames in ([b"\x08"], [b"\x08", b"", b""], [b"\x0a", b""], [b"\x01\x00\x01", b""],
                   [b"\x06" + u64(1) + b"\x02", b""], [b"", b""], [b"\x05" + u64(1), b"x"],
                   [b"\x05" + u64(1) + b"\x00\x00\x00\x00\x09", b"x"]):  # fmt: skip
        data.socket.send_multipart(frames)
    data.command(b"\x06" + u64(77) + b"\x00")  # Confirm of nothing: ignored silently
    data.command(b"\x07" + u64(78) + b"\x01\x01")  # Reject of nothing: ignored silently
    deadline = time.monotonic() + 0.3
    while data.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        header, _ = data.socket.recv_multipart()
        assert header == b"\x08", header  # the listener's Pings, and nothing else
    data.command(b"\x03" + u64(5) + short("resource"))  # Summon before Lease
    assert data.response(5) == 403
    data.content(6, "resource", b"no lease")  # Content before Lease: rejected
    kind, fields, _ = data.next()
    assert (kind, fields) == (0x07, u64(6) + b"\x00\x00")
    assert data.lease("no such lease") == 403
    assert data.lease(lease) == 200
    data.command(b"\x03" + u64(7) + short("elsewhere"))  # not a leased resource
    assert data.response(7) == 400
    data.command(b"\x04" + u64(8) + short("resource"))  # Dismiss before Summon
    assert data.response(8) == 400
    data.command(b"\x08")  # Ping: Pong
    assert data.next()[0] == 0x09  # (a Ping from the listener meanwhile is answered)
    data.content(9, "resource", b"a reader may not write")
    kind, fields, _ = data.next()
    assert (kind, fields) == (0x07, u64(9) + b"\x00\x00")
    writer_port, writer_lease = Control(context, port).ready("gateway", "Writer", ["a", "b"])
    writer = Data(context, writer_port)
    assert writer.lease(writer_lease) == 200
    writer.content(1, "", b"two resources leased: which one?")
    writer.content(2, "c", b"not leased")
    for sequence in (1, 2):  # rejected although the lease has no confirmations
        kind, fields, _ = writer.next()
        assert (kind, fields) == (0x07, u64(sequence) + b"\x00\x00")


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
    # After the Response to Dismiss, nothing more from the resource for that reader.
    writers[0].content(2, "resource", b"after the dismiss")
    for reader in readers[1:]:
        assert reader.next()[2] == b"after the dismiss"
    readers[0].command(b"\x08")  # a Ping: its Pong comes after anything already sent
    assert readers[0].next()[0] == 0x09
    # Summoned again: content flows again, after the Response.
    readers[0].command(b"\x03" + u64(10) + short("resource"))
    assert readers[0].response(10) == 200
    writers[1].content(2, "", b"summoned again")
    assert readers[0].next()[2] == b"summoned again"


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


def test_a_burst_of_contents_is_answered_one_by_one(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Contents sent at once (routed as batches) each learn their own Confirm or Reject, in full.

    A run of accepted ones may be told with one Confirm with multiple.
    """
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Writer", [], confirm="full")
    writer = Data(context, data_port)
    assert writer.lease(lease) == 200
    count = 200
    with LineClient(gateway.address("hub")) as watcher:
        watcher.send("LOGIN burst-watcher open", "SUBSCRIBE burst.items")
        watcher.expect("200")
        watcher.expect("200")
        for sequence in range(1, count + 1):
            # Every third cannot be carried to SSMP (a LF in the payload): rejected.
            body = b"bad\nline" if sequence % 3 == 0 else b"item %d" % sequence
            writer.content(sequence, "burst.items", body)
        answers: dict[int, tuple[int, bytes]] = {}
        while len(answers) < count:
            kind, fields, _ = writer.next()
            writer.learn(answers, kind, fields, range(1, count + 1))
        assert answers == {
            sequence: (0x07, b"\x00\x00") if sequence % 3 == 0 else (0x06, b"\x00")
            for sequence in range(1, count + 1)
        }
        delivered = [watcher.read_line() for _ in range(count - count // 3)]
        assert delivered == [
            b"000 . MCAST burst.items item %d" % sequence
            for sequence in range(1, count + 1)
            if sequence % 3
        ]


def test_confirm_and_reject_multiple(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """One Confirm with multiple settles three contents; one Reject multiple+recycle two more."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Reader", ["bulk"], confirm="full")
    reader = Data(context, data_port)
    assert reader.lease(lease) == 200
    reader.command(b"\x03" + u64(2) + short("bulk"))
    assert reader.response(2) == 200
    with LineClient(gateway.address("hub")) as publisher:
        publisher.send("LOGIN bulk-sender open")
        publisher.expect("200")
        for rounds, answer, expected in (
            (3, b"\x06", b"200"),  # Confirm, multiple
            (2, b"\x07", b"400 retry"),  # Reject, multiple, recycle: retry later
        ):
            for index in range(rounds):
                publisher.send(f"MCAST bulk.items item {index}")
            sequences = []
            for _ in range(rounds):
                kind, fields, _ = reader.next()
                assert kind == 0x05
                sequences.append(fields[:8])
            flags = b"\x01" if answer == b"\x06" else b"\x01\x01"
            reader.command(answer + max(sequences) + flags)
            for _ in range(rounds):
                line = publisher.read_line()
                assert line.startswith(expected), line


def test_a_reader_that_went_away_is_not_counted_as_delivered(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A confirm=none reader closes its socket: its content is no longer "accepted" but retried."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Reader", ["gone"])
    reader = Data(context, data_port)
    assert reader.lease(lease) == 200
    reader.command(b"\x03" + u64(2) + short("gone"))
    assert reader.response(2) == 200
    with LineClient(gateway.address("hub")) as publisher:
        publisher.send("LOGIN gone-sender open", "MCAST gone.now first")
        publisher.expect("200")
        publisher.expect("200")  # written to the reader: accepted
        assert reader.next()[2] == b"first"
        reader.socket.close(linger=0)
        # ZeroMQ notices the closed connection on its own time: poll, bounded.
        deadline = time.monotonic() + 10
        while True:
            publisher.send("MCAST gone.now again")
            answer = publisher.read_line()
            if answer.startswith(b"400 retry"):
                break
            # Each try is a full round trip through the gateway: no sleep needed.
            assert answer.startswith(b"200") and time.monotonic() < deadline, answer


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


def test_qmqp_to_an_mtl_reader(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """QMQP mail routed to a confirm=full reader: Confirm is K, Reject D, Reject recycle Z."""
    port = gateway.address("mtl")[1]
    data_port, lease = Control(context, port).ready("gateway", "Reader", ["inbox"], confirm="full")
    reader = Data(context, data_port)
    assert reader.lease(lease) == 200
    reader.command(b"\x03" + u64(2) + short("inbox"))
    assert reader.response(2) == 200
    session = QMQPSession(gateway.address("mail"))
    try:
        answers = {
            b"kept": b"\x06" + b"\x00",
            b"refused": b"\x07\x00\x00",
            b"later": b"\x07\x00\x01",
        }
        for block_id in answers:
            session.send(mail(block_id.decode(), "ops@mtl.example", subject=block_id.decode()))
            kind, fields, body = reader.next()
            assert kind == 0x05 and fields[8:].startswith(short("inbox")), (kind, fields)
            assert b"Subject: " + block_id in body
            kind_and_flags = answers[block_id]
            reader.command(kind_and_flags[:1] + fields[:8] + kind_and_flags[1:])
            (reply,) = session.read_blocks(1)
            assert isinstance(reply, qmqp.ReplyBlock) and reply.id == block_id
            expected = {b"kept": qmqp.K, b"refused": qmqp.D, b"later": qmqp.Z}[block_id]
            assert reply.status == expected, reply
    finally:
        session.close()


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


DEAD = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:{port}:interface=127.0.0.1"
ping_interval_seconds = 0.2
dead_after_seconds = 1
"""


def test_dead_data_peers_are_forgotten(
    tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The listener pings; a peer that never answers loses its lease, one that pongs keeps it."""
    server = GatewayProcess(tmp_path / "dead", DEAD.format(port=0)).start()
    try:
        port = server.address("mtl")[1]
        peers = []
        for _ in range(2):
            control = Control(context, port)
            assert (
                control.ask("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})[0]
                == 201
            )
            assert control.ask("Connection.Profile", {"profile": "test"})[0] == 200
            status, reply = control.ask("Connection.Reader", {"resources": [], "confirm": "none"})
            assert status == 202
            peer = Data(context, int(reply["port"]))  # type: ignore[call-overload]
            assert peer.lease(str(reply["lease"])) == 200
            peer.command(b"\x03" + u64(2) + short("resource"))
            assert peer.response(2) == 200
            peers.append(peer)
        silent, alive = peers
        kind, _, _ = silent.next(skip_pings=False)
        assert kind == 0x08  # a Ping, left unanswered
        deadline = time.monotonic() + 15
        while "forgot a dead data peer" not in server.output():
            assert time.monotonic() < deadline, server.output()
            if alive.socket.poll(50):  # answer the listener's Pings meanwhile
                header, _ = alive.socket.recv_multipart()
                assert header == b"\x08"
                alive.command(b"\x09")
        assert "silent for" in server.wait_for_log("forgot a dead data peer")
        # The silent peer is a stranger now: its Summon needs a lease first.
        silent.command(b"\x04" + u64(3) + short("resource"))
        while True:
            kind, fields, body = silent.next(skip_pings=False)
            if kind == 0x02:
                break
        assert (fields, body) == (u64(3), b"403")
        # The peer that answered every Ping still holds its lease and summons.
        alive.command(b"\x04" + u64(3) + short("resource"))
        assert alive.response(3) == 200
    finally:
        server.stop()


RECOVER = """
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
request_timeout_seconds = 1
ping_interval_seconds = 0.2
dead_after_seconds = 1
"""

FAR = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:{port}:interface=127.0.0.1"
"""


def wait_for_count(process: GatewayProcess, text: str, count: int, timeout: float = 30.0) -> None:
    """Wait until ``text`` appears ``count`` times in the log (woken by each new line)."""
    process.wait_for_log_count(text, count, timeout)


def test_our_client_recovers_when_the_server_goes_away(tmp_path: Path) -> None:
    """The server is killed: deliveries answer retry; a new server on the port: carried again."""
    port = free_port()
    far_routes = {"in": 'from = "mtl"\nmatch = "#"\nto = "hub"\n'}
    far = GatewayProcess(tmp_path / "far1", FAR.format(port=port), routes=far_routes).start()
    near = GatewayProcess(
        tmp_path / "near",
        RECOVER.format(port=port),
        routes={"out": 'from = "hub"\nmatch = "weather.#"\nto = "far"\n'},
        secrets='[upstreams]\nfar = "unused"\n',
    ).start()
    try:
        near.wait_for_log("upstream far: connected")
        with LineClient(near.address("hub")) as publisher:
            publisher.send("LOGIN sensor-1 open", "MCAST weather.oslo snow")
            publisher.expect("200")
            publisher.expect("200")
            far.kill()
            near.wait_for_log("upstream far: starting over")
            publisher.send("MCAST weather.oslo sleet")
            answer = publisher.read_line()
            assert answer.startswith(b"400 retry"), answer
            far = GatewayProcess(tmp_path / "far2", FAR.format(port=port), routes=far_routes)
            far.start()
            wait_for_count(near, "upstream far: connected", 2)
            with LineClient(far.address("hub")) as watcher:
                watcher.send("LOGIN watcher open", "SUBSCRIBE weather.oslo")
                watcher.expect("200")
                watcher.expect("200")
                publisher.send("MCAST weather.oslo sun")
                publisher.expect("200")
                watcher.expect("000 sensor-1 MCAST weather.oslo sun")
    finally:
        near.stop()
        far.stop()


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


OPEN_TEST = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
profiles = ["test"]
ping_interval_seconds = 0.2
"""


def test_under_twistds_asyncio_reactor(
    tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """``twistd --reactor=asyncio``: txzmq is imported after the choice; the flows work."""
    process = GatewayProcess(tmp_path / "asyncio", OPEN_TEST, reactor="asyncio").start()
    try:
        assert "AsyncioSelectorReactor" in process.wait_for_log("reactor class")
        port = process.address("mtl")[1]
        peers = {}
        for kind in ("Reader", "Writer"):
            control = Control(context, port)
            opened = {"protocol": {"name": "MTL", "version": 1}}
            assert control.ask("Connection.Open", opened)[0] == 201
            assert control.ask("Connection.Profile", {"profile": "test"})[0] == 200
            status, reply = control.ask(f"Connection.{kind}", {"resources": [], "confirm": "none"})
            assert status == 202
            peers[kind] = Data(context, int(reply["port"]))  # type: ignore[call-overload]
            assert peers[kind].lease(str(reply["lease"])) == 200
        peers["Reader"].command(b"\x03" + u64(2) + short("resource"))
        assert peers["Reader"].response(2) == 200
        for sequence in range(1, 101):
            peers["Writer"].content(sequence, "", b"body %d" % sequence)
        got = [peers["Reader"].next()[2] for _ in range(100)]
        assert got == [b"body %d" % sequence for sequence in range(1, 101)]
        kind, _, _ = peers["Writer"].next(skip_pings=False)
        assert kind == 0x08  # the listener's timer runs on this reactor too
    finally:
        process.stop()


TEST_READER = CLIENT.replace(
    'mode = "writer"', 'mode = "reader"\nresources = ["resource"]'
).replace('profile = "gateway"\nconfirm = "full"', 'profile = "test"\nconfirm = "none"')


def test_our_client_on_the_test_profile(
    gateway: GatewayProcess, tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Gateway D's upstream reads the test profile's "resource": a raw writer reaches SSMP."""
    assert 'profile = "test"' in TEST_READER
    client = GatewayProcess(
        tmp_path / "d",
        TEST_READER.format(port=gateway.address("mtl")[1]),
        routes={"in": 'from = "far"\nmatch = "resource"\nto = "hub"\naddress = "relay.test"\n'},
        secrets='[upstreams]\nfar = "wonderland"\n',
    ).start()
    try:
        client.wait_for_log("upstream far: summoned resource")
        with LineClient(client.address("hub")) as watcher:
            watcher.send("LOGIN watcher4 open", "SUBSCRIBE relay.test")
            watcher.expect("200")
            watcher.expect("200")
            data_port, lease = Control(context, gateway.address("mtl")[1]).ready(
                "test", "Writer", ["resource"]
            )
            writer = Data(context, data_port)
            assert writer.lease(lease) == 200
            writer.content(1, "resource", b"hello through the test profile")
            watcher.expect("000 . MCAST relay.test hello through the test profile")
    finally:
        client.stop()


LOOP = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
max_backlog_messages = {backlog}
dead_after_seconds = 60

[listeners.out]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
max_backlog_messages = {backlog}
dead_after_seconds = 60

[listeners.slow]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
max_backlog_messages = 1000
dead_after_seconds = 60

[listeners.stuck]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
max_backlog_messages = 100
slow_consumer_seconds = 1
dead_after_seconds = 60
"""
LOOP_ROUTES = {
    # Gateway-profile writers of "mtl" on "relay.in" reach the readers of "relay.out" on "out".
    "relay": 'from = "mtl"\nmatch = "relay.in"\nto = "out"\naddress = "relay.out"\n',
    # ... and on "flood.in" the readers of "flood.out" on "slow" (a short ZeroMQ queue).
    "flood": 'from = "mtl"\nmatch = "flood.in"\nto = "slow"\naddress = "flood.out"\n',
}


@pytest.fixture(scope="module")
def loop_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with two MTL listeners (no login): writers of one reach readers of the other."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("loop"), LOOP.format(backlog=10_000), routes=LOOP_ROUTES
    ).start()
    yield process
    process.stop()


def open_flow(
    context: zmq.Context[zmq.Socket[bytes]],
    port: int,
    profile: str,
    kind: str,
    resource: str,
    confirm: str = "none",
) -> Data:
    """A data peer with a lease of ``resource`` on a listener without login; readers summon it."""
    control = Control(context, port)
    assert control.ask("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})[0] == 201
    assert control.ask("Connection.Profile", {"profile": profile})[0] == 200
    status, reply = control.ask(f"Connection.{kind}", {"resources": [resource], "confirm": confirm})
    assert status == 202, reply
    peer = Data(context, int(reply["port"]))  # type: ignore[call-overload]
    assert peer.lease(str(reply["lease"])) == 200
    if kind == "Reader":
        peer.command(b"\x03" + u64(2) + short(resource))
        assert peer.response(2) == 200
    return peer


def test_a_reader_gone_without_dismiss_does_not_refuse_for_the_next(
    loop_gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Reader 1 closes without Dismiss; reader 2 gets every message and the writer every Confirm.

    ZeroMQ cannot route to reader 1 any more: that reader is forgotten at
    once, and its copy does not make the message "retry later" when reader
    2, the one reader left, confirmed it.
    """
    readers = loop_gateway.address("out")[1]
    first = open_flow(context, readers, "gateway", "Reader", "relay.out")
    first.socket.close(linger=0)
    second = open_flow(context, readers, "gateway", "Reader", "relay.out", confirm="full")
    writers = loop_gateway.address("mtl")[1]
    writer = open_flow(context, writers, "gateway", "Writer", "relay.in", confirm="full")
    count = 5000
    for sequence in range(1, count + 1):
        writer.content(sequence, "relay.in", b"%d" % sequence)
    received: list[bytes] = []
    answers: dict[int, tuple[int, bytes]] = {}
    poller = zmq.Poller()
    poller.register(second.socket, zmq.POLLIN)
    poller.register(writer.socket, zmq.POLLIN)
    deadline = time.monotonic() + 30
    while len(answers) < count:
        assert time.monotonic() < deadline, (len(received), len(answers))
        ready = dict(poller.poll(1000))
        if second.socket in ready:
            kind, fields, body = second.next()
            if kind == 0x05:
                received.append(body)
                second.command(b"\x06" + fields[:8] + b"\x00")  # Confirm it
        if writer.socket in ready:
            kind, fields, _ = writer.next()
            if kind in (0x06, 0x07):
                writer.learn(answers, kind, fields, range(1, count + 1))
    assert received == [b"%d" % sequence for sequence in range(1, count + 1)]
    rejected = sorted(sequence for sequence, (kind, _) in answers.items() if kind != 0x06)
    assert rejected == [], f"{len(rejected)} Rejects, the first {rejected[:5]}"


def flood(
    context: zmq.Context[zmq.Socket[bytes]],
    writers: list[Data],
    resource: str,
    count: int,
    reader: Data,
) -> dict[int, list[int]]:
    """Each writer sends ``count`` Contents at once, in its own thread; what ``reader`` got.

    A writer blocks when its ZeroMQ queue to the gateway is full (the
    gateway stopped reading it), so the threads end only as the reader
    reads. Returns, per writer, the numbers it sent in the order received.
    """
    failures: list[BaseException] = []

    def write(index: int, writer: Data) -> None:
        try:
            writer.socket.setsockopt(zmq.SNDTIMEO, 60_000)
            for number in range(count):
                writer.content(number + 1, resource, b"%d %d" % (index, number))
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    threads = [
        threading.Thread(target=write, args=(index, writer), daemon=True)
        for index, writer in enumerate(writers)
    ]
    for thread in threads:
        thread.start()
    got: dict[int, list[int]] = {index: [] for index in range(len(writers))}
    total = count * len(writers)
    received = 0
    deadline = time.monotonic() + 120
    while received < total:
        assert time.monotonic() < deadline, (received, total)
        assert reader.socket.poll(10_000), f"nothing more after {received} of {total}"
        header, body = reader.socket.recv_multipart()
        if header[0] == 0x08:  # the listener's Ping
            reader.command(b"\x09")
            continue
        assert header[0] == 0x05, header
        index, number = body.split()
        got[int(index)].append(int(number))
        received += 1
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    return got


@pytest.mark.parametrize("profile", ["test", "gateway"])
def test_fast_writers_and_a_healthy_reader_lose_nothing(
    loop_gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]], profile: str
) -> None:
    """Four unpaced writers, one reader with a short ZeroMQ queue: every Content, in order.

    The reader's listener queues 1,000 commands for it (max_backlog_messages);
    the writers send 20,000 each as fast as ZeroMQ takes them. Past the
    queue the gateway holds what the reader has not taken and stops
    reading the writers (test profile: the same data socket; gateway
    profile: the writers' listener, through its routed Contents in flight),
    so nothing is dropped and nobody is cut.
    """
    count = 20_000
    if profile == "test":
        port = loop_gateway.address("slow")[1]
        reader = open_flow(context, port, "test", "Reader", "resource")
        writers = [open_flow(context, port, "test", "Writer", "resource") for _ in range(4)]
        resource = "resource"
    else:
        reader = open_flow(
            context, loop_gateway.address("slow")[1], "gateway", "Reader", "flood.out"
        )
        port = loop_gateway.address("mtl")[1]
        writers = [open_flow(context, port, "gateway", "Writer", "flood.in") for _ in range(4)]
        resource = "flood.in"
    got = flood(context, writers, resource, count, reader)
    for index, numbers in got.items():
        assert numbers == list(range(count)), (index, len(numbers))
    assert "slow consumer" not in loop_gateway.output()


def test_a_stuck_reader_is_forgotten_and_the_writer_goes_on(
    loop_gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A reader that reads nothing holds the writer for slow_consumer_seconds (1 s), then is cut.

    The writer's 5,000 Contents of 10 KiB outgrow every queue on the way
    (ZeroMQ's and the kernel's), so its sends block while the gateway does
    not read it; once the reader is forgotten as a slow consumer (logged),
    reading resumes and the writer finishes.
    """
    port = loop_gateway.address("stuck")[1]
    stuck = open_flow(context, port, "test", "Reader", "resource")
    writer = open_flow(context, port, "test", "Writer", "resource")
    writer.socket.setsockopt(zmq.SNDTIMEO, 30_000)
    finished = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            body = b"x" * 10240
            for number in range(5000):
                writer.content(number + 1, "resource", body)
            finished.set()
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    line = loop_gateway.wait_for_log("forgot a slow consumer", timeout=20)
    assert "slow_consumer_seconds" in line
    assert finished.wait(20), failures
    assert time.monotonic() - started >= 1.0
    thread.join(5)
    assert not failures
    stuck.socket.close(linger=0)
