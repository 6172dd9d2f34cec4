"""Planning and reading the log's files from outside the gateway (no Spark needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.codecs import osiris
from gateway.core.outcomes import OUTCOME_STREAM, decode_records
from gateway.protocols.stream.mapping import message_from_entry
from gateway.spark.logfiles import (
    BLOCK_PADDING_BYTES,
    LogReadError,
    Range,
    Slice,
    list_streams,
    plan_slices,
    read_blocks,
    read_slice,
)
from tests.spark.conftest import make_log

SPEC = {
    "segment_bytes": 40_000,
    "streams": {
        "orders": {"count": 2000, "batch": 100, "publisher": "pub-1", "start": 1_700_000_000.0},
        "events": {"count": 300, "batch": 50},
    },
}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log these tests read, written once by the gateway's LogStore."""
    return make_log(tmp_path_factory.mktemp("log") / "log", SPEC)


def _records(root: Path, **bounds: object) -> list[tuple[str, int, bytes]]:
    rows = []
    for piece in plan_slices(root, **bounds):  # type: ignore[arg-type]
        for chunk in read_slice(piece):
            for offset, record in enumerate(chunk.records, chunk.header.first_offset):
                rows.append((piece.stream, offset, bytes(record)))
    return rows


def test_every_message_once_in_order(log: Path) -> None:
    """Every message once in order."""
    rows = _records(log, streams=["orders"])
    ids = [message_from_entry(r, stream="orders", timestamp=0.0).id for _, _, r in rows]
    assert ids == [f"orders-{i}" for i in range(2000)]
    offsets = [offset for _, offset, _ in rows]
    assert offsets == sorted(set(offsets))
    # Several segments: each later one starts with a tracking snapshot, an offset of its own.
    assert len({p.segment for p in plan_slices(log, streams=["orders"])}) > 3
    assert offsets[-1] > 1999


def test_streams_and_publishers(log: Path) -> None:
    """Streams and publishers."""
    assert set(list_streams(log)) == {"orders", "events"}
    pieces = plan_slices(log, streams=["orders"])
    chunk = next(read_slice(pieces[0]))
    assert chunk.publishers == ("pub-1",)
    events = next(read_slice(plan_slices(log, streams=["events"])[0]))
    assert events.publishers == ()


def test_offset_filter_skips_segments(log: Path) -> None:
    """Offset filter skips segments."""
    everything = plan_slices(log, streams=["orders"])
    narrow = plan_slices(log, streams=["orders"], offsets=Range(1000, 1010))
    assert sum(len(p.chunk_ids) for p in narrow) <= 3  # the chunks around 1000..1009
    assert len(everything) > 3 * len(narrow)
    rows = [o for _, o, _ in _records(log, streams=["orders"], offsets=Range(1000, 1010))]
    assert min(rows) <= 1000 and max(rows) >= 1009  # whole chunks: Spark keeps the range


def test_timestamp_filter(log: Path) -> None:
    """Timestamp filter."""
    pieces = plan_slices(log, streams=["orders"])
    newest = max(p.last_timestamp for p in pieces)
    assert plan_slices(log, streams=["orders"], timestamps=Range(newest + 1, None)) == []
    assert plan_slices(log, streams=["orders"], timestamps=Range(None, newest + 1))


def test_small_slices(log: Path) -> None:
    """Small slices."""
    pieces = plan_slices(log, streams=["orders"], max_slice_bytes=5_000)
    assert len(pieces) > len(plan_slices(log, streams=["orders"]))
    assert sum(len(list(read_slice(p))) for p in pieces) == 20  # 20 appends of 100


def _copy(log: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(log, target)
    return target


def _segment(root: Path, stream: str, number: int) -> Path:
    directory = list_streams(root)[stream]
    return sorted(directory.glob("*.segment"))[number]


def test_torn_tail_is_not_an_error(log: Path, tmp_path: Path) -> None:
    """Torn tail is not an error."""
    root = _copy(log, tmp_path / "log")
    segment = _segment(root, "events", -1)
    size = segment.stat().st_size
    os.truncate(segment, size - 10)  # the last chunk, cut as a crash would
    rows = _records(root, streams=["events"])
    assert len(rows) == 250  # the last append of 50 is gone, nothing else


def test_damage_before_the_end_is_an_error(log: Path, tmp_path: Path) -> None:
    """Damage before the end is an error."""
    root = _copy(log, tmp_path / "log")
    segment = _segment(root, "events", 0)  # starts with a user chunk, more follow
    with open(segment, "r+b") as handle:
        handle.seek(osiris.FILE_HEADER_BYTES + osiris.HEADER_BYTES + 20)
        handle.write(b"\xff\xff")
    with pytest.raises(LogReadError, match=r"damaged chunk at byte 8: .*CRC"):
        _records(root, streams=["events"])


def test_a_removed_segment_reads_as_nothing(log: Path, tmp_path: Path) -> None:
    """A removed segment reads as nothing."""
    root = _copy(log, tmp_path / "log")
    pieces = plan_slices(root, streams=["events"])
    Path(pieces[0].segment).unlink()  # retention, between planning and reading
    assert list(read_slice(pieces[0])) == []


def test_not_a_log(tmp_path: Path) -> None:
    """Not a log."""
    with pytest.raises(LogReadError, match="cannot list the log directory"):
        plan_slices(tmp_path / "missing")
    (tmp_path / "junk").mkdir()
    assert plan_slices(tmp_path) == []


def test_outcome_records_decode(tmp_path: Path) -> None:
    """Outcome records decode."""
    root = make_log(
        tmp_path / "log",
        {"outcomes": [["r1", "mail", "accepted", 10.0, 10.25, "a@b", ["x@y.example"], 7]]},
    )
    [piece] = plan_slices(root, streams=[OUTCOME_STREAM])
    [chunk] = read_slice(piece)
    [record] = decode_records(chunk.records[0])
    assert record["route"] == "r1" and record["status"] == "accepted"
    assert record["finished"] - record["arrived"] == pytest.approx(0.25)
    assert record["recipients"] == ["x@y.example"] and record["bytes"] == 7


def _block_records(root: Path, **bounds: object) -> list[tuple[str, int, bytes]]:
    rows = []
    offsets = bounds.get("offsets", Range())
    for piece in plan_slices(root, **bounds):  # type: ignore[arg-type]
        for block in read_blocks(piece, offsets=offsets, max_records=250):  # type: ignore[arg-type]
            number = 0
            for chunk in block.chunks:
                for offset in range(chunk.first_offset, chunk.first_offset + chunk.count):
                    start, end = block.starts[number], block.ends[number]
                    rows.append((piece.stream, offset, bytes(block.buffer[start:end])))
                    number += 1
            assert number == block.count
            if block.count:
                assert len(block.buffer) - block.ends[-1] >= BLOCK_PADDING_BYTES
    return rows


@pytest.mark.parametrize(
    "offsets", [Range(), Range(150, 1010), Range(1999, None), Range(None, 1), Range(5000, None)]
)
def test_blocks_hold_the_records_of_read_slice(log: Path, offsets: Range) -> None:
    """Blocks hold exactly the records read_slice reads, within the offsets asked for."""
    expected = [r for r in _records(log, offsets=offsets) if r[1] in offsets]
    assert _block_records(log, offsets=offsets) == expected


def _segment_of(directory: Path, chunks: list[bytes]) -> Slice:
    """A segment file of these chunks, as one slice."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / osiris.segment_file_name(0)
    positions, ids = [], []
    data = bytearray(osiris.SEGMENT_HEADER)
    for chunk in chunks:
        positions.append(len(data))
        ids.append(osiris.ChunkHeader.unpack(chunk).first_offset)
        data += chunk
    path.write_bytes(bytes(data))
    return Slice("s", str(path), tuple(positions), tuple(ids), ids[0], None, 0, 0)


def test_blocks_of_sub_batches(tmp_path: Path) -> None:
    """Records of plain and gzip sub-batches, beside simple entries, in order."""
    plain = osiris.SubBatch.parse(osiris.encode_sub_batch([b"p1", b"p22", b""]))
    zipped = osiris.SubBatch.parse(
        osiris.encode_sub_batch([b"z1", b"z2" * 50], compression=osiris.COMPRESSION_GZIP)
    )
    chunks = [
        osiris.encode_chunk([b"a", plain, b"b"], first_offset=0, timestamp_ms=1, records=5),
        osiris.encode_chunk([b"uniform"] * 3, first_offset=5, timestamp_ms=2),
        osiris.encode_chunk([zipped, b"c"], first_offset=8, timestamp_ms=3, records=3),
    ]
    piece = _segment_of(tmp_path / "s", chunks)
    expected = [
        (offset, bytes(record))
        for chunk in read_slice(piece)
        for offset, record in enumerate(chunk.records, chunk.header.first_offset)
    ]
    assert [r for _, r in expected] == [
        b"a",
        b"p1",
        b"p22",
        b"",
        b"b",
        *[b"uniform"] * 3,
        b"z1",
        b"z2" * 50,
        b"c",
    ]
    for offsets in (Range(), Range(2, 9), Range(9, None)):
        got = []
        for block in read_blocks(piece, offsets=offsets, max_records=4):
            number = 0
            for chunk in block.chunks:
                for offset in range(chunk.first_offset, chunk.first_offset + chunk.count):
                    start, end = block.starts[number], block.ends[number]
                    got.append((offset, bytes(block.buffer[start:end])))
                    number += 1
        assert got == [r for r in expected if r[0] in offsets]


def test_blocks_report_damage(log: Path, tmp_path: Path) -> None:
    """A damaged chunk before the end is an error for blocks too; a torn tail is not."""
    root = _copy(log, tmp_path / "log")
    segment = _segment(root, "events", 0)
    with open(segment, "r+b") as handle:
        handle.seek(osiris.FILE_HEADER_BYTES + osiris.HEADER_BYTES + 20)
        handle.write(b"\xff\xff")
    with pytest.raises(LogReadError, match=r"damaged chunk at byte 8: .*CRC"):
        _block_records(root, streams=["events"])
    last = _segment(root, "events", -1)
    os.truncate(last, last.stat().st_size - 10)
    [*_, piece] = plan_slices(root, streams=["events"])
    assert sum(b.count for b in read_blocks(piece)) == len(piece.chunk_ids) * 50 - 50
