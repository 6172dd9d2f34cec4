"""The status API: ``/routes``, the route table in use with live numbers, as JSON."""

from __future__ import annotations

from twisted.web import http
from twisted.web.iweb import IRequest

from gateway.admin.base import AdminResource, json_body
from gateway.core.message import Status
from gateway.core.router import BoundRoute, Router
from gateway.metrics import GatewayMetrics, RouteStats

__all__ = ["RoutesResource"]


class RoutesResource(AdminResource):
    """``/routes``: the router's table as of this request, with live numbers."""

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        super().__init__()
        self._router = router
        self._metrics = metrics

    def render_GET(self, request: IRequest) -> bytes:
        """Return each route's configuration and counts, in table order."""
        stats = self._metrics.routes()
        nothing = RouteStats()

        def describe(bound: BoundRoute) -> dict[str, object]:
            route = bound.route
            numbers = stats.get(route.name, nothing)
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
            }

        # Read the table once: a reload during this request cannot mix tables.
        table = self._router.table
        return json_body(request, http.OK, [describe(bound) for bound in table.routes])
