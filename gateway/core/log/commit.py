"""Planning one stream's share of a group commit, on the reactor thread.

Every append queued since the last commit becomes part of user chunks of
at most 65,535 entries (and about `MAX_CHUNK_DATA_BYTES` of data), in order.
Each user chunk's trailer holds the last publishing id of each reference it
stores; the first one also holds the consumer offsets stored since the last
commit, which otherwise go into a tracking delta chunk of their own
(docs/stream-protocol-notes.md, sections 8 and 9). Before a chunk would go
into a segment that has reached its size limit, a new segment is started,
and its first chunk is a tracking snapshot.

The plan fixes every chunk id, file position and size, so the reactor thread
knows the outcome before the writer thread has encoded a byte; it changes
nothing until the commit succeeds (`StreamCommit` carries the new state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from twisted.internet.defer import Deferred

from gateway.codecs.osiris import (
    FILE_HEADER_BYTES,
    INDEX_RECORD_BYTES,
    MAX_ENTRIES_PER_CHUNK,
    MAX_ENTRY_BYTES,
    TRACKING_DELTA,
    TRACKING_SNAPSHOT,
    USER,
    FrozenEntries,
    SubBatch,
    encode_tracking,
)
from gateway.core.log.segment import PlannedChunk, Segment, SegmentWrite, chunk_size
from gateway.core.log.tracking import TrackingState
from gateway.core.log.values import AppendResult

__all__ = [
    "MAX_CHUNK_DATA_BYTES",
    "CommitPlanner",
    "Entry",
    "PendingAppend",
    "StreamCommit",
    "kept_entries",
]

Entry = bytes | memoryview | SubBatch
"""What a chunk stores: a simple entry's body, or a whole sub-batch entry."""


def _immutable(message: bytes | memoryview) -> bool:
    return type(message) is bytes or (
        isinstance(message, memoryview) and type(message.obj) is bytes
    )


def _kept(entry: Entry) -> Entry:
    """An entry as the writer thread may read it later (copied unless immutable)."""
    if isinstance(entry, SubBatch):
        return (
            entry
            if _immutable(entry.entry)
            else SubBatch(bytes(entry.entry), entry.records, entry.compression)
        )
    if len(entry) > MAX_ENTRY_BYTES:
        raise ValueError(f"a message holds at most {MAX_ENTRY_BYTES} bytes")
    return entry if _immutable(entry) else bytes(entry)


def kept_entries(
    messages: Sequence[bytes | memoryview] | Sequence[Entry], *, sub_batches: bool
) -> list[Entry]:
    """An append's messages as the writer thread may read them later.

    Views into immutable bytes are kept as they are: the stream codec's
    frames come as `FrozenEntries`, which are not asked one by one (about
    0.1 µs a message, a tenth of a Publish's cost); anything that may change
    under us is copied now.

    Raises:
        ValueError: A message over `MAX_ENTRY_BYTES` bytes, or more than
            `MAX_ENTRIES_PER_CHUNK` entries with sub-batches.
    """
    if sub_batches:
        stored = [_kept(entry) for entry in messages]
        if len(stored) > MAX_ENTRIES_PER_CHUNK:
            raise ValueError(f"an append with sub-batches holds at most {MAX_ENTRIES_PER_CHUNK}")
        return stored
    if type(messages) is FrozenEntries:
        stored = list(messages)
    else:
        stored = [
            message if _immutable(message) else bytes(message)  # type: ignore[arg-type]
            for message in messages
        ]
    if stored and max(map(len, stored)) > MAX_ENTRY_BYTES:  # type: ignore[arg-type]
        raise ValueError(f"a message holds at most {MAX_ENTRY_BYTES} bytes")
    return stored


MAX_CHUNK_DATA_BYTES: Final = 8 * 1024 * 1024
"""A user chunk is closed once its data reaches 8 MiB: one chunk is one Deliver
frame, and a consumer's memory holds a whole one."""


@dataclass(slots=True, eq=False)
class PendingAppend:
    """One append waiting for its commit.

    Attributes:
        deferred: Fired with the `AppendResult` once committed.
        messages: The entries to store (duplicates already left out).
        nbytes: Their total size, as `chunk_size` counts it: each entry's
            bytes in the data section less the 4 of a simple entry's prefix.
        reference: The publisher reference, if deduplicating.
        ids: The stored messages' publishing ids, when there is a reference.
        duplicates: Messages left out as duplicates.
        records: Offsets the entries take (None: one each, no sub-batches).
        first_offset: Set by the planner: offset of the first stored message.
        chunk_id: Set by the planner: the chunk holding it.
        spans: Set by the planner: ``(first offset, offsets taken)`` in each
            chunk the append went into.
    """

    deferred: Deferred[AppendResult]
    messages: list[Entry]
    nbytes: int
    reference: str | None
    ids: list[int] | None
    duplicates: int
    records: int | None = None
    first_offset: int | None = None
    chunk_id: int | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)

    def result(self) -> AppendResult:
        """The outcome to acknowledge with."""
        return AppendResult(
            first_offset=self.first_offset,
            chunk_id=self.chunk_id,
            stored=len(self.messages),
            duplicates=self.duplicates,
            spans=tuple(self.spans),
        )


@dataclass(slots=True, eq=False)
class StreamCommit:
    """A planned commit of one stream: what to write, and the state once written.

    Attributes:
        appends: The appends it acknowledges.
        writes: Segment writes, in order (empty when nothing is written).
        tracking: The tracking state after the commit.
        next_id: The next offset after the commit.
        last_user_chunk_id: The last user chunk it writes, if any.
        timestamp: Its chunks' timestamp (ms).
        offsets: The consumer offsets it stores (queued again if it fails).
    """

    appends: list[PendingAppend]
    writes: list[SegmentWrite]
    tracking: TrackingState
    next_id: int
    last_user_chunk_id: int | None
    timestamp: int
    offsets: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _OpenChunk:
    """The user chunk being filled."""

    messages: list[Entry] = field(default_factory=list)
    nbytes: int = 0
    records: int = 0
    mixed: bool = False
    sequences: dict[str, int] = field(default_factory=dict)


class CommitPlanner:
    """Lays out one stream's queued appends and offsets as chunks.

    Args:
        active: The stream's active (last) segment, as committed.
        next_id: The stream's next offset.
        tracking: The committed tracking state (copied, not changed).
        timestamp: The commit's time in ms.
        max_segment_bytes: Roll once the active segment holds this much.
    """

    def __init__(
        self,
        active: Segment,
        *,
        next_id: int,
        tracking: TrackingState,
        timestamp: int,
        max_segment_bytes: int,
    ) -> None:
        self._tracking = tracking.copy()
        self._timestamp = timestamp
        self._max_segment_bytes = max_segment_bytes
        self._next_id = next_id
        self._first_id = active.first_id
        self._size = active.size
        self._count = len(active)
        self._index_position = active.index_position()
        self._creating = False
        self._writes: list[SegmentWrite] = []
        self._last_user_chunk_id: int | None = None

    def plan(self, appends: list[PendingAppend], offsets: dict[str, int]) -> StreamCommit:
        """Lay out the appends (in order) and the stored offsets."""
        pending_offsets = offsets
        chunk = _OpenChunk()
        for append in appends:
            if append.records is not None:
                # Appends with sub-batches are kept whole in one chunk.
                if append.messages and chunk.messages and not _fits_whole(append, chunk):
                    self._close_user_chunk(chunk, pending_offsets)
                    pending_offsets, chunk = {}, _OpenChunk()
                if append.messages:
                    self._place_whole(append, chunk)
                    if (
                        len(chunk.messages) >= MAX_ENTRIES_PER_CHUNK
                        or chunk.nbytes >= MAX_CHUNK_DATA_BYTES
                    ):
                        self._close_user_chunk(chunk, pending_offsets)
                        pending_offsets, chunk = {}, _OpenChunk()
                continue
            done = 0
            total = len(append.messages)
            while done < total:
                if not chunk.messages:
                    self._prepare_chunk()
                take, nbytes = _fit(append, done, chunk)
                if take == 0:
                    self._close_user_chunk(chunk, pending_offsets)
                    pending_offsets, chunk = {}, _OpenChunk()
                    continue
                offset = self._next_id + chunk.records
                if append.first_offset is None:
                    append.chunk_id = self._next_id
                    append.first_offset = offset
                append.spans.append((offset, take))
                if done == 0 and take == total:
                    chunk.messages.extend(append.messages)
                else:
                    chunk.messages.extend(append.messages[done : done + take])
                chunk.nbytes += nbytes
                chunk.records += take
                done += take
                if append.reference is not None and append.ids is not None:
                    chunk.sequences[append.reference] = append.ids[done - 1]
                if (
                    len(chunk.messages) >= MAX_ENTRIES_PER_CHUNK
                    or chunk.nbytes >= MAX_CHUNK_DATA_BYTES
                ):
                    self._close_user_chunk(chunk, pending_offsets)
                    pending_offsets, chunk = {}, _OpenChunk()
        if chunk.messages:
            self._close_user_chunk(chunk, pending_offsets)
            pending_offsets = {}
        if pending_offsets:
            self._prepare_chunk()
            body = encode_tracking({}, pending_offsets)
            self._tracking.update(self._next_id, {}, pending_offsets)
            self._emit(TRACKING_DELTA, [body], len(body), b"")
        return StreamCommit(
            appends=appends,
            writes=self._writes,
            tracking=self._tracking,
            next_id=self._next_id,
            last_user_chunk_id=self._last_user_chunk_id,
            timestamp=self._timestamp,
            offsets=offsets,
        )

    def _place_whole(self, append: PendingAppend, chunk: _OpenChunk) -> None:
        """Put a whole append (one with sub-batches) into the open chunk."""
        if not chunk.messages:
            self._prepare_chunk()
        append.chunk_id = self._next_id
        append.first_offset = self._next_id + chunk.records
        append.spans.append((append.first_offset, append.records or 0))
        chunk.messages.extend(append.messages)
        chunk.nbytes += append.nbytes
        chunk.records += append.records or 0
        chunk.mixed = True
        if append.reference is not None and append.ids:
            chunk.sequences[append.reference] = append.ids[-1]

    def _prepare_chunk(self) -> None:
        """Before a chunk: roll if the segment is full; start a rolled segment with a snapshot."""
        if self._count and self._size >= self._max_segment_bytes:
            self._first_id = self._next_id
            self._size = FILE_HEADER_BYTES
            self._count = 0
            self._index_position = FILE_HEADER_BYTES
            self._creating = True
        if self._count == 0 and self._first_id > 0:
            # Every segment but the stream's first starts with a snapshot, so the
            # tracking state is rebuilt from the last segment alone (notes 8.4).
            body = self._tracking.snapshot()
            self._emit(TRACKING_SNAPSHOT, [body], len(body), b"")

    def _close_user_chunk(self, chunk: _OpenChunk, offsets: dict[str, int]) -> None:
        """Emit the filled user chunk with its tracking trailer."""
        trailer = encode_tracking(chunk.sequences, offsets)
        self._tracking.update(self._next_id, chunk.sequences, offsets)
        self._last_user_chunk_id = self._next_id
        records = chunk.records if chunk.mixed else None
        self._emit(USER, chunk.messages, chunk.nbytes, trailer, records)

    def _emit(
        self,
        chunk_type: int,
        messages: Sequence[Entry],
        nbytes: int,
        trailer: bytes,
        records: int | None = None,
    ) -> None:
        """Place a chunk at the end of the current segment."""
        planned = PlannedChunk(
            chunk_type=chunk_type,
            messages=messages,
            records=records,
            chunk_id=self._next_id,
            timestamp=self._timestamp,
            trailer=trailer,
            position=self._size,
            size=chunk_size(nbytes, len(messages), len(trailer)),
        )
        if not self._writes or self._writes[-1].first_id != self._first_id:
            self._writes.append(
                SegmentWrite(
                    first_id=self._first_id,
                    create=self._creating,
                    position=self._size,
                    index_position=self._index_position,
                    chunks=[],
                )
            )
            self._creating = False
        self._writes[-1].chunks.append(planned)
        self._size += planned.size
        self._count += 1
        self._index_position += INDEX_RECORD_BYTES
        self._next_id += planned.num_records


def _fits_whole(append: PendingAppend, chunk: _OpenChunk) -> bool:
    """Whether a whole append still fits the open chunk."""
    return (
        len(chunk.messages) + len(append.messages) <= MAX_ENTRIES_PER_CHUNK
        and chunk.nbytes + append.nbytes <= MAX_CHUNK_DATA_BYTES
    )


def _fit(append: PendingAppend, start: int, chunk: _OpenChunk) -> tuple[int, int]:
    """How many of the append's messages from ``start`` fit the open chunk, and their bytes.

    An empty chunk always takes at least one message, however large.
    """
    room = MAX_ENTRIES_PER_CHUNK - len(chunk.messages)
    byte_room = MAX_CHUNK_DATA_BYTES - chunk.nbytes
    remaining = len(append.messages) - start
    if start == 0 and remaining <= room and append.nbytes <= byte_room:
        return remaining, append.nbytes
    taken = nbytes = 0
    for message in append.messages[start : start + min(room, remaining)]:
        size = len(message)  # type: ignore[arg-type]  # no sub-batches: plain bodies
        if nbytes + size > byte_room and (taken or chunk.messages):
            break
        taken += 1
        nbytes += size
    return taken, nbytes
