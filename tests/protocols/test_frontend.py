"""The TLS front-end's relay, in memory: LOGIN rewriting, refusals, time-outs, the backend's fate.

Client connections are `TLSStringTransport` s with a chosen client
certificate; the backend connection is whatever the front-end asks a
`MemoryReactorClock` for, connected (or failed) by the test.
"""

from __future__ import annotations

from typing import Any

import pytest
from cryptography import x509
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from gateway.codecs import qmqp
from gateway.core.auth import Secrets
from gateway.metrics import GatewayMetrics
from gateway.protocols.frontend import FrontendFactory, FrontendProtocol, FrontendSettings
from tests.certs import issue_client_certificate, make_ca
from tests.integration.test_qmqp import mail
from tests.protocols.test_ssmp_server import TLSStringTransport


@pytest.fixture(scope="module")
def alice() -> x509.Certificate:
    """A client certificate naming alice (CN) and alice.example.org (SAN)."""
    ca = make_ca("front-end tests CA")
    return issue_client_certificate(ca, "alice", dns_names=["alice.example.org"]).certificate


def _front(
    speaks: str, certificate: x509.Certificate | None, *, secret: bytes | None = b"s3cret"
) -> tuple[FrontendProtocol, TLSStringTransport, MemoryReactorClock, FrontendFactory]:
    reactor = MemoryReactorClock()
    factory = FrontendFactory(
        name="front",
        settings=FrontendSettings(speaks=speaks, backend="tcp:host=10.0.0.5:port=8787"),
        secrets=Secrets(upstreams={"front": secret} if secret else {}),
        reactor=reactor,
        metrics=GatewayMetrics(),
    )
    protocol = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5000))
    assert protocol is not None
    client = TLSStringTransport(certificate)
    protocol.makeConnection(client)
    return protocol, client, reactor, factory


def _backend(reactor: MemoryReactorClock) -> tuple[Any, StringTransport]:
    """Complete the connection the front-end asked for; return its protocol and transport."""
    [(host, port, factory, timeout, _)] = reactor.tcpClients
    assert (host, port, timeout) == ("10.0.0.5", 8787, 10)
    protocol = factory.buildProtocol(IPv4Address("TCP", host, port))
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


def test_ssmp_login_rewritten_then_bytes_relayed(alice: x509.Certificate) -> None:
    """The LOGIN, one byte at a time, becomes a secret login; the rest passes both ways."""
    front, client, reactor, _ = _front("ssmp", alice)
    for byte in b"LOGIN alice.example.org/laptop cert\nSUBSCRIBE news\n":
        front.dataReceived(bytes([byte]))
    backend, server = _backend(reactor)
    assert server.value() == b"LOGIN alice.example.org/laptop secret s3cret\nSUBSCRIBE news\n"
    backend.dataReceived(b"200\n200\n")
    assert client.value() == b"200\n200\n"
    front.dataReceived(b"MCAST news hi\n")
    assert server.value().endswith(b"MCAST news hi\n")
    backend.connectionLost(Failure(ConnectionRefusedError()))
    assert client.disconnecting


@pytest.mark.parametrize(
    "line", [b"LOGIN bob cert\n", b"LOGIN alice secret x\n", b"LOGIN alice open\n"]
)
def test_ssmp_login_not_matching_the_certificate(alice: x509.Certificate, line: bytes) -> None:
    """Another name or scheme: 401 cert, closed, and the backend is never contacted."""
    front, client, reactor, _ = _front("ssmp", alice)
    front.dataReceived(line)
    assert client.value() == b"401 cert\n"
    assert client.disconnecting
    assert reactor.tcpClients == []


def test_ssmp_first_line_not_a_login(alice: x509.Certificate) -> None:
    """The spec: 400 and the close."""
    front, client, reactor, _ = _front("ssmp", alice)
    front.dataReceived(b"SUBSCRIBE news\n")
    assert client.value().startswith(b"400 ")
    assert client.disconnecting and reactor.tcpClients == []


def test_ssmp_without_a_backend_secret(alice: x509.Certificate) -> None:
    """No [upstreams] secret for the listener: refused, and the log says what to add."""
    front, client, reactor, _ = _front("ssmp", alice, secret=None)
    front.dataReceived(b"LOGIN alice cert\n")
    assert client.value() == b"401 cert\n" and reactor.tcpClients == []


def test_ssmp_login_timeout(alice: x509.Certificate) -> None:
    """No LOGIN in time: closed without a response, as the spec says."""
    front, client, reactor, _ = _front("ssmp", alice)
    front.dataReceived(b"LOGIN ali")
    reactor.advance(10)
    assert client.value() == b"" and client.disconnecting


def test_without_a_certificate_nothing_reaches_the_backend() -> None:
    """QMQP and stream without a client certificate identity: closed at the first byte."""
    for speaks in ("qmqp", "stream"):
        front, client, reactor, _factory = _front(speaks, None)
        front.dataReceived(b"x")
        assert client.disconnecting and client.value() == b""
        front.connectionLost(Failure(ConnectionRefusedError()))
        # The connection made in advance (for speed) is given up: nothing was held for it.
        [(_, _, wrapping, _, _)] = reactor.tcpClients
        assert wrapping._onConnection.called  # cancelled


def test_qmqp_held_until_connected_then_relayed(alice: x509.Certificate) -> None:
    """Blocks sent while the backend connects are delivered in order, then replies come back."""
    front, client, reactor, _ = _front("qmqp", alice)
    blocks = mail("m1", "a@b.example") + mail("m2", "a@b.example")
    front.dataReceived(blocks[:10])
    front.dataReceived(blocks[10:])
    backend, server = _backend(reactor)
    assert server.value() == blocks
    reply = qmqp.encode(qmqp.ReplyBlock(id=b"m1", status=qmqp.K, description=b"ok", pending=1))
    backend.dataReceived(reply)
    assert client.value() == reply


def test_qmqp_backend_down_answers_z(alice: x509.Certificate) -> None:
    """Each message block gets Z with the reason, then the done block and the close."""
    front, client, reactor, _ = _front("qmqp", alice)
    front.dataReceived(mail("m1", "a@b.example"))
    [(_, _, factory, _, _)] = reactor.tcpClients
    factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
    front.dataReceived(mail("m2", "a@b.example") + qmqp.DONE_BYTES)
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    answers = codec.receive_data(client.value())
    assert [(a.id, a.status) for a in answers[:2]] == [(b"m1", qmqp.Z), (b"m2", qmqp.Z)]  # type: ignore[union-attr]
    assert b"cannot be reached" in answers[0].description  # type: ignore[union-attr]
    assert answers[2] == qmqp.DoneBlock() and client.disconnecting


def test_client_gone_before_the_backend_answers(alice: x509.Certificate) -> None:
    """What the client sent before leaving is still delivered, then the backend is closed."""
    front, _client, reactor, _ = _front("stream", alice)
    front.dataReceived(b"frame bytes")
    front.connectionLost(Failure(ConnectionRefusedError()))
    _, server = _backend(reactor)
    assert server.value() == b"frame bytes" and server.disconnecting


def test_client_closing_closes_the_backend(alice: x509.Certificate) -> None:
    """Either side closing closes the other; the connection is no longer counted."""
    front, _client, reactor, factory = _front("stream", alice)
    front.dataReceived(b"a")
    _, server = _backend(reactor)
    assert front in factory.connections
    front.connectionLost(Failure(ConnectionRefusedError()))
    assert server.disconnecting and front not in factory.connections
