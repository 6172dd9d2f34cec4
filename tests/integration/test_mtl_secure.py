"""MTL with SCRAM-SHA-256 and CURVE, end to end: the gateway under twistd, raw pyzmq clients.

The MTL dialogue is driven with pyzmq and struct from the spec's field
lists; the SCRAM messages come from `ScramClient`, which
tests/codecs/test_scram.py checks against RFC 7677's example. The key file
is made here, so the public key the gateway logs must be the one derived
from it. Then our upstream in a second gateway logs in with SCRAM over
CURVE with its own key, which the listener lets in by name
(``curve_client_keys``), and carries SSMP messages to a raw reader.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gateway.codecs.scram import ScramClient
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
mechanisms = ["SCRAM-SHA-256"]
curve_secret_key_file = "mtl.key"
ping_interval_seconds = 5

[listeners.guarded]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
allow_addresses = ["10.0.0.0/8"]
"""
SECRETS = '[logins]\nalice = "wonderland"\n'
TIMEOUT_MS = 10_000
KEYS = zmq.curve_keypair()
UPSTREAM_KEYS = zmq.curve_keypair()
READER_KEYS = zmq.curve_keypair()
STRICT = f"""
[listeners.strict]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
mechanisms = ["SCRAM-SHA-256"]
curve_secret_key_file = "mtl.key"
curve_client_keys = ["{UPSTREAM_KEYS[0].decode()}", "{READER_KEYS[0].decode()}"]
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway whose MTL listener wants SCRAM-SHA-256 over CURVE."""
    directory = tmp_path_factory.mktemp("mtl-secure")
    (directory / "mtl.key").write_bytes(KEYS[1] + b"\n")
    process = GatewayProcess(directory, CONFIG + STRICT, secrets=SECRETS).start()
    yield process
    process.stop()


def curve_socket(
    context: zmq.Context[zmq.Socket[bytes]], kind: int, keys: tuple[bytes, bytes] | None = None
) -> zmq.Socket[bytes]:
    """A socket that is a CURVE client of the gateway, with ``keys`` or a fresh pair."""
    socket = context.socket(kind)
    socket.linger = 0
    public_key, secret_key = keys or zmq.curve_keypair()
    socket.curve_serverkey = KEYS[0]
    socket.curve_publickey = public_key
    socket.curve_secretkey = secret_key
    return socket


def recv(socket: zmq.Socket[bytes]) -> list[bytes]:
    """One multipart message, within the time-out."""
    assert socket.poll(TIMEOUT_MS), "nothing arrived in time"
    return socket.recv_multipart()


def ask(socket: zmq.Socket[bytes], command: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One control request; its status and JSON reply."""
    socket.send_multipart([command.encode(), json.dumps(body).encode()])
    status, reply = recv(socket)
    return int(status), json.loads(reply)


def authorize(socket: zmq.Socket[bytes], response: bytes) -> tuple[int, Any]:
    """Connection.Authorize with SCRAM-SHA-256 and ``response``."""
    blob = base64.b64encode(response).decode()
    return ask(socket, "Connection.Authorize", {"mechanism": "SCRAM-SHA-256", "response": blob})


def lease(
    context: zmq.Context[zmq.Socket[bytes]],
    port: int,
    kind: str,
    keys: tuple[bytes, bytes] | None = None,
) -> zmq.Socket[bytes]:
    """Log in as alice with SCRAM, pick the test profile, lease; the DEALER, leased."""
    control = curve_socket(context, zmq.REQ, keys)
    control.connect(f"tcp://127.0.0.1:{port}")
    status, reply = ask(control, "Connection.Open", {"protocol": {"name": "MTL", "version": 1}})
    assert (status, reply["mechanisms"]) == (401, ["SCRAM-SHA-256"])
    client = ScramClient("alice", b"wonderland")
    status, reply = authorize(control, client.first())
    assert status == 402
    status, reply = authorize(control, client.final(base64.b64decode(reply["challenge"])))
    assert status == 402
    client.verify(base64.b64decode(reply["challenge"]))
    assert authorize(control, b"")[0] == 201
    assert ask(control, "Connection.Profile", {"profile": "TEST"})[0] == 200
    status, reply = ask(control, f"Connection.{kind}", {"resources": [], "confirm": "none"})
    assert status == 202
    control.close(linger=0)
    data = curve_socket(context, zmq.DEALER, keys)
    data.connect(f"tcp://127.0.0.1:{reply['port']}")
    token = reply["lease"].encode()
    data.send_multipart([struct.pack(">BQB", 1, 1, len(token)) + token, b""])
    assert recv(data) == [struct.pack(">BQ", 2, 1), b"200"]
    return data


def test_scram_and_curve_dialogue_with_fan_out(gateway: GatewayProcess) -> None:
    """The logged public key is ours; SCRAM logins over CURVE; content fans out to two readers."""
    line = gateway.wait_for_log("CURVE on, server public key")
    assert line.endswith(KEYS[0].decode())
    port = gateway.address("mtl")[1]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        readers = [lease(context, port, "Reader") for _ in range(2)]
        for sequence, reader in enumerate(readers, start=2):
            reader.send_multipart([struct.pack(">BQB", 3, sequence, 8) + b"resource", b""])
            assert recv(reader) == [struct.pack(">BQ", 2, sequence), b"200"]
        writer = lease(context, port, "Writer")
        header = struct.pack(">BQB", 5, 1, 8) + b"resource" + struct.pack(">I", 0)
        writer.send_multipart([header, b"secret payload"])
        for reader in readers:
            frames = recv(reader)
            while frames[0][:1] == b"\x08":  # a listener Ping: answer and go on
                reader.send_multipart([b"\x09", b""])
                frames = recv(reader)
            assert frames[0][0] == 5 and frames[1] == b"secret payload"
    finally:
        context.destroy(linger=0)


def test_peer_from_a_network_not_allowed_is_never_answered(gateway: GatewayProcess) -> None:
    """The ZAP handler refuses a loopback peer where only 10.0.0.0/8 is allowed, and logs it."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        control = context.socket(zmq.REQ)
        control.connect(f"tcp://127.0.0.1:{gateway.address('guarded')[1]}")
        control.send_multipart([b"Connection.Open", b'{"protocol": {"name": "MTL", "version": 1}}'])
        line = gateway.wait_for_log("guarded: refused a peer")
        assert line.endswith("address 127.0.0.1 is not allowed")
        assert not control.poll(0)
    finally:
        context.destroy(linger=0)


UPSTREAM = """
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
profile = "test"
confirm = "none"
username = "alice"
mechanism = "SCRAM-SHA-256"
curve_server_key = "{server_key}"
curve_secret_key_file = "client.key"
"""


def test_our_upstream_with_scram_and_its_curve_key(gateway: GatewayProcess, tmp_path: Path) -> None:
    """SSMP on gateway A, through its upstream (SCRAM, its own CURVE key), to a reader on B."""
    directory = tmp_path / "a"
    directory.mkdir()
    (directory / "client.key").write_bytes(UPSTREAM_KEYS[1])
    client = GatewayProcess(
        directory,
        UPSTREAM.format(port=gateway.address("strict")[1], server_key=KEYS[0].decode()),
        routes={"out": 'from = "hub"\nmatch = "weather.#"\nto = "far"\naddress = "resource"\n'},
        secrets='[upstreams]\nfar = "wonderland"\n',
    ).start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        reader = lease(context, gateway.address("strict")[1], "Reader", READER_KEYS)
        reader.send_multipart([struct.pack(">BQB", 3, 2, 8) + b"resource", b""])
        assert recv(reader) == [struct.pack(">BQ", 2, 2), b"200"]
        client.wait_for_log("upstream far: connected")
        with LineClient(client.address("hub")) as publisher:
            publisher.send("LOGIN sensor-9 open", "MCAST weather.rome sunny")
            publisher.expect("200")
            publisher.expect("200")
        frames = recv(reader)
        while frames[0][:1] == b"\x08":  # a listener Ping: answer and go on
            reader.send_multipart([b"\x09", b""])
            frames = recv(reader)
        assert frames[0][0] == 5 and frames[1] == b"sunny"
    finally:
        context.destroy(linger=0)
        client.stop()


def test_scram_curve_and_zap_under_twistds_asyncio_reactor(tmp_path: Path) -> None:
    """The same listener under ``twistd --reactor=asyncio``: its ZAP handler and sockets work."""
    (tmp_path / "mtl.key").write_bytes(KEYS[1])
    process = GatewayProcess(tmp_path, CONFIG + STRICT, secrets=SECRETS, reactor="asyncio")
    process.start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        process.wait_for_log("reactor class: .*AsyncioSelectorReactor")
        reader = lease(context, process.address("strict")[1], "Reader", READER_KEYS)
        reader.send_multipart([struct.pack(">BQB", 3, 2, 8) + b"resource", b""])
        assert recv(reader) == [struct.pack(">BQ", 2, 2), b"200"]
        stranger = curve_socket(context, zmq.REQ)  # a key the listener does not know
        stranger.connect(f"tcp://127.0.0.1:{process.address('strict')[1]}")
        stranger.send_multipart([b"Connection.Open", b"{}"])
        line = process.wait_for_log("strict: refused a peer")
        assert line.endswith("CURVE key not allowed")
    finally:
        context.destroy(linger=0)
        process.stop()
