"""`gateway.fleet.backbone`: the node's AMQP 0-9-1 connection, without a broker.

What needs a broker (confirms, returns, reconnection) is in
tests/integration/test_fleet_backbone.py and test_fleet_hub.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from pika.adapters.twisted_connection import TwistedProtocolConnection
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from zope.interface.verify import verifyObject

from gateway.core.interfaces import IBackbone
from gateway.fleet.backbone import Backbone, Published, make_backbone, reconnect_delay
from gateway.metrics import GatewayMetrics


def backbone(reactor: MemoryReactorClock) -> Backbone:
    """A backbone for two endpoints on a memory reactor."""
    return make_backbone(
        node="n1",
        endpoints=["tcp:host=r1:port=5672", "tcp:host=r2:port=5672"],
        vhost="/",
        heartbeat_seconds=10,
        username=None,
        password=None,
        reactor=reactor,
        metrics=GatewayMetrics(),
    )


def test_it_provides_the_interface() -> None:
    """The backbone is an `IBackbone`."""
    assert verifyObject(IBackbone, backbone(MemoryReactorClock()))


def test_pika_still_has_what_the_backbone_uses() -> None:
    """The pika Connection behind the Twisted adapter, and its callbacks, are still there."""
    protocol = TwistedProtocolConnection(None, custom_reactor=Clock())
    connection = protocol._impl
    for name in (
        "channel",
        "add_on_connection_blocked_callback",
        "add_on_connection_unblocked_callback",
        "add_on_open_error_callback",
    ):
        assert callable(getattr(connection, name)), name


@pytest.mark.parametrize(
    ("attempt", "endpoints", "delay"),
    [(0, 3, 0.0), (2, 3, 0.0), (3, 3, 0.25), (6, 3, 0.5), (9, 3, 1.0), (300, 3, 5.0), (1, 1, 0.25)],
)
def test_reconnect_delay(attempt: int, endpoints: int, delay: float) -> None:
    """Every endpoint once at once, then rounds twice as far apart, up to 5 s."""
    assert reconnect_delay(attempt, endpoints) == delay


def test_endpoints_are_tried_in_turn() -> None:
    """It connects to the first endpoint, then the next when that fails."""
    reactor = MemoryReactorClock()
    node = backbone(reactor)
    node.start()
    assert [(host, port) for host, port, *_ in reactor.tcpClients] == [("r1", 5672)]
    connector: Any = None
    reactor.tcpClients[0][2].clientConnectionFailed(connector, Failure(ConnectionRefusedError()))
    reactor.advance(0)
    assert [host for host, *_ in reactor.tcpClients] == ["r1", "r2"]
    assert node.lost_since == 0.0
    node.stop()


def test_without_a_connection_publishing_is_dropped_and_counted() -> None:
    """No connection: publish says False, the result is lost, the drop is counted."""
    node = backbone(MemoryReactorClock())
    results: list[Published] = []
    assert not node.publish("x", "k", b"b", kind="t", on_result=results.append)
    assert results == [Published.LOST]
    assert node.stats.dropped == 1


def test_bindings_are_kept_while_disconnected() -> None:
    """Bindings asked for without a connection are remembered for the next one."""
    node = backbone(MemoryReactorClock())
    node.bind("x", "a")
    node.bind("x", "b")
    node.unbind("x", "a")
    assert node.bindings() == 1
    called: list[bool] = []
    node.when_bound(lambda: called.append(True))
    assert called == []  # after the next connection's declarations
