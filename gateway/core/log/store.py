"""The log store: a directory of streams, their recovery, writer thread and retention.

Layout, the osiris one (docs/stream-protocol-notes.md, 10.1)::

    <directory>/<escaped stream name>/
        meta.json                         name and retention settings
        00000000000000000000.segment      chunks from id 0
        00000000000000000000.index
        00000000000000012345.segment      the next segment: starts at chunk 12345
        ...

`LogStore.open` recovers every stream synchronously, at start-up. After
that nothing touches the disk on the reactor thread except bounded reads:
creating and deleting streams, removing retired segments and every commit
run, in order, in the store's one writer thread.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.log.directory import (
    DELETING_SUFFIX,
    META_FILE,
    ORPHAN_SUFFIX,
    decode_meta,
    directory_name,
    fsync_directory,
    write_meta,
)
from gateway.core.log.files import FULL_ERRNOS, SegmentWriter, WriteSegment, pwrite_all
from gateway.core.log.recovery import recover_stream
from gateway.core.log.segment import Segment
from gateway.core.log.stream import StreamLog
from gateway.core.log.thread import WriterThread
from gateway.core.log.tracking import TrackingState
from gateway.core.log.values import (
    CommitStats,
    FsyncPolicy,
    ILogReactor,
    LogClosedError,
    LogError,
    LogWriteError,
    Retention,
    StreamExistsError,
    StreamMissingError,
)
from gateway.core.log.writer import GroupCommitter

__all__ = ["DEFAULT_RETENTION_INTERVAL_SECONDS", "LogStore"]

DEFAULT_RETENTION_INTERVAL_SECONDS = 60.0
"""How often retention runs by itself."""

_T = TypeVar("_T")


def _create_stream_files(
    directory: Path, name: str, retention: Retention, writer: SegmentWriter, *, sync: bool
) -> None:
    """Create a stream's directory, first segment and ``meta.json`` (writer thread)."""
    directory.mkdir()
    writer.create(0, sync_directory=sync)
    write_meta(directory, name, retention, sync=sync)
    if sync:
        fsync_directory(directory.parent)


def _delete_stream_files(directory: Path, writer: SegmentWriter, *, sync: bool) -> None:
    """Remove a stream's directory: renamed first, so a crash cannot leave half a stream."""
    writer.close()
    if not directory.is_dir():
        return
    doomed = directory.with_name(directory.name + DELETING_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed)
    try:
        directory.rename(doomed)
    except FileNotFoundError:
        return
    if sync:
        fsync_directory(directory.parent)
    shutil.rmtree(doomed)


def _remove_segments(segments: Sequence[Segment], *, sync: bool) -> None:
    """Delete retired segment files (writer thread)."""
    directories = set()
    for segment in segments:
        segment.segment_path.unlink(missing_ok=True)
        segment.index_path.unlink(missing_ok=True)
        directories.add(segment.segment_path.parent)
    if sync:
        for directory in directories:
            if directory.exists():
                fsync_directory(directory)


def _close_writers(writers: Sequence[SegmentWriter]) -> None:
    """Close every stream's open files (writer thread)."""
    for writer in writers:
        writer.close()


class LogStore:
    """Durable streams in a directory, written by group commit in one writer thread.

    Args:
        directory: Where the streams live (created if missing).
        reactor: Schedules commits and receives the writer thread's results.
        fsync: When commits reach the disk, and so when appends are acknowledged.
        fsync_interval_seconds: Longest time between fsyncs under ``INTERVAL``.
        default_retention: Retention of streams created without their own.
        clock: Commit timestamps, retention ages and timers (the reactor if None).
        retention_interval_seconds: How often retention runs by itself.
        write_segment: How bytes reach a file: a seam for tests that count writes.
        inline_max_bytes: Under ``ALWAYS``, the largest commit written on the
            reactor thread while the writer thread is idle
            (`gateway.core.log.writer`); 0: none.
    """

    _log = Logger()

    def __init__(
        self,
        directory: Path,
        reactor: ILogReactor,
        *,
        fsync: FsyncPolicy = FsyncPolicy.ALWAYS,
        fsync_interval_seconds: float = 0.2,
        default_retention: Retention = Retention(),  # noqa: B008 (frozen, so shared safely)
        clock: IReactorTime | None = None,
        retention_interval_seconds: float = DEFAULT_RETENTION_INTERVAL_SECONDS,
        write_segment: WriteSegment = pwrite_all,
        inline_max_bytes: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.default_retention = default_retention
        self.stats = CommitStats()
        self._reactor = reactor
        self._clock: IReactorTime = reactor if clock is None else clock
        self._retention_interval = retention_interval_seconds
        self._write_segment = write_segment
        self._thread = WriterThread(reactor, f"log-writer {self.directory}")
        self._committer = GroupCommitter(
            reactor,
            self._clock,
            self._thread,
            policy=fsync,
            interval_seconds=fsync_interval_seconds,
            stats=self.stats,
            inline_max_bytes=inline_max_bytes,
        )
        self._streams: dict[str, StreamLog] = {}
        self._retention = LoopingCall(self._retention_tick)
        self._retention.clock = self._clock
        self._state = "new"
        self._closed: Deferred[None] | None = None
        self._shutdown_trigger: object | None = None

    @property
    def clock(self) -> IReactorTime:
        """The clock the store keeps time with (for its users' timers and rate limits)."""
        return self._clock

    # Life cycle.

    def open(self) -> None:
        """Recover every stream and start the writer thread (blocking: at start-up only).

        Raises:
            LogError: The store was opened before.
            OSError: The directory or a stream's files cannot be read or repaired.
        """
        if self._state != "new":
            raise LogError("a log store opens once")
        self.directory.mkdir(parents=True, exist_ok=True)
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name.endswith(DELETING_SUFFIX):
                self._log.info("Finishing the deletion of {path}", path=entry.path)
                shutil.rmtree(entry.path)
            elif "." not in entry.name:
                self._open_stream(Path(entry.path))
        self._thread.start()
        self._state = "open"
        self._retention.start(self._retention_interval, now=False)
        if IReactorCore.providedBy(self._reactor):
            core = cast(IReactorCore, self._reactor)
            # "during", not "before": the owner's services stop "before"
            # (twistd), and the last writes they make (the outcome records'
            # final flush) must find the store still open.
            self._shutdown_trigger = core.addSystemEventTrigger(
                "during", "shutdown", self._reactor_stopping
            )

    def _reactor_stopping(self) -> Deferred[None]:
        """Close the store as the reactor stops, if its owner has not (the trigger fires once)."""
        self._shutdown_trigger = None
        return self.close()

    def _open_stream(self, path: Path) -> None:
        """Recover one stream directory, or set it aside if it is not one."""
        try:
            name, retention = decode_meta((path / META_FILE).read_bytes())
        except (OSError, ValueError) as exc:
            self._set_aside(path, str(exc))
            return
        if name in self._streams:
            self._set_aside(path, f"a second directory for stream {name!r}")
            return
        segments, tracking = recover_stream(path)
        writer = SegmentWriter(path, self._write_segment)
        writer.open_existing(segments[-1].first_id)
        stream = StreamLog(name, path, retention, segments, tracking, writer, self._committer)
        self._streams[name] = stream
        self._log.info(
            "Opened stream {stream}: offsets {first} to {next}, {segments} segments",
            stream=name,
            first=stream.first_offset,
            next=stream.next_offset,
            segments=len(segments),
        )

    def _set_aside(self, path: Path, reason: str) -> None:
        """Rename a directory that is not a readable stream, keeping its data."""
        target = path.with_name(path.name + ORPHAN_SUFFIX)
        number = 1
        while target.exists():
            number += 1
            target = path.with_name(f"{path.name}{ORPHAN_SUFFIX}{number}")
        self._log.warn(
            "Setting {path} aside as {target}: {reason}",
            path=str(path),
            target=str(target),
            reason=reason,
        )
        path.rename(target)

    def close(self) -> Deferred[None]:
        """Commit what is queued, fsync (unless ``NEVER``), stop the writer thread.

        Runs by itself before the reactor shuts down, if the owner has not.

        New appends fail with `LogClosedError` from now on; tailing readers'
        `StreamLog.wait_for` Deferreds fail with it once the store is closed.
        """
        if self._closed is None:
            if self._state != "open":
                self._state = "closed"
                self._closed = succeed(None)
            else:
                self._closed = Deferred.fromCoroutine(self._close())
        return self._closed

    async def _close(self) -> None:
        """Drain the group commit and the writer thread, then stop it."""
        self._state = "closing"
        if self._shutdown_trigger is not None:
            cast(IReactorCore, self._reactor).removeSystemEventTrigger(self._shutdown_trigger)
            self._shutdown_trigger = None
        if self._retention.running:
            self._retention.stop()
        closed = LogClosedError("the log store is closed")
        for stream in self._streams.values():
            stream.refuse(closed)
        await self._committer.drain()
        writers = [stream.writer for stream in self._streams.values()]
        try:
            await self._in_writer(_close_writers, writers)
        finally:
            for stream in self._streams.values():
                stream.shut(closed)
            self._thread.stop()
            self._state = "closed"

    def _check_open(self) -> None:
        """Refuse changes unless the store is open."""
        if self._state != "open":
            raise LogClosedError(f"the log store is {self._state}")

    def _in_writer(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> Deferred[_T]:
        """Run a job in the writer thread, after everything submitted before it."""
        return self._thread.submit(function, *args, **kwargs)

    # Streams.

    def names(self) -> list[str]:
        """The streams' names, sorted."""
        return sorted(self._streams)

    def get(self, name: str) -> StreamLog | None:
        """The stream of that name, if any."""
        return self._streams.get(name)

    def create(self, name: str, retention: Retention | None = None) -> StreamLog:
        """Create a stream; its files are made in the writer thread, before its first commit.

        Raises:
            StreamExistsError: It exists already.
            ValueError: The name is empty.
            LogClosedError: The store is not open.
        """
        self._check_open()
        if not name:
            raise ValueError("a stream needs a name")
        if name in self._streams:
            raise StreamExistsError(f"stream {name!r} exists")
        retention = self.default_retention if retention is None else retention
        path = self.directory / directory_name(name)
        writer = SegmentWriter(path, self._write_segment)
        stream = StreamLog(
            name, path, retention, [Segment(path, 0)], TrackingState(), writer, self._committer
        )
        self._streams[name] = stream
        created = self._in_writer(
            _create_stream_files,
            path,
            name,
            retention,
            writer,
            sync=self.fsync is not FsyncPolicy.NEVER,
        )

        def failed(failure: Failure) -> None:
            error = failure.value
            if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
                self._not_created(stream, error)
                return
            self._log.failure("Creating stream {stream} failed", failure, stream=name)
            stream.shut(LogWriteError(f"creating stream {name!r} failed: {failure.value}"))

        created.addErrback(failed)
        return stream

    def _not_created(self, stream: StreamLog, error: OSError) -> None:
        """A stream's files did not fit on the disk: forget it, so it can be created later.

        What waits on it fails; its partial directory is removed (in the
        writer thread, so before any later attempt to create it again).
        """
        name = stream.name
        code = errno.errorcode.get(error.errno or 0, str(error.errno))
        why = f"the file system is full ({code}) at {error.filename}"
        self._log.warn(
            "Creating stream {stream} failed: {why}; it can be created again once there is room",
            stream=name,
            why=why,
        )
        if self._streams.get(name) is stream:
            del self._streams[name]
        self._committer.forget(stream)
        stream.shut(
            LogWriteError(
                f"creating stream {name!r} failed: {why}; it can be created again"
                " once there is room"
            )
        )
        if self._state != "open":
            return  # the next open sets a directory without meta.json aside
        removed = self._in_writer(
            _delete_stream_files,
            stream.directory,
            stream.writer,
            sync=self.fsync is not FsyncPolicy.NEVER,
        )
        removed.addErrback(
            lambda failure: self._log.failure(
                "Removing what was made of stream {stream} failed", failure, stream=name
            )
        )

    def delete(self, name: str) -> Deferred[None]:
        """Delete a stream: pending appends and waiting readers fail at once.

        Returns:
            A Deferred firing once its files are gone.

        Raises:
            StreamMissingError: No such stream.
            LogClosedError: The store is not open.
        """
        self._check_open()
        stream = self._streams.pop(name, None)
        if stream is None:
            raise StreamMissingError(f"no stream {name!r}")
        stream.shut(StreamMissingError(f"stream {name!r} was deleted"))
        self._committer.forget(stream)
        self._log.info("Deleting stream {stream}", stream=name)
        return self._in_writer(
            _delete_stream_files,
            stream.directory,
            stream.writer,
            sync=self.fsync is not FsyncPolicy.NEVER,
        )

    # Retention.

    def apply_retention(self) -> Deferred[int]:
        """Retire old segments of every stream now (it also runs on a timer).

        Returns:
            A Deferred firing with how many segments were removed, once their
            files are gone.
        """
        if self._state != "open":
            return succeed(0)
        now_ms = int(self._clock.seconds() * 1000)
        retired: list[Segment] = []
        for stream in self._streams.values():
            dropped = stream.retire_segments(now_ms)
            if dropped:
                self._log.info(
                    "Retention removes {count} segments of {stream}; it now starts at {first}",
                    count=len(dropped),
                    stream=stream.name,
                    first=stream.first_offset,
                )
                retired.extend(dropped)
        if not retired:
            return succeed(0)
        removed = self._in_writer(
            _remove_segments, retired, sync=self.fsync is not FsyncPolicy.NEVER
        )
        return removed.addCallback(lambda _: len(retired))

    def _retention_tick(self) -> Deferred[None]:
        """The timer's retention run; a failure is logged and the timer goes on."""

        def failed(failure: Failure) -> None:
            self._log.failure("Applying retention failed", failure)

        return self.apply_retention().addCallbacks(lambda _: None, failed)
