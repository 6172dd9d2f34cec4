"""The embedded log and the durable routes' forwarders in /metrics, read at scrape time.

Nothing here runs on the durable path. The log counts as it commits, once
per commit and stream (`gateway.core.log.values.CommitStats`, `StreamLog`'s
``appends``, ``records`` and ``written_bytes``), and each forwarder once per
delivered batch (`LogForwarder`'s ``delivered``, ``retried`` and
``dead_lettered``); the collectors below turn those numbers, and what is
state (a forwarder's lag, a stream's files, the file system's free space),
into metric families when Prometheus scrapes. The lag comes from the
stream's in-memory index (`user_records_after`), so a scrape reads no file
and asks the kernel only for the file system's size (``statvfs``).

Labels are the stream (every stream of the log: clients' streams and the
gateway's own, one per durable route and the dead-letter ones) and the
durable route, both bounded by the configuration.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.core.log.segment import user_records_after
from gateway.core.log.values import DURATION_BUCKETS_SECONDS, Durations

if TYPE_CHECKING:
    from gateway.core.forwarder import LogForwarder
    from gateway.core.log import LogStore, StreamLog

__all__ = ["ForwarderCollector", "LogCollector", "disk_bytes", "forwarder_lag"]

_BOUNDS: Final = [repr(float(bound)) for bound in DURATION_BUCKETS_SECONDS] + ["+Inf"]


def disk_bytes(stream: StreamLog) -> int:
    """Bytes the stream's segment and index files hold, the zeros written ahead included."""
    held = sum(segment.size + segment.index_position() for segment in stream.segments)
    return held + stream.writer.ahead_bytes


def forwarder_lag(forwarder: LogForwarder) -> int:
    """Messages committed to the forwarder's stream that it has not finished delivering."""
    stream = forwarder.stream
    done = stream.query_offset(forwarder.reference)
    return user_records_after(stream.segments, -1 if done is None else done)


def _histogram(name: str, documentation: str, durations: Durations) -> HistogramMetricFamily:
    """A histogram family of one unlabelled `Durations`."""
    family = HistogramMetricFamily(name, documentation)
    cumulative = itertools.accumulate(durations.counts)
    family.add_metric([], list(zip(_BOUNDS, cumulative, strict=True)), durations.total_seconds)
    return family


class LogCollector(Collector):
    """The log store's streams, group commits and file system, read at scrape time.

    Args:
        store: The embedded log.
    """

    def __init__(self, store: LogStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        """The families of a scrape (see docs/operations.rst, "Metrics")."""
        store = self._store
        appends = CounterMetricFamily(
            "msggateway_log_appends", "Appends (batches) committed to a stream.", labels=["stream"]
        )
        messages = CounterMetricFamily(
            "msggateway_log_messages",
            "Messages (records) committed to a stream.",
            labels=["stream"],
        )
        written = CounterMetricFamily(
            "msggateway_log_written_bytes",
            "Bytes of chunks written to a stream's segments (headers and tracking included).",
            labels=["stream"],
        )
        disk = GaugeMetricFamily(
            "msggateway_log_disk_bytes",
            "Bytes a stream's segment and index files hold (zeros written ahead included).",
            labels=["stream"],
        )
        segments = GaugeMetricFamily(
            "msggateway_log_segments", "Segment files a stream keeps.", labels=["stream"]
        )
        for name in store.names():
            stream = store.get(name)
            if stream is None:
                continue
            appends.add_metric([name], stream.appends)
            messages.add_metric([name], stream.records)
            written.add_metric([name], stream.written_bytes)
            disk.add_metric([name], disk_bytes(stream))
            segments.add_metric([name], len(stream.segments))
        yield from (appends, messages, written, disk, segments)
        stats = store.stats
        yield _histogram(
            "msggateway_log_commit_seconds",
            "Time a group commit took, from planning to the writer thread's answer"
            " (encoding, writing, fsync as the policy says).",
            stats.commit_seconds,
        )
        yield _histogram(
            "msggateway_log_fsync_seconds",
            "Time each segment fsync of a commit took.",
            stats.fsync_seconds,
        )
        commits = CounterMetricFamily(
            "msggateway_log_commits",
            "Group commits that wrote something, by where they were written: the writer"
            " thread, or the main thread (small commits under fsync = always, while the"
            " writer thread is idle and fsyncs are quick).",
            labels=["thread"],
        )
        commits.add_metric(["writer"], stats.commits - stats.inline_commits)
        commits.add_metric(["main"], stats.inline_commits)
        yield commits
        yield from self._file_system()

    def _file_system(self) -> Iterator[Metric]:
        """Free and total bytes of the log's file system, if it can be asked."""
        try:
            usage = os.statvfs(self._store.directory)
        except OSError:
            return
        free = GaugeMetricFamily(
            "msggateway_log_filesystem_free_bytes",
            "Bytes free for the gateway on the log's file system (what a write may use).",
        )
        free.add_metric([], usage.f_bavail * usage.f_frsize)
        size = GaugeMetricFamily(
            "msggateway_log_filesystem_size_bytes", "Size of the log's file system in bytes."
        )
        size.add_metric([], usage.f_blocks * usage.f_frsize)
        yield from (free, size)


_COUNTS: Final = (
    ("delivered", "Messages a durable route's forwarder delivered (accepted)."),
    ("retried", "Refused messages a durable route's forwarder put back for another delivery."),
    ("dead_lettered", "Messages a durable route's forwarder moved to the dead-letter stream."),
)


class ForwarderCollector(Collector):
    """The durable routes' forwarders: lag, and delivered, retried and dead-lettered counts.

    A reload gives a route a new forwarder, whose counts start at zero: the
    counts of the one it replaces are carried over at the next scrape, so
    that the route's counters do not go down while the process lives (a
    forwarder replaced between two scrapes, by two reloads, is not seen).

    Args:
        forwarders: The durable routes' forwarders by route name (a live
            mapping, as `gateway.core.durable.DurableRoutes.forwarders`).
    """

    def __init__(self, forwarders: Mapping[str, LogForwarder]) -> None:
        self._forwarders = forwarders
        self._seen: dict[str, LogForwarder] = {}
        self._carried: dict[str, list[int]] = {}

    def collect(self) -> Iterator[Metric]:
        """The families of a scrape (see docs/operations.rst, "Metrics")."""
        lag = GaugeMetricFamily(
            "msggateway_forwarder_lag_messages",
            "Messages committed to a durable route's stream that its forwarder has not"
            " finished delivering.",
            labels=["route"],
        )
        counts = [
            CounterMetricFamily(
                f"msggateway_forwarder_{attribute}", documentation, labels=["route"]
            )
            for attribute, documentation in _COUNTS
        ]
        for route, forwarder in sorted(self._forwarders.items()):
            carried = self._carry_over(route, forwarder)
            lag.add_metric([route], forwarder_lag(forwarder))
            for family, (attribute, _doc), base in zip(counts, _COUNTS, carried, strict=True):
                family.add_metric([route], base + getattr(forwarder, attribute))
        yield lag
        yield from counts

    def _carry_over(self, route: str, forwarder: LogForwarder) -> list[int]:
        """The counts of the route's earlier forwarders (those a reload replaced)."""
        carried = self._carried.setdefault(route, [0] * len(_COUNTS))
        previous = self._seen.get(route)
        if previous is not forwarder:
            if previous is not None:
                for number, (attribute, _doc) in enumerate(_COUNTS):
                    carried[number] += getattr(previous, attribute)
            self._seen[route] = forwarder
        return carried
