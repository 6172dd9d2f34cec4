"""Segments as the reactor thread knows them: committed chunks, and what a commit plans.

A stream's chunks live in ``NNNNNNNNNNNNNNNNNNNN.segment`` files (named by
their first chunk id) with a ``.index`` beside each (docs/stream-protocol-notes.md,
10.1 and 10.2). `Segment` is what the reactor thread knows of one segment:
only committed chunks, kept in arrays for bisection. A commit plans its
chunks as `PlannedChunk` in `SegmentWrite` runs, which the writer thread
writes (`gateway.core.log.files`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.codecs.osiris import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    INDEX_RECORD_BYTES,
    USER,
    SubBatch,
    index_file_name,
    segment_file_name,
)

__all__ = [
    "PlannedChunk",
    "Segment",
    "SegmentWrite",
    "chunk_size",
    "user_records_after",
]


def chunk_size(data_bytes: int, entries: int, trailer_bytes: int) -> int:
    """Bytes a chunk takes on disk (no bloom).

    ``data_bytes`` counts each entry's bytes less the 4 of a simple entry's
    length prefix, which ``entries`` adds back (a sub-batch entry counts its
    whole size less 4).
    """
    return HEADER_BYTES + 4 * entries + data_bytes + trailer_bytes


class Segment:
    """One segment's committed chunks, as the reactor thread knows them.

    Attributes:
        first_id: The segment's first chunk id, its file name.
        segment_path: The ``.segment`` file.
        index_path: The ``.index`` file.
        chunk_ids: Chunk ids, ascending.
        positions: File positions of the chunk headers.
        timestamps: Chunk timestamps (ms), non-decreasing.
        types: Chunk types.
        size: File size up to the end of the last committed chunk.
        next_id: The id after the last chunk (``first_id`` when empty).
    """

    __slots__ = (
        "chunk_ids",
        "first_id",
        "index_path",
        "next_id",
        "positions",
        "segment_path",
        "size",
        "timestamps",
        "types",
    )

    def __init__(self, directory: Path, first_id: int) -> None:
        self.first_id = first_id
        self.segment_path = directory / segment_file_name(first_id)
        self.index_path = directory / index_file_name(first_id)
        self.chunk_ids: array[int] = array("q")
        self.positions: array[int] = array("q")
        self.timestamps: array[int] = array("q")
        self.types = bytearray()
        self.size = FILE_HEADER_BYTES
        self.next_id = first_id

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def add(self, chunk: PlannedChunk) -> None:
        """Record a committed chunk written at the end of the segment."""
        self.chunk_ids.append(chunk.chunk_id)
        self.positions.append(chunk.position)
        self.timestamps.append(chunk.timestamp)
        self.types.append(chunk.chunk_type)
        self.size = chunk.position + chunk.size
        self.next_id = chunk.chunk_id + chunk.num_records

    def locate(self, chunk_id: int) -> int:
        """Index of the chunk holding ``chunk_id`` (greatest id not above it), -1 if before."""
        return bisect_right(self.chunk_ids, chunk_id) - 1

    def chunk_end(self, index: int) -> int:
        """File position just after chunk ``index``."""
        return self.positions[index + 1] if index + 1 < len(self.positions) else self.size

    def chunk_next_id(self, index: int) -> int:
        """The id after chunk ``index``: the next chunk's id."""
        return self.chunk_ids[index + 1] if index + 1 < len(self.chunk_ids) else self.next_id

    @property
    def last_timestamp(self) -> int | None:
        """Timestamp of the newest chunk, None when empty."""
        return self.timestamps[-1] if self.timestamps else None

    def index_position(self) -> int:
        """Where the next index record goes in the ``.index`` file."""
        return FILE_HEADER_BYTES + INDEX_RECORD_BYTES * len(self.chunk_ids)


def user_records_after(segments: Sequence[Segment], offset: int) -> int:
    """How many user records the segments hold at offsets above ``offset``.

    What a reader that has read up to ``offset`` still has to read: tracking
    chunks take one offset each and hold no message, so they are left out.
    From the in-memory index alone (a count of chunk types per segment),
    without reading a file; segments wholly at or below ``offset`` are not
    looked at.
    """
    total = 0
    start = offset + 1
    for segment in reversed(segments):
        if segment.next_id <= start:
            break
        count = len(segment)
        if not count:
            continue
        holding = segment.locate(start)
        if holding >= 0 and segment.types[holding] == USER:
            # The chunk holding ``start``: only its records from ``start`` on.
            total += segment.chunk_next_id(holding) - start
        after = holding + 1
        if after < count:
            others = (count - after) - segment.types.count(USER, after)
            total += segment.next_id - segment.chunk_ids[after] - others
        if holding >= 0:
            break  # the older segments are all below ``start``
    return total


@dataclass(slots=True, kw_only=True)
class PlannedChunk:
    """A chunk planned on the reactor thread and encoded in the writer thread.

    Attributes:
        chunk_type: The osiris chunk type.
        messages: Entry bodies (for tracking chunks, the one tracking body),
            and whole sub-batch entries when ``records`` is set.
        chunk_id: Its id.
        timestamp: Commit time in ms.
        trailer: Tracking delta entries to store after the data.
        position: Where its header goes in the segment file.
        size: Its size on disk.
        records: Records its entries hold, when some are sub-batches (None:
            one per entry).
    """

    chunk_type: int
    messages: Sequence[bytes | memoryview | SubBatch]
    chunk_id: int
    timestamp: int
    trailer: bytes
    position: int
    size: int
    records: int | None = None

    @property
    def num_records(self) -> int:
        """Offsets the chunk takes: one per simple entry, a sub-batch's count for each."""
        return len(self.messages) if self.records is None else self.records


@dataclass(slots=True, kw_only=True)
class SegmentWrite:
    """Consecutive chunks for one segment file, written with one write.

    Attributes:
        first_id: The segment they go into.
        create: The segment is new: roll to it first.
        position: Where the first chunk goes.
        index_position: Where their index records go.
        chunks: The chunks, in order.
    """

    first_id: int
    create: bool
    position: int
    index_position: int
    chunks: list[PlannedChunk]

    @property
    def size(self) -> int:
        """The bytes of its chunks."""
        return sum(chunk.size for chunk in self.chunks)

    @property
    def entries(self) -> int:
        """The entries of its chunks (a sub-batch is one)."""
        return sum(len(chunk.messages) for chunk in self.chunks)
