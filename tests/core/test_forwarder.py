"""Tests for `gateway.core.forwarder.LogForwarder`: delivery from the log, never losing one.

A real log in a temporary directory on the real reactor (its commits come
back through it); the forwarder's own timers (retry delays, the next chunk)
run on a `Clock` the tests advance. Deliveries are recorded and answered by
the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs import osiris
from gateway.core.forwarder import (
    Forwarded,
    ForwardedException,
    ForwarderSettings,
    LogForwarder,
)
from gateway.core.internal import hop_limit_refusal, internal_refusal
from gateway.core.log import LogStore, LogWriteError, StreamLog
from gateway.core.message import Message, Outcome

SETTINGS = ForwarderSettings(max_attempts=3, retry_initial_seconds=1.0, retry_max_seconds=4.0)


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    """An opened log store, closed after the test."""
    log = LogStore(tmp_path, _reactor())
    log.open()
    yield log
    pytest_twisted.blockon(log.close())


def to_message(entry: bytes, offset: int, timestamp: float) -> Message:
    """A stored entry as a message whose id is its offset."""
    return Message(id=str(offset), address="a", body=entry, timestamp=timestamp)


class Destination:
    """Records deliveries and answers each with the outcome ``answer`` picks."""

    def __init__(self, answer: Callable[[Message, int], Outcome]) -> None:
        self.answer = answer
        self.deliveries: list[tuple[str, bytes]] = []
        self.dead: list[tuple[bytes, str]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Record the batch; each message's attempt number is how often its id came before."""
        outcomes = []
        for message in messages:
            attempt = sum(1 for id_, _ in self.deliveries if id_ == message.id) + 1
            self.deliveries.append((message.id, message.body))
            outcomes.append(self.answer(message, attempt))
        return succeed(outcomes)

    def dead_letter(self, message: Message, outcome: Outcome) -> Deferred[object]:
        """Record a dead-lettered message and its last outcome."""
        self.dead.append((message.body, outcome.reason))
        return succeed(None)


def forwarder(stream: StreamLog, destination: Destination, clock: Clock) -> LogForwarder:
    """A forwarder of ``stream`` to the destination under reference ``fw``."""
    return LogForwarder(
        reference="fw",
        stream=stream,
        deliver=destination.deliver,
        to_message=to_message,
        dead_letter=destination.dead_letter,
        clock=clock,
        settings=SETTINGS,
    )


def accept(message: Message, attempt: int) -> Outcome:
    """Accept everything."""
    return Outcome.accepted()


@pytest_twisted.ensureDeferred
async def test_delivers_in_order_and_resumes_after_the_stored_offset(store: LogStore) -> None:
    """Every message once, in order; a new forwarder under the same reference skips them."""
    stream = store.create("s")
    await stream.append([b"a", b"b"])
    await stream.append([b"c"])
    clock = Clock()
    destination = Destination(accept)
    first = forwarder(stream, destination, clock)
    first.start()
    clock.advance(0)
    assert destination.deliveries == [("0", b"a"), ("1", b"b"), ("2", b"c")]
    assert stream.query_offset("fw") == 2
    first.stop()
    await stream.append([b"d"])
    second = forwarder(stream, destination, clock)
    second.start()
    clock.advance(0)
    assert destination.deliveries[3:] == [("3", b"d")]
    assert second.delivered == 1
    second.stop()


@pytest_twisted.ensureDeferred
async def test_retry_later_waits_and_delivers_again(store: LogStore) -> None:
    """A retry outcome is delivered again after a growing delay, as long as it takes.

    Each delivery again is counted in ``retried``.
    """
    stream = store.create("s")
    await stream.append([b"a"])
    clock = Clock()
    destination = Destination(
        lambda message, attempt: Outcome.accepted() if attempt > 4 else Outcome.retry("busy")
    )
    running = forwarder(stream, destination, clock)
    running.start()
    assert len(destination.deliveries) == 1
    for delay, count in ((1.0, 2), (2.0, 3), (4.0, 4), (4.0, 5)):
        clock.advance(delay - 0.01)
        assert len(destination.deliveries) == count - 1
        clock.advance(0.01)
        assert len(destination.deliveries) == count
    assert stream.query_offset("fw") == 0
    assert (running.delivered, running.dead_lettered, running.retried) == (1, 0, 4)
    running.stop()


@pytest_twisted.ensureDeferred
async def test_rejected_max_attempts_goes_to_the_dead_letter(store: LogStore) -> None:
    """A message rejected max_attempts times is dead-lettered; its neighbours are delivered."""
    stream = store.create("s")
    await stream.append([b"good", b"bad", b"fine"])
    clock = Clock()
    destination = Destination(
        lambda message, attempt: (
            Outcome.rejected("no") if message.body == b"bad" else accept(message, attempt)
        )
    )
    running = forwarder(stream, destination, clock)
    running.start()
    clock.advance(1.0)
    clock.advance(2.0)
    clock.advance(0)
    assert [body for _, body in destination.deliveries].count(b"bad") == 3
    assert destination.dead == [(b"bad", "no")]
    assert (running.delivered, running.dead_lettered, running.retried) == (2, 1, 2)
    assert stream.query_offset("fw") == 2
    running.stop()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    "refusal",
    [
        internal_refusal("stream listener s", "msggateway.route.r"),
        hop_limit_refusal("stream listener s", "echo"),
    ],
    ids=["internal-stream", "hop-limit"],
)
async def test_a_rejection_no_retry_fixes_is_dead_lettered_at_once(
    store: LogStore, refusal: Outcome
) -> None:
    """An address in the gateway's own namespace, or a loop: dead-lettered on the first refusal.

    Tried again it would only hold the chunk (and the route) for the
    retries' delays.
    """
    stream = store.create("s")
    await stream.append([b"good", b"looping"])
    clock = Clock()
    destination = Destination(
        lambda message, attempt: refusal if message.body == b"looping" else accept(message, attempt)
    )
    running = forwarder(stream, destination, clock)
    running.start()
    clock.advance(0)
    assert [body for _, body in destination.deliveries] == [b"good", b"looping"]
    assert destination.dead == [(b"looping", refusal.reason)]
    assert (running.delivered, running.dead_lettered) == (1, 1)
    assert stream.query_offset("fw") == 1
    running.stop()


@pytest_twisted.ensureDeferred
async def test_a_dead_letter_not_stored_is_delivered_again(store: LogStore) -> None:
    """The offset never passes a message whose dead letter failed (a full disk): it comes again."""
    stream = store.create("s")
    await stream.append([b"good", b"bad"])
    clock = Clock()
    destination = Destination(
        lambda message, attempt: (
            Outcome.rejected("no") if message.body == b"bad" else accept(message, attempt)
        )
    )
    stored = destination.dead_letter
    failures = [LogWriteError("the file system is full")]

    def dead_letter(message: Message, outcome: Outcome) -> Deferred[object]:
        return fail(failures.pop()) if failures else stored(message, outcome)

    running = LogForwarder(
        reference="fw",
        stream=stream,
        deliver=destination.deliver,
        to_message=to_message,
        dead_letter=dead_letter,
        clock=clock,
        settings=SETTINGS,
    )
    with capturedLogs() as events:
        running.start()
        clock.advance(1.0)
        clock.advance(2.0)  # third rejection: the dead letter fails
        assert destination.dead == []
        assert running.dead_lettered == 0
        assert stream.query_offset("fw") is None
        clock.advance(4.0)  # delivered again, rejected again, dead-lettered this time
    assert [body for _, body in destination.deliveries].count(b"bad") == 4
    assert destination.dead == [(b"bad", "no")]
    assert (running.delivered, running.dead_lettered) == (1, 1)
    assert stream.query_offset("fw") == 1
    failed = [e for e in events if "could not be stored" in e.get("log_format", "")]
    assert [e["offset"] for e in failed] == [1]
    running.stop()


@pytest_twisted.ensureDeferred
async def test_sub_batch_records_and_a_bad_one(store: LogStore) -> None:
    """Sub-batch records get an offset each; one that does not inflate is skipped, logged."""
    stream = store.create("s")
    good = osiris.SubBatch.parse(
        osiris.encode_sub_batch([b"r1", b"r2"], compression=osiris.COMPRESSION_GZIP)
    )
    broken = bytearray(osiris.encode_sub_batch([b"x" * 100], compression=osiris.COMPRESSION_GZIP))
    broken[osiris.SUB_BATCH_HEADER_BYTES + 12 :] = bytes(len(broken) - 12 - 11)  # not gzip any more
    await stream.append([b"a", good], sub_batches=True)
    await stream.append([osiris.SubBatch.parse(bytes(broken)), b"lost"], sub_batches=True)
    await stream.append([b"after"])
    clock = Clock()
    destination = Destination(accept)
    running = forwarder(stream, destination, clock)
    with capturedLogs() as events:
        running.start()
        clock.advance(0)
        clock.advance(0)
    assert destination.deliveries == [("0", b"a"), ("1", b"r1"), ("2", b"r2"), ("5", b"after")]
    skipped = [e for e in events if "skipping the rest" in e.get("log_format", "")]
    assert [(e["chunk_id"], e["stream"]) for e in skipped] == [(3, "s")]
    running.stop()


class HeldDestination:
    """Keeps each batch until the test answers it."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[bytes], Deferred[list[Outcome]]]] = []
        self.dead: list[bytes] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; the Deferred fires when the test answers."""
        d: Deferred[list[Outcome]] = Deferred()
        self.pending.append(([message.body for message in messages], d))
        return d

    def dead_letter(self, message: Message, outcome: Outcome) -> Deferred[object]:
        """Record a dead-lettered message."""
        self.dead.append(message.body)
        return succeed(None)


@pytest_twisted.ensureDeferred
async def test_outcomes_that_come_after_a_stop_are_ignored(store: LogStore) -> None:
    """A delivery answered after a stop changes nothing: after a start it is delivered again."""
    stream = store.create("s")
    await stream.append([b"a"])
    clock = Clock()
    destination = HeldDestination()
    running = LogForwarder(
        reference="fw",
        stream=stream,
        deliver=destination.deliver,
        to_message=to_message,
        dead_letter=destination.dead_letter,
        clock=clock,
        settings=ForwarderSettings(max_attempts=1),
    )
    running.start()
    running.stop()
    [(_, stale)] = destination.pending
    stale.callback([Outcome.rejected("gone")])  # would have dead-lettered it
    assert (destination.dead, running.dead_lettered, running.delivered) == ([], 0, 0)
    assert stream.query_offset("fw") is None
    running.start()
    clock.advance(0)
    assert [b for b, _ in destination.pending] == [[b"a"], [b"a"]]
    destination.pending[1][1].callback([Outcome.accepted()])
    assert running.delivered == 1 and stream.query_offset("fw") == 0
    assert not clock.getDelayedCalls() or all(
        call.getTime() == clock.seconds() for call in clock.getDelayedCalls()
    )
    running.stop()


@pytest_twisted.ensureDeferred
async def test_each_chunk_is_reported_as_a_range_with_its_exceptions(store: LogStore) -> None:
    """One report per chunk: its range, first answer time, and who needed more than one try."""
    stream = store.create("s")
    await stream.append([b"a", b"b", b"c", b"d"])
    stream.store_offset("fw", 0)  # as if stopped in the middle of the chunk
    await stream.append([b"e"])
    clock = Clock()
    clock.advance(100)
    destination = Destination(
        lambda message, attempt: (
            Outcome.rejected("no", "550")
            if message.body == b"b"
            else Outcome.retry("busy", "451")
            if message.body == b"c" and attempt == 1
            else Outcome.accepted()
        )
    )
    reports: list[Forwarded] = []
    running = LogForwarder(
        reference="fw",
        stream=stream,
        deliver=destination.deliver,
        to_message=to_message,
        dead_letter=destination.dead_letter,
        clock=clock,
        settings=SETTINGS,
        on_forwarded=reports.append,
    )
    running.start()
    clock.advance(1.0)
    clock.advance(2.0)
    clock.advance(0)
    [first, second] = reports
    stored = stream.read_chunks(0, 1, 1 << 20)[0].header.timestamp / 1000  # to_message's time
    assert first == Forwarded(
        1,
        3,
        stored,
        100.0,
        (
            ForwardedException(1, True, Outcome.rejected("no", "550"), 3, 103.0),
            ForwardedException(2, False, Outcome.retry("busy", "451"), 2, 101.0),
        ),
    )
    assert (second.first_offset, second.last_offset, second.exceptions) == (4, 4, ())
    assert [body for _, body in destination.deliveries][:3] == [b"b", b"c", b"d"]
    running.stop()
