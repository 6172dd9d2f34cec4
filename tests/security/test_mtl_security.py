"""MTL authentication under attack (issue 26, defects 9, 10 and 13c): real processes, raw pyzmq.

* 9: a fake MTL server (a pyzmq ROUTER) answers 201 right after the
  client-first message of our upstream's SCRAM-SHA-256 login. The upstream
  must not go on to a profile, a lease or the data flow; the SSMP publisher
  whose message is routed to it must not get 200; the log says why.
* 10: Alice logs in with PLAIN over CURVE under the routing id
  ``app-node-1``, leases, and disconnects. Bob, whose CURVE key is allowed
  too, takes the same routing ids without a login: his Profile and Writer
  requests and his data flow's Content must get nothing of Alice's.
* 13c: refusals name the peer and the key, and are counted: a CURVE key not
  allowed (ZAP), a plaintext client and a wrong server key (libzmq ends
  those handshakes itself), and our upstream given a wrong server key,
  which only sees silence.

The gateways run under twistd (`GatewayProcess`); the MTL peers are pyzmq
sockets driven with struct from the spec's field lists.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import zmq

from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

TIMEOUT_MS: Final = 10_000
ALICE: Final = zmq.curve_keypair()
BOB: Final = zmq.curve_keypair()
STRANGER: Final = zmq.curve_keypair()
SERVER: Final = zmq.curve_keypair()
OPEN: Final = {"protocol": {"name": "MTL", "version": 1}}


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a metric family from /metrics text (0 when absent)."""
    for line in text.splitlines():
        head, _, rest = line.partition("{")
        if head != name:
            continue
        inside, _, value = rest.rpartition("} ")
        if dict(re.findall(r'(\w+)="([^"]*)"', inside)) == labels:
            return float(value)
    return 0.0


def errors(process: GatewayProcess, endpoint: str, kind: str) -> float:
    """A protocol error count of one listener or upstream."""
    return metric(
        process.metrics(), "msggateway_protocol_errors_total", endpoint=endpoint, kind=kind
    )


def u64(value: int) -> bytes:
    """An MTL integer."""
    return struct.pack(">Q", value)


def short(text: str) -> bytes:
    """An MTL short string."""
    return bytes((len(text),)) + text.encode()


# --- 9: the upstream's SCRAM login does not trust a server that proved nothing -----------


class FakeServer:
    """A pyzmq ROUTER playing an MTL server that does not know the secret.

    It answers Connection.Open with 401 (SCRAM-SHA-256), and the first
    Connection.Authorize (the client-first message) with 201 Ready; had the
    client gone on, Profile 200, Writer 202 with its data port, the Lease
    200 and every Content a Confirm. It records every command, and every
    message its data socket gets.
    """

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = self.context.socket(zmq.ROUTER)
        self.data = self.context.socket(zmq.ROUTER)
        for socket in (self.control, self.data):
            socket.linger = 0
        self.port = self.control.bind_to_random_port("tcp://127.0.0.1")
        self.data_port = self.data.bind_to_random_port("tcp://127.0.0.1")
        self.commands: list[str] = []
        self.data_messages: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, command: str) -> tuple[bytes, dict[str, Any]]:
        if command == "connection.open":
            return b"401", {"status": "Unauthorized", "mechanisms": ["SCRAM-SHA-256"]}
        if command == "connection.authorize":
            return b"201", {"status": "Ready", "profiles": ["gateway"]}
        if command == "connection.profile":
            return b"200", {"status": "OK"}
        return b"202", {"status": "Data Lease", "port": self.data_port, "lease": "fake"}

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(50):
                frames = socket.recv_multipart()
                if socket is self.data:
                    self.data_messages.append(frames)
                    routing_id, header = frames[0], frames[1]
                    if header[:1] == b"\x01":  # Lease: 200
                        self.data.send_multipart([routing_id, b"\x02" + header[1:9], b"200"])
                    elif header[:1] == b"\x05":  # Content: Confirm
                        self.data.send_multipart([routing_id, b"\x06" + header[1:9] + b"\0", b""])
                    continue
                routing_id, empty, command = frames[:3]
                self.commands.append(command.decode().lower())
                status, body = self._answer(command.decode().lower())
                self.control.send_multipart([routing_id, empty, status, json.dumps(body).encode()])

    def close(self) -> None:
        """Stop serving."""
        self._stop.set()
        self._thread.join(5)
        self.context.destroy(linger=0)


UPSTREAM: Final = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

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
username = "gw"
mechanism = "SCRAM-SHA-256"
request_timeout_seconds = {timeout}
{curve}
"""


def test_upstream_refuses_a_server_that_answers_201_before_proving_itself(
    tmp_path: Path,
) -> None:
    """Defect 9: no Profile, no lease, no data; the publisher gets no 200; the log says why."""
    fake = FakeServer()
    process = GatewayProcess(
        tmp_path,
        UPSTREAM.format(port=fake.port, timeout=10, curve=""),
        routes={"out": 'from = "hub"\nmatch = "weather.#"\nto = "far"\naddress = "weather"\n'},
        secrets='[upstreams]\nfar = "s3cret"\n',
    ).start()
    try:
        # The upstream has decided about this server, one way or the other.
        line = process.wait_for_log("upstream far: (server not trusted|connected)")
        with LineClient(process.address("hub")) as publisher:
            publisher.send("LOGIN sensor-9 open", "MCAST weather.rome the payload")
            publisher.expect("200")  # the login
            answer = publisher.read_line()
        assert not answer.startswith(b"200"), answer
        assert "answered connection.authorize with 201 Ready before proving" in line
        assert errors(process, "far", "server-not-verified") >= 1
        assert "connection.profile" not in fake.commands
        assert "connection.writer" not in fake.commands
        assert fake.commands[:2] == ["connection.open", "connection.authorize"]
        assert fake.data_messages == []
        assert "upstream far: connected" not in process.output()
    finally:
        process.stop()
        fake.close()


# --- 10: a session is its connection's, not its routing id's ----------------------------

LISTENER: Final = f"""
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
mechanisms = ["PLAIN"]
curve_secret_key_file = "mtl.key"
curve_client_keys = ["{ALICE[0].decode()}", "{BOB[0].decode()}"]
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A CURVE MTL listener letting in Alice's and Bob's keys, PLAIN logins, routed to SSMP."""
    directory = tmp_path_factory.mktemp("mtl-security")
    (directory / "mtl.key").write_bytes(SERVER[1] + b"\n")
    process = GatewayProcess(
        directory,
        LISTENER,
        routes={"to-hub": 'from = "mtl"\nmatch = "news"\nto = "hub"\n'},
        secrets='[logins]\nalice = "wonderland"\n',
    ).start()
    yield process
    process.stop()


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A pyzmq context, destroyed after the test."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def curve_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    keys: tuple[bytes, bytes],
    routing_id: bytes | None = None,
    server_key: bytes = SERVER[0],
) -> zmq.Socket[bytes]:
    """A CURVE client socket with ``keys``, choosing its routing id if given."""
    socket = context.socket(kind)
    socket.linger = 0
    if routing_id is not None:
        socket.routing_id = routing_id
    socket.curve_serverkey = server_key
    socket.curve_publickey, socket.curve_secretkey = keys
    return socket


def ask(socket: zmq.Socket[bytes], command: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One control request; its status and JSON reply."""
    socket.send_multipart([command.encode(), json.dumps(body).encode()])
    assert socket.poll(TIMEOUT_MS), f"no answer to {command}"
    status, reply = socket.recv_multipart()
    return int(status), json.loads(reply)


def recv(socket: zmq.Socket[bytes]) -> list[bytes]:
    """One data command, Pings answered and skipped."""
    while True:
        assert socket.poll(TIMEOUT_MS), "nothing arrived in time"
        frames = socket.recv_multipart()
        if frames[0][:1] != b"\x08":
            return frames
        socket.send_multipart([b"\x09", b""])


def test_a_routing_id_taken_by_another_peer_inherits_nothing(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Defect 10: Bob, under Alice's routing ids after she left, gets no session and no lease."""
    port = gateway.address("mtl")[1]
    alice = curve_socket(context, zmq.REQ, ALICE, b"app-node-1")
    alice.connect(f"tcp://127.0.0.1:{port}")
    assert ask(alice, "Connection.Open", OPEN)[0] == 401
    plain = base64.b64encode(b"\0alice\0wonderland").decode()
    assert ask(alice, "Connection.Authorize", {"mechanism": "PLAIN", "response": plain})[0] == 201
    assert ask(alice, "Connection.Profile", {"profile": "gateway"})[0] == 200
    status, reply = ask(alice, "Connection.Writer", {"resources": ["news"], "confirm": "full"})
    assert status == 202
    data_port, token = reply["port"], reply["lease"].encode()
    alice.close(linger=0)
    alice_data = curve_socket(context, zmq.DEALER, ALICE, b"data-node-1")
    alice_data.connect(f"tcp://127.0.0.1:{data_port}")
    alice_data.send_multipart([b"\x01" + u64(1) + bytes((len(token),)) + token, b""])
    assert recv(alice_data) == [b"\x02" + u64(1), b"200"]
    alice_data.close(linger=0)

    with LineClient(gateway.address("hub")) as watcher:
        watcher.send("LOGIN watcher open", "SUBSCRIBE news")
        watcher.expect("200")
        watcher.expect("200")
        for attempt in range(3):  # the later ones surely after Alice's connections closed
            bob = curve_socket(context, zmq.REQ, BOB, b"app-node-1")
            bob.connect(f"tcp://127.0.0.1:{port}")
            status, reply = ask(bob, "Connection.Profile", {"profile": "gateway"})
            assert status != 200, reply
            writer = {"resources": ["news"], "confirm": "full"}
            status, reply = ask(bob, "Connection.Writer", writer)
            assert status != 202, reply
            bob.close(linger=0)
            bob_data = curve_socket(context, zmq.DEALER, BOB, b"data-node-1")
            bob_data.connect(f"tcp://127.0.0.1:{data_port}")
            header = b"\x05" + u64(attempt + 1) + short("news") + b"\0\0\0\0"
            bob_data.send_multipart([header, b"bob's payload"])
            kind, *_ = recv(bob_data)
            assert kind == b"\x07" + u64(attempt + 1) + b"\x00\x00"  # Reject: no lease
            bob_data.close(linger=0)
        watcher.sync()  # nothing of Bob's reached the subscriber before the PONG
    assert errors(gateway, "mtl", "content-without-writer-lease") >= 3


# --- 13c: refusals name the peer and the key, and are counted ---------------------------


def test_refused_peers_are_named_and_counted(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A key not allowed (address and Z85 key), a plaintext client, a wrong server key."""
    port = gateway.address("mtl")[1]
    stranger = curve_socket(context, zmq.REQ, STRANGER)
    plaintext = context.socket(zmq.REQ)
    plaintext.linger = 0
    wrong_key = curve_socket(context, zmq.REQ, ALICE, server_key=zmq.curve_keypair()[0])
    opening = [b"Connection.Open", json.dumps(OPEN).encode()]
    stranger.connect(f"tcp://127.0.0.1:{port}")
    stranger.send_multipart(opening)
    line = gateway.wait_for_log("mtl: refused a peer from")
    assert line.endswith(
        f"refused a peer from 127.0.0.1 with CURVE key {STRANGER[0].decode()}:"
        " CURVE key not allowed"
    )
    # Which side of a plaintext handshake with a CURVE listener sees the mismatch first
    # is a race: the listener either sees it or sees the client break off.
    plaintext.connect(f"tcp://127.0.0.1:{port}")
    plaintext.send_multipart(opening)
    line = gateway.wait_for_log(
        "refused a peer of the control socket at its ZeroMQ handshake: (it does not use"
        " CURVE|it broke off its handshake .*plaintext client)"
    )
    assert line.endswith("(ZeroMQ does not say from which address)")
    wrong_key.connect(f"tcp://127.0.0.1:{port}")
    wrong_key.send_multipart(opening)
    gateway.wait_for_log("refused a peer of the control socket .*another server public key")
    assert errors(gateway, "mtl", "peer-refused") >= 1
    assert errors(gateway, "mtl", "plaintext-peer") + errors(gateway, "mtl", "handshake-failed")
    assert errors(gateway, "mtl", "curve-handshake-failed") >= 1
    for socket in (stranger, plaintext, wrong_key):
        assert not socket.poll(0)


def test_our_upstream_with_a_wrong_server_key_says_so(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """13c, the client side: Open unanswered over CURVE; the log blames the key; counted."""
    wrong = zmq.curve_keypair()[0].decode()
    process = GatewayProcess(
        tmp_path,
        UPSTREAM.format(
            port=gateway.address("mtl")[1], timeout=1, curve=f'curve_server_key = "{wrong}"'
        ),
        secrets='[upstreams]\nfar = "s3cret"\n',
    ).start()
    try:
        line = process.wait_for_log("upstream far: starting over: no answer to Connection.Open")
        assert "curve_server_key is probably not the server's public key" in line
        assert errors(process, "far", "no-curve-handshake") >= 1
    finally:
        process.stop()
