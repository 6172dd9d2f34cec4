"""Prometheus metrics for one gateway service.

Each service owns its own `CollectorRegistry` so that tests (and several
services in one process) never share counters. Hot paths count in plain
integers and add them here once per batch; see `gateway.protocols.ssmp`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.logmetrics import ForwarderCollector, LogCollector

if TYPE_CHECKING:
    from gateway.core.forwarder import LogForwarder
    from gateway.core.log import LogStore

__all__ = [
    "BackboneStats",
    "FleetStats",
    "GatewayMetrics",
    "LockStats",
    "RouteStats",
    "TrafficCounters",
]

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


class RouteStats:
    """One route's numbers, as plain ints (the router updates them per message).

    Exposed at scrape time as ``msggateway_route_messages_total``,
    ``_route_bytes_total``, ``_route_outcomes_total{outcome}``,
    ``_route_in_flight`` and the ``_route_latency_seconds`` histogram.
    """

    __slots__ = ("bytes", "in_flight", "latency_buckets", "latency_sum", "messages", "outcomes")

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self.in_flight = 0
        self.outcomes: dict[str, int] = {"accepted": 0, "retry": 0, "rejected": 0}
        self.latency_buckets = [0] * (len(_LATENCY_BUCKETS_SECONDS) + 1)
        self.latency_sum = 0.0

    def observe_latency(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` outcomes of the same latency (one batch) in its histogram bucket."""
        self.latency_buckets[bisect.bisect_left(_LATENCY_BUCKETS_SECONDS, seconds)] += count
        self.latency_sum += seconds * count


class _RouteCollector(Collector):
    """Reads every route's `RouteStats` at scrape time."""

    def __init__(self, routes: dict[str, RouteStats]) -> None:
        self._routes = routes

    def collect(self) -> Iterator[Metric]:
        routes = sorted(self._routes.items())
        messages = CounterMetricFamily(
            "msggateway_route_messages", "Messages that entered a route.", labels=["route"]
        )
        size = CounterMetricFamily(
            "msggateway_route_bytes", "Body bytes of messages that entered a route.",
            labels=["route"],
        )  # fmt: skip
        outcomes = CounterMetricFamily(
            "msggateway_route_outcomes",
            "Outcomes of route deliveries: accepted, retry or rejected.",
            labels=["route", "outcome"],
        )
        in_flight = GaugeMetricFamily(
            "msggateway_route_in_flight",
            "Messages handed to a route whose outcome is not known yet.",
            labels=["route"],
        )
        latency = HistogramMetricFamily(
            "msggateway_route_latency_seconds",
            "Time from a message entering a route to its outcome.",
            labels=["route"],
        )
        for name, stats in routes:
            messages.add_metric([name], stats.messages)
            size.add_metric([name], stats.bytes)
            for outcome, count in stats.outcomes.items():
                outcomes.add_metric([name, outcome], count)
            in_flight.add_metric([name], stats.in_flight)
            cumulative = list(itertools.accumulate(stats.latency_buckets))
            bounds = [repr(float(b)) for b in _LATENCY_BUCKETS_SECONDS] + ["+Inf"]
            latency.add_metric(
                [name], list(zip(bounds, cumulative, strict=True)), stats.latency_sum
            )
        yield from (messages, size, outcomes, in_flight, latency)


class BackboneStats:
    """The fleet backbone's numbers (`gateway.fleet.backbone`), as plain ints.

    Exposed at scrape time as ``msggateway_fleet_backbone_connected``,
    ``_blocked``, ``_bindings``, ``_reconnects_total``, ``_gap_seconds_total``
    (time without a connection, added when it is back), ``_dropped_total``
    (messages for other nodes dropped for want of a connection, or unconfirmed
    when it was lost), ``_nacked_total``, ``_published_total``,
    ``_published_bytes_total`` and ``_received_total`` (AMQP messages, each
    a batch of events).
    """

    __slots__ = (
        "bindings",
        "blocked",
        "connected",
        "connections",
        "dropped",
        "gap_seconds",
        "nacked",
        "published",
        "published_bytes",
        "received",
        "reconnects",
    )

    def __init__(self) -> None:
        self.connected = 0
        self.blocked = 0
        self.bindings = 0
        self.connections = 0
        self.reconnects = 0
        self.gap_seconds = 0.0
        self.dropped = 0
        self.nacked = 0
        self.published = 0
        self.published_bytes = 0
        self.received = 0


_BACKBONE: Final = (
    ("connected", GaugeMetricFamily, "1 while the node is connected to RabbitMQ, else 0."),
    ("blocked", GaugeMetricFamily, "1 while RabbitMQ blocks the node's publishing, else 0."),
    ("bindings", GaugeMetricFamily, "Bindings of the node's queue."),
    ("reconnects", CounterMetricFamily, "Reconnections to RabbitMQ after a loss."),
    ("gap_seconds", CounterMetricFamily, "Seconds spent without a connection to RabbitMQ."),
    ("dropped", CounterMetricFamily, "Messages for other nodes dropped (no connection)."),
    ("nacked", CounterMetricFamily, "Messages RabbitMQ refused (nacked)."),
    ("published", CounterMetricFamily, "AMQP messages published (each a batch)."),
    ("published_bytes", CounterMetricFamily, "Bytes published."),
    ("received", CounterMetricFamily, "AMQP messages received from other nodes."),
)


class _BackboneCollector(Collector):
    """Reads the backbone's `BackboneStats` at scrape time."""

    def __init__(self, stats: BackboneStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        for attribute, family, documentation in _BACKBONE:
            metric = family(f"msggateway_fleet_backbone_{attribute}", documentation)
            metric.add_metric([], getattr(self._stats, attribute))
            yield metric


class LockStats:
    """One fleet lock's numbers on this node (`gateway.fleet.locks`), as plain ints.

    Exposed at scrape time as ``msggateway_fleet_lock_held{lock}`` (1 while
    this node holds it), ``_acquired_total`` (times this node got it),
    ``_takeovers_total`` (of those, times another node held it before:
    this node was refused first) and ``_lost_total`` (times this node lost
    it without releasing it: its connection to RabbitMQ went, or went
    unconfirmed).
    """

    __slots__ = ("acquired", "held", "lost", "takeovers")

    def __init__(self) -> None:
        self.held = 0
        self.acquired = 0
        self.takeovers = 0
        self.lost = 0


_LOCK: Final = (
    ("held", GaugeMetricFamily, "1 while this node holds the fleet lock, else 0."),
    ("acquired", CounterMetricFamily, "Times this node got the fleet lock."),
    (
        "takeovers",
        CounterMetricFamily,
        "Times this node got the fleet lock after another node had held it.",
    ),
    ("lost", CounterMetricFamily, "Times this node lost the fleet lock without releasing it."),
)


class _LockCollector(Collector):
    """Reads every fleet lock's `LockStats` at scrape time."""

    def __init__(self, locks: dict[str, LockStats]) -> None:
        self._locks = locks

    def collect(self) -> Iterator[Metric]:
        for attribute, family, documentation in _LOCK:
            metric = family(f"msggateway_fleet_lock_{attribute}", documentation, labels=["lock"])
            for name, stats in sorted(self._locks.items()):
                metric.add_metric([name], getattr(stats, attribute))
            yield metric


class FleetStats:
    """The fleet's membership as this node sees it (`gateway.fleet.members`), as plain ints.

    Exposed at scrape time as ``msggateway_fleet_nodes`` (live nodes, this
    one included) and ``msggateway_fleet_config_mismatch`` (live nodes whose
    configuration hash differs from this node's).
    """

    __slots__ = ("config_mismatch", "nodes")

    def __init__(self) -> None:
        self.nodes = 1
        self.config_mismatch = 0


class _FleetCollector(Collector):
    """Reads the membership's `FleetStats` at scrape time."""

    def __init__(self, stats: FleetStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        nodes = GaugeMetricFamily(
            "msggateway_fleet_nodes", "Live nodes of the fleet, this one included."
        )
        nodes.add_metric([], self._stats.nodes)
        yield nodes
        mismatch = GaugeMetricFamily(
            "msggateway_fleet_config_mismatch",
            "Live nodes whose configuration hash differs from this node's.",
        )
        mismatch.add_metric([], self._stats.config_mismatch)
        yield mismatch


class GatewayMetrics:
    """The gateway's counters, gauges and histograms, in their own registry."""

    def __init__(self) -> None:
        # Every counter and histogram would also get a *_created series (when it was
        # made), which queries and the dashboard never use and every scrape carries.
        # prometheus_client's switch is for the whole process.
        disable_created_metrics()  # type: ignore[no-untyped-call]
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
        self.login_failures = Counter(
            "msggateway_login_failures",
            "Logins refused (a wrong secret, lease or certificate name, or a refused identity),"
            " per listener.",
            ["endpoint"],
            registry=r,
        )
        self.slow_consumers = Counter(
            "msggateway_slow_consumer_disconnects",
            "Connections closed because their undelivered backlog passed its limit.",
            ["endpoint"],
            registry=r,
        )
        self._routes: dict[str, RouteStats] = {}
        r.register(_RouteCollector(self._routes))
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
        self._locks: dict[str, LockStats] | None = None
        self._node = Info(
            "msggateway_node",
            "This process's node id (in every publisher reference it uses), as a label.",
            registry=r,
        )

    def backbone(self) -> BackboneStats:
        """The fleet backbone's numbers, registered for scraping (one backbone per gateway)."""
        stats = BackboneStats()
        self.registry.register(_BackboneCollector(stats))
        return stats

    def fleet_lock(self, name: str) -> LockStats:
        """A fleet lock's numbers, registered for scraping (made on first use)."""
        if self._locks is None:
            self._locks = {}
            self.registry.register(_LockCollector(self._locks))
        stats = self._locks.get(name)
        if stats is None:
            stats = self._locks[name] = LockStats()
        return stats

    def fleet(self) -> FleetStats:
        """The fleet membership's numbers, registered for scraping (one per gateway)."""
        stats = FleetStats()
        self.registry.register(_FleetCollector(stats))
        return stats

    def set_node(self, node: str) -> None:
        """Show this process's node id: ``msggateway_node_info{node="..."} 1``."""
        self._node.info({"node": node})

    def traffic(self, endpoint: str) -> TrafficCounters:
        """Return the traffic counters of a listener or upstream (made on first use)."""
        counters = self._traffic.get(endpoint)
        if counters is None:
            counters = self._traffic[endpoint] = TrafficCounters()
        return counters

    def qmqp_reply_counter(self, endpoint: str) -> Callable[[bytes, int], None]:
        """Count one endpoint's QMQP replies by status byte (each label looked up once).

        The counter takes a status and how many replies had it.
        """
        children: dict[bytes, Any] = {}
        family = self.qmqp_replies

        def count(status: bytes, replies: int) -> None:
            child = children.get(status)
            if child is None:
                child = children[status] = family.labels(endpoint, status.decode("ascii"))
            child.inc(replies)

        return count

    def route(self, name: str) -> RouteStats:
        """Return a route's numbers (made on first use)."""
        stats = self._routes.get(name)
        if stats is None:
            stats = self._routes[name] = RouteStats()
        return stats

    def traffic_counts(self) -> dict[str, TrafficCounters]:
        """Every listener's and upstream's traffic counters so far, by name (read them only)."""
        return dict(self._traffic)

    def routes(self) -> dict[str, RouteStats]:
        """Every route's numbers so far, by route name."""
        return dict(self._routes)

    # The embedded log and the durable routes' forwarders (`gateway.logmetrics`).

    def durable_log(self, store: LogStore, forwarders: Mapping[str, LogForwarder]) -> None:
        """Expose the log's streams, commits and file system, and the forwarders' progress.

        Args:
            store: The embedded log (one per gateway).
            forwarders: The durable routes' forwarders by route name, a live mapping.
        """
        self.registry.register(LogCollector(store))
        self.registry.register(ForwarderCollector(forwarders))
