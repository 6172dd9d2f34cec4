"""The admin HTTP endpoint: health, Prometheus metrics and the live route table.

DESIGN.md, "Operations": a small twisted.web site, meant to listen on
loopback (the assembly chooses the endpoint string), with three read-only
paths:

- ``/healthz``: whether the gateway is serving, as JSON (see `HealthReport`);
- ``/metrics``: the service's own Prometheus registry in the text format;
- ``/routes``: the route table in use right now, with live per-route numbers;
- ``/leases`` (when the gateway has DMP listeners): ``POST`` makes a DMP
  lease, ``DELETE /leases/TEXT`` revokes one; both need ``Authorization:
  Bearer TOKEN`` with the secret of ``admin`` in the secrets file.

``/`` lists them. Every answer is JSON except ``/metrics``, carries
``Cache-Control: no-store`` and is generated afresh per request, so a route
reload or a listener going down shows at once. Only GET and HEAD are allowed;
any other method gets a JSON 405 with an ``Allow`` header, any other path a
JSON 404. The read-only paths need no authentication: nothing served there
is secret (names, patterns, counts), and the endpoint is not meant to leave
the host.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, Protocol

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.internet.interfaces import IReactorTime
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

from gateway.core.message import Status
from gateway.core.router import BoundRoute, Router
from gateway.metrics import GatewayMetrics, RouteStats

__all__ = ["HealthReport", "make_admin_resource", "make_admin_site"]

JSON_CONTENT_TYPE: Final = b"application/json"
"""RFC 8259 fixes JSON's encoding as UTF-8 and defines no charset parameter."""

ALLOWED_METHODS: Final = (b"GET", b"HEAD")

PATHS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "/healthz": "whether the gateway is serving: listeners and upstreams",
        "/metrics": "Prometheus metrics, text exposition format",
        "/routes": "the routes in use, with live message counts",
    }
)


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

    Attributes:
        listeners: Each listener by config name: True when it is listening.
        upstreams: Each upstream by config name: True when it is connected
            (and logged in, where its protocol has a login).
    """

    listeners: Mapping[str, bool] = attrs.field(factory=dict, converter=_frozen, hash=False)
    upstreams: Mapping[str, bool] = attrs.field(factory=dict, converter=_frozen, hash=False)

    @property
    def ok(self) -> bool:
        """Whether the gateway is serving: every listener is listening."""
        return all(self.listeners.values())

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
        return {
            "status": self.status,
            "listeners": {
                name: {"listening": state} for name, state in sorted(self.listeners.items())
            },
            "upstreams": {
                name: {"connected": state} for name, state in sorted(self.upstreams.items())
            },
        }


def _json_body(request: IRequest, code: int, value: object) -> bytes:
    """Set the status and JSON content type, and return ``value`` encoded."""
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    text = json.dumps(value, ensure_ascii=False, indent=2)
    return text.encode("utf-8") + b"\n"


class _AdminResource(Resource):
    """A read-only admin resource: GET and HEAD, never cached, no children.

    Subclasses implement `render_GET`. Rendering is overridden as a whole so
    that a wrong method gets JSON rather than twisted.web's HTML error page,
    and HEAD gets the headers GET would, without twisted.web logging about
    the body it drops.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # twisted.web leaves it unannotated

    def render(self, request: IRequest) -> bytes:
        """Answer the request; HEAD gets GET's headers and an empty body."""
        request.setHeader(b"Cache-Control", b"no-store")
        request.setHeader(b"X-Content-Type-Options", b"nosniff")
        body = self._respond(request)
        if request.method == b"HEAD":
            request.setHeader(b"Content-Length", b"%d" % (len(body),))
            return b""
        return body

    def _respond(self, request: IRequest) -> bytes:
        """Return the body for an allowed method, or a 405 for any other."""
        if request.method not in ALLOWED_METHODS:
            request.setHeader(b"Allow", b", ".join(ALLOWED_METHODS))
            return _json_body(
                request,
                http.NOT_ALLOWED,
                {
                    "error": "method not allowed",
                    "method": request.method.decode("latin-1"),
                    "allowed": [method.decode("ascii") for method in ALLOWED_METHODS],
                },
            )
        return self.render_GET(request)

    def render_GET(self, request: IRequest) -> bytes:
        """Return the response body; subclasses set status and content type."""
        raise NotImplementedError

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Answer 404 for anything below this resource."""
        return _NotFound()


class _NotFound(_AdminResource):
    """Any path the admin site does not serve: a JSON 404, whatever the method."""

    def _respond(self, request: IRequest) -> bytes:
        """Return the 404 body, naming the path that was asked for."""
        return _json_body(
            request,
            http.NOT_FOUND,
            {
                "error": "not found",
                "path": request.path.decode("utf-8", "replace"),
                "paths": list(PATHS),
            },
        )


class _Index(_AdminResource):
    """``/``: the paths the admin site serves, each with a line about it."""

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Serve the index for ``/`` itself and 404 for unknown children."""
        if not path and not request.postpath:
            return self
        return _NotFound()

    def render_GET(self, request: IRequest) -> bytes:
        """Return the index."""
        return _json_body(request, http.OK, {"paths": dict(PATHS)})


class _Health(_AdminResource):
    """``/healthz``: 200 when ok or degraded, 503 when unavailable."""

    def __init__(self, health: Callable[[], HealthReport]) -> None:
        super().__init__()
        self._health = health

    def render_GET(self, request: IRequest) -> bytes:
        """Return a fresh health report."""
        report = self._health()
        code = http.OK if report.ok else http.SERVICE_UNAVAILABLE
        return _json_body(request, code, report.to_json())


class _Metrics(_AdminResource):
    """``/metrics``: the service's own registry (never the global one)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: IRequest) -> bytes:
        """Return the registry in the Prometheus text exposition format."""
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        body: bytes = generate_latest(self._metrics.registry)
        return body


class _Routes(_AdminResource):
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
        return _json_body(request, http.OK, [describe(bound) for bound in table.routes])


class LeaseMaker(Protocol):
    """What ``/leases`` needs (`gateway.protocols.dmp.leases.LeaseDesk` is one)."""

    @property
    def enabled(self) -> bool:
        """Whether an admin token is configured."""

    def authorized(self, token: bytes | None) -> bool:
        """Whether the token is the admin token."""

    def make(self, listener: str, kind: str, target: str, ttl_seconds: float) -> dict[str, object]:
        """Grant a lease (raises an error with ``status`` and ``reason``)."""

    def revoke(self, text: str) -> bool:
        """Revoke a lease; whether it existed."""


class _Leases(_AdminResource):
    """``POST /leases`` makes a DMP lease; ``DELETE /leases/TEXT`` revokes it."""

    def __init__(self, desk: LeaseMaker, text: str | None = None) -> None:
        super().__init__()
        self._desk = desk
        self._text = text

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """``/leases/TEXT``: one lease, for DELETE."""
        if self._text is None and path:
            return _Leases(self._desk, path.decode("utf-8", "replace"))
        return _NotFound()

    def _respond(self, request: IRequest) -> bytes:
        allowed = b"DELETE" if self._text is not None else b"POST"
        if request.method != allowed:
            request.setHeader(b"Allow", allowed)
            return _json_body(request, http.NOT_ALLOWED, {"error": "method not allowed"})
        if not self._desk.enabled:
            return _json_body(
                request,
                http.FORBIDDEN,
                {"error": "the lease API is off: give [logins] admin a secret to turn it on"},
            )
        header = request.getHeader(b"Authorization") or b""
        token = header[7:] if header.startswith(b"Bearer ") else None
        if not self._desk.authorized(token):
            request.setHeader(b"WWW-Authenticate", b'Bearer realm="msggateway"')
            return _json_body(
                request, http.UNAUTHORIZED, {"error": "a valid admin token is needed"}
            )
        if self._text is not None:
            if self._desk.revoke(self._text):
                return _json_body(request, http.OK, {"revoked": True})
            return _json_body(request, http.NOT_FOUND, {"error": "no such lease"})
        try:
            asked = json.loads(request.content.read() if request.content else b"")
            if not isinstance(asked, dict):
                raise ValueError("not an object")
            listener = str(asked["listener"])
            kind = "sink" if "sink" in asked else "feed"
            target = str(asked[kind])
            ttl = float(asked.get("ttl_seconds", 3600))
        except (ValueError, KeyError, TypeError) as exc:
            return _json_body(
                request,
                http.BAD_REQUEST,
                {
                    "error": f'want JSON like {{"listener": "dmp", "sink": "orders",'
                    f' "ttl_seconds": 3600}} ({exc})'
                },
            )
        try:
            made = self._desk.make(listener, kind, target, ttl)
        except ValueError as exc:
            status = getattr(exc, "status", http.BAD_REQUEST)
            return _json_body(request, status, {"error": getattr(exc, "reason", str(exc))})
        return _json_body(request, http.CREATED, made)


class _QuietSite(Site):
    """A `Site` that keeps no access log and does not announce its factory.

    Prometheus and health checks poll every few seconds; a line per request
    would drown the gateway's own events, and ``/metrics`` already counts
    what matters.
    """

    noisy = False

    def __init__(self, resource: IResource, reactor: IReactorTime) -> None:
        super().__init__(resource, reactor=reactor)  # type: ignore[no-untyped-call]  # as above
        # Already Twisted's default, stated because it matters here: a failing
        # render must not show code or values to whoever asks.
        self.displayTracebacks = False

    def log(self, request: http.Request) -> None:
        """Skip the access log line."""


def make_admin_resource(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    leases: LeaseMaker | None = None,
) -> IResource:
    """Build the admin resource tree (also what in-memory tests serve).

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists.
        health: Called per ``/healthz`` request for a fresh report.
        leases: Makes and revokes DMP leases (``/leases``), if any.

    Returns:
        The root resource: ``/``, ``/healthz``, ``/metrics``, ``/routes``
        and ``/leases``.
    """
    root = _Index()
    root.putChild(b"healthz", _Health(health))
    root.putChild(b"metrics", _Metrics(metrics))
    root.putChild(b"routes", _Routes(router, metrics))
    if leases is not None:
        root.putChild(b"leases", _Leases(leases))
    return root


def make_admin_site(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    reactor: IReactorTime,
    leases: LeaseMaker | None = None,
) -> Site:
    """Build the admin site, ready to listen on a (loopback) endpoint.

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists.
        health: Called per ``/healthz`` request for a fresh report.
        reactor: Times out idle HTTP connections.
        leases: Makes and revokes DMP leases (``/leases``), if any.

    Returns:
        A `Site` over `make_admin_resource`, without an access log.
    """
    resource = make_admin_resource(metrics=metrics, router=router, health=health, leases=leases)
    return _QuietSite(resource, reactor=reactor)
