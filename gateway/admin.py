"""The admin HTTP endpoint: health, Prometheus metrics and the live route table.

DESIGN.md, "Operations": a small twisted.web site, meant to listen on
loopback (the assembly chooses the endpoint string), with three read-only
paths:

- ``/healthz``: whether the gateway is serving, as JSON (see `HealthReport`);
- ``/metrics``: the service's own Prometheus registry in the text format;
- ``/routes``: the route table in use right now, with live per-route numbers;
- ``/leases`` (when the gateway has DMP listeners): ``POST`` makes a DMP
  lease, ``DELETE /leases/TEXT`` revokes one; both need ``Authorization:
  Bearer TOKEN`` with the secret of ``admin`` in the secrets file;
- ``/tap``: ``GET /tap?listener=NAME|route=NAME&match=PATTERN&sample=RATE&max=N``
  with the same admin token streams the messages passing there, as JSON
  lines, until the client goes away or the gateway stops (`_Tap`;
  ``msggateway tap`` reads it).

``/`` lists them. Every answer is JSON except ``/metrics``, carries
``Cache-Control: no-store`` and is generated afresh per request, so a route
reload or a listener going down shows at once. Only GET and HEAD are allowed;
any other method gets a JSON 405 with an ``Allow`` header, any other path a
JSON 404. The read-only paths need no authentication: nothing served there
is secret (names, patterns, counts), and the endpoint is not meant to leave
the host. Before any of that, the site's HTTP channel
(`gateway.adminhttp.AdminChannel`) answers only requests whose Host names
the endpoint (against DNS rebinding: 421 otherwise) and bounds request
bodies (413), before they are read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Final, Protocol, TypeVar, cast

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IReactorCore, IReactorTime
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from gateway.adminhttp import AdminChannel, AdminRequest, HostPolicy
from gateway.core.addressing import AddressPattern, PatternError
from gateway.core.auth import Secrets
from gateway.core.message import Status
from gateway.core.router import BoundRoute, Router
from gateway.core.tap import DEFAULT_TAP_RECORDS, MAX_TAP_RECORDS, Tap, TapWriter
from gateway.metrics import GatewayMetrics, RouteStats
from gateway.protocols.dmp.leases import LeaseDesk

__all__ = ["AdminToken", "HealthReport", "LeaseMaker", "make_admin_resource", "make_admin_site"]

JSON_CONTENT_TYPE: Final = b"application/json"
"""RFC 8259 fixes JSON's encoding as UTF-8 and defines no charset parameter."""

ALLOWED_METHODS: Final = (b"GET", b"HEAD")

_N = TypeVar("_N", int, float)

TAP_CONTENT_TYPE: Final = b"application/x-ndjson"
"""``/tap`` answers newline-delimited JSON: one object per line, as it comes."""
TAP_PARAMETERS: Final = frozenset({"listener", "route", "match", "sample", "max"})
MAX_TAPS: Final = 16
"""Taps open at once: each costs the router work per batch on its listener or route."""
TAP_END_SECONDS: Final = 1.0
"""How long a stopping gateway waits for its taps' clients to get their last lines."""
TAP_END_POLL_SECONDS: Final = 0.01
TAP_END_REASON: Final = "the gateway is stopping"
TAP_PATH_HELP: Final = (
    "watch messages live (admin token): ?listener=NAME or ?route=NAME,"
    " &match=PATTERN&sample=RATE&max=RECORDS"
)

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

    def __init__(self, paths: Mapping[str, str]) -> None:
        super().__init__()
        self._paths = paths

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Serve the index for ``/`` itself and 404 for unknown children."""
        if not path and not request.postpath:
            return self
        return _NotFound()

    def render_GET(self, request: IRequest) -> bytes:
        """Return the index."""
        return _json_body(request, http.OK, {"paths": dict(self._paths)})


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


class AdminToken(Protocol):
    """Checks the admin token (`gateway.protocols.dmp.leases.LeaseDesk` does)."""

    @property
    def enabled(self) -> bool:
        """Whether an admin token is configured."""

    def authorized(self, token: bytes | None) -> bool:
        """Whether the token is the admin token."""


def _refused_without_token(request: IRequest, admin: AdminToken | None, api: str) -> bytes | None:
    """The answer to a request without the admin token (403 or 401), None when it has it.

    Args:
        request: Carries ``Authorization: Bearer TOKEN``.
        admin: Checks the token; None when the gateway has no way to.
        api: Names the API in the 403 answer.
    """
    if admin is None or not admin.enabled:
        return _json_body(
            request,
            http.FORBIDDEN,
            {"error": f"the {api} API is off: set admin_token in the secrets file to turn it on"},
        )
    header = request.getHeader(b"Authorization") or b""
    token = header[7:] if header.startswith(b"Bearer ") else None
    if not admin.authorized(token):
        request.setHeader(b"WWW-Authenticate", b'Bearer realm="msggateway"')
        return _json_body(request, http.UNAUTHORIZED, {"error": "a valid admin token is needed"})
    return None


class LeaseMaker(AdminToken, Protocol):
    """What ``/leases`` needs (`gateway.protocols.dmp.leases.LeaseDesk` is one)."""

    def make(
        self,
        listener: str,
        kind: str,
        target: str,
        ttl_seconds: float,
        identity: str | None = None,
    ) -> dict[str, object]:
        """Grant a lease, bound to ``identity`` if given.

        Raises:
            ValueError: With ``status`` and ``reason``: it cannot be granted.
        """

    def revoke(self, text: str) -> bool | Deferred[bool]:
        """Revoke a lease; whether it existed (later, when other nodes must hear of it).

        The Deferred fails with a ValueError carrying ``status`` and
        ``reason`` when the revocation could not be passed on.
        """


LEASE_KEYS: Final = frozenset({"listener", "sink", "feed", "ttl_seconds", "identity"})
LEASE_EXAMPLE: Final = (
    '{"listener": "dmp", "sink": "orders", "ttl_seconds": 3600, "identity": "alice"}'
    " (sink or feed; ttl_seconds and identity optional)"
)
DEFAULT_LEASE_TTL_SECONDS: Final = 3600.0


@attrs.frozen
class _LeaseAsked:
    """What a ``POST /leases`` body asks for."""

    listener: str
    kind: str
    target: str
    ttl_seconds: float
    identity: str | None


def _lease_asked(body: bytes) -> _LeaseAsked:
    """Read a ``POST /leases`` body, refusing anything it does not understand.

    A key it does not know is refused rather than ignored: a misspelt
    ``identity`` must not make a lease anyone holding it may use.

    Raises:
        ValueError: Not JSON, not an object, an unknown key, or a value of
            the wrong type; the message says which.
    """
    asked = json.loads(body)
    if not isinstance(asked, dict):
        raise ValueError("the body is not a JSON object")
    unknown = sorted(set(asked) - LEASE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s): {', '.join(map(repr, unknown))}")
    kinds = [kind for kind in ("sink", "feed") if kind in asked]
    if len(kinds) != 1:
        raise ValueError("name a sink or a feed, one of them")
    kind = kinds[0]
    for key in ("listener", kind, "identity"):
        if key in asked and not isinstance(asked[key], str):
            raise ValueError(f"{key} must be a string")
    if "listener" not in asked:
        raise ValueError("name the listener")
    ttl = asked.get("ttl_seconds", DEFAULT_LEASE_TTL_SECONDS)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ValueError("ttl_seconds must be a number")
    return _LeaseAsked(
        listener=asked["listener"],
        kind=kind,
        target=asked[kind],
        ttl_seconds=float(ttl),
        identity=asked.get("identity"),
    )


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
        refusal = _refused_without_token(request, self._desk, "lease")
        if refusal is not None:
            return refusal
        if self._text is not None:
            revoked = self._desk.revoke(self._text)
            if isinstance(revoked, Deferred):
                _answer_later(request, revoked)
                return NOT_DONE_YET  # type: ignore[return-value]  # twisted.web's marker
            return _revocation(request, revoked)
        try:
            asked = _lease_asked(request.content.read() if request.content else b"")
        except ValueError as exc:
            return _json_body(
                request, http.BAD_REQUEST, {"error": f"{exc}; want JSON like {LEASE_EXAMPLE}"}
            )
        try:
            made = self._desk.make(
                asked.listener, asked.kind, asked.target, asked.ttl_seconds, asked.identity
            )
        except ValueError as exc:
            status = getattr(exc, "status", http.BAD_REQUEST)
            return _json_body(request, status, {"error": getattr(exc, "reason", str(exc))})
        return _json_body(request, http.CREATED, made)


def _revocation(request: IRequest, found: bool) -> bytes:
    """The answer to ``DELETE /leases/TEXT``: 200, or 404 for a lease that is not known."""
    if found:
        return _json_body(request, http.OK, {"revoked": True})
    return _json_body(request, http.NOT_FOUND, {"error": "no such lease"})


def _answer_later(request: IRequest, revoked: Deferred[bool]) -> None:
    """Answer ``DELETE /leases/TEXT`` once the revocation reached the fleet (or did not)."""
    gone: list[bool] = []
    cast(Request, request).notifyFinish().addErrback(lambda _: gone.append(True))

    def write(body: bytes) -> None:
        if not gone:
            request.write(body)
            request.finish()

    def failed(failure: Failure) -> None:
        refusal = failure.value
        status = getattr(refusal, "status", http.INTERNAL_SERVER_ERROR)
        write(_json_body(request, status, {"error": getattr(refusal, "reason", str(refusal))}))

    revoked.addCallbacks(lambda found: write(_revocation(request, found)), failed)


class _TapRefusedError(Exception):
    """A ``/tap`` request that cannot be served: the status and the JSON to answer."""

    def __init__(self, status: int, answer: dict[str, object]) -> None:
        super().__init__(answer["error"])
        self.status = status
        self.answer = answer


class _Tap(Resource):
    """``GET /tap``: the messages passing a listener or a route, live, as JSON lines.

    Query: ``listener=NAME`` (a listener or upstream) or ``route=NAME``;
    ``match=PATTERN`` (route pattern syntax, on the source address or any
    recipient); ``sample=RATE`` (above 0, at most 1; default 1);
    ``max=RECORDS`` (records kept for a slow reader before they are
    dropped; default `DEFAULT_TAP_RECORDS`). Needs the admin token, as
    ``/leases`` does. The answer is 200 with a chunked body written by
    `TapWriter` until the client goes away or the gateway stops; errors are
    JSON: 401/403 without the token, 400 for a bad query, 404 naming an
    unknown listener or route, 503 past `MAX_TAPS`.

    Args:
        router: Whose batches are tapped, and whose table names the routes.
        health: Names the listeners and upstreams.
        admin: Checks the admin token; None when none can be checked.
        clock: For the records' times and the writers' timers.
    """

    def __init__(
        self,
        router: Router,
        health: Callable[[], HealthReport],
        admin: AdminToken | None,
        clock: IReactorTime,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # twisted.web leaves it unannotated
        self._router = router
        self._health = health
        self._admin = admin
        self._clock = clock
        self.open: dict[TapWriter, Request] = {}
        """Each open tap's writer and its request."""

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        """Answer 404 for anything below ``/tap``."""
        return _NotFound()

    def render(self, request: Request) -> bytes | int:
        """Start streaming a tap, or answer why not."""
        request.setHeader(b"Cache-Control", b"no-store")
        request.setHeader(b"X-Content-Type-Options", b"nosniff")
        if request.method != b"GET":
            request.setHeader(b"Allow", b"GET")
            return _json_body(request, http.NOT_ALLOWED, {"error": "method not allowed"})
        refusal = _refused_without_token(request, self._admin, "tap")
        if refusal is not None:
            return refusal
        try:
            tap = self._tap(request)
        except _TapRefusedError as exc:
            return _json_body(request, exc.status, exc.answer)
        if len(self.open) >= MAX_TAPS:
            return _json_body(
                request,
                http.SERVICE_UNAVAILABLE,
                {"error": f"{MAX_TAPS} taps are open already: close one first"},
            )
        request.setResponseCode(http.OK)
        request.setHeader(b"Content-Type", TAP_CONTENT_TYPE)
        writer = TapWriter(tap, self._router, request, self._clock)
        self.open[writer] = request
        request.notifyFinish().addBoth(self._closed, writer)
        writer.start()
        return NOT_DONE_YET

    def _closed(self, result: object, writer: TapWriter) -> None:
        """The response ended (or its connection went): stop tapping."""
        self.open.pop(writer, None)
        writer.stop(unregister=False)

    def end_all(self, reason: str) -> Deferred[None]:
        """End every open tap's response, saying why, and close its connection.

        Returns:
            A Deferred that fires once those connections have closed, their
            last lines sent (at most `TAP_END_SECONDS` later): the reactor
            drops the connections still open when it stops, unsent bytes
            and all.
        """
        transports = []
        for writer, request in list(self.open.items()):
            transport = request.transport
            writer.end(reason)
            request.finish()
            if transport is not None:
                transports.append(transport)
                transport.loseConnection()  # once what is written has gone
        done: Deferred[None] = Deferred()
        deadline = self._clock.seconds() + TAP_END_SECONDS

        def closed() -> None:
            if self._clock.seconds() >= deadline or not any(
                getattr(transport, "connected", False) for transport in transports
            ):
                done.callback(None)
            else:
                self._clock.callLater(TAP_END_POLL_SECONDS, closed)

        closed()
        return done

    def _tap(self, request: IRequest) -> Tap:
        """The tap the query asks for.

        Raises:
            _TapRefusedError: The query is wrong (400) or names what does not exist (404).
        """
        args: dict[str, list[str]] = {
            key.decode("utf-8", "replace"): [value.decode("utf-8", "replace") for value in values]
            for key, values in (request.args or {}).items()
        }
        unknown = sorted(set(args) - TAP_PARAMETERS)
        if unknown:
            raise _TapRefusedError(
                http.BAD_REQUEST,
                {
                    "error": f"unknown parameter(s): {', '.join(unknown)}",
                    "parameters": sorted(TAP_PARAMETERS),
                },
            )

        def one(name: str) -> str | None:
            values = args.get(name)
            if not values:
                return None
            if len(values) > 1:
                raise _TapRefusedError(http.BAD_REQUEST, {"error": f"give {name} once"})
            return values[0]

        listener, route = one("listener"), one("route")
        if (listener is None) == (route is None):
            raise _TapRefusedError(
                http.BAD_REQUEST,
                {"error": "name a listener (listener=NAME) or a route (route=NAME), one of them"},
            )
        table = self._router.table
        if listener is not None:
            report = self._health()
            known = sorted({*report.listeners, *report.upstreams, *table.sources()})
            if listener not in known:
                raise _TapRefusedError(
                    http.NOT_FOUND,
                    {
                        "error": f"no listener or upstream named {listener!r}",
                        "listener": listener,
                        "known": known,
                    },
                )
        if route is not None:
            names = [bound.route.name for bound in table.routes]
            if route not in names:
                raise _TapRefusedError(
                    http.NOT_FOUND,
                    {"error": f"no route named {route!r}", "route": route, "known": names},
                )
        match = one("match")
        try:
            pattern = None if match is None else AddressPattern(match)
        except PatternError as exc:
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": f"bad pattern: {exc}", "match": match}
            ) from None
        sample = _number(one("sample"), float, 1.0, "sample", "a rate above 0 and at most 1")
        if not (math.isfinite(sample) and 0.0 < sample <= 1.0):
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": "sample is a rate above 0 and at most 1"}
            )
        records = _number(one("max"), int, DEFAULT_TAP_RECORDS, "max", "a count of records")
        if not 1 <= records <= MAX_TAP_RECORDS:
            raise _TapRefusedError(
                http.BAD_REQUEST, {"error": f"max is 1 to {MAX_TAP_RECORDS} records"}
            )
        return Tap(
            listener=listener, route=route, pattern=pattern, sample=sample, max_records=records
        )


def _number(text: str | None, kind: Callable[[str], _N], default: _N, name: str, what: str) -> _N:
    """A query parameter's number, its default when absent.

    Raises:
        _TapRefusedError: It is not a number (400).
    """
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise _TapRefusedError(
            http.BAD_REQUEST, {"error": f"{name} is {what}, not {text!r}"}
        ) from None


class _QuietSite(Site):
    """A `Site` that keeps no access log and does not announce its factory.

    Prometheus and health checks poll every few seconds; a line per request
    would drown the gateway's own events, and ``/metrics`` already counts
    what matters. Its channels check Host and bound request bodies
    (`AdminChannel`); it parses no HTML form bodies (nothing here takes one).
    """

    noisy = False
    # Twisted types its channels as the wrapper that can negotiate HTTP/2 over
    # TLS (ALPN); this site serves HTTP/1.1 only, on channels of its own.
    protocol = AdminChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: IResource,
        reactor: IReactorTime,
        tap: _Tap | None = None,
        hosts: HostPolicy | None = None,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]  # as above
            resource, AdminRequest, reactor=reactor, parsePOSTFormSubmission=False
        )
        # Already Twisted's default, stated because it matters here: a failing
        # render must not show code or values to whoever asks.
        self.displayTracebacks = False
        self._tap = tap
        self._hosts = hosts if hosts is not None else HostPolicy()
        self._shutdown: tuple[IReactorCore, object] | None = None

    def buildProtocol(self, addr: IAddress | None) -> AdminChannel:  # type: ignore[override]
        """A channel that answers by this site's Host policy (see ``protocol``)."""
        channel = super().buildProtocol(addr)  # type: ignore[no-untyped-call]  # as above
        assert isinstance(channel, AdminChannel)
        channel.hosts = self._hosts
        return channel

    def doStart(self) -> None:
        """Listening: end the taps before the reactor stops, while their last lines can go."""
        super().doStart()  # type: ignore[no-untyped-call]  # as above
        reactor = self.reactor
        if self._tap is not None and self._shutdown is None and IReactorCore.providedBy(reactor):
            trigger = reactor.addSystemEventTrigger("before", "shutdown", self._stopping)
            self._shutdown = (reactor, trigger)

    def _stopping(self) -> Deferred[None] | None:
        self._shutdown = None  # fired: not to be removed
        return None if self._tap is None else self._tap.end_all(TAP_END_REASON)

    def doStop(self) -> None:
        """Once the last port stops listening, end the taps' streams (if still open)."""
        super().doStop()  # type: ignore[no-untyped-call]  # as above
        if self.numPorts:
            return
        if self._shutdown is not None:
            reactor, trigger = self._shutdown
            self._shutdown = None
            reactor.removeSystemEventTrigger(trigger)
        if self._tap is not None:
            self._tap.end_all(TAP_END_REASON)

    def log(self, request: http.Request) -> None:
        """Skip the access log line."""


def _build(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    leases: LeaseMaker | None,
    clock: IReactorTime | None,
    admin: AdminToken | None,
) -> tuple[IResource, _Tap | None]:
    paths = dict(PATHS)
    tap = None
    if clock is not None:
        tap = _Tap(router, health, admin if admin is not None else leases, clock)
        paths["/tap"] = TAP_PATH_HELP
    root = _Index(MappingProxyType(paths))
    root.putChild(b"healthz", _Health(health))
    root.putChild(b"metrics", _Metrics(metrics))
    root.putChild(b"routes", _Routes(router, metrics))
    if leases is not None:
        root.putChild(b"leases", _Leases(leases))
    if tap is not None:
        root.putChild(b"tap", tap)
    return root, tap


def make_admin_resource(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    leases: LeaseMaker | None = None,
    clock: IReactorTime | None = None,
    admin: AdminToken | None = None,
) -> IResource:
    """Build the admin resource tree (also what in-memory tests serve).

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists and whose
            batches ``/tap`` watches.
        health: Called per ``/healthz`` request for a fresh report.
        leases: Makes and revokes DMP leases (``/leases``), if any.
        clock: Times ``/tap``'s records; without it there is no ``/tap``.
        admin: Checks ``/tap``'s admin token (default: ``leases``; with
            neither, ``/tap`` answers 403).

    Returns:
        The root resource: ``/``, ``/healthz``, ``/metrics``, ``/routes``,
        ``/leases`` and ``/tap``.
    """
    root, _tap = _build(
        metrics=metrics, router=router, health=health, leases=leases, clock=clock, admin=admin
    )
    return root


def make_admin_site(
    *,
    metrics: GatewayMetrics,
    router: Router,
    health: Callable[[], HealthReport],
    reactor: IReactorTime,
    leases: LeaseMaker | None = None,
    secrets: Secrets | None = None,
    allowed_hosts: Iterable[str] = (),
) -> Site:
    """Build the admin site, ready to listen on a (loopback) endpoint.

    Args:
        metrics: The service's metrics; ``/metrics`` serves its registry and
            ``/routes`` reads its per-route collectors.
        router: The router whose current table ``/routes`` lists and whose
            batches ``/tap`` watches.
        health: Called per ``/healthz`` request for a fresh report.
        reactor: Times out idle HTTP connections, times ``/tap``.
        leases: Makes and revokes DMP leases (``/leases``), if any.
        secrets: Holds the admin token (the secret of ``admin``), checked
            as ``/leases`` checks it; without it (and without ``leases``)
            ``/tap`` answers 403.
        allowed_hosts: Host names and addresses requests may name besides
            the address they arrive on (`HostPolicy`).

    Returns:
        A `Site` over the resources of `make_admin_resource`, without an
        access log, that ends ``/tap`` streams when it stops listening,
        and answers only requests with an allowed Host and a small body.

    Raises:
        gateway.adminhttp.HostError: An allowed host names no host.
    """
    admin = leases
    if admin is None and secrets is not None:
        admin = LeaseDesk({}, secrets, reactor)  # no DMP listeners: it only checks the token
    root, tap = _build(
        metrics=metrics, router=router, health=health, leases=leases, clock=reactor, admin=admin
    )
    return _QuietSite(root, reactor=reactor, tap=tap, hosts=HostPolicy.of(allowed_hosts))
