"""Tests for the embedded log on a full file system (issue 18).

A commit that fails with ENOSPC is taken back in the writer thread (the
torn bytes cut off, segments it created removed), its appends fail with
`LogFullError`, the stream refuses appends for a while and then tries
again, and writing resumes without a restart once there is room; the
files stay valid throughout. The full disk is a ``write_segment`` seam (or
the index and header writes patched) that writes part of what it is given,
then raises ``OSError(ENOSPC)``, as a real one does. Real files in a
temporary directory, the real reactor for the writer thread's results, and
a `Clock` for the waits. tests/integration/test_disk_full.py does it on a
real full tmpfs.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs

from gateway.codecs import osiris
from gateway.core import log as log_package
from gateway.core.addressing import AddressPattern
from gateway.core.durable import DurableDelivery
from gateway.core.log import (
    FsyncPolicy,
    LogFullError,
    LogStore,
    LogWriteError,
    Retention,
)
from gateway.core.log import files as files_module
from gateway.core.log.recovery import read_index
from gateway.core.log.stream import FULL_RETRY_INITIAL_SECONDS, FULL_RETRY_MAX_SECONDS
from gateway.core.message import Message, Outcome, Status
from gateway.core.outcomes import OUTCOME_STREAM, OutcomeRecorder
from gateway.core.router import Route
from tests.core.test_log import messages, next_turn

ENOSPC_TEXT = "the file system is full (ENOSPC)"


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


class FullDisk:
    """A ``write_segment`` seam over a disk the test fills and empties.

    While ``full``, a write puts the first half of its bytes in the file (a
    torn chunk) and then fails with ENOSPC. With ``gate`` set, a failing
    write first tells ``started`` and waits for the gate to open.
    """

    def __init__(self) -> None:
        self.full = False
        self.failures = 0
        self.gate: threading.Event | None = None
        self.started: Deferred[None] = Deferred()

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Write all, or half and fail."""
        if not self.full:
            files_module.pwrite_all(fd, data, position)
            return
        self.failures += 1
        if self.gate is not None:
            _reactor().callFromThread(self.started.callback, None)
            self.gate.wait(timeout=30)
        files_module.pwrite_all(fd, bytes(data[: len(data) // 2]), position)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def disk() -> FullDisk:
    """An empty disk."""
    return FullDisk()


@pytest.fixture
def clock() -> Clock:
    """The store's clock: the waits after a failed write pass when the test says."""
    return Clock()


def open_store(directory: Path, disk: FullDisk, clock: Clock, **options: Any) -> LogStore:
    """An opened store writing through ``disk``, timed by ``clock``."""
    store = LogStore(directory, _reactor(), clock=clock, write_segment=disk, **options)
    store.open()
    return store


@pytest.fixture
def store(tmp_path: Path, disk: FullDisk, clock: Clock) -> Iterator[LogStore]:
    """An opened store over ``disk``, closed after the test."""
    opened = open_store(tmp_path, disk, clock)
    yield opened
    pytest_twisted.blockon(opened.close())


async def refused(appended: Deferred[Any]) -> LogFullError:
    """The `LogFullError` an append fails with."""
    with pytest.raises(LogFullError) as caught:
        await appended
    return caught.value


def assert_intact(directory: Path) -> list[int]:
    """Every segment of a stream is whole: each chunk passes its CRC, and ids follow.

    Each index is exact (one record per chunk, at its position), each chunk
    starts where the one before ends, and each segment ends where its last
    chunk does: no torn bytes after it.

    Returns:
        The chunk ids, in order.
    """
    chunk_ids: list[int] = []
    expected: int | None = None
    for path in sorted(directory.glob("*.segment")):
        data = path.read_bytes()
        assert data[: osiris.FILE_HEADER_BYTES] == osiris.SEGMENT_HEADER
        records, exact = read_index(path.with_suffix(".index"))
        assert exact, f"{path.with_suffix('.index')} is not exact"
        position = osiris.FILE_HEADER_BYTES
        for record in records:
            assert record.position == position
            header = osiris.validate_chunk(data, position)
            assert header.first_offset == record.chunk_id
            assert expected is None or header.first_offset == expected
            chunk_ids.append(header.first_offset)
            expected = header.next_offset
            position += header.size
        assert position == len(data), f"{path}: {len(data) - position} bytes after the last chunk"
    return chunk_ids


async def reopened(directory: Path, name: str) -> list[bytes]:
    """Reopen a store over ``directory``: recovery repairs nothing; the stream's messages."""
    with capturedLogs() as events:
        store = LogStore(directory, _reactor())
        store.open()
    try:
        assert not [e for e in events if e["log_level"] >= LogLevel.warn]
        repairs = [e for e in events if "Rebuilt" in e["log_format"]]
        assert not repairs
        stream = store.get(name)
        assert stream is not None
        return messages(stream)
    finally:
        await store.close()


# Taking a failed commit back.


@pytest_twisted.ensureDeferred
async def test_a_full_disk_fails_the_commit_and_takes_it_back(
    store: LogStore, disk: FullDisk, tmp_path: Path
) -> None:
    """The torn chunk is cut off: files end at the last committed chunk, which stays readable."""
    stream = store.create("s")
    await stream.append([b"a", b"b"])
    segment = stream.segments[-1]
    size, index_size = segment.size, segment.index_position()
    disk.full = True
    error = await refused(stream.append([b"c" * 5000]))
    assert isinstance(error, LogWriteError)
    assert disk.failures == 1
    assert os.path.getsize(segment.segment_path) == size
    assert os.path.getsize(segment.index_path) == index_size
    assert messages(stream) == [b"a", b"b"]
    assert (stream.next_offset, stream.committed_chunk_id) == (2, 0)
    assert assert_intact(tmp_path / "s") == [0]


@pytest_twisted.ensureDeferred
async def test_the_refusal_says_what_where_and_that_it_passes(
    store: LogStore, disk: FullDisk
) -> None:
    """The error names the stream, the file, the free space; one warning, no traceback."""
    stream = store.create("orders")
    await stream.append([b"a"])
    disk.full = True
    with capturedLogs() as events:
        error = await refused(stream.append([b"b"]))
    path = str(stream.segments[-1].segment_path)
    text = str(error)
    assert text.startswith(f"writing stream 'orders' failed: {ENOSPC_TEXT} at {path}: free space ")
    assert text.endswith(
        f"appends are refused for {FULL_RETRY_INITIAL_SECONDS:g} s, then tried again:"
        " writing resumes by itself once there is room"
    )
    assert (error.stream, error.path, error.retry_seconds) == (
        "orders",
        path,
        FULL_RETRY_INITIAL_SECONDS,
    )
    assert error.free_bytes is not None
    [warning] = [e for e in events if e["log_level"] == LogLevel.warn]
    assert warning["stream"] == "orders" and warning["path"] == path
    assert "log_failure" not in warning
    assert not [e for e in events if e["log_level"] > LogLevel.warn]


# Refusing for a while, then trying again.


@pytest_twisted.ensureDeferred
async def test_appends_are_refused_for_a_while_then_tried_again(
    store: LogStore, disk: FullDisk, clock: Clock
) -> None:
    """During the wait appends fail at once, unwritten; each failed try doubles it, up to a cap."""
    stream = store.create("s")
    disk.full = True
    waits: list[float] = []
    for _ in range(6):
        error = await refused(stream.append([b"x"]))
        waits.append(error.retry_seconds)
        assert await refused(stream.append([b"during the wait"])) is error
        clock.advance(error.retry_seconds - 0.01)
        assert await refused(stream.append([b"still waiting"])) is error
        clock.advance(0.01)
    assert waits == [0.5, 1.0, 2.0, 4.0, FULL_RETRY_MAX_SECONDS, FULL_RETRY_MAX_SECONDS]
    assert disk.failures == 6  # one write per try, none during the waits


@pytest_twisted.ensureDeferred
async def test_writing_resumes_once_there_is_room(
    store: LogStore, disk: FullDisk, clock: Clock, tmp_path: Path
) -> None:
    """After the wait the next append is written; offsets go on where the committed ones end."""
    stream = store.create("s")
    await stream.append([b"a"])
    disk.full = True
    error = await refused(stream.append([b"lost", b"lost too"]))
    disk.full = False
    with capturedLogs() as events:
        clock.advance(error.retry_seconds)
        result = await stream.append([b"b", b"c"])
    assert (result.first_offset, result.stored) == (1, 2)
    assert messages(stream) == [b"a", b"b", b"c"]
    formats = [e["log_format"] for e in events]
    assert any(f.startswith("Stream {stream} accepts appends again") for f in formats)
    assert any(f.startswith("Writing stream {stream} resumed") for f in formats)
    await store.close()
    assert assert_intact(tmp_path / "s") == [0, 1]
    assert await reopened(tmp_path, "s") == [b"a", b"b", b"c"]


@pytest_twisted.ensureDeferred
async def test_failed_publishing_ids_are_not_kept(
    store: LogStore, disk: FullDisk, clock: Clock
) -> None:
    """Ids of failed appends, and of those queued behind them, count as not stored.

    The append queued while the failing commit is being written was
    deduplicated against it (only id 5 kept); it fails too, so neither is
    acknowledged as a duplicate of a message that was never written.
    """
    stream = store.create("s")
    await stream.append([b"1", b"2"], reference="p", publishing_ids=[1, 2])
    disk.full = True
    disk.gate = threading.Event()
    failing = stream.append([b"3", b"4"], reference="p", publishing_ids=[3, 4])
    await disk.started  # the commit is in the writer thread
    behind = stream.append([b"3", b"4", b"5"], reference="p", publishing_ids=[3, 4, 5])
    disk.gate.set()
    error = await refused(failing)
    assert await refused(behind) is error
    assert stream.writer_sequence("p") == 2
    disk.full, disk.gate = False, None
    clock.advance(error.retry_seconds)
    result = await stream.append([b"3", b"4", b"5"], reference="p", publishing_ids=[3, 4, 5])
    assert (result.stored, result.duplicates) == (3, 0)
    assert stream.writer_sequence("p") == 5
    assert messages(stream) == [b"1", b"2", b"3", b"4", b"5"]


@pytest_twisted.ensureDeferred
async def test_readers_keep_waiting(store: LogStore, disk: FullDisk, clock: Clock) -> None:
    """A tailing reader's wait survives the full disk and fires once writing resumes."""
    stream = store.create("s")
    await stream.append([b"a"])
    waiting = stream.wait_for(1)
    disk.full = True
    error = await refused(stream.append([b"b"]))
    assert not waiting.called
    assert not stream.wait_for(1).called
    disk.full = False
    clock.advance(error.retry_seconds)
    await stream.append([b"b"])
    await waiting  # woken by that commit


@pytest_twisted.ensureDeferred
async def test_offsets_are_kept_and_written_once_there_is_room(
    store: LogStore, disk: FullDisk, clock: Clock, tmp_path: Path
) -> None:
    """A failed commit's offsets, and those stored while waiting, are written after the wait."""
    stream = store.create("s")
    await stream.append([b"a"])
    disk.full = True
    stream.store_offset("kept", 0)
    failing = stream.append([b"b"])
    error = await refused(failing)
    stream.store_offset("late", 0)
    assert (stream.query_offset("kept"), stream.query_offset("late")) == (0, 0)
    disk.full = False
    clock.advance(error.retry_seconds)  # the wait is over: the offsets are committed
    await store.close()
    assert disk.failures == 1
    reopened_store = LogStore(tmp_path, _reactor())
    reopened_store.open()
    try:
        again = reopened_store.get("s")
        assert again is not None
        assert (again.query_offset("kept"), again.query_offset("late")) == (0, 0)
    finally:
        await reopened_store.close()
    assert_intact(tmp_path / "s")


@pytest_twisted.ensureDeferred
async def test_a_failed_index_write_is_taken_back_too(
    store: LogStore, disk: FullDisk, clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk written before its index record failed is cut off with it: never half stored."""
    stream = store.create("s")
    await stream.append([b"a"])
    real = files_module.pwrite_all
    full_index = {"on": True}

    def index_fails(fd: int, data: bytes, position: int) -> None:
        if full_index["on"] and os.readlink(f"/proc/self/fd/{fd}").endswith(".index"):
            real(fd, bytes(data[:7]), position)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, position)

    monkeypatch.setattr(files_module, "pwrite_all", index_fails)
    error = await refused(stream.append([b"b"]))
    assert error.path == str(stream.segments[-1].index_path)
    assert assert_intact(tmp_path / "s") == [0]
    full_index["on"] = False
    clock.advance(error.retry_seconds)
    await stream.append([b"c"])
    await store.close()
    assert assert_intact(tmp_path / "s") == [0, 1]
    assert await reopened(tmp_path, "s") == [b"a", b"c"]


@pytest_twisted.ensureDeferred
async def test_a_failed_roll_removes_the_new_segment(
    tmp_path: Path, disk: FullDisk, clock: Clock
) -> None:
    """A commit that rolls and fails in the new segment leaves no trace of it; it rolls again."""
    store = open_store(tmp_path, disk, clock, default_retention=Retention(max_segment_bytes=4096))
    try:
        stream = store.create("s")
        await stream.append([b"a" * 5000])  # the first segment is full now
        disk.full = True
        error = await refused(stream.append([b"b" * 100]))
        directory = tmp_path / "s"
        assert sorted(p.name for p in directory.glob("0*")) == [
            "00000000000000000000.index",
            "00000000000000000000.segment",
        ]
        assert error.path == str(directory / "00000000000000000001.segment")
        assert len(stream.segments) == 1
        disk.full = False
        clock.advance(error.retry_seconds)
        result = await stream.append([b"b" * 100])
        assert result.first_offset == 2  # after the new segment's tracking snapshot
        assert [s.first_id for s in stream.segments] == [0, 1]
    finally:
        await store.close()
    assert assert_intact(directory) == [0, 1, 2]
    assert await reopened(tmp_path, "s") == [b"a" * 5000, b"b" * 100]


@pytest_twisted.ensureDeferred
async def test_a_failed_fsync_still_stops_the_stream(
    tmp_path: Path, disk: FullDisk, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from fsync is not taken as a passing full disk: the files cannot be trusted."""
    store = open_store(tmp_path, disk, clock, fsync=FsyncPolicy.ALWAYS)
    try:
        stream = store.create("s")
        await stream.append([b"a"])

        def no_sync(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(files_module, "_datasync", no_sync)
        with capturedLogs():
            with pytest.raises(LogWriteError) as caught:
                await stream.append([b"b"])
            assert not isinstance(caught.value, LogFullError)
            monkeypatch.undo()
            clock.advance(FULL_RETRY_MAX_SECONDS)
            with pytest.raises(LogWriteError):
                await stream.append([b"c"])
        assert messages(stream) == [b"a"]
    finally:
        await store.close()
    assert assert_intact(tmp_path / "s") == [0]


@pytest_twisted.ensureDeferred
async def test_a_stream_created_on_a_full_disk_can_be_created_again(
    store: LogStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its appends fail, it is forgotten and its directory removed; later it is created anew."""
    real = files_module.pwrite_all

    def no_room(fd: int, data: bytes, position: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_module, "pwrite_all", no_room)
    with capturedLogs() as events:
        stream = store.create("new")
        with pytest.raises(LogWriteError, match="can be created again once there is room"):
            await stream.append([b"a"])
    assert not [e for e in events if "log_failure" in e]
    assert store.get("new") is None
    await next_turn()
    monkeypatch.setattr(files_module, "pwrite_all", real)
    again = store.create("new")
    await again.append([b"b"])
    assert messages(again) == [b"b"]


@pytest_twisted.ensureDeferred
async def test_closing_while_waiting(store: LogStore, disk: FullDisk, clock: Clock) -> None:
    """A store closed during the wait closes; its last commit tries the held offsets once more."""
    stream = store.create("s")
    await stream.append([b"a"])
    disk.full = True
    await refused(stream.append([b"b"]))
    stream.store_offset("c", 0)
    disk.full = False
    await store.close()
    assert [call for call in clock.getDelayedCalls() if call.active()] == []
    assert stream.query_offset("c") == 0


# What the log's users see.


@pytest_twisted.ensureDeferred
async def test_outcome_records_are_dropped_and_counted(
    store: LogStore, disk: FullDisk, clock: Clock
) -> None:
    """The outcome recorder drops and counts what the full log refuses, then records again."""
    recorder = OutcomeRecorder(store.create(OUTCOME_STREAM), clock)
    message = Message(body=b"x", address="a")
    disk.full = True
    recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
    with capturedLogs() as events:
        await recorder.flush()
    assert (recorder.recorded, recorder.dropped) == (0, 1)
    assert any("outcome records dropped" in e["log_format"] for e in events)
    recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
    await recorder.flush()  # during the wait: refused at once
    assert (recorder.recorded, recorder.dropped) == (0, 2)
    disk.full = False
    clock.advance(FULL_RETRY_INITIAL_SECONDS)
    recorder.record("route", "r", "s", message, 0.0, Outcome.accepted())
    await recorder.flush()
    assert (recorder.recorded, recorder.dropped) == (1, 2)


@pytest_twisted.ensureDeferred
async def test_a_durable_route_answers_retry_later(store: LogStore, disk: FullDisk) -> None:
    """A durable route answers a full log with retry and a reason without paths; no traceback."""
    route = Route(
        name="mail", source="qmqp", pattern=AddressPattern("#"), destination="far", durable=True
    )
    stream = store.create("msggateway.route.mail")
    delivery = DurableDelivery(route, stream, lambda messages: [m.body for m in messages])
    disk.full = True
    with capturedLogs() as events:
        outcomes = await delivery.deliver([Message(body=b"x", address="a")] * 2)
    assert [outcome.status for outcome in outcomes] == [Status.RETRY] * 2
    assert outcomes[0].reason == (
        "route mail: the log could not store the message: its file system is full;"
        " writing resumes by itself once there is room"
    )
    assert not [e for e in events if "log_failure" in e]


@pytest_twisted.ensureDeferred
async def test_a_route_into_a_local_stream_answers_retry_later(
    store: LogStore, disk: FullDisk
) -> None:
    """The stream listener's destination: retry, a reason without paths, no traceback."""
    from gateway.protocols.stream.bridge import StreamDestination

    store.create("inbox")
    destination = StreamDestination("streams", store)
    disk.full = True
    with capturedLogs() as events:
        outcomes = await destination.deliver([Message(body=b"x", address="inbox")] * 2)
    assert [outcome.status for outcome in outcomes] == [Status.RETRY] * 2
    assert outcomes[0].reason == (
        "stream listener streams: the log's file system is full;"
        " writing resumes by itself once there is room"
    )
    assert not [e for e in events if "log_failure" in e]


def test_the_error_is_exported() -> None:
    """`LogFullError` is a `LogWriteError`, exported by the log package."""
    assert log_package.LogFullError is LogFullError
    assert issubclass(LogFullError, LogWriteError)
    assert "LogFullError" in log_package.__all__
