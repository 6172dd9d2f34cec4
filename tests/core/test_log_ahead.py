"""Tests for the zeros a segment writer writes ahead of the data (`gateway.core.log.files`).

A small commit written on the reactor thread (under ``fsync = "always"``)
that reaches past the zeros ahead of its segment's data writes the next
`PREALLOCATE_BYTES`, so that the commits after overwrite them and their
fsyncs have no file size to commit; the writer thread's commits write none.
Nothing reads them: a segment is cut back to its data when the writer
closes it or rolls away from it, and recovery cuts off a tail of zeros that
a crash left without a warning. Real files and the real reactor, as in
tests/core/test_log.py.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.logger import LogLevel, capturedLogs

from gateway.core.log import FsyncPolicy, LogStore, StreamLog
from gateway.core.log import files as files_module
from gateway.core.log.files import PREALLOCATE_BYTES
from gateway.core.log.segment import Segment
from tests.core.test_log import (
    fill,
    messages,
    open_store,
    reopen_logged,
    tiny_segments,
    truncation,
)
from tests.core.test_log_inline import INLINE


def inline_store(directory: Path, **options: Any) -> LogStore:
    """A store under ALWAYS that writes small commits on the reactor thread."""
    return open_store(directory, fsync=FsyncPolicy.ALWAYS, inline_max_bytes=INLINE, **options)


async def idle_writer_thread(directory: Path, **options: Any) -> tuple[LogStore, StreamLog]:
    """An `inline_store` with stream "s" holding ``first``: its writer thread idle since.

    The stream's files, then its first commit, are the writer thread's; the
    small commits after are the reactor thread's.
    """
    store = inline_store(directory, **options)
    stream = store.create("s")
    await stream.append([b"first"])
    assert stream.writer.ahead_bytes == 0  # the writer thread's commit
    return store, stream


def file_size(segment: Segment) -> int:
    """The segment file's size, as the file system says."""
    return segment.segment_path.stat().st_size


def past_the_data(segment: Segment) -> bytes:
    """What the segment file holds after its data."""
    return segment.segment_path.read_bytes()[segment.size :]


@pytest_twisted.ensureDeferred
async def test_small_commits_write_zeros_ahead_that_later_commits_overwrite(
    tmp_path: Path,
) -> None:
    """A small commit past the zeros writes the next; those after stay within them."""
    store, stream = await idle_writer_thread(tmp_path)
    try:
        await stream.append([b"second"])
        (segment,) = stream.segments
        second_end = segment.size
        assert file_size(segment) == second_end + PREALLOCATE_BYTES
        assert past_the_data(segment) == bytes(PREALLOCATE_BYTES)
        for number in range(20):
            await stream.append([b"message %d" % number])
        assert segment.size > second_end
        assert file_size(segment) == second_end + PREALLOCATE_BYTES  # overwritten in place
        assert store.stats.inline_commits == 21
        # A large commit (the writer thread's) past the zeros writes none; the
        # next small one does.
        big = b"x" * PREALLOCATE_BYTES
        await stream.append([big])
        assert file_size(segment) == segment.size
        await stream.append([b"last"])
        assert file_size(segment) == segment.size + PREALLOCATE_BYTES
        assert past_the_data(segment) == bytes(PREALLOCATE_BYTES)
        assert messages(stream) == [
            b"first",
            b"second",
            *(b"message %d" % n for n in range(20)),
            big,
            b"last",
        ]
    finally:
        await store.close()
    # Closed: the file ends with its data.
    assert file_size(segment) == segment.size


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    "options",
    [
        {"fsync": FsyncPolicy.ALWAYS},  # every commit through the writer thread
        {"fsync": FsyncPolicy.INTERVAL, "inline_max_bytes": INLINE},
        {"fsync": FsyncPolicy.NEVER, "inline_max_bytes": INLINE},
    ],
)
async def test_commits_through_the_writer_thread_write_no_zeros(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """A busy gateway's commits, or commits without an fsync each: the file ends with its data."""
    store = open_store(tmp_path, **options)
    try:
        stream = store.create("s")
        for number in range(5):
            await stream.append([b"message %d" % number])
        (segment,) = stream.segments
        assert file_size(segment) == segment.size
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_roll_cuts_the_segment_it_leaves_back_to_its_data(tmp_path: Path) -> None:
    """Segments that had zeros ahead end with their data once rolled away from."""
    store, stream = await idle_writer_thread(tmp_path, default_retention=tiny_segments())
    try:
        had_zeros = set()
        for _ in range(8):  # a new segment's first commit is the writer thread's
            await fill(stream, 1)
            if stream.writer.ahead_bytes:
                active = stream.segments[-1]
                assert past_the_data(active) == bytes(stream.writer.ahead_bytes)
                had_zeros.add(active.first_id)
        *rolled, _active = stream.segments
        assert len(had_zeros & {segment.first_id for segment in rolled}) >= 2
        assert [file_size(segment) for segment in rolled] == [s.size for s in rolled]
    finally:
        await store.close()


async def crashed_copy(source: Path, target: Path) -> tuple[StreamLog, list[bytes]]:
    """Stream "s" with messages, copied while its store is open: as a kill -9 leaves it."""
    store = inline_store(source)
    try:
        stream = store.create("s")
        bodies = [b"message %d" % number for number in range(5)]
        for number, body in enumerate(bodies, 1):
            await stream.append([body], reference="p", publishing_ids=[number])
        shutil.copytree(source, target)
    finally:
        await store.close()
    return stream, bodies


def warnings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events logged at warn level or above."""
    return [e for e in events if e["log_level"] >= LogLevel.warn]


@pytest_twisted.ensureDeferred
async def test_recovery_cuts_off_the_zeros_a_crash_left_without_a_warning(
    tmp_path: Path,
) -> None:
    """Zeros alone after the last chunk are no damage: cut off quietly; every chunk stays."""
    old, bodies = await crashed_copy(tmp_path / "live", tmp_path / "crashed")
    (segment,) = old.segments
    copied = Segment(tmp_path / "crashed" / segment.segment_path.parent.name, 0)
    tail = copied.segment_path.read_bytes()[segment.size :]
    assert tail and tail == bytes(len(tail))
    with capturedLogs() as events:
        store = inline_store(tmp_path / "crashed")
    stream = store.get("s")
    assert stream is not None
    try:
        assert warnings(list(events)) == []
        assert copied.segment_path.stat().st_size == segment.size
        assert messages(stream) == bodies
        await stream.append([b"after"])
        assert messages(stream) == [*bodies, b"after"]
        assert stream.writer.ahead_bytes == PREALLOCATE_BYTES
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_torn_chunk_before_the_zeros_is_still_damage(tmp_path: Path) -> None:
    """A chunk cut short, zeros after it: the warning names the chunk's start."""
    old, bodies = await crashed_copy(tmp_path / "live", tmp_path / "crashed")
    (segment,) = old.segments
    path = tmp_path / "crashed" / segment.segment_path.parent.name / segment.segment_path.name
    last = segment.positions[-1]
    with path.open("r+b") as file:  # the last chunk's data half gone: zeros, as if unwritten
        file.seek(last + 60)
        file.write(bytes(segment.size - last - 60))
    store, stream, events = reopen_logged(tmp_path / "crashed")
    try:
        assert truncation(events) == (str(path), last)
        assert messages(stream) == bodies[:-1]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_zeros_that_cannot_be_written_leave_the_commit_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full file system refusing the zeros: the commit is kept, the file ends at its data."""
    store = inline_store(tmp_path)
    try:
        stream = store.create("s")
        write = files_module.pwrite_all

        def refuse_zeros(fd: int, data: bytes, position: int) -> None:
            if len(data) == PREALLOCATE_BYTES and not any(data):
                write(fd, data[: len(data) // 2], position)  # half, then full
                raise OSError(errno.ENOSPC, "No space left on device")
            write(fd, data, position)

        monkeypatch.setattr(files_module, "pwrite_all", refuse_zeros)
        await stream.append([b"first"])
        (segment,) = stream.segments
        assert file_size(segment) == segment.size
        assert stream.writer.ahead_bytes == 0
        monkeypatch.undo()
        await stream.append([b"second"])  # room again: the next commit writes them
        assert file_size(segment) == segment.size + PREALLOCATE_BYTES
        assert messages(stream) == [b"first", b"second"]
    finally:
        await store.close()
