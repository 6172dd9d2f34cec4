"""Tests for `gateway.core.durable`: a durable route commits batches and forwards them.

A real log in a temporary directory on the real reactor (commits come back
through it), the stream listener's real entry mapping, and a `Clock` for the
router's deadlines and the forwarders' timers. The destination keeps every
batch it is given and answers when the test says (or at once). The decoder
is the gateway's own, counted: a batch forwarded from memory is never
decoded.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs
from zope.interface import implementer

from gateway.core.addressing import AddressPattern
from gateway.core.durable import DurableDelivery, DurableRoutes, route_stream_name
from gateway.core.forwarder import ForwarderSettings, LogForwarder
from gateway.core.interfaces import IDestination
from gateway.core.log import FsyncPolicy, LogStore, Retention, StreamLog
from gateway.core.message import Message, Outcome, Status
from gateway.core.outcomes import OUTCOME_STREAM, OutcomeRecorder
from gateway.core.router import Route, Router, bind_routes
from gateway.protocols.stream.bridge import dead_letter_writer
from gateway.protocols.stream.mapping import (
    durable_entries,
    entry_from_message,
    message_from_entry,
)
from tests.core.test_log import HeldWrites, next_turn, read_all
from tests.core.test_outcomes import _logged

ROUTE = Route(
    name="r",
    source="mail",
    pattern=AddressPattern("#"),
    destination="far",
    durable=True,
    timeout_seconds=10.0,
    max_attempts=3,
)
REFERENCE = "msggateway.forwarder.r"
OUTCOMES = {
    "accepted": Outcome.accepted(),
    "retry": Outcome.retry("busy", "451"),
    "rejected": Outcome.rejected("no such mailbox", "550"),
}


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


def open_store(directory: Path, **options: Any) -> LogStore:
    """An opened store (fsync never: these tests are about order, not disks)."""
    options.setdefault("fsync", FsyncPolicy.NEVER)
    store = LogStore(directory, _reactor(), **options)
    store.open()
    return store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    """An opened log store, closed after the test."""
    log = open_store(tmp_path)
    yield log
    pytest_twisted.blockon(log.close())


async def settle(store: LogStore, clock: Clock) -> None:
    """Commit what is queued and run the timers due now, until nothing moves.

    Uses the store's group commit directly: the tests need the log idle, and
    only its owner's close offers that otherwise.
    """
    for _ in range(1000):
        # A turn first: an awaited commit resumes the test from inside the
        # log's callbacks, before the log has woken its readers.
        await next_turn()
        await store._committer.drain()
        if not any(call.getTime() <= clock.seconds() for call in clock.getDelayedCalls()):
            return
        clock.advance(0)
    raise AssertionError("the forwarders never settle")


async def recorded(recorder: OutcomeRecorder, directory: Path) -> list[dict[str, Any]]:
    """Every outcome record in the log, once the recorder's last batch is committed."""
    flushed = recorder.flush()
    if flushed is not None:
        await flushed
    return _logged(directory)


def mail(number: int, size: int = 20) -> Message:
    """Message ``number``: a unique id, a body of ``size`` bytes, an envelope."""
    return Message(
        body=(b"body %d " % number).ljust(size, b"."),
        address="mail.far",
        id=f"m{number}",
        sender="a@near.example",
        recipients=("x@far.example",),
        timestamp=1_700_000_000.0 + number,
    )


class CountingDecoder:
    """The gateway's durable-route decoder, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, entry: bytes, offset: int, timestamp: float) -> Message:
        """Decode as the service does; count."""
        self.calls += 1
        return message_from_entry(
            entry, stream="", timestamp=timestamp, offset=offset, address_from_to=True
        )


@implementer(IDestination)
class Far:
    """Keeps every batch; answers it at once with ``answer``, or when the test says.

    Args:
        answer: Each message's outcome from its id and attempt number; None
            to hold every batch until `reply`.
    """

    name = "far"

    def __init__(self, answer: Callable[[Message, int], Outcome] | None = None) -> None:
        self.answer = answer
        self.batches: list[list[Message]] = []
        self.pending: deque[tuple[list[Message], Deferred[list[Outcome]], int]] = deque()
        self.attempts: dict[str, int] = {}
        self.epoch = 0
        """Counts the forwarder's stops: an accepted message comes again only after one."""
        self.accepted: dict[str, int] = {}
        self.again: list[str] = []
        """Messages delivered again in the epoch they were accepted in (never, if right)."""

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; answer it now or later."""
        batch = list(messages)
        self.batches.append(batch)
        self.again.extend(m.id for m in batch if self.accepted.get(m.id) == self.epoch)
        if self.answer is None:
            d: Deferred[list[Outcome]] = Deferred()
            self.pending.append((batch, d, self.epoch))
            return d
        outcomes = []
        for message in batch:
            attempt = self.attempts[message.id] = self.attempts.get(message.id, 0) + 1
            outcomes.append(self.answer(message, attempt))
        return succeed(outcomes)

    def reply(self, statuses: Sequence[str] = ("accepted",)) -> list[Message]:
        """Answer the oldest held batch: message ``i`` gets ``statuses[i % len]``."""
        batch, d, epoch = self.pending.popleft()
        outcomes = [OUTCOMES[statuses[i % len(statuses)]] for i in range(len(batch))]
        for message, outcome in zip(batch, outcomes, strict=True):
            if outcome.is_accepted:
                self.accepted[message.id] = epoch
        d.callback(outcomes)
        return batch

    def ids(self) -> list[list[str]]:
        """The ids of every batch delivered, in order."""
        return [[message.id for message in batch] for batch in self.batches]


def accept_all(message: Message, attempt: int) -> Outcome:
    """Accept everything."""
    return Outcome.accepted()


def durable_routes(
    store: LogStore, clock: Clock, decoder: CountingDecoder, recorder: OutcomeRecorder | None = None
) -> DurableRoutes:
    """The gateway's durable routes over ``store``, as the service builds them."""
    routes = DurableRoutes(
        store,
        clock,
        encode=durable_entries,
        decode=decoder,
        dead_letter=lambda stream, route: dead_letter_writer(store, stream, route),
    )
    routes.recorder = recorder
    return routes


def last_offset_read(stream: StreamLog) -> int | None:
    """The last offset of the stream's last user chunk, as a reader finds it (None: empty)."""
    chunks = read_all(stream)
    return chunks[-1].next_chunk_id - 1 if chunks else None


# --- from memory at the tail --------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_batch_at_the_tail_is_forwarded_from_memory(store: LogStore) -> None:
    """Each committed batch reaches the destination as the same objects, never decoded."""
    clock = Clock()
    decoder = CountingDecoder()
    routes = durable_routes(store, clock, decoder)
    far = Far(accept_all)
    delivery = routes.delivery(ROUTE, far)
    routes.start()
    batches = [[mail(0), mail(1)], [mail(2)], [mail(3), mail(4), mail(5)]]
    for batch in batches:
        outcomes = await delivery.deliver(batch)
        assert outcomes == [Outcome.accepted()] * len(batch)
        await settle(store, clock)
    assert far.batches == batches
    for got, sent in zip(far.batches, batches, strict=True):
        assert all(a is b for a, b in zip(got, sent, strict=True))
    forwarder = routes.forwarders["r"]
    assert decoder.calls == 0
    assert (forwarder.chunks_from_memory, forwarder.chunks_read) == (3, 0)
    assert forwarder.held_messages == 0
    stream = store.get(route_stream_name("r"))
    assert stream is not None
    assert stream.query_offset(REFERENCE) == last_offset_read(stream)
    routes.stop()


@pytest_twisted.ensureDeferred
async def test_batches_sharing_a_chunk_go_as_one(store: LogStore) -> None:
    """Two batches committed in one turn share a chunk: one delivery, from memory."""
    clock = Clock()
    decoder = CountingDecoder()
    routes = durable_routes(store, clock, decoder)
    far = Far(accept_all)
    delivery = routes.delivery(ROUTE, far)
    routes.start()
    await gatherResults([delivery.deliver([mail(0), mail(1)]), delivery.deliver([mail(2)])])
    await settle(store, clock)
    assert far.ids() == [["m0", "m1", "m2"]]
    assert decoder.calls == 0
    routes.stop()


@pytest_twisted.ensureDeferred
async def test_a_batch_across_two_chunks(tmp_path: Path) -> None:
    """A batch that fills a chunk goes on after a new segment's snapshot; both parts from memory."""
    store = open_store(tmp_path, default_retention=Retention(max_segment_bytes=300))
    try:
        clock = Clock()
        decoder = CountingDecoder()
        routes = durable_routes(store, clock, decoder)
        far = Far(accept_all)
        delivery = routes.delivery(ROUTE, far)
        routes.start()
        batch = [mail(0, 5 << 20), mail(1, 5 << 20), mail(2)]
        await delivery.deliver(batch)
        await settle(store, clock)
        stream = store.get(route_stream_name("r"))
        assert stream is not None
        assert [c.chunk_id for c in read_all(stream)[:2]] == [0, 2]  # 1 is the snapshot
        assert far.ids() == [["m0"], ["m1", "m2"]]
        assert decoder.calls == 0
        assert stream.query_offset(REFERENCE) == 3
        routes.stop()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_chunk_shared_with_another_writer_is_read(store: LogStore) -> None:
    """What is not all held (another append in the chunk) is read and decoded instead."""
    clock = Clock()
    decoder = CountingDecoder()
    routes = durable_routes(store, clock, decoder)
    far = Far(accept_all)
    delivery = routes.delivery(ROUTE, far)
    routes.start()
    stream = store.get(route_stream_name("r"))
    assert stream is not None
    await gatherResults([stream.append([entry_from_message(mail(0))]), delivery.deliver([mail(1)])])
    await settle(store, clock)
    assert far.ids() == [["m0", "m1"]]
    assert decoder.calls == 2
    await delivery.deliver([mail(2)])
    await settle(store, clock)
    assert far.ids()[1:] == [["m2"]]
    assert decoder.calls == 2  # at the tail again: from memory
    routes.stop()


@pytest_twisted.ensureDeferred
async def test_a_batch_not_held_between_two_held_ones(store: LogStore) -> None:
    """Three batches in one chunk, the middle one too big to hold: the chunk is read."""
    clock = Clock()
    decoder = CountingDecoder()
    far = Far(accept_all)
    stream = store.create(route_stream_name("r"))
    forwarder = LogForwarder(
        reference=REFERENCE,
        stream=stream,
        deliver=far.deliver,
        to_message=decoder,
        dead_letter=lambda message, outcome: succeed(None),
        clock=clock,
        settings=ForwarderSettings(max_held_messages=3),
    )
    delivery = DurableDelivery(ROUTE, stream, durable_entries, forwarder=forwarder)
    forwarder.start()
    batches = [[mail(0), mail(1)], [mail(2), mail(3)], [mail(4)]]
    await gatherResults([delivery.deliver(batch) for batch in batches])
    assert forwarder.not_held == 1
    await settle(store, clock)
    assert far.ids() == [["m0", "m1", "m2", "m3", "m4"]]
    assert decoder.calls == 5 and forwarder.held_messages == 0
    forwarder.stop()


@pytest_twisted.ensureDeferred
async def test_behind_it_reads_and_what_it_holds_is_bounded(store: LogStore) -> None:
    """A stalled destination: held batches stop at the limit, the rest is read in its turn."""
    clock = Clock()
    decoder = CountingDecoder()
    far = Far()
    stream = store.create(route_stream_name("r"))
    forwarder = LogForwarder(
        reference=REFERENCE,
        stream=stream,
        deliver=far.deliver,
        to_message=decoder,
        dead_letter=lambda message, outcome: succeed(None),
        clock=clock,
        settings=ForwarderSettings(max_held_messages=4, max_held_bytes=1 << 20),
    )
    delivery = DurableDelivery(ROUTE, stream, durable_entries, forwarder=forwarder)
    forwarder.start()
    number = 0
    for _ in range(5):  # m0-m1 in delivery, m2-m3 held, the rest not
        await delivery.deliver([mail(number), mail(number + 1)])
        number += 2
        await settle(store, clock)
        assert forwarder.held_messages <= 4
    assert (forwarder.held_messages, forwarder.not_held) == (4, 3)
    while far.pending:
        far.reply()
        await settle(store, clock)
    assert far.ids() == [["m0", "m1"], ["m2", "m3"], ["m4", "m5"], ["m6", "m7"], ["m8", "m9"]]
    assert decoder.calls == 6
    assert forwarder.held_messages == 0
    await delivery.deliver([mail(10)])  # caught up: from memory again
    await settle(store, clock)
    far.reply()
    await settle(store, clock)
    assert far.ids()[-1] == ["m10"] and decoder.calls == 6
    assert (forwarder.chunks_from_memory, forwarder.chunks_read) == (3, 3)
    assert stream.query_offset(REFERENCE) == last_offset_read(stream)
    forwarder.stop()


@pytest_twisted.ensureDeferred
async def test_after_a_restart_it_reads_from_the_log(tmp_path: Path) -> None:
    """Committed while stopped, or before the process restarted: read from the stored offset."""
    store = open_store(tmp_path)
    clock = Clock()
    decoder = CountingDecoder()
    far = Far(accept_all)
    try:
        routes = durable_routes(store, clock, decoder)
        delivery = routes.delivery(ROUTE, far)
        routes.start()
        await delivery.deliver([mail(0)])
        await settle(store, clock)
        routes.stop()
        await delivery.deliver([mail(1), mail(2)])  # not held: stopped
        routes.start()
        await settle(store, clock)
        assert far.ids() == [["m0"], ["m1", "m2"]]
        assert decoder.calls == 2
        routes.stop()
        await delivery.deliver([mail(3)])
    finally:
        await store.close()
    store = open_store(tmp_path)  # the next run of the gateway
    try:
        routes = durable_routes(store, clock, decoder)
        delivery = routes.delivery(ROUTE, far)
        routes.start()
        await settle(store, clock)
        assert far.ids()[2:] == [["m3"]]
        assert decoder.calls == 3
        await delivery.deliver([mail(4)])
        await settle(store, clock)
        assert far.ids()[3:] == [["m4"]] and decoder.calls == 3
        routes.stop()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_commit_past_the_deadline_is_forwarded_from_the_log(tmp_path: Path) -> None:
    """The router's deadline passes before the commit: retry later, then read and delivered."""
    writes = HeldWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        clock = Clock()
        decoder = CountingDecoder()
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
        routes = durable_routes(store, clock, decoder, recorder)
        far = Far(accept_all)
        router = Router(bind_routes([ROUTE], {"far": far}, routes.delivery), clock)
        router.recorder = recorder
        routes.start()
        answered = router.dispatch("mail", [mail(0)])
        await writes.started
        clock.advance(ROUTE.timeout_seconds)
        [outcome] = await answered
        assert outcome.status is Status.RETRY
        assert outcome.reason == "route r: the log did not commit the message within 10 seconds"
        writes.release.set()
        await settle(store, clock)
        assert far.ids() == [["m0"]] and decoder.calls == 1
        records = [
            (r["kind"], r["status"], r["id"], r["first"])
            for r in await recorded(recorder, tmp_path)
        ]
        assert records[0] == ("route", "retry", "m0", None)
        assert records[1:] == [("forward", "accepted", None, 0)]
        routes.stop()
    finally:
        writes.release.set()
        await store.close()


# --- outcome records ----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_records_are_ranges_of_the_routes_stream(tmp_path: Path) -> None:
    """A committed batch is one range; a forwarded chunk one range with its exceptions."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        clock.advance(1000)
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)

        def answer(message: Message, attempt: int) -> Outcome:
            if message.id == "m1":
                return OUTCOMES["rejected"]
            if message.id == "m2" and attempt == 1:
                return OUTCOMES["retry"]
            return OUTCOMES["accepted"]

        far = Far(answer)
        routes = durable_routes(store, clock, CountingDecoder(), recorder)
        router = Router(bind_routes([ROUTE], {"far": far}, routes.delivery), clock)
        router.recorder = recorder
        routes.start()
        assert (
            await router.dispatch("mail", [mail(0), mail(1), mail(2), mail(3)])
            == [Outcome.accepted()] * 4
        )
        await settle(store, clock)
        for _ in range(3):
            clock.advance(10)
            await settle(store, clock)
        assert far.ids() == [["m0", "m1", "m2", "m3"], ["m1", "m2"], ["m1"]]
        routed, forwarded = await recorded(recorder, tmp_path)
        stream = route_stream_name("r")
        assert routed == {
            "kind": "route",
            "route": "r",
            "source": "mail",
            "id": None,
            "address": None,
            "sender": None,
            "recipients": None,
            "bytes": None,
            "arrived": 1000.0,
            "status": "accepted",
            "code": None,
            "reason": "",
            "finished": 1000.0,
            "stream": stream,
            "first": 0,
            "last": 3,
            "exceptions": [],
        }
        assert (forwarded["kind"], forwarded["source"], forwarded["stream"]) == (
            "forward",
            "log",
            stream,
        )
        assert (forwarded["first"], forwarded["last"], forwarded["status"]) == (0, 3, "accepted")
        assert (forwarded["arrived"], forwarded["finished"]) == (mail(0).timestamp, 1000.0)
        assert forwarded["exceptions"] == [
            {
                "offset": 1,
                "kind": "dead-letter",
                "status": "rejected",
                "code": "550",
                "reason": "no such mailbox",
                "finished": 1020.0,
                "attempts": 3,
            },
            {
                "offset": 2,
                "kind": "forward",
                "status": "accepted",
                "code": "451",
                "reason": "busy",
                "finished": 1010.0,
                "attempts": 2,
            },
        ]
        dead = store.get(ROUTE.dead_letter)
        assert dead is not None and dead.next_offset == 1
        routes.stop()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_batch_the_log_refused_is_recorded_per_message(tmp_path: Path) -> None:
    """No offsets to name: each message's record, with the retry its sender was told."""
    store = open_store(tmp_path)
    try:
        clock = Clock()
        recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
        routes = durable_routes(store, clock, CountingDecoder(), recorder)
        delivery = routes.delivery(ROUTE, Far(accept_all))
        await store.delete(route_stream_name("r"))
        outcomes = await delivery.deliver([mail(0), mail(1)])
        assert [o.status for o in outcomes] == [Status.RETRY] * 2
        records = await recorded(recorder, tmp_path)
        assert [(r["id"], r["status"], r["address"], r["stream"]) for r in records] == [
            ("m0", "retry", "mail.far", None),
            ("m1", "retry", "mail.far", None),
        ]
        assert records[0]["reason"] == "route r: the log could not store the message"
    finally:
        await store.close()


async def test_a_batch_after_the_log_closed_is_answered_retry_quietly(tmp_path: Path) -> None:
    """The gateway is stopping: retry later, no record, no traceback, one line for all."""
    store = open_store(tmp_path)
    clock = Clock()
    recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
    routes = durable_routes(store, clock, CountingDecoder(), recorder)
    delivery = routes.delivery(ROUTE, Far(accept_all))
    await store.close()
    with capturedLogs() as events:
        first = await delivery.deliver([mail(0), mail(1)])
        second = await delivery.deliver([mail(2)])
    for outcome in (*first, *second):
        assert outcome.status is Status.RETRY
        assert outcome.reason == "route r: the gateway is stopping"
    assert [event["log_level"] for event in events] == [LogLevel.info]
    assert "the log is closed" in events[0]["log_format"]
    assert "log_failure" not in events[0]
    assert routes.refused_closed == 3
    assert recorder.flush() is None  # nothing recorded: the log is closed


# --- memory and reading agree -------------------------------------------------------


class World:
    """One durable route over its own stream: the delivery, the forwarder, the destination.

    Two worlds take the same steps; one hands committed batches to its
    forwarder (``from_memory``), the other never does, so it reads all.
    """

    def __init__(
        self, store: LogStore, clock: Clock, settings: ForwarderSettings, *, from_memory: bool
    ) -> None:
        self.stream = store.create("memory" if from_memory else "reading")
        self.clock = clock
        self.settings = settings
        self.from_memory = from_memory
        self.far = Far()
        self.decoder = CountingDecoder()
        self.dead: list[str] = []
        self.rebuild()

    def rebuild(self) -> None:
        """A new forwarder and delivery, as after the process restarted."""
        self.forwarder = LogForwarder(
            reference=REFERENCE,
            stream=self.stream,
            deliver=self.far.deliver,
            to_message=self.decoder,
            dead_letter=self._dead_letter,
            clock=self.clock,
            settings=self.settings,
        )
        self.delivery = DurableDelivery(
            ROUTE,
            self.stream,
            durable_entries,
            forwarder=self.forwarder if self.from_memory else None,
        )

    def _dead_letter(self, message: Message, outcome: Outcome) -> Deferred[object]:
        self.dead.append(message.id)
        return succeed(None)


_COMMIT = st.tuples(st.just("commit"), st.lists(st.integers(1, 4), min_size=1, max_size=3))
_REPLY = st.tuples(
    st.just("reply"), st.lists(st.sampled_from(sorted(OUTCOMES)), min_size=1, max_size=3)
)
_STEPS = st.one_of(
    # Weighted: mostly commits, replies and delays; now and then a stop.
    _COMMIT,
    _COMMIT,
    _REPLY,
    _REPLY,
    _REPLY,
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0])),
    st.tuples(st.sampled_from(["bounce", "restart", "stop", "start"]), st.none()),
)


async def _run(steps: list[tuple[str, Any]], held: int, directory: Path) -> None:
    store = open_store(directory)
    worlds: list[World] = []
    try:
        clock = Clock()
        settings = ForwarderSettings(
            max_attempts=3,
            retry_initial_seconds=1.0,
            retry_max_seconds=4.0,
            max_held_messages=held,
        )
        worlds.extend(World(store, clock, settings, from_memory=m) for m in (True, False))
        for world in worlds:
            world.forwarder.start()
        sent: list[str] = []
        number = 0
        for step, argument in steps:
            if step == "commit":
                batches = []
                for size in argument:
                    batches.append([mail(n) for n in range(number, number + size)])
                    number += size
                sent.extend(message.id for batch in batches for message in batch)
                await gatherResults(
                    [world.delivery.deliver(batch) for world in worlds for batch in batches]
                )
            elif step == "reply":  # then as long as any retry waits: the next round is out
                if all(world.far.pending for world in worlds):
                    replied = [world.far.reply(argument) for world in worlds]
                    assert [m.id for m in replied[0]] == [m.id for m in replied[1]]
                await settle(store, clock)
                clock.advance(settings.retry_max_seconds)
            elif step == "advance":
                clock.advance(argument)
            else:  # bounce: stop and start again; restart: a new forwarder
                for world in worlds:
                    if step != "start":
                        world.forwarder.stop()
                        world.far.epoch += 1
                    if step == "restart":
                        world.rebuild()
                    if step != "stop":
                        world.forwarder.start()
            await settle(store, clock)
            memory, reading = worlds
            assert memory.far.ids() == reading.far.ids()
            assert memory.forwarder.held_messages <= held
        for world in worlds:  # whatever was left: start, accept everything
            world.forwarder.start()
        for _ in range(100):
            for world in worlds:
                while world.far.pending:
                    world.far.reply()
            clock.advance(4.0)
            await settle(store, clock)
            if not any(world.far.pending for world in worlds):
                break
        memory, reading = worlds
        assert memory.far.ids() == reading.far.ids()
        assert memory.dead == reading.dead
        assert memory.decoder.calls <= reading.decoder.calls
        for world in worlds:
            assert world.far.again == []  # accepted means done, until a stop
            assert world.stream.query_offset(REFERENCE) == last_offset_read(world.stream)
            delivered = [message for batch in world.far.ids() for message in batch]
            assert set(delivered) == set(sent)  # none skipped
            first_seen = list(dict.fromkeys(delivered))
            assert first_seen == sent  # in order
    finally:
        for world in worlds:
            world.forwarder.stop()
        await store.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEPS, min_size=3, max_size=30), held=st.integers(1, 8))
def test_memory_and_reading_deliver_the_same(
    steps: list[tuple[str, Any]], held: int
) -> Deferred[None]:
    """Any interleaving of commits, replies, retries and restarts: the same deliveries as reading.

    The forwarder that is handed committed batches delivers exactly what
    (and in exactly the batches) a forwarder that reads everything does:
    nothing twice that reading would not, nothing skipped, in order, the
    same dead letters and stored offsets, and never more decoding.
    (pytest-twisted runs each example on the reactor and waits for it.)
    """
    directory = Path(tempfile.mkdtemp(prefix="durable-"))
    run = Deferred.fromCoroutine(_run(steps, held, directory))
    return run.addBoth(_removing(directory))


def _removing(directory: Path) -> Callable[[object], object]:
    def remove(result: object) -> object:
        shutil.rmtree(directory, ignore_errors=True)
        return result

    return remove


def test_nothing_is_held_while_stopped(store: LogStore) -> None:
    """A stopped forwarder holds nothing; after a start it reads what it missed."""
    clock = Clock()
    far = Far(accept_all)
    stream = store.create("s")
    forwarder = LogForwarder(
        reference=REFERENCE,
        stream=stream,
        deliver=far.deliver,
        to_message=CountingDecoder(),
        dead_letter=lambda message, outcome: succeed(None),
        clock=clock,
    )
    assert not forwarder.hold(0, [mail(0)], 10)
    forwarder.start()
    assert forwarder.hold(5, [mail(5)], 10) and forwarder.held_messages == 1
    forwarder.stop()
    assert forwarder.held_messages == 0
