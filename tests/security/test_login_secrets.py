"""The admin token and DMP lease texts are no login passwords (issue 26, defects 5 and 13a).

Against a real ``twistd msggateway`` whose secrets file has an
``admin_token``, alice's login password and the text of DMP lease
``alice-orders``:

- the admin token does not log in as ``admin`` on the SSMP hub (``LOGIN
  admin secret TOKEN``), the stream listener (SASL PLAIN) or the QMQP
  listener (an ``A`` block), and it does open the admin API (``/tap``);
- the lease text does not log in as ``alice-orders`` on the hub (the
  probe's ``LOGIN alice-orders secret LEASE-...`` got 200) nor anywhere
  else, and it does open the DMP sink.

And without a process: a secrets file written the old way (the token as
``[logins] admin``, a lease text in ``[logins]``) is refused, naming the
file, the key and what to move where.
"""

from __future__ import annotations

import http.client
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.gateway_proc import StreamClient
from gateway.codecs import dmp, qmqp
from gateway.codecs import stream as sp
from gateway.config import ConfigError, load_config
from tests.integration.harness import GatewayProcess, LineClient

TOKEN = "ADMIN-t0ken-8c1f"
LEASE = "LEASE-5d0a-orders"

CONFIG = """
[gateway]
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
login_failure_delay_seconds = 0.01
login_failure_max_delay_seconds = 0.05

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
login_failure_delay_seconds = 0.01
login_failure_max_delay_seconds = 0.05

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
login_failure_delay_seconds = 0.01
login_failure_max_delay_seconds = 0.05

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]

[listeners.dmp.leases]
alice-orders = { sink = "orders" }
"""
SECRETS = f"""
admin_token = "{TOKEN}"

[logins]
alice = "alice-pw"

[leases]
alice-orders = "{LEASE}"
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway above, started once for the module."""
    process = GatewayProcess(tmp_path_factory.mktemp("login-secrets"), CONFIG, secrets=SECRETS)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def ssmp_login(gateway: GatewayProcess, identity: str, secret: str) -> bytes:
    """``LOGIN identity secret SECRET`` on the hub; its answer."""
    with LineClient(gateway.address("hub")) as client:
        client.send(f"LOGIN {identity} secret {secret}")
        return client.read_line()


def stream_plain(gateway: GatewayProcess, user: str, password: str) -> int:
    """SASL PLAIN on the stream listener; the SaslAuthenticate response code."""
    client = StreamClient(gateway.address("streams"))
    try:
        client.send(sp.SaslHandshake(correlation_id=1))
        client.expect(sp.SaslHandshakeResponse)
        data = b"\0" + user.encode() + b"\0" + password.encode()
        client.send(sp.SaslAuthenticate(correlation_id=2, mechanism="PLAIN", data=data))
        code: int = client.expect(sp.SaslAuthenticateResponse).code
        return code
    finally:
        client.close()


def qmqp_auth(gateway: GatewayProcess, user: str, password: str) -> bool:
    """An ``A`` block on the QMQP listener; whether it was accepted."""
    block = qmqp.encode(qmqp.AuthBlock(username=user.encode(), password=password.encode()))
    with socket.create_connection(gateway.address("mail"), timeout=5) as sock:
        sock.sendall(block)
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        while True:
            data = sock.recv(4096)
            assert data, "the listener closed without answering the A block"
            for reply in codec.receive_data(data):
                assert isinstance(reply, qmqp.AuthReplyBlock)
                return reply.success


def dmp_open(gateway: GatewayProcess, lease: str) -> int:
    """Present a lease on the DMP listener; the status of its answer."""
    with socket.create_connection(gateway.address("dmp"), timeout=5) as sock:
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


def tap_status(gateway: GatewayProcess, token: str | None) -> int:
    """``GET /tap?route=nowhere`` on the admin endpoint, with ``token`` if any; the status."""
    host, port = gateway.address("admin")
    connection = http.client.HTTPConnection(host, port, timeout=5)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        connection.request("GET", "/tap?route=nowhere", headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.integration
def test_the_admin_token_logs_in_nowhere(gateway: GatewayProcess) -> None:
    """Defect 5: the admin token is no password of a login ``admin``, on any listener."""
    assert ssmp_login(gateway, "admin", TOKEN).startswith(b"401")
    assert stream_plain(gateway, "admin", TOKEN) == sp.ResponseCode.AUTHENTICATION_FAILURE
    assert qmqp_auth(gateway, "admin", TOKEN) is False
    # Logins still work, with login passwords.
    assert ssmp_login(gateway, "alice", "alice-pw") == b"200"
    assert stream_plain(gateway, "alice", "alice-pw") == sp.ResponseCode.OK


@pytest.mark.integration
def test_the_admin_token_opens_the_admin_api(gateway: GatewayProcess) -> None:
    """The token authorizes the admin API: past it, /tap says the route is unknown (404)."""
    assert tap_status(gateway, None) == 401
    assert tap_status(gateway, "alice-pw") == 401
    assert tap_status(gateway, TOKEN) == 404


@pytest.mark.integration
def test_a_lease_text_logs_in_nowhere(gateway: GatewayProcess) -> None:
    """Defect 13a: ``LOGIN alice-orders secret LEASE-...`` is 401; the lease opens its sink."""
    assert ssmp_login(gateway, "alice-orders", LEASE).startswith(b"401")
    assert stream_plain(gateway, "alice-orders", LEASE) == sp.ResponseCode.AUTHENTICATION_FAILURE
    assert qmqp_auth(gateway, "alice-orders", LEASE) is False
    assert dmp_open(gateway, LEASE) == 200


# --- secrets files written the old way ---------------------------------------------------------

MAIN = """
[gateway]
secrets = "secrets.toml"

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]

[listeners.dmp.leases]
alice-orders = { sink = "orders" }
"""


def problems(tmp_path: Path, secrets: str) -> list[str]:
    """The problems a configuration with this secrets file has, as ``file: key: reason``."""
    (tmp_path / "gateway.toml").write_text(MAIN)
    (tmp_path / "secrets.toml").write_text(textwrap.dedent(secrets))
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "gateway.toml")
    return [str(problem) for problem in refused.value.problems]


def test_the_admin_token_in_logins_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """``[logins] admin`` without ``admin_token``: refused, saying to move it to admin_token."""
    found = problems(tmp_path, f'[logins]\nadmin = "{TOKEN}"\n[leases]\nalice-orders = "x"\n')
    assert len(found) == 1
    assert found[0].startswith(f"{tmp_path / 'secrets.toml'}: logins.admin: ")
    assert "move it to admin_token" in found[0]


def test_a_lease_text_in_logins_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """A lease text only in ``[logins]``: refused, naming the key and where to move it."""
    (found,) = problems(tmp_path, f'[logins]\nalice-orders = "{LEASE}"\n')
    assert found.startswith(f"{tmp_path / 'secrets.toml'}: logins.alice-orders: ")
    assert "move alice-orders from [logins] to [leases]" in found


def test_an_empty_admin_token_is_refused(tmp_path: Path) -> None:
    """``admin_token = ""`` would let any request in: refused."""
    (found,) = problems(tmp_path, 'admin_token = ""\n[leases]\nalice-orders = "x"\n')
    assert ": admin_token: " in found


def test_a_login_named_admin_beside_an_admin_token_is_a_login(tmp_path: Path) -> None:
    """With ``admin_token`` set, ``[logins] admin`` is just a login, apart from the token."""
    (tmp_path / "gateway.toml").write_text(MAIN)
    (tmp_path / "secrets.toml").write_text(
        f'admin_token = "{TOKEN}"\n[logins]\nadmin = "pw"\n[leases]\nalice-orders = "{LEASE}"\n'
    )
    secrets = load_config(tmp_path / "gateway.toml").secrets
    assert secrets.verify("admin", b"pw") and not secrets.verify("admin", TOKEN.encode())
    assert secrets.is_admin_token(TOKEN.encode()) and not secrets.is_admin_token(b"pw")
    assert not secrets.verify("alice-orders", LEASE.encode())
