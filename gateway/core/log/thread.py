"""The log's writer thread: disk work run in order, results back on the reactor thread.

One daemon thread takes jobs from a `queue.SimpleQueue` and hands each
result (or failure) back with ``callFromThread``. Not a one-thread Twisted
``ThreadPool``: that hands each job over through a coordinator whose lock
both threads take, and under load the reactor thread waits on that lock
while the writer thread, holding it, waits for the GIL (about 4% of the
reactor's time with a durable route's commits, by py-spy). Here handing a
job over is one ``put`` on a queue written in C, and each job costs the
writer thread two GIL acquisitions besides its own system calls: one to
take it, one to report it.

Handing a job over is not the same as the writer thread running it: it
needs the GIL, which the reactor thread keeps while it has work (a thread
waiting for the GIL gets it when the holder blocks, or after the switch
interval, 5 ms). A commit that senders wait for is handed over with
`submit_now`, which waits (without the GIL) until the writer thread has
taken the job: a thread's wake-up, some 10 µs, where a busy reactor made
the job wait 0.6 ms at the median (a QMQP durable route at 10,000 messages
a second), longer than the fsync itself. It waits only when the thread is
idle (else the job waits its turn anyway, and the reactor must not wait
for a slow disk).

The thread is a daemon: a store left open must not hang the process at
exit. Nothing acknowledged depends on it (acknowledged means written and,
per the policy, fsynced); a torn last write is what recovery repairs.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure

__all__ = ["WriterThread", "WriterThreadStoppedError"]

_T = TypeVar("_T")
_Job = tuple[Deferred[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any], bool]
"""The Deferred, the function and its arguments, and whether the submitter waits for it."""
_STOP: Final = None
"""Put on the queue to end the thread once the jobs before it are done."""
_TAKEN_SECONDS: Final = 0.05
"""`submit_now` waits at most this long for the idle thread to take its job (a safety net:
it takes far less); then it goes on, and the job runs when its turn comes."""


class WriterThreadStoppedError(Exception):
    """A job was submitted after the writer thread was told to stop."""


class WriterThread:
    """Runs submitted functions one at a time, in order, in one thread of its own.

    Jobs submitted before `start` wait for it.

    Args:
        reactor: Receives each job's result (``callFromThread``).
        name: The thread's name.
    """

    def __init__(self, reactor: IReactorFromThreads, name: str) -> None:
        self._reactor = reactor
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._taken: queue.SimpleQueue[None] = queue.SimpleQueue()
        """One item per job of `submit_now`, put by the thread as it takes the job."""
        self._thread: threading.Thread | None = None
        self._idle = False
        """The thread waits for a job (set by the thread; a plain flag read under the GIL)."""
        self._stopped = False

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    @property
    def idle(self) -> bool:
        """The thread runs, waits for a job, and none is queued: whatever was submitted is done."""
        return self._thread is not None and self._idle and self._jobs.empty()

    def submit(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> Deferred[_T]:
        """Run ``function(*args, **kwargs)`` in the thread, after everything submitted before.

        Returns:
            A Deferred firing on the reactor thread with the function's
            result, or failing with what it raised.

        Raises:
            WriterThreadStoppedError: `stop` was called.
        """
        return self._submit(function, args, kwargs, wait=False)

    def submit_now(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> Deferred[_T]:
        """As `submit`, and wait until the thread has taken the job, without the GIL.

        For a job somebody waits for: it runs without waiting for the
        reactor thread to let go of the GIL (module docstring). Only when
        the thread is idle (else at once), at most `_TAKEN_SECONDS`.
        """
        return self._submit(function, args, kwargs, wait=self.idle)

    def _submit(
        self,
        function: Callable[..., _T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        wait: bool,
    ) -> Deferred[_T]:
        if self._stopped:
            raise WriterThreadStoppedError(f"{self._name} has stopped")
        done: Deferred[_T] = Deferred()
        self._jobs.put((done, function, args, kwargs, wait))
        if wait:
            # Not taken in time: its item comes later, and ends a later wait early (harmless).
            with contextlib.suppress(queue.Empty):
                self._taken.get(timeout=_TAKEN_SECONDS)
        return done

    def stop(self) -> None:
        """Let the jobs submitted so far finish, then end the thread and wait for it."""
        if self._stopped:
            return
        self._stopped = True
        self._jobs.put(_STOP)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        """The thread: run jobs until told to stop."""
        jobs = self._jobs
        while True:
            self._idle = True
            job = jobs.get()
            self._idle = False
            if job is _STOP:
                return
            self._run_one(*job)
            job = None  # nothing of a job is kept while waiting for the next

    def _run_one(
        self,
        done: Deferred[Any],
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        waited: bool,
    ) -> None:
        """Run one job; hand its result or failure to the reactor thread."""
        if waited:
            self._taken.put(None)
        try:
            result = function(*args, **kwargs)
        except Exception:
            self._idle = True  # before the reactor hears of it: its next job may wait for it
            self._reactor.callFromThread(done.errback, Failure())
        else:
            self._idle = True
            self._reactor.callFromThread(done.callback, result)
