"""Password guessing against a real gateway is slowed down and cut off (issue 26, defect 3).

The probe answered 200 wrong passwords in a row at 0.8-1.6 ms each, then took
the right one at once, on the SSMP hub (``secret``), the stream listener
(SASL PLAIN), QMQP (100 ``A`` blocks on one connection in 10 ms) and MTL
(100 Connection.Authorize on one session in 20 ms). Here ``twistd
msggateway`` runs with small delays (`DELAY` doubling to `MAX_DELAY`, three
refusals a connection) and real clients guess:

- every refusal waits: N wrong guesses in a row take at least the sum of
  their delays, on each protocol, whether the client waits for each answer
  or opens a new connection for the next guess;
- the right password, sent while a refusal is still owed to the same
  address, is answered only once that refusal is (then accepted);
- a QMQP connection is closed after its third refused ``A`` block, and an
  MTL session must Connection.Open again after its third refusal;
- each refusal is counted in ``msggateway_login_failures_total`` and
  logged with the peer's address.

Clients: raw sockets for SSMP, QMQP and DMP, the bench's `StreamClient`
(our stream codec over a socket) for SASL PLAIN, pyzmq for MTL.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from bench.gateway_proc import StreamClient
from gateway.codecs import dmp, qmqp
from gateway.codecs import stream as sp
from gateway.core.auth import LoginFailurePolicy
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

DELAY = 0.02
MAX_DELAY = 0.1
POLICY = LoginFailurePolicy(delay_seconds=DELAY, max_delay_seconds=MAX_DELAY)
SLACK_SECONDS = 0.01
"""What a lower bound on elapsed time allows for clock reading (the reactor never fires early)."""
THROTTLE = f"""
login_failure_delay_seconds = {DELAY}
login_failure_max_delay_seconds = {MAX_DELAY}
login_failures_per_connection = 3
"""
CONFIG = f"""
[gateway]
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
{THROTTLE}
[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
{THROTTLE}
[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
{THROTTLE}
[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
{THROTTLE}
[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]
{THROTTLE}
[listeners.dmp.leases]
orders = {{ sink = "orders" }}
"""
SECRETS = """
[logins]
alice = "alice-pw"

[leases]
orders = "the-orders-lease"
"""
TIMEOUT_MS = 10_000


def backoff(guesses: int) -> float:
    """The least time ``guesses`` refusals in a row take to be answered, one after another."""
    return sum(POLICY.delay_after(n) for n in range(1, guesses + 1))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway above, started once for the module; each test guesses on its own listener."""
    process = GatewayProcess(tmp_path_factory.mktemp("brute-force"), CONFIG, secrets=SECRETS)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def refusals_logged(gateway: GatewayProcess, listener: str) -> int:
    """How many refusals the gateway logged for one listener."""
    return len(re.findall(rf"{listener}: login refused: ", gateway.output()))


def login_failures(gateway: GatewayProcess, listener: str) -> float:
    """``msggateway_login_failures_total`` of one listener, from /metrics."""
    pattern = rf'^msggateway_login_failures_total\{{endpoint="{listener}"\}} (\S+)$'
    found = re.search(pattern, gateway.metrics(), re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# --- SSMP ----------------------------------------------------------------------------------


def ssmp_guess(gateway: GatewayProcess, secret: str) -> bytes:
    """One LOGIN on a new connection; the answer (a 401 closes the connection)."""
    with LineClient(gateway.address("hub")) as client:
        client.send(f"LOGIN alice secret {secret}")
        return client.read_line()


def test_ssmp_twenty_wrong_secrets_take_the_backoff_sum(gateway: GatewayProcess) -> None:
    """20 wrong LOGINs, each on a new connection: at least the sum of the delays, growing."""
    started = time.monotonic()
    answered = []
    for guess in range(20):
        assert ssmp_guess(gateway, f"guess-{guess}") == b"401 secret"
        answered.append(time.monotonic() - started)
    assert answered[-1] >= backoff(20) - SLACK_SECONDS
    gaps = [later - earlier for earlier, later in zip([0.0, *answered], answered, strict=False)]
    assert gaps[0] >= DELAY - SLACK_SECONDS
    assert min(gaps[3:]) >= MAX_DELAY - SLACK_SECONDS
    assert login_failures(gateway, "hub") == 20
    assert refusals_logged(gateway, "hub") == 20
    assert re.search(
        r"hub: login refused: alice from 127\.0\.0\.1:\d+ \(LOGIN secret\)", gateway.output()
    )


def test_ssmp_the_right_secret_waits_for_the_refusal_owed(gateway: GatewayProcess) -> None:
    """A wrong LOGIN is being answered: the right one, on another connection, waits for it."""
    before = refusals_logged(gateway, "hub")
    with LineClient(gateway.address("hub")) as guesser, LineClient(gateway.address("hub")) as owner:
        guesser.send("LOGIN alice secret one-more-guess")
        gateway.wait_for_log_count("hub: login refused: ", before + 1, timeout=10)
        counted = time.monotonic()
        owner.send("LOGIN alice secret alice-pw")
        assert owner.read_line() == b"200"
        waited = time.monotonic() - counted
        assert guesser.read_line() == b"401 secret"
    assert waited >= MAX_DELAY - 2 * SLACK_SECONDS  # the guesser's delay was at its cap


# --- the stream protocol ----------------------------------------------------------------


def stream_guess(gateway: GatewayProcess, password: str) -> int:
    """SASL PLAIN as alice on a new connection; the response code."""
    client = StreamClient(gateway.address("streams"))
    try:
        client.send(sp.PeerProperties(correlation_id=1, properties={"product": "guesser"}))
        client.expect(sp.PeerPropertiesResponse)
        client.send(sp.SaslHandshake(correlation_id=2))
        client.expect(sp.SaslHandshakeResponse)
        data = b"\0alice\0" + password.encode()
        client.send(sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=data))
        code: int = client.expect(sp.SaslAuthenticateResponse).code
        return code
    finally:
        client.close()


def test_stream_wrong_passwords_take_the_backoff_sum(gateway: GatewayProcess) -> None:
    """10 wrong SASL PLAIN logins take at least the sum of their delays; then alice gets in."""
    started = time.monotonic()
    for guess in range(10):
        assert stream_guess(gateway, f"guess-{guess}") == sp.ResponseCode.AUTHENTICATION_FAILURE
    assert time.monotonic() - started >= backoff(10) - SLACK_SECONDS
    assert stream_guess(gateway, "alice-pw") == sp.ResponseCode.OK
    assert login_failures(gateway, "streams") == 10
    assert re.search(
        r"streams: login refused: alice from 127\.0\.0\.1:\d+ \(SASL PLAIN\)", gateway.output()
    )


# --- QMQP ------------------------------------------------------------------------------------


def test_qmqp_a_hundred_wrong_a_blocks_get_three_slow_answers_and_a_close(
    gateway: GatewayProcess,
) -> None:
    """100 wrong ``A`` blocks in one write: refused three times, each later, then closed."""
    wrong = qmqp.encode(qmqp.AuthBlock(username=b"alice", password=b"guess"))
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    replies: list[tuple[float, qmqp.Block]] = []
    with socket.create_connection(gateway.address("mail"), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(wrong * 100)
        while data := sock.recv(65536):
            now = time.monotonic() - started
            replies += [(now, block) for block in codec.receive_data(data)]
        closed = time.monotonic() - started
    assert [block for _, block in replies] == [qmqp.AuthReplyBlock(success=False)] * 3
    times = [at for at, _ in replies]
    assert times[0] >= backoff(1) - SLACK_SECONDS
    assert times[2] >= backoff(3) - SLACK_SECONDS
    assert closed >= backoff(3) - SLACK_SECONDS
    assert login_failures(gateway, "mail") == 3


# --- MTL -------------------------------------------------------------------------------------


class Control:
    """A REQ control client of the MTL listener."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.socket = context.socket(zmq.REQ)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, command: str, body: object) -> tuple[int, dict[str, Any]]:
        """Send a request; the status and the JSON reply."""
        self.socket.send_multipart([command.encode(), json.dumps(body).encode()])
        assert self.socket.poll(TIMEOUT_MS), "no reply in time"
        status, reply = self.socket.recv_multipart()
        return int(status), json.loads(reply)

    def open(self) -> int:
        """Connection.Open; its status."""
        return self.ask("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})[0]

    def plain(self, password: str) -> tuple[int, dict[str, Any]]:
        """Connection.Authorize with PLAIN as alice."""
        response = base64.b64encode(b"\0alice\0" + password.encode()).decode()
        return self.ask("Connection.Authorize", {"mechanism": "PLAIN", "response": response})


def test_mtl_wrong_passwords_take_the_backoff_sum_and_close_the_session(
    gateway: GatewayProcess,
) -> None:
    """Nine wrong PLAIN logins (Open again after every third) take the sum of their delays."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        control = Control(context, gateway.address("mtl")[1])
        started = time.monotonic()
        for _ in range(3):
            assert control.open() == 401
            statuses = [control.plain("guess") for _ in range(3)]
            assert [status for status, _ in statuses] == [401, 401, 401]
            assert "send Connection.Open" in statuses[-1][1]["reason"]
            # The session is closed: guessing on needs a new Connection.Open.
            status, reply = control.plain("alice-pw")
            assert (status, reply["reason"]) == (400, "send Connection.Open first")
        assert time.monotonic() - started >= backoff(9) - SLACK_SECONDS
        assert control.open() == 401
        assert control.plain("alice-pw")[0] == 201
    finally:
        context.destroy(linger=0)
    assert login_failures(gateway, "mtl") == 9
    assert re.search(
        r"mtl: login refused: alice from 127\.0\.0\.1 \(SASL PLAIN\)", gateway.output()
    )


# --- DMP leases ------------------------------------------------------------------------------


def dmp_guess(gateway: GatewayProcess, lease: str) -> int:
    """Present a lease on a new connection; the status of its answer."""
    with socket.create_connection(gateway.address("dmp"), timeout=10) as sock:
        sock.sendall(dmp.PROTOCOL_HEADER + bytes((len(lease),)) + lease.encode())
        codec = dmp.DMPCodec(dmp.Role.CLIENT)
        answers: list[dmp.Response] = []
        while len(answers) < 2:
            data = sock.recv(4096)
            assert data, f"closed after {answers}"
            answers += [
                event for event in codec.receive_data(data) if isinstance(event, dmp.Response)
            ]
        return answers[1].code


def test_dmp_wrong_leases_take_the_backoff_sum(gateway: GatewayProcess) -> None:
    """10 wrong lease texts take at least the sum of their delays; the right one opens the sink."""
    started = time.monotonic()
    for guess in range(10):
        assert dmp_guess(gateway, f"guess-{guess}") == 402
    assert time.monotonic() - started >= backoff(10) - SLACK_SECONDS
    assert dmp_guess(gateway, "the-orders-lease") == 200
    assert login_failures(gateway, "dmp") == 10
