"""The status API: what the gateway is doing, as JSON, for the status page and for scripts.

Each path answers a JSON list, read afresh from the running gateway per
request (nothing is kept between requests; rates are for the reader to
compute from two answers):

- ``/routes``: the route table in use, with each route's messages, bytes,
  outcomes and in-flight count, and a durable route's forwarder (its lag,
  delivered, retried and dead-lettered counts);
- ``/listeners``: each listener's address, whether it listens, its open
  connections and its traffic and error counters;
- ``/upstreams``: each upstream's state, address, reconnects and counters;
- ``/streams``: each stream of the embedded log, with its offsets, size on
  disk, segments and retention (none without the log);
- ``/nodes``: the fleet's live nodes (outside a fleet, this node alone).

The numbers are those of ``/metrics`` (`gateway.metrics`,
`gateway.logmetrics`), read the same way: plain counters, the log's
in-memory state, no file read. What the gateway is made of comes from a
`GatewayView` (`gateway.service.GatewayService` is one); a site built
without one answers empty lists, but for ``/routes``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final, Protocol

from prometheus_client import Counter, Gauge
from twisted.web import http
from twisted.web.iweb import IRequest

from gateway import __version__
from gateway.admin.base import AdminResource, json_body
from gateway.core.message import Status
from gateway.core.router import BoundRoute, Router
from gateway.logmetrics import disk_bytes, forwarder_lag
from gateway.metrics import GatewayMetrics, RouteStats, TrafficCounters
from gateway.protocols.upstream import describe_endpoint

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.core.durable import DurableRoutes
    from gateway.core.log import LogStore
    from gateway.fleet.members import Membership
    from gateway.fleet.streams import StreamOwnership

__all__ = [
    "STATUS_PATHS",
    "GatewayView",
    "JSONListResource",
    "RoutesResource",
    "listeners",
    "nodes",
    "streams",
    "upstreams",
]

STATUS_PATHS: Final = {
    "/listeners": "the listeners: address, connections, traffic and errors",
    "/upstreams": "the upstreams: state, address, reconnects, traffic and errors",
    "/streams": "the embedded log's streams: offsets, size, segments and retention",
    "/nodes": "the fleet's live nodes (outside a fleet, this node)",
}
"""The status API's paths besides ``/routes``, each with a line for the index."""


class EndpointView(Protocol):
    """What the status API reads of a listener or upstream the gateway built."""

    @property
    def destination(self) -> object:
        """The listener's or upstream's route destination (an upstream: its client)."""

    @property
    def upstream(self) -> bool:
        """Whether it is an upstream."""


class ListeningView(Protocol):
    """What the status API reads of a listening service."""

    @property
    def port(self) -> object | None:
        """The listening port, None while not listening."""

    @property
    def address(self) -> str | None:
        """``host:port`` listened on, None while not listening."""


class GatewayView(Protocol):
    """What the status API reads of the running gateway (`gateway.service.GatewayService`)."""

    @property
    def node(self) -> str:
        """This process's node id."""

    @property
    def config(self) -> GatewayConfig:
        """The configuration it runs."""

    @property
    def metrics(self) -> GatewayMetrics:
        """Its metrics."""

    @property
    def store(self) -> LogStore | None:
        """The embedded log, if open."""

    @property
    def durable(self) -> DurableRoutes | None:
        """The durable routes and their forwarders, with the log."""

    @property
    def membership(self) -> Membership | None:
        """The fleet as this node sees it, in a fleet."""

    @property
    def streams(self) -> StreamOwnership | None:
        """Which node owns each stream, in a fleet."""

    @property
    def endpoints(self) -> Mapping[str, EndpointView]:
        """Each listener and upstream by name."""

    def listeners(self) -> Mapping[str, ListeningView]:
        """Each listening service by name."""


class JSONListResource(AdminResource):
    """A status path: the JSON list a function makes, afresh per request."""

    def __init__(self, make: Callable[[], list[dict[str, object]]]) -> None:
        super().__init__()
        self._make = make

    def render_GET(self, request: IRequest) -> bytes:
        """Return the list."""
        return json_body(request, http.OK, self._make())


class RoutesResource(AdminResource):
    """``/routes``: the router's table as of this request, with live numbers.

    Args:
        router: Whose table is listed.
        metrics: The routes' counters.
        gateway: Where durable routes' forwarders are found; None: none are.
    """

    def __init__(
        self, router: Router, metrics: GatewayMetrics, gateway: GatewayView | None = None
    ) -> None:
        super().__init__()
        self._router = router
        self._metrics = metrics
        self._gateway = gateway

    def render_GET(self, request: IRequest) -> bytes:
        """Return each route's configuration and counts, in table order."""
        stats = self._metrics.routes()
        nothing = RouteStats()
        durable = self._gateway.durable if self._gateway is not None else None
        forwarders = durable.forwarders if durable is not None else {}

        def describe(bound: BoundRoute) -> dict[str, object]:
            route = bound.route
            numbers = stats.get(route.name, nothing)
            forwarder = forwarders.get(route.name) if route.durable else None
            return {
                "name": route.name,
                "source": route.source,
                "pattern": route.pattern.text,
                "destination": route.destination,
                "target": None if route.target is None else route.target.text,
                "durable": route.durable,
                "timeout_seconds": route.timeout_seconds,
                "messages": numbers.messages,
                "bytes": numbers.bytes,
                "outcomes": {status.value: numbers.outcomes[status.value] for status in Status},
                "in_flight": numbers.in_flight,
                "forwarder": None
                if forwarder is None
                else {
                    "lag": forwarder_lag(forwarder),
                    "delivered": forwarder.delivered,
                    "retried": forwarder.retried,
                    "dead_lettered": forwarder.dead_lettered,
                },
            }

        # Read the table once: a reload during this request cannot mix tables.
        table = self._router.table
        return json_body(request, http.OK, [describe(bound) for bound in table.routes])


def _by_endpoint(metric: Counter | Gauge, sample: str) -> dict[str, int]:
    """A labelled metric's samples named ``sample``, summed per ``endpoint`` label."""
    totals: dict[str, int] = {}
    for family in metric.collect():
        for found in family.samples:
            if found.name == sample:
                endpoint = found.labels.get("endpoint", "")
                totals[endpoint] = totals.get(endpoint, 0) + int(found.value)
    return totals


class _Numbers:
    """The per-endpoint numbers of one request: connections, traffic and errors."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.traffic = metrics.traffic_counts()
        self.connections = _by_endpoint(metrics.connections, "msggateway_connections")
        self.opened = _by_endpoint(metrics.connections_total, "msggateway_connections_opened_total")
        self.errors = _by_endpoint(metrics.protocol_errors, "msggateway_protocol_errors_total")
        self.logins = _by_endpoint(metrics.login_failures, "msggateway_login_failures_total")
        self.slow = _by_endpoint(
            metrics.slow_consumers, "msggateway_slow_consumer_disconnects_total"
        )

    def of(self, name: str) -> dict[str, object]:
        """The numbers both listeners and upstreams have."""
        traffic = self.traffic.get(name) or TrafficCounters()
        return {
            "connections": self.connections.get(name, 0),
            "connections_opened": self.opened.get(name, 0),
            "messages_in": traffic.messages_in,
            "messages_out": traffic.messages_out,
            "bytes_in": traffic.bytes_in,
            "bytes_out": traffic.bytes_out,
            "protocol_errors": self.errors.get(name, 0),
        }


def listeners(gateway: GatewayView | None) -> list[dict[str, object]]:
    """``/listeners``: each configured listener, in configuration order."""
    if gateway is None:
        return []
    numbers = _Numbers(gateway.metrics)
    services = gateway.listeners()
    found: list[dict[str, object]] = []
    for config in gateway.config.listeners:
        service = services.get(config.name)
        listening = service is not None and service.port is not None
        found.append(
            {
                "name": config.name,
                "protocol": config.protocol,
                "address": service.address if service is not None else None,
                "tls": config.tls,
                "listening": listening,
                **numbers.of(config.name),
                "login_failures": numbers.logins.get(config.name, 0),
                "slow_consumer_disconnects": numbers.slow.get(config.name, 0),
            }
        )
    return found


def _upstream_state(client: object) -> str:
    """``connected``, ``standby`` (another node runs it), ``connecting`` or ``stopped``."""
    if getattr(client, "connected", False):
        return "connected"
    if getattr(client, "standby", False):
        return "standby"
    if getattr(client, "running", True):
        return "connecting"
    return "stopped"


def _upstream_address(client: object, configured: str) -> str:
    """Where the upstream connects (its next attempt), as the log names it."""
    endpoint = getattr(client, "endpoint", None)
    if endpoint is not None:
        return describe_endpoint(endpoint)
    host, port = getattr(client, "host", None), getattr(client, "port", None)
    if isinstance(host, str) and isinstance(port, int):  # MTL: ZeroMQ, no Twisted endpoint
        return f"{host}:{port}"
    return configured


def upstreams(gateway: GatewayView | None) -> list[dict[str, object]]:
    """``/upstreams``: each configured upstream, in configuration order."""
    if gateway is None:
        return []
    numbers = _Numbers(gateway.metrics)
    found: list[dict[str, object]] = []
    for config in gateway.config.upstreams:
        endpoint = gateway.endpoints.get(config.name)
        client = endpoint.destination if endpoint is not None else None
        state = _upstream_state(client) if client is not None else "stopped"
        shared = numbers.of(config.name)
        opened = shared["connections_opened"]
        assert isinstance(opened, int)
        found.append(
            {
                "name": config.name,
                "protocol": config.protocol,
                "address": _upstream_address(client, config.endpoint),
                "state": state,
                "connected": state == "connected",
                "reconnects": max(opened - 1, 0),
                **shared,
            }
        )
    return found


def streams(gateway: GatewayView | None) -> list[dict[str, object]]:
    """``/streams``: each stream of the embedded log, by name (none without the log)."""
    store = gateway.store if gateway is not None else None
    if gateway is None or store is None:
        return []
    ownership = gateway.streams
    found: list[dict[str, object]] = []
    for name in sorted(store.names()):
        stream = store.get(name)
        if stream is None:
            continue
        first, following = stream.first_offset, stream.next_offset
        retention = stream.retention
        found.append(
            {
                "name": name,
                "first_offset": first,
                "last_offset": following - 1 if following > first else None,
                "next_offset": following,
                "disk_bytes": disk_bytes(stream),
                "segments": len(stream.segments),
                "appends": stream.appends,
                "messages": stream.records,
                "written_bytes": stream.written_bytes,
                "retention": {
                    "max_bytes": retention.max_bytes,
                    "max_age_seconds": retention.max_age_seconds,
                    "max_segment_bytes": retention.max_segment_bytes,
                },
                "owner": ownership.owner(name) if ownership is not None else gateway.node,
            }
        )
    return found


def _addresses(pairs: Iterable[tuple[str, tuple[str, int]]]) -> dict[str, str]:
    return {name: f"{host}:{port}" for name, (host, port) in sorted(pairs)}


def nodes(gateway: GatewayView | None) -> list[dict[str, object]]:
    """``/nodes``: the fleet's live nodes, sorted; outside a fleet, this node alone."""
    if gateway is None:
        return []
    membership = gateway.membership
    if membership is None:
        return [
            {
                "node": gateway.node,
                "this": True,
                "fleet": False,
                "version": __version__,
                "started": None,
                "config_matches": True,
                "listeners": {
                    name: service.address
                    for name, service in sorted(gateway.listeners().items())
                    if service.address is not None and name != "admin"
                },
            }
        ]
    mismatched = set(membership.mismatched())
    found: list[dict[str, object]] = []
    for node in membership.nodes():
        member = membership.member(node)
        if member is None:
            continue
        found.append(
            {
                "node": node,
                "this": node == gateway.node,
                "fleet": True,
                "version": member.version,
                "started": member.started,
                "config_hash": member.config_hash,
                "config_matches": node not in mismatched,
                "listeners": _addresses(member.addresses.items()),
            }
        )
    return found
