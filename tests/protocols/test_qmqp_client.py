"""In-memory tests of the QMQP streaming upstream: `gateway.protocols.qmqp.client`.

Most tests drive `QMQPClientProtocol` connections of one `QMQPUpstream` over
`StringTransport`s, playing the server by hand: what the client wrote is
decoded with the server-role codec, replies are encoded with `qmqp.encode`.
Time is a `MemoryReactorClock`; the upstream's `ClientService` is never
started, so each test makes (and loses) connections itself. The last test
pairs our client with our own `QMQPServerProtocol` through
`twisted.test.iosim`. The behaviour checked is the module's docstring, the
settings' and docs/protocols/qmqp.rst.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import qmqp
from gateway.codecs.framing import encode_netstrings
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.batch import UNANSWERED
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, RouteTable, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.qmqp.client import QMQPClientProtocol, QMQPUpstream
from gateway.protocols.qmqp.server import QMQPServerFactory
from gateway.protocols.qmqp.settings import QMQPListenerSettings, QMQPUpstreamSettings
from tests.protocols.test_ssmp_server import TLSStringTransport

T = TypeVar("T")

UPSTREAM = "relay"
FEED = "feed"
SECRET = b"s3cret"
SETTINGS = QMQPUpstreamSettings(
    window=3,
    max_queue=100,
    max_attempts=4,
    retry_initial_seconds=1.0,
    retry_max_seconds=3.0,
)
ROUTE_TIMEOUT_SECONDS = 20.0
OUTBOUND = Route(
    name="outbound",
    source=FEED,
    pattern=AddressPattern("#"),
    destination=UPSTREAM,
    timeout_seconds=ROUTE_TIMEOUT_SECONDS,
)
"""Everything arriving at ``feed`` goes to the upstream."""


# --- helpers ---------------------------------------------------------------------------------


class WriteCountingTransport(StringTransport):
    """A `StringTransport` that also keeps each write apart, to count them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Keep the write, then buffer it as StringTransport does."""
        self.writes.append(data)
        super().write(data)  # type: ignore[no-untyped-call]


class Connection:
    """One client connection, with the test playing the server."""

    def __init__(self, protocol: QMQPClientProtocol, transport: WriteCountingTransport) -> None:
        self.protocol = protocol
        self.transport = transport
        self._codec = qmqp.QMQPCodec(qmqp.Role.SERVER)

    def sent(self) -> list[qmqp.Block]:
        """Decode the blocks the client wrote since the last call."""
        data: bytes = self.transport.value()  # type: ignore[no-untyped-call]
        self.transport.clear()  # type: ignore[no-untyped-call]
        return self._codec.receive_data(data)

    def sent_ids(self) -> list[bytes]:
        """The ids of the message blocks written since the last call, in order."""
        ids: list[bytes] = []
        for block in self.sent():
            assert isinstance(block, qmqp.MessageBlock), block
            ids.append(block.id)
        return ids

    def server_says(self, data: bytes) -> None:
        """Deliver bytes from the server, as the reactor would."""
        self.protocol.dataReceived(data)

    def answer(self, block_id: bytes, result: bytes, pending: int = 0) -> None:
        """Send one reply: ``result`` is the status byte and its description."""
        self.server_says(
            qmqp.encode(
                qmqp.ReplyBlock(
                    id=block_id, status=result[:1], description=result[1:], pending=pending
                )
            )
        )

    def lose(self) -> None:
        """Simulate the connection going away (after a close, or not)."""
        self.protocol.connectionLost(Failure(ConnectionLost("gone")))


class UpstreamWorld:
    """One QMQP upstream with a router feeding it, a clock and metrics."""

    def __init__(self, settings: QMQPUpstreamSettings = SETTINGS) -> None:
        self.clock = MemoryReactorClock()
        self.metrics = GatewayMetrics()
        self.upstream = QMQPUpstream(
            name=UPSTREAM,
            settings=settings,
            endpoint=TCP4ClientEndpoint(self.clock, "relay.example", 628),
            secrets=Secrets(upstreams={UPSTREAM: SECRET}),
            clock=self.clock,
            metrics=self.metrics,
        )
        self.router = Router(
            bind_routes([OUTBOUND], {UPSTREAM: self.upstream}), self.clock, self.metrics
        )

    def connect(self) -> Connection:
        """Open a connection, as the ClientService would."""
        protocol = QMQPClientProtocol(self.upstream)
        transport = WriteCountingTransport()
        protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
        return Connection(protocol, transport)

    def deliver(self, name: str, *recipients: str) -> Deferred[Outcome]:
        """Deliver a batch of one message with id ``name``; the Deferred fires with its outcome.

        Cancelling it cancels the batch (as the router's deadline does).
        """
        return self.upstream.deliver([letter(name, *recipients)]).addCallback(only)

    def batch(self, *names: str) -> Deferred[list[Outcome]]:
        """Deliver one batch of messages with these ids straight to the upstream."""
        return self.upstream.deliver([letter(name) for name in names])

    def sample(self, name: str, **labels: str) -> float:
        """Return a metric's current value (0 when it was never set)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def letter(name: str, *recipients: str) -> Message:
    """A mail message with id ``name``."""
    return Message(
        body=b"Subject: " + name.encode() + b"\n\nhello\n",
        address=(recipients or ("ops@example.org",))[0],
        id=name,
        sender="app@example.org",
        recipients=recipients or ("ops@example.org",),
    )


def only(outcomes: list[Outcome]) -> Outcome:
    """The one outcome of a batch of one."""
    [outcome] = outcomes
    return outcome


def fired(deferred: Deferred[T]) -> T:
    """Return the result of a Deferred that must already have fired successfully."""
    results: list[T | Failure] = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


def tracked(deferred: Deferred[T]) -> list[T | Failure]:
    """Collect every result the Deferred fires with (a Deferred fires once, at most)."""
    results: list[T | Failure] = []
    deferred.addBoth(results.append)
    return results


@pytest.fixture
def world() -> UpstreamWorld:
    """An upstream without authentication: window 3, 4 attempts, resends after 1 s to 3 s."""
    return UpstreamWorld()


# --- connecting ----------------------------------------------------------------------------------


def test_upstream_provides_idestination(world: UpstreamWorld) -> None:
    """The upstream is a real IDestination named after its config entry."""
    assert verifyObject(IDestination, world.upstream)
    assert world.upstream.name == UPSTREAM


def test_without_username_the_connection_is_ready_at_once(world: UpstreamWorld) -> None:
    """Without ``username`` nothing is sent on connect and the upstream is connected."""
    assert not world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 0
    connection = world.connect()
    assert connection.sent() == []
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 1
    assert world.sample("msggateway_connections", endpoint=UPSTREAM, protocol="qmqp") == 1

    connection.lose()
    assert not world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 0
    assert world.sample("msggateway_connections", endpoint=UPSTREAM, protocol="qmqp") == 0


def test_over_tls_without_username_the_connection_is_ready_once_tls_is_up(
    world: UpstreamWorld,
) -> None:
    """Over TLS, nothing tells that the server verified before the handshake: not ready till then.

    A failed handshake (the transport ends first) is then no ready connection,
    and the back-off is not reset by it.
    """
    protocol = QMQPClientProtocol(world.upstream)
    protocol.makeConnection(TLSStringTransport(None))
    assert not world.upstream.connected
    protocol.handshakeCompleted()
    assert world.upstream.connected
    protocol.connectionLost(Failure(ConnectionLost("gone")))

    failed = QMQPClientProtocol(world.upstream)
    failed.makeConnection(TLSStringTransport(None))
    failed.connectionLost(Failure(ConnectionLost("handshake failed")))
    assert not world.upstream.connected


def test_protocol_is_a_push_producer_on_its_transport(world: UpstreamWorld) -> None:
    """The connection registers itself as a streaming producer with its transport."""
    connection = world.connect()
    assert verifyObject(IPushProducer, connection.protocol)
    assert connection.transport.producer is connection.protocol
    assert connection.transport.streaming


def test_nothing_is_sent_while_the_server_does_not_read(world: UpstreamWorld) -> None:
    """When the transport pauses us nothing more is written; resuming sends what waited."""
    connection = world.connect()
    connection.protocol.pauseProducing()
    world.deliver("m1")
    world.deliver("m2")
    assert connection.sent() == []
    connection.protocol.resumeProducing()
    assert [block_id.split(b".")[0] for block_id in connection.sent_ids()] == [b"m1", b"m2"]


def test_message_block_carries_the_envelope(world: UpstreamWorld) -> None:
    """A message becomes one M block: an id from the message id, body, sender, recipients."""
    connection = world.connect()
    world.deliver("m1", "a@example.org", "b@example.org")
    [block] = connection.sent()
    assert isinstance(block, qmqp.MessageBlock)
    assert block.id.startswith(b"m1.")
    assert block.message == b"Subject: m1\n\nhello\n"
    assert block.sender == b"app@example.org"
    assert block.recipients == (b"a@example.org", b"b@example.org")


def test_messages_queued_while_disconnected_stream_in_order_on_connect(
    world: UpstreamWorld,
) -> None:
    """Messages delivered before a connection are sent on connect, FIFO, in one write."""
    for name in ("m1", "m2", "m3"):
        world.deliver(name)
    writes: list[bytes] = []
    protocol = QMQPClientProtocol(world.upstream)
    transport = StringTransport()
    transport.write = writes.append  # type: ignore[method-assign]
    protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
    assert len(writes) == 1
    blocks = qmqp.QMQPCodec(qmqp.Role.SERVER).receive_data(writes[0])
    names = [b.id.split(b".")[0] for b in blocks if isinstance(b, qmqp.MessageBlock)]
    assert names == [b"m1", b"m2", b"m3"]
    assert len(blocks) == 3


# --- window, queue and replies ------------------------------------------------------------------


def test_window_bounds_unanswered_messages(world: UpstreamWorld) -> None:
    """At most ``window`` messages are unanswered; each reply lets the next one go, FIFO."""
    connection = world.connect()
    outcomes = [world.deliver(f"m{i}") for i in range(5)]
    sent = connection.sent_ids()
    assert [block_id.split(b".")[0] for block_id in sent] == [b"m0", b"m1", b"m2"]
    assert world.upstream.unanswered == 5

    connection.answer(sent[1], b"K")
    [fourth] = connection.sent_ids()
    assert fourth.startswith(b"m3.")
    assert fired(outcomes[1]) == Outcome.accepted()
    assert not outcomes[0].called

    connection.answer(sent[0], b"K", pending=1)
    [fifth] = connection.sent_ids()
    assert fifth.startswith(b"m4.")


def test_replies_are_matched_by_id_in_any_order(world: UpstreamWorld) -> None:
    """Replies out of order reach the right messages: K accepted, D rejected with the reason."""
    connection = world.connect()
    first, second, third = (world.deliver(name) for name in ("m1", "m2", "m3"))
    ids = connection.sent_ids()
    connection.server_says(
        qmqp.encode(
            qmqp.ReplyBlock(id=ids[2], status=qmqp.D, description=b"no such user", pending=2)
        )
        + qmqp.encode(qmqp.ReplyBlock(id=ids[0], status=qmqp.K, description=b"ok", pending=1))
    )
    assert not second.called
    assert fired(first) == Outcome.accepted()
    rejected = fired(third)
    assert rejected.status is Status.REJECTED
    assert rejected.reason == "relay answered D: no such user"
    assert rejected.code == "D"
    connection.answer(ids[1], b"K")
    assert fired(second).is_accepted


def test_unknown_reply_id_is_ignored(world: UpstreamWorld) -> None:
    """A reply for an id never sent changes nothing and keeps the connection."""
    connection = world.connect()
    outcome = world.deliver("m1")
    connection.sent()
    connection.answer(b"never-sent", b"K")
    assert not outcome.called
    assert not connection.transport.disconnecting


def test_full_queue_is_retry_at_once() -> None:
    """Past ``max_queue`` waiting messages a delivery is "retry later" at once, never queued."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=2, max_queue=2))
    waiting = [world.deliver(f"m{i}") for i in range(2)]
    refused = fired(world.deliver("m2"))
    assert refused.status is Status.RETRY
    assert "2 messages queued already" in refused.reason
    assert not any(d.called for d in waiting)

    connection = world.connect()  # the window takes both; the queue has room again
    assert len(connection.sent_ids()) == 2
    more = [world.deliver(f"n{i}") for i in range(2)]
    assert not any(d.called for d in more)
    assert connection.sent_ids() == []  # waiting for the window
    assert fired(world.deliver("n2")).status is Status.RETRY


def test_messages_waiting_for_a_resend_count_against_the_queue() -> None:
    """Messages waiting to be resent after Z take queue room, so memory stays bounded."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=2, max_queue=2))
    connection = world.connect()
    world.deliver("m0")
    world.deliver("m1")
    for block_id in connection.sent_ids():
        connection.answer(block_id, b"Zbusy")
    assert fired(world.deliver("m2")).status is Status.RETRY


# --- Z: resend with backoff ----------------------------------------------------------------------


def test_z_is_resent_with_doubling_delay_then_retry(world: UpstreamWorld) -> None:
    """Z: resent after 1 s, 2 s, then 3 s (capped); the 4th Z is a retry outcome."""
    connection = world.connect()
    outcome = world.deliver("m1")
    [block_id] = connection.sent_ids()
    for delay in (1.0, 2.0, 3.0):
        connection.answer(block_id, b"Zmailbox busy")
        world.clock.advance(delay - 0.01)
        assert connection.sent_ids() == []
        world.clock.advance(0.01)
        assert connection.sent_ids() == [block_id]  # the same block, the same id
        assert not outcome.called
    connection.answer(block_id, b"Zmailbox busy")
    result = fired(outcome)
    assert result.status is Status.RETRY
    assert result.reason == "relay answered Z: mailbox busy"
    assert result.code == "Z"
    world.clock.advance(60)
    assert connection.sent_ids() == []
    assert world.upstream.unanswered == 0


def test_z_then_k_is_accepted(world: UpstreamWorld) -> None:
    """A message answered Z and then K on its resend is accepted, once."""
    connection = world.connect()
    results = tracked(world.deliver("m1"))
    [block_id] = connection.sent_ids()
    connection.answer(block_id, b"Z")
    world.clock.advance(1)
    assert connection.sent_ids() == [block_id]
    connection.answer(block_id, b"K")
    assert results == [Outcome.accepted()]


def test_resend_goes_before_queued_messages() -> None:
    """A message due for a resend goes to the front of the queue, before later messages."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=1))
    connection = world.connect()
    for name in ("m1", "m2", "m3"):
        world.deliver(name)
    [m1] = connection.sent_ids()
    connection.answer(m1, b"Z")
    [m2] = connection.sent_ids()  # the window had room meanwhile
    assert m2.startswith(b"m2.")
    world.clock.advance(1)
    assert connection.sent_ids() == []  # due, but the window is full
    connection.answer(m2, b"K")
    assert connection.sent_ids() == [m1]


def test_max_attempts_one_makes_z_a_retry_outcome_at_once() -> None:
    """With ``max_attempts = 1`` the first Z is the outcome: nothing is resent."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_attempts=1))
    connection = world.connect()
    outcome = world.deliver("m1")
    [block_id] = connection.sent_ids()
    connection.answer(block_id, b"Zlater")
    assert fired(outcome).status is Status.RETRY
    world.clock.advance(10)
    assert connection.sent_ids() == []


# --- cancellation (the router's time-out) ---------------------------------------------------------


def test_cancelled_while_queued_is_never_sent() -> None:
    """A message cancelled before it was sent is answered UNANSWERED and never goes out."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=1))
    connection = world.connect()
    world.deliver("m1")
    queued = world.deliver("m2")
    [first] = connection.sent_ids()
    queued.cancel()
    assert tracked(queued) == [UNANSWERED]
    connection.answer(first, b"K")
    assert connection.sent_ids() == []
    assert world.upstream.unanswered == 0


def test_cancelled_on_the_wire_keeps_its_slot_until_its_late_reply() -> None:
    """A cancelled sent message (UNANSWERED) holds its window slot; its late reply frees it."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=1))
    connection = world.connect()
    outcome = world.deliver("m1")
    results = tracked(outcome)
    queued = world.deliver("m2")
    [first] = connection.sent_ids()
    outcome.cancel()
    assert results == [UNANSWERED]
    assert connection.sent_ids() == []  # a silent server must not make us write more

    connection.answer(first, b"K")  # late: dropped, no second result
    assert len(results) == 1
    assert world.sample("msggateway_qmqp_replies_total", endpoint=UPSTREAM, status="K") == 1
    [second] = connection.sent_ids()
    assert second.startswith(b"m2.")
    connection.answer(second, b"K")
    assert fired(queued).is_accepted


def test_cancelled_on_the_wire_is_not_resent_after_a_reconnect(world: UpstreamWorld) -> None:
    """A cancelled message that was on the wire is dropped when the connection is lost."""
    connection = world.connect()
    cancelled = world.deliver("m1")
    kept = world.deliver("m2")
    ids = connection.sent_ids()
    cancelled.cancel()
    assert fired(cancelled) is UNANSWERED
    connection.lose()
    again = world.connect()
    assert again.sent_ids() == [ids[1]]
    again.answer(ids[1], b"K")
    assert fired(kept).is_accepted
    assert world.upstream.unanswered == 0


def test_cancelled_while_waiting_for_a_resend_is_never_resent(world: UpstreamWorld) -> None:
    """A message cancelled between a Z and its resend is UNANSWERED and not sent again."""
    connection = world.connect()
    outcome = world.deliver("m1")
    [block_id] = connection.sent_ids()
    connection.answer(block_id, b"Z")
    results = tracked(outcome)
    outcome.cancel()
    assert results == [UNANSWERED]
    world.clock.advance(10)
    assert connection.sent_ids() == []
    assert world.upstream.unanswered == 0


def test_router_time_out_while_waiting_for_a_resend_is_retry() -> None:
    """The route's time-out between a Z and the resend answers "retry"; nothing is resent."""
    world = UpstreamWorld(
        settings=attrs.evolve(SETTINGS, retry_initial_seconds=30.0, retry_max_seconds=60.0)
    )
    connection = world.connect()
    outcome = world.router.dispatch(FEED, [letter("slow")])
    [block_id] = connection.sent_ids()
    connection.answer(block_id, b"Z")  # resend due in 30 s; the route gives up at 20 s
    world.clock.advance(ROUTE_TIMEOUT_SECONDS)
    [result] = fired(outcome)
    assert isinstance(result, Outcome)
    assert result.status is Status.RETRY
    assert "no outcome from relay" in result.reason
    world.clock.advance(60)
    assert connection.sent_ids() == []
    assert world.upstream.unanswered == 0


def test_router_time_out_is_retry_and_the_message_is_never_sent_again(
    world: UpstreamWorld,
) -> None:
    """The route's time-out gives "retry"; after a reconnect the message is not resent."""
    connection = world.connect()
    outcome = world.router.dispatch(FEED, [letter("slow")])
    [block_id] = connection.sent_ids()
    world.clock.advance(ROUTE_TIMEOUT_SECONDS)
    [result] = fired(outcome)
    assert isinstance(result, Outcome)
    assert result.status is Status.RETRY
    assert "no outcome from relay within 20 seconds" in result.reason

    connection.lose()
    again = world.connect()
    assert again.sent_ids() == []
    again.answer(block_id, b"K")  # a late reply finds nothing
    assert world.upstream.unanswered == 0


# --- reconnecting ------------------------------------------------------------------------------


def test_unanswered_messages_are_resent_first_after_a_reconnect(world: UpstreamWorld) -> None:
    """On loss, sent-but-unanswered messages go back to the front of the queue, in order."""
    connection = world.connect()
    outcomes = [tracked(world.deliver(f"m{i}")) for i in range(4)]
    ids = connection.sent_ids()  # m0, m1, m2; m3 waits for the window
    connection.answer(ids[1], b"K")
    [m3] = connection.sent_ids()
    connection.lose()
    world.deliver("m4")
    assert world.upstream.unanswered == 4

    again = world.connect()
    assert again.sent_ids() == [ids[0], ids[2], m3]  # front of the queue, in order
    again.answer(ids[2], b"K")
    [m4] = again.sent_ids()
    assert m4.startswith(b"m4.")
    again.answer(ids[0], b"K")
    again.answer(m3, b"D")
    assert [len(results) for results in outcomes] == [1, 1, 1, 1]


def test_each_outcome_fires_exactly_once_across_reconnects(world: UpstreamWorld) -> None:
    """A reply arriving on a lost connection is ignored; the resend's reply is the outcome."""
    first = world.connect()
    results = tracked(world.deliver("m1"))
    [block_id] = first.sent_ids()
    first.lose()
    first.answer(block_id, b"K")  # too late: the old connection is gone
    assert results == []

    second = world.connect()
    assert second.sent_ids() == [block_id]
    second.answer(block_id, b"K")
    second.answer(block_id, b"K")  # a duplicate reply counts nothing
    assert results == [Outcome.accepted()]
    assert world.upstream.unanswered == 0


def test_resend_timer_during_a_disconnection_waits_for_the_next_connection(
    world: UpstreamWorld,
) -> None:
    """A resend due while disconnected is sent on the next connection."""
    connection = world.connect()
    outcome = world.deliver("m1")
    [block_id] = connection.sent_ids()
    connection.answer(block_id, b"Z")
    connection.lose()
    world.clock.advance(1)
    again = world.connect()
    assert again.sent_ids() == [block_id]
    again.answer(block_id, b"K")
    assert fired(outcome).is_accepted


def test_server_done_block_closes_and_requeues(world: UpstreamWorld) -> None:
    """The server's done block closes the connection; unanswered messages go to the next one."""
    connection = world.connect()
    outcome = world.deliver("m1")
    [block_id] = connection.sent_ids()
    with capturedLogs() as events:
        connection.server_says(qmqp.DONE_BYTES)
    assert connection.transport.disconnecting
    assert any("done block" in event.get("why", "") for event in events)
    connection.lose()
    assert not world.upstream.connected

    again = world.connect()
    assert again.sent_ids() == [block_id]
    again.answer(block_id, b"K")
    assert fired(outcome).is_accepted


def test_malformed_reply_closes_after_the_good_replies_and_requeues(world: UpstreamWorld) -> None:
    """Replies before bad input count; then the connection closes and the rest is resent."""
    connection = world.connect()
    good = world.deliver("m1")
    pending = world.deliver("m2")
    ids = connection.sent_ids()
    connection.server_says(
        qmqp.encode(qmqp.ReplyBlock(id=ids[0], status=qmqp.K, description=b"", pending=1))
        + encode_netstrings([b"R", b"x", b"Qhuh", b"0"])
    )
    assert fired(good).is_accepted
    assert connection.transport.disconnecting
    assert (
        world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="bad-reply") == 1
    )
    connection.server_says(
        qmqp.encode(qmqp.ReplyBlock(id=ids[1], status=qmqp.K, description=b"", pending=0))
    )
    assert not pending.called  # nothing is read after the close
    connection.lose()

    again = world.connect()
    assert again.sent_ids() == [ids[1]]
    again.answer(ids[1], b"K")
    assert fired(pending).is_accepted


def test_replies_are_counted_by_status(world: UpstreamWorld) -> None:
    """Replies received are counted per status under the upstream's name."""
    connection = world.connect()
    for name in ("a", "b", "c"):
        world.deliver(name)
    ids = connection.sent_ids()
    connection.answer(ids[0], b"K")
    connection.answer(ids[1], b"Z")
    connection.answer(ids[2], b"D")
    for status in ("K", "Z", "D"):
        assert world.sample("msggateway_qmqp_replies_total", endpoint=UPSTREAM, status=status) == 1


# --- batches ---------------------------------------------------------------------------------


def names_of(block_ids: list[bytes]) -> list[bytes]:
    """The message ids that block ids were made from (``m1.7`` is ``m1``'s)."""
    return [block_id.split(b".")[0] for block_id in block_ids]


def test_a_batch_the_window_takes_is_one_write(world: UpstreamWorld) -> None:
    """The blocks of a batch that fit the window go out in one write, in the batch's order."""
    connection = world.connect()
    world.batch("m1", "m2", "m3")
    assert len(connection.transport.writes) == 1
    assert names_of(connection.sent_ids()) == [b"m1", b"m2", b"m3"]


def test_a_batch_larger_than_the_window_fills_it_in_one_write_then_follows_replies(
    world: UpstreamWorld,
) -> None:
    """Past the window the rest of the batch waits; one read of replies frees slots, one write."""
    connection = world.connect()
    batch = world.batch(*(f"m{i}" for i in range(6)))
    ids = connection.sent_ids()
    assert names_of(ids) == [b"m0", b"m1", b"m2"]
    assert len(connection.transport.writes) == 1
    connection.server_says(
        b"".join(
            qmqp.encode(qmqp.ReplyBlock(id=block_id, status=qmqp.K, description=b"", pending=0))
            for block_id in ids
        )
    )
    more = connection.sent_ids()
    assert names_of(more) == [b"m3", b"m4", b"m5"]
    assert len(connection.transport.writes) == 2  # the three replies, then one write
    assert not batch.called
    for block_id in more:
        connection.answer(block_id, b"K")
    assert fired(batch) == [Outcome.accepted()] * 6


def test_partial_refusals_in_one_batch_answer_each_message(world: UpstreamWorld) -> None:
    """One batch: K, D and a Z past max_attempts each give their own message its outcome."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_attempts=1))
    connection = world.connect()
    batch = world.batch("ok", "bad", "busy")
    ids = connection.sent_ids()
    connection.server_says(
        qmqp.encode(qmqp.ReplyBlock(id=ids[2], status=qmqp.Z, description=b"full", pending=2))
        + qmqp.encode(qmqp.ReplyBlock(id=ids[1], status=qmqp.D, description=b"no", pending=1))
    )
    assert not batch.called
    connection.answer(ids[0], b"K")
    assert fired(batch) == [
        Outcome.accepted(),
        Outcome.rejected("relay answered D: no", code="D"),
        Outcome.retry("relay answered Z: full", code="Z"),
    ]


def test_a_batch_past_max_queue_refuses_only_the_messages_that_do_not_fit() -> None:
    """max_queue per message: the window and queue take the first; the rest are retry at once."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=2, max_queue=2))
    connection = world.connect()
    batch = world.batch(*(f"m{i}" for i in range(6)))
    assert names_of(connection.sent_ids()) == [b"m0", b"m1"]  # the window; m2, m3 queue
    assert world.upstream.unanswered == 4
    connection.lose()
    again = world.connect()
    ids = again.sent_ids()
    assert names_of(ids) == [b"m0", b"m1"]
    for block_id in ids:
        again.answer(block_id, b"K")
    for block_id in again.sent_ids():
        again.answer(block_id, b"K")
    outcomes = fired(batch)
    assert outcomes[:4] == [Outcome.accepted()] * 4
    assert [o.status for o in outcomes[4:]] == [Status.RETRY] * 2
    assert "2 messages queued already" in outcomes[4].reason


def test_the_router_deadline_cuts_a_batch_keeping_what_is_known() -> None:
    """At the route's deadline: answered messages keep their outcome, the rest time out.

    Messages still queued are never sent, not even when the window frees;
    one on the wire keeps its slot until its late reply, which is dropped.
    """
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, window=2))
    connection = world.connect()
    batch = world.router.dispatch(FEED, [letter(f"m{i}") for i in range(4)])
    ids = connection.sent_ids()
    assert names_of(ids) == [b"m0", b"m1"]
    connection.answer(ids[0], b"Dunknown")
    [m2] = connection.sent_ids()
    world.clock.advance(ROUTE_TIMEOUT_SECONDS)
    outcomes = fired(batch)
    assert outcomes[0] == Outcome.rejected("relay answered D: unknown", code="D")
    for late in outcomes[1:]:
        assert isinstance(late, Outcome) and late.status is Status.RETRY
        assert "no outcome from relay within 20 seconds" in late.reason
    connection.answer(ids[1], b"K")  # late: dropped, and m3 is not sent
    assert connection.sent_ids() == []
    connection.lose()
    assert world.connect().sent_ids() == []  # m2, on the wire when cut, is not resent
    assert world.upstream.unanswered == 0
    del m2


def test_a_connection_dropped_mid_batch_resends_the_unanswered_in_one_write(
    world: UpstreamWorld,
) -> None:
    """A drop mid-batch: answered messages keep their outcome, the rest go again, in order."""
    connection = world.connect()
    batch = world.batch("m0", "m1", "m2", "m3")
    ids = connection.sent_ids()
    connection.answer(ids[1], b"K")
    [m3] = connection.sent_ids()
    connection.lose()
    assert not batch.called

    again = world.connect()
    assert again.sent_ids() == [ids[0], ids[2], m3]
    assert len(again.transport.writes) == 1
    again.answer(ids[0], b"Zlater")
    again.answer(ids[2], b"Dno")
    again.answer(m3, b"K")
    world.clock.advance(2)  # Z after m0's second send: resent 2 s later
    assert again.sent_ids() == [ids[0]]
    again.answer(ids[0], b"K")
    assert fired(batch) == [
        Outcome.accepted(),
        Outcome.accepted(),
        Outcome.rejected("relay answered D: no", code="D"),
        Outcome.accepted(),
    ]
    assert world.upstream.unanswered == 0


def test_an_empty_batch_is_answered_at_once(world: UpstreamWorld) -> None:
    """A batch of no messages answers an empty list and writes nothing."""
    connection = world.connect()
    assert fired(world.upstream.deliver([])) == []
    assert connection.transport.writes == []


class _Run:
    """One upstream driven by a script, for the property below."""

    def __init__(self, settings: QMQPUpstreamSettings) -> None:
        self.world = UpstreamWorld(settings)
        self.connection: Connection | None = None
        self.on_wire: list[bytes] = []

    def connect(self) -> None:
        if self.connection is None:
            self.connection = self.world.connect()
            self.collect()

    def collect(self) -> None:
        if self.connection is not None:
            self.on_wire += self.connection.sent_ids()

    def step(self, step: tuple[object, ...]) -> None:
        connection = self.connection
        match step:
            case ("reply", int(pick), bytes(status)) if connection is not None and self.on_wire:
                block_id = self.on_wire.pop(pick % len(self.on_wire))
                connection.answer(block_id, status + b"why")
            case ("drop",) if connection is not None:
                connection.lose()
                self.connection = None
                self.on_wire = []
            case ("connect",):
                self.connect()
            case ("advance", float(seconds)):
                self.world.clock.advance(seconds)
            case ("pause",) if connection is not None:
                connection.protocol.pauseProducing()
            case ("resume",) if connection is not None:
                connection.protocol.resumeProducing()
        self.collect()


_steps = st.lists(
    st.one_of(
        st.tuples(st.just("reply"), st.integers(0, 7), st.sampled_from([qmqp.K, qmqp.Z, qmqp.D])),
        st.tuples(st.just("drop")),
        st.tuples(st.just("connect")),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 3.0])),
        st.tuples(st.just("pause")),
        st.tuples(st.just("resume")),
        st.tuples(st.just("deadline")),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(1, 8),
    window=st.integers(1, 4),
    max_queue=st.integers(1, 6),
    max_attempts=st.integers(1, 3),
    connected=st.booleans(),
    steps=_steps,
)
def test_a_batch_answers_each_message_as_batches_of_one_would(
    count: int,
    window: int,
    max_queue: int,
    max_attempts: int,
    connected: bool,
    steps: list[tuple[object, ...]],
) -> None:
    """Property: one batch and the same messages as batches of one get the same outcomes.

    Two upstreams see the same script of replies (K, Z, D to any message on
    the wire), drops, reconnects, pauses, time and the deadline (the batch
    cancelled, or each batch of one); they write the same blocks in the
    same order, hold the same number of messages, and in the end answer
    each message alike: batching changes how many writes, never an outcome.
    """
    settings_ = attrs.evolve(
        SETTINGS,
        window=window,
        max_queue=max_queue,
        max_attempts=max_attempts,
        retry_initial_seconds=1.0,
        retry_max_seconds=2.0,
    )
    batched, single = _Run(settings_), _Run(settings_)
    if connected:
        batched.connect()
        single.connect()
    names = [f"m{i}" for i in range(count)]
    batch_deferred = batched.world.batch(*names)
    batch = tracked(batch_deferred)
    alone_deferreds = [single.world.deliver(name) for name in names]
    alone = [tracked(d) for d in alone_deferreds]
    cancelled = False
    for step in [*steps, ("deadline",)]:
        if step == ("deadline",):
            if not cancelled:
                cancelled = True
                batch_deferred.cancel()
                for d in alone_deferreds:
                    d.cancel()
        else:
            batched.step(step)
            single.step(step)
        assert batched.on_wire == single.on_wire
        assert batched.world.upstream.unanswered == single.world.upstream.unanswered
    [outcomes] = batch
    assert outcomes == [only_result for [only_result] in alone]
    for run in (batched, single):
        if run.connection is not None:
            for block_id in run.on_wire:
                run.connection.answer(block_id, b"K")  # late replies change nothing
    assert batch == [outcomes]


# --- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize("success_reply", ["1", "0"])
def test_auth_waits_for_the_success_reply(success_reply: str) -> None:
    """With ``username`` an A block goes first; messages flow only after the success reply.

    ``auth_success_reply`` says which reply means success: "1" (the spec's
    prose, the default) or "0" (the spec's example).
    """
    world = UpstreamWorld(
        settings=attrs.evolve(SETTINGS, username="gw", auth_success_reply=success_reply)
    )
    outcome = world.deliver("m1")
    connection = world.connect()
    assert connection.sent() == [qmqp.AuthBlock(username=b"gw", password=SECRET)]
    assert not world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 0
    world.deliver("m2")
    assert connection.sent() == []  # nothing before the auth reply

    connection.server_says(f"8:1:A,1:{success_reply},,".encode())
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 1
    ids = connection.sent_ids()
    assert [block_id.split(b".")[0] for block_id in ids] == [b"m1", b"m2"]
    connection.answer(ids[0], b"K")
    assert fired(outcome).is_accepted


@pytest.mark.parametrize(("success_reply", "refusal"), [("1", "0"), ("0", "1")])
def test_auth_refused_closes_and_keeps_the_messages(success_reply: str, refusal: str) -> None:
    """The other auth reply is a refusal: close, count it, keep the messages queued."""
    world = UpstreamWorld(
        settings=attrs.evolve(SETTINGS, username="gw", auth_success_reply=success_reply)
    )
    outcome = world.deliver("m1")
    connection = world.connect()
    connection.sent()
    with capturedLogs() as events:
        connection.server_says(f"8:1:A,1:{refusal},,".encode())
    assert connection.transport.disconnecting
    assert connection.sent() == []
    assert not world.upstream.connected
    assert (
        world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="auth-refused")
        == 1
    )
    assert any("refused" in event.get("why", "") for event in events)
    connection.lose()
    assert not outcome.called
    assert world.upstream.unanswered == 1


def test_auth_without_a_secret_sends_an_empty_password() -> None:
    """An upstream with ``username`` but no secret in the secrets file sends an empty password."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, username="gw"))
    world.upstream.secrets = Secrets()
    connection = world.connect()
    assert connection.sent() == [qmqp.AuthBlock(username=b"gw", password=b"")]


def test_auth_reply_after_ready_is_ignored() -> None:
    """A second auth reply on a ready connection changes nothing."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, username="gw"))
    connection = world.connect()
    connection.sent()
    connection.server_says(b"8:1:A,1:1,,")
    connection.server_says(b"8:1:A,1:0,,")
    assert world.upstream.connected
    assert not connection.transport.disconnecting


# --- our client with our server, through iosim -------------------------------------------------


@implementer(IDestination)
class DomainDestination:
    """The far gateway's destination: accepts, retries or rejects by recipient domain."""

    name = "far-sink"

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Answer each message of the batch by its first recipient's domain."""
        self.messages.extend(messages)
        return succeed([self._answer(message) for message in messages])

    @staticmethod
    def _answer(message: Message) -> Outcome:
        domain = message.recipients[0].rpartition("@")[2]
        if domain == "busy.example":
            return Outcome.retry("queue full")
        if domain == "bad.example":
            return Outcome.rejected("mailbox unknown")
        return Outcome.accepted()


def test_our_client_with_our_server_over_iosim() -> None:
    """Through our own listener (with auth), one batch: K accepted, Z resent then retry, D rejected.

    The batch's three blocks reach the far listener together, so its
    replies come back for all three; the batch answers once the Z'd
    message has its last reply.
    """
    clock = MemoryReactorClock()
    far = DomainDestination()
    listener = "far-qmqp"
    far_routes = [
        Route(
            name=domain,
            source=listener,
            pattern=AddressPattern(f"#@{domain}"),
            destination=far.name,
        )
        for domain in ("ok.example", "busy.example", "bad.example")
    ]
    server_factory = QMQPServerFactory(
        name=listener,
        settings=QMQPListenerSettings(require_auth=True),
        router=Router(bind_routes(far_routes, {far.name: far}), clock),
        secrets=Secrets(logins={"gw": SECRET}),
        clock=clock,
    )
    world_settings = attrs.evolve(SETTINGS, username="gw", max_attempts=2)
    metrics = GatewayMetrics()
    upstream = QMQPUpstream(
        name=UPSTREAM,
        settings=world_settings,
        endpoint=TCP4ClientEndpoint(clock, "far.example", 628),
        secrets=Secrets(upstreams={UPSTREAM: SECRET}),
        clock=clock,
        metrics=metrics,
    )
    router = Router(RouteTable(), clock)
    router.replace_table(bind_routes([OUTBOUND], {UPSTREAM: upstream}))

    server = server_factory.buildProtocol(None)
    client = QMQPClientProtocol(upstream)
    pump = iosim.connect(
        server,
        iosim.FakeTransport(server, isServer=True),
        client,
        iosim.FakeTransport(client, isServer=False),
        clock=clock,
    )
    assert upstream.connected
    assert server is not None and server.identity == "gw"

    batch = router.dispatch(
        FEED,
        [
            letter("ok", "ops@ok.example"),
            letter("busy", "ops@busy.example"),
            letter("bad", "ops@bad.example"),
        ],
    )
    pump.flush()
    assert not batch.called  # Z: resent after a second; the batch waits for it

    clock.advance(1)
    pump.flush()
    assert fired(batch) == [
        Outcome.accepted(),
        Outcome.retry("relay answered Z: queue full", code="Z"),
        Outcome.rejected("relay answered D: mailbox unknown", code="D"),
    ]
    assert [message.id.split(".")[0] for message in far.messages] == ["ok", "busy", "bad", "busy"]
    assert far.messages[0].recipients == ("ops@ok.example",)
    assert far.messages[0].sender == "app@example.org"
    assert upstream.unanswered == 0
    assert (
        metrics.registry.get_sample_value(
            "msggateway_qmqp_replies_total", {"endpoint": UPSTREAM, "status": "Z"}
        )
        == 2
    )
