"""Prometheus metrics for one gateway service.

Each service owns its own `CollectorRegistry` so that tests (and several
services in one process) never share counters. Hot paths count in plain
integers and add them here once per batch; see `gateway.protocols.ssmp`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["GatewayMetrics", "TrafficCounters"]

_LATENCY_BUCKETS_SECONDS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class TrafficCounters:
    """Messages and bytes in and out of one listener or upstream, as plain ints.

    The hot path adds to these attributes directly (no lock, no label
    lookup); `GatewayMetrics` exposes them as Prometheus counters when
    scraped. The reactor thread is the only writer.
    """

    __slots__ = ("bytes_in", "bytes_out", "messages_in", "messages_out")

    def __init__(self) -> None:
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0


_TRAFFIC: Final = (
    ("msggateway_messages_received", "Protocol messages received from peers.", "messages_in"),
    ("msggateway_messages_sent", "Protocol messages sent to peers.", "messages_out"),
    ("msggateway_received_bytes", "Bytes received from peers.", "bytes_in"),
    ("msggateway_sent_bytes", "Bytes sent to peers.", "bytes_out"),
)


class _TrafficCollector(Collector):
    """Reads every endpoint's `TrafficCounters` at scrape time."""

    def __init__(self, traffic: dict[str, TrafficCounters]) -> None:
        self._traffic = traffic

    def collect(self) -> Iterator[Metric]:
        for name, documentation, attribute in _TRAFFIC:
            family = CounterMetricFamily(
                name, documentation + " Per listener or upstream.", labels=["endpoint"]
            )
            for endpoint, counters in sorted(self._traffic.items()):
                family.add_metric([endpoint], getattr(counters, attribute))
            yield family


class GatewayMetrics:
    """The gateway's counters, gauges and histograms, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections = Gauge(
            "msggateway_connections",
            "Open connections, per listener or upstream.",
            ["endpoint", "protocol"],
            registry=r,
        )
        self.connections_total = Counter(
            "msggateway_connections_opened",
            "Connections accepted or made, per listener or upstream.",
            ["endpoint", "protocol"],
            registry=r,
        )
        self._traffic: dict[str, TrafficCounters] = {}
        r.register(_TrafficCollector(self._traffic))
        self.protocol_errors = Counter(
            "msggateway_protocol_errors",
            "Bad input from peers, by kind, per listener or upstream.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.slow_consumers = Counter(
            "msggateway_slow_consumer_disconnects",
            "Connections closed because their undelivered backlog passed its limit.",
            ["endpoint"],
            registry=r,
        )
        self.route_messages = Counter(
            "msggateway_route_messages",
            "Messages that entered a route.",
            ["route"],
            registry=r,
        )
        self.route_bytes = Counter(
            "msggateway_route_bytes",
            "Body bytes of messages that entered a route.",
            ["route"],
            registry=r,
        )
        self.route_outcomes = Counter(
            "msggateway_route_outcomes",
            "Outcomes of route deliveries: accepted, retry or rejected.",
            ["route", "outcome"],
            registry=r,
        )
        self.route_latency = Histogram(
            "msggateway_route_latency_seconds",
            "Time from a message entering a route to its outcome.",
            ["route"],
            buckets=_LATENCY_BUCKETS_SECONDS,
            registry=r,
        )
        self.route_in_flight = Gauge(
            "msggateway_route_in_flight",
            "Messages handed to a route whose outcome is not known yet.",
            ["route"],
            registry=r,
        )
        self.qmqp_replies = Counter(
            "msggateway_qmqp_replies",
            "QMQP replies sent by listeners or received by upstreams, by status K, Z or D.",
            ["endpoint", "status"],
            registry=r,
        )
        self.upstream_up = Gauge(
            "msggateway_upstream_connected",
            "1 when the upstream is connected and logged in, else 0.",
            ["upstream"],
            registry=r,
        )

    def traffic(self, endpoint: str) -> TrafficCounters:
        """Return the traffic counters of a listener or upstream (made on first use)."""
        counters = self._traffic.get(endpoint)
        if counters is None:
            counters = self._traffic[endpoint] = TrafficCounters()
        return counters
