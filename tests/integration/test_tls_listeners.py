"""TLS on the QMQP, stream and DMP listeners, end to end: the same ``mtls:`` endpoint as SSMP's.

A gateway under twistd serves each protocol on an ``mtls:`` endpoint that
requires a client certificate from the test CA. A client with alice's
certificate is served in each protocol's own way; a client with a
certificate from another CA is refused during the TLS handshake.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "{tls}"

[listeners.streams]
protocol = "stream"
endpoint = "{tls}"
anonymous = true
# EXTERNAL may name the certificate's e-mail address too.
cert_identity = ["cn", "email"]

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["s"]
"""

REQUESTS = {
    "qmqp": qmqp.encode(
        qmqp.MessageBlock(id=b"t", message=b"x", sender=b"a@b", recipients=(b"c@d",))
    ),
    "streams": sp.encode(sp.PeerProperties(correlation_id=1, properties={})),
    "dmp": b"AMQP\x0a\x01\x00\x01",
}
"""A first request each protocol answers."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """QMQP, stream and DMP listeners over TLS, client certificates required."""
    tls = mtls_endpoint(pki, "required")
    process = GatewayProcess(tmp_path_factory.mktemp("tls"), CONFIG.format(tls=tls)).start()
    yield process
    process.stop()


def client(pki: Pki, cert: Path, key: Path) -> ssl.SSLContext:
    """A client context trusting the test CA, presenting ``cert``."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


@pytest.mark.parametrize("listener", ["qmqp", "streams", "dmp"])
def test_served_over_tls_with_a_client_certificate(
    gateway: GatewayProcess, pki: Pki, listener: str
) -> None:
    """Alice's certificate: the protocol answers its first request over TLS."""
    host, port = gateway.address(listener)
    ctx = client(pki, pki.alice_cert, pki.alice_key)
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(REQUESTS[listener])
        assert tls.recv(64)  # an answer, in the protocol's own framing


@pytest.mark.parametrize("listener", ["qmqp", "streams", "dmp"])
def test_a_certificate_from_another_ca_is_refused(
    gateway: GatewayProcess, pki: Pki, listener: str
) -> None:
    """Mallory's certificate (another CA): the handshake fails, nothing is served."""
    host, port = gateway.address(listener)
    ctx = client(pki, pki.mallory_cert, pki.mallory_key)
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)),
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(REQUESTS[listener])
        if not tls.recv(64):  # TLS 1.3: the refusal arrives after the handshake
            raise ConnectionResetError("closed")


def stream_login(
    tls: socket.socket, authzid: bytes, mechanism: str = "EXTERNAL"
) -> tuple[tuple[str, ...], int]:
    """Peer properties, SASL handshake, ``mechanism`` with ``authzid``: the mechanisms and the code.

    For PLAIN, ``authzid`` is the whole response: NUL, user, NUL, password.
    """
    codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
    events: list[sp.Event] = []

    def ask(event: sp.Event) -> sp.Event:
        tls.sendall(codec.send(event))
        while not events:
            data = tls.recv(65536)
            assert data, "closed"
            events.extend(codec.receive_data(data))
        return events.pop(0)

    ask(sp.PeerProperties(correlation_id=1, properties={}))
    offered = ask(sp.SaslHandshake(correlation_id=2))
    assert isinstance(offered, sp.SaslHandshakeResponse)
    answer = ask(sp.SaslAuthenticate(correlation_id=3, mechanism=mechanism, data=authzid))
    assert isinstance(answer, sp.SaslAuthenticateResponse)
    return tuple(offered.mechanisms), answer.code


@pytest.mark.parametrize(("authzid", "code"), [(b"", 1), (b"alice@example.org", 1), (b"bob", 8)])
def test_stream_external_login_by_certificate(
    gateway: GatewayProcess, pki: Pki, authzid: bytes, code: int
) -> None:
    """EXTERNAL is offered over TLS with a certificate; it logs in as one of its names only."""
    host, port = gateway.address("streams")
    ctx = client(pki, pki.alice_cert, pki.alice_key)
    with (
        socket.create_connection((host, port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        mechanisms, answer = stream_login(tls, authzid)
    assert "EXTERNAL" in mechanisms
    assert answer == code
