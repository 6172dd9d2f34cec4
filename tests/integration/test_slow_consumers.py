"""Consumers that stop reading, against a real gateway: bounded memory and the protocol's answer.

For each of SSMP, the stream protocol, a DMP feed and an MTL reader, a fresh
``twistd msggateway`` with small caps gets one consumer that subscribes and
never reads again, and a publisher that sends `MESSAGES` messages of
`SIZE` bytes (80 MB: a gateway that kept them for the consumer would grow by
at least that). The scenarios are those of ``bench/slow_consumers.py``
(`bench.slow_consumers.measure`), bounded in count and time; the gateway's
RSS is sampled throughout. Each checks that RSS grew by less than
`GROWTH_LIMIT_MIB` and that the gateway answered as its protocol allows:

* SSMP: the publisher held while the subscriber is congested, the
  subscriber disconnected once stuck (``slow_consumer_seconds``), counted;
  every MCAST then answered 200;
* stream: nothing sent past the full buffer however much credit, every
  publish confirmed, and everything delivered once the consumer reads;
* DMP: the sink writer's messages wait while the feed reader is congested;
  the reader is cut once stuck, counted, and what waited for it and what
  followed (no reader) is answered retry later;
* MTL: what ZeroMQ does not take for the reader is held and the writer not
  read; the reader is forgotten once stuck, counted, and the confirm=full
  writer gets Reject with recycle for what it did not take.
"""

from __future__ import annotations

from typing import Final

import pytest

from bench.slow_consumers import Row, measure, metric

pytestmark = pytest.mark.integration

MESSAGES: Final = 80_000
SIZE: Final = 1000
GROWTH_LIMIT_MIB: Final = 56.0
"""Well under the 80 MB sent. Measured: the caps below hold a few hundred kilobytes,
and the publishers' own traffic (read, routed, answered) costs SSMP nothing, the
stream 12 MiB, DMP 18, MTL 36 (what the writer has in flight, ZeroMQ's queue of
what it sent); with the caps lifted, MTL and DMP grew by 120 and 167 MiB."""
SETTINGS: Final = {
    "hub.slow_consumer_seconds": "1",
    "dmp.slow_consumer_seconds": "1",
    "mtl2.max_backlog_messages": "100",
    "mtl2.slow_consumer_seconds": "1",
    "streams.max_unconfirmed": "2000",  # the publisher's own backlog: not what is measured
}


def slow(protocol: str) -> Row:
    """Run one protocol's slow-consumer scenario on a fresh gateway."""
    row = measure(protocol, MESSAGES, SIZE, slow=True, settings=dict(SETTINGS))
    assert row.sent == MESSAGES, row
    assert not row.notes, row.notes
    growth = row.rss_peak - row.rss_start
    assert growth < GROWTH_LIMIT_MIB, f"RSS grew by {growth:.1f} MiB: {row}"
    return row


def test_ssmp_subscriber_that_stops_reading_is_disconnected() -> None:
    """The stuck subscriber is cut off and counted; the publisher gets 200 for every MCAST."""
    row = slow("ssmp")
    assert row.acked == MESSAGES
    disconnects = "msggateway_slow_consumer_disconnects_total"
    assert metric(row.metrics_end, disconnects, endpoint="hub") == 1
    assert row.delivered is not None and row.delivered < MESSAGES // 2


def test_stream_consumer_granting_credit_without_reading_is_sent_nothing_more() -> None:
    """Credit granted again and again, never read: sends stop; everything arrives once it reads."""
    row = slow("stream")
    assert row.acked == MESSAGES and row.refused == 0
    sent = metric(row.metrics_before_read, "msggateway_messages_sent_total", endpoint="streams")
    assert sent < MESSAGES // 2  # what the kernel's buffers took, no more
    assert row.delivered == MESSAGES
    disconnects = "msggateway_slow_consumer_disconnects_total"
    assert metric(row.metrics_end, disconnects, endpoint="streams") == 0


def test_dmp_feed_reader_that_stops_reading_is_cut_and_the_rest_retried() -> None:
    """The stuck reader is cut and counted; what it did not take is retry later, none lost."""
    row = slow("dmp")
    assert row.refused > MESSAGES // 2
    disconnects = "msggateway_slow_consumer_disconnects_total"
    assert metric(row.metrics_end, disconnects, endpoint="dmp") == 1
    accepted = metric(
        row.metrics_end, "msggateway_route_outcomes_total", route="dmp-loop", outcome="accepted"
    )
    assert accepted + row.refused == MESSAGES


def test_mtl_reader_that_stops_reading_is_cut_and_the_writer_recycles() -> None:
    """The stuck reader is forgotten and counted; the writer gets Reject with recycle, none lost."""
    row = slow("mtl")
    assert row.acked is not None
    assert row.refused > MESSAGES // 2
    assert row.acked + row.refused == MESSAGES
    disconnects = "msggateway_slow_consumer_disconnects_total"
    assert metric(row.metrics_end, disconnects, endpoint="mtl2") == 1
