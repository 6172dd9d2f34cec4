"""Tests for small commits written on the reactor thread (`gateway.core.log.writer`).

Under ``fsync = "always"`` a commit of at most ``inline_max_bytes`` is
written and fsynced by the reactor thread while commits average at most
`INLINE_MAX_ENTRIES` entries, the writer thread is idle with nothing queued
and recent fsyncs were quick; anything else goes to the writer thread.
Which thread wrote is seen through the store's ``write_segment`` seam
(pytest-twisted runs the reactor in the main thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_twisted

from gateway.core.log import FsyncPolicy, LogStore, StreamLog
from gateway.core.log import files as files_module
from gateway.core.log.writer import (
    HANDOVER_WAIT_MAX_ENTRIES,
    INLINE_MAX_BYTES,
    INLINE_MAX_ENTRIES,
    INLINE_MAX_SYNC_SECONDS,
)
from tests.core.test_log import (
    NotedWrites,
    failed_write_stops,
    messages,
    next_turn,
    open_store,
    reopened_goes_on,
)

INLINE = 16 * 1024


def inline_store(directory: Path, writes: NotedWrites, **options: object) -> LogStore:
    """A store that writes small commits inline, its writes watched."""
    return open_store(directory, write_segment=writes, inline_max_bytes=INLINE, **options)


@contextlib.asynccontextmanager
async def first_acknowledged(
    directory: Path,
) -> AsyncIterator[tuple[LogStore, StreamLog, NotedWrites]]:
    """An inline store, its stream ``s`` and its writes, once ``first`` is acknowledged.

    The stream's files are the writer thread's first job; from that
    acknowledgement on, the thread is idle. The store is closed afterwards.
    """
    writes = NotedWrites()
    store = inline_store(directory, writes)
    try:
        stream = store.create("s")
        await stream.append([b"first"])
        yield store, stream, writes
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_small_commits_are_written_and_synced_on_the_reactor_thread(tmp_path: Path) -> None:
    """Once the writer thread is idle, each small commit is written inline, fsynced, and kept."""
    async with first_acknowledged(tmp_path) as (store, stream, writes):
        before = store.stats.inline_commits
        for index in range(5):
            await stream.append([b"m%d" % index])
        assert writes.on_reactor[-5:] == [True] * 5
        assert store.stats.inline_commits == before + 5
        assert store.stats.synced_commits == store.stats.commits
        assert store.stats.fsyncs == store.stats.commits
        # A stored offset alone (not synced) is written inline as well.
        stream.store_offset("reader", 3)
        await store._committer.drain()
        assert writes.on_reactor[-1] is True
    store = open_store(tmp_path)
    try:
        again = store.get("s")
        assert again is not None
        assert messages(again) == [b"first"] + [b"m%d" % index for index in range(5)]
        assert again.query_offset("reader") == 3
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_commit_over_the_limit_goes_to_the_writer_thread(tmp_path: Path) -> None:
    """A commit larger than ``inline_max_bytes`` is written by the writer thread."""
    async with first_acknowledged(tmp_path) as (store, stream, writes):
        inline = store.stats.inline_commits
        await stream.append([b"x" * (INLINE + 1)])
        assert writes.on_reactor[-1] is False
        assert store.stats.inline_commits == inline
        await stream.append([b"small"])
        assert writes.on_reactor[-1] is True


@pytest_twisted.ensureDeferred
async def test_commits_of_many_entries_go_to_the_writer_thread(tmp_path: Path) -> None:
    """Once commits average more than `INLINE_MAX_ENTRIES` entries (a busy reactor): the thread.

    One large commit after small ones (what follows a pause) stays inline.
    """
    async with first_acknowledged(tmp_path) as (_store, stream, writes):
        for _ in range(2):
            await stream.append([b"one"])
        await stream.append([b"e"] * (INLINE_MAX_ENTRIES * 2))
        assert writes.on_reactor[-1] is True  # the average is about 16
        for _ in range(3):
            await stream.append([b"e"] * (INLINE_MAX_ENTRIES * 3))
        # The average passes 32 with the first of these (about 36), and stays above.
        assert writes.on_reactor[-3:] == [False, False, False]
        for _ in range(12):
            await stream.append([b"one"])
        assert writes.on_reactor[-1] is True  # back under, small commits are inline again


@pytest_twisted.ensureDeferred
async def test_the_reactor_waits_for_the_thread_to_take_a_commit_unless_commits_are_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large commits are handed to the idle writer thread without waiting for it.

    They go with ``submit_now`` until commits average more than
    `HANDOVER_WAIT_MAX_ENTRIES` entries (a flood), then with ``submit``; back
    under the bound, with ``submit_now`` again. Every one is written by the
    thread and kept.
    """
    async with first_acknowledged(tmp_path) as (store, stream, writes):
        thread = store._thread
        handed: list[str] = []

        def noted(name: str) -> Callable[..., object]:
            method = getattr(thread, name)

            def call(*args: object, **kwargs: object) -> object:
                handed.append(name)
                return method(*args, **kwargs)

            return call

        monkeypatch.setattr(thread, "submit_now", noted("submit_now"))
        monkeypatch.setattr(thread, "submit", noted("submit"))
        large = [b"e"] * (HANDOVER_WAIT_MAX_ENTRIES * 2)
        for _ in range(3):
            await stream.append(large)
        # The average (weight 1/4) is about 64, 112, then 148: past the bound.
        assert handed == ["submit_now", "submit_now", "submit"]
        await stream.append(large[:50])  # about 124: under it again
        assert handed[-1] == "submit_now"
        assert writes.on_reactor[-4:] == [False] * 4
        assert len(messages(stream)) == 1 + 3 * len(large) + 50


@pytest_twisted.ensureDeferred
async def test_a_busy_writer_thread_keeps_the_order(tmp_path: Path) -> None:
    """With a job queued or running in the writer thread, a small commit waits behind it there."""
    release = threading.Event()
    async with first_acknowledged(tmp_path) as (store, stream, writes):
        held = store._thread.submit(release.wait, 30)
        appended = stream.append([b"second"])
        try:
            await next_turn()
            await next_turn()
            assert not appended.called  # behind the job
        finally:
            release.set()  # else closing would wait for the job
        await held
        await appended
        assert writes.on_reactor[-1] is False
        assert messages(stream) == [b"first", b"second"]


@pytest_twisted.ensureDeferred
async def test_slow_fsyncs_send_commits_back_to_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the fsyncs' moving average passes the bound, commits go to the writer thread."""
    ticks = iter(range(10**6))
    step = INLINE_MAX_SYNC_SECONDS * 5  # each fsync seems to take five times the bound
    slow = SimpleNamespace(perf_counter=lambda: next(ticks) * step)
    async with first_acknowledged(tmp_path) as (store, stream, writes):
        # From nothing: the real fsyncs before (the first commit's wrote the zeros
        # ahead too, `PREALLOCATE_BYTES`) take the average wherever this disk puts it.
        store._committer._sync_average = 0.0
        monkeypatch.setattr(files_module, "time", slow)
        for index in range(6):
            await stream.append([b"m%d" % index])
        # 0.1 of each 5 ms fsync: the average passes 1 ms after the third.
        assert writes.on_reactor[-6:] == [True, True, True, False, False, False]
        monkeypatch.undo()


@pytest_twisted.ensureDeferred
async def test_off_by_default_in_the_store_and_not_under_other_policies(tmp_path: Path) -> None:
    """``inline_max_bytes`` 0 (the store's default), or INTERVAL / NEVER: the writer thread."""
    for options in (
        {},
        {"inline_max_bytes": INLINE, "fsync": FsyncPolicy.INTERVAL},
        {"inline_max_bytes": INLINE, "fsync": FsyncPolicy.NEVER},
    ):
        writes = NotedWrites()
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        store = open_store(directory, write_segment=writes, **options)
        try:
            stream = store.create("s")
            for index in range(3):
                await stream.append([b"m%d" % index])
            assert writes.on_reactor == [False] * 3, options  # each append, by the thread
            assert store.stats.inline_commits == 0
        finally:
            await store.close()


@pytest_twisted.ensureDeferred
async def test_an_inline_write_failure_is_what_a_writer_thread_failure_is(tmp_path: Path) -> None:
    """A failed inline write fails its appends and stops the stream; reopening recovers it."""
    writes = NotedWrites(fail_at=3)
    store = inline_store(tmp_path, writes)
    try:
        await failed_write_stops(store.create("s"), [b"a", b"b"])
        assert writes.on_reactor[1:] == [True, True]  # the failing write was made inline
    finally:
        await store.close()
    await reopened_goes_on(tmp_path, [b"a", b"b"])


@pytest_twisted.ensureDeferred
async def test_a_gateway_without_the_key_writes_small_commits_inline(tmp_path: Path) -> None:
    """No ``[log] inline_commit_max_bytes`` in the config: the gateway's store inlines (16 KiB)."""
    from twisted.internet import reactor

    from gateway.config.loader import load_config
    from gateway.service import _log_store

    main = tmp_path / "gateway.toml"
    main.write_text('[gateway]\ndata_dir = "state"\n', encoding="utf-8")
    config = load_config(main)
    assert config.log.inline_commit_max_bytes == INLINE_MAX_BYTES == 16 * 1024
    store = _log_store(config, reactor)
    store.open()
    try:
        stream = store.create("s")
        await stream.append([b"first"])  # the stream's files: the writer thread's job
        await stream.append([b"x" * (INLINE_MAX_BYTES - 1024)])
        assert store.stats.inline_commits == 1
    finally:
        await store.close()
