"""`ListenerFactory`: connections per identity, and the open-connections gauge."""

from __future__ import annotations

from twisted.internet.protocol import Protocol

from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import ListenerFactory
from tests.core.test_router import _sample


class _Factory(ListenerFactory[Protocol]):
    kind = "test"


def _open(metrics: GatewayMetrics) -> float:
    return _sample(metrics, "msggateway_connections", endpoint="l", protocol="test")


def test_identity_limit_and_release() -> None:
    """Past the limit an identity is refused; closing or replacing a connection frees a place."""
    metrics = GatewayMetrics()
    factory = _Factory("l", metrics)
    factory.max_connections_per_identity = 2
    one, two, three = Protocol(), Protocol(), Protocol()
    for connection in (one, two, three):
        factory.connection_opened(connection)
    assert factory.admit(one, "alice") and factory.admit(two, "alice")
    assert factory.admit(one, "alice")  # already counted: not twice
    assert not factory.admit(three, "alice")
    assert factory.admit(three, None)  # no identity, no limit
    assert (
        _sample(
            metrics,
            "msggateway_protocol_errors_total",
            endpoint="l",
            kind="too-many-connections-per-identity",
        )
        == 1
    )
    factory.release(two)  # being replaced (an SSMP login with the same identifier)
    assert factory.admit(three, "alice")
    assert _open(metrics) == 3  # releasing an identity does not close a connection
    factory.connection_closed(two)  # its identity was already released
    factory.connection_closed(one)
    assert _open(metrics) == 1
    assert factory.admit(Protocol(), "alice")
