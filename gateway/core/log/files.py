"""The writer thread's side of segment files: the active segment's open files, and a commit.

`SegmentWriter` holds a stream's active segment and its index open; it is
used only from the writer thread (and at start-up, and on the reactor thread
while the writer thread is idle: `gateway.core.log.writer`). `write_stream`
is what a commit does to one stream's files: it encodes the chunks the
reactor thread planned (`gateway.core.log.segment`), writes them and their
index records, and fsyncs as the policy says.

A commit written on the reactor thread (small, under fsync ``ALWAYS``:
`gateway.core.log.writer`) writes zeros ahead of the active segment's data
(`PREALLOCATE_BYTES` at a time) when it reaches past the last ones, so that the
commits after overwrite blocks the file already has. An fsync of a file that
grew must also commit the file system's journal (its new size and blocks); of
one overwritten in place, only the data. On this project's machines (ext4), an
fdatasync after a 3 KB commit (and its index record) took 0.23 ms at the median
appending, 0.155 ms overwriting zeros; 0.26 against 0.175 ms on average, the
commits that write the next zeros included (docs/performance.rst). Commits
through the writer thread come from a busy gateway: they write none, since a
quicker fsync there only makes the next commits smaller, and each costs the
reactor as much (with zeros for every commit, a QMQP durable route at full
speed made a third to a half more commits, lost a tenth of its rate and spent
1.5 µs more CPU a message). The zeros past the data are never read: readers go
by the index, recovery cuts a tail of zeros off quietly, and a segment is cut
back to its data when the writer closes it or rolls away from it.

A commit whose writing fails is taken back before it is reported: the
segment and index are cut back to their committed ends, a segment the commit
created is removed, and the writer is left on the segment it started on, so
that what was committed before stays valid and the next commit starts where
this one did (`CommitWriteError` says whether that worked, and how much
space the file system has left).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from gateway.codecs.osiris import (
    FILE_HEADER_BYTES,
    INDEX_HEADER,
    SEGMENT_HEADER,
    encode_chunk,
    index_file_name,
    pack_index_record,
    segment_file_name,
)
from gateway.core.log.directory import fsync_directory
from gateway.core.log.segment import SegmentWrite

__all__ = [
    "EPOCH",
    "FULL_ERRNOS",
    "PREALLOCATE_BYTES",
    "CommitWriteError",
    "SegmentWriter",
    "WriteSegment",
    "pwrite_all",
    "roll_back",
    "write_stream",
]


EPOCH: Final = 1
"""A single node's writer epoch."""

FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Errors of a file system without room (or of a quota): writing may work again later."""

_datasync: Final[Callable[[int], None]] = getattr(os, "fdatasync", os.fsync)

PREALLOCATE_BYTES: Final = 128 * 1024
"""Zeros written ahead of the active segment's data at a time (module docstring). The commit
that writes them fsyncs them too, on the reactor thread: 1 MiB at a time took about 1 ms
(against 0.15 for the commits between), ten such waits a second for a QMQP durable route at
10,000 messages a second; 128 KiB took 0.35 ms, and the commits averaged the same (0.18 ms,
the zeros' commits included)."""

WriteSegment = Callable[[int, bytes, int], None]
"""Writes all of ``data`` to file descriptor ``fd`` at ``position``: how chunks reach
a segment file (a seam for tests that count or hold writes)."""


class CommitWriteError(Exception):
    """A stream's share of a commit could not be written (raised in the writer thread).

    Args:
        cause: The error of the write (its ``filename`` names the file).
        rolled_back: What the commit wrote was taken back: both files end
            where they did before it, and the writer is on its segment again.
        synced: The error came from an fsync, after which a file's contents
            cannot be trusted (only a reopen, with recovery, can).
        free_bytes: Bytes the file system had free for us after the rollback
            (``statvfs``), None if unknown.
        total_bytes: Its size, None if unknown.
    """

    def __init__(
        self,
        cause: OSError,
        *,
        rolled_back: bool,
        synced: bool = False,
        free_bytes: int | None = None,
        total_bytes: int | None = None,
    ) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.rolled_back = rolled_back
        self.synced = synced
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes

    @property
    def path(self) -> str:
        """The file whose write failed ("" if unknown)."""
        return "" if self.cause.filename is None else os.fsdecode(self.cause.filename)

    @property
    def space_ran_out(self) -> bool:
        """The file system (or a quota) was full, and the commit was taken back cleanly.

        Then the stream is as it was before the commit, and writing can
        resume once there is room; any other failure leaves it broken.
        """
        return self.rolled_back and not self.synced and self.cause.errno in FULL_ERRNOS


def _named(error: OSError, path: Path) -> OSError:
    """``error`` with ``path`` as its file name, unless it names one already."""
    if error.filename is None:
        error.filename = str(path)
    return error


def pwrite_all(fd: int, data: bytes, position: int) -> None:
    """Write all of ``data`` at ``position``, looping over short writes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written


class SegmentWriter:
    """The open files of a stream's active segment, for one thread at a time.

    The writer thread's, or the reactor thread's while the writer thread is
    idle with nothing queued (`gateway.core.log.writer`, small commits).

    Args:
        directory: The stream's directory.
        write: How chunks reach the segment file (`pwrite_all`, or a test double).
    """

    def __init__(self, directory: Path, write: WriteSegment) -> None:
        self.directory = directory
        self._write = write
        self._segment_fd: int | None = None
        self._index_fd: int | None = None
        self.first_id: int | None = None
        self._sync_seconds: list[float] = []
        self._end = 0
        """Where the open segment's data ends."""
        self._allocated = 0
        """The open segment file's size: its data, then the zeros written ahead of it."""

    @property
    def ahead_bytes(self) -> int:
        """Zeros the open segment file holds past its data (read from any thread: a gauge).

        Read while the writer thread writes, its two ends may be a write apart.
        """
        return max(0, self._allocated - self._end)

    def segment_path(self, first_id: int | None = None) -> Path:
        """The segment file ``first_id`` (the open one by default)."""
        first_id = self.first_id if first_id is None else first_id
        return self.directory / segment_file_name(first_id or 0)

    def index_path(self, first_id: int | None = None) -> Path:
        """The index file ``first_id`` (the open one by default)."""
        first_id = self.first_id if first_id is None else first_id
        return self.directory / index_file_name(first_id or 0)

    def open_existing(self, first_id: int) -> None:
        """Open the (recovered) segment ``first_id`` for writing."""
        self.close()
        self._segment_fd = os.open(self.segment_path(first_id), os.O_RDWR)
        self._index_fd = os.open(self.index_path(first_id), os.O_RDWR)
        self.first_id = first_id
        # Recovery has cut off any zeros a crash left past the data.
        self._end = self._allocated = os.fstat(self._segment_fd).st_size

    def create(self, first_id: int, *, sync_directory: bool) -> None:
        """Create segment ``first_id`` (and its index) with their headers, and open them."""
        self.close()
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self._segment_fd = os.open(self.segment_path(first_id), flags, 0o644)
        self._index_fd = os.open(self.index_path(first_id), flags, 0o644)
        self.first_id = first_id
        try:
            pwrite_all(self._segment_fd, SEGMENT_HEADER, 0)
        except OSError as exc:
            raise _named(exc, self.segment_path()) from None
        try:
            pwrite_all(self._index_fd, INDEX_HEADER, 0)
        except OSError as exc:
            raise _named(exc, self.index_path()) from None
        self._end = self._allocated = FILE_HEADER_BYTES
        if sync_directory:
            _datasync(self._segment_fd)
            fsync_directory(self.directory)

    def write(
        self, position: int, data: bytes, index_position: int, index_data: bytes, *, ahead: bool
    ) -> None:
        """Write chunks at ``position``, then their index records.

        With ``ahead``, a write that reaches past the zeros written ahead of
        the data writes the next (module docstring).

        Raises:
            OSError: A write failed; its ``filename`` names the file.
        """
        if self._segment_fd is None or self._index_fd is None:
            raise OSError(f"no segment open for writing in {self.directory}")
        try:
            self._write(self._segment_fd, data, position)
        except OSError as exc:
            raise _named(exc, self.segment_path()) from None
        end = position + len(data)
        self._end = max(self._end, end)
        if end > self._allocated:
            self._allocated = end
            if ahead:
                self._zero_ahead(self._segment_fd)
        try:
            pwrite_all(self._index_fd, index_data, index_position)
        except OSError as exc:
            raise _named(exc, self.index_path()) from None

    def _zero_ahead(self, fd: int) -> None:
        """Write zeros past the data, for the next commits to overwrite (module docstring).

        Best effort: where they cannot be written (the file system is full),
        the file is cut back to its data, and the next write tries again.
        """
        start = self._allocated
        try:
            pwrite_all(fd, bytes(PREALLOCATE_BYTES), start)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            return
        self._allocated = start + PREALLOCATE_BYTES

    def sync(self) -> None:
        """Flush the segment file to disk (the index can be rebuilt, so it is not).

        Its duration is kept for `take_sync_seconds`.

        Raises:
            OSError: The fsync failed; its ``filename`` names the file.
        """
        if self._segment_fd is not None:
            started = time.perf_counter()
            try:
                _datasync(self._segment_fd)
            except OSError as exc:
                raise _named(exc, self.segment_path()) from None
            self._sync_seconds.append(time.perf_counter() - started)

    def take_sync_seconds(self) -> list[float]:
        """The durations of the fsyncs `sync` made since the last call (writer thread)."""
        taken, self._sync_seconds = self._sync_seconds, []
        return taken

    def truncate(self, size: int, index_size: int) -> None:
        """Cut the open segment and index back to these sizes (taking back a failed write).

        Truncating frees blocks, so it works on a full file system too.
        """
        if self._segment_fd is None or self._index_fd is None:
            raise OSError(f"no segment open for writing in {self.directory}")
        os.ftruncate(self._segment_fd, size)
        self._end = self._allocated = size
        os.ftruncate(self._index_fd, index_size)

    def discard(self, first_ids: Sequence[int], *, sync_directory: bool) -> None:
        """Remove segments (and their indexes) that a failed commit created."""
        for first_id in first_ids:
            if first_id == self.first_id:
                self.close()
            self.segment_path(first_id).unlink(missing_ok=True)
            self.index_path(first_id).unlink(missing_ok=True)
        if first_ids and sync_directory:
            fsync_directory(self.directory)

    def close(self) -> None:
        """Close the open files, if any, the segment cut back to its data."""
        if self._segment_fd is not None and self._allocated > self._end:
            # Best effort: recovery cuts off zeros left behind too.
            with contextlib.suppress(OSError):
                os.ftruncate(self._segment_fd, self._end)
        self._end = self._allocated = 0
        for fd in (self._segment_fd, self._index_fd):
            if fd is not None:
                os.close(fd)
        self._segment_fd = self._index_fd = None
        self.first_id = None


def write_stream(
    writer: SegmentWriter,
    writes: Sequence[SegmentWrite],
    *,
    sync: bool,
    sync_rolls: bool,
    ahead: bool = False,
) -> int:
    """Encode and write one stream's share of a commit: runs in the writer thread.

    Each `SegmentWrite` becomes one write of its chunks and one of their
    index records. If anything fails, what the commit wrote is taken back
    (`roll_back`) before the error is raised.

    Args:
        writer: The stream's open files.
        writes: What to write, in order.
        sync: Fsync the active segment once everything is written.
        sync_rolls: Fsync a segment before rolling away from it, and the
            directory after creating a file (false only under NEVER).
        ahead: Write zeros ahead of the data when past the last ones (a
            commit on the reactor thread: module docstring).

    Returns:
        How many segment writes were made.

    Raises:
        CommitWriteError: A write or fsync failed; it says whether the
            stream's files are as they were before the commit.
    """
    started_on = writer.first_id
    try:
        for write in writes:
            if write.create:
                if sync_rolls:
                    _sync(writer)
                writer.create(write.first_id, sync_directory=sync_rolls)
            _write_chunks(writer, write, ahead)
        if sync:
            _sync(writer)
    except _SyncError as exc:
        # After a failed fsync the kernel may have dropped dirty pages: the
        # files cannot be trusted until recovery reads them again.
        roll_back(writer, writes, started_on, sync_directory=sync_rolls)
        raise CommitWriteError(exc.cause, rolled_back=False, synced=True) from exc.cause
    except OSError as exc:
        rolled_back = roll_back(writer, writes, started_on, sync_directory=sync_rolls)
        free_bytes = total_bytes = None
        with contextlib.suppress(OSError):
            usage = os.statvfs(writer.directory)
            free_bytes = usage.f_bavail * usage.f_frsize
            total_bytes = usage.f_blocks * usage.f_frsize
        raise CommitWriteError(
            exc, rolled_back=rolled_back, free_bytes=free_bytes, total_bytes=total_bytes
        ) from exc
    return len(writes)


class _SyncError(Exception):
    """An fsync failed (kept apart from write errors, which can be taken back)."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _sync(writer: SegmentWriter) -> None:
    """Fsync the writer's segment; a failure becomes `_SyncError`."""
    try:
        writer.sync()
    except OSError as exc:
        raise _SyncError(exc) from exc


def _write_chunks(writer: SegmentWriter, write: SegmentWrite, ahead: bool) -> None:
    """Encode one `SegmentWrite`'s chunks and write them and their index records."""
    encoded = [
        encode_chunk(
            chunk.messages,
            first_offset=chunk.chunk_id,
            timestamp_ms=chunk.timestamp,
            epoch=EPOCH,
            chunk_type=chunk.chunk_type,
            trailer=chunk.trailer,
            records=chunk.records,
        )
        for chunk in write.chunks
    ]
    data = encoded[0] if len(encoded) == 1 else b"".join(encoded)
    expected = sum(chunk.size for chunk in write.chunks)
    if len(data) != expected:
        raise RuntimeError(f"planned {expected} bytes of chunks, encoded {len(data)}")
    index = b"".join(
        pack_index_record(chunk.chunk_id, chunk.timestamp, EPOCH, chunk.position, chunk.chunk_type)
        for chunk in write.chunks
    )
    writer.write(write.position, data, write.index_position, index, ahead=ahead)


def roll_back(
    writer: SegmentWriter,
    writes: Sequence[SegmentWrite],
    started_on: int | None,
    *,
    sync_directory: bool,
) -> bool:
    """Take back a failed commit's writes: runs in the writer thread.

    Segments the commit created are removed; the segment it started on is
    reopened if the writer rolled away from it, and cut back (with its
    index) to where the commit's first write began. Bytes past a committed
    end are never read, but left there they would make the next, shorter,
    commit end in garbage, and a half-written chunk is what recovery
    reports as damage.

    Args:
        writer: The stream's files.
        writes: The commit's writes.
        started_on: The writer's segment before the commit (None: none was open).
        sync_directory: Fsync the directory after removing files.

    Returns:
        Whether the files are as they were before the commit.
    """
    try:
        created = [write.first_id for write in writes if write.create]
        writer.discard(created, sync_directory=sync_directory)
        if started_on is None:
            return not writes or writes[0].create
        if writer.first_id != started_on:
            writer.open_existing(started_on)
        if writes and not writes[0].create:
            writer.truncate(writes[0].position, writes[0].index_position)
    except OSError:
        return False
    return True
