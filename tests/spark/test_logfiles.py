"""Planning and reading the log's files from outside the gateway (no Spark needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.codecs import osiris
from gateway.core.outcomes import OUTCOME_STREAM, decode_records
from gateway.protocols.stream.mapping import message_from_entry
from gateway.spark.logfiles import (
    LogReadError,
    Range,
    list_streams,
    plan_slices,
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
