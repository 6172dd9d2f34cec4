"""SIGHUP reloads certificates and secrets without dropping established connections.

A gateway under twistd has a QMQP listener over ``mtls:`` and a plaintext
QMQP listener that requires the ``A`` block. The test replaces the server's
certificate and key files and alice's secret, then sends SIGHUP:

* the TLS connection made before the reload still works;
* a new TLS connection gets the new certificate;
* a new login needs the new secret (the old one is refused);
* a reload with a broken certificate file keeps the last good one, and says so.
"""

from __future__ import annotations

import signal
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from gateway.codecs import qmqp
from tests.certs import issue_server_certificate, make_pki, write_pem
from tests.integration.harness import GatewayProcess
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.secure]
protocol = "qmqp"
endpoint = "mtls:0:interface=127.0.0.1:certKey={cert}:privateKey={key}:caCerts={ca}:verify=required"

[listeners.locked]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
"""


def _secrets(password: str) -> str:
    return f'[logins]\nalice = "{password}"\n'


def _auth(password: str) -> bytes:
    return qmqp.encode(qmqp.AuthBlock(username=b"alice", password=password.encode()))


def _login(gateway: GatewayProcess, password: str) -> bool:
    """Whether the locked listener takes alice's login with this password."""
    session = QMQPSession(gateway.address("locked"))
    try:
        session.send(_auth(password))
        [reply] = session.read_blocks(1)
        assert isinstance(reply, qmqp.AuthReplyBlock)
        return reply.success
    finally:
        session.close()


def _common_name(tls: ssl.SSLSocket) -> str:
    der = tls.getpeercert(binary_form=True)
    assert der is not None
    certificate = x509.load_der_x509_certificate(der)
    return str(certificate.subject.rfc4514_string())


def test_sighup_reloads_certificates_and_secrets(tmp_path: Path) -> None:
    """Old connections stay; new ones get the new certificate and secrets; bad files are refused."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    live = tmp_path / "live"
    live.mkdir()
    cert, key = write_pem(live, "server", pki.server)
    config = CONFIG.format(cert=cert, key=key, ca=pki.ca_cert)
    gateway = GatewayProcess(tmp_path / "gw", config, secrets=_secrets("old")).start()
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    try:
        assert _login(gateway, "old")
        host, port = gateway.address("secure")
        before = context.wrap_socket(
            socket.create_connection((host, port), timeout=10), server_hostname="localhost"
        )
        assert _common_name(before) == "CN=localhost"

        write_pem(live, "server", issue_server_certificate(pki.ca, "renewed"))
        (tmp_path / "gw" / "secrets.toml").write_text(_secrets("new"))
        gateway.signal(signal.SIGHUP)
        gateway.wait_for_log(r"reload: \d+ route\(s\) in effect")
        assert "new connections use the files as they are now" in gateway.output()

        # The connection made before the reload is served as before.
        before.sendall(mail("m1", "x@nowhere.example") + qmqp.DONE_BYTES)
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        blocks: list[qmqp.Block] = []
        while len(blocks) < 2:
            data = before.recv(65536)
            assert data, "the old connection was dropped"
            blocks.extend(codec.receive_data(data))
        assert isinstance(blocks[0], qmqp.ReplyBlock) and blocks[0].id == b"m1"
        before.close()

        with context.wrap_socket(
            socket.create_connection((host, port), timeout=10), server_hostname="localhost"
        ) as after:
            assert _common_name(after) == "CN=renewed"
        assert not _login(gateway, "old")
        assert _login(gateway, "new")

        # A broken file: the reload says so and the last good certificate stays.
        cert.write_text("not a certificate\n")
        gateway.signal(signal.SIGHUP)
        gateway.wait_for_log_count("route(s) in effect", 2, timeout=30)
        assert "keeping the old certificate" in gateway.output()
        with context.wrap_socket(
            socket.create_connection((host, port), timeout=10), server_hostname="localhost"
        ) as again:
            assert _common_name(again) == "CN=renewed"
    finally:
        gateway.stop()
