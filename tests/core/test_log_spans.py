"""Tests for `StreamLog.read_spans`: where chunks lie in the files, for ``os.sendfile``.

A span's bytes, read from its descriptor, must be exactly the payload
`StreamLog.read_chunks` gives for the same chunk (the general path, which
the Deliver tests check against the spec), over streams with tracking
chunks, trailers and many segments, read with any bounds. Real files and
the real reactor; a segment with a bloom filter is written by hand, since
the log writes none.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_twisted

from gateway.codecs import osiris
from gateway.core.log import ChunkSpan, LogError, Retention, StreamLog
from gateway.core.log.reads import SegmentReads
from gateway.core.log.segment import PlannedChunk, Segment
from tests.core.test_log import fill, open_store, read_all

Walked = list[tuple[int, int, int, bytes]]
"""Per chunk: its id, the next id, its records, its Deliver payload."""


def walk_chunks(stream: StreamLog) -> Walked:
    """Every chunk as `read_chunks` gives it."""
    return [
        (chunk.chunk_id, chunk.next_chunk_id, chunk.header.num_records, chunk.payload)
        for chunk in read_all(stream)
    ]


def span_bytes(span: ChunkSpan) -> bytes:
    """What a span points at."""
    return os.pread(span.fd, span.length, span.position)


def walk_spans(stream: StreamLog, max_chunks: int, max_bytes: int) -> Walked:
    """Every chunk as `read_spans` places it, checking each call's bounds."""
    position = stream.seek(("first",))
    walked: Walked = []
    while spans := stream.read_spans(position, max_chunks, max_bytes):
        assert len(spans) <= max_chunks
        assert len({span.fd for span in spans}) == 1  # one segment a call
        assert sum(span.length for span in spans[:-1]) < max_bytes or len(spans) == 1
        walked.extend((s.chunk_id, s.next_chunk_id, s.records, span_bytes(s)) for s in spans)
        position = spans[-1].next_chunk_id
    assert spans == []  # the end, never None: the log writes no bloom filter
    return walked


@pytest_twisted.ensureDeferred
async def test_spans_hold_the_payloads_read_chunks_gives(tmp_path: Path) -> None:
    """Trailers, tracking snapshots at each roll, many segments: the same chunks, same bytes."""
    store = open_store(tmp_path, default_retention=Retention(max_segment_bytes=300))
    try:
        stream = store.create("s")
        await fill(stream, 9)  # with a publisher reference: every chunk has a trailer
        assert len(stream.segments) >= 4
        chunks = walk_chunks(stream)
        assert len(chunks) == 9
        for max_chunks, max_bytes in [(10, 10**6), (3, 4096), (1, 10**6), (10, 1)]:
            assert walk_spans(stream, max_chunks, max_bytes) == chunks
    finally:
        await store.close()


@pytest.mark.parametrize("seed", range(8))
@pytest_twisted.ensureDeferred
async def test_spans_agree_with_chunks_whatever_the_commits_and_bounds(
    tmp_path: Path, seed: int
) -> None:
    """Random commits (sizes, counts, references), segment size and read bounds."""
    rng = random.Random(seed)
    segment_bytes = rng.choice([300, 1000, 5000, 10**6])
    store = open_store(tmp_path, default_retention=Retention(max_segment_bytes=segment_bytes))
    try:
        stream = store.create("s")
        publishing_id = 0
        for _ in range(rng.randint(1, 12)):
            bodies = [os.urandom(rng.randint(0, 400)) for _ in range(rng.randint(1, 20))]
            if rng.random() < 0.5:
                ids = list(range(publishing_id + 1, publishing_id + 1 + len(bodies)))
                publishing_id = ids[-1]
                await stream.append(bodies, reference="p", publishing_ids=ids)
            else:
                await stream.append(bodies)
            if rng.random() < 0.3:
                stream.store_offset("reader", rng.randint(0, 100))
        chunks = walk_chunks(stream)
        for _ in range(4):
            bounds = (rng.randint(1, 6), rng.choice([1, 200, 2000, 10**6]))
            assert walk_spans(stream, *bounds) == chunks, bounds
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_spans_start_where_read_chunks_starts(tmp_path: Path) -> None:
    """From an offset inside a chunk, before the first, and at the end."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        await stream.append([b"a", b"b", b"c"])
        await stream.append([b"d", b"e"])
        (span,) = stream.read_spans(1, 1, 10**6) or []
        (chunk,) = stream.read_chunks(1, 1, 10**6)
        assert (span.chunk_id, span_bytes(span)) == (0, chunk.payload)
        assert [s.chunk_id for s in stream.read_spans(3, 5, 10**6) or []] == [3]
        assert stream.read_spans(5, 5, 10**6) == []
        assert stream.read_spans(0, 0, 10**6) == []
    finally:
        await store.close()


def write_segment(directory: Path, chunks: list[tuple[bytes, int]]) -> Segment:
    """A segment file of ``(chunk bytes, records)``, and its index as the log keeps it."""
    segment = Segment(directory, 0)
    data = bytearray(osiris.SEGMENT_HEADER)
    chunk_id = 0
    for raw, records in chunks:
        header = osiris.ChunkHeader.unpack(raw)
        planned = PlannedChunk(
            chunk_type=header.chunk_type,
            messages=[b""] * records,
            chunk_id=chunk_id,
            timestamp=header.timestamp,
            trailer=b"",
            position=len(data),
            size=len(raw),
        )
        segment.add(planned)
        data += raw
        chunk_id += records
    segment.segment_path.write_bytes(bytes(data))
    return segment


def with_bloom(raw: bytes, bloom: bytes) -> bytes:
    """A chunk as RabbitMQ writes it with filter values: its bloom filter before the data."""
    header = osiris.ChunkHeader.unpack(raw)
    header = replace(header, bloom_size=len(bloom))
    return header.pack() + bloom + raw[osiris.HEADER_BYTES :]


def chunk(first: int, bodies: list[bytes]) -> bytes:
    """An encoded user chunk."""
    return osiris.encode_chunk(bodies, first_offset=first, timestamp_ms=1000)


def test_a_chunk_with_a_bloom_filter_is_left_to_read_chunks(tmp_path: Path) -> None:
    """Spans stop before it; from it, None: `read_chunks` reads it, without its filter."""
    bloomed = with_bloom(chunk(2, [b"c"]), b"\xff" * 16)
    segment = write_segment(
        tmp_path, [(chunk(0, [b"a", b"b"]), 2), (bloomed, 1), (chunk(3, [b"d"]), 1)]
    )
    reads = SegmentReads()
    try:
        spans = reads.read_spans([segment], 0, 10, 10**6)
        assert [s.chunk_id for s in spans or []] == [0]
        assert reads.read_spans([segment], 2, 10, 10**6) is None
        (read,) = reads.read_chunks([segment], 2, 1, 10**6)
        head = osiris.HEADER_BYTES  # the header as stored, the data without the filter
        assert read.payload == bloomed[:head] + bloomed[head + 16 :]
        after = reads.read_spans([segment], 3, 10, 10**6) or []
        assert [(s.chunk_id, span_bytes(s)) for s in after] == [(3, chunk(3, [b"d"]))]
    finally:
        reads.close()


def test_a_segment_shorter_than_its_index_is_an_error(tmp_path: Path) -> None:
    """A header cut off, or data running past where the index ends the chunk: LogError."""
    raw = chunk(0, [b"a" * 100])
    segment = write_segment(tmp_path, [(raw, 1)])
    reads = SegmentReads()
    try:
        os.truncate(segment.segment_path, len(osiris.SEGMENT_HEADER) + 20)
        with pytest.raises(LogError, match="shorter than its index"):
            reads.read_spans([segment], 0, 1, 10**6)
    finally:
        reads.close()
    segment = write_segment(tmp_path, [(raw, 1)])
    segment.size -= 10  # the index ends the chunk before its data does
    reads = SegmentReads()
    try:
        with pytest.raises(LogError, match="runs past its end"):
            reads.read_spans([segment], 0, 1, 10**6)
    finally:
        reads.close()
