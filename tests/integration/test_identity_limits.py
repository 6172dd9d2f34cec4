"""Connections per identity, end to end: past ``max_connections_per_identity`` a login is refused.

One gateway under twistd with an SSMP (over ``mtls:``), a QMQP and a stream
listener, each allowing alice two connections: her third login is refused
in each protocol's own way (SSMP ``401`` and the close, QMQP an ``A`` reply
of failure, stream SASL code 8, DMP ``403``), bob is not affected, and once one of
alice's connections closes she may log in again. SSMP counts the
certificate's identity (``alice/1`` and ``alice/2`` are both alice); a
login with the same identifier replaces the earlier connection, as the spec
says, and is not refused.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Iterator

import pytest

from gateway.codecs import qmqp
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_tls_listeners import stream_login as sasl_login

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "{tls}"
schemes = ["secret"]
max_connections_per_identity = 2

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
max_connections_per_identity = 2

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
max_connections_per_identity = 2

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["s"]
max_connections_per_identity = 2

[listeners.dmp.leases.writer]
sink = "s"
text = "L"
"""
SECRETS = '[logins]\nalice = "a-secret"\nbob = "b-secret"\n'


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway with per-identity limits of two."""
    tls = mtls_endpoint(pki, "optional")
    process = GatewayProcess(
        tmp_path_factory.mktemp("ids"), CONFIG.format(tls=tls), secrets=SECRETS
    ).start()
    process.pki = pki  # type: ignore[attr-defined]
    yield process
    process.stop()


_SSMP_LOGINS: dict[str, int] = {}


def ssmp_login(gateway: GatewayProcess, who: str) -> tuple[bool, object]:
    """Log in over SSMP (alice by certificate as alice/N, bob by secret); the result and client."""
    pki: Pki = gateway.pki  # type: ignore[attr-defined]
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    client = LineClient(gateway.address("ssmp"), ctx)
    if who == "alice":
        number = _SSMP_LOGINS[who] = _SSMP_LOGINS.get(who, 0) + 1
        client.send(f"LOGIN alice/{number} cert")
    else:
        client.send(f"LOGIN {who} secret {who[0]}-secret")
    return client.read_line() == b"200", client


def qmqp_login(gateway: GatewayProcess, who: str) -> tuple[bool, object]:
    """Send QMQP's A block; whether it succeeded, and the open socket."""
    sock = socket.create_connection(gateway.address("qmqp"), timeout=10)
    sock.sendall(
        qmqp.encode(qmqp.AuthBlock(username=who.encode(), password=b"%c-secret" % who[0].encode()))
    )
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    blocks: list[qmqp.Block] = []
    while not blocks:
        data = sock.recv(4096)
        assert data
        blocks.extend(codec.receive_data(data))
    [reply] = blocks
    assert isinstance(reply, qmqp.AuthReplyBlock)
    return reply.success, sock


def stream_login(gateway: GatewayProcess, who: str) -> tuple[bool, object]:
    """Peer properties, SASL PLAIN; whether the code was OK (1), and the open socket."""
    sock = socket.create_connection(gateway.address("streams"), timeout=10)
    response = b"\0" + who.encode() + b"\0" + f"{who[0]}-secret".encode()
    _mechanisms, code = sasl_login(sock, response, "PLAIN")
    return code == 1, sock


def dmp_login(gateway: GatewayProcess, who: str) -> tuple[bool, object]:
    """Open the sink with the lease: alice by her certificate, bob without one."""
    pki: Pki = gateway.pki  # type: ignore[attr-defined]
    raw = socket.create_connection(gateway.address("dmp"), timeout=10)
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    if who == "alice":
        ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    sock = ctx.wrap_socket(raw, server_hostname="localhost")
    sock.sendall(b"AMQP\x0a\x01\x00\x01\x01L")
    data = b""
    while not (data and len(data) > data[0] and len(data) >= 2 + data[0] + data[1 + data[0]]):
        more = sock.recv(4096)
        if not more:
            break
        data += more
    rest = data[1 + data[0] :]
    return rest[1:4] == b"200", sock


@pytest.mark.parametrize(
    "login",
    [ssmp_login, qmqp_login, stream_login, dmp_login],
    ids=["ssmp", "qmqp", "stream", "dmp"],
)
def test_third_login_of_an_identity_is_refused(
    gateway: GatewayProcess, login: Callable[[GatewayProcess, str], tuple[bool, object]]
) -> None:
    """Two of alice's logins work, the third does not; bob's does; a freed place is taken again."""
    first, one = login(gateway, "alice")
    second, two = login(gateway, "alice")
    third, three = login(gateway, "alice")
    other, four = login(gateway, "bob")
    try:
        assert (first, second, third, other) == (True, True, False, True)
        one.close()  # type: ignore[attr-defined]
        again = False
        for _ in range(50):  # the close reaches the gateway asynchronously: a bounded retry
            again, extra = login(gateway, "alice")
            extra.close()  # type: ignore[attr-defined]
            if again:
                break
        assert again
    finally:
        for held in (two, three, four):
            held.close()  # type: ignore[attr-defined]
    assert "already has 2 connection(s)" in gateway.output()
