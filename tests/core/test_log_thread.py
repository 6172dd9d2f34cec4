"""Tests for `gateway.core.log.thread`, the log's writer thread.

The real reactor receives the results, as it does in the store.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import gatherResults

from gateway.core.log.thread import WriterThread, WriterThreadStoppedError


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


@pytest_twisted.ensureDeferred
async def test_jobs_run_in_order_in_one_other_thread() -> None:
    """Jobs run one after another, in submission order, in one thread that is not the reactor's."""
    writer = WriterThread(_reactor(), "test-writer")
    ran: list[tuple[int, int | None]] = []

    def job(number: int) -> int:
        ran.append((number, threading.get_ident()))
        return number * 10

    writer.start()
    try:
        results = await gatherResults([writer.submit(job, number) for number in range(50)])
    finally:
        writer.stop()
    assert results == [number * 10 for number in range(50)]
    assert [number for number, _ in ran] == list(range(50))
    threads = {ident for _, ident in ran}
    assert len(threads) == 1
    assert threading.get_ident() not in threads


@pytest_twisted.ensureDeferred
async def test_failure_comes_back_and_the_thread_goes_on() -> None:
    """A job that raises fails its Deferred with the exception; the next job still runs."""
    writer = WriterThread(_reactor(), "test-writer")

    def broken() -> None:
        raise OSError(5, "input/output error")

    writer.start()
    try:
        failed = writer.submit(broken)
        after = writer.submit(lambda: "after")
        with pytest.raises(OSError, match="input/output error"):
            await failed
        assert await after == "after"
    finally:
        writer.stop()


@pytest_twisted.ensureDeferred
async def test_jobs_submitted_before_start_wait_for_it() -> None:
    """A job submitted before `WriterThread.start` runs once the thread starts."""
    writer = WriterThread(_reactor(), "test-writer")
    early = writer.submit(lambda x, y=0: x + y, 1, y=2)
    writer.start()
    try:
        assert await early == 3
    finally:
        writer.stop()


def test_stop_waits_for_jobs_then_refuses_more() -> None:
    """`WriterThread.stop` returns once the jobs submitted before it ran; later ones are refused."""
    writer = WriterThread(_reactor(), "test-writer")
    ran = threading.Event()
    writer.start()
    writer.submit(ran.set)
    writer.stop()
    assert ran.is_set()
    with pytest.raises(WriterThreadStoppedError):
        writer.submit(ran.set)


@pytest_twisted.ensureDeferred
async def test_submit_now_returns_once_the_thread_took_the_job() -> None:
    """`WriterThread.submit_now` hands the job over: when it returns, the thread has it.

    The job blocks until released, and the queue is already empty when
    `submit_now` returns. Before `start` it returns at once, and the job
    runs once the thread starts.
    """
    writer = WriterThread(_reactor(), "test-writer")
    early = writer.submit_now(lambda: "early")
    assert not writer._jobs.empty()
    writer.start()
    try:
        assert await early == "early"
        held = threading.Event()
        taken = writer.submit_now(held.wait, 10)
        assert writer._jobs.empty()
        held.set()
        assert await taken is True
    finally:
        writer.stop()


@pytest_twisted.ensureDeferred
async def test_submit_now_does_not_wait_for_a_busy_thread() -> None:
    """A thread still at an earlier job: `WriterThread.submit_now` returns at once.

    The reactor thread must not wait for a slow disk; the job waits its turn.
    """
    writer = WriterThread(_reactor(), "test-writer")
    writer.start()
    try:
        release = threading.Event()
        started = threading.Event()

        def slow() -> str:
            started.set()
            release.wait(10)
            return "slow"

        first = writer.submit_now(slow)
        assert started.wait(10)
        second = writer.submit_now(lambda: "second")
        assert not writer._jobs.empty()
        release.set()
        assert [await first, await second] == ["slow", "second"]
    finally:
        writer.stop()
