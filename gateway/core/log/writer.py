"""The group commit: many appends, one chunk per stream, one write, one fsync.

An append queues on its stream and asks for a commit. With no commit being
written, the commit starts on the next reactor turn (``callLater(0)``), so
every append of a turn shares it; appends made while a commit is on its way
to the disk share the next one. Each stream in a commit gets its chunks
planned on the reactor thread, and the writer thread
(`gateway.core.log.thread`) encodes them, writes each stream's chunks with
one write, and fsyncs each written stream once, as the policy says. Only
then, back on the reactor thread, do the streams publish the chunks
(`CommittingStream.commit_written`) and fire the appends
(`CommittingStream.acknowledge`).

Between the two, the next commit (what queued while this one was written)
is planned and handed to the writer thread: the disk does not wait while
the reactor answers the senders of the last commit and wakes its readers,
which (for a durable route) deliver what it held. Appends made by those
callbacks go into the commit after.

Under ``ALWAYS``, a small commit (at most ``inline_max_bytes``, into the open
segments, while commits average at most `INLINE_MAX_ENTRIES` entries) is
written and fsynced on the reactor thread itself, when the writer thread has
nothing to do and the recent fsyncs were quick (`INLINE_MAX_SYNC_SECONDS`).
Handing a commit to another thread and back costs two thread wake-ups and the
GIL's back and forth: traced with a QMQP durable route at 10,000 messages a
second, a commit took 1.2 ms at the median from its planning to its
acknowledgement through the writer thread, of which the fsync (GIL wait
included) 0.55 ms; written inline, 0.3 ms, the fsync 0.23 ms. The reactor waits
for the fsync instead. An inline commit also writes zeros ahead of the
segment's data, so that the next ones overwrite in place and their fsyncs skip
the file system's journal (`gateway.core.log.files`). A commit that creates a
segment, a large one (a busy gateway: the reactor has reading to do meanwhile),
or one while the disk is slow goes to the writer thread; the reactor waits for
the idle thread to take it unless commits are larger still
(`HANDOVER_WAIT_MAX_ENTRIES`). Nothing else can use the files during an inline
commit: the writer thread is idle with nothing queued, and the reactor, which
would queue its next job, is busy with the commit.

Under ``INTERVAL`` a commit fsyncs when the last fsync is at least the
interval old; otherwise a timer on the clock asks for a sync-only commit
when the interval has passed, so nothing stays unsynced for much longer.

Each commit that writes is timed from its planning to its answer on the
reactor thread, and each fsync (`CommitStats`): a few
clock reads per commit, none per message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.log.files import CommitWriteError, SegmentWriter, write_stream
from gateway.core.log.segment import SegmentWrite
from gateway.core.log.thread import WriterThread
from gateway.core.log.values import CommitStats, FsyncPolicy, ILogReactor

if TYPE_CHECKING:
    from gateway.core.log.commit import StreamCommit

__all__ = ["CommittingStream", "GroupCommitter"]


class CommittingStream(Protocol):
    """What the committer needs of a stream (`gateway.core.log.stream.StreamLog` is one)."""

    @property
    def writer(self) -> SegmentWriter:
        """The writer thread's files for the stream."""

    def plan_commit(self, now_ms: int) -> StreamCommit | None:
        """Turn the queued appends and offsets into a planned commit, if any."""

    def commit_written(self, commit: StreamCommit) -> bool:
        """The commit is written (and synced as the policy says): publish it.

        Returns:
            Whether it is to be acknowledged (False: the stream failed its
            appends, having been shut meanwhile).
        """

    def acknowledge(self, commit: StreamCommit) -> None:
        """Fire a published commit's appends; wake the readers of its chunks."""

    def commit_failed(self, commit: StreamCommit, reason: BaseException) -> None:
        """Writing the commit failed."""


_Outcome = int | CommitWriteError
"""Per stream in a commit: segment writes made, or the error that stopped it."""
_Planned = tuple[CommittingStream, "StreamCommit"]

INLINE_MAX_BYTES: Final = 16 * 1024
"""The default largest commit written and fsynced on the reactor thread (module docstring)."""

INLINE_MAX_ENTRIES: Final = 32
"""Nor while commits have averaged more entries than this: commits of many small messages
mean a busy reactor, whose reading would wait for the fsync (a QMQP durable route storing
subjects, at full speed, kept making small commits inline and lost a quarter of its rate).
An average, not each commit's count: after a pause (a large commit of outcome records in
the writer thread) the next commit is larger, and sending it to the thread too made the
one after larger still."""

HANDOVER_WAIT_MAX_ENTRIES: Final = 4 * INLINE_MAX_ENTRIES
"""A commit is handed to the idle writer thread with `WriterThread.submit_now` (the
reactor waits for the thread's wake-up, without the GIL) only while commits have averaged
at most this many entries; else with `WriterThread.submit`. Larger commits mean a flood:
the reactor has reading to do and lets go of the GIL at its next system call anyway, and
with the senders' threads on the other core the wake-up took about 0.2 ms a commit, 4% of
a QMQP durable route's time at full speed (about 280 entries a commit). At 30,000
messages a second (about 30 entries a commit, a fifth of them through the thread) the
wait keeps the p50 at 1.1 ms; without it two passes in four had 2.2 to 2.7 ms."""

_ENTRIES_AVERAGE_WEIGHT: Final = 0.25
"""The weight of each commit's entries in the moving average `INLINE_MAX_ENTRIES` limits."""

INLINE_MAX_SYNC_SECONDS: Final = 0.001
"""Commits are written inline only while the recent fsyncs average at most this long."""

_SYNC_AVERAGE_WEIGHT: Final = 0.1
"""The weight of each fsync's duration in the moving average `INLINE_MAX_SYNC_SECONDS` limits."""


def _run_commit(
    jobs: Sequence[tuple[SegmentWriter, Sequence[SegmentWrite]]],
    also_sync: Sequence[SegmentWriter],
    *,
    sync: bool,
    sync_rolls: bool,
    ahead: bool = False,
) -> tuple[list[_Outcome], int, list[float]]:
    """Write (and sync) every stream of a commit: runs in the writer thread.

    One stream's failure does not stop the others: each gets its outcome.
    With ``ahead`` (a commit on the reactor thread) a write past the zeros
    written ahead of a segment's data writes the next (`gateway.core.log.files`).

    Returns:
        Each stream's outcome, how many fsyncs ended the commit, and the
        duration of every fsync made (those before a segment roll too).
    """
    outcomes: list[_Outcome] = []
    for writer, writes in jobs:
        try:
            outcomes.append(
                write_stream(writer, writes, sync=sync, sync_rolls=sync_rolls, ahead=ahead)
            )
        except CommitWriteError as exc:
            outcomes.append(exc)
    for writer in also_sync:
        writer.sync()
    synced = sum(1 for outcome in outcomes if isinstance(outcome, int)) if sync else 0
    durations = [seconds for writer, _writes in jobs for seconds in writer.take_sync_seconds()]
    for writer in also_sync:
        durations.extend(writer.take_sync_seconds())
    return outcomes, synced + len(also_sync), durations


class GroupCommitter:
    """Merges appends into commits and runs them in the writer thread.

    Args:
        reactor: Runs the commit turn and receives the writer thread's results.
        clock: Gives commit times and runs the ``INTERVAL`` sync timer.
        thread: The writer thread (started and stopped by the store).
        policy: When commits fsync.
        interval_seconds: The ``INTERVAL`` policy's longest time between fsyncs.
        stats: Counters to update.
        inline_max_bytes: Under ``ALWAYS``, the largest commit written on
            the reactor thread (module docstring); 0: every commit goes to
            the writer thread.
    """

    _log = Logger()

    def __init__(
        self,
        reactor: ILogReactor,
        clock: IReactorTime,
        thread: WriterThread,
        *,
        policy: FsyncPolicy,
        interval_seconds: float,
        stats: CommitStats,
        inline_max_bytes: int = 0,
    ) -> None:
        self._reactor = reactor
        self._inline_max_bytes = inline_max_bytes
        self._sync_average = 0.0
        """A moving average of the fsyncs' durations (seconds)."""
        self._entries_average = 0.0
        """A moving average of the entries of the commits that write."""
        self._clock = clock
        self._thread = thread
        self._policy = policy
        self._interval = interval_seconds
        self._stats = stats
        self._pending: dict[CommittingStream, None] = {}
        self._turn: IDelayedCall | None = None
        self._in_flight = False
        self._last_sync = clock.seconds()
        self._unsynced: dict[SegmentWriter, None] = {}
        self._sync_due = False
        self._sync_timer: IDelayedCall | None = None
        self._idle_waiters: list[Deferred[None]] = []

    @property
    def clock(self) -> IReactorTime:
        """The clock commits are timed by (and streams time their retries with)."""
        return self._clock

    def request(self, stream: CommittingStream) -> None:
        """A stream has queued work: commit it on the next turn (or after the current commit)."""
        self._pending[stream] = None
        self._schedule()

    def forget(self, stream: CommittingStream) -> None:
        """A stream is gone: commit nothing more of it."""
        self._pending.pop(stream, None)
        self._unsynced.pop(stream.writer, None)

    def _schedule(self) -> None:
        """Start a commit on the next reactor turn, unless one is due or in flight."""
        if self._turn is None and not self._in_flight:
            self._turn = self._reactor.callLater(0, self._commit)

    def drain(self) -> Deferred[None]:
        """Commit everything queued now (with a final fsync unless ``NEVER``); fire when idle."""
        if self._sync_timer is not None and self._sync_timer.active():
            self._sync_timer.cancel()
        self._sync_timer = None
        if self._unsynced and self._policy is not FsyncPolicy.NEVER:
            self._sync_due = True
        if not self._in_flight:
            if self._turn is not None and self._turn.active():
                self._turn.cancel()
            self._turn = None
            self._commit()
        if self._idle():
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle_waiters.append(waiter)
        return waiter

    def _idle(self) -> bool:
        """Nothing queued, scheduled or being written."""
        return not (self._pending or self._in_flight or self._turn is not None or self._sync_due)

    def _commit(self) -> None:
        """Plan every pending stream's commit and hand the writing to the thread."""
        unwritten = self._start()
        if unwritten is not None:
            self._finish(unwritten, {}, synced=False)

    def _start(self) -> list[_Planned] | None:
        """Plan every pending stream's commit; hand it to the writer thread if it writes.

        Returns:
            The planned commits if there is nothing to write or sync (the
            caller finishes them), else None: they are on their way.
        """
        if self._turn is not None and self._turn.active():
            self._turn.cancel()
        self._turn = None
        now = self._clock.seconds()
        streams, self._pending = list(self._pending), {}
        commits: list[_Planned] = []
        for stream in streams:
            commit = stream.plan_commit(int(now * 1000))
            if commit is not None:
                commits.append((stream, commit))
        written = [(stream, commit) for stream, commit in commits if commit.writes]
        # ALWAYS syncs what is acknowledged: a commit of stored offsets alone (a
        # forwarder's progress, never acknowledged) is written, and synced with
        # the next commit that is; a crash loses at most that progress, which
        # means delivering again, never losing.
        sync = (
            self._policy is FsyncPolicy.ALWAYS
            and (self._sync_due or any(commit.appends for _stream, commit in written))
        ) or (
            self._policy is FsyncPolicy.INTERVAL
            and (self._sync_due or now - self._last_sync >= self._interval)
        )
        writers = {stream.writer for stream, _commit in written}
        also_sync = [writer for writer in self._unsynced if writer not in writers] if sync else []
        if not written and not also_sync:
            self._sync_due = False
            return commits
        self._in_flight = True
        begun = time.perf_counter()
        jobs = [(stream.writer, commit.writes) for stream, commit in written]
        size = entries = 0
        create = False
        for _writer, writes in jobs:
            for write in writes:
                create = create or write.create
                size += write.size
                entries += write.entries
        average = (
            self._entries_average + (entries - self._entries_average) * _ENTRIES_AVERAGE_WEIGHT
        )
        self._entries_average = average
        if self._policy is FsyncPolicy.ALWAYS and self._inline(size, create):
            # Written and fsynced here, then on as when the writer thread is done.
            try:
                result = _run_commit(jobs, also_sync, sync=sync, sync_rolls=True, ahead=True)
            except Exception:
                self._crashed(Failure(), commits)
            else:
                self._stats.inline_commits += 1
                self._written(result, commits, written, sync, now, begun)
            return None
        # Waiting for the idle thread to take the commit costs the reactor a
        # thread's wake-up; worth it only while the reactor has little else to do.
        submit = (
            self._thread.submit_now if average <= HANDOVER_WAIT_MAX_ENTRIES else self._thread.submit
        )
        done = submit(
            _run_commit,
            jobs,
            also_sync,
            sync=sync,
            sync_rolls=self._policy is not FsyncPolicy.NEVER,
        )
        done.addCallbacks(
            self._written,
            self._crashed,
            callbackArgs=(commits, written, sync, now, begun),
            errbackArgs=(commits,),
        )
        return None

    def _inline(self, size: int, create: bool) -> bool:
        """Whether a commit of ``size`` bytes is written on the reactor thread (module docstring).

        Args:
            size: The bytes it writes.
            create: It creates a segment.
        """
        return (
            bool(self._inline_max_bytes)
            and not create
            and size <= self._inline_max_bytes
            and self._entries_average <= INLINE_MAX_ENTRIES
            and self._sync_average <= INLINE_MAX_SYNC_SECONDS
            and self._thread.idle
        )

    def _written(
        self,
        result: tuple[list[_Outcome], int, list[float]],
        commits: list[_Planned],
        written: list[_Planned],
        sync: bool,
        started: float,
        begun: float,
    ) -> None:
        """The thread is done: update the sync state, start the next commit, acknowledge."""
        self._in_flight = False
        outcomes, fsyncs, fsync_seconds = result
        self._stats.fsyncs += fsyncs
        average = self._sync_average
        for seconds in fsync_seconds:
            self._stats.fsync_seconds.observe(seconds)
            average += (seconds - average) * _SYNC_AVERAGE_WEIGHT
        self._sync_average = average
        if sync:
            self._last_sync = started
            self._unsynced.clear()
            self._sync_due = False
        elif self._policy is not FsyncPolicy.NEVER:
            for stream, _commit in written:
                self._unsynced[stream.writer] = None
            if self._policy is FsyncPolicy.INTERVAL:
                self._arm_sync_timer()
        errors: dict[int, BaseException] = {
            id(commit): outcome
            for (_stream, commit), outcome in zip(written, outcomes, strict=True)
            if isinstance(outcome, CommitWriteError)
        }
        if written:
            self._stats.commit_seconds.observe(time.perf_counter() - begun)
            self._stats.commits += 1
            self._stats.synced_commits += sync
            self._stats.writes += sum(o for o in outcomes if isinstance(o, int))
        published = self._publish(commits, errors, synced=sync)
        # What queued meanwhile goes to the disk now, before the appends just
        # written are acknowledged: their senders' answers, and the readers
        # they wake, are made while the next commit is being written.
        unwritten = self._start() if self._pending or self._sync_due else None
        for stream, commit in published:
            stream.acknowledge(commit)
        if unwritten is not None:
            self._finish(unwritten, {}, synced=False)
        else:
            self._next()

    def _crashed(self, failure: Failure, commits: list[_Planned]) -> None:
        """The writer thread raised something other than an I/O error: a bug."""
        self._in_flight = False
        self._log.failure("The log writer thread failed", failure)
        error = failure.value if failure.value is not None else RuntimeError("writer failed")
        errors = {id(commit): error for _stream, commit in commits}
        self._finish(commits, errors, synced=False)

    def _publish(
        self, commits: list[_Planned], errors: dict[int, BaseException], *, synced: bool
    ) -> list[_Planned]:
        """Tell each stream how its commit went; return those to acknowledge.

        A failed commit's appends fail now; a written one's chunks are
        published, and its appends wait for `CommittingStream.acknowledge`.
        """
        published: list[_Planned] = []
        stats = self._stats
        for stream, commit in commits:
            error = errors.get(id(commit))
            if error is not None:
                stream.commit_failed(commit, error)
                continue
            if not stream.commit_written(commit):
                continue
            stats.appends += len(commit.appends)
            stats.chunks += sum(len(write.chunks) for write in commit.writes)
            stats.messages += sum(len(append.messages) for append in commit.appends)
            if synced:
                stats.synced_appends += len(commit.appends)
            published.append((stream, commit))
        return published

    def _finish(
        self, commits: list[_Planned], errors: dict[int, BaseException], *, synced: bool
    ) -> None:
        """Tell each stream how its commit went and acknowledge; then commit what queued."""
        for stream, commit in self._publish(commits, errors, synced=synced):
            stream.acknowledge(commit)
        self._next()

    def _next(self) -> None:
        """Commit what queued meanwhile (on the next turn), or tell the waiters it is idle."""
        if self._pending or self._sync_due:
            # On the next turn, not here: appends made by the callbacks that
            # just ran (and anything else this turn) join it, and the stack
            # stays flat.
            self._schedule()
        elif self._idle():
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def _arm_sync_timer(self) -> None:
        """Under ``INTERVAL``, ask for a sync-only commit once the interval has passed."""
        if self._sync_timer is None or not self._sync_timer.active():
            delay = max(0.0, self._last_sync + self._interval - self._clock.seconds())
            self._sync_timer = self._clock.callLater(delay, self._sync_now)

    def _sync_now(self) -> None:
        """The interval has passed with unsynced writes: sync them."""
        self._sync_timer = None
        if self._unsynced:
            self._sync_due = True
            self._schedule()
