"""Segment files: the in-memory index of committed chunks, and the writer thread's files.

A stream's chunks live in ``NNNNNNNNNNNNNNNNNNNN.segment`` files (named by
their first chunk id) with a ``.index`` beside each (docs/stream-protocol-notes.md,
10.1 and 10.2). `Segment` is what the reactor thread knows of one segment:
only committed chunks, kept in arrays for bisection. `SegmentWriter` holds
the active segment's open files and is used only from the writer thread (and
at start-up); `write_stream` is what a commit does there.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gateway.codecs.osiris import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    INDEX_HEADER,
    INDEX_RECORD_BYTES,
    SEGMENT_HEADER,
    SubBatch,
    encode_chunk,
    index_file_name,
    pack_index_record,
    segment_file_name,
)
from gateway.core.log.directory import fsync_directory

__all__ = [
    "EPOCH",
    "PlannedChunk",
    "Segment",
    "SegmentWrite",
    "SegmentWriter",
    "WriteSegment",
    "chunk_size",
    "pwrite_all",
    "write_stream",
]

EPOCH: Final = 1
"""A single node's writer epoch."""

_datasync: Final[Callable[[int], None]] = getattr(os, "fdatasync", os.fsync)

WriteSegment = Callable[[int, bytes, int], None]
"""Writes all of ``data`` to file descriptor ``fd`` at ``position``: how chunks reach
a segment file (a seam for tests that count or hold writes)."""


def pwrite_all(fd: int, data: bytes, position: int) -> None:
    """Write all of ``data`` at ``position``, looping over short writes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written


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


class SegmentWriter:
    """The open files of a stream's active segment, for the writer thread only.

    Args:
        directory: The stream's directory.
        write: How chunks reach the segment file (`pwrite_all`, or a test double).
    """

    def __init__(self, directory: Path, write: WriteSegment) -> None:
        self.directory = directory
        self._write = write
        self._segment_fd: int | None = None
        self._index_fd: int | None = None
        self.first_id: int | None = None

    def open_existing(self, first_id: int) -> None:
        """Open the (recovered) segment ``first_id`` for writing."""
        self.close()
        self._segment_fd = os.open(self.directory / segment_file_name(first_id), os.O_RDWR)
        self._index_fd = os.open(self.directory / index_file_name(first_id), os.O_RDWR)
        self.first_id = first_id

    def create(self, first_id: int, *, sync_directory: bool) -> None:
        """Create segment ``first_id`` (and its index) with their headers, and open them."""
        self.close()
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self._segment_fd = os.open(self.directory / segment_file_name(first_id), flags, 0o644)
        self._index_fd = os.open(self.directory / index_file_name(first_id), flags, 0o644)
        self.first_id = first_id
        pwrite_all(self._segment_fd, SEGMENT_HEADER, 0)
        pwrite_all(self._index_fd, INDEX_HEADER, 0)
        if sync_directory:
            _datasync(self._segment_fd)
            fsync_directory(self.directory)

    def write(self, position: int, data: bytes, index_position: int, index_data: bytes) -> None:
        """Write chunks at ``position``, then their index records."""
        if self._segment_fd is None or self._index_fd is None:
            raise OSError(f"no segment open for writing in {self.directory}")
        self._write(self._segment_fd, data, position)
        pwrite_all(self._index_fd, index_data, index_position)

    def sync(self) -> None:
        """Flush the segment file to disk (the index can be rebuilt, so it is not)."""
        if self._segment_fd is not None:
            _datasync(self._segment_fd)

    def close(self) -> None:
        """Close the open files, if any."""
        for fd in (self._segment_fd, self._index_fd):
            if fd is not None:
                os.close(fd)
        self._segment_fd = self._index_fd = None
        self.first_id = None


def write_stream(
    writer: SegmentWriter, writes: Sequence[SegmentWrite], *, sync: bool, sync_rolls: bool
) -> int:
    """Encode and write one stream's share of a commit: runs in the writer thread.

    Each `SegmentWrite` becomes one write of its chunks and one of their
    index records.

    Args:
        writer: The stream's open files.
        writes: What to write, in order.
        sync: Fsync the active segment once everything is written.
        sync_rolls: Fsync a segment before rolling away from it, and the
            directory after creating a file (false only under NEVER).

    Returns:
        How many segment writes were made.

    Raises:
        OSError: A write failed; the stream must not be written again before recovery.
    """
    for write in writes:
        if write.create:
            if sync_rolls:
                writer.sync()
            writer.create(write.first_id, sync_directory=sync_rolls)
        encoded = [
            encode_chunk(
                chunk.messages,
                first_offset=chunk.chunk_id,
                timestamp_ms=chunk.timestamp,
                epoch=EPOCH,
                chunk_type=chunk.chunk_type,
                trailer=chunk.trailer,
                records=chunk.records,
            )
            for chunk in write.chunks
        ]
        data = encoded[0] if len(encoded) == 1 else b"".join(encoded)
        expected = sum(chunk.size for chunk in write.chunks)
        if len(data) != expected:
            raise RuntimeError(f"planned {expected} bytes of chunks, encoded {len(data)}")
        index = b"".join(
            pack_index_record(
                chunk.chunk_id, chunk.timestamp, EPOCH, chunk.position, chunk.chunk_type
            )
            for chunk in write.chunks
        )
        writer.write(write.position, data, write.index_position, index)
    if sync:
        writer.sync()
    return len(writes)
