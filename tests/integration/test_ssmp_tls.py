"""SSMP over TLS with client certificates, against a real twistd process.

The test makes its own PKI (a CA, a server certificate, a client ``alice``
with SANs, and ``mallory`` from an unrelated CA) and starts one gateway with
an ``mtls:`` listener requiring client certificates and one where they are
optional.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.required]
protocol = "ssmp"
endpoint = "{tls}:verify=required"
schemes = ["secret"]
cert_identity = ["cn", "dns", "email"]

[listeners.optional]
protocol = "ssmp"
endpoint = "{tls}:verify=optional"
schemes = ["secret"]
"""

SECRETS = """
[logins]
dave = "dave-secret"
"""


def tls_endpoint(pki: Pki) -> str:
    """An mtls: endpoint on a free loopback port with the test PKI (no verify= yet)."""
    return mtls_endpoint(pki)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with a required-certificate and an optional-certificate listener."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("tls"), CONFIG.format(tls=tls_endpoint(pki)), secrets=SECRETS
    ).start()
    yield process
    process.stop()


def context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context trusting the test CA, with an optional client certificate."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def test_cert_login_by_cn_san_and_suffix(gateway: GatewayProcess, pki: Pki) -> None:
    """LOGIN ... cert succeeds for the CN, any SAN, and NAME/suffix."""
    for identity in ("alice", "alice.example.org", "alice@example.org", "alice/laptop"):
        with LineClient(
            gateway.address("required"), context(pki, pki.alice_cert, pki.alice_key)
        ) as client:
            client.send(f"LOGIN {identity} cert")
            client.expect("200")
            client.sync()


def test_cert_login_for_another_name_is_refused(gateway: GatewayProcess, pki: Pki) -> None:
    """A certificate does not prove someone else's identity: 401 and close."""
    with LineClient(
        gateway.address("required"), context(pki, pki.alice_cert, pki.alice_key)
    ) as client:
        client.send("LOGIN bob cert")
        assert client.read_line() == b"401 cert secret"
        client.expect_closed()


def test_secret_login_over_tls(gateway: GatewayProcess, pki: Pki) -> None:
    """Other schemes work over TLS too; cert is always among those offered."""
    with LineClient(
        gateway.address("required"), context(pki, pki.alice_cert, pki.alice_key)
    ) as client:
        client.send("LOGIN dave secret dave-secret", "SUBSCRIBE tls.news")
        client.expect("200")
        client.expect("200")


def test_certificate_required(gateway: GatewayProcess, pki: Pki) -> None:
    """Without a client certificate the required listener refuses the handshake."""
    with pytest.raises((ssl.SSLError, ConnectionResetError, EOFError, BrokenPipeError)):
        client = LineClient(gateway.address("required"), context(pki))
        client.send("LOGIN dave secret dave-secret")
        client.read_line()


def test_wrong_ca_refused(gateway: GatewayProcess, pki: Pki) -> None:
    """A client certificate from another CA is refused."""
    with pytest.raises((ssl.SSLError, ConnectionResetError, EOFError, BrokenPipeError)):
        client = LineClient(
            gateway.address("required"), context(pki, pki.mallory_cert, pki.mallory_key)
        )
        client.send("LOGIN mallory cert")
        client.read_line()
    # The gateway says why, and what fixes it.
    line = gateway.wait_for_log(r"required: TLS with 127\.0\.0\.1\S* failed: ")
    assert "certificate" in line and "caCerts" in line, line


def test_optional_certificate(gateway: GatewayProcess, pki: Pki) -> None:
    """With verify=optional, no certificate still connects; cert login then fails."""
    with LineClient(gateway.address("optional"), context(pki)) as client:
        client.send("LOGIN dave secret dave-secret")
        client.expect("200")
    with LineClient(gateway.address("optional"), context(pki)) as client:
        client.send("LOGIN alice cert")
        client.expect_code(401)
    with LineClient(
        gateway.address("optional"), context(pki, pki.alice_cert, pki.alice_key)
    ) as client:
        client.send("LOGIN alice cert")
        client.expect("200")


UPSTREAM_CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.secure]
protocol = "ssmp"
endpoint = "{endpoint}"
identity = "alice/bridge"
scheme = "cert"
"""


def test_upstream_over_tls_with_client_certificate(
    gateway: GatewayProcess, pki: Pki, tmp_path: Path
) -> None:
    """An upstream verifies the server and logs in with its client certificate."""
    _, port = gateway.address("required")
    bridge = GatewayProcess(
        tmp_path,
        UPSTREAM_CONFIG.format(
            endpoint=f"tls:host=localhost:port={port}:trustRoots={pki.trust_dir}"
            f":certificate={pki.alice_cert}:privateKey={pki.alice_key}"
        ),
        routes={"in": 'from = "secure"\nmatch = "tls.alerts"\nto = "hub"\n'},
    ).start()
    try:
        bridge.wait_for_log("upstream secure: logged in as alice/bridge")
        with (
            LineClient(bridge.address("hub")) as local,
            LineClient(
                gateway.address("required"), context(pki, pki.alice_cert, pki.alice_key)
            ) as remote,
        ):
            local.send("LOGIN local open", "SUBSCRIBE tls.alerts")
            local.expect("200")
            local.expect("200")
            remote.send("LOGIN alice/sender cert", "SUBSCRIBE tls.alerts PRESENCE")
            remote.expect("200")
            remote.expect("200")
            remote.expect("000 alice/bridge SUBSCRIBE tls.alerts")  # the bridge is in
            remote.send("MCAST tls.alerts over tls")
            remote.expect("200")
            local.expect("000 alice/sender MCAST tls.alerts over tls")
    finally:
        bridge.stop()
