"""The TLS front-end's relay and SSMP LOGIN rewrite, in memory.

The client's side is a `TLSStringTransport` holding a test client
certificate; the backend connection is made through a real ``tcp:`` client
endpoint on a `MemoryReactorClock`, whose recorded connection the test
completes with another `StringTransport` (or fails).
"""

from __future__ import annotations

import pytest
from twisted.internet.endpoints import clientFromString
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IProtocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from gateway.codecs import qmqp
from gateway.core.auth import Secrets
from gateway.metrics import GatewayMetrics
from gateway.protocols.frontend.server import (
    MAX_EARLY_BYTES,
    FrontendServerFactory,
    FrontendServerProtocol,
    backend_secret,
)
from gateway.protocols.frontend.settings import FrontendSettings
from gateway.protocols.tcp import RefusedConnection
from tests.certs import issue_client_certificate, make_ca
from tests.protocols.test_ssmp_server import TLSStringTransport

CA = make_ca("front-end test CA")
ALICE = issue_client_certificate(CA, "alice", dns_names=["alice.example.org"]).certificate
SECRETS = {"alice": b"alice-secret", "alice.example.org": b"dns-secret"}


class Link:
    """One front-end connection: the factory, the client's transport, the reactor."""

    def __init__(
        self,
        speaks: str,
        *,
        certificate: bool = True,
        secrets: dict[str, bytes] | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.reactor = MemoryReactorClock()
        settings = FrontendSettings(
            speaks=speaks, backend="tcp:host=10.0.0.1:port=7000", handshake_timeout_seconds=5.0
        )
        self.factory = FrontendServerFactory(
            name="front",
            settings=settings,
            backend=clientFromString(self.reactor, settings.backend),
            secrets=Secrets(frontends={"front": SECRETS if secrets is None else secrets}),
            clock=self.reactor,
            metrics=metrics,
        )
        protocol = self.factory.buildProtocol(None)
        assert isinstance(protocol, FrontendServerProtocol)
        self.front = protocol
        self.client = TLSStringTransport(ALICE if certificate else None)
        self.front.makeConnection(self.client)
        self.backend: StringTransport | None = None
        self.backend_protocol: IProtocol | None = None

    def handshake(self) -> None:
        """The TLS handshake completes."""
        self.front.handshakeCompleted()

    def connects(self) -> int:
        """How many backend connections were asked for."""
        return len(self.reactor.tcpClients)

    def accept(self) -> StringTransport:
        """The backend accepts the connection asked for."""
        host, port, factory, _, _ = self.reactor.tcpClients[-1]
        assert (host, port) == ("10.0.0.1", 7000)
        protocol = factory.buildProtocol(None)
        self.backend = StringTransport()
        self.backend_protocol = protocol
        protocol.makeConnection(self.backend)
        return self.backend

    def refuse(self) -> None:
        """The backend refuses the connection asked for."""
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))

    def backend_says(self, data: bytes) -> None:
        """Bytes from the backend."""
        assert self.backend_protocol is not None
        self.backend_protocol.dataReceived(data)


def test_backend_secret_lookup_order() -> None:
    """The identity's own secret, else its certificate name's (longest), else ``*``."""
    names = frozenset({"alice", "alice/team"})
    table = {"alice": b"a", "alice/team": b"t", "*": b"shared"}
    assert backend_secret(table, "alice", names) == b"a"
    assert backend_secret(table, "alice/team/phone", names) == b"t"
    assert backend_secret({"alice": b"a"}, "alice/phone", names) == b"a"
    assert backend_secret({"*": b"shared"}, "alice/phone", names) == b"shared"
    assert backend_secret({"bob": b"b"}, "alice", names) is None


@pytest.mark.parametrize("speaks", ["qmqp", "stream"])
def test_relay_is_byte_for_byte_both_ways(speaks: str) -> None:
    """After the handshake one backend connection opens; all bytes pass unchanged."""
    link = Link(speaks)
    link.handshake()
    assert link.connects() == 1
    assert link.client.producerState == "paused"  # nothing more read until the backend is up
    link.front.dataReceived(b"early ")
    backend = link.accept()
    assert backend.value() == b"early "
    assert link.client.producerState == "producing"
    link.front.dataReceived(b"\x00later\xff")
    assert backend.value() == b"early \x00later\xff"
    link.backend_says(b"reply \x00 bytes")
    assert link.client.value() == b"reply \x00 bytes"
    assert (link.factory.traffic.bytes_in, link.factory.traffic.bytes_out) == (13, 13)
    assert link.front.identity == "alice"


def test_flow_control_pauses_each_side_for_the_other() -> None:
    """Each transport is the other's streaming producer: a full buffer pauses the far reader."""
    link = Link("qmqp")
    link.handshake()
    backend = link.accept()
    assert link.client.producer is backend and link.client.streaming
    assert backend.producer is link.client and backend.streaming


def test_backend_close_closes_the_client_and_back() -> None:
    """Either side closing closes the other."""
    link = Link("stream")
    link.handshake()
    link.accept()
    assert link.backend_protocol is not None
    link.backend_protocol.connectionLost(Failure(ConnectionRefusedError()))
    assert link.client.disconnecting
    other = Link("stream")
    other.handshake()
    other_backend = other.accept()
    other.front.connectionLost(Failure(ConnectionRefusedError()))
    assert other_backend.disconnecting
    assert other.factory.connections == set()


def test_client_leaving_while_connecting_cancels_the_backend() -> None:
    """A client gone before the backend answered stops the connection attempt."""
    link = Link("qmqp")
    link.handshake()
    link.front.connectionLost(Failure(ConnectionRefusedError()))
    assert link.reactor.connectors[-1].stoppedConnecting
    assert link.factory.connections == set()


def test_no_client_certificate_is_closed_without_a_backend() -> None:
    """A TLS client without a verified certificate is closed; no backend connection is opened."""
    link = Link("qmqp", certificate=False)
    link.handshake()
    assert link.client.disconnecting
    assert link.connects() == 0


def test_handshake_timeout_closes() -> None:
    """No handshake (or no SSMP LOGIN) within the time-out: the connection is closed."""
    link = Link("ssmp")
    link.handshake()
    link.reactor.advance(4.9)
    assert not link.client.disconnecting
    link.reactor.advance(0.2)
    assert link.client.disconnecting
    assert link.connects() == 0


def test_ssmp_login_is_rewritten_one_byte_at_a_time() -> None:
    """``LOGIN alice cert`` becomes a secret login; what follows is relayed verbatim."""
    link = Link("ssmp")
    link.handshake()
    assert link.connects() == 0  # SSMP waits for the LOGIN line
    data = b"LOGIN alice cert\nSUBSCRIBE t\nMCAST t x\n"
    for index in range(len(data)):
        link.front.dataReceived(data[index : index + 1])
        if link.connects():
            break
    assert link.connects() == 1
    link.front.dataReceived(data[index + 1 :])
    backend = link.accept()
    assert backend.value() == b"LOGIN alice secret alice-secret\nSUBSCRIBE t\nMCAST t x\n"
    link.reactor.advance(10)
    assert not link.client.disconnecting  # the LOGIN time-out was cancelled
    link.backend_says(b"200\n")
    assert link.client.value() == b"200\n"


def test_ssmp_login_with_a_san_and_a_suffix_uses_that_names_secret() -> None:
    """``alice.example.org/phone`` logs in with the secret of the SAN it extends."""
    link = Link("ssmp")
    link.factory.cert_identity = ("cn", "dns")
    link.handshake()
    link.front.dataReceived(b"LOGIN alice.example.org/phone cert\n")
    assert link.accept().value() == b"LOGIN alice.example.org/phone secret dns-secret\n"


def test_ssmp_login_as_a_san_is_refused_by_default() -> None:
    """Without ``dns`` in the listener's ``cert_identity`` a DNS SAN is no login name."""
    link = Link("ssmp")
    link.handshake()
    link.front.dataReceived(b"LOGIN alice.example.org cert\n")
    assert link.client.value() == b"401 cert\n"
    assert link.connects() == 0


@pytest.mark.parametrize(
    ("line", "reply"),
    [
        (b"SUBSCRIBE t\n", b"400 the first request must be LOGIN\n"),
        (b"LOGIN alice secret s3cret\n", b"401 cert\n"),
        (b"LOGIN bob cert\n", b"401 cert\n"),
        (b"LOGIN alice\n", b"400 LOGIN needs an identifier and a scheme\n"),
        (b"LOGIN " + b"a" * 1100, b"400 line is over SSMP's 1024-byte limit\n"),
    ],
)
def test_ssmp_bad_logins_are_answered_and_closed(line: bytes, reply: bytes) -> None:
    """A bad first line gets the spec's 400 or 401 and a close, and no backend connection."""
    link = Link("ssmp")
    link.handshake()
    link.front.dataReceived(line)
    assert link.client.value() == reply
    assert link.client.disconnecting
    assert link.connects() == 0


def test_ssmp_without_a_backend_secret_is_401() -> None:
    """A certificate name with no backend secret configured is refused ``401 cert``."""
    link = Link("ssmp", secrets={})
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\n")
    assert link.client.value() == b"401 cert\n"
    assert link.connects() == 0


def test_ssmp_backend_unreachable_is_401() -> None:
    """A backend that refuses the connection: the client's LOGIN gets ``401 cert``, then a close."""
    link = Link("ssmp")
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\n")
    link.refuse()
    assert link.client.value() == b"401 cert\n"
    assert link.client.disconnecting


def test_qmqp_backend_unreachable_answers_z_per_block() -> None:
    """A backend that cannot be reached: each block gets Z with its id, the done block DONE."""
    link = Link("qmqp")
    link.handshake()
    block = qmqp.encode(
        qmqp.MessageBlock(id=b"m1", message=b"x\n", sender=b"a@b", recipients=(b"c@d",))
    )
    link.front.dataReceived(block)
    link.refuse()
    link.front.dataReceived(
        qmqp.encode(qmqp.MessageBlock(id=b"m2", message=b"y\n", sender=b"", recipients=(b"e@f",)))
        + qmqp.DONE_BYTES
    )
    replies = qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(link.client.value())
    assert [(r.id, r.status) for r in replies if isinstance(r, qmqp.ReplyBlock)] == [
        (b"m1", b"Z"),
        (b"m2", b"Z"),
    ]
    assert replies[-1] == qmqp.DONE
    assert link.client.disconnecting


def test_stream_backend_unreachable_closes() -> None:
    """The stream protocol has no word before its handshake: the connection is closed."""
    link = Link("stream")
    link.handshake()
    link.refuse()
    assert link.client.value() == b""
    assert link.client.disconnecting


def test_backend_connect_timeout() -> None:
    """A backend that does not answer within ``connect_timeout_seconds`` counts as unreachable."""
    link = Link("stream")
    link.handshake()
    link.reactor.advance(9.9)
    assert not link.client.disconnecting
    link.reactor.advance(0.2)
    assert link.client.disconnecting


def test_early_bytes_are_bounded() -> None:
    """Past ``MAX_EARLY_BYTES`` held while connecting, the client is closed."""
    link = Link("stream")
    link.handshake()
    link.front.dataReceived(b"x" * (MAX_EARLY_BYTES + 1))
    assert link.client.disconnecting


def test_connections_and_refusals_are_counted() -> None:
    """Open connections and refusals by kind appear in the listener's metrics."""
    metrics = GatewayMetrics()
    link = Link("ssmp", metrics=metrics)

    def sample(name: str, labels: dict[str, str]) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("msggateway_connections", {"endpoint": "front", "protocol": "frontend"}) == 1.0
    link.handshake()
    link.front.dataReceived(b"LOGIN mallory cert\n")
    link.front.connectionLost(Failure(ConnectionRefusedError()))
    assert sample("msggateway_connections", {"endpoint": "front", "protocol": "frontend"}) == 0.0
    errors = {"endpoint": "front", "kind": "login-refused"}
    assert sample("msggateway_protocol_errors_total", errors) == 1.0


def test_max_connections_is_respected() -> None:
    """Past ``max_connections`` open clients, a new connection is closed before any byte."""
    link = Link("qmqp")
    link.factory.max_connections = 1
    refused = link.factory.buildProtocol(None)
    assert isinstance(refused, RefusedConnection)
    transport = StringTransport()
    refused.makeConnection(transport)
    assert transport.disconnecting
    assert transport.value() == b""


def test_the_backends_answer_to_login_passes_split_anywhere() -> None:
    """The backend's ``200`` and what follows reach the client unchanged, however split."""
    link = Link("ssmp")
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\n")
    link.accept()
    link.backend_says(b"20")
    assert link.client.value() == b""
    link.backend_says(b"0\n000 bob MCAST t x\n")
    link.backend_says(b"401 later lines are not touched\n")
    assert link.client.value() == b"200\n000 bob MCAST t x\n401 later lines are not touched\n"


def test_a_backend_refusal_of_the_login_becomes_401_cert() -> None:
    """The backend's ``401 secret`` (its schemes) is answered ``401 cert`` (the front-end's)."""
    metrics = GatewayMetrics()
    link = Link("ssmp", metrics=metrics)
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\n")
    link.accept()
    link.backend_says(b"401 secret\n")
    assert link.client.value() == b"401 cert\n"
    errors = {"endpoint": "front", "kind": "backend-refused-login"}
    assert metrics.registry.get_sample_value("msggateway_protocol_errors_total", errors) == 1.0


def test_backend_secrets_follow_a_reload() -> None:
    """After the secrets file is reloaded (SIGHUP), new logins present the new secret."""
    link = Link("ssmp")
    link.factory.secrets.update(Secrets(frontends={"front": {"*": b"reloaded"}}))
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\n")
    assert link.accept().value() == b"LOGIN alice secret reloaded\n"


@pytest.mark.parametrize("speaks", ["ssmp", "qmqp"])
def test_max_connections_per_identity(speaks: str) -> None:
    """Past the per-identity limit a second client of the same name is refused, no backend."""
    first = Link(speaks)
    first.factory.max_connections_per_identity = 1
    first.handshake()
    if speaks == "ssmp":
        first.front.dataReceived(b"LOGIN alice cert\n")
    assert first.connects() == 1
    second = first.factory.buildProtocol(None)
    assert isinstance(second, FrontendServerProtocol)
    client = TLSStringTransport(ALICE)
    second.makeConnection(client)
    second.handshakeCompleted()
    if speaks == "ssmp":
        second.dataReceived(b"LOGIN alice cert\n")
        assert client.value() == b"401 cert\n"
    assert client.disconnecting
    assert first.connects() == 1
    first.front.connectionLost(Failure(ConnectionRefusedError()))
    third = first.factory.buildProtocol(None)
    assert isinstance(third, FrontendServerProtocol)
    third.makeConnection(TLSStringTransport(ALICE))
    third.handshakeCompleted()
    if speaks == "ssmp":
        third.dataReceived(b"LOGIN alice cert\n")
    assert first.connects() == 2  # the first one's count was released


def test_what_a_client_said_before_leaving_is_delivered() -> None:
    """A client gone while the backend connects: its bytes go to the backend, which is closed."""
    link = Link("ssmp")
    link.handshake()
    link.front.dataReceived(b"LOGIN alice cert\nMCAST t bye\nCLOSE\n")
    link.front.connectionLost(Failure(ConnectionRefusedError()))
    assert not link.reactor.connectors[-1].stoppedConnecting
    backend = link.accept()
    assert backend.value() == b"LOGIN alice secret alice-secret\nMCAST t bye\nCLOSE\n"
    assert backend.disconnecting


def test_a_half_sent_login_line_is_aborted_at_the_frame_time_out() -> None:
    """Part of the SSMP LOGIN line and nothing more: aborted at ``frame_timeout_seconds``."""
    metrics = GatewayMetrics()
    link = Link("ssmp", metrics=metrics)
    link.factory.frame_timeout_seconds = 2.0  # shorter than the handshake time-out (5 s)
    link.handshake()
    link.front.dataReceived(b"LOGIN ali")
    link.reactor.advance(1.9)
    assert not link.client.disconnecting
    link.reactor.advance(0.1)
    assert link.client.disconnected
    assert link.connects() == 0
    errors = {"endpoint": "front", "kind": "frame-timeout"}
    assert metrics.registry.get_sample_value("msggateway_protocol_errors_total", errors) == 1.0


def test_a_client_that_does_not_read_its_refusals_is_not_read() -> None:
    """Backend unreachable, QMQP: while the client's transport is full, its blocks wait."""
    link = Link("qmqp")
    link.handshake()
    link.refuse()
    assert link.client.producer is link.front
    link.front.pauseProducing()  # as the transport does when Z replies pile up
    assert link.client.producerState == "paused"
    link.front.resumeProducing()
    assert link.client.producerState == "producing"
