"""Reading the embedded log's files from outside the gateway: plan and scan.

The Spark data source (`gateway.spark.source`) runs this in Spark's Python
workers, possibly on other machines that share the log directory, and while
the gateway is writing. It reads files only: no log store, no reactor, no
writer thread; the osiris layout and the index reading (`read_index`, the
well-formed ascending records) are the log's own.

Planning (`plan_slices`) reads only ``meta.json`` and ``.index`` files: each
segment becomes one or more `Slice` s (consecutive chunks of at most
``max_slice_bytes``), each with its offset and timestamp range, so a filter
on stream, offset or time skips segments and chunk ranges without opening
their segment files.

Scanning (`read_slice`, `read_blocks`) maps the segment file and walks the
chunks the index listed when the slice was planned. `read_slice` yields each
chunk's records as buffers; `read_blocks` yields `RecordBlock` s, the
records of consecutive chunks as start and end positions into one copy of
their bytes, for the columnar decoder (`gateway.spark.columnar`): one
Python object per chunk, not per record. The gateway writes a chunk before its
index record, so a listed chunk was written in full; it is still checked
(magic, lengths, CRC). A chunk that fails the checks at the end of what the
index lists is a torn tail (a crash, or a reader racing a writer after a
crash): the scan stops there without an error. One that fails before the
end is damage, and raises `LogReadError` naming the file and byte. Tracking
chunks hold no messages and are skipped; a user chunk's trailer names the
publishers whose messages it holds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from gateway.codecs.osiris import (
    COMPRESSION_NONE,
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    SUB_BATCH_HEADER_BYTES,
    USER,
    ChunkHeader,
    OsirisError,
    decode_tracking,
    index_file_name,
    iter_entries,
    segment_file_name,
    validate_chunk,
)
from gateway.core.log.directory import META_FILE, decode_meta
from gateway.core.log.recovery import read_index, segment_file_ids

__all__ = [
    "BLOCK_PADDING_BYTES",
    "DEFAULT_SLICE_BYTES",
    "BlockChunk",
    "ChunkRecords",
    "LogReadError",
    "Range",
    "RecordBlock",
    "SegmentGoneError",
    "Slice",
    "StreamBounds",
    "list_streams",
    "plan_slices",
    "read_blocks",
    "read_slice",
    "stream_bounds",
]

DEFAULT_SLICE_BYTES: Final = 16 * 1024 * 1024
"""Most bytes of chunks in one slice (one Spark partition): a quarter of a default
segment, so that a few segments still make enough tasks for every core."""

BLOCK_PADDING_BYTES: Final = 64
"""Zero bytes after the last record of a `RecordBlock`: a fixed-width read at
any record byte stays inside the buffer."""

_UNBOUNDED: Final = 2**63 - 1
_MAX_POSITION: Final = 2**31 - BLOCK_PADDING_BYTES
"""Records past this in a file are read from a copy: positions stay within 31 bits."""
_U32: Final = struct.Struct(">I")
_SUB_BATCH: Final = struct.Struct(">BHII")


class LogReadError(Exception):
    """The log's files cannot be read as a log: a message naming the file and byte."""


class SegmentGoneError(LogReadError):
    """A segment planned for reading was deleted (retention) before it was read."""


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """The offsets a stream's files hold now.

    Attributes:
        first: The first offset still kept: the oldest segment's first chunk id.
        next: The offset after the last chunk the index lists (``first``
            when it lists none).
    """

    first: int
    next: int


@dataclass(frozen=True, slots=True)
class Range:
    """A half-open range ``[low, high)`` of offsets or timestamps (ms); None is open."""

    low: int | None = None
    high: int | None = None

    def overlaps(self, first: int, last: int) -> bool:
        """Whether any value of ``[first, last]`` is in the range."""
        if self.low is not None and last < self.low:
            return False
        return self.high is None or first < self.high

    def __contains__(self, value: int) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value < self.high)

    @property
    def unbounded(self) -> bool:
        """Whether the range holds every value."""
        return self.low is None and self.high is None


@dataclass(frozen=True, slots=True)
class Slice:
    """Consecutive chunks of one segment: one partition of a Spark scan.

    Attributes:
        stream: The stream's name.
        segment: Path of the ``.segment`` file.
        positions: File positions of the slice's chunks, ascending.
        chunk_ids: Their chunk ids (first offsets).
        first_offset: The slice's first offset.
        next_offset: The offset after its last record, when the index tells
            (the next chunk's id); None for the last chunk of a segment that
            is still being written.
        first_timestamp: The first chunk's timestamp (ms).
        last_timestamp: The last chunk's timestamp (ms).
    """

    stream: str
    segment: str
    positions: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    first_offset: int
    next_offset: int | None
    first_timestamp: int
    last_timestamp: int


@dataclass(frozen=True, slots=True)
class ChunkRecords:
    """The records of one user chunk.

    Attributes:
        header: The chunk header.
        records: The records, in offset order (sub-batches already split).
        publishers: The publisher references in the chunk's trailer.
    """

    header: ChunkHeader
    records: list[bytes | memoryview]
    publishers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BlockChunk:
    """The records one chunk contributes to a `RecordBlock`.

    Attributes:
        first_offset: Offset of its first record in the block.
        count: Records in the block, consecutive offsets from ``first_offset``.
        timestamp: The chunk's timestamp (ms).
        publishers: The publisher references in the chunk's trailer.
    """

    first_offset: int
    count: int
    timestamp: int
    publishers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RecordBlock:
    """Records of consecutive chunks as positions into one buffer.

    Record ``i`` is ``buffer[starts[i]:ends[i]]``; records are in offset
    order, chunk after chunk (``chunks`` says which records are whose), and
    their ranges ascend without overlapping. ``buffer`` is the mapped
    segment file itself, or, for the end of a file and for gzip
    sub-batches, a copy of the chunks' bytes with the inflated records
    after them. Either way at least `BLOCK_PADDING_BYTES` bytes follow the
    last record, and positions fit in 31 bits.

    Attributes:
        buffer: The bytes (read them only while the block is being read:
            a mapped file is unmapped once the slice is read).
        starts: Where each record starts (int64).
        ends: Where each record ends (int64).
        chunks: The chunks, in order.
    """

    buffer: bytearray | mmap.mmap
    starts: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    chunks: tuple[BlockChunk, ...]

    @property
    def count(self) -> int:
        """Records in the block."""
        return len(self.starts)


def list_streams(root: Path | str) -> dict[str, Path]:
    """The streams of a log directory: name (from ``meta.json``) to directory.

    Directories without a readable ``meta.json`` (the store's work
    directories, a stream being created) are not streams and are left out.

    Raises:
        LogReadError: ``root`` is not a readable directory.
    """
    root = Path(root)
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except OSError as exc:
        raise LogReadError(f"{root}: cannot list the log directory: {exc.strerror}") from None
    streams: dict[str, Path] = {}
    for entry in entries:
        if not entry.is_dir() or "." in entry.name:
            continue
        try:
            name, _retention = decode_meta((Path(entry.path) / META_FILE).read_bytes())
        except (OSError, ValueError):
            continue
        streams[name] = Path(entry.path)
    return streams


def stream_bounds(directory: Path | str) -> StreamBounds:
    """The first offset a stream's directory still holds, and the next one to come.

    From the index files and the header of the last chunk they list (the
    gateway writes a chunk before its index record): what a reader planning
    now would find, whatever the gateway appends meanwhile.

    Raises:
        LogReadError: The last chunk listed cannot be read.
    """
    directory = Path(directory)
    segment_ids, index_ids = segment_file_ids(directory)
    ids = sorted(segment_ids & index_ids)
    if not ids:
        return StreamBounds(0, 0)
    for number in range(len(ids) - 1, -1, -1):
        following = ids[number + 1] if number + 1 < len(ids) else None
        records, _complete = read_index(directory / index_file_name(ids[number]))
        if following is not None:
            records = [r for r in records if r.chunk_id < following]
        if not records:
            continue
        last = records[-1]
        segment = directory / segment_file_name(ids[number])
        try:
            with open(segment, "rb") as handle:
                handle.seek(last.position)
                header = ChunkHeader.unpack(handle.read(HEADER_BYTES))
        except FileNotFoundError:
            continue  # retention removed it meanwhile: an older one is older still
        except (OSError, OsirisError) as exc:
            raise LogReadError(f"{segment}: chunk at byte {last.position}: {exc}") from None
        if header.first_offset != last.chunk_id:
            raise LogReadError(
                f"{segment}: byte {last.position} holds chunk {header.first_offset},"
                f" the index says {last.chunk_id}"
            )
        return StreamBounds(ids[0], header.next_offset)
    return StreamBounds(ids[0], ids[-1])


def plan_slices(
    root: Path | str,
    *,
    streams: Sequence[str] | None = None,
    offsets: Range = Range(),
    timestamps: Range = Range(),
    max_slice_bytes: int = DEFAULT_SLICE_BYTES,
) -> list[Slice]:
    """The slices holding what a scan with these bounds can return.

    Args:
        root: The log directory (the gateway's ``data_dir``/log).
        streams: Only these streams (None: all); names not in the log are ignored.
        offsets: Only chunks that may hold offsets in this range.
        timestamps: Only chunks whose timestamp (ms) is in this range.
        max_slice_bytes: Split segments into slices of about this many bytes.
    """
    found = list_streams(root)
    wanted = found if streams is None else {n: found[n] for n in streams if n in found}
    slices: list[Slice] = []
    for name, directory in wanted.items():
        slices.extend(_stream_slices(name, directory, offsets, timestamps, max_slice_bytes))
    return slices


def _stream_slices(
    name: str, directory: Path, offsets: Range, timestamps: Range, max_bytes: int
) -> Iterator[Slice]:
    ids = sorted(segment_file_ids(directory)[1])  # by their indexes: what they list is committed
    for number, first_id in enumerate(ids):
        following = ids[number + 1] if number + 1 < len(ids) else None
        if offsets.high is not None and first_id >= offsets.high:
            return
        if following is not None and offsets.low is not None and following <= offsets.low:
            continue
        # Missing (retention removed it since the listing) or without its header
        # yet (just created): no records. Otherwise the well-formed, ascending ones.
        records, _complete = read_index(directory / index_file_name(first_id))
        chunks = [(r.chunk_id, r.position, r.timestamp) for r in records if r.chunk_type == USER]
        # Only the chunks before the next segment's first id: a crash can
        # leave records past what recovery keeps, and the next segment wins.
        if following is not None:
            chunks = [c for c in chunks if c[0] < following]
        segment = str(directory / segment_file_name(first_id))
        yield from _split(name, segment, chunks, following, offsets, timestamps, max_bytes)


def _split(
    name: str,
    segment: str,
    chunks: list[tuple[int, int, int]],
    following: int | None,
    offsets: Range,
    timestamps: Range,
    max_bytes: int,
) -> Iterator[Slice]:
    """Group a segment's kept chunks into slices of about ``max_bytes``."""
    group: list[tuple[int, int, int, int | None]] = []
    for number, (chunk_id, position, timestamp) in enumerate(chunks):
        next_id = chunks[number + 1][0] if number + 1 < len(chunks) else following
        last = (next_id - 1) if next_id is not None else _UNBOUNDED
        if not offsets.overlaps(chunk_id, last) or timestamp not in timestamps:
            if group:
                yield _slice(name, segment, group)
                group = []
            continue
        if group and position - group[0][1] >= max_bytes:
            yield _slice(name, segment, group)
            group = []
        group.append((chunk_id, position, timestamp, next_id))
    if group:
        yield _slice(name, segment, group)


def _slice(name: str, segment: str, group: list[tuple[int, int, int, int | None]]) -> Slice:
    return Slice(
        stream=name,
        segment=segment,
        positions=tuple(g[1] for g in group),
        chunk_ids=tuple(g[0] for g in group),
        first_offset=group[0][0],
        next_offset=group[-1][3],
        first_timestamp=group[0][2],
        last_timestamp=group[-1][2],
    )


def read_slice(piece: Slice) -> Iterator[ChunkRecords]:
    """Yield the user chunks of a slice with their records.

    Raises:
        LogReadError: A chunk before the last one listed is damaged, or a
            record does not decode (an unknown compression, say).
    """
    buf = _mapped(piece)
    if buf is None:
        return
    try:
        yield from _chunks(piece, buf)
    finally:
        buf.close()


def read_blocks(
    piece: Slice,
    *,
    offsets: Range = Range(),
    timestamps: Range = Range(),
    max_records: int = 8192,
    missing_ok: bool = True,
) -> Iterator[RecordBlock]:
    """Yield the records of a slice's user chunks as blocks of whole chunks.

    A block holds the chunks read until it has at least ``max_records``
    records (so one chunk can make it larger). Only records whose offset is
    in ``offsets``, of chunks whose timestamp is in ``timestamps``, are in
    a block; chunks are checked as `read_slice` checks them. A segment that
    retention removed since planning reads as nothing, unless not
    ``missing_ok``.

    Raises:
        SegmentGoneError: The segment file is gone and not ``missing_ok``.
        LogReadError: As `read_slice`.
    """
    buf = _mapped(piece)
    if buf is None:
        if not missing_ok and not os.path.exists(piece.segment):
            raise SegmentGoneError(f"{piece.segment}: deleted before it was read (retention)")
        return
    try:
        pending: list[tuple[int, ChunkHeader]] = []
        records = 0
        for position, header in _user_chunks(piece, buf):
            if header.timestamp not in timestamps or not offsets.overlaps(
                header.first_offset, header.next_offset - 1
            ):
                continue
            pending.append((position, header))
            records += header.num_records
            if records >= max_records:
                yield _block(piece, buf, pending, offsets)
                pending, records = [], 0
        if pending:
            yield _block(piece, buf, pending, offsets)
    finally:
        with contextlib.suppress(BufferError):  # still viewed: unmapped when collected
            buf.close()


def _block(
    piece: Slice, buf: mmap.mmap, chunks: list[tuple[int, ChunkHeader]], offsets: Range
) -> RecordBlock:
    """The chunks' records, in the mapped file where it can be, else in a copy.

    A copy (first chunk's data to last chunk's) is made for the end of a
    file, where no padding follows, and for chunks with sub-batches, whose
    gzip records must be inflated after it.
    """
    first = chunks[0][0] + chunks[0][1].data_start
    last_position, last_header = chunks[-1]
    end = last_position + last_header.data_start + last_header.data_length
    plain = all(h.num_entries == h.num_records for _, h in chunks)
    buffer: bytearray | mmap.mmap
    if plain and end + BLOCK_PADDING_BYTES <= len(buf) and end < _MAX_POSITION:
        buffer, base = buf, 0
    else:
        size = end - first
        buffer, base = bytearray(size + BLOCK_PADDING_BYTES), first
        with memoryview(buf) as view:
            buffer[:size] = view[first:end]
    starts: list[npt.NDArray[np.int64]] = []
    ends: list[npt.NDArray[np.int64]] = []
    inflated: list[bytes | memoryview] = []
    described: list[BlockChunk] = []
    for position, header in chunks:
        data_start = position + header.data_start - base
        data_end = data_start + header.data_length
        spans = None
        if header.num_entries == header.num_records:
            spans = _simple_entries(buffer, data_start, data_end, header.num_entries)
        if spans is None:
            assert isinstance(buffer, bytearray)  # a chunk with sub-batches: a copy
            spans = _other_entries(piece, position, buffer, data_start, data_end, inflated)
        # Keep only the records in range: a run of consecutive offsets.
        count = len(spans[0])
        first_offset = header.first_offset
        keep_from = 0 if offsets.low is None else min(max(offsets.low - first_offset, 0), count)
        keep_to = count if offsets.high is None else min(max(offsets.high - first_offset, 0), count)
        if keep_to <= keep_from:
            continue
        starts.append(spans[0][keep_from:keep_to])
        ends.append(spans[1][keep_from:keep_to])
        trailer_at = position + header.data_start + header.data_length
        try:
            publishers = _publishers(buf[trailer_at : trailer_at + header.trailer_length])
        except OsirisError as exc:
            raise LogReadError(f"{piece.segment}: chunk at byte {position}: {exc}") from None
        described.append(
            BlockChunk(first_offset + keep_from, keep_to - keep_from, header.timestamp, publishers)
        )
    if inflated:
        # Records that are not in the file as they are: after the chunks' bytes.
        assert isinstance(buffer, bytearray)
        buffer[len(buffer) - BLOCK_PADDING_BYTES :] = b"".join(inflated) + bytes(
            BLOCK_PADDING_BYTES
        )
    empty = np.zeros(0, np.int64)
    return RecordBlock(
        buffer=buffer,
        starts=np.concatenate(starts) if starts else empty,
        ends=np.concatenate(ends) if ends else empty,
        chunks=tuple(described),
    )


def _simple_entries(
    buffer: bytearray | mmap.mmap, pos: int, end: int, count: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """The positions of ``count`` simple entries from ``pos``; None if they are not.

    Entries of one length (a producer's fixed-size messages) are checked
    with one strided comparison; others are walked one by one. A
    sub-batch's flag byte makes a length of 2 GiB or more, so a chunk with
    one overruns ``end``, as does a cut or miscounted one: the caller then
    reads the chunk the general way, which also names what is wrong.
    """
    if count and end - pos >= 4:
        (length,) = _U32.unpack_from(buffer, pos)
        step = 4 + length
        if step * count == end - pos:
            lengths = np.ndarray((count,), ">u4", buffer, pos, (step,))
            if bool((lengths == length).all()):
                starts = np.arange(pos + 4, end, step, dtype=np.int64)
                return starts, starts + length
    found = array("q")
    unpack = _U32.unpack_from
    add = found.append
    try:
        for _ in range(count):
            (length,) = unpack(buffer, pos)
            add(pos + 4)
            add(pos + 4 + length)
            pos += 4 + length
    except struct.error:
        return None
    if pos != end:
        return None
    both = np.frombuffer(found, np.int64)
    return both[0::2].copy(), both[1::2].copy()


def _other_entries(
    piece: Slice,
    position: int,
    buffer: bytearray,
    data_start: int,
    data_end: int,
    inflated: list[bytes | memoryview],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The records of a chunk with sub-batches (or a malformed one, which raises).

    The chunk is first read by `iter_entries`, which checks it. Records of
    uncompressed sub-batches are where the chunk has them; a gzip
    sub-batch's inflated records go to ``inflated``, whose bytes the block
    appends after the chunks': their positions count from there.
    """
    data = bytes(buffer[data_start:data_end])
    try:
        for _record in iter_entries(data):
            pass
    except OsirisError as exc:
        raise LogReadError(f"{piece.segment}: chunk at byte {position}: {exc}") from None
    starts: list[int] = []
    ends: list[int] = []
    tail_at = len(buffer) - BLOCK_PADDING_BYTES + sum(map(len, inflated))
    pos = 0
    while pos < len(data):
        if not data[pos] & 0x80:
            (length,) = _U32.unpack_from(data, pos)
            starts.append(data_start + pos + 4)
            pos += 4 + length
            ends.append(data_start + pos)
            continue
        flags, count, _uncompressed, length = _SUB_BATCH.unpack_from(data, pos)
        body = pos + SUB_BATCH_HEADER_BYTES
        if (flags >> 4) & 0x07 == COMPRESSION_NONE:
            at = body
            for _ in range(count):
                (size,) = _U32.unpack_from(data, at)
                starts.append(data_start + at + 4)
                at += 4 + size
                ends.append(data_start + at)
        else:
            for record in iter_entries(data[pos : body + length]):
                starts.append(tail_at)
                tail_at += len(record)
                ends.append(tail_at)
                inflated.append(record)
        pos = body + length
    return np.array(starts, np.int64), np.array(ends, np.int64)


def _mapped(piece: Slice) -> mmap.mmap | None:
    """The slice's segment file, mapped; None when it is gone or holds no chunk."""
    try:
        fd = os.open(piece.segment, os.O_RDONLY)
    except FileNotFoundError:
        return None  # retention removed the segment after planning: nothing left to read
    try:
        if os.fstat(fd).st_size <= FILE_HEADER_BYTES:
            return None
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _user_chunks(piece: Slice, buf: mmap.mmap) -> Iterator[tuple[int, ChunkHeader]]:
    """(position, header) of the slice's user chunks, each checked (see `read_slice`)."""
    last = len(piece.positions) - 1
    for number, (position, chunk_id) in enumerate(
        zip(piece.positions, piece.chunk_ids, strict=True)
    ):
        try:
            header = validate_chunk(buf, position)
        except OsirisError as exc:
            if number == last:
                return  # a torn tail: what a crash leaves, not an error
            raise LogReadError(
                f"{piece.segment}: damaged chunk at byte {position}: {exc}"
            ) from None
        if header.first_offset != chunk_id:
            raise LogReadError(
                f"{piece.segment}: byte {position} holds chunk {header.first_offset},"
                f" the index says {chunk_id}"
            )
        if header.chunk_type == USER:
            yield position, header


def _chunks(piece: Slice, buf: mmap.mmap) -> Iterator[ChunkRecords]:
    for position, header in _user_chunks(piece, buf):
        start = position + header.data_start
        trailer_at = start + header.data_length
        # One copy of the data section (mmap slices are bytes), so the
        # records, views of it, outlive the mapping, which closes at the end.
        data = buf[start:trailer_at]
        try:
            records = list(iter_entries(data))
            publishers = _publishers(buf[trailer_at : trailer_at + header.trailer_length])
        except OsirisError as exc:
            raise LogReadError(f"{piece.segment}: chunk at byte {position}: {exc}") from None
        yield ChunkRecords(header=header, records=records, publishers=publishers)


def _publishers(trailer: bytes) -> tuple[str, ...]:
    """The publisher references of a user chunk's trailer (sequence entries)."""
    if not trailer:
        return ()
    sequences, _offsets = decode_tracking(trailer)
    return tuple(sequences)
