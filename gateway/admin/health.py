"""``/healthz``: whether the gateway is serving, as JSON (`HealthReport`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs
from twisted.web import http
from twisted.web.iweb import IRequest

from gateway.admin.base import AdminResource, json_body

__all__ = ["HealthReport", "HealthResource"]


def _frozen(value: Mapping[str, bool]) -> Mapping[str, bool]:
    """Return a read-only copy of a name-to-state mapping."""
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class HealthReport:
    """The health of the gateway at one moment, as ``/healthz`` reports it.

    The gateway is unavailable (HTTP 503) only when a listener is not
    listening: then clients cannot reach it and a load balancer should send
    them elsewhere. An upstream that is down makes it *degraded*, still HTTP
    200: the gateway itself is serving, its clients get "retry later"
    outcomes for routes towards that upstream, and it reconnects on its own;
    taking the gateway out of a balancer would not bring the upstream back.

    In a fleet, a node that has had no connection to RabbitMQ for longer
    than ``[fleet] unhealthy_after_seconds`` is unavailable too (``reason``
    says so): it serves its own clients, but nothing crosses to or from the
    other nodes, so a load balancer should send its clients to one that can.

    Attributes:
        listeners: Each listener by config name: True when it is listening.
        upstreams: Each upstream by config name: True when it is connected
            (and logged in, where its protocol has a login).
        fleet: The node's fleet state (`gateway.fleet.members.Membership.health`),
            or None outside a fleet.
        fleet_problem: Why the node is unavailable to the fleet, or None.
    """

    listeners: Mapping[str, bool] = attrs.field(factory=dict, converter=_frozen, hash=False)
    upstreams: Mapping[str, bool] = attrs.field(factory=dict, converter=_frozen, hash=False)
    fleet: Mapping[str, object] | None = attrs.field(default=None, hash=False)
    fleet_problem: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the gateway is serving: every listener listens, and it is in its fleet."""
        return all(self.listeners.values()) and self.fleet_problem is None

    @property
    def status(self) -> str:
        """Return ``"ok"``, ``"degraded"`` (an upstream is down) or ``"unavailable"``."""
        if not self.ok:
            return "unavailable"
        if not all(self.upstreams.values()):
            return "degraded"
        return "ok"

    def to_json(self) -> dict[str, object]:
        """Return the report as the JSON value ``/healthz`` serves, names sorted."""
        report: dict[str, object] = {
            "status": self.status,
            "listeners": {
                name: {"listening": state} for name, state in sorted(self.listeners.items())
            },
            "upstreams": {
                name: {"connected": state} for name, state in sorted(self.upstreams.items())
            },
        }
        if self.fleet is not None:
            report["fleet"] = dict(self.fleet)
        if self.fleet_problem is not None:
            report["reason"] = self.fleet_problem
        return report


class HealthResource(AdminResource):
    """``/healthz``: 200 when ok or degraded, 503 when unavailable."""

    def __init__(self, health: Callable[[], HealthReport]) -> None:
        super().__init__()
        self._health = health

    def render_GET(self, request: IRequest) -> bytes:
        """Return a fresh health report."""
        report = self._health()
        code = http.OK if report.ok else http.SERVICE_UNAVAILABLE
        return json_body(request, code, report.to_json())
