"""The embedded durable log: streams of osiris chunks with group commit.

Issue 4. `LogStore` keeps streams in a directory, in exactly the osiris
on-disk layout (`gateway.codecs.osiris`), recovers them at start-up, and
writes them from one writer thread by group commit: every append of a
reactor turn goes into one chunk per stream, one write and (per
`FsyncPolicy`) one fsync. `StreamLog` is one stream: appends with
publisher deduplication, stored consumer offsets, seeks and chunk reads
whose payload is exactly what a stream Deliver frame carries.
"""

from gateway.core.log.store import LogStore
from gateway.core.log.stream import OffsetSpec, StreamLog
from gateway.core.log.values import (
    AppendResult,
    ChunkSpan,
    CommitStats,
    FsyncPolicy,
    ILogReactor,
    LogClosedError,
    LogError,
    LogFullError,
    LogWriteError,
    Retention,
    StoredChunk,
    StreamExistsError,
    StreamMissingError,
)

__all__ = [
    "AppendResult",
    "ChunkSpan",
    "CommitStats",
    "FsyncPolicy",
    "ILogReactor",
    "LogClosedError",
    "LogError",
    "LogFullError",
    "LogStore",
    "LogWriteError",
    "OffsetSpec",
    "Retention",
    "StoredChunk",
    "StreamExistsError",
    "StreamLog",
    "StreamMissingError",
]
