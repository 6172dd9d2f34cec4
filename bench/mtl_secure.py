"""Benchmark what MTL's security costs: CURVE on the data flow, SCRAM-SHA-256 logins.

Starts the gateway (``twistd msggateway``) with two MTL listeners, one
plaintext and one with CURVE, and runs ``bench/mtl_flow.py``'s test-profile
fan-out (raw pyzmq peers, 100-byte bodies) against each; the CURVE peers
are the same code with a context whose sockets are CURVE clients. Then it
times whole SCRAM-SHA-256 and PLAIN logins (Open to 201) against a listener
offering both. Every run is bounded by a count and a time limit. Run it
with ``python bench/mtl_secure.py [--count N] [--logins N]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.mtl_flow import test_profile  # noqa: E402
from gateway.codecs.scram import ScramClient  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

CONFIG = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.plain]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.curve]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
curve_secret_key_file = "mtl.key"

[listeners.login]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
mechanisms = ["PLAIN", "SCRAM-SHA-256"]
"""
SECRETS = '[logins]\nalice = "wonderland"\n'
LIMIT_SECONDS = 60.0


class CurveContext(zmq.Context):  # type: ignore[type-arg]
    """A context whose sockets are CURVE clients of one server key."""

    server_key = b""

    def socket(self, socket_type: int, **kwargs: Any) -> Any:  # type: ignore[override]
        """A socket with the server key and a fresh key pair of its own."""
        made = super().socket(socket_type, **kwargs)
        public_key, secret_key = zmq.curve_keypair()
        made.curve_serverkey = self.server_key
        made.curve_publickey = public_key
        made.curve_secretkey = secret_key
        return made


def login(socket: zmq.Socket[bytes], mechanism: str) -> None:
    """Open and log in as alice with ``mechanism``, up to 201."""

    def ask(command: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        socket.send_multipart([command.encode(), json.dumps(body).encode()])
        status, reply = socket.recv_multipart()
        return int(status), json.loads(reply)

    def authorize(response: bytes) -> tuple[int, dict[str, Any]]:
        blob = base64.b64encode(response).decode()
        return ask("Connection.Authorize", {"mechanism": mechanism, "response": blob})

    assert ask("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})[0] == 401
    if mechanism == "PLAIN":
        assert authorize(b"\0alice\0wonderland")[0] == 201
        return
    client = ScramClient("alice", b"wonderland")
    _, reply = authorize(client.first())
    _, reply = authorize(client.final(base64.b64decode(reply["challenge"])))
    client.verify(base64.b64decode(reply["challenge"]))
    assert authorize(b"")[0] == 201


def logins(context: zmq.Context[zmq.Socket[bytes]], port: int, mechanism: str, count: int) -> str:
    """Time ``count`` whole logins, each on a new REQ socket (a new session)."""
    started = time.perf_counter()
    done = 0
    while done < count and time.perf_counter() - started < LIMIT_SECONDS:
        socket = context.socket(zmq.REQ)
        socket.connect(f"tcp://127.0.0.1:{port}")
        login(socket, mechanism)
        socket.close(linger=0)
        done += 1
    elapsed = time.perf_counter() - started
    return f"{mechanism} logins: {done}, {1000 * elapsed / done:.2f} ms each"


def main() -> None:
    """Run the measurements and print one line for each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--logins", type=int, default=200)
    arguments = parser.parse_args()
    public_key, secret_key = zmq.curve_keypair()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "mtl.key").write_bytes(secret_key)
        gateway = GatewayProcess(Path(directory), CONFIG, secrets=SECRETS).start()
        try:
            plain: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            curve = CurveContext()
            curve.server_key = public_key
            out = sys.stdout
            for label, context, name in (("plaintext", plain, "plain"), ("CURVE", curve, "curve")):
                result = test_profile(context, gateway.address(name)[1], arguments.count)
                out.write(f"{label:<10}{result}\n")
            for mechanism in ("PLAIN", "SCRAM-SHA-256"):
                port = gateway.address("login")[1]
                out.write(logins(plain, port, mechanism, arguments.logins) + "\n")
            plain.destroy(linger=0)
            curve.destroy(linger=0)
        finally:
            gateway.stop()


if __name__ == "__main__":
    main()
