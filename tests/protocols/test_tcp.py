"""`gateway.protocols.tcp`: a refused connection is closed at once, on TCP and under TLS.

A listener past ``max_connections`` builds a `RefusedConnection` rather than
None: Twisted's TLS wrapper (``mtls:``, ``ssl:``) cannot take None (it
raised ``AttributeError`` and left the connection open for ever).
"""

from __future__ import annotations

from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer

from gateway.core.auth import Secrets
from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import ListenerFactory
from gateway.protocols.tcp import RefusedConnection
from tests.core.test_router import _sample


@implementer(ITCPTransport)
class _TCPTransport(StringTransport):
    """A StringTransport that says it is TCP and records an abort."""

    aborted = False

    def abortConnection(self) -> None:  # noqa: N802 (Twisted's name)
        """Record the abort, and close."""
        self.aborted = True
        self.loseConnection()


class _Factory(ListenerFactory[Protocol, None]):
    kind = "test"


def _full_factory(metrics: GatewayMetrics) -> _Factory:
    factory = _Factory(name="l", settings=None, secrets=Secrets(), clock=Clock(), metrics=metrics)
    factory.max_connections = 1
    factory.connection_opened(Protocol())
    return factory


def test_a_refused_connection_is_closed_when_made() -> None:
    """Closed at once, nothing written (on TCP: the orderly close a refused None got)."""
    transport = StringTransport()
    RefusedConnection().makeConnection(transport)
    assert transport.disconnecting
    assert transport.value() == b""


def test_past_max_connections_the_factory_builds_a_refused_connection() -> None:
    """Not None: a connection that closes itself, counted as too-many-connections."""
    metrics = GatewayMetrics()
    factory = _full_factory(metrics)
    assert isinstance(factory.buildProtocol(None), RefusedConnection)
    assert (
        _sample(
            metrics, "msggateway_protocol_errors_total", endpoint="l", kind="too-many-connections"
        )
        == 1
    )
    assert len(factory.connections) == 1  # the refused one is not counted open


def test_under_tls_a_refused_connection_is_closed_before_the_handshake() -> None:
    """Wrapped by Twisted's TLS factory: no error, no handshake byte, the TCP port aborted."""
    metrics = GatewayMetrics()
    tls = TLSMemoryBIOFactory(CertificateOptions(), False, _full_factory(metrics))
    transport = _TCPTransport()
    with capturedLogs() as events:
        wrapper = tls.buildProtocol(None)
        assert wrapper is not None
        wrapper.makeConnection(transport)
    assert transport.aborted
    assert transport.value() == b""
    assert not [event for event in events if event.get("log_failure") is not None]
