"""A stream's wait after its file system filled up: refusals, then another try.

A commit that fails because the file system (or a quota) is full was taken
back by the writer thread, so the stream is intact. `FullDisk` keeps what
follows: the `LogFullError` appends are refused with (saying what is full,
where, and how much is free), and a timer that ends the wait after
`FULL_RETRY_INITIAL_SECONDS`, doubling up to `FULL_RETRY_MAX_SECONDS` while
the disk stays full; after each wait the stream's next commit tries again,
so writing resumes by itself once there is room. All of it runs on the
reactor thread.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Final

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.core.log.files import CommitWriteError
from gateway.core.log.values import LogFullError

__all__ = ["FULL_RETRY_INITIAL_SECONDS", "FULL_RETRY_MAX_SECONDS", "FullDisk"]

FULL_RETRY_INITIAL_SECONDS: Final = 0.5
"""After a commit fails on a full file system, appends are refused this long, then tried."""
FULL_RETRY_MAX_SECONDS: Final = 5.0
"""The wait doubles with each failed try up to this: writing resumes at most this long
after space is freed, and a full disk costs one failed write per stream this often."""


def _size(nbytes: int) -> str:
    """A byte count for people: ``0 bytes``, ``12.0 KiB``, ``2.0 MiB``."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    value = nbytes / 1024
    units = iter(("MiB", "GiB", "TiB"))
    unit = "KiB"
    while value >= 1024 and (bigger := next(units, None)) is not None:
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _no_room(error: CommitWriteError) -> str:
    """What a full file system looks like, for the operator: what, where, how much is free."""
    what = (
        "the disk quota is exhausted (EDQUOT)"
        if error.cause.errno == errno.EDQUOT
        else "the file system is full (ENOSPC)"
    )
    if error.free_bytes is None:
        free = "unknown"
    else:
        free = _size(error.free_bytes)
        if error.total_bytes is not None:
            free += f" of {_size(error.total_bytes)}"
    return f"{what} at {error.path}: free space {free}"


class FullDisk:
    """One stream's state while its file system is full.

    Args:
        stream: The stream's name, for messages.
        clock: Times the waits.
        try_again: Called when a wait is over and appends are accepted again.
    """

    _log = Logger()

    def __init__(self, stream: str, clock: IReactorTime, try_again: Callable[[], None]) -> None:
        self._stream = stream
        self._clock = clock
        self._try_again = try_again
        self.error: LogFullError | None = None
        """What appends are refused with while waiting (None: not waiting)."""
        self._failures = 0
        self._since = 0.0
        self._timer: IDelayedCall | None = None

    @property
    def waiting(self) -> bool:
        """Whether a wait's timer is set."""
        return self._timer is not None

    def ran_out(self, reason: CommitWriteError, *, retry: bool) -> LogFullError:
        """A commit failed for want of space: refuse appends, and try again after a wait.

        Args:
            reason: The writer thread's error.
            retry: Set the timer (not when the stream refuses appends anyway).

        Returns:
            The error the commit's appends, and those after it, fail with.
        """
        if not self._failures:
            self._since = self._clock.seconds()
        self._failures += 1
        delay = min(FULL_RETRY_INITIAL_SECONDS * 2 ** (self._failures - 1), FULL_RETRY_MAX_SECONDS)
        why = _no_room(reason)
        error = self.error = LogFullError(
            f"writing stream {self._stream!r} failed: {why}; appends are refused for"
            f" {delay:g} s, then tried again: writing resumes by itself once there is room",
            stream=self._stream,
            path=reason.path,
            free_bytes=reason.free_bytes,
            retry_seconds=delay,
        )
        self._log.warn(
            "Writing stream {stream} failed: {why}; appends are refused for {seconds} s,"
            " then tried again",
            stream=self._stream,
            why=why,
            seconds=delay,
            path=reason.path,
            free_bytes=reason.free_bytes,
        )
        self.cancel()
        if retry:
            self._timer = self._clock.callLater(delay, self._waited)
        return error

    def written(self) -> None:
        """A commit was written: if the disk had been full, say that writing resumed."""
        if self._failures:
            self._log.info(
                "Writing stream {stream} resumed: the file system has room again"
                " (it was full for {seconds:.1f} s)",
                stream=self._stream,
                failures=self._failures,
                seconds=self._clock.seconds() - self._since,
            )
            self._failures = 0

    def cancel(self) -> bool:
        """Cancel the timer that ends the wait, if it is set; return whether it was."""
        timer, self._timer = self._timer, None
        if timer is None:
            return False
        if timer.active():
            timer.cancel()
        return True

    def clear(self) -> None:
        """Stop waiting (the stream broke otherwise): refuse nothing for want of space."""
        self.error = None
        self.cancel()

    def _waited(self) -> None:
        """The wait is over: accept appends again; the next commit tries the disk."""
        self._timer = None
        if self.error is None:
            return
        self.error = None
        self._log.info(
            "Stream {stream} accepts appends again; the next commit tries the disk",
            stream=self._stream,
        )
        self._try_again()
