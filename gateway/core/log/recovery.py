"""Recovering a stream directory at start-up, after a clean stop or a kill -9.

For each segment (docs/stream-protocol-notes.md, 10.1 to 10.3):

1. Read its index, keeping the prefix of well-formed records whose positions
   and chunk ids ascend.
2. Find the last trustworthy record: walking back from the end, the first
   whose chunk lies within the file, starts with the magic byte, matches the
   record's id and type, and passes its CRC.
3. Scan on from the end of that chunk: every following chunk must have the
   magic byte, fit in the file, pass its CRC and carry the expected id (the
   previous id plus its record count). The segment is truncated at the first
   chunk that does not (a warning names the file and byte offset). Zeros
   alone past the last good chunk are what the writer writes ahead under
   fsync ``always`` (`gateway.core.log.files`): they are cut off quietly.
4. Rewrite the index when it was missing, malformed, ahead of the segment
   or shorter than it.

Empty segments other than the last are removed. Then the tracking state
(publisher sequences, stored offsets) is rebuilt from the last segment that
starts with a tracking snapshot (or the oldest segment) onwards: snapshot
chunks replace it, delta chunks and user chunk trailers update it.

Blocking, by design: this runs once, before the store takes any traffic.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from twisted.logger import Logger

from gateway.codecs.osiris import (
    FILE_HEADER_BYTES,
    HEADER_BYTES,
    INDEX_HEADER,
    INDEX_RECORD_BYTES,
    SEGMENT_HEADER,
    TRACKING_SNAPSHOT,
    USER,
    ChunkHeader,
    IndexRecord,
    OsirisError,
    index_file_name,
    iter_entries,
    iter_index_records,
    parse_file_stem,
    segment_file_name,
    validate_chunk,
)
from gateway.core.log.segment import Segment
from gateway.core.log.tracking import TrackingState

__all__ = ["create_segment_files", "read_index", "recover_stream", "segment_file_ids"]

_log = Logger()


def create_segment_files(directory: Path, first_id: int) -> None:
    """Create an empty segment and index (headers only), replacing any old ones."""
    for name, header in (
        (segment_file_name(first_id), SEGMENT_HEADER),
        (index_file_name(first_id), INDEX_HEADER),
    ):
        with (directory / name).open("wb") as file:
            file.write(header)
            file.flush()
            os.fsync(file.fileno())


def recover_stream(directory: Path) -> tuple[list[Segment], TrackingState]:
    """Recover a stream directory's segments and tracking state.

    Returns:
        The segments, oldest first (at least one: an empty segment 0 is
        created for a stream without any), and the tracking state.

    Raises:
        OSError: A file could not be read or repaired.
    """
    segment_ids, index_ids = segment_file_ids(directory)
    for first_id in index_ids - segment_ids:
        orphan = directory / index_file_name(first_id)
        _log.warn("Removing index {path} without a segment", path=str(orphan))
        orphan.unlink()
    if not segment_ids:
        create_segment_files(directory, 0)
        segment_ids.add(0)
    segments = [_recover_segment(directory, first_id) for first_id in sorted(segment_ids)]
    kept = [segments[-1]]
    for segment in reversed(segments[:-1]):
        if len(segment):
            kept.append(segment)
            continue
        _log.warn("Removing empty segment {path}", path=str(segment.segment_path))
        segment.segment_path.unlink()
        segment.index_path.unlink(missing_ok=True)
    kept.reverse()
    return kept, _rebuild_tracking(kept)


def segment_file_ids(directory: Path) -> tuple[set[int], set[int]]:
    """The first chunk ids of a stream directory's ``.segment`` and ``.index`` files."""
    segment_ids: set[int] = set()
    index_ids: set[int] = set()
    for entry in os.scandir(directory):
        stem, _, suffix = entry.name.partition(".")
        first_id = parse_file_stem(stem)
        if first_id is None:
            continue
        if suffix == "segment":
            segment_ids.add(first_id)
        elif suffix == "index":
            index_ids.add(first_id)
    return segment_ids, index_ids


def read_index(path: Path) -> tuple[list[IndexRecord], bool]:
    """The well-formed, ascending prefix of an index file, and whether that is all of it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    if data[:FILE_HEADER_BYTES] != INDEX_HEADER:
        return [], False
    records: list[IndexRecord] = []
    last_id = last_position = -1
    for record in iter_index_records(data):
        if record.position < FILE_HEADER_BYTES or record.position <= last_position:
            break
        if record.chunk_id <= last_id:
            break
        records.append(record)
        last_id, last_position = record.chunk_id, record.position
    exact = len(data) == FILE_HEADER_BYTES + len(records) * INDEX_RECORD_BYTES
    return records, exact


def _trust_point(
    buf: mmap.mmap, records: Sequence[IndexRecord], first_id: int
) -> tuple[int, int, int]:
    """How many records to keep, where scanning resumes, and the id expected there."""
    size = len(buf)
    kept = len(records)
    while kept:
        record = records[kept - 1]
        if record.position + HEADER_BYTES <= size:
            try:
                header = validate_chunk(buf, record.position)
            except OsirisError:
                header = None
            if (
                header is not None
                and header.first_offset == record.chunk_id
                and header.chunk_type == record.chunk_type
            ):
                return kept, record.position + header.size, header.next_offset
        kept -= 1
    return 0, FILE_HEADER_BYTES, first_id


def _scan(
    buf: mmap.mmap, position: int, expected: int
) -> tuple[list[IndexRecord], int, int, str | None]:
    """Validate chunks from ``position`` to the end of the file.

    Returns:
        Records for the good chunks, where the good data ends, the next chunk
        id, and what is wrong at that end (None if the file ends cleanly).
    """
    found: list[IndexRecord] = []
    size = len(buf)
    while position < size:
        try:
            header = validate_chunk(buf, position)
        except OsirisError as exc:
            return found, position, expected, exc.reason
        if header.first_offset != expected:
            problem = f"chunk id {header.first_offset} where {expected} was expected"
            return found, position, expected, problem
        found.append(
            IndexRecord(
                chunk_id=header.first_offset,
                timestamp=header.timestamp,
                epoch=header.epoch,
                position=position,
                chunk_type=header.chunk_type,
            )
        )
        position += header.size
        expected = header.next_offset
    return found, position, expected, None


_ZEROS_STEP = 1 << 20
"""Bytes compared at a time by `_zeros_from`."""


def _zeros_from(buf: mmap.mmap, position: int) -> bool:
    """Whether the file holds nothing but zeros from ``position`` to its end."""
    return not any(
        buf[start : start + _ZEROS_STEP].strip(b"\0")
        for start in range(position, len(buf), _ZEROS_STEP)
    )


def _write_index(path: Path, records: Sequence[IndexRecord]) -> None:
    """Rewrite an index file from scratch."""
    with path.open("wb") as file:
        file.write(INDEX_HEADER + b"".join(record.pack() for record in records))
        file.flush()
        os.fsync(file.fileno())


def _recover_segment(directory: Path, first_id: int) -> Segment:
    """Validate one segment's tail, truncate it at damage, and repair its index."""
    segment = Segment(directory, first_id)
    path = segment.segment_path
    with path.open("r+b") as file:
        size = os.fstat(file.fileno()).st_size
        if file.read(FILE_HEADER_BYTES) != SEGMENT_HEADER:
            if size:
                _log.warn(
                    "Truncating {path} at byte {position}: no segment header",
                    path=str(path),
                    position=0,
                )
            file.truncate(0)
            file.seek(0)
            file.write(SEGMENT_HEADER)
            file.flush()
            os.fsync(file.fileno())
            _write_index(segment.index_path, [])
            return segment
        records, exact = read_index(segment.index_path)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            kept, resume, expected = _trust_point(buf, records, first_id)
            found, end, next_id, problem = _scan(buf, resume, expected)
            written_ahead = problem is not None and _zeros_from(buf, end)
        if written_ahead:
            file.truncate(end)
        elif problem is not None:
            _log.warn(
                "Truncating {path} at byte {position}: {reason} ({dropped} bytes dropped)",
                path=str(path),
                position=end,
                reason=problem,
                dropped=size - end,
            )
            file.truncate(end)
            os.fsync(file.fileno())
    if found or kept != len(records) or not exact:
        _log.info(
            "Rebuilt index {path}: {kept} records kept, {added} added, {dropped} dropped",
            path=str(segment.index_path),
            kept=kept,
            added=len(found),
            dropped=len(records) - kept,
        )
        _write_index(segment.index_path, [*records[:kept], *found])
    for record in (*records[:kept], *found):
        segment.chunk_ids.append(record.chunk_id)
        segment.positions.append(record.position)
        segment.timestamps.append(record.timestamp)
        segment.types.append(record.chunk_type)
    segment.size = end
    segment.next_id = next_id
    return segment


def _rebuild_tracking(segments: Sequence[Segment]) -> TrackingState:
    """Replay tracking data from the last snapshot (or the oldest segment) onwards."""
    start = 0
    for number in range(len(segments) - 1, -1, -1):
        types = segments[number].types
        if types and types[0] == TRACKING_SNAPSHOT:
            start = number
            break
    state = TrackingState()
    for segment in segments[start:]:
        if not len(segment):
            continue
        with (
            segment.segment_path.open("rb") as file,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf,
        ):
            for number in range(len(segment)):
                _replay_chunk(buf, segment, number, state)
    return state


def _replay_chunk(buf: mmap.mmap, segment: Segment, number: int, state: TrackingState) -> None:
    """Apply one chunk's tracking data (a trailer, a delta or a snapshot) to ``state``."""
    chunk_id = segment.chunk_ids[number]
    try:
        header = ChunkHeader.unpack(buf, segment.positions[number])
        start = segment.positions[number] + header.data_start
        if header.chunk_type == USER:
            if header.trailer_length:
                trailer_start = start + header.data_length
                state.apply_delta(
                    chunk_id, buf[trailer_start : trailer_start + header.trailer_length]
                )
            return
        for body in iter_entries(buf[start : start + header.data_length]):
            if header.chunk_type == TRACKING_SNAPSHOT:
                state.apply_snapshot(body)
            else:
                state.apply_delta(chunk_id, body)
    except OsirisError as exc:
        _log.warn(
            "Skipping the tracking data of chunk {chunk_id} in {path}: {reason}",
            chunk_id=chunk_id,
            path=str(segment.segment_path),
            reason=exc.reason,
        )
