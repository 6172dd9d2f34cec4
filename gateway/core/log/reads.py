"""Reading one stream's committed segments: where a chunk is, and its bytes.

`SegmentReads` answers a `gateway.core.log.stream.StreamLog`'s seeks and
reads from its segments' in-memory index (chunk ids, positions, types and
timestamps, as `gateway.core.log.segment.Segment` keeps them) and reads
chunk bytes with ``os.pread``, bounded by the caller's byte budget, through
a small cache of read-only descriptors. It sees only what the stream has
published (committed); the stream checks its own state (deleted, closed)
first. All of it runs on the reactor thread.

Offsets follow osiris (docs/stream-protocol-notes.md, section 7): they count
records, a chunk's id is the offset of its first record, and tracking chunks
take one offset each, so user-visible offsets have gaps.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Final

from gateway.codecs.osiris import HEADER_BYTES, USER, ChunkHeader, delivery_payload
from gateway.core.log.segment import Segment
from gateway.core.log.values import ChunkSpan, LogError, StoredChunk

__all__ = ["MAX_OPEN_READ_FILES", "SegmentReads", "first_chunk_id"]

MAX_OPEN_READ_FILES: Final = 4
"""Segment files a stream keeps open for reading (most reads hit the newest)."""
_U64_MAX: Final = 2**64 - 1


def first_chunk_id(segments: Sequence[Segment], next_id: int) -> int:
    """Id of the oldest chunk kept, or ``next_id`` when the segments hold none."""
    for segment in segments:
        if len(segment):
            return segment.chunk_ids[0]
    return next_id


def _newest_timestamp(segment: Segment) -> int:
    """A segment's newest chunk timestamp; an empty segment (only ever the last) sorts last."""
    newest = segment.last_timestamp
    return _U64_MAX if newest is None else newest


def _start(segments: Sequence[Segment], chunk_id: int) -> tuple[int, int]:
    """Segment number and chunk index a read from ``chunk_id`` starts at."""
    number = bisect_right(segments, chunk_id, key=lambda s: s.first_id) - 1
    if number < 0:
        return 0, 0
    segment = segments[number]
    index = max(segment.locate(chunk_id), 0)
    if index < len(segment) and chunk_id >= segment.chunk_next_id(index):
        index += 1
    return number, index


def _first_user(segments: Sequence[Segment], chunk_id: int) -> tuple[Segment, int] | None:
    """The segment and index of the first user chunk a read from ``chunk_id`` gives, if any."""
    number, index = _start(segments, chunk_id)
    while number < len(segments):
        segment = segments[number]
        found = segment.types.find(USER, index)
        if found >= 0:
            return segment, found
        number, index = number + 1, 0
    return None


class SegmentReads:
    """Seeks and chunk reads over a stream's segments, with its read descriptors."""

    def __init__(self) -> None:
        self._files: dict[int, int] = {}

    def seek_offset(self, segments: Sequence[Segment], offset: int, next_id: int) -> int:
        """The chunk holding ``offset``, clamped to the first and next chunk ids."""
        first = first_chunk_id(segments, next_id)
        if offset <= first:
            return first
        if offset >= next_id:
            return next_id
        number = bisect_right(segments, offset, key=lambda s: s.first_id) - 1
        for segment in reversed(segments[: number + 1]):
            index = segment.locate(offset)
            if index >= 0:
                return segment.chunk_ids[index]
        return first

    def seek_timestamp(self, segments: Sequence[Segment], timestamp: int, next_id: int) -> int:
        """The first chunk written at or after ``timestamp``, else ``next_id``.

        Chunk timestamps never decrease (a commit takes the later of the clock
        and the previous commit's time), so both searches bisect.
        """
        number = bisect_left(segments, timestamp, key=_newest_timestamp)
        if number == len(segments) or not len(segments[number]):
            return next_id
        segment = segments[number]
        return segment.chunk_ids[bisect_left(segment.timestamps, timestamp)]

    def read_chunks(
        self, segments: Sequence[Segment], chunk_id: int, max_chunks: int, max_bytes: int
    ) -> list[StoredChunk]:
        """Read user chunks from ``chunk_id`` on (see `StreamLog.read_chunks`)."""
        number, index = _start(segments, chunk_id)
        chunks: list[StoredChunk] = []
        budget = max_bytes
        # Until a user chunk is found the budget does not stop the read: tracking
        # chunks at the end of a segment must not hide the user chunk after them.
        while number < len(segments) and len(chunks) < max_chunks and (budget > 0 or not chunks):
            segment = segments[number]
            if index >= len(segment):
                number, index = number + 1, 0
                continue
            index, budget = self._read_span(segment, index, max_chunks, budget, chunks)
        return chunks

    def read_spans(
        self, segments: Sequence[Segment], chunk_id: int, max_chunks: int, max_bytes: int
    ) -> list[ChunkSpan] | None:
        """Where user chunks from ``chunk_id`` on lie (see `StreamLog.read_spans`).

        From one segment only: the cache may close another segment's
        descriptor on the way, and the spans must stay usable together.
        """
        found = _first_user(segments, chunk_id)
        if found is None:
            return []
        segment, index = found
        fd = self._file(segment)
        types = segment.types
        spans: list[ChunkSpan] = []
        budget = max_bytes
        while index < len(segment) and len(spans) < max_chunks and (budget > 0 or not spans):
            if types[index] != USER:
                index += 1
                continue
            position = segment.positions[index]
            head = os.pread(fd, HEADER_BYTES, position)
            if len(head) != HEADER_BYTES:
                raise LogError(f"{segment.segment_path} is shorter than its index")
            header = ChunkHeader.unpack(head)
            if header.bloom_size:
                break  # its payload is not one span: `read_chunks` reads it
            length = HEADER_BYTES + header.data_length
            if position + length > segment.chunk_end(index):
                raise LogError(f"{segment.segment_path}: a chunk's data runs past its end")
            spans.append(
                ChunkSpan(
                    chunk_id=header.first_offset,
                    next_chunk_id=header.next_offset,
                    records=header.num_records,
                    fd=fd,
                    position=position,
                    length=length,
                )
            )
            budget -= length
            index += 1
        return spans or None

    def user_chunk_at(self, segments: Sequence[Segment], chunk_id: int) -> tuple[int, int] | None:
        """Id and next chunk id of the first user chunk at or after ``chunk_id``, if any.

        From the index alone (see `StreamLog.user_chunk_at`).
        """
        found = _first_user(segments, chunk_id)
        if found is None:
            return None
        segment, index = found
        return segment.chunk_ids[index], segment.chunk_next_id(index)

    def forget(self, segment: Segment) -> None:
        """Close the descriptor of a segment that is gone (retired), if one is open."""
        fd = self._files.pop(segment.first_id, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every descriptor."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def _read_span(
        self,
        segment: Segment,
        start: int,
        max_chunks: int,
        budget: int,
        chunks: list[StoredChunk],
    ) -> tuple[int, int]:
        """Read consecutive chunks of one segment with one pread; add the user chunks.

        Returns:
            The index after the last chunk read, and the budget left (0 to stop).
        """
        end = start
        span = 0
        wanted = max_chunks - len(chunks)
        while end < len(segment) and wanted:
            size = segment.chunk_end(end) - segment.positions[end]
            if span + size > budget and (chunks or wanted < max_chunks - len(chunks)):
                break
            span += size
            if segment.types[end] == USER:
                wanted -= 1
            end += 1
        if end == start:
            return start, 0
        base = segment.positions[start]
        data = os.pread(self._file(segment), span, base)
        if len(data) != span:
            raise LogError(f"{segment.segment_path} is shorter than its index")
        for number in range(start, end):
            if segment.types[number] != USER:
                continue
            at = segment.positions[number] - base
            header = ChunkHeader.unpack(data, at)
            chunks.append(
                StoredChunk(
                    chunk_id=header.first_offset,
                    next_chunk_id=header.next_offset,
                    header=header,
                    payload=delivery_payload(data, at),
                )
            )
        stop = end < len(segment) or not wanted
        return end, 0 if stop else budget - span

    def _file(self, segment: Segment) -> int:
        """A read-only descriptor for a segment, from a small cache."""
        files = self._files
        fd = files.pop(segment.first_id, None)
        if fd is None:
            fd = os.open(segment.segment_path, os.O_RDONLY)
            if len(files) >= MAX_OPEN_READ_FILES:
                oldest = next(iter(files))
                os.close(files.pop(oldest))
        files[segment.first_id] = fd
        return fd
