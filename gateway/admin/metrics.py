"""``/metrics``: the gateway's Prometheus registry, in the text exposition format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.web.iweb import IRequest

from gateway.admin.base import AdminResource
from gateway.metrics import GatewayMetrics

__all__ = ["MetricsResource"]


class MetricsResource(AdminResource):
    """``/metrics``: the service's own registry (never the global one)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: IRequest) -> bytes:
        """Return the registry in the Prometheus text exposition format."""
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        body: bytes = generate_latest(self._metrics.registry)
        return body
