"""Certificates, good and bad, against every TLS listener and the TLS upstreams, through twistd.

A *server* gateway has SSMP, QMQP, stream and DMP listeners on ``mtls:``
endpoints that require a client certificate from the test CA, plus a QMQP
and a stream listener presenting a certificate for another host name.

* Client certificates against each listener: alice's (valid) is served;
  an expired one, one not yet valid and one from another CA are refused
  in the handshake.
* SSMP ``cert`` logins by a certificate with SANs only (no CN), with the
  ``name/suffix`` form.
* An *upstream* gateway routes mail to QMQP and stream upstreams over
  ``tls:`` endpoints (service_identity checks the host name): the good ones
  deliver (K; the stream one after the stream listener's confirm); a wrong
  host name, an untrusted CA, no client certificate and an expired client
  certificate each fail the handshake, so the sender gets Z.
"""

from __future__ import annotations

import datetime
import shutil
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.codecs import qmqp
from tests.certs import (
    Pki,
    issue_client_certificate,
    issue_server_certificate,
    make_pki,
    write_pem,
)
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_qmqp import QMQPSession, mail
from tests.integration.test_tls_listeners import REQUESTS

pytestmark = pytest.mark.integration

SERVER = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "{tls}"
schemes = ["cert"]
cert_identity = ["cn", "dns"]

[listeners.qmqp]
protocol = "qmqp"
endpoint = "{tls}"

[listeners.streams]
protocol = "stream"
endpoint = "{tls}"
guest = true
advertised_host = "localhost"

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["s"]

[listeners.qmqp-elsewhere]
protocol = "qmqp"
endpoint = "{elsewhere}"

[listeners.streams-elsewhere]
protocol = "stream"
endpoint = "{elsewhere}"
guest = true
advertised_host = "localhost"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""
SERVER_ROUTES = {
    "mail": 'from = "qmqp"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n',
    "elsewhere": 'from = "qmqp-elsewhere"\nmatch = "#"\nto = "hub"\naddress = "mail"\n'
    'body = "subject"\n',
}

UPSTREAM = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.in]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""
STREAM_CASES = {
    "stream-good": ("trustRoots={trust}:certificate={alice}:privateKey={alice_key}", "streams"),
    "stream-wrong-host": (
        "trustRoots={trust}:certificate={alice}:privateKey={alice_key}",
        "streams-elsewhere",
    ),
}
CASES = {
    # name: (endpoint parameters after tls:host=localhost:port=P, which listener)
    "good": ("trustRoots={trust}:certificate={alice}:privateKey={alice_key}", "qmqp"),
    "wrong-host": ("trustRoots={trust}:certificate={alice}:privateKey={alice_key}", "elsewhere"),
    "untrusted": ("trustRoots={other_trust}:certificate={alice}:privateKey={alice_key}", "qmqp"),
    "no-cert": ("trustRoots={trust}", "qmqp"),
    "expired-cert": ("trustRoots={trust}:certificate={expired}:privateKey={expired_key}", "qmqp"),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test PKI plus expired, not-yet-valid, SAN-only and wrong-host certificates."""
    directory = tmp_path_factory.mktemp("pki")
    pki: Pki = make_pki(directory)
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    paths: dict[str, Path] = {
        "ca": pki.ca_cert,
        "trust": pki.trust_dir,
        "server": pki.server_cert,
        "server_key": pki.server_key,
        "alice": pki.alice_cert,
        "alice_key": pki.alice_key,
        "mallory": pki.mallory_cert,
        "mallory_key": pki.mallory_key,
    }
    for name, certified in (
        ("expired", issue_client_certificate(pki.ca, "old", validity=(now - 9 * day, now - day))),
        ("future", issue_client_certificate(pki.ca, "new", validity=(now + day, now + 9 * day))),
        ("carol", issue_client_certificate(pki.ca, None, dns_names=["carol.example.org"])),
        ("elsewhere", issue_server_certificate(pki.ca, "elsewhere", ["elsewhere.example"])),
    ):
        paths[name], paths[f"{name}_key"] = write_pem(directory, name, certified)
    other = directory / "other-trust"
    other.mkdir()
    shutil.copy(pki.wrong_ca_cert, other / "ca.pem")
    paths["other_trust"] = other
    return paths


@pytest.fixture(scope="module")
def server(
    certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The server gateway: every listener over mtls, client certificates required."""
    common = f":caCerts={certs['ca']}:verify=required"
    tls = f"mtls:0:certKey={certs['server']}:privateKey={certs['server_key']}{common}"
    elsewhere = f"mtls:0:certKey={certs['elsewhere']}:privateKey={certs['elsewhere_key']}{common}"
    process = GatewayProcess(
        tmp_path_factory.mktemp("server"),
        SERVER.format(tls=tls, elsewhere=elsewhere),
        routes=SERVER_ROUTES,
    ).start()
    yield process
    process.stop()


def _context(certs: dict[str, Path], name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    ctx.load_cert_chain(str(certs[name]), str(certs[f"{name}_key"]))
    return ctx


def _served(server: GatewayProcess, listener: str, ctx: ssl.SSLContext) -> bool:
    """Whether the listener answers its protocol's first request over this TLS context."""
    try:
        with (
            socket.create_connection(server.address(listener), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            tls.sendall(REQUESTS.get(listener, b"LOGIN alice cert\n"))
            return bool(tls.recv(64))
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return False


@pytest.mark.parametrize("listener", ["ssmp", "qmqp", "streams", "dmp"])
@pytest.mark.parametrize(
    ("certificate", "served"),
    [("alice", True), ("expired", False), ("future", False), ("mallory", False)],
)
def test_client_certificates(
    server: GatewayProcess, certs: dict[str, Path], listener: str, certificate: str, served: bool
) -> None:
    """Valid: served. Expired, not yet valid, another CA: refused in the handshake."""
    assert _served(server, listener, _context(certs, certificate)) is served


def test_ssmp_login_by_san_only_certificate(server: GatewayProcess, certs: dict[str, Path]) -> None:
    """A certificate without a CN logs in as its SAN, and as SAN/suffix; not as another name."""
    ctx = _context(certs, "carol")
    for identifier, code in (
        ("carol.example.org", b"200"),
        ("carol.example.org/laptop", b"200"),
        ("alice", b"401"),
    ):
        with LineClient(server.address("ssmp"), ctx) as client:
            client.send(f"LOGIN {identifier} cert")
            assert client.read_line().startswith(code), identifier


def test_qmqp_and_stream_upstreams_over_tls(
    server: GatewayProcess, certs: dict[str, Path], tmp_path: Path
) -> None:
    """Only a trusted server with the right host name, and a valid client certificate: K."""
    names = {k: str(v) for k, v in certs.items()}
    ports = {
        "qmqp": server.address("qmqp")[1],
        "elsewhere": server.address("qmqp-elsewhere")[1],
        "streams": server.address("streams")[1],
        "streams-elsewhere": server.address("streams-elsewhere")[1],
    }
    config = UPSTREAM
    routes: dict[str, str] = {}
    for case, (parameters, target) in {**CASES, **STREAM_CASES}.items():
        endpoint = f"tls:host=localhost:port={ports[target]}:" + parameters.format(**names)
        protocol = "stream" if case in STREAM_CASES else "qmqp"
        config += f'\n[upstreams.{case}]\nprotocol = "{protocol}"\nendpoint = "{endpoint}"\n'
        if protocol == "stream":
            config += "create_streams = true\n"
        routes[case] = (
            f'from = "in"\nmatch = "#@{case}.example"\nto = "{case}"\ntimeout_seconds = 5\n'
            + ('address = "inbox"\n' if protocol == "stream" else "")
        )
    gateway = GatewayProcess(tmp_path, config, routes=routes).start()
    try:
        # The stream upstream takes mail only once connected (else: Z at once).
        gateway.wait_for_log("upstream stream-good: connected", timeout=30)
        session = QMQPSession(gateway.address("in"))
        try:
            cases = [*CASES, *STREAM_CASES]
            session.send(b"".join(mail(case, f"ops@{case}.example") for case in cases) + b"1:D,")
            replies = {
                block.id.decode(): block.status  # type: ignore[union-attr]
                for block in session.read_blocks(len(cases))
            }
        finally:
            session.close()
    finally:
        gateway.stop()
    assert replies == {
        "good": qmqp.K,
        "wrong-host": qmqp.Z,
        "untrusted": qmqp.Z,
        "no-cert": qmqp.Z,
        "expired-cert": qmqp.Z,
        "stream-good": qmqp.K,
        "stream-wrong-host": qmqp.Z,
    }
