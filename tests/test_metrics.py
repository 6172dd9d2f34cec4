"""The gateway's Prometheus registry (`gateway.metrics`)."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.metrics import GatewayMetrics


def test_no_created_series() -> None:
    """Counters and histograms come without ``*_created`` series (the time each was made)."""
    metrics = GatewayMetrics()
    metrics.connections_total.labels("hub", "ssmp").inc()
    metrics.route("tour").messages += 1
    text = generate_latest(metrics.registry).decode()
    assert "msggateway_connections_opened_total" in text
    assert "_created" not in text
