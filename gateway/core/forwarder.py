"""Deliver messages from a stream of the embedded log, never losing one.

A `LogForwarder` reads one stream from the offset it stored last, a chunk at
a time, hands every message of the chunk to its delivery function, and
stores the chunk's last offset once every message has an outcome:

* accepted: done;
* retry later: delivered again after a growing delay (temporary failures
  wait as long as it takes: the log holds them);
* rejected: tried again up to ``max_attempts`` times, then written to the
  dead-letter stream with the reason, and done.

It is used by durable routes (their own stream, delivering to the route's
destination) and by routes from a stream listener (delivering along the
router). Delivery is at least once: after a crash, the messages of the
chunk that was in progress are delivered again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
from twisted.internet.defer import Deferred, DeferredList, fail
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import osiris
from gateway.core.log import StoredChunk, StreamLog
from gateway.core.message import Message, Outcome, Status

__all__ = ["ForwarderSettings", "LogForwarder"]

MAX_CHUNK_BYTES: Final = 8 * 1024 * 1024
"""A forwarder reads at most this much of the log at a time."""


@attrs.frozen(kw_only=True)
class ForwarderSettings:
    """How a forwarder retries.

    Attributes:
        max_attempts: Deliveries of a message that is rejected before it
            goes to the dead-letter stream.
        retry_initial_seconds: First delay before delivering again.
        retry_max_seconds: Longest delay between attempts.
    """

    max_attempts: int = 5
    retry_initial_seconds: float = 0.5
    retry_max_seconds: float = 30.0


class _Pending:
    __slots__ = ("attempts", "message", "offset", "outcome")

    def __init__(self, offset: int, message: Message) -> None:
        self.offset = offset
        self.message = message
        self.attempts = 0
        self.outcome: Outcome | None = None


class LogForwarder:
    """Forwards one stream's messages, in chunk order, from a stored offset.

    Args:
        reference: The name its offset is stored under in the stream.
        stream: The stream it reads.
        deliver: Delivers a batch; fires with one outcome per message.
        to_message: Turns a stored entry (with its offset and the chunk's
            timestamp in seconds) back into a message.
        dead_letter: Stores a message that kept being rejected, with the
            last outcome; fires once it is stored.
        clock: For retry delays.
        settings: Retry settings.
        on_settled: Told of each message delivered (``False``) or
            dead-lettered (``True``), with its outcome: the outcome record.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        reference: str,
        stream: StreamLog,
        deliver: Callable[[Sequence[Message]], Deferred[list[Outcome]]],
        to_message: Callable[[bytes, int, float], Message],
        dead_letter: Callable[[Message, Outcome], Deferred[object]],
        clock: IReactorTime,
        settings: ForwarderSettings = ForwarderSettings(),
        on_settled: Callable[[Message, Outcome, bool], None] | None = None,
    ) -> None:
        self.reference = reference
        self._on_settled = on_settled
        self.stream = stream
        self._deliver = deliver
        self._to_message = to_message
        self._dead_letter = dead_letter
        self._clock = clock
        self._settings = settings
        self._running = False
        self._next_chunk = 0
        self._after_offset = -1
        self._waiting: Deferred[None] | None = None
        self._timers: set[IDelayedCall] = set()
        self.delivered = 0
        self.dead_lettered = 0

    @property
    def running(self) -> bool:
        """Whether it is forwarding."""
        return self._running

    def start(self) -> None:
        """Start from the stored offset (or the start of the stream)."""
        if self._running:
            return
        self._running = True
        stored = self.stream.query_offset(self.reference)
        if stored is None:
            self._next_chunk = self.stream.seek(("first",))
        else:
            self._after_offset = stored
            self._next_chunk = self.stream.seek(("offset", stored + 1))
        self._step()

    def stop(self) -> None:
        """Stop; what is in progress is delivered again on the next start."""
        self._running = False
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.cancel()

    def _step(self) -> None:
        if not self._running:
            return
        chunks = self.stream.read_chunks(self._next_chunk, 1, MAX_CHUNK_BYTES)
        if not chunks:
            self._waiting = self.stream.wait_for(self._next_chunk)
            self._waiting.addCallbacks(self._woken, self._wait_failed)
            return
        chunk = chunks[0]
        pending = self._pending_of(chunk)
        if not pending:
            self._chunk_done(chunk)
            return
        self._attempt(pending).addCallback(lambda _: self._chunk_done(chunk))

    def _woken(self, _: object) -> None:
        self._waiting = None
        self._step()

    def _wait_failed(self, failure: Failure) -> None:
        self._waiting = None
        if self._running:
            self._log.failure(
                "forwarder {reference}: waiting on {stream} failed",
                failure,
                reference=self.reference,
                stream=self.stream.name,
            )

    def _pending_of(self, chunk: StoredChunk) -> list[_Pending]:
        data = chunk.payload[osiris.HEADER_BYTES :]
        timestamp = chunk.header.timestamp / 1000
        pending: list[_Pending] = []
        entries = enumerate(osiris.iter_entries(data))
        while True:
            try:
                index, entry = next(entries)
            except StopIteration:
                break
            except osiris.OsirisError as exc:
                # A sub-batch that does not inflate (a client's bad gzip):
                # its records cannot be read here; consumers see the same.
                self._log.error(
                    "forwarder {reference}: skipping the rest of chunk {chunk_id} of"
                    " {stream}: {reason}",
                    reference=self.reference,
                    chunk_id=chunk.chunk_id,
                    stream=self.stream.name,
                    reason=exc.reason,
                )
                break
            offset = chunk.chunk_id + index
            if offset <= self._after_offset:
                continue  # delivered before a restart, in a chunk resumed midway
            pending.append(_Pending(offset, self._to_message(bytes(entry), offset, timestamp)))
        return pending

    def _attempt(self, pending: list[_Pending]) -> Deferred[None]:
        """Deliver the pending messages as one batch until each has a final outcome."""
        for item in pending:
            item.attempts += 1
        try:
            d = self._deliver([item.message for item in pending])
        except Exception:
            d = fail()

        def record(outcomes: list[Outcome]) -> None:
            for item, outcome in zip(pending, outcomes, strict=True):
                item.outcome = outcome

        def broken(failure: Failure) -> None:
            self._log.failure(
                "forwarder {reference}: delivery failed unexpectedly",
                failure,
                reference=self.reference,
            )
            retry = Outcome.retry("internal error")
            for item in pending:
                item.outcome = retry

        d.addCallbacks(record, broken)
        return d.addCallback(lambda _: self._settle(pending))

    def _settle(self, pending: list[_Pending]) -> Deferred[None] | None:
        again: list[_Pending] = []
        dead: list[Deferred[object]] = []
        settings = self._settings
        for item in pending:
            outcome = item.outcome
            assert outcome is not None
            if outcome.status is Status.ACCEPTED:
                self.delivered += 1
                if self._on_settled is not None:
                    self._on_settled(item.message, outcome, False)
            elif outcome.status is Status.REJECTED and item.attempts >= settings.max_attempts:
                self.dead_lettered += 1
                self._log.warn(
                    "forwarder {reference}: offset {offset} rejected {attempts} times,"
                    " moved to the dead-letter stream: {reason}",
                    reference=self.reference,
                    offset=item.offset,
                    attempts=item.attempts,
                    reason=outcome.reason,
                )
                dead.append(self._dead_letter(item.message, outcome))
                if self._on_settled is not None:
                    self._on_settled(item.message, outcome, True)
            else:
                again.append(item)
        if not again:
            if not dead:
                return None
            stored: Deferred[Any] = DeferredList(dead, consumeErrors=True)
            return stored.addCallback(lambda _: None)
        attempts = min(item.attempts for item in again)
        delay = min(
            settings.retry_initial_seconds * 2 ** (attempts - 1), settings.retry_max_seconds
        )
        retried: Deferred[None] = Deferred()

        def fire() -> None:
            self._timers.discard(timer)
            if self._running:
                retried.callback(None)

        timer = self._clock.callLater(delay, fire)
        self._timers.add(timer)
        later = retried.addCallback(lambda _: self._attempt(again))
        if dead:
            return DeferredList([later, *dead], consumeErrors=True).addCallback(lambda _: None)
        return later

    def _chunk_done(self, chunk: StoredChunk) -> None:
        if not self._running:
            return
        last = chunk.chunk_id + chunk.header.num_records - 1
        self.stream.store_offset(self.reference, last)
        self._after_offset = last
        self._next_chunk = chunk.next_chunk_id
        # The next chunk on the next reactor turn: a long backlog neither
        # recurses nor keeps the reactor from everything else.
        timer = self._clock.callLater(0, self._next)
        self._timers.add(timer)

    def _next(self) -> None:
        self._timers = {timer for timer in self._timers if timer.active()}
        self._step()
