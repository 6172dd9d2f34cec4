"""Values and errors of the embedded log: policies, retention, results, the reactor it needs."""

from __future__ import annotations

import enum
from bisect import bisect_left
from typing import Final

import attrs
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime

from gateway.codecs.osiris import ChunkHeader

__all__ = [
    "DEFAULT_MAX_SEGMENT_BYTES",
    "DURATION_BUCKETS_SECONDS",
    "MAX_SEGMENT_BYTES_LIMIT",
    "AppendResult",
    "ChunkSpan",
    "CommitStats",
    "Durations",
    "FsyncPolicy",
    "ILogReactor",
    "LogClosedError",
    "LogError",
    "LogFullError",
    "LogWriteError",
    "Retention",
    "StoredChunk",
    "StreamExistsError",
    "StreamMissingError",
]

DEFAULT_MAX_SEGMENT_BYTES: Final = 64 * 1024 * 1024
"""Roll to a new segment once the active one holds 64 MiB (osiris uses 500 MB)."""
MAX_SEGMENT_BYTES_LIMIT: Final = 2**31
"""Index records hold a chunk's position as a u32; segments roll well before that."""
DURATION_BUCKETS_SECONDS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the commit and fsync histograms: a commit without fsync on a fast
disk takes tens of microseconds, an fsync on an SSD about a millisecond, on a
spinning or network disk tens of milliseconds, and a stalled one seconds."""


class ILogReactor(IReactorTime, IReactorFromThreads):
    """What the log needs of its reactor: timers, and results from its writer thread."""


class FsyncPolicy(enum.Enum):
    """When a commit reaches the disk, and so when an append is acknowledged.

    ``ALWAYS``: every commit is fsynced before its appends are acknowledged (a
    commit of stored offsets alone is fsynced with the next one that is).
    ``INTERVAL``: acknowledged once written; fsync at most every interval.
    ``NEVER``: written and acknowledged; the operating system flushes (as a
    single RabbitMQ node does: osiris never fsyncs).
    """

    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


def _segment_bytes(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    """Accept a segment size that index positions can address."""
    if not 1 <= value <= MAX_SEGMENT_BYTES_LIMIT:
        raise ValueError(f"max_segment_bytes must be 1..{MAX_SEGMENT_BYTES_LIMIT}, not {value}")


@attrs.frozen
class Retention:
    """How much of a stream is kept; whole segments are deleted, never the active one.

    Attributes:
        max_bytes: Delete the oldest segments while all of them together hold more.
        max_age_seconds: Delete segments whose newest chunk is older than this.
        max_segment_bytes: Roll to a new segment once the active one holds this much.
    """

    max_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    max_age_seconds: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    max_segment_bytes: int = attrs.field(
        default=DEFAULT_MAX_SEGMENT_BYTES, validator=_segment_bytes
    )


@attrs.frozen
class AppendResult:
    """What became of one append.

    Attributes:
        first_offset: Offset of the first message stored, None if none was.
        chunk_id: Id of the chunk holding that message, None if none was stored.
        stored: Messages written, in order, from ``first_offset`` on.
        duplicates: Messages not written because their publishing id was not
            above the reference's last one; they are acknowledged all the same.
        spans: Where the stored messages went: one ``(first offset, offsets
            taken)`` per chunk, in order. Within a chunk offsets are
            consecutive; an append that fills a chunk goes on in the next
            user chunk, which may not start right after it (a segment roll
            puts a tracking snapshot, one offset, in between). Appends of
            one group commit share chunks, so a chunk may hold others too.
    """

    first_offset: int | None
    chunk_id: int | None
    stored: int
    duplicates: int
    spans: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class StoredChunk:
    """One committed user chunk, as a consumer reads it.

    Attributes:
        chunk_id: The chunk's id, the offset of its first record.
        next_chunk_id: Where the next read starts: ``chunk_id`` plus its records.
        header: The chunk's header.
        payload: The 48-byte header as stored, then the data entries only (no
            bloom, no trailer): exactly what a Deliver frame carries after the
            subscription id.
    """

    chunk_id: int
    next_chunk_id: int
    header: ChunkHeader
    payload: bytes


@attrs.frozen
class ChunkSpan:
    """Where a committed user chunk's Deliver payload lies in its segment file.

    The bytes ``length`` from ``position`` in ``fd`` are exactly a
    `StoredChunk`'s ``payload``: the header, then the data entries (the
    chunk has no bloom filter; its trailer comes after them). ``fd`` is the
    stream's read descriptor, open until the reactor's next turn at least:
    use it at once (``os.sendfile``), never keep it.

    Attributes:
        chunk_id: The chunk's id, the offset of its first record.
        next_chunk_id: Where the next read starts: ``chunk_id`` plus its records.
        records: The records it holds.
        fd: The segment file's read descriptor.
        position: Where the chunk starts in the file.
        length: The payload's bytes.
    """

    chunk_id: int
    next_chunk_id: int
    records: int
    fd: int
    position: int
    length: int


@attrs.define
class Durations:
    """A histogram of durations as plain numbers, kept on the reactor thread.

    Attributes:
        counts: Observations per bucket of `DURATION_BUCKETS_SECONDS`, each
            counted once (not cumulative); the last bucket is above them all.
        total_seconds: The observations' sum.
    """

    counts: list[int] = attrs.field(factory=lambda: [0] * (len(DURATION_BUCKETS_SECONDS) + 1))
    total_seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration (a bucket holds what is at most its bound, as Prometheus says)."""
        self.counts[bisect_left(DURATION_BUCKETS_SECONDS, seconds)] += 1
        self.total_seconds += seconds


@attrs.define
class CommitStats:
    """Counters of the group commit, for metrics and the benchmark.

    Attributes:
        commits: Commit rounds that wrote something.
        synced_commits: Of those, the ones that fsynced before acknowledging.
        chunks: Chunks written (user and tracking).
        writes: Segment write calls.
        fsyncs: Segment fsync calls.
        appends: Appends acknowledged.
        synced_appends: Appends acknowledged by a commit that fsynced.
        messages: Messages stored.
        commit_seconds: How long commit rounds that wrote something took,
            from planning on the reactor thread to the writer thread's
            answer back there (encoding, writing, fsync as the policy says).
        fsync_seconds: How long each segment fsync of a commit took (those
            before a segment roll included).
        inline_commits: Of the commits, those written and fsynced on the
            reactor thread (small ones, `gateway.core.log.writer`).
    """

    commits: int = 0
    synced_commits: int = 0
    chunks: int = 0
    writes: int = 0
    fsyncs: int = 0
    appends: int = 0
    synced_appends: int = 0
    messages: int = 0
    commit_seconds: Durations = attrs.field(factory=Durations)
    fsync_seconds: Durations = attrs.field(factory=Durations)
    inline_commits: int = 0


class LogError(Exception):
    """Base of the log's errors."""


class StreamExistsError(LogError):
    """A stream of that name exists already."""


class StreamMissingError(LogError):
    """No stream of that name, or it was deleted while the operation was pending."""


class LogClosedError(LogError):
    """The store is closed (or closing)."""


class LogWriteError(LogError):
    """Writing a stream failed; it refuses appends until the store is reopened.

    Reopening recovers the segment files (torn chunks are cut off). The
    subclass `LogFullError` is the exception: it passes by itself.
    """


class LogFullError(LogWriteError):
    """The log's file system (or quota) is full: appends are refused for a while.

    What the failed commit wrote was taken back, so the stream is intact;
    it refuses appends for ``retry_seconds``, then tries again, and writing
    resumes by itself once there is room. Readers are not affected.

    Args:
        message: What happened, for operators and senders.
        stream: The stream's name.
        path: The file whose write failed.
        free_bytes: What the file system had free after the failure, if known.
        retry_seconds: How long the stream refuses appends before trying again.
    """

    def __init__(
        self,
        message: str,
        *,
        stream: str,
        path: str,
        free_bytes: int | None,
        retry_seconds: float,
    ) -> None:
        super().__init__(message)
        self.stream = stream
        self.path = path
        self.free_bytes = free_bytes
        self.retry_seconds = retry_seconds
