"""One stream of the embedded log: appends with deduplication, offsets, reads, seeks.

All of it runs on the reactor thread. Appends queue until the store's group
commit (`gateway.core.log.writer`) plans them into chunks (through
`gateway.core.log.commit`), writes them in its thread and reports back;
only then do acknowledgements fire and readers see the chunks. Seeks and
reads of what is committed are `gateway.core.log.reads`'.

A commit that fails because the file system (or a quota) is full was taken
back by the writer thread, so the stream is intact: its appends, and those
queued behind it, fail with `LogFullError`, and the stream refuses appends
for a while, then lets the next commit try again (`gateway.core.log.full`).
Any other write failure leaves the stream refusing appends until the store
reopens (recovery).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs.osiris import (
    MAX_TRACKING_ID_BYTES,
    USER,
    SubBatch,
    entry_bytes,
)
from gateway.core.log.commit import (
    CommitPlanner,
    Entry,
    PendingAppend,
    StreamCommit,
    kept_entries,
)
from gateway.core.log.files import CommitWriteError, SegmentWriter
from gateway.core.log.full import FULL_RETRY_INITIAL_SECONDS, FULL_RETRY_MAX_SECONDS, FullDisk
from gateway.core.log.reads import SegmentReads, first_chunk_id
from gateway.core.log.segment import Segment
from gateway.core.log.tracking import TrackingState
from gateway.core.log.values import (
    AppendResult,
    ChunkSpan,
    LogError,
    LogWriteError,
    Retention,
    StoredChunk,
)

if TYPE_CHECKING:
    from gateway.core.log.writer import GroupCommitter

__all__ = [
    "FULL_RETRY_INITIAL_SECONDS",
    "FULL_RETRY_MAX_SECONDS",
    "OffsetSpec",
    "StreamLog",
]

_U64_MAX: Final = 2**64 - 1

OffsetSpec = tuple[str] | tuple[str, int]
"""``("first",)``, ``("last",)``, ``("next",)``, ``("offset", n)`` or ``("timestamp", ms)``."""


def _check_reference(reference: str) -> None:
    """Refuse a reference that a tracking entry cannot carry."""
    if len(reference.encode("utf-8")) > MAX_TRACKING_ID_BYTES:
        raise ValueError(f"a reference holds at most {MAX_TRACKING_ID_BYTES} UTF-8 bytes")


class StreamLog:
    """One stream: get it from `LogStore.create` or `LogStore.get`.

    Args:
        name: The stream's name.
        directory: Its directory.
        retention: Its retention settings.
        segments: Its recovered segments, oldest first (at least one).
        tracking: Its recovered tracking state.
        writer: The writer thread's files for it.
        committer: The store's group commit.
    """

    _log = Logger()

    def __init__(
        self,
        name: str,
        directory: Path,
        retention: Retention,
        segments: list[Segment],
        tracking: TrackingState,
        writer: SegmentWriter,
        committer: GroupCommitter,
    ) -> None:
        self.name = name
        self.directory = directory
        self.retention = retention
        self.writer = writer
        self._committer = committer
        self._segments = segments
        self._tracking = tracking
        self._next_id = segments[-1].next_id
        self._committed_chunk_id = -1
        self._last_timestamp = 0
        for segment in reversed(segments):
            if self._last_timestamp == 0 and len(segment):
                self._last_timestamp = segment.timestamps[-1]
            user = segment.types.rfind(USER)
            if user >= 0:
                self._committed_chunk_id = segment.chunk_ids[user]
                break
        self._queued: list[PendingAppend] = []
        self._queued_offsets: dict[str, int] = {}
        self._sequences_ahead: dict[str, int] = {}
        self._offsets_ahead: dict[str, int] = {}
        self._waiters: list[tuple[int, Deferred[None]]] = []
        self._reads = SegmentReads()
        self._error: LogError | None = None
        self._refusal: LogError | None = None
        self._full = FullDisk(name, committer.clock, self._space_again)
        self.appends = 0
        """Appends committed since the store opened (one per batch, duplicates or not)."""
        self.records = 0
        """Records those appends stored (a sub-batch counts each record)."""
        self.written_bytes = 0
        """Bytes of the chunks written since the store opened (tracking chunks too)."""

    def __repr__(self) -> str:
        return f"<StreamLog {self.name!r} offsets {self.first_offset}..{self._next_id}>"

    # Positions.

    @property
    def first_offset(self) -> int:
        """The oldest offset still kept: the first chunk id of the oldest segment."""
        return self.first_chunk_id

    @property
    def next_offset(self) -> int:
        """The offset the next record will get."""
        return self._next_id

    @property
    def committed_chunk_id(self) -> int:
        """Id of the last user chunk written, -1 if none."""
        return self._committed_chunk_id

    @property
    def first_chunk_id(self) -> int:
        """Id of the oldest chunk kept (the next offset when the stream is empty)."""
        return first_chunk_id(self._segments, self._next_id)

    @property
    def last_chunk_id(self) -> int:
        """Id of the newest chunk of any type, -1 if none."""
        for segment in reversed(self._segments):
            if len(segment):
                return segment.chunk_ids[-1]
        return -1

    @property
    def segments(self) -> Sequence[Segment]:
        """The segments kept, oldest first (read only)."""
        return tuple(self._segments)

    @property
    def size_bytes(self) -> int:
        """Bytes the committed segments take."""
        return sum(segment.size for segment in self._segments)

    # Writing.

    def append(
        self,
        messages: Sequence[bytes | memoryview] | Sequence[Entry],
        *,
        reference: str | None = None,
        publishing_ids: Sequence[int] | None = None,
        sub_batches: bool = False,
    ) -> Deferred[AppendResult]:
        """Append messages; the Deferred fires once they are committed.

        Every append made before the next commit starts shares its chunk (and
        its fsync). Messages that are not ``bytes`` (views into a receive
        buffer, say) are copied now, since the writer thread reads them later.

        Args:
            messages: The message bodies, in order.
            reference: A publisher reference: deduplicate by ``publishing_ids``.
            publishing_ids: One id per message, with a reference. A message
                whose id is not above the reference's last (stored or pending)
                id is not stored, but acknowledged all the same.
            sub_batches: Some messages are whole `SubBatch` entries (each
                takes as many offsets as it holds records, under one
                publishing id); such an append is stored in one chunk.

        Returns:
            A Deferred firing with the `AppendResult`, or failing with
            `StreamMissingError` (deleted), `LogClosedError` or `LogWriteError`.

        Raises:
            ValueError: Ids without a reference (or the reverse), a count
                mismatch, a reference over 255 bytes, a message over 2 GiB,
                or more than 65,535 entries with sub-batches.
        """
        if reference == "":
            reference = None
        if (reference is None) != (publishing_ids is None):
            raise ValueError("a reference and publishing ids go together")
        stored = kept_entries(messages, sub_batches=sub_batches)
        if reference is not None and publishing_ids is not None:
            _check_reference(reference)
            if len(publishing_ids) != len(stored):
                raise ValueError("one publishing id per message")
        refusal = self._error or self._refusal or self._full.error
        if refusal is not None:
            return fail(refusal)
        ids: list[int] | None = None
        if reference is not None and publishing_ids is not None:
            stored, ids = self._deduplicate(reference, stored, publishing_ids)
        if sub_batches:
            records: int | None = sum(
                entry.records if isinstance(entry, SubBatch) else 1 for entry in stored
            )
            nbytes = sum(map(entry_bytes, stored)) - 4 * len(stored)
        else:
            records = None
            nbytes = sum(map(len, stored))  # type: ignore[arg-type]
        append = PendingAppend(
            deferred=Deferred(),
            messages=stored,
            nbytes=nbytes,
            reference=reference,
            ids=ids,
            duplicates=len(messages) - len(stored),
            records=records,
        )
        self._queued.append(append)
        self._committer.request(self)
        return append.deferred

    def _deduplicate(
        self, reference: str, messages: list[Entry], ids: Sequence[int]
    ) -> tuple[list[Entry], list[int]]:
        """Leave out messages whose id is not above the reference's last one."""
        last = self._sequences_ahead.get(reference)
        if last is None:
            last = self._tracking.sequence(reference)
        kept: list[Entry] = []
        kept_ids: list[int] = []
        for message, publishing_id in zip(messages, ids, strict=True):
            if publishing_id > last:
                kept.append(message)
                kept_ids.append(publishing_id)
                last = publishing_id
        if kept_ids:
            if last > _U64_MAX:
                raise ValueError("publishing ids are u64")
            self._sequences_ahead[reference] = last
        return kept, kept_ids

    def writer_sequence(self, reference: str) -> int:
        """The last publishing id stored for a reference (0 if unknown)."""
        return self._tracking.sequence(reference)

    def store_offset(self, reference: str, offset: int) -> None:
        """Store a consumer's offset; written with the next commit, never acknowledged.

        Raises:
            ValueError: A reference over 255 bytes, or an offset outside u64.
        """
        _check_reference(reference)
        if not 0 <= offset <= _U64_MAX:
            raise ValueError("offsets are u64")
        if self._error is not None or self._refusal is not None:
            return
        self._queued_offsets[reference] = offset
        self._offsets_ahead[reference] = offset
        if self._full.error is None:  # else it is written when the stream tries again
            self._committer.request(self)

    def query_offset(self, reference: str) -> int | None:
        """The last offset stored for a consumer reference (perhaps not yet on disk)."""
        ahead = self._offsets_ahead.get(reference)
        return self._tracking.offsets.get(reference) if ahead is None else ahead

    # Group commit (called by the store's committer).

    def plan_commit(self, now_ms: int) -> StreamCommit | None:
        """Turn the queued appends and offsets into a planned commit, if any.

        None while the stream waits out a full file system (unless the store
        is closing: its last commit tries the queued offsets once more).
        """
        if self._error is not None or not (self._queued or self._queued_offsets):
            return None
        if self._full.error is not None and self._refusal is None:
            return None
        self._last_timestamp = max(self._last_timestamp, now_ms)
        planner = CommitPlanner(
            self._segments[-1],
            next_id=self._next_id,
            tracking=self._tracking,
            timestamp=self._last_timestamp,
            max_segment_bytes=self.retention.max_segment_bytes,
        )
        commit = planner.plan(self._queued, self._queued_offsets)
        self._queued, self._queued_offsets = [], {}
        return commit

    def commit_written(self, commit: StreamCommit) -> bool:
        """The commit is written (and synced as the policy says): publish its chunks.

        Readers see them from now on; the appends are acknowledged by
        `acknowledge`, once the next commit is on its way.

        Returns:
            Whether to acknowledge it: False if the stream was shut
            meanwhile (its appends have failed).
        """
        if self._error is not None:
            self._fail_appends(commit.appends, self._error)
            return False
        for write in commit.writes:
            if write.create:
                self._segments.append(Segment(self.directory, write.first_id))
            segment = self._segments[-1]
            for chunk in write.chunks:
                segment.add(chunk)
                if chunk.chunk_type == USER:
                    self.records += chunk.num_records
            self.written_bytes += segment.size - write.position
        self.appends += len(commit.appends)
        self._tracking = commit.tracking
        self._next_id = commit.next_id
        for reference, sequence in list(self._sequences_ahead.items()):
            if self._tracking.sequence(reference) >= sequence:
                del self._sequences_ahead[reference]
        for reference, offset in list(self._offsets_ahead.items()):
            if self._tracking.offsets.get(reference) == offset:
                del self._offsets_ahead[reference]
        if commit.last_user_chunk_id is not None:
            self._committed_chunk_id = commit.last_user_chunk_id
        self._full.written()
        return True

    def acknowledge(self, commit: StreamCommit) -> None:
        """Fire the appends of a commit `commit_written` published; wake its chunks' readers."""
        for append in commit.appends:
            append.deferred.callback(append.result())
        if commit.last_user_chunk_id is not None:
            self._wake_waiters()

    def commit_failed(self, commit: StreamCommit, reason: BaseException) -> None:
        """Writing failed: fail the commit's appends and those queued behind it.

        A full file system (the commit taken back: `CommitWriteError.space_ran_out`)
        makes the stream refuse appends for a while and then try again. Any
        other failure makes it refuse appends and fail its waiting readers
        until the store reopens. Either way what was committed before stays
        readable, and no publishing id of a failed append counts as stored.
        """
        if self._error is not None:
            self._fail_appends(commit.appends, self._error)
            return
        if isinstance(self._refusal, LogWriteError):  # broken already
            self._fail_appends(commit.appends, self._refusal)
            return
        if isinstance(reason, CommitWriteError) and reason.space_ran_out:
            self._space_ran_out(commit, reason)
            return
        self._log.failure(
            "Writing stream {stream} failed; it refuses appends until the store reopens",
            Failure(reason),
            stream=self.name,
        )
        error = self._refusal = LogWriteError(f"writing stream {self.name!r} failed: {reason}")
        self._full.clear()
        queued, self._queued = self._queued, []
        self._queued_offsets.clear()
        self._sequences_ahead.clear()
        self._fail_appends([*commit.appends, *queued], error)
        waiters, self._waiters = self._waiters, []
        for _chunk_id, waiter in waiters:
            waiter.errback(error)

    def _space_ran_out(self, commit: StreamCommit, reason: CommitWriteError) -> None:
        """The file system is full: refuse appends for a while, then try again.

        The failed commit was taken back, so the stream's state is the
        committed one: its appends and those queued (deduplicated against
        the failed ones' publishing ids) fail, nothing is pending, and no
        publishing id is reserved any more. Its consumer offsets are queued
        again; readers keep waiting.
        """
        error = self._full.ran_out(reason, retry=self._refusal is None)
        queued, self._queued = self._queued, []
        self._sequences_ahead.clear()
        for reference, offset in commit.offsets.items():
            self._queued_offsets.setdefault(reference, offset)
        self._fail_appends([*commit.appends, *queued], error)

    def _space_again(self) -> None:
        """The wait after a full file system is over: the next commit tries the disk."""
        if self._queued_offsets:
            self._committer.request(self)

    def refuse(self, error: LogError) -> None:
        """Refuse new appends and offsets with ``error``; what is queued still commits.

        Offsets held back by a full file system are tried once more too.
        """
        if self._refusal is None:
            self._refusal = error
        if self._full.cancel() and self._queued_offsets:
            self._committer.request(self)

    def shut(self, error: LogError) -> None:
        """Stop the stream (deleted, closed or broken): fail what waits, close read files."""
        if self._error is not None:
            return
        self._error = error
        self._full.cancel()
        queued, self._queued = self._queued, []
        self._queued_offsets.clear()
        self._fail_appends(queued, error)
        waiters, self._waiters = self._waiters, []
        for _chunk_id, waiter in waiters:
            waiter.errback(error)
        self._reads.close()

    def _fail_appends(self, appends: Sequence[PendingAppend], error: LogError) -> None:
        """Fail the appends' Deferreds."""
        for append in appends:
            append.deferred.errback(error)

    # Retention.

    def retire_segments(self, now_ms: int) -> list[Segment]:
        """Drop the oldest segments that retention no longer keeps (never the active one).

        Returns:
            The segments dropped from memory; their files are still to be deleted.
        """
        segments = self._segments
        drop = 0
        max_bytes = self.retention.max_bytes
        if max_bytes is not None:
            total = sum(segment.size for segment in segments)
            while drop < len(segments) - 1 and total > max_bytes:
                total -= segments[drop].size
                drop += 1
        max_age = self.retention.max_age_seconds
        if max_age is not None:
            cutoff = now_ms - int(max_age * 1000)
            while drop < len(segments) - 1:
                newest = segments[drop].last_timestamp
                if newest is not None and newest >= cutoff:
                    break
                drop += 1
        retired, self._segments = segments[:drop], segments[drop:]
        for segment in retired:
            self._reads.forget(segment)
        return retired

    # Reading.

    def seek(self, spec: OffsetSpec) -> int:
        """The chunk id a consumer starts from (docs/stream-protocol-notes.md, section 7).

        ``first``: the oldest chunk; ``last``: the last user chunk (``next`` if
        none); ``next``: only what is written from now on; ``("offset", n)``:
        the chunk holding ``n``, clamped to first and next; ``("timestamp",
        ms)``: the first chunk written at or after ``ms`` (``next`` if none).

        Raises:
            ValueError: Not one of those.
        """
        match spec:
            case ("first",):
                return self.first_chunk_id
            case ("next",):
                return self._next_id
            case ("last",):
                if self._committed_chunk_id >= self.first_chunk_id:
                    return self._committed_chunk_id
                return self._next_id
            case ("offset", int(offset)):
                return self._reads.seek_offset(self._segments, offset, self._next_id)
            case ("timestamp", int(timestamp)):
                return self._reads.seek_timestamp(self._segments, timestamp, self._next_id)
        raise ValueError(f"unknown offset specification {spec!r}")

    def read_chunks(self, chunk_id: int, max_chunks: int, max_bytes: int) -> list[StoredChunk]:
        """Read committed user chunks from ``chunk_id`` on; tracking chunks are skipped.

        Args:
            chunk_id: Where to start: a chunk id from `seek` or a previous
                ``next_chunk_id``; an offset inside a chunk starts at that
                chunk, one before the oldest at the oldest.
            max_chunks: Return at most this many chunks.
            max_bytes: Read about this many bytes at most; the first chunk is
                returned whatever its size, so a reader always progresses.

        Returns:
            The chunks, oldest first; empty at the end of the stream.
        """
        if max_chunks <= 0 or self._error is not None or chunk_id >= self._next_id:
            return []
        return self._reads.read_chunks(self._segments, chunk_id, max_chunks, max_bytes)

    def read_spans(self, chunk_id: int, max_chunks: int, max_bytes: int) -> list[ChunkSpan] | None:
        """Where `read_chunks`' chunks lie in the files, to send them with ``os.sendfile``.

        From one segment (the next call goes on). [] at the end of the stream; None
        when the next chunk is not one span (a bloom filter before its data): read it.
        """
        if max_chunks <= 0 or self._error is not None or chunk_id >= self._next_id:
            return []
        return self._reads.read_spans(self._segments, chunk_id, max_chunks, max_bytes)

    def user_chunk_at(self, chunk_id: int) -> tuple[int, int] | None:
        """Id and next chunk id of the chunk `read_chunks` would return first, from the index.

        Nothing is read: a reader that already holds the chunk's messages
        (a durable route's forwarder at the tail) learns where it is and
        where the next read starts without reading or decoding it.

        Returns:
            ``(chunk_id, next_chunk_id)`` of the first committed user chunk
            at or after ``chunk_id`` (as `read_chunks` starts), or None at
            the end of the stream.
        """
        if self._error is not None or chunk_id >= self._next_id:
            return None
        return self._reads.user_chunk_at(self._segments, chunk_id)

    def wait_for(self, chunk_id: int) -> Deferred[None]:
        """Fire once a user chunk at or after ``chunk_id`` is committed (for tailing readers).

        Cancelling the Deferred stops waiting. Fails with the stream's error
        if it is deleted, broken or closed first.
        """
        if self._committed_chunk_id >= chunk_id:
            return succeed(None)
        error = self._error
        if error is None and isinstance(self._refusal, LogWriteError):
            error = self._refusal
        if error is not None:
            return fail(error)

        def cancel(waiter: Deferred[None]) -> None:
            self._waiters = [entry for entry in self._waiters if entry[1] is not waiter]

        waiter: Deferred[None] = Deferred(cancel)
        self._waiters.append((chunk_id, waiter))
        return waiter

    def _wake_waiters(self) -> None:
        """Fire the waiters that the committed chunk id has reached."""
        committed = self._committed_chunk_id
        ready = [waiter for wanted, waiter in self._waiters if wanted <= committed]
        if ready:
            self._waiters = [entry for entry in self._waiters if entry[0] > committed]
            for waiter in ready:
                waiter.callback(None)
