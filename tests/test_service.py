"""A clean stop of the assembled gateway (`gateway.service.GatewayService.stopService`).

The gateway is built from a real configuration on a `MemoryReactorClock`;
a QMQP connection is made by hand on an in-memory transport, and its one
route delivers to a destination whose answer the test gives (or never
gives). The drain: reading stops, what was read is answered, connections
half-close after their answers, and ``shutdown_grace_seconds`` bounds it
all, with one line at its start and one at its end, none critical.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import qmqp
from gateway.config import load_config
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import BoundRoute, DirectDelivery, RouteTable
from gateway.protocols.listener import ListenerConnection
from gateway.service import GatewayService, build_gateway
from tests.protocols.test_listener import _TCPTransport

GRACE_SECONDS = 5.0
CONFIG = f"""
[gateway]
shutdown_grace_seconds = {GRACE_SECONDS}

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"

[routes.mail]
from = "mail"
match = "#@example.org"
to = "hub"
"""


@implementer(IDestination)
class _Held:
    """A destination that answers when the test says."""

    name = "hub"

    def __init__(self) -> None:
        self.held: list[tuple[int, Deferred[list[Outcome]]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hold the batch."""
        d: Deferred[list[Outcome]] = Deferred()
        self.held.append((len(messages), d))
        return d

    def accept_all(self) -> None:
        """Accept every batch held."""
        for count, d in self.held:
            d.callback([Outcome.accepted()] * count)


class _Running:
    """A started gateway, its reactor, its held destination and one QMQP connection."""

    def __init__(self, directory: Path) -> None:
        (directory / "gateway.toml").write_text(CONFIG)
        self.reactor = MemoryReactorClock()
        self.gateway: GatewayService = build_gateway(
            load_config(directory / "gateway.toml"), self.reactor, node="test"
        )
        self.gateway.startService()
        self.hub = _Held()
        [route] = self.gateway.router.table.routes
        self.gateway.router.replace_table(
            RouteTable([BoundRoute(route.route, DirectDelivery(self.hub))])
        )
        factory = self.gateway.listeners()["mail"].factory
        connection = factory.buildProtocol(None)
        assert isinstance(connection, ListenerConnection)
        self.connection = connection
        self.transport = _TCPTransport()
        connection.makeConnection(self.transport)

    def send(self, *ids: bytes) -> None:
        """Stream message blocks, as a QMQP client does."""
        blocks = (
            qmqp.MessageBlock(
                id=block_id, message=b"hi", sender=b"a@example.org", recipients=(b"b@example.org",)
            )
            for block_id in ids
        )
        self.connection.dataReceived(b"".join(map(qmqp.encode, blocks)))

    def replies(self) -> list[qmqp.Block]:
        """What the client was answered."""
        return qmqp.QMQPCodec(qmqp.Role.CLIENT).receive_data(self.transport.value())


@pytest.fixture
def running(tmp_path: Path) -> Iterator[_Running]:
    """A started gateway with one QMQP connection."""
    yield _Running(tmp_path)


def _levels(events: list[dict[str, object]]) -> list[LogLevel]:
    return [event["log_level"] for event in events if "log_level" in event]  # type: ignore[misc]


def test_the_stop_answers_what_was_read_then_closes_after_the_answers(running: _Running) -> None:
    """Read before the stop: answered K, then the half-close; the stop ends when the peer goes.

    A read that comes after the stop began (a TLS record already decrypted)
    is not routed: it is answered retry later at once.
    """
    running.send(b"m1", b"m2")
    with capturedLogs() as events:
        stopped = running.gateway.stopService()
        assert running.transport.producerState == "paused"  # reading stopped at once
        running.send(b"m3")  # a read already under way (a TLS record): told to retry
        running.reactor.advance(1)
        assert not running.transport.write_closed
        running.hub.accept_all()
        replies = running.replies()
        assert [(r.id, r.status) for r in replies] == [  # type: ignore[union-attr]
            (b"m3", qmqp.Z),
            (b"m1", qmqp.K),
            (b"m2", qmqp.K),
        ]
        assert b"the gateway is stopping" in replies[0].description  # type: ignore[union-attr]
        assert running.transport.write_closed  # after its answers
        assert not stopped.called
        running.connection.connectionLost(Failure(ConnectionDone()))
        assert stopped.called
    lines = [str(event.get("log_format")) for event in events]
    assert any(line.startswith("msggateway stopping:") for line in lines), lines
    assert any(line.startswith("msggateway drained in") for line in lines), lines
    assert LogLevel.critical not in _levels(events)
    assert len(running.hub.held) == 1  # m3 never reached the route


def test_the_grace_bounds_the_stop_and_its_end_says_what_was_left(running: _Running) -> None:
    """No answer and a peer that stays: the stop ends at the grace with a warning, not critical."""
    running.send(b"m1")
    with capturedLogs() as events:
        stopped = running.gateway.stopService()
        running.reactor.advance(GRACE_SECONDS - 0.1)
        assert not running.transport.write_closed
        running.reactor.advance(0.1)
        assert running.transport.write_closed  # closed unanswered: the sender retries
        running.reactor.advance(0)
        assert stopped.called
    warnings = [event for event in events if event.get("log_level") is LogLevel.warn]
    assert len(warnings) == 1
    assert warnings[0]["batches"] == 1
    assert warnings[0]["open"] == 1
    assert LogLevel.critical not in _levels(events)
    assert running.replies() == []
