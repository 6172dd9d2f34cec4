"""Deliver messages from a stream of the embedded log, never losing one.

A `LogForwarder` goes through one stream from the offset it stored last, a
chunk at a time, hands the chunk's messages as one batch to its delivery
function, and stores the chunk's last offset once every message has an
outcome:

* accepted: done;
* retry later: delivered again after a growing delay (temporary failures
  wait as long as it takes: the log holds them);
* rejected: tried again up to ``max_attempts`` times, then written to the
  dead-letter stream with the reason, and done; a rejection no retry can fix
  (`gateway.core.internal.FINAL_REJECTIONS`: an address in the gateway's own
  namespace, a message that loops) is dead-lettered at once.

It is used by durable routes (their own stream, delivering to the route's
destination) and by routes from a stream listener (delivering along the
router). Delivery is at least once: after a crash, the messages of the
chunk that was in progress are delivered again.

From memory at the tail (DESIGN.md, "The batch is the unit of work"): the
writer of the stream may hand the forwarder what it has just committed
(`hold`: the messages themselves and the offsets the log gave them). When
the next chunk the forwarder would read is wholly made of held messages, it
delivers those, without reading or decoding the chunk, and then stores the
offset and moves on exactly as if it had read it (the chunk's id and the
next one come from the log's index, `StreamLog.user_chunk_at`). Anything
else is read from the log: a backlog, a chunk shared with another writer,
what was committed before a (re)start. What it holds is bounded
(`ForwarderSettings.max_held_messages` and ``max_held_bytes``): a batch that
does not fit is not held, and read from the log when its turn comes.

From memory the destination gets the messages as they were committed; read
back, they are what the entry decodes to, which is the same message unless
it carried something the entry format adapts (see
`gateway.protocols.stream.mapping`: an unset timestamp, an integer header
outside 64 bits, text that is not valid Unicode).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
from twisted.internet.defer import Deferred, DeferredList, fail
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import osiris
from gateway.core.internal import FINAL_REJECTIONS
from gateway.core.log import StoredChunk, StreamLog
from gateway.core.message import Message, Outcome, Status

__all__ = [
    "MAX_HELD_BYTES",
    "MAX_HELD_MESSAGES",
    "Forwarded",
    "ForwardedException",
    "ForwarderSettings",
    "LogForwarder",
]

MAX_CHUNK_BYTES: Final = 8 * 1024 * 1024
"""A forwarder reads at most this much of the log at a time."""
MAX_HELD_MESSAGES: Final = 65_536
"""Committed messages a forwarder holds for delivery from memory, by default (one
full chunk's worth: more means it is behind, and reading is what it does then)."""
MAX_HELD_BYTES: Final = 32 * 1024 * 1024
"""Stored bytes of the messages a forwarder holds, by default (four 8 MiB chunks)."""
_ACCEPTED: Final = Outcome.accepted()


@attrs.frozen(kw_only=True)
class ForwarderSettings:
    """How a forwarder retries, and how much it holds for delivery from memory.

    Attributes:
        max_attempts: Deliveries of a message that is rejected before it
            goes to the dead-letter stream.
        retry_initial_seconds: First delay before delivering again.
        retry_max_seconds: Longest delay between attempts.
        max_held_messages: Committed messages held for delivery from memory.
        max_held_bytes: Their stored size.
    """

    max_attempts: int = 5
    retry_initial_seconds: float = 0.5
    retry_max_seconds: float = 30.0
    max_held_messages: int = MAX_HELD_MESSAGES
    max_held_bytes: int = MAX_HELD_BYTES


@attrs.frozen
class ForwardedException:
    """A message of a forwarded chunk that was not simply accepted the first time.

    Attributes:
        offset: Its offset.
        dead: Whether it went to the dead-letter stream (else it was
            delivered after retries).
        outcome: The last refusal: the one that dead-lettered it, or the
            last one it was delivered again after.
        attempts: Deliveries it took.
        finished: When its final outcome came (seconds).
    """

    offset: int
    dead: bool
    outcome: Outcome
    attempts: int
    finished: float


@attrs.frozen
class Forwarded:
    """What became of one chunk's messages: a range, and the exceptions in it.

    Every message from ``first_offset`` to ``last_offset`` was accepted by
    the first delivery, answered at ``finished``, except those listed.

    Attributes:
        first_offset: The first message delivered (after a restart in the
            middle of a chunk, not the chunk's first).
        last_offset: The last one.
        arrived: The first message's timestamp (seconds).
        finished: When the first delivery was answered (seconds).
        exceptions: The messages that needed more, in offset order.
    """

    first_offset: int
    last_offset: int
    arrived: float
    finished: float
    exceptions: tuple[ForwardedException, ...] = ()


class _Held:
    """Committed messages at consecutive offsets, as their writer handed them over."""

    __slots__ = ("end", "first", "messages", "nbytes")

    def __init__(self, first: int, messages: Sequence[Message], nbytes: int) -> None:
        self.first = first
        self.end = first + len(messages)
        self.messages = messages
        self.nbytes = nbytes


class _Chunk:
    """One chunk's messages on their way: every round delivers those still open together."""

    __slots__ = (
        "chunk_id",
        "exceptions",
        "finished",
        "first",
        "generation",
        "messages",
        "next_chunk_id",
        "refused",
        "rounds",
    )

    def __init__(
        self,
        first: int,
        messages: Sequence[Message],
        chunk_id: int,
        next_chunk_id: int,
        generation: int,
    ) -> None:
        self.first = first
        self.messages = messages
        self.chunk_id = chunk_id
        self.next_chunk_id = next_chunk_id
        self.generation = generation
        self.rounds = 0
        self.finished = 0.0
        self.refused: dict[int, Outcome] = {}
        self.exceptions: list[ForwardedException] = []


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
        settings: Retry and memory settings.
        on_forwarded: Told what became of each chunk once it is done (the
            outcome record), if given.
        deliver_once: Delivers a batch with a publishing id per message (its
            offset plus one), for a destination that stores each id once
            (`gateway.core.interfaces.IDeduplicatingDestination`): used
            instead of ``deliver`` when given, so that delivering a chunk
            again after a crash stores nothing twice.
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
        on_forwarded: Callable[[Forwarded], None] | None = None,
        deliver_once: Callable[[Sequence[Message], Sequence[int]], Deferred[list[Outcome]]]
        | None = None,
    ) -> None:
        self.reference = reference
        self.stream = stream
        self._deliver = deliver
        self._deliver_once = deliver_once
        self._to_message = to_message
        self._dead_letter = dead_letter
        self._clock = clock
        self._settings = settings
        self._on_forwarded = on_forwarded
        self._running = False
        self._generation = 0
        self._next_chunk = 0
        self._after_offset = -1
        self._waiting: Deferred[None] | None = None
        self._timers: set[IDelayedCall] = set()
        self._held: deque[_Held] = deque()
        self._held_messages = 0
        self._held_bytes = 0
        self.delivered = 0
        self.dead_lettered = 0
        self.retried = 0
        """Refused messages put back for another delivery (each time they are)."""
        self.chunks_from_memory = 0
        """Chunks delivered from held messages, without reading the log."""
        self.chunks_read = 0
        """Chunks read from the log."""
        self.not_held = 0
        """Committed batches handed over that did not fit (read from the log later)."""

    @property
    def running(self) -> bool:
        """Whether it is forwarding."""
        return self._running

    def done_offset(self) -> int:
        """The last offset of the stream whose chunk is done (-1: none since it was made).

        Done means every message of the chunk has its outcome, as the stored
        offset says (`gateway.core.origins.PendingOrigins` asks it).
        """
        return self._after_offset

    @property
    def held_messages(self) -> int:
        """Messages held now for delivery from memory."""
        return self._held_messages

    def start(self) -> None:
        """Start from the stored offset (or the start of the stream)."""
        if self._running:
            return
        self._running = True
        self._generation += 1
        stored = self.stream.query_offset(self.reference)
        if stored is None:
            self._after_offset = -1
            self._next_chunk = self.stream.seek(("first",))
        else:
            self._after_offset = stored
            self._next_chunk = self.stream.seek(("offset", stored + 1))
        self._step()

    def stop(self) -> None:
        """Stop; what is in progress is delivered again on the next start."""
        self._running = False
        self._generation += 1  # outcomes still to come belong to no chunk now
        self._forget_held()
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.cancel()

    def hold(self, first_offset: int, messages: Sequence[Message], nbytes: int) -> bool:
        """Keep committed messages to deliver from memory when their chunk's turn comes.

        Args:
            first_offset: The offset the log gave the first of them; the
                others follow at consecutive offsets (one chunk's span of an
                append, `gateway.core.log.AppendResult.spans`).
            messages: The messages, as their entries decode (kept, not copied).
            nbytes: Their stored size.

        Returns:
            Whether they are held: not when stopped, nor when the limits
            would be passed (the forwarder is behind, and reads).
        """
        count = len(messages)
        if not self._running or not count:
            return False
        settings = self._settings
        if (
            self._held_messages + count > settings.max_held_messages
            or self._held_bytes + nbytes > settings.max_held_bytes
        ):
            self.not_held += 1
            return False
        self._held.append(_Held(first_offset, messages, nbytes))
        self._held_messages += count
        self._held_bytes += nbytes
        return True

    # The chunk loop.

    def _step(self) -> None:
        if not self._running:
            return
        if self._held:
            found = self.stream.user_chunk_at(self._next_chunk)
            if found is None:
                self._wait()
                return
            chunk_id, next_chunk_id = found
            start = max(chunk_id, self._after_offset + 1)
            messages = self._take_held(start, next_chunk_id)
            if messages is not None:
                self.chunks_from_memory += 1
                self._forward(_Chunk(start, messages, chunk_id, next_chunk_id, self._generation))
                return
        chunks = self.stream.read_chunks(self._next_chunk, 1, MAX_CHUNK_BYTES)
        if not chunks:
            self._wait()
            return
        chunk = chunks[0]
        self.chunks_read += 1
        first, messages = self._decode(chunk)
        if not messages:
            self._chunk_done(chunk.next_chunk_id)
            return
        self._forward(
            _Chunk(first, messages, chunk.chunk_id, chunk.next_chunk_id, self._generation)
        )

    def _wait(self) -> None:
        self._waiting = self.stream.wait_for(self._next_chunk)
        self._waiting.addCallbacks(self._woken, self._wait_failed)

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

    def _take_held(self, start: int, end: int) -> Sequence[Message] | None:
        """The held messages at offsets ``start`` to ``end - 1``, if every one is held."""
        held = self._held
        while held and held[0].end <= start:
            self._drop_first()
        if not held or held[0].first > start or start >= end:
            return None
        head = held[0]
        if head.first == start and head.end == end:
            return head.messages  # the usual case: one batch, one chunk
        taken: list[Message] = []
        at = start
        for piece in held:
            if piece.first != at and taken:
                return None  # a gap: some of the chunk is not held
            stop = min(piece.end, end)
            taken.extend(piece.messages[at - piece.first : stop - piece.first])
            at = stop
            if at >= end:
                return taken
        return None

    def _drop_first(self) -> None:
        piece = self._held.popleft()
        self._held_messages -= len(piece.messages)
        self._held_bytes -= piece.nbytes

    def _forget_before(self, offset: int) -> None:
        """Drop what is held below ``offset``, a chunk id (done, or read from the log instead).

        A held span lies in one chunk, so nothing below a chunk id is needed.
        """
        held = self._held
        while held and held[0].first < offset:
            self._drop_first()

    def _forget_held(self) -> None:
        self._held.clear()
        self._held_messages = 0
        self._held_bytes = 0

    def _decode(self, chunk: StoredChunk) -> tuple[int, list[Message]]:
        """The chunk's messages not delivered yet, and the offset of the first."""
        data = chunk.payload[osiris.HEADER_BYTES :]
        timestamp = chunk.header.timestamp / 1000
        to_message = self._to_message
        after = self._after_offset
        first = max(chunk.chunk_id, after + 1)
        messages: list[Message] = []
        entries = enumerate(osiris.iter_entries(data), chunk.chunk_id)
        while True:
            try:
                offset, entry = next(entries)
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
            if offset <= after:
                continue  # delivered before a restart, in a chunk resumed midway
            messages.append(to_message(bytes(entry), offset, timestamp))
        return first, messages

    # Delivering one chunk.

    def _forward(self, chunk: _Chunk) -> None:
        self._attempt(chunk, chunk.messages, None).addCallback(self._forwarded, chunk)

    def _attempt(
        self, chunk: _Chunk, batch: Sequence[Message], indices: list[int] | None
    ) -> Deferred[None]:
        """Deliver ``batch`` (the chunk's messages at ``indices``, or all of them)."""
        chunk.rounds += 1
        deliver_once = self._deliver_once
        try:
            if deliver_once is None:
                d = self._deliver(batch)
            else:
                first = chunk.first + 1  # ids start at 1: 0 is "nothing stored yet"
                ids: Sequence[int] = (
                    range(first, first + len(batch))
                    if indices is None
                    else [first + index for index in indices]
                )
                d = deliver_once(batch, ids)
        except Exception:
            d = fail()
        return d.addCallbacks(
            self._answered,
            self._broken,
            callbackArgs=(chunk, batch, indices),
            errbackArgs=(chunk, batch, indices),
        )

    def _broken(
        self, failure: Failure, chunk: _Chunk, batch: Sequence[Message], indices: list[int] | None
    ) -> Deferred[None] | None:
        self._log.failure(
            "forwarder {reference}: delivery failed unexpectedly",
            failure,
            reference=self.reference,
        )
        return self._answered([Outcome.retry("internal error")] * len(batch), chunk, batch, indices)

    def _answered(
        self,
        outcomes: list[Outcome],
        chunk: _Chunk,
        batch: Sequence[Message],
        indices: list[int] | None,
    ) -> Deferred[None] | None:
        """Settle a round's outcomes; deliver those still open again later."""
        if chunk.generation != self._generation:
            return None  # stopped meanwhile: the chunk is delivered again after a start
        now = self._clock.seconds()
        if chunk.rounds == 1:
            chunk.finished = now
        count = len(batch)
        if len(outcomes) != count:
            self._log.error(
                "forwarder {reference}: {outcomes} outcomes for {count} messages",
                reference=self.reference,
                outcomes=len(outcomes),
                count=count,
            )
            outcomes = [Outcome.retry("internal error: outcomes missing")] * count
        if outcomes.count(_ACCEPTED) == count and indices is None:
            self.delivered += count  # the usual case: all accepted the first time
            return None
        again: list[int] = []
        dead: list[Deferred[object]] = []
        dead_indices: list[int] = []
        max_attempts = self._settings.max_attempts
        for position, outcome in enumerate(outcomes):
            index = position if indices is None else indices[position]
            status = outcome.status
            if status is Status.ACCEPTED:
                self.delivered += 1
                if indices is not None:
                    chunk.exceptions.append(
                        ForwardedException(
                            chunk.first + index, False, chunk.refused[index], chunk.rounds, now
                        )
                    )
            elif status is Status.REJECTED and (
                chunk.rounds >= max_attempts or outcome.code in FINAL_REJECTIONS
            ):
                offset = chunk.first + index
                self.dead_lettered += 1
                self._log.warn(
                    "forwarder {reference}: offset {offset} rejected {attempts} times,"
                    " moved to the dead-letter stream: {reason}",
                    reference=self.reference,
                    offset=offset,
                    attempts=chunk.rounds,
                    reason=outcome.reason,
                )
                chunk.refused[index] = outcome
                try:
                    stored = self._dead_letter(chunk.messages[index], outcome)
                except Exception:
                    stored = fail()
                dead.append(stored)
                dead_indices.append(index)
                chunk.exceptions.append(
                    ForwardedException(offset, True, outcome, chunk.rounds, now)
                )
            else:
                chunk.refused[index] = outcome
                again.append(index)
        if dead:
            # The chunk is done only once its dead letters are stored: one
            # that could not be (a full disk) is delivered again instead.
            written: Deferred[Any] = DeferredList(dead, consumeErrors=True)
            return written.addCallback(self._dead_lettered, chunk, again, dead_indices)
        return self._retry(chunk, again) if again else None

    def _dead_lettered(
        self,
        results: list[tuple[bool, Any]],
        chunk: _Chunk,
        again: list[int],
        indices: list[int],
    ) -> Deferred[None] | None:
        """Deliver again the messages whose dead letter was not stored, with the others due."""
        if chunk.generation != self._generation:
            return None
        failed = [index for index, (ok, _) in zip(indices, results, strict=True) if not ok]
        for index, (ok, failure) in zip(indices, results, strict=True):
            if not ok:
                self._log.error(
                    "forwarder {reference}: offset {offset} could not be stored in the"
                    " dead-letter stream ({reason}); it is delivered again later",
                    reference=self.reference,
                    offset=chunk.first + index,
                    reason=failure.getErrorMessage(),
                )
        if failed:
            self.dead_lettered -= len(failed)
            offsets = {chunk.first + index for index in failed}
            chunk.exceptions = [
                exception
                for exception in chunk.exceptions
                if not (exception.dead and exception.offset in offsets)
            ]
            again = sorted([*again, *failed])
        return self._retry(chunk, again) if again else None

    def _retry(self, chunk: _Chunk, again: list[int]) -> Deferred[None]:
        """Deliver the chunk's messages at ``again`` after the round's delay."""
        settings = self._settings
        delay = min(
            settings.retry_initial_seconds * 2 ** (chunk.rounds - 1), settings.retry_max_seconds
        )
        retried: Deferred[None] = Deferred()

        def fire() -> None:
            self._timers.discard(timer)
            if chunk.generation == self._generation:
                retried.callback(None)

        timer = self._clock.callLater(delay, fire)
        self._timers.add(timer)
        messages = chunk.messages
        batch = [messages[index] for index in again]
        self.retried += len(batch)
        return retried.addCallback(lambda _: self._attempt(chunk, batch, again))

    def _forwarded(self, _: object, chunk: _Chunk) -> None:
        if chunk.generation != self._generation:
            return
        if self._on_forwarded is not None:
            exceptions = chunk.exceptions
            if len(exceptions) > 1:
                exceptions.sort(key=lambda exception: exception.offset)
            self._on_forwarded(
                Forwarded(
                    chunk.first,
                    chunk.first + len(chunk.messages) - 1,
                    chunk.messages[0].timestamp,
                    chunk.finished,
                    tuple(exceptions),
                )
            )
        self._chunk_done(chunk.next_chunk_id)

    def _chunk_done(self, next_chunk_id: int) -> None:
        if not self._running:
            return
        last = next_chunk_id - 1
        self.stream.store_offset(self.reference, last)
        self._after_offset = last
        self._next_chunk = next_chunk_id
        if self._held:
            self._forget_before(next_chunk_id)
        # The next chunk on the next reactor turn: a long backlog neither
        # recurses nor keeps the reactor from everything else.
        generation = self._generation
        timer = self._clock.callLater(0, self._next, generation)
        self._timers.add(timer)

    def _next(self, generation: int) -> None:
        self._timers = {timer for timer in self._timers if timer.active()}
        if generation == self._generation:
            self._step()
