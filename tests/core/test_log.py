"""Tests for `gateway.core.log`, the embedded durable log.

Real files in a temporary directory and the real reactor (the writer thread
reports back through it); a `Clock` where commit times matter. Writes are
counted, or held, through the store's ``write_segment`` seam. A crash is a
child process killed with SIGKILL after a number of acknowledgements read
from its output.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.task import Clock, deferLater
from twisted.logger import LogLevel, capturedLogs

from gateway.codecs import osiris
from gateway.core.log import (
    AppendResult,
    FsyncPolicy,
    LogClosedError,
    LogStore,
    LogWriteError,
    Retention,
    StoredChunk,
    StreamExistsError,
    StreamLog,
    StreamMissingError,
)
from gateway.core.log.files import pwrite_all

REPO = Path(__file__).resolve().parents[2]


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


async def next_turn() -> None:
    """Let the reactor run one turn (commits start on the turn after an append)."""
    await deferLater(_reactor(), 0, lambda: None)


def open_store(directory: Path, **options: Any) -> LogStore:
    """An opened store over ``directory`` on the real reactor."""
    store = LogStore(directory, _reactor(), **options)
    store.open()
    return store


def records(chunk: StoredChunk) -> list[bytes]:
    """The messages a chunk's Deliver payload carries."""
    return [bytes(m) for m in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])]


def read_all(stream: StreamLog, start: int | None = None) -> list[StoredChunk]:
    """Every committed user chunk from ``start`` (the first chunk by default)."""
    position = stream.seek(("first",)) if start is None else start
    chunks: list[StoredChunk] = []
    while batch := stream.read_chunks(position, 3, 4096):
        chunks.extend(batch)
        position = batch[-1].next_chunk_id
    return chunks


def messages(stream: StreamLog) -> list[bytes]:
    """Every message of a stream, in order."""
    return [message for chunk in read_all(stream) for message in records(chunk)]


class CountingWrites:
    """A ``write_segment`` seam that records each write's size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Count, then write."""
        self.sizes.append(len(data))
        pwrite_all(fd, data, position)


class HeldWrites:
    """A ``write_segment`` seam that holds the first write until released."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.started: Deferred[None] = Deferred()
        self.release = threading.Event()
        self._held = False

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Report the first write to the reactor and wait for the test; then write."""
        self.sizes.append(len(data))
        if not self._held:
            self._held = True
            _reactor().callFromThread(self.started.callback, None)
            self.release.wait(timeout=30)
        pwrite_all(fd, data, position)


# Group commit.


@pytest_twisted.ensureDeferred
async def test_one_turn_one_chunk_one_write(tmp_path: Path) -> None:
    """Appends from one reactor turn share one chunk, one write and one fsync."""
    writes = CountingWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("orders")
        results = await gatherResults(
            [stream.append([b"a", b"b"]), stream.append([b"c"]), stream.append([b"d", b"e"])]
        )
        assert results == [
            AppendResult(first_offset=0, chunk_id=0, stored=2, duplicates=0, spans=((0, 2),)),
            AppendResult(first_offset=2, chunk_id=0, stored=1, duplicates=0, spans=((2, 1),)),
            AppendResult(first_offset=3, chunk_id=0, stored=2, duplicates=0, spans=((3, 2),)),
        ]
        assert len(writes.sizes) == 1
        (chunk,) = read_all(stream)
        assert records(chunk) == [b"a", b"b", b"c", b"d", b"e"]
        assert (store.stats.commits, store.stats.fsyncs, store.stats.synced_appends) == (1, 1, 3)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_appends_during_a_commit_share_the_next(tmp_path: Path) -> None:
    """Appends made while a commit is being written wait for it, then share one chunk."""
    writes = HeldWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("orders")
        first = stream.append([b"a"])
        await writes.started
        second = stream.append([b"b"])
        await next_turn()
        third = stream.append([b"c"], reference="p", publishing_ids=[1])
        await next_turn()
        assert not (first.called or second.called or third.called)
        writes.release.set()
        results = await gatherResults([first, second, third])
        assert [r.chunk_id for r in results] == [0, 1, 1]
        assert [r.first_offset for r in results] == [0, 1, 2]
        assert len(writes.sizes) == 2
        assert [records(c) for c in read_all(stream)] == [[b"a"], [b"b", b"c"]]
    finally:
        writes.release.set()
        await store.close()


class WatchedWrites(HeldWrites):
    """`HeldWrites` that also tells when the second write begins."""

    def __init__(self) -> None:
        super().__init__()
        self.second = threading.Event()

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Note a write after the first, then go on as `HeldWrites`."""
        if self.sizes:
            self.second.set()
        super().__call__(fd, data, position)


@pytest_twisted.ensureDeferred
async def test_next_commit_is_written_while_the_last_is_acknowledged(tmp_path: Path) -> None:
    """What queued behind a commit goes to the writer thread before that commit is acknowledged.

    So the answers to its senders, and what the readers it wakes do, are
    made while the next commit is on its way to the disk.
    """
    writes = WatchedWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("orders")
        first = stream.append([b"a"])
        await writes.started
        second = stream.append([b"b"])
        await next_turn()
        seen: list[bool] = []

        def acknowledged(result: AppendResult) -> AppendResult:
            # The reactor thread waits here: the writer thread can only be
            # writing the second commit if it was handed over already.
            seen.append(writes.second.wait(timeout=5))
            return result

        first.addCallback(acknowledged)
        writes.release.set()
        results = await gatherResults([first, second])
        assert seen == [True]
        assert [r.chunk_id for r in results] == [0, 1]
        assert [records(c) for c in read_all(stream)] == [[b"a"], [b"b"]]
    finally:
        writes.release.set()
        await store.close()


@pytest_twisted.ensureDeferred
async def test_acknowledged_in_order_behind_a_commit(tmp_path: Path) -> None:
    """A duplicate queued behind a commit (nothing to write) is acknowledged after that commit."""
    writes = HeldWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("orders")
        order: list[str] = []
        first = stream.append([b"a"], reference="p", publishing_ids=[1])
        first.addCallback(lambda _: order.append("first"))
        await writes.started
        duplicate = stream.append([b"a"], reference="p", publishing_ids=[1])
        duplicate.addCallback(lambda _: order.append("duplicate"))
        await next_turn()
        writes.release.set()
        await gatherResults([first, duplicate])
        assert order == ["first", "duplicate"]
        assert len(writes.sizes) == 1
    finally:
        writes.release.set()
        await store.close()


class GatedWrites:
    """A ``write_segment`` seam whose writes each wait for the test's permit."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)

    def allow(self, count: int = 1) -> None:
        """Let ``count`` more writes through."""
        self._permits.release(count)

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Wait for a permit, then write."""
        if not self._permits.acquire(timeout=30):
            raise RuntimeError("the test gave no permit for a write")
        pwrite_all(fd, data, position)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_pipelined_commits_acknowledge_in_order_what_is_written(
    tmp_path: Path, seed: int
) -> None:
    """Appends made at random moments, across commits on their way, some duplicates.

    Every write waits for the test. Between appends, as the seed says,
    the reactor may turn (a commit starts), or one write is let through
    and the test waits until that commit is acknowledged (the appends
    after it go to later commits, some while the next is on its way).
    Every append is acknowledged in the order it was made, with
    offsets that follow on from the one before; when it is, its messages
    are in the segment file on disk; and the stream ends up holding each
    stored message once, in order.
    """
    rng = random.Random(seed)
    writes = GatedWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("s")
        acknowledged: list[int] = []
        on_disk: list[bool] = []
        expected: list[bytes] = []
        appends = []
        publishing_id = 0
        progress: list[Deferred[None]] = []

        def check(result: AppendResult, number: int, body: bytes) -> AppendResult:
            acknowledged.append(number)
            if result.stored:
                (segment,) = stream.segments
                on_disk.append(body in segment.segment_path.read_bytes())
            waiting, progress[:] = progress[:], []
            for waiter in waiting:  # on the next turn: not from inside the acknowledgement
                _reactor().callLater(0, waiter.callback, None)
            return result

        for number in range(60):
            body = b"m%03d" % number
            if rng.random() < 0.2 and publishing_id:  # a duplicate of the last id
                appended = stream.append([body], reference="p", publishing_ids=[publishing_id])
            else:
                publishing_id += 1
                appended = stream.append([body], reference="p", publishing_ids=[publishing_id])
                expected.append(body)
            appended.addCallback(check, number, body)
            appends.append(appended)
            choice = rng.random()
            if choice < 0.3 and len(acknowledged) < len(appends):
                writes.allow()
                acknowledged_one: Deferred[None] = Deferred()
                progress.append(acknowledged_one)
                await acknowledged_one
            elif choice < 0.6:
                await next_turn()
        writes.allow(1_000)
        results = await gatherResults(appends)
        assert acknowledged == list(range(60))
        assert on_disk and all(on_disk)
        stored = [r for r in results if r.stored]
        offsets = [r.first_offset for r in stored]
        assert offsets == sorted(offsets)
        assert len(set(offsets)) == len(offsets)
        assert messages(stream) == expected
        assert store.stats.commits > 1
    finally:
        writes.allow(1_000)
        await store.close()


@pytest_twisted.ensureDeferred
async def test_chunks_split_at_65535_entries(tmp_path: Path) -> None:
    """One append of 70,000 messages spans two chunks, at consecutive offsets."""
    store = open_store(tmp_path)
    try:
        stream = store.create("big")
        result = await stream.append([b"x"] * 70000)
        assert result == AppendResult(
            first_offset=0,
            chunk_id=0,
            stored=70000,
            duplicates=0,
            spans=((0, 65535), (65535, 4465)),
        )
        chunks = stream.read_chunks(0, 10, 10**7)
        assert [(c.chunk_id, c.header.num_entries) for c in chunks] == [(0, 65535), (65535, 4465)]
        assert stream.next_offset == 70000
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_chunks_split_by_size(tmp_path: Path) -> None:
    """A chunk closes once its data reaches 8 MiB; a bigger message gets a chunk of its own."""
    store = open_store(tmp_path)
    try:
        stream = store.create("big")
        body = b"m" * (5 * 1024 * 1024)
        result = await stream.append([body, body, b"small"])
        assert result.stored == 3
        chunks = stream.read_chunks(0, 10, 1)
        assert [c.chunk_id for c in chunks] == [0]
        chunks = stream.read_chunks(0, 10, 10**8)
        assert [len(records(c)) for c in chunks] == [1, 2]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_an_append_across_a_roll_says_where_each_part_went(tmp_path: Path) -> None:
    """An append that fills a chunk goes on past a new segment's snapshot: its spans say so."""
    store = open_store(tmp_path, default_retention=Retention(max_segment_bytes=300))
    try:
        stream = store.create("big")
        body = b"m" * (5 * 1024 * 1024)
        result = await stream.append([body, body, b"small"])
        # Offset 1 is the second segment's tracking snapshot.
        assert (result.first_offset, result.chunk_id, result.stored) == (0, 0, 3)
        assert result.spans == ((0, 1), (2, 2))
        chunks = stream.read_chunks(0, 10, 10**8)
        assert [(c.chunk_id, c.header.num_entries) for c in chunks] == [(0, 1), (2, 2)]
        assert [stream.user_chunk_at(n) for n in range(5)] == [(0, 1), (2, 4), (2, 4), (2, 4), None]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_user_chunk_at_is_where_a_read_starts(tmp_path: Path) -> None:
    """From any id, user_chunk_at names the chunk read_chunks returns first, from the index."""
    store = open_store(tmp_path, default_retention=tiny_segments(max_bytes=700))
    try:
        stream = store.create("s")
        for number in range(6):
            await fill(stream, 2)
            stream.store_offset("reader", number)  # tracking chunks between user chunks
            await next_turn()
        await stream.append([b"a", b"b"])
        await store.apply_retention()
        assert stream.first_offset > 0
        for chunk_id in range(-1, stream.next_offset + 2):
            chunks = stream.read_chunks(chunk_id, 1, 1)
            expected = (chunks[0].chunk_id, chunks[0].next_chunk_id) if chunks else None
            assert stream.user_chunk_at(chunk_id) == expected, chunk_id
    finally:
        await store.close()


# Offsets, reads and seeks.


@pytest_twisted.ensureDeferred
async def test_offsets_and_positions(tmp_path: Path) -> None:
    """Offsets count records; a stored offset's tracking chunk takes one offset."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        assert (stream.first_offset, stream.next_offset) == (0, 0)
        assert (stream.committed_chunk_id, stream.last_chunk_id) == (-1, -1)
        await stream.append([b"a", b"b", b"c"])
        stream.store_offset("consumer", 2)
        assert stream.query_offset("consumer") == 2
        await next_turn()
        result = await stream.append([b"d"])
        assert result.first_offset == 4
        assert (stream.first_chunk_id, stream.last_chunk_id) == (0, 4)
        assert (stream.committed_chunk_id, stream.next_offset) == (4, 5)
        assert [c.chunk_id for c in read_all(stream)] == [0, 4]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_payload_is_the_stored_header_and_data(tmp_path: Path) -> None:
    """A chunk's payload is its header as stored (trailer length too) and the data only."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        body = memoryview(b"--hello--")[2:7]
        await stream.append([body, b"raw"], reference="producer", publishing_ids=[1, 2])
        (chunk,) = read_all(stream)
        segment = stream.segments[0]
        data = segment.segment_path.read_bytes()
        position = segment.positions[0]
        header = osiris.ChunkHeader.unpack(data, position)
        assert header.trailer_length > 0
        assert chunk.header == header
        assert chunk.payload == data[position : position + 48 + header.data_length]
        assert records(chunk) == [b"hello", b"raw"]
        assert osiris.validate_chunk(data, position) == header
        assert (chunk.chunk_id, chunk.next_chunk_id) == (0, 2)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_views_are_copied_at_append(tmp_path: Path) -> None:
    """A view into a buffer that changes after the append stores what it showed then."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        buffer = bytearray(b"first")
        appended = stream.append([memoryview(buffer), buffer])
        buffer[:] = b"later"
        await appended
        assert messages(stream) == [b"first", b"first"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_read_bounds(tmp_path: Path) -> None:
    """Reads stop at max_chunks and max_bytes, but always return a first chunk."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        for number in range(5):
            await stream.append([bytes([number]) * 100])
        assert [c.chunk_id for c in stream.read_chunks(0, 2, 10**6)] == [0, 1]
        assert [c.chunk_id for c in stream.read_chunks(0, 10, 10)] == [0]
        assert [c.chunk_id for c in stream.read_chunks(0, 10, 2 * 160)] == [0, 1]
        assert [c.chunk_id for c in stream.read_chunks(3, 10, 10**6)] == [3, 4]
        assert stream.read_chunks(5, 10, 10**6) == []
        assert stream.read_chunks(0, 0, 10**6) == []
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_seek(tmp_path: Path) -> None:
    """Every offset specification finds the chunk the notes (section 7) say."""
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    try:
        stream = store.create("s")
        for spec in [("first",), ("last",), ("next",), ("offset", 5), ("timestamp", 0)]:
            assert stream.seek(spec) == 0
        clock.advance(1)
        stream.store_offset("c", 0)
        await next_turn()
        await stream.append([b"a", b"b", b"c"])
        clock.advance(1)
        await stream.append([b"d"])
        clock.advance(1)
        stream.store_offset("c", 4)
        await next_turn()
        await stream.append([b"e"])
        # chunks: 0 tracking @1s, 1-3 user @1s, 4 user @2s, 5 tracking @3s, 6 user @3s
        assert stream.seek(("first",)) == 0
        assert stream.seek(("last",)) == 6
        assert stream.seek(("next",)) == 7
        assert [stream.seek(("offset", n)) for n in (-1, 0, 1, 2, 3, 4, 5, 6, 7, 99)] == [
            0,
            0,
            1,
            1,
            1,
            4,
            5,
            6,
            7,
            7,
        ]
        assert [stream.seek(("timestamp", ms)) for ms in (0, 1000, 1500, 2000, 2001, 4000)] == [
            0,
            0,
            4,
            4,
            5,
            7,
        ]
        assert [c.chunk_id for c in stream.read_chunks(stream.seek(("first",)), 9, 10**6)] == [
            1,
            4,
            6,
        ]
        with pytest.raises(ValueError):
            stream.seek(("middle",))
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_last_without_user_chunks_is_next(tmp_path: Path) -> None:
    """With only tracking chunks, "last" is "next", as with an empty stream."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        stream.store_offset("c", 1)
        await next_turn()
        waiter = stream.wait_for(0)
        await stream.append([])
        assert stream.next_offset == 1
        assert stream.seek(("last",)) == 1
        assert read_all(stream) == []
        assert not waiter.called
        waiter.cancel()
        with pytest.raises(CancelledError):
            await waiter
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_wait_for(tmp_path: Path) -> None:
    """A tailing reader's wait fires when a user chunk at or after its position commits."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        await stream.append([b"a"])
        assert stream.wait_for(0).called
        waiter = stream.wait_for(stream.next_offset)
        assert not waiter.called
        stream.store_offset("c", 0)
        await stream.append([b"b"])
        await waiter
        # The offset went into the user chunk's trailer: no tracking chunk, no gap.
        assert (stream.committed_chunk_id, stream.next_offset) == (1, 2)
        (chunk,) = stream.read_chunks(1, 1, 1000)
        assert chunk.header.trailer_length > 0
    finally:
        await store.close()


# Deduplication and tracking.


@pytest_twisted.ensureDeferred
async def test_duplicates_are_acknowledged_not_stored(tmp_path: Path) -> None:
    """The same reference and ids twice: stored once, acknowledged twice."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        first = await stream.append([b"a", b"b"], reference="p", publishing_ids=[1, 2])
        again = await stream.append([b"a", b"b"], reference="p", publishing_ids=[1, 2])
        assert first == AppendResult(
            first_offset=0, chunk_id=0, stored=2, duplicates=0, spans=((0, 2),)
        )
        assert again == AppendResult(first_offset=None, chunk_id=None, stored=0, duplicates=2)
        mixed = await stream.append(
            [b"b", b"c", b"c", b"d", b"x"], reference="p", publishing_ids=[2, 3, 3, 4, 1]
        )
        assert (mixed.stored, mixed.duplicates, mixed.first_offset) == (2, 3, 2)
        other = await stream.append([b"e"], reference="q", publishing_ids=[1])
        assert other.stored == 1
        assert messages(stream) == [b"a", b"b", b"c", b"d", b"e"]
        assert (stream.writer_sequence("p"), stream.writer_sequence("q")) == (4, 1)
        assert stream.writer_sequence("unknown") == 0
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_pipelined_duplicates(tmp_path: Path) -> None:
    """A duplicate of a pending append (same turn, or behind a commit) is not stored."""
    writes = HeldWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("s")
        first = stream.append([b"a"], reference="p", publishing_ids=[1])
        same_turn = stream.append([b"a"], reference="p", publishing_ids=[1])
        await writes.started
        assert stream.writer_sequence("p") == 0
        behind = stream.append([b"a", b"b"], reference="p", publishing_ids=[1, 2])
        writes.release.set()
        results = await gatherResults([first, same_turn, behind])
        assert [(r.stored, r.duplicates) for r in results] == [(1, 0), (0, 1), (1, 1)]
        assert messages(stream) == [b"a", b"b"]
    finally:
        writes.release.set()
        await store.close()


def sub_batch(
    records: Sequence[bytes], compression: int = osiris.COMPRESSION_NONE
) -> osiris.SubBatch:
    """A sub-batch entry as a client publishes it."""
    return osiris.SubBatch.parse(osiris.encode_sub_batch(records, compression=compression))


@pytest_twisted.ensureDeferred
async def test_sub_batches_take_an_offset_per_record(tmp_path: Path) -> None:
    """Sub-batch entries are stored whole; offsets, dedup and reopen count their records."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        plain = stream.append([b"a"])
        batched = stream.append(
            [sub_batch([b"b", b"c", b"d"]), b"e", sub_batch([b"f", b"g"], osiris.COMPRESSION_GZIP)],
            reference="p",
            publishing_ids=[1, 2, 3],
            sub_batches=True,
        )
        after = stream.append([b"h"])
        results = await gatherResults([plain, batched, after])
        assert [(r.first_offset, r.stored) for r in results] == [(0, 1), (1, 3), (7, 1)]
        (chunk,) = read_all(stream)
        header = osiris.ChunkHeader.unpack(chunk.payload)
        assert (header.num_entries, header.num_records) == (5, 8)
        assert messages(stream) == [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
        assert stream.next_offset == 8
        again = await stream.append(
            [sub_batch([b"b", b"c", b"d"]), b"i"],
            reference="p",
            publishing_ids=[3, 4],
            sub_batches=True,
        )
        assert (again.stored, again.duplicates, again.first_offset) == (1, 1, 8)
    finally:
        await store.close()
    store = open_store(tmp_path)
    try:
        stream = store.get("s")
        assert stream is not None
        assert stream.next_offset == 9
        assert stream.writer_sequence("p") == 4
        assert messages(stream)[-2:] == [b"h", b"i"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_an_append_with_sub_batches_is_never_split(tmp_path: Path) -> None:
    """One that does not fit the open chunk starts the next one, whole."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        filler = stream.append([b"x"] * (osiris.MAX_ENTRIES_PER_CHUNK - 1))
        whole = stream.append([sub_batch([b"a", b"b"]), b"c"], sub_batches=True)
        result = (await gatherResults([filler, whole]))[1]
        assert result.first_offset == result.chunk_id == osiris.MAX_ENTRIES_PER_CHUNK - 1
        chunks = read_all(stream)
        assert [records(chunk)[-3:] for chunk in chunks][1] == [b"a", b"b", b"c"]
        with pytest.raises(ValueError, match="at most 65535"):
            stream.append([b"x"] * (osiris.MAX_ENTRIES_PER_CHUNK + 1), sub_batches=True)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_tracking_survives_reopen(tmp_path: Path) -> None:
    """Sequences and stored offsets are rebuilt from trailers and tracking chunks."""
    store = open_store(tmp_path)
    stream = store.create("s")
    await stream.append([b"a", b"b"], reference="p", publishing_ids=[5, 6])
    stream.store_offset("reader", 1)
    stream.store_offset("other", 0)
    await next_turn()
    await stream.append([b"c"], reference="q", publishing_ids=[9])
    stream.store_offset("reader", 2)
    await store.close()

    store = open_store(tmp_path)
    try:
        stream = store.get("s")
        assert stream is not None
        assert (stream.writer_sequence("p"), stream.writer_sequence("q")) == (6, 9)
        assert (stream.query_offset("reader"), stream.query_offset("other")) == (2, 0)
        assert stream.query_offset("nobody") is None
        again = await stream.append([b"b", b"d"], reference="p", publishing_ids=[6, 7])
        assert (again.stored, again.duplicates) == (1, 1)
        assert messages(stream) == [b"a", b"b", b"c", b"d"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_append_arguments(tmp_path: Path) -> None:
    """Ids need a reference and one id per message; references fit in 255 bytes."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        with pytest.raises(ValueError):
            stream.append([b"a"], publishing_ids=[1])
        with pytest.raises(ValueError):
            stream.append([b"a"], reference="p")
        with pytest.raises(ValueError):
            stream.append([b"a"], reference="p", publishing_ids=[1, 2])
        with pytest.raises(ValueError):
            stream.append([b"a"], reference="p" * 256, publishing_ids=[1])
        with pytest.raises(ValueError):
            stream.store_offset("c", -1)
        result = await stream.append([b"a"], reference="", publishing_ids=None)
        assert result.stored == 1
    finally:
        await store.close()


# Segments and retention.


def tiny_segments(**options: Any) -> Retention:
    """Retention that rolls after about two 100-byte chunks."""
    return Retention(max_segment_bytes=300, **options)


async def fill(stream: StreamLog, count: int, clock: Clock | None = None) -> None:
    """Append ``count`` 100-byte messages, one commit each, with ids 1, 2, ..."""
    start = stream.writer_sequence("p") + 1
    for publishing_id in range(start, start + count):
        if clock is not None:
            clock.advance(1)
        body = b"%03d" % publishing_id + b"." * 97
        await stream.append([body], reference="p", publishing_ids=[publishing_id])


@pytest_twisted.ensureDeferred
async def test_segments_roll_with_a_snapshot_first(tmp_path: Path) -> None:
    """A full segment rolls; each new segment starts with a tracking snapshot chunk."""
    store = open_store(tmp_path, default_retention=tiny_segments())
    try:
        stream = store.create("s")
        stream.store_offset("reader", 7)
        await fill(stream, 7)
        segments = stream.segments
        assert len(segments) >= 3
        assert segments[0].types[0] == osiris.USER
        for number, segment in enumerate(segments[1:]):
            assert segment.types[0] == osiris.TRACKING_SNAPSHOT
            assert segment.segment_path.name == osiris.segment_file_name(segment.first_id)
            data = segment.segment_path.read_bytes()
            assert data[:8] == osiris.SEGMENT_HEADER
            header = osiris.validate_chunk(data, 8)
            assert header.first_offset == segment.first_id
            (body,) = osiris.iter_entries(data[56 : 56 + header.data_length])
            sequences, offsets = osiris.decode_tracking_snapshot(body)
            assert offsets == {"reader": 7}
            # Publishing ids 1, 2, ... took every offset but the earlier snapshots'.
            assert sequences["p"][1] == segment.first_id - number
        assert [m[:3] for m in messages(stream)] == [b"%03d" % n for n in range(1, 8)]
    finally:
        await store.close()

    store = open_store(tmp_path)
    try:
        stream = store.get("s")
        assert stream is not None
        assert len(stream.segments) == len(segments)
        assert stream.writer_sequence("p") == 7
        assert stream.query_offset("reader") == 7
        assert stream.retention == tiny_segments()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_retention_by_size(tmp_path: Path) -> None:
    """Old segments go while the stream is over max_bytes; the active one stays."""
    store = open_store(tmp_path, default_retention=tiny_segments(max_bytes=700))
    try:
        stream = store.create("s")
        await fill(stream, 9)
        before = stream.segments
        assert sum(s.size for s in before) > 700
        removed = await store.apply_retention()
        after = stream.segments
        assert removed == len(before) - len(after) > 0
        assert sum(s.size for s in after) <= 700
        assert stream.first_offset == after[0].first_id > 0
        for segment in before[:removed]:
            assert not segment.segment_path.exists()
            assert not segment.index_path.exists()
        assert [m[:3] for m in messages(stream)][-1] == b"009"
        assert stream.seek(("offset", 0)) == stream.first_offset
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_retention_by_age_on_the_timer(tmp_path: Path) -> None:
    """Segments whose newest chunk is older than max_age go when the timer runs."""
    clock = Clock()
    store = open_store(
        tmp_path,
        clock=clock,
        retention_interval_seconds=100,
        default_retention=tiny_segments(max_age_seconds=30),
    )
    try:
        stream = store.create("s")
        await fill(stream, 6, clock)
        segments = stream.segments
        assert len(segments) >= 3
        clock.advance(100 - clock.seconds())
        assert stream.segments == segments[-1:]
        assert stream.first_offset == segments[-1].first_id
    finally:
        await store.close()
    assert not segments[0].segment_path.exists()
    assert segments[-1].segment_path.exists()


# Streams.


@pytest_twisted.ensureDeferred
async def test_create_get_delete(tmp_path: Path) -> None:
    """Streams are created once; deleting one fails its pending appends and readers."""
    store = open_store(tmp_path)
    try:
        stream = store.create("s")
        with pytest.raises(StreamExistsError):
            store.create("s")
        assert store.get("s") is stream
        assert store.names() == ["s"]
        await stream.append([b"a"])
        pending = stream.append([b"b"])
        waiter = stream.wait_for(99)
        await store.delete("s")
        with pytest.raises(StreamMissingError):
            await pending
        with pytest.raises(StreamMissingError):
            await waiter
        with pytest.raises(StreamMissingError):
            await stream.append([b"c"])
        with pytest.raises(StreamMissingError):
            store.delete("s")
        assert store.get("s") is None
        assert not (tmp_path / "s").exists()
        fresh = store.create("s")
        assert (await fresh.append([b"new"])).first_offset == 0
        assert messages(fresh) == [b"new"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_delete_during_a_commit(tmp_path: Path) -> None:
    """An append being written when its stream is deleted fails."""
    writes = HeldWrites()
    store = open_store(tmp_path, write_segment=writes)
    try:
        stream = store.create("s")
        pending = stream.append([b"a"])
        await writes.started
        deleted = store.delete("s")
        writes.release.set()
        with pytest.raises(StreamMissingError):
            await pending
        await deleted
        assert store.names() == []
    finally:
        writes.release.set()
        await store.close()


@pytest_twisted.ensureDeferred
async def test_names_are_escaped(tmp_path: Path) -> None:
    """Any UTF-8 name gets a safe, distinct directory, and comes back on reopen."""
    names = ["a/b", "..", ".", "é", "A-b_c", "a%2Fb", "x" * 300, "x" * 299 + "y"]
    store = open_store(tmp_path)
    for name in names:
        await store.create(name).append([name.encode()])
    await store.close()
    directories = sorted(p.name for p in tmp_path.iterdir())
    assert len(directories) == len(names)
    for directory in directories:
        assert "/" not in directory
        assert "." not in directory
        assert len(directory) < 200
    store = open_store(tmp_path)
    try:
        assert store.names() == sorted(names)
        for name in names:
            stream = store.get(name)
            assert stream is not None
            assert messages(stream) == [name.encode()]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_open_sets_aside_and_finishes_deletes(tmp_path: Path) -> None:
    """A directory without meta.json is set aside; a half-deleted stream is removed."""
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "data").write_bytes(b"keep me")
    (tmp_path / "gone.deleting").mkdir()
    with capturedLogs() as events:
        store = open_store(tmp_path)
    try:
        assert store.names() == []
        assert (tmp_path / "stray.orphan" / "data").read_bytes() == b"keep me"
        assert not (tmp_path / "gone.deleting").exists()
        assert any(e["log_level"] == LogLevel.warn and "stray" in e["path"] for e in events)
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_close(tmp_path: Path) -> None:
    """Close commits what is queued; afterwards appends and waits fail."""
    store = open_store(tmp_path)
    stream = store.create("s")
    queued = stream.append([b"a"])
    closing = store.close()
    with pytest.raises(LogClosedError):
        await stream.append([b"late"])
    await closing
    assert (await queued).stored == 1
    with pytest.raises(LogClosedError):
        await stream.wait_for(5)
    with pytest.raises(LogClosedError):
        store.create("t")
    assert store.close() is closing


class NotedWrites:
    """A ``write_segment`` seam that notes which thread made each write; it may fail one.

    ``on_reactor`` says, write by write, whether the reactor thread made it
    (pytest-twisted runs the reactor in the main thread). The write number
    ``fail_at`` fails as a broken disk would. (A full disk, ENOSPC, passes
    by itself: tests/core/test_log_disk_full.py.)
    """

    def __init__(self, fail_at: int | None = None) -> None:
        self.on_reactor: list[bool] = []
        self._fail_at = fail_at

    def __call__(self, fd: int, data: bytes, position: int) -> None:
        """Note the thread, then write (or fail, at ``fail_at``)."""
        self.on_reactor.append(threading.current_thread() is threading.main_thread())
        if len(self.on_reactor) == self._fail_at:
            raise OSError(errno.EIO, "Input/output error")
        pwrite_all(fd, data, position)


async def failed_write_stops(stream: StreamLog, kept: list[bytes]) -> None:
    """Append ``kept`` (written), then one whose write fails: it and the next fail, logged."""
    for body in kept:
        await stream.append([body])
    with capturedLogs() as events, pytest.raises(LogWriteError):
        await stream.append([b"failed"])
    assert any(e.get("log_failure") is not None for e in events)
    with pytest.raises(LogWriteError):
        await stream.append([b"after"])
    assert messages(stream) == kept


async def reopened_goes_on(directory: Path, kept: list[bytes]) -> None:
    """Reopened, stream ``s`` holds ``kept`` and appends after it."""
    store = open_store(directory)
    try:
        stream = store.get("s")
        assert stream is not None
        assert (await stream.append([b"again"])).first_offset == len(kept)
        assert messages(stream) == [*kept, b"again"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_write_failure_stops_the_stream(tmp_path: Path) -> None:
    """A failed write fails its appends and later ones; reopening recovers the stream."""
    store = open_store(tmp_path, write_segment=NotedWrites(fail_at=2))
    try:
        await failed_write_stops(store.create("s"), [b"a"])
    finally:
        await store.close()
    await reopened_goes_on(tmp_path, [b"a"])


@pytest_twisted.ensureDeferred
async def test_create_failure_fails_appends(tmp_path: Path) -> None:
    """A stream whose files cannot be created refuses appends."""
    store = open_store(tmp_path)
    try:
        (tmp_path / "blocked").write_bytes(b"a file where the directory would go")
        with capturedLogs() as events:
            stream = store.create("blocked")
            with pytest.raises(LogWriteError):
                await stream.append([b"a"])
        assert any(e.get("log_failure") is not None for e in events)
    finally:
        await store.close()


# Fsync policies.


@pytest_twisted.ensureDeferred
async def test_never_fsyncs(tmp_path: Path) -> None:
    """Under NEVER, commits are acknowledged after the write, without fsync."""
    store = open_store(tmp_path, fsync=FsyncPolicy.NEVER)
    stream = store.create("s")
    await gatherResults([stream.append([b"a"]), stream.append([b"b"])])
    await stream.append([b"c"])
    await store.close()
    assert (store.stats.commits, store.stats.fsyncs, store.stats.synced_appends) == (2, 0, 0)
    store = open_store(tmp_path)
    try:
        stream = store.get("s")
        assert stream is not None
        assert messages(stream) == [b"a", b"b", b"c"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_always_syncs_what_is_acknowledged_and_offsets_with_it(tmp_path: Path) -> None:
    """Under ALWAYS, a commit of stored offsets alone is written without an fsync.

    Nothing waits for it (offsets are never acknowledged); the next commit
    that acknowledges appends syncs the file, offsets and all.
    """
    store = open_store(tmp_path)
    stream = store.create("s")
    await stream.append([b"a"])
    assert (store.stats.commits, store.stats.fsyncs) == (1, 1)
    stream.store_offset("reader", 0)
    await store._committer.drain()
    assert (store.stats.commits, store.stats.fsyncs) == (2, 1)
    await stream.append([b"b"])
    assert (store.stats.commits, store.stats.fsyncs, store.stats.synced_appends) == (3, 2, 2)
    await store.close()
    store = open_store(tmp_path)
    try:
        again = store.get("s")
        assert again is not None
        assert again.query_offset("reader") == 0
        assert messages(again) == [b"a", b"b"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_interval_fsyncs_at_most_every_interval(tmp_path: Path) -> None:
    """Under INTERVAL, a commit fsyncs only once the interval has passed."""
    clock = Clock()
    store = open_store(
        tmp_path, clock=clock, fsync=FsyncPolicy.INTERVAL, fsync_interval_seconds=0.5
    )
    try:
        stream = store.create("s")
        await stream.append([b"a"])
        await stream.append([b"b"])
        assert (store.stats.commits, store.stats.synced_commits) == (2, 0)
        clock.advance(0.5)
        await stream.append([b"c"])
        assert store.stats.synced_commits == 1
        assert store.stats.synced_appends == 1
    finally:
        await store.close()
    assert store.stats.fsyncs == 1


# Recovery.


async def three_chunks(directory: Path) -> StreamLog:
    """A closed store with stream "s" of three one-message chunks (ids 1, 2, 3)."""
    store = open_store(directory)
    stream = store.create("s")
    for number in (1, 2, 3):
        await stream.append([b"message %d" % number], reference="p", publishing_ids=[number])
    await store.close()
    return stream


def reopen_logged(directory: Path) -> tuple[LogStore, StreamLog, list[dict[str, Any]]]:
    """Reopen the store, capturing what recovery logs."""
    with capturedLogs() as events:
        store = open_store(directory)
    stream = store.get("s")
    assert stream is not None
    return store, stream, list(events)


def truncation(events: Sequence[dict[str, Any]]) -> tuple[str, int]:
    """The file and byte offset of the one truncation warning."""
    (event,) = [e for e in events if e["log_level"] == LogLevel.warn]
    assert "Truncating" in event["log_format"]
    return event["path"], event["position"]


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("cut", [1, 20, 48, 60])
async def test_recover_torn_chunk(tmp_path: Path, cut: int) -> None:
    """A segment cut inside its last chunk loses that chunk only, and takes appends again."""
    old = await three_chunks(tmp_path)
    segment = old.segments[0]
    last = segment.positions[-1]
    os.truncate(segment.segment_path, last + cut)
    store, stream, events = reopen_logged(tmp_path)
    try:
        assert truncation(events) == (str(segment.segment_path), last)
        assert segment.segment_path.stat().st_size == last
        assert messages(stream) == [b"message 1", b"message 2"]
        assert (stream.next_offset, stream.writer_sequence("p")) == (2, 2)
        result = await stream.append([b"message 3"], reference="p", publishing_ids=[3])
        assert (result.first_offset, result.stored) == (2, 1)
        assert messages(stream)[-1] == b"message 3"
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_recover_flipped_byte(tmp_path: Path) -> None:
    """The last chunk failing its CRC (a flipped data byte) is cut off; the rest stays."""
    old = await three_chunks(tmp_path)
    segment = old.segments[0]
    last = segment.positions[-1]
    with segment.segment_path.open("r+b") as file:
        file.seek(last + 48 + 5)
        byte = file.read(1)
        file.seek(last + 48 + 5)
        file.write(bytes([byte[0] ^ 0x20]))
    store, stream, events = reopen_logged(tmp_path)
    try:
        assert truncation(events) == (str(segment.segment_path), last)
        assert messages(stream) == [b"message 1", b"message 2"]
        assert stream.writer_sequence("p") == 2
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_recover_garbage_after_the_last_chunk(tmp_path: Path) -> None:
    """Bytes after the last chunk are cut off; every chunk stays."""
    old = await three_chunks(tmp_path)
    segment = old.segments[0]
    size = segment.segment_path.stat().st_size
    with segment.segment_path.open("ab") as file:
        file.write(b"\x50garbage that is not a chunk" * 3)
    store, stream, events = reopen_logged(tmp_path)
    try:
        assert truncation(events) == (str(segment.segment_path), size)
        assert messages(stream) == [b"message 1", b"message 2", b"message 3"]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("damage", ["delete", "short", "ahead", "garbage-header"])
async def test_recover_index(tmp_path: Path, damage: str) -> None:
    """A missing, short, overlong or unreadable index is rebuilt from the segment."""
    old = await three_chunks(tmp_path)
    index = old.segments[0].index_path
    original = index.read_bytes()
    if damage == "delete":
        index.unlink()
    elif damage == "short":
        index.write_bytes(original[: -osiris.INDEX_RECORD_BYTES - 3])
    elif damage == "ahead":
        bogus = osiris.pack_index_record(3, 0, 1, 4000, 0)
        index.write_bytes(original + bogus)
    else:
        index.write_bytes(b"XXXX" + original[4:])
    store, stream, events = reopen_logged(tmp_path)
    try:
        assert not [e for e in events if e["log_level"] == LogLevel.warn]
        assert any("Rebuilt index" in e["log_format"] for e in events)
        assert index.read_bytes() == original
        assert messages(stream) == [b"message 1", b"message 2", b"message 3"]
        assert stream.seek(("offset", 2)) == 2
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_recover_torn_roll(tmp_path: Path) -> None:
    """A segment left empty by a torn roll gets its snapshot again; tracking survives."""
    store = open_store(tmp_path, default_retention=tiny_segments())
    stream = store.create("s")
    await fill(stream, 3)
    last = stream.segments[-1]
    assert last.types[0] == osiris.TRACKING_SNAPSHOT
    await store.close()
    os.truncate(last.segment_path, 8 + 30)
    store, stream, events = reopen_logged(tmp_path)
    try:
        assert truncation(events) == (str(last.segment_path), 8)
        assert stream.writer_sequence("p") == 2
        assert stream.next_offset == last.first_id
        await fill(stream, 1)
        assert stream.segments[-1].types[0] == osiris.TRACKING_SNAPSHOT
        assert [m[:3] for m in messages(stream)] == [b"001", b"002", b"003"]
    finally:
        await store.close()


CHILD = """
import sys
from pathlib import Path

from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults

from gateway.core.log import FsyncPolicy, LogStore

store = LogStore(Path(sys.argv[1]), reactor, fsync=FsyncPolicy.ALWAYS)
store.open()
stream = store.get("crash") or store.create("crash")
padding = b"." * int(sys.argv[2])


def batch(first):
    ids = range(first, first + 5)
    return ids, gatherResults(
        [
            stream.append([b"message %d " % i + padding], reference="producer", publishing_ids=[i])
            for i in ids
        ]
    )


async def produce():
    # Four batches in flight, so that a commit is being written most of the time.
    next_id = stream.writer_sequence("producer") + 1
    window = []
    while True:
        while len(window) < 4:
            window.append(batch(next_id))
            next_id += 5
        ids, pending = window.pop(0)
        for publishing_id, result in zip(ids, await pending):
            sys.stdout.write("%d %d\\n" % (publishing_id, result.first_offset))
        sys.stdout.flush()


reactor.callWhenRunning(lambda: Deferred.fromCoroutine(produce()))
reactor.run()
"""


@pytest_twisted.ensureDeferred
async def test_crash_keeps_every_acknowledged_message(tmp_path: Path) -> None:
    """After SIGKILL, every message acknowledged under ALWAYS is there once, in order."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), "2000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    acknowledged: dict[int, int] = {}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            publishing_id, offset = map(int, line.split())
            acknowledged[publishing_id] = offset
            if len(acknowledged) >= 400:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        _, errors = child.communicate(timeout=30)
    assert len(acknowledged) >= 400, errors.decode()
    assert child.returncode == -signal.SIGKILL

    store = open_store(tmp_path)
    try:
        stream = store.get("crash")
        assert stream is not None
        stored: list[tuple[int, int]] = []
        for chunk in read_all(stream):
            for number, body in enumerate(records(chunk)):
                stored.append((int(body.split()[1]), chunk.chunk_id + number))
        ids = [publishing_id for publishing_id, _ in stored]
        assert ids == list(range(1, len(ids) + 1))
        assert dict(stored[: len(acknowledged)]) == acknowledged
        assert stream.writer_sequence("producer") == len(ids)
        again = await stream.append([b"again"], reference="producer", publishing_ids=[1])
        assert again.duplicates == 1
    finally:
        await store.close()
