"""What every listener shares: `ListenerFactory` and `ListenerConnection`.

The factory side: connections per identity and the open-connections gauge.
The connection side is checked on `_Lines`, a small line protocol built on
`ListenerConnection` the way the real listeners are (it answers each line
``ok <line>``, and holds a line "awaiting its outcome" when it starts with
``hold``): producer registration, counting, timers, output in one write,
close and abort, back-pressure with a transport that behaves like Twisted's
TCP transport, and the frame time-out. Each listener's own tests check the
same behaviour through its protocol.
"""

from __future__ import annotations

import attrs
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer, ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs.framing import LineSplitter
from gateway.core.auth import Secrets
from gateway.core.flow import FlowPolicy
from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import (
    DEFAULT_FRAME_TIMEOUT_SECONDS,
    STOP_QUIET_SECONDS,
    ListenerConnection,
    ListenerFactory,
)
from tests.core.test_router import _sample


class BufferingTransport(StringTransport):
    """A StringTransport whose peer reads only when told, with Twisted's write-side flow control.

    Like a TCP transport (``abstract.FileDescriptor``): while more than
    ``high_water`` bytes are unread it calls its producer's ``pauseProducing``
    on every write, not once; `drain` is the peer reading everything, after
    which the producer is resumed.
    """

    def __init__(self, high_water: int) -> None:
        super().__init__()
        self.high_water = high_water

    def write(self, data: bytes) -> None:
        """Buffer, then pause the producer if the buffer is over the high-water mark."""
        super().write(data)
        if self.producer is not None and len(self.value()) > self.high_water:
            self.producer.pauseProducing()

    def drain(self) -> bytes:
        """The peer reads all that is buffered; the producer is resumed."""
        data: bytes = self.value()
        self.clear()
        if self.producer is not None:
            self.producer.resumeProducing()
        return data


@attrs.frozen
class _Settings:
    max_held: int = 2


class _Factory(ListenerFactory[Protocol, None]):
    kind = "test"


class _LinesFactory(ListenerFactory["_Lines", _Settings]):
    kind = "test"


class _Lines(ListenerConnection[_LinesFactory]):
    """A line protocol on the shared base: ``ok <line>`` for each line; ``hold`` lines wait."""

    def __init__(self, factory: _LinesFactory) -> None:
        super().__init__(factory)
        self._lines = LineSplitter(64)
        self.started = False
        self.ended: Failure | None = None
        self.held = 0

    def _connection_started(self) -> None:
        self.started = True

    def _connection_ended(self, reason: Failure) -> None:
        self.ended = reason

    def _partial_frame_bytes(self) -> int:
        return self._lines.pending

    def _may_read(self) -> bool:
        return self.held < self.factory.settings.max_held

    def dataReceived(self, data: bytes) -> None:
        """Answer every complete line; lines starting ``hold`` count against reading."""
        lines = self._lines.feed(data)
        for line in lines:
            if line.startswith(b"hold"):
                self.held += 1
            self.queue(b"ok " + line + b"\n")
        if self.held >= self.factory.settings.max_held:
            self._pause_reading()
        held = self._lines.pending
        if held or self._partial_since is not None:
            self._frame_read(bool(lines), held)
        self.flush()

    def queue(self, data: bytes) -> None:
        """Queue one message's bytes."""
        self._out.append(data)
        self._out_count += 1

    def release(self) -> None:
        """One held line is answered: reading may resume."""
        self.held -= 1
        self._resume_reading()


_LinesFactory.protocol = _Lines


class _World:
    """A `_LinesFactory` with a clock and metrics."""

    def __init__(self, max_held: int = 2) -> None:
        self.clock = Clock()
        self.metrics = GatewayMetrics()
        self.factory = _LinesFactory(
            name="l",
            settings=_Settings(max_held=max_held),
            secrets=Secrets(),
            clock=self.clock,
            metrics=self.metrics,
        )

    def connect(self, transport: StringTransport | None = None) -> tuple[_Lines, StringTransport]:
        """A new connection on ``transport`` (a fresh StringTransport by default)."""
        connection = self.factory.buildProtocol(None)
        assert isinstance(connection, _Lines)
        transport = StringTransport() if transport is None else transport
        connection.makeConnection(transport)
        return connection, transport

    def errors(self, kind: str) -> float:
        """How many protocol errors of ``kind`` were counted."""
        return _sample(self.metrics, "msggateway_protocol_errors_total", endpoint="l", kind=kind)

    def open_connections(self) -> float:
        """The open-connections gauge."""
        return _sample(self.metrics, "msggateway_connections", endpoint="l", protocol="test")


# --- the factory ------------------------------------------------------------------------


def test_identity_limit_and_release() -> None:
    """Past the limit an identity is refused; closing or replacing a connection frees a place."""
    world = _World()
    metrics = world.metrics
    factory = _Factory(name="l", settings=None, secrets=Secrets(), clock=Clock(), metrics=metrics)
    factory.max_connections_per_identity = 2
    one, two, three = Protocol(), Protocol(), Protocol()
    for connection in (one, two, three):
        factory.connection_opened(connection)
    assert factory.admit(one, "alice") and factory.admit(two, "alice")
    assert factory.admit(one, "alice")  # already counted: not twice
    assert not factory.admit(three, "alice")
    assert factory.admit(three, None)  # no identity, no limit
    assert world.errors("too-many-connections-per-identity") == 1
    factory.release(two)  # being replaced (an SSMP login with the same identifier)
    assert factory.admit(three, "alice")
    assert world.open_connections() == 3  # releasing an identity does not close a connection
    factory.connection_closed(two)  # its identity was already released
    factory.connection_closed(one)
    assert world.open_connections() == 1
    assert factory.admit(Protocol(), "alice")


def test_the_factory_holds_what_every_listener_is_built_with() -> None:
    """Name, settings, secrets and clock are the factory's; the frame time-out has its default."""
    world = _World(max_held=5)
    factory = world.factory
    assert (factory.name, factory.settings, factory.clock) == ("l", _Settings(5), world.clock)
    assert factory.frame_timeout_seconds == DEFAULT_FRAME_TIMEOUT_SECONDS == 30.0


# --- a connection's life ------------------------------------------------------------------


def test_a_connection_is_a_push_producer_counted_while_open() -> None:
    """Made: the transport's streaming producer, counted, its own start run; lost: all undone."""
    world = _World()
    connection, transport = world.connect()
    assert verifyObject(IPushProducer, connection)
    assert transport.producer is connection and transport.streaming
    assert connection.started and world.open_connections() == 1
    assert world.factory.connections == {connection}

    fired: list[str] = []
    connection._call_later(5, fired.append, "a")
    connection._call_later(10, fired.append, "b")
    connection.queue(b"never written\n")
    reason = Failure(ConnectionDone())
    connection.connectionLost(reason)
    assert connection.ended is reason
    assert world.open_connections() == 0 and not world.factory.connections
    world.clock.advance(60)
    assert fired == []  # every timer it started was cancelled
    connection.flush()
    assert transport.value() == b""  # unwritten output was dropped


def test_timers_that_fired_are_forgotten() -> None:
    """A connection that starts a timer after another (heartbeats) remembers only the live ones."""
    world = _World()
    connection, _ = world.connect()
    for _ in range(1000):
        connection._call_later(1, lambda: None)
        world.clock.advance(1)
    assert len(connection._timers) <= 9


def test_output_goes_out_in_one_write_counted() -> None:
    """Lines answered in one read go out in one write; messages and bytes are counted."""
    world = _World()
    writes: list[bytes] = []

    class Recording(StringTransport):
        def write(self, data: bytes) -> None:
            writes.append(data)
            super().write(data)

    connection, _ = world.connect(Recording())
    connection.dataReceived(b"a\nb\nc\n")
    assert writes == [b"ok a\nok b\nok c\n"]
    traffic = world.factory.traffic
    assert (traffic.messages_out, traffic.bytes_out) == (3, 15)


def test_close_writes_what_is_queued_then_closes() -> None:
    """A graceful close writes what is queued and lets the producer go (TLS waits for it)."""
    world = _World()
    connection, transport = world.connect()
    connection.queue(b"last words\n")
    connection._close()
    assert transport.value() == b"last words\n"
    assert transport.producer is None
    assert transport.disconnecting and not transport.disconnected
    connection._close()  # once is enough
    assert transport.value() == b"last words\n"


def test_abort_drops_what_is_queued() -> None:
    """A peer given up on is aborted: what is queued is not written."""
    world = _World()
    connection, transport = world.connect()
    connection.queue(b"never written\n")
    connection._abort()
    assert transport.disconnected
    assert transport.value() == b""
    connection._close()  # after an abort, nothing more
    assert transport.value() == b""


# --- back-pressure -------------------------------------------------------------------------


def test_a_slow_peer_is_not_read_until_it_catches_up() -> None:
    """The transport pauses us: reading stops; it resumes us: reading resumes."""
    world = _World()
    connection, transport = world.connect()
    connection.pauseProducing()
    assert transport.producerState == "paused"
    connection.resumeProducing()
    assert transport.producerState == "producing"


def test_reading_resumes_only_when_the_protocols_own_limits_allow() -> None:
    """Held lines pause reading; a caught-up peer is read again only once `_may_read` says so."""
    world = _World(max_held=1)
    connection, transport = world.connect()
    connection.dataReceived(b"hold 1\n")
    assert transport.producerState == "paused"
    connection.pauseProducing()
    connection.resumeProducing()  # caught up, but a line is still held
    assert transport.producerState == "paused"
    connection.pauseProducing()
    connection.release()  # no line held, but the peer is behind
    assert transport.producerState == "paused"
    connection.resumeProducing()
    assert transport.producerState == "producing"


def test_the_backlog_counts_from_the_first_pause() -> None:
    """Twisted pauses us on every write past its high-water mark: the backlog still adds up.

    Issue 18: the backlog was reset on each ``pauseProducing``, so a
    subscriber that never reads grew the gateway's memory without bound.
    """
    world = _World()
    transport = BufferingTransport(high_water=100)
    world.factory.flow = FlowPolicy(max_backlog_bytes=1000)
    connection, _ = world.connect(transport)
    with capturedLogs() as events:
        # Two writes of 100 bytes fill the buffer past 100: paused, and on every write after;
        # ten more are a backlog of 1,000 bytes, at the limit but not past it.
        for _ in range(12):
            connection.queue(b"x" * 49 + b"\n")
            connection.queue(b"y" * 49 + b"\n")
            connection.flush()
        assert transport.producerState == "paused"
        assert not transport.disconnected
        connection.queue(b"z" * 99 + b"\n")
        connection.flush()
    assert transport.disconnected  # aborted: it keeps nothing it did not read
    assert _sample(world.metrics, "msggateway_slow_consumer_disconnects_total", endpoint="l") == 1
    [warning] = [event for event in events if "slow consumer" in event["log_format"]]
    assert "(max_backlog_bytes 1000)" in warning["why"]
    backlog = int(warning["why"].split()[0])
    assert backlog > 1000


def test_a_peer_that_catches_up_starts_from_no_backlog() -> None:
    """Draining the transport resumes us and forgets the backlog."""
    world = _World()
    transport = BufferingTransport(high_water=100)
    world.factory.flow = FlowPolicy(max_backlog_bytes=1000)
    connection, _ = world.connect(transport)
    for _ in range(20):  # 20 x 800 bytes, read by the peer after each
        for _ in range(4):
            connection.queue(b"x" * 199 + b"\n")
        connection.flush()
        assert len(transport.drain()) == 800
    assert not transport.disconnected
    assert transport.producerState == "producing"


def test_a_held_producer_reads_nothing_until_every_holder_released_it() -> None:
    """A connection held by consumers is paused; it resumes when the last lets go, if it may."""
    world = _World()
    consumers = [world.connect()[0] for _ in range(2)]
    producer, transport = world.connect()
    for consumer in consumers:
        consumer.pauseProducing()
        consumer.congestion.hold(producer.throttle)
    assert transport.producerState == "paused"
    consumers[0].resumeProducing()
    assert transport.producerState == "paused"
    producer.dataReceived(b"hold 1\nhold 2\n")  # its own limit is reached too
    consumers[1].resumeProducing()
    assert transport.producerState == "paused"
    producer.release()
    assert transport.producerState == "producing"


def test_a_congested_consumer_is_cut_after_slow_consumer_seconds_unless_it_drains() -> None:
    """One timer per connection, re-armed for the time left after drains in between."""
    world = _World()
    world.factory.flow = FlowPolicy(slow_consumer_seconds=10)
    consumer, transport = world.connect()
    consumer.pauseProducing()
    world.clock.advance(6)
    consumer.resumeProducing()
    world.clock.advance(1)
    consumer.pauseProducing()  # congested again at 7 s: cut at 17 s, not 10 s
    world.clock.advance(9.9)
    assert not transport.disconnected
    world.clock.advance(0.1)
    assert transport.disconnected
    assert _sample(world.metrics, "msggateway_slow_consumer_disconnects_total", endpoint="l") == 1


def test_slow_consumer_seconds_zero_never_cuts_for_time() -> None:
    """0 turns the stuck check off: only the byte cap remains."""
    world = _World()
    world.factory.flow = FlowPolicy(slow_consumer_seconds=0)
    consumer, transport = world.connect()
    consumer.pauseProducing()
    world.clock.advance(3600)
    assert not transport.disconnected
    assert not world.clock.getDelayedCalls()


# --- the frame time-out --------------------------------------------------------------------


def test_a_frame_that_never_completes_is_aborted() -> None:
    """Part of a line and nothing more: aborted at the time-out, counted and logged."""
    world = _World()
    connection, transport = world.connect()
    with capturedLogs() as events:
        connection.dataReceived(b"half a li")
        world.clock.advance(DEFAULT_FRAME_TIMEOUT_SECONDS - 0.1)
        assert not transport.disconnecting
        world.clock.advance(0.1)
    assert transport.disconnected
    assert world.errors("frame-timeout") == 1
    [logged] = [event for event in events if event.get("held") is not None]
    assert logged["held"] == 9 and logged["listener"] == "l"


def test_the_clock_runs_from_the_read_that_began_the_frame() -> None:
    """A byte at a time does not keep an unfinished frame alive; a finished one resets it."""
    world = _World()
    connection, transport = world.connect()
    connection.dataReceived(b"a")
    for byte in b"bcdefghijklmnopqrstuvwxy":
        world.clock.advance(1)
        connection.dataReceived(bytes([byte]))
    world.clock.advance(5)  # 29 s after the first byte
    connection.dataReceived(b"z\nnext")  # done; a new frame begins now
    world.clock.advance(29)
    assert not transport.disconnecting
    world.clock.advance(1)
    assert transport.disconnected


def test_frames_ending_mid_read_do_not_time_out() -> None:
    """A steady stream whose reads each end inside the next frame is never timed out."""
    world = _World()
    connection, transport = world.connect()
    connection.dataReceived(b"fir")
    for _ in range(100):
        world.clock.advance(10)
        connection.dataReceived(b"st\nfir")
    assert not transport.disconnecting
    assert world.errors("frame-timeout") == 0


def test_a_quiet_peer_between_frames_stays() -> None:
    """Nothing held between frames: no frame time-out, however long the peer is quiet."""
    world = _World()
    connection, transport = world.connect()
    connection.dataReceived(b"whole\n")
    world.clock.advance(10 * DEFAULT_FRAME_TIMEOUT_SECONDS)
    assert not transport.disconnecting


def test_time_we_do_not_read_does_not_count() -> None:
    """While we hold reading (the peer is behind), its unfinished frame is not timed out."""
    world = _World(max_held=1)
    connection, transport = world.connect()
    connection.dataReceived(b"hold\npart")
    assert transport.producerState == "paused"
    world.clock.advance(5 * DEFAULT_FRAME_TIMEOUT_SECONDS)
    assert not transport.disconnecting
    connection.release()  # reading resumes: the frame has its full time from now
    world.clock.advance(DEFAULT_FRAME_TIMEOUT_SECONDS - 1)
    assert not transport.disconnecting
    world.clock.advance(1)
    assert transport.disconnected


def test_a_frame_time_out_of_zero_is_off() -> None:
    """``frame_timeout_seconds = 0``: an unfinished frame is never timed out."""
    world = _World()
    world.factory.frame_timeout_seconds = 0
    connection, transport = world.connect()
    connection.dataReceived(b"part")
    world.clock.advance(1e6)
    assert not transport.disconnecting
    assert not world.clock.getDelayedCalls()


# --- a clean stop -----------------------------------------------------------------------------


@implementer(ITCPTransport)
class _TCPTransport(StringTransport):
    """A StringTransport that half-closes as a TCP transport does (``loseWriteConnection``)."""

    write_closed = False

    def setTcpNoDelay(self, enabled: bool) -> None:  # noqa: N802 (ITCPTransport's name)
        """Nagle's algorithm: nothing to switch here."""

    def loseWriteConnection(self) -> None:  # noqa: N802 (ITCPTransport's name)
        """Our side is done writing (a FIN once what is buffered went out); reading goes on."""
        self.write_closed = True


def test_a_stopped_connection_reads_nothing_more_whatever_resumes_it() -> None:
    """`stop_reading` pauses reading for good: a caught-up peer or a released hold do not resume."""
    world = _World(max_held=1)
    connection, transport = world.connect()
    connection.dataReceived(b"hold 1\n")
    world.factory.stop_reading()
    assert transport.producerState == "paused"
    connection.pauseProducing()
    connection.resumeProducing()  # the peer caught up
    connection.release()  # the held line was answered
    assert transport.producerState == "paused"
    assert not transport.disconnecting


def test_closing_for_a_stop_writes_the_answers_then_half_closes_and_drains_input() -> None:
    """Answers written after the stop go out first, then a FIN; input is read until the peer closes.

    Closing a socket with input unread would reset it, losing answers the
    kernel had not sent: so the write side closes, reading resumes (what is
    read is dropped, unanswered), and the connection is gone once the peer
    closes its side.
    """
    world = _World()
    connection, transport = world.connect(_TCPTransport())
    world.factory.stop_reading()
    connection.queue(b"ok answered after the stop\n")  # the router's answer came in
    closed = world.factory.close_connections()
    assert transport.value() == b"ok answered after the stop\n"
    assert transport.write_closed and not transport.disconnecting
    assert transport.producer is None  # a TLS transport waits for its producer to go
    assert transport.producerState == "producing"  # reading the peer's last bytes
    connection.dataReceived(b"more from a peer still streaming\n")
    assert transport.value() == b"ok answered after the stop\n"  # dropped, unanswered
    assert not closed.called
    connection.connectionLost(Failure(ConnectionDone()))
    assert closed.called
    assert world.factory.connections == set()


def test_a_half_closed_peer_that_stays_is_closed_once_quiet() -> None:
    """A peer that neither sends nor closes is closed after `STOP_QUIET_SECONDS` of quiet.

    With nothing unread, the close is no reset: the answers still go out.
    """
    world = _World()
    connection, transport = world.connect(_TCPTransport())
    world.factory.close_connections()
    world.clock.advance(STOP_QUIET_SECONDS - 0.1)
    connection.dataReceived(b"still streaming\n")
    world.clock.advance(STOP_QUIET_SECONDS - 0.1)
    assert not transport.disconnecting  # it was heard from 0.4 s ago
    world.clock.advance(0.1)
    assert transport.disconnecting


def test_without_a_half_close_the_stop_closes_after_the_answers() -> None:
    """A transport that cannot half-close (TLS sends close_notify instead) is closed gracefully."""
    world = _World()
    connection, transport = world.connect()
    connection.queue(b"ok last\n")
    closed = world.factory.close_connections()
    assert transport.value() == b"ok last\n"
    assert transport.disconnecting
    connection.connectionLost(Failure(ConnectionDone()))
    assert closed.called


def test_closing_no_connections_is_done_at_once_and_a_cancelled_wait_is_forgotten() -> None:
    """Nothing open: fired already. A wait cancelled (the grace ran out) is skipped later."""
    world = _World()
    assert world.factory.close_connections().called
    connection, _ = world.connect(_TCPTransport())
    gave_up = world.factory.close_connections()
    gave_up.addErrback(lambda failure: None)
    gave_up.cancel()
    connection.connectionLost(Failure(ConnectionDone()))
    assert world.factory.close_connections().called
