"""A client certificate's SANs are not identities unless a listener says so (issue 26, defect 6).

Mallory holds a certificate from the listeners' CA with CN ``alice`` and the
SANs DNS ``bob`` and e-mail ``admin`` (a CA that vouches for a host name or
a mailbox does not thereby vouch for a login name). By default she is alice
and nobody else, on every protocol that takes identities from certificates:
an SSMP ``cert`` login, stream SASL EXTERNAL, a DMP lease bound to an
identity, and the TLS front-end's SSMP login. A listener with
``cert_identity = ["cn", "email"]`` takes the e-mail SAN as well, and still
not the DNS one.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import pytest

from tests.certs import Pki, issue_client_certificate, make_pki, mtls_endpoint, write_pem
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_tls_listeners import stream_login

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "{tls}"
schemes = ["cert"]
login_failure_delay_seconds = 0  # this test is refused on purpose, from one address

[listeners.hub-email]
protocol = "ssmp"
endpoint = "{tls}"
schemes = ["cert"]
cert_identity = ["cn", "email"]
login_failure_delay_seconds = 0

[listeners.streams]
protocol = "stream"
endpoint = "{tls}"
login_failure_delay_seconds = 0

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["orders"]
login_failure_delay_seconds = 0

[listeners.dmp.leases.alice-writer]
sink = "orders"
text = "AW"
identity = "alice"

[listeners.dmp.leases.bob-writer]
sink = "orders"
text = "BW"
identity = "bob"

[listeners.front]
protocol = "frontend"
speaks = "ssmp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={backend}"
handshake_timeout_seconds = 5
"""

SECRETS = """
[frontends.front]
"*" = "shared"
"""

STREAM_OK = 1
STREAM_AUTHENTICATION_FAILURE = 8


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The test PKI, with Mallory's certificate: CN alice, SANs DNS bob and e-mail admin."""
    directory = tmp_path_factory.mktemp("pki")
    pki = make_pki(directory)
    mallory = issue_client_certificate(pki.ca, "alice", dns_names=["bob"], emails=["admin"])
    write_pem(directory, "sans", mallory)
    return pki


@pytest.fixture(scope="module")
def backend() -> Iterator[socket.socket]:
    """A plaintext SSMP backend stand-in: accepts, reads the LOGIN, answers 200."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    yield server
    server.close()


@pytest.fixture(scope="module")
def gateway(
    pki: Pki, backend: socket.socket, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """SSMP, stream, DMP and front-end listeners on mtls:, default cert_identity but one."""
    config = CONFIG.format(tls=mtls_endpoint(pki), backend=backend.getsockname()[1])
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), config, secrets=SECRETS).start()
    yield process
    process.stop()


def _context(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.directory / "sans.pem"), str(pki.directory / "sans.key"))
    return ctx


def _ssmp_login(gateway: GatewayProcess, pki: Pki, listener: str, identity: str) -> bytes:
    with LineClient(gateway.address(listener), _context(pki)) as client:
        client.send(f"LOGIN {identity} cert")
        return client.read_line()


@pytest.mark.parametrize(
    ("identity", "reply"),
    [("alice", b"200"), ("alice/x", b"200"), ("bob", b"401 cert"), ("admin", b"401 cert")],
)
def test_ssmp_cert_login_by_the_common_name_only(
    gateway: GatewayProcess, pki: Pki, identity: str, reply: bytes
) -> None:
    """SSMP ``LOGIN <id> cert``: alice yes; the SANs bob and admin no."""
    assert _ssmp_login(gateway, pki, "hub", identity) == reply


@pytest.mark.parametrize(
    ("identity", "reply"), [("alice", b"200"), ("admin", b"200"), ("bob", b"401 cert")]
)
def test_a_listener_may_take_a_san_type(
    gateway: GatewayProcess, pki: Pki, identity: str, reply: bytes
) -> None:
    """With ``cert_identity = ["cn", "email"]``: the e-mail SAN logs in, the DNS SAN does not."""
    assert _ssmp_login(gateway, pki, "hub-email", identity) == reply


@pytest.mark.parametrize(
    ("authzid", "code"),
    [
        (b"", STREAM_OK),
        (b"alice", STREAM_OK),
        (b"bob", STREAM_AUTHENTICATION_FAILURE),
        (b"admin", STREAM_AUTHENTICATION_FAILURE),
    ],
)
def test_stream_external_by_the_common_name_only(
    gateway: GatewayProcess, pki: Pki, authzid: bytes, code: int
) -> None:
    """Stream SASL EXTERNAL: no name or alice logs in; bob and admin are refused."""
    with (
        socket.create_connection(gateway.address("streams"), timeout=10) as raw,
        _context(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        _, answer = stream_login(tls, authzid)
    assert answer == code


def _dmp_lease_answer(gateway: GatewayProcess, pki: Pki, lease: bytes) -> bytes:
    """Open a DMP connection with Mallory's certificate and a lease: the lease's response."""
    with (
        socket.create_connection(gateway.address("dmp"), timeout=10) as raw,
        _context(pki).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"AMQP\x0a\x01\x00\x01" + bytes((len(lease),)) + lease)
        data = b""
        # Two short strings: the protocol header's answer, then the lease's.
        while not (
            data and len(data) > 1 + data[0] and len(data) >= 2 + data[0] + data[1 + data[0]]
        ):
            more = tls.recv(4096)
            assert more, data
            data += more
    rest = data[1 + data[0] :]
    return rest[1 : 1 + rest[0]]


def test_dmp_lease_bound_to_a_san_is_refused(gateway: GatewayProcess, pki: Pki) -> None:
    """A DMP lease bound to bob is 402 BAD-LEASE for the certificate naming bob as a SAN."""
    assert _dmp_lease_answer(gateway, pki, b"AW").startswith(b"200 OK Ready to write")
    assert _dmp_lease_answer(gateway, pki, b"BW").startswith(b"402 BAD-LEASE")


def test_front_end_login_by_the_common_name_only(
    gateway: GatewayProcess, pki: Pki, backend: socket.socket
) -> None:
    """The front-end's SSMP ``LOGIN bob cert`` is refused before any backend connection."""
    with LineClient(gateway.address("front"), _context(pki)) as client:
        client.send("LOGIN bob cert")
        assert client.read_line() == b"401 cert"
    with LineClient(gateway.address("front"), _context(pki)) as client:
        client.send("LOGIN alice cert")
        connection, _ = backend.accept()
        with connection:
            connection.settimeout(10)
            assert connection.recv(1024) == b"LOGIN alice secret shared\n"
            connection.sendall(b"200\n")
            assert client.read_line() == b"200"
