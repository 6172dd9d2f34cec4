"""The embedded log and the durable routes' forwarders in /metrics (`gateway.logmetrics`).

A real log in a temporary directory on the real reactor (its commits come
back through it), scraped through a `GatewayMetrics` registry as Prometheus
would: the text format, parsed back. Forwarders run on a `Clock`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, deferLater

from gateway.codecs import osiris
from gateway.core.forwarder import ForwarderSettings, LogForwarder
from gateway.core.log import FsyncPolicy, LogStore, Retention, StreamLog
from gateway.core.log.segment import user_records_after
from gateway.core.log.values import DURATION_BUCKETS_SECONDS, Durations
from gateway.core.message import Message, Outcome
from gateway.metrics import GatewayMetrics


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


async def next_turn() -> None:
    """Let the reactor run one turn (a stored offset is committed on the next)."""
    await deferLater(_reactor(), 0, lambda: None)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    """An opened log store (fsync always), closed after the test."""
    log = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.ALWAYS)
    log.open()
    yield log
    pytest_twisted.blockon(log.close())


def scrape(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape in the text format, by name and sorted labels."""
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    """One sample's value."""
    return samples[(name, tuple(sorted(labels.items())))]


def files_bytes(directory: Path) -> int:
    """Bytes of a stream directory's segment and index files, as the file system says."""
    return sum(
        path.stat().st_size for path in directory.iterdir() if path.suffix in (".segment", ".index")
    )


def to_message(entry: bytes, offset: int, timestamp: float) -> Message:
    """A stored entry as a message whose id is its offset."""
    return Message(id=str(offset), address="a", body=entry, timestamp=timestamp)


def test_durations_count_a_bound_in_its_own_bucket() -> None:
    """A duration equal to a bound is in that bound's bucket (Prometheus' ``le``)."""
    durations = Durations()
    durations.observe(DURATION_BUCKETS_SECONDS[0])
    durations.observe(DURATION_BUCKETS_SECONDS[0] * 1.5)
    durations.observe(60.0)
    assert durations.counts[:2] == [1, 1]
    assert durations.counts[-1] == 1
    assert sum(durations.counts) == 3
    assert durations.total_seconds == pytest.approx(DURATION_BUCKETS_SECONDS[0] * 2.5 + 60.0)


@pytest_twisted.ensureDeferred
async def test_streams_commits_and_the_file_system_in_a_scrape(store: LogStore) -> None:
    """Appends, messages and bytes per stream; disk bytes as on disk; commit and fsync times."""
    metrics = GatewayMetrics()
    metrics.durable_log(store, {})
    orders = store.create("orders")
    store.create("empty")
    await orders.append([b"a", b"bb"])
    await orders.append([b"ccc"])
    samples = scrape(metrics)
    assert sample(samples, "msggateway_log_appends_total", stream="orders") == 2
    assert sample(samples, "msggateway_log_messages_total", stream="orders") == 3
    assert sample(samples, "msggateway_log_appends_total", stream="empty") == 0
    written = sample(samples, "msggateway_log_written_bytes_total", stream="orders")
    assert written == orders.segments[-1].size - osiris.FILE_HEADER_BYTES
    assert sample(samples, "msggateway_log_disk_bytes", stream="orders") == files_bytes(
        orders.directory
    )
    assert sample(samples, "msggateway_log_segments", stream="orders") == 1
    commits = sample(samples, "msggateway_log_commit_seconds_count")
    assert commits == store.stats.commits == 2
    assert sample(samples, "msggateway_log_commit_seconds_bucket", le="+Inf") == commits
    assert sample(samples, "msggateway_log_commit_seconds_sum") > 0
    assert sample(samples, "msggateway_log_fsync_seconds_count") == store.stats.fsyncs == 2
    assert sample(samples, "msggateway_log_fsync_seconds_sum") > 0
    assert sample(samples, "msggateway_log_commits_total", thread="writer") == 2
    assert sample(samples, "msggateway_log_commits_total", thread="main") == 0
    usage = os.statvfs(store.directory)
    assert sample(samples, "msggateway_log_filesystem_size_bytes") == (
        usage.f_blocks * usage.f_frsize
    )
    assert (
        0
        < sample(samples, "msggateway_log_filesystem_free_bytes")
        <= (usage.f_blocks * usage.f_frsize)
    )


@pytest_twisted.ensureDeferred
async def test_commits_by_the_thread_that_wrote_them(tmp_path: Path) -> None:
    """Small commits written on the main thread are counted apart from the writer thread's."""
    store = LogStore(tmp_path, _reactor(), inline_max_bytes=16 * 1024)
    store.open()
    try:
        metrics = GatewayMetrics()
        metrics.durable_log(store, {})
        stream = store.create("s")
        await stream.append([b"first"])  # the writer thread is idle once it is acknowledged
        await stream.append([b"small"])
        await stream.append([b"x" * 20000])
        samples = scrape(metrics)
        assert sample(samples, "msggateway_log_commits_total", thread="main") == 1
        assert sample(samples, "msggateway_log_commits_total", thread="writer") == 2
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_segments_and_the_fsyncs_of_a_roll(tmp_path: Path) -> None:
    """Rolled segments count, and the fsync before each roll is timed too."""
    store = LogStore(tmp_path, _reactor(), default_retention=Retention(max_segment_bytes=300))
    store.open()
    try:
        metrics = GatewayMetrics()
        metrics.durable_log(store, {})
        stream = store.create("s")
        for _ in range(4):
            await stream.append([b"." * 200])
        samples = scrape(metrics)
        rolled = len(stream.segments) - 1
        assert rolled >= 2
        assert sample(samples, "msggateway_log_segments", stream="s") == rolled + 1
        assert sample(samples, "msggateway_log_disk_bytes", stream="s") == files_bytes(
            stream.directory
        )
        # One fsync per commit, and one of the full segment before each roll.
        assert sample(samples, "msggateway_log_fsync_seconds_count") == 4 + rolled
        assert sample(samples, "msggateway_log_commit_seconds_count") == 4
    finally:
        await store.close()


def brute_force_records_after(stream: StreamLog, offset: int) -> int:
    """User records above ``offset``, counted by reading every chunk."""
    total = 0
    for chunk in stream.read_chunks(stream.first_offset, 10_000, 10**9):
        total += max(0, chunk.next_chunk_id - max(chunk.chunk_id, offset + 1))
    return total


@pytest_twisted.ensureDeferred
async def test_user_records_after_leaves_tracking_chunks_out(tmp_path: Path) -> None:
    """From every offset, the count from the index is what reading the chunks finds."""
    store = LogStore(
        tmp_path,
        _reactor(),
        default_retention=Retention(max_segment_bytes=300, max_bytes=700),
    )
    store.open()
    try:
        stream = store.create("s")
        for number in range(6):
            await stream.append([b"x" * 90, b"y"])
            stream.store_offset("reader", number)  # a tracking chunk between user chunks
            await next_turn()
        sub_batch = osiris.SubBatch.parse(osiris.encode_sub_batch([b"a", b"b", b"c"]))
        await stream.append([sub_batch, b"d"], sub_batches=True)
        await store.apply_retention()
        assert stream.first_offset > 0 and len(stream.segments) > 1
        for offset in range(-2, stream.next_offset + 2):
            expected = brute_force_records_after(stream, offset)
            assert user_records_after(stream.segments, offset) == expected, offset
    finally:
        await store.close()


class Gate:
    """A destination that answers when the test says so."""

    def __init__(self) -> None:
        self.waiting: list[tuple[Sequence[Message], Deferred[list[Outcome]]]] = []
        self.refuse_next = False

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hold the batch until `answer`."""
        answered: Deferred[list[Outcome]] = Deferred()
        self.waiting.append((messages, answered))
        return answered

    def answer(self, outcome: Outcome) -> None:
        """Answer every batch waiting with ``outcome`` for each message."""
        waiting, self.waiting = self.waiting, []
        for messages, answered in waiting:
            answered.callback([outcome] * len(messages))


def make_forwarder(stream: StreamLog, gate: Gate, clock: Clock) -> LogForwarder:
    """A route's forwarder of ``stream`` to the gate."""
    return LogForwarder(
        reference="msggateway.forwarder.orders",
        stream=stream,
        deliver=gate.deliver,
        to_message=to_message,
        dead_letter=lambda message, outcome: succeed(None),
        clock=clock,
        settings=ForwarderSettings(retry_initial_seconds=1.0),
    )


@pytest_twisted.ensureDeferred
async def test_forwarder_lag_delivered_and_retried(store: LogStore) -> None:
    """The lag is what is not delivered yet; delivered and retried count; 0 once caught up."""
    stream = store.create("msggateway.route.orders")
    clock = Clock()
    gate = Gate()
    forwarders: dict[str, LogForwarder] = {}
    metrics = GatewayMetrics()
    metrics.durable_log(store, forwarders)
    forwarder = forwarders["orders"] = make_forwarder(stream, gate, clock)
    await stream.append([b"a", b"b", b"c"])
    samples = scrape(metrics)
    assert sample(samples, "msggateway_forwarder_lag_messages", route="orders") == 3
    assert sample(samples, "msggateway_forwarder_delivered_total", route="orders") == 0
    forwarder.start()
    gate.answer(Outcome.retry("busy"))
    clock.advance(1.0)
    samples = scrape(metrics)
    assert sample(samples, "msggateway_forwarder_lag_messages", route="orders") == 3
    assert sample(samples, "msggateway_forwarder_retried_total", route="orders") == 3
    gate.answer(Outcome.accepted())
    clock.advance(0)
    await next_turn()  # the stored offset's tracking chunk is committed: no lag for it
    await next_turn()
    samples = scrape(metrics)
    assert sample(samples, "msggateway_forwarder_lag_messages", route="orders") == 0
    assert sample(samples, "msggateway_forwarder_delivered_total", route="orders") == 3
    assert sample(samples, "msggateway_forwarder_dead_lettered_total", route="orders") == 0
    forwarder.stop()


@pytest_twisted.ensureDeferred
async def test_a_reload_does_not_reset_the_counts(store: LogStore) -> None:
    """A route's new forwarder (after a reload) goes on from its old one's counts."""
    stream = store.create("msggateway.route.orders")
    clock = Clock()
    gate = Gate()
    forwarders: dict[str, LogForwarder] = {}
    metrics = GatewayMetrics()
    metrics.durable_log(store, forwarders)
    old = forwarders["orders"] = make_forwarder(stream, gate, clock)
    old.start()
    await stream.append([b"a", b"b"])
    await next_turn()  # the forwarder is woken after the append is answered
    gate.answer(Outcome.accepted())
    assert sample(scrape(metrics), "msggateway_forwarder_delivered_total", route="orders") == 2
    old.stop()
    new = forwarders["orders"] = make_forwarder(stream, gate, clock)
    new.start()
    await stream.append([b"c"])
    await next_turn()
    gate.answer(Outcome.accepted())
    assert sample(scrape(metrics), "msggateway_forwarder_delivered_total", route="orders") == 3
    assert sample(scrape(metrics), "msggateway_forwarder_delivered_total", route="orders") == 3
    new.stop()
