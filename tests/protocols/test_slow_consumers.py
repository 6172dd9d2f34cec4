"""Consumers that stop reading cost the gateway a bounded amount, and say so (issue 18).

The stream listener and the DMP listener run over `CongestingTransport`, a
`StringTransport` that pauses its producer from inside a write once more
than its buffer is unsent, as Twisted's TCP transport does; the test
reading what was written is the peer reading. The MTL listener runs with
recorded sockets that refuse what a full ZeroMQ queue would, and the
ZeroMQ queues themselves are checked on real sockets (``inproc://``, and
the listener's own on 127.0.0.1 port 0). SSMP's slow subscriber is tested
in test_ssmp_server.py and test_listener.py.
"""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
import zmq
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import LogLevel, capturedLogs

from gateway.codecs import dmp, mtl, osiris
from gateway.codecs import stream as sp
from gateway.config import ConfigError, load_config
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.flow import DEFAULT_FLOW, DISCONNECT, FlowPolicy
from gateway.core.log import FsyncPolicy, LogStore
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.flow import LogTally
from gateway.protocols.dmp.server import DMPServerProtocol
from gateway.protocols.mtl.backlog import HELD_RETRY_SECONDS
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings
from gateway.protocols.mtl.zmq import DEFAULT_HIGH_WATER_MARK, ZmqSocket, zmq_factory
from gateway.protocols.stream.server import StreamServerFactory, StreamServerProtocol
from gateway.protocols.stream.settings import StreamListenerSettings
from tests.protocols.test_dmp_server import Listener as DMPListener
from tests.protocols.test_mtl_server import Sent, answers, bridge, burst, data, lease

BUFFER_BYTES = 65536
"""What a Twisted TCP transport holds unsent before it pauses its producer."""


class CongestingTransport(StringTransport):
    """A `StringTransport` whose peer reads only when the test says (`drain`).

    Like Twisted's TCP transport, every write that leaves more than
    ``buffer_bytes`` unsent calls the streaming producer's pauseProducing
    (again and again while it stays full); `drain` empties the buffer and
    resumes the producer.
    """

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.buffer_bytes = buffer_bytes
        self.most_unsent = 0

    def write(self, data: bytes) -> None:
        """Buffer; pause the producer if the buffer is over its size."""
        super().write(data)  # type: ignore[no-untyped-call]
        self._check()

    def writeSequence(self, data: Sequence[bytes]) -> None:  # noqa: N802 (Twisted's name)
        """Buffer; pause the producer if the buffer is over its size."""
        super().writeSequence(data)  # type: ignore[no-untyped-call]
        self._check()

    def _check(self) -> None:
        unsent = len(self.io.getvalue())
        self.most_unsent = max(self.most_unsent, unsent)
        if unsent > self.buffer_bytes and self.producer is not None and self.streaming:
            self.producer.pauseProducing()

    def drain(self) -> bytes:
        """The peer reads everything; the transport resumes its producer."""
        data = self.value()
        self.clear()
        if self.producer is not None:
            self.producer.resumeProducing()
        return data


# --- the stream listener -----------------------------------------------------------------


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


@pytest_twisted.async_yield_fixture
async def store(tmp_path: Path) -> AsyncIterator[LogStore]:
    """An open log in a temporary directory."""
    opened = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER, clock=Clock())
    opened.open()
    yield opened
    await opened.close()


class StreamConsumer:
    """A stream client over a `CongestingTransport`, opened as guest, speaking our client codec."""

    def __init__(self, store: LogStore) -> None:
        self.factory = StreamServerFactory(
            name="streams",
            settings=StreamListenerSettings(guest=True, heartbeat_seconds=0),
            store=store,
            secrets=Secrets(),
            clock=Clock(),
        )
        self.factory.listening_on(IPv4Address("TCP", "127.0.0.1", 5552))
        self.transport = CongestingTransport(
            hostAddress=IPv4Address("TCP", "127.0.0.1", 5552),
            peerAddress=IPv4Address("TCP", "127.0.0.1", 40000),
        )
        address = IPv4Address("TCP", "127.0.0.1", 40000)
        protocol = self.factory.buildProtocol(address)
        assert isinstance(protocol, StreamServerProtocol)
        self.protocol = protocol
        protocol.makeConnection(self.transport)
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self.send(
            sp.PeerProperties(correlation_id=1, properties={}),
            sp.SaslHandshake(correlation_id=2),
            sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest"),
            sp.Tune(frame_max=0, heartbeat=0),
            sp.Open(correlation_id=4, virtual_host="/"),
        )
        opened = self.read()[-1]
        assert isinstance(opened, sp.OpenResponse) and opened.code == 1

    def send(self, *events: sp.Event) -> None:
        """Frames from the client, in one read."""
        self.protocol.dataReceived(b"".join(self.codec.send(event) for event in events))

    def read(self) -> list[sp.Event]:
        """The client reads everything the server wrote."""
        return list(self.codec.receive_data(self.transport.drain()))


def first_offsets(events: Sequence[sp.Event]) -> list[int]:
    """The first offsets of the chunks Delivered among ``events``."""
    return [
        osiris.ChunkHeader.unpack(bytes(event.chunk)).first_offset
        for event in events
        if isinstance(event, sp.Deliver)
    ]


@pytest_twisted.ensureDeferred
async def test_a_stream_consumer_granting_credit_and_never_reading_gets_one_chunk_past_the_buffer(
    store: LogStore,
) -> None:
    """Credit for every chunk, granted again and again: sending stops once the buffer is full.

    Thirty chunks of 10 kB: the first read of the log takes them all (its
    budget is 4 MiB), but the transport pauses the connection inside the
    seventh write and no chunk follows it, however much Credit comes; when
    the client reads, the next ones go out the same way, every chunk once,
    in order.
    """
    stream = store.create("flood")
    for _ in range(30):
        await stream.append([b"x" * 10_000])
    consumer = StreamConsumer(store)
    consumer.send(
        sp.Subscribe(
            correlation_id=5,
            subscription_id=1,
            stream="flood",
            offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
            credit=1000,
        )
    )
    unsent = len(consumer.transport.value())
    assert BUFFER_BYTES < unsent < BUFFER_BYTES + 10_100  # one chunk past the buffer
    for _ in range(5):
        consumer.send(sp.Credit(subscription_id=1, credit=1000))
    assert len(consumer.transport.value()) == unsent
    seen: list[int] = []
    for _ in range(30):
        events = consumer.read()
        seen += first_offsets(events)
        if len(seen) == 30:
            break
    assert seen == list(range(30))
    assert consumer.transport.most_unsent < BUFFER_BYTES + 10_100


# --- the DMP listener --------------------------------------------------------------------


def open_reader(listener: DMPListener) -> tuple[DMPServerProtocol, CongestingTransport]:
    """A feed reader of ``alerts`` over a congesting transport, its dialog read."""
    protocol = listener.factory.buildProtocol(None)
    assert protocol is not None
    transport = CongestingTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(dmp.PROTOCOL_HEADER + bytes((3,)) + b"R-1")
    transport.drain()
    return protocol, transport


def test_a_dmp_feed_reader_that_stops_reading_stalls_its_routes_then_is_cut() -> None:
    """A reader that never reads: nothing is answered (its sources wait), then it is cut.

    Twenty batches of 50 messages of 1 kB to a reader that never reads:
    each is written (the transport holds it); those written before its
    buffer filled are accepted, the others are not answered, so a route's
    sources run out of in-flight room and stop. After
    ``slow_consumer_seconds`` without a drain the reader is cut, counted
    and logged, and every waiting message is answered retry later: nothing
    was told accepted that the reader did not take.
    """
    listener = DMPListener()
    _reader, transport = open_reader(listener)
    body = b"m" * 1000
    outcomes: list[Outcome] = []
    with capturedLogs() as events:
        for _ in range(20):
            waiting = listener.factory.deliver([Message(address="alerts", body=body)] * 50)
            waiting.addCallback(outcomes.extend)
        written = len(outcomes)
        assert 0 < written * 1000 <= BUFFER_BYTES + 50 * 1100
        assert all(o.is_accepted for o in outcomes)
        listener.clock.advance(DEFAULT_FLOW.slow_consumer_seconds)
    assert transport.disconnected
    assert len(outcomes) == 1000
    cut = outcomes[written:]
    assert all(o.status is Status.RETRY and "went away" in o.reason for o in cut)
    sample = listener.metrics.registry.get_sample_value(
        "msggateway_slow_consumer_disconnects_total", {"endpoint": "dmp"}
    )
    assert sample == 1
    [warning] = [e for e in events if "slow consumer" in e["log_format"]]
    assert "has not emptied for 10 s" in warning["why"]
    assert "alerts" not in listener.factory.readers


def test_a_dmp_sink_whose_messages_find_no_reader_logs_once_in_a_while() -> None:
    """A sink routed to a feed without a reader: each message counted, one log line, then a tally.

    A thousand messages in one read: ``not-delivered`` counts 1,000, the
    log has one line; when the writer leaves, one more line says how many
    went unlogged.
    """
    listener = DMPListener()
    route = Route(
        name="sink-to-feed",
        source="dmp",
        pattern=AddressPattern("orders.#"),
        destination="dmp",
        target=AddressTemplate("alerts"),
    )
    listener.router.replace_table(bind_routes([route], {"dmp": listener.factory}))
    writer, transport, _ = listener.opened(b"W-1")
    with capturedLogs() as events:
        writer.dataReceived(dmp.encode_envelope(dmp.Envelope(body=b"x")) * 1000)
        assert listener.errors("not-delivered") == 1000
        assert [e["count"] for e in events if "not delivered" in e["log_format"]] == [1]
        writer.connectionLost()
    [last] = [e for e in events if "more message(s)" in e["log_format"]]
    assert last["count"] == 999
    del transport


def test_log_tally() -> None:
    """The first occurrence at once; then nothing until the interval passes, then how many."""
    clock = Clock()
    tally = LogTally(clock, 10.0)
    assert tally.add() == 1
    assert [tally.add(2) for _ in range(3)] == [0, 0, 0]
    clock.advance(10)
    assert tally.add() == 7
    assert tally.add() == 0
    assert tally.count == 1


# --- the MTL listener --------------------------------------------------------------------


def metered_mtl(
    max_backlog_messages: int = 10_000,
    flow: FlowPolicy = DEFAULT_FLOW,
    dead_after_seconds: float = 60.0,
) -> tuple[MTLServer, Clock, Sent, Sent, GatewayMetrics]:
    """An MTL listener with recorded sockets and metrics, pinging every 5 s."""
    clock = Clock()
    metrics = GatewayMetrics()
    router = Router(bind_routes([], {}), clock, metrics)
    listener = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(
            ping_interval_seconds=5.0,
            dead_after_seconds=dead_after_seconds,
            max_backlog_messages=max_backlog_messages,
        ),
        host="127.0.0.1",
        port=0,
        router=router,
        secrets=Secrets(),
        clock=clock,
        reactor=clock,
        metrics=metrics,
    )
    listener.flow = flow
    control, sent = Sent(), Sent()
    listener._control, listener._data = control, sent
    listener._timer = clock.callLater(5.0, listener._tick)
    return listener, clock, control, sent, metrics


def not_sent(metrics: GatewayMetrics) -> float:
    """The MTL listener's ``not-sent`` count."""
    value = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": "not-sent"}
    )
    return value or 0.0


def test_disconnect_policy_an_mtl_reader_whose_queue_is_full_gets_retry_later() -> None:
    """Under ``disconnect``: Contents ZeroMQ refuses (the reader's queue is full) are retry later.

    Counted and logged: the log line comes with the next ping round, with
    how many, once. Nobody is held: the data socket is read on.
    """
    listener, clock, control, sent, metrics = metered_mtl(flow=FlowPolicy(policy=DISCONNECT))
    data(listener, b"slow", mtl_lease(listener, control))
    data(listener, b"slow", summon("news"))
    sent.refuse.add(b"slow")
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"%d" % n) for n in range(5)]).addCallback(
        results.append
    )
    [outcomes] = results
    assert all(o.status is Status.RETRY and "not reading" in o.reason for o in outcomes)
    assert not_sent(metrics) == 5
    assert not sent.paused and not listener._peers[b"slow"].backlog
    with capturedLogs() as events:
        clock.advance(5)  # the ping round; the ping itself is refused too
        clock.advance(5)
    lines = [e for e in events if "not sent" in e["log_format"]]
    assert [(e["count"], e["limit"]) for e in lines] == [(5, 10_000), (1, 10_000)]
    assert not_sent(metrics) == 7


def test_an_mtl_reader_that_reads_but_never_confirms_gets_max_backlog_messages() -> None:
    """A confirm=full reader with max_backlog_messages unconfirmed: retry later, until it confirms.

    In one batch of eight to a reader allowed five: five are sent, three are
    retry later at once (counted as not sent); a Confirm of three makes room
    for three more, in order of sequence.
    """
    listener, _clock, control, sent, metrics = metered_mtl(max_backlog_messages=5)
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", summon("news"))
    results: list[list[Outcome]] = []
    batch = [Message(address="news", body=b"%d" % n) for n in range(8)]
    listener.deliver(batch).addCallback(results.append)
    assert [c.sequence for c in contents(sent, b"r")] == [1, 2, 3, 4, 5]
    assert not_sent(metrics) == 3
    data(listener, b"r", mtl.Confirm(5, True))
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED] * 5 + [Status.RETRY] * 3
    assert "unconfirmed" in outcomes[-1].reason
    listener.deliver(batch[:3])
    assert [c.sequence for c in contents(sent, b"r")][5:] == [6, 7, 8]


def test_disconnect_policy_drops_a_test_profile_copy_for_a_full_queue() -> None:
    """Under ``disconnect``, a test-profile copy ZeroMQ refuses is dropped and counted."""
    listener, _clock, control, sent, metrics = metered_mtl(flow=FlowPolicy(policy=DISCONNECT))
    reader, writer = leased_test_profile_peers(listener, control)
    sent.room[reader] = 3
    burst(listener, [(writer, mtl.Content(n, "", {}, b"%d" % n)) for n in range(10)])
    assert [c.body for c in contents(sent, reader)] == [b"0", b"1", b"2"]
    assert not_sent(metrics) == 7
    assert not sent.paused


def leased_test_profile_peers(listener: MTLServer, control: Sent) -> tuple[bytes, bytes]:
    """A test-profile reader (summoned) and writer, leased; their identities."""
    reader, writer = b"r", b"w"
    data(
        listener,
        reader,
        mtl.Lease(1, lease(listener, control, "Reader", "none", ["resource"], "test")),
    )
    data(listener, reader, summon("resource"))
    data(
        listener,
        writer,
        mtl.Lease(1, lease(listener, control, "Writer", "none", ["resource"], "test")),
    )
    return reader, writer


def test_a_full_mtl_reader_holds_the_test_profile_writers_and_loses_nothing() -> None:
    """A burst past the reader's queue is held for it, in order; the data socket is not read.

    The reader's ZeroMQ queue takes 3; a writer bursts 10. The 7 refused
    wait in the listener (not counted as not sent) and reading stops; while
    the reader reads nothing they are offered again on a short timer, and
    once it has room they all go, in order, and reading resumes.
    """
    listener, clock, control, sent, metrics = metered_mtl()
    reader, writer = leased_test_profile_peers(listener, control)
    sent.room[reader] = 3
    burst(listener, [(writer, mtl.Content(n, "", {}, b"%d" % n)) for n in range(10)])
    assert [c.body for c in contents(sent, reader)] == [b"0", b"1", b"2"]
    assert sent.paused and len(listener._peers[reader].backlog) == 7
    clock.pump([HELD_RETRY_SECONDS] * 50)  # a second: the reader reads nothing
    assert sent.paused and len(contents(sent, reader)) == 3
    sent.room[reader] = 4  # it read some
    clock.advance(HELD_RETRY_SECONDS)
    assert len(contents(sent, reader)) == 7 and sent.paused
    sent.room[reader] = 100  # it read the rest
    clock.advance(HELD_RETRY_SECONDS)
    assert [c.body for c in contents(sent, reader)] == [b"%d" % n for n in range(10)]
    assert [c.sequence for c in contents(sent, reader)] == list(range(1, 11))
    assert not sent.paused and sent.read_soon == 1
    assert not_sent(metrics) == 0
    assert retry_timers(listener, clock) == []  # the retry timer stops once nothing is held


def retry_timers(listener: MTLServer, clock: Clock) -> list[object]:
    """The listener's pending timers that offer held commands again."""
    return [call for call in clock.getDelayedCalls() if call.func == listener._backlogs._retry]


def test_a_congested_readers_answers_and_pings_keep_their_place() -> None:
    """What else a congested reader is sent (a Ping) goes after what it holds, in order."""
    listener, clock, control, sent, _metrics = metered_mtl()
    reader, writer = leased_test_profile_peers(listener, control)
    sent.room[reader] = 1
    burst(listener, [(writer, mtl.Content(n, "", {}, b"%d" % n)) for n in range(3)])
    clock.advance(5)  # the ping round
    sent.room[reader] = 100
    clock.advance(HELD_RETRY_SECONDS)
    kinds = [type(c).__name__ for c in sent.commands(reader)][-4:]
    assert kinds == ["Content", "Content", "Content", "Ping"]


def test_a_route_to_a_full_mtl_reader_is_answered_once_zeromq_took_it() -> None:
    """A confirm=none reader's copies ZeroMQ refused are accepted when taken, not before."""
    listener, clock, control, sent, _metrics = metered_mtl()
    data(listener, b"r", mtl_lease(listener, control))
    data(listener, b"r", summon("news"))
    sent.room[b"r"] = 2
    results: list[list[Outcome]] = []
    batch = [Message(address="news", body=b"%d" % n) for n in range(5)]
    listener.deliver(batch).addCallback(results.append)
    assert results == [] and sent.paused
    later: list[list[Outcome]] = []
    listener.deliver(batch[:1]).addCallback(later.append)  # goes after what is held
    sent.room[b"r"] = 3
    clock.advance(HELD_RETRY_SECONDS)
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED] * 5
    assert later == [] and sent.paused
    sent.room[b"r"] = 1
    clock.advance(HELD_RETRY_SECONDS)
    assert [[o.status for o in outcomes] for outcomes in later] == [[Status.ACCEPTED]]
    assert [c.body for c in contents(sent, b"r")] == [b"0", b"1", b"2", b"3", b"4", b"0"]
    assert not sent.paused


def test_a_confirm_full_reader_held_copies_answer_by_confirm() -> None:
    """A confirm=full reader's held copies go out later and are answered by its Confirms."""
    listener, clock, control, sent, _metrics = metered_mtl()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", summon("news"))
    sent.room[b"r"] = 1
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"%d" % n) for n in range(3)]).addCallback(
        results.append
    )
    sent.room[b"r"] = 10
    clock.advance(HELD_RETRY_SECONDS)
    assert [c.sequence for c in contents(sent, b"r")] == [1, 2, 3] and not sent.paused
    assert results == []
    data(listener, b"r", mtl.Confirm(3, True))
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED] * 3


def slow_consumers(metrics: GatewayMetrics) -> float:
    """The MTL listener's slow-consumer count."""
    value = metrics.registry.get_sample_value(
        "msggateway_slow_consumer_disconnects_total", {"endpoint": "mtl"}
    )
    return value or 0.0


def test_a_stuck_mtl_reader_is_forgotten_and_reading_resumes() -> None:
    """A reader ZeroMQ takes nothing more for during slow_consumer_seconds is cut.

    It is forgotten (as a dead peer is), counted as a slow consumer and
    logged once; what waited for it is retry later and the data socket is
    read again. Progress restarts the count.
    """
    flow = FlowPolicy(slow_consumer_seconds=2.0)
    listener, clock, control, sent, metrics = metered_mtl(flow=flow)
    data(listener, b"r", mtl_lease(listener, control))
    data(listener, b"r", summon("news"))
    sent.room[b"r"] = 1
    results: list[list[Outcome]] = []
    batch = [Message(address="news", body=b"%d" % n) for n in range(4)]
    listener.deliver(batch).addCallback(results.append)
    clock.pump([HELD_RETRY_SECONDS] * 75)  # 1.5 s without progress
    sent.room[b"r"] = 1  # some progress
    clock.pump([HELD_RETRY_SECONDS] * 75)  # 1.5 s since
    assert b"r" in listener._peers and sent.paused
    with capturedLogs() as events:
        clock.pump([HELD_RETRY_SECONDS] * 50)  # 2.5 s without progress: stuck
        clock.pump([HELD_RETRY_SECONDS] * 50)
    assert b"r" not in listener._peers
    assert not sent.paused and sent.read_soon == 1
    [outcomes] = results
    assert [o.status for o in outcomes[:2]] == [Status.ACCEPTED] * 2
    assert all(o.status is Status.RETRY and "went away" in o.reason for o in outcomes[2:])
    assert slow_consumers(metrics) == 1
    [line] = [e for e in events if "slow consumer" in e["log_format"]]
    assert line["log_level"] is LogLevel.warn and "slow_consumer_seconds" in line["why"]
    assert retry_timers(listener, clock) == []  # nothing is held: no retry timer


def test_a_congested_mtl_reader_found_gone_is_forgotten_and_reading_resumes() -> None:
    """A congested reader whose connection goes: forgotten at the next offer, outcomes retry."""
    listener, clock, control, sent, _metrics = metered_mtl()
    data(listener, b"r", mtl_lease(listener, control))
    data(listener, b"r", summon("news"))
    sent.refuse.add(b"r")
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"x")]).addCallback(results.append)
    assert sent.paused and results == []
    sent.gone.add(b"r")
    clock.advance(HELD_RETRY_SECONDS)
    assert listener._peers[b"r"].departed and not sent.paused
    [[outcome]] = results
    assert outcome.status is Status.RETRY and "went away" in outcome.reason
    assert retry_timers(listener, clock) == []


def test_an_mtl_reader_past_max_backlog_bytes_is_cut_at_once() -> None:
    """Held bytes past max_backlog_bytes cut the reader at once: forgotten, counted, logged."""
    listener, _clock, control, sent, metrics = metered_mtl(flow=FlowPolicy(max_backlog_bytes=1000))
    reader, writer = leased_test_profile_peers(listener, control)
    sent.refuse.add(reader)
    with capturedLogs() as events:
        burst(listener, [(writer, mtl.Content(n, "", {}, b"x" * 300)) for n in range(5)])
    assert reader not in listener._peers and not sent.paused
    assert slow_consumers(metrics) == 1
    [line] = [e for e in events if "slow consumer" in e["log_format"]]
    assert "max_backlog_bytes 1000" in line["why"]


def test_silence_while_the_data_socket_is_not_read_is_not_death() -> None:
    """Peers are not declared dead for time the listener did not read them (it was paused).

    Dead after 12 s; a reader congested for 30 s (making progress) keeps the
    writer and itself alive; 12 s of silence after reading resumes does not.
    """
    flow = FlowPolicy(slow_consumer_seconds=0)  # never stuck for time alone
    listener, clock, control, sent, _metrics = metered_mtl(flow=flow, dead_after_seconds=12.0)
    reader, writer = leased_test_profile_peers(listener, control)
    sent.refuse.add(reader)
    burst(listener, [(writer, mtl.Content(n, "", {}, b"x")) for n in range(3)])
    clock.pump([1.0] * 30)
    assert sent.paused and {reader, writer} <= set(listener._peers)
    sent.refuse.clear()
    clock.advance(HELD_RETRY_SECONDS)
    assert not sent.paused
    clock.pump([1.0] * 11)
    assert {reader, writer} <= set(listener._peers)
    clock.pump([1.0] * 5)
    assert not {reader, writer} & set(listener._peers)


def test_mtl_writers_wait_while_max_in_flight_are_unanswered() -> None:
    """Past max_in_flight routed Contents unanswered, the writers' listener reads nothing.

    Their route's destination (another listener's confirm=full reader)
    answers when it confirms; at half the limit reading resumes.
    """
    world = bridge()
    writers = world.writers
    writers.settings = attrs.evolve(writers.settings, max_in_flight=4)
    burst(writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2, 3)])
    assert not world.writers_sent.paused
    burst(writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (4, 5)])
    assert world.writers_sent.paused
    data(world.readers, b"r", mtl.Confirm(2, True))
    assert world.writers_sent.paused  # 3 unanswered: more than half
    data(world.readers, b"r", mtl.Confirm(3, False))
    assert not world.writers_sent.paused and world.writers_sent.read_soon == 1


def test_mtl_writers_wait_for_a_congested_reader_on_another_listener() -> None:
    """Writers routed to a full reader of another listener wait; all is delivered, in order.

    The reader's listener holds what ZeroMQ refused and answers each copy
    once ZeroMQ took it; the writers' listener stops reading at
    max_in_flight, and reads again as the reader catches up.
    """
    world = bridge(reader_confirms="none")
    writers = world.writers
    writers.settings = attrs.evolve(writers.settings, max_in_flight=10)
    world.readers_sent.room[b"r"] = 2
    sequence = 0
    while not world.writers_sent.paused:
        burst(
            writers,
            [
                (b"w", mtl.Content(sequence + n, "in", {}, b"%d" % (sequence + n)))
                for n in range(1, 4)
            ],
        )
        sequence += 3
    assert sequence == 12 and world.readers_sent.paused
    assert answers(world.writers_sent, b"w") == {}
    world.readers_sent.room[b"r"] = 100
    world.clock.advance(HELD_RETRY_SECONDS)
    assert not world.writers_sent.paused and not world.readers_sent.paused
    assert [c.body for c in contents(world.readers_sent, b"r")] == [
        b"%d" % n for n in range(1, sequence + 1)
    ]
    assert answers(world.writers_sent, b"w") == {n: mtl.Confirm(n, False) for n in range(1, 13)}


def contents(sent: Sent, identity: bytes) -> list[mtl.Content]:
    """The Contents sent to one peer."""
    return [c for c in sent.commands(identity) if isinstance(c, mtl.Content)]


def mtl_lease(listener: MTLServer, control: Sent) -> mtl.Lease:
    """A Lease command for a confirm=none reader of ``news``."""
    return mtl.Lease(1, lease(listener, control, "Reader", "none"))


def summon(resource: str) -> mtl.Summon:
    """A Summon command."""
    return mtl.Summon(2, resource)


@pytest.fixture
def zmq_world() -> Iterator[Any]:
    """A txzmq factory on a memory reactor; shut down after the test."""
    factory = zmq_factory(MemoryReactorClock())
    yield factory
    factory.shutdown()


def test_zmq_sockets_have_bounded_queues(zmq_world: Any) -> None:
    """Sockets made here queue at most DEFAULT_HIGH_WATER_MARK each way (txzmq sets no limit)."""
    socket = ZmqSocket(zmq_world, zmq.DEALER, lambda _frames: None)
    raw = socket._connection.socket
    assert raw.getsockopt(zmq.SNDHWM) == raw.getsockopt(zmq.RCVHWM) == DEFAULT_HIGH_WATER_MARK
    assert DEFAULT_HIGH_WATER_MARK > 0


def test_a_router_refuses_past_the_mark_for_a_peer_that_does_not_read(zmq_world: Any) -> None:
    """ROUTER_MANDATORY with SNDHWM: sends to a peer that does not read fail past the mark.

    Over inproc the queue is the ROUTER's SNDHWM plus the peer's RCVHWM;
    what was taken is exactly what the peer reads later, in order, and the
    rest is refused (the positions ``send_many`` returns).
    """
    router = ZmqSocket(zmq_world, zmq.ROUTER, lambda _frames: None)
    router.set_option(zmq.ROUTER_MANDATORY, 1)
    router.set_option(zmq.SNDHWM, 5)
    router.bind("inproc://slow")
    peer = zmq_world.context.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"slow")
    peer.setsockopt(zmq.RCVHWM, 5)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect("inproc://slow")
    try:
        failed = router.send_many([[b"slow", b"%d" % n] for n in range(100)])
        taken = 100 - len(failed)
        assert 0 < taken <= 10
        assert failed == list(range(taken, 100))
        got = []
        while peer.poll(0):
            got.append(peer.recv_multipart()[0])
        assert got == [b"%d" % n for n in range(taken)]
    finally:
        peer.close(linger=0)


def test_the_listener_data_socket_takes_max_backlog_messages() -> None:
    """The data socket's SNDHWM is max_backlog_messages; its RCVHWM the bounded default."""
    reactor = MemoryReactorClock()
    listener = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(max_backlog_messages=123, ping_interval_seconds=5.0),
        host="127.0.0.1",
        port=0,
        router=Router(bind_routes([], {}), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
    )
    listener.start()
    try:
        raw = listener._data._connection.socket
        assert raw.getsockopt(zmq.SNDHWM) == 123
        assert raw.getsockopt(zmq.RCVHWM) == DEFAULT_HIGH_WATER_MARK
    finally:
        listener.stop()


def test_max_backlog_messages_is_configured_and_checked(tmp_path: Path) -> None:
    """An MTL listener's max_backlog_messages: 10,000 unless set; at least 1, named when wrong."""
    base = """
        [listeners.mtl]
        protocol = "mtl"
        endpoint = "tcp:0:interface=127.0.0.1"
    """
    path = tmp_path / "gateway.toml"
    path.write_text(textwrap.dedent(base))
    [default] = load_config(path).listeners
    assert isinstance(default.settings, MTLListenerSettings)
    assert default.settings.max_backlog_messages == 10_000
    path.write_text(textwrap.dedent(base + "    max_backlog_messages = 50\n"))
    [configured] = load_config(path).listeners
    assert isinstance(configured.settings, MTLListenerSettings)
    assert configured.settings.max_backlog_messages == 50
    path.write_text(textwrap.dedent(base + "    max_backlog_messages = 0\n"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [problem] = caught.value.problems
    assert problem.file == str(path)
    assert problem.key == "listeners.mtl.max_backlog_messages"
    assert "at least 1" in problem.reason


@pytest.mark.parametrize("backlog", [None, 50])
def test_the_listener_sockets_take_the_listen_backlog(backlog: int | None) -> None:
    """ZMQ_BACKLOG on both sockets: the listener's ``backlog`` (1024 unless set; ZeroMQ: 100)."""
    reactor = MemoryReactorClock()
    listener = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(ping_interval_seconds=5.0),
        host="127.0.0.1",
        port=0,
        router=Router(bind_routes([], {}), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
    )
    if backlog is not None:
        listener.backlog = backlog
    listener.start()
    try:
        for socket in (listener._control, listener._data):
            raw = socket._connection.socket
            assert raw.getsockopt(zmq.BACKLOG) == (backlog or 1024)
    finally:
        listener.stop()
