"""Tests for the admin HTTP endpoint: /, /healthz, /metrics, /routes and /leases.

Most tests serve the resource tree in memory through `treq.testing.StubTreq`;
one listens on a real loopback port and fetches with real `treq`.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import attrs
import pytest
import pytest_twisted
import treq
from prometheus_client import CONTENT_TYPE_LATEST
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.iweb import IResponse
from twisted.web.resource import IResource
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.admin.health import HealthReport
from gateway.admin.site import make_admin_resource, make_admin_site
from gateway.codecs import dmp
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.interfaces import IRouteDelivery
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import BoundRoute, Route, Router, RouteTable
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.leases import LeaseDesk
from gateway.protocols.dmp.server import DMPServerFactory
from gateway.protocols.dmp.settings import DMPListenerSettings
from tests.certs import CertifiedKey, issue_client_certificate, make_ca
from tests.doubles import NO_LOGIN_WAIT, deliver_each, dispatch_one
from tests.protocols.test_dmp_server import read
from tests.protocols.test_ssmp_server import TLSStringTransport

T = TypeVar("T")

BASE = "http://admin.invalid"
"""Any URL works with StubTreq; this one cannot reach anything real."""


@implementer(IRouteDelivery)
class _HeldDelivery:
    """A route delivery whose outcomes the test decides, one message at a time."""

    def __init__(self) -> None:
        self.held: list[tuple[Message, Deferred[Outcome]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hold each message of the batch."""
        return deliver_each(self._hold, messages)

    def _hold(self, message: Message) -> Deferred[Outcome]:
        """Keep the message; its outcome comes when the test fires the Deferred."""
        d: Deferred[Outcome] = Deferred()
        self.held.append((message, d))
        return d


@implementer(IRouteDelivery)
class _AcceptingDelivery:
    """A route delivery that accepts every message at once."""

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Accept the messages."""
        return succeed([Outcome.accepted()] * len(messages))


@attrs.define
class _Gateway:
    """What the admin site looks at: metrics, a router on a clock, its deliveries."""

    metrics: GatewayMetrics
    clock: Clock
    router: Router
    weather: _HeldDelivery
    orders: _AcceptingDelivery
    health: HealthReport


WEATHER = Route(
    name="weather",
    source="ssmp-in",
    pattern=AddressPattern("weather.*"),
    destination="rabbit",
    target=AddressTemplate("archive.{1}"),
    timeout_seconds=5.0,
)
ORDERS = Route(
    name="orders",
    source="ssmp-in",
    pattern=AddressPattern("orders"),
    destination="qmqp-out",
    durable=True,
)


@pytest.fixture
def gateway() -> _Gateway:
    """Return a real router with two routes, real metrics and a healthy report."""
    metrics = GatewayMetrics()
    clock = Clock()
    weather = _HeldDelivery()
    orders = _AcceptingDelivery()
    table = RouteTable([BoundRoute(WEATHER, weather), BoundRoute(ORDERS, orders)])
    return _Gateway(
        metrics=metrics,
        clock=clock,
        router=Router(table, clock, metrics),
        weather=weather,
        orders=orders,
        health=HealthReport(listeners={"ssmp-in": True}, upstreams={"rabbit": True}),
    )


def _resource(gateway: _Gateway) -> IResource:
    """Return the admin resource over the gateway, asking ``gateway.health`` each time."""
    return make_admin_resource(
        metrics=gateway.metrics, router=gateway.router, health=lambda: gateway.health
    )


def _stub(gateway: _Gateway) -> StubTreq:
    """Return an in-memory HTTP client for the gateway's admin resource."""
    return StubTreq(_resource(gateway))


def _result(d: Deferred[T]) -> T:
    """Return what an already fired Deferred fired with, or raise its failure."""
    results: list[T] = []
    failures: list[Failure] = []
    d.addCallbacks(results.append, failures.append)
    if failures:
        failures[0].raiseException()
    assert results, "the Deferred has not fired"
    return results[0]


def _dispatch(router: Router, address: str, body: bytes) -> Deferred[Outcome]:
    """Dispatch a message from ``ssmp-in``, which some route must take."""
    d = dispatch_one(router, "ssmp-in", Message(body=body, address=address))
    assert d is not None, f"no route takes {address}"
    return d


def _request(stub: StubTreq, method: str, path: str) -> tuple[IResponse, bytes]:
    """Make one in-memory request; return the response and its whole body."""
    response: IResponse = _result(stub.request(method, BASE + path))
    body: bytes = _result(stub.content(response))
    return response, body


def _header(response: IResponse, name: str) -> str:
    """Return the single value of a response header."""
    values = response.headers.getRawHeaders(name)
    assert values is not None, f"no {name} header"
    assert len(values) == 1, f"{name} repeated: {values}"
    return str(values[0])


def _json(response: IResponse, body: bytes) -> Any:
    """Check that a response is uncached UTF-8 JSON and return its value."""
    assert _header(response, "Content-Type") == "application/json"
    assert _header(response, "Cache-Control") == "no-store"
    return json.loads(body.decode("utf-8"))


def _route(routes: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Return the ``/routes`` entry for the named route."""
    (found,) = [entry for entry in routes if entry["name"] == name]
    return found


def test_index_lists_the_paths(gateway: _Gateway) -> None:
    """``/`` answers 200 with uncached JSON naming the read-only paths and the status API."""
    response, body = _request(_stub(gateway), "GET", "/")
    assert response.code == 200
    assert sorted(_json(response, body)["paths"]) == [
        "/healthz",
        "/listeners",
        "/metrics",
        "/nodes",
        "/routes",
        "/streams",
        "/upstreams",
    ]


def test_healthz_ok(gateway: _Gateway) -> None:
    """All listeners listening and upstreams connected: 200 with status "ok"."""
    gateway.health = HealthReport(
        listeners={"ssmp-in": True, "qmqp-in": True}, upstreams={"rabbit": True}
    )
    response, body = _request(_stub(gateway), "GET", "/healthz")
    assert response.code == 200
    assert _json(response, body) == {
        "status": "ok",
        "listeners": {"qmqp-in": {"listening": True}, "ssmp-in": {"listening": True}},
        "upstreams": {"rabbit": {"connected": True}},
    }


def test_healthz_degraded_when_an_upstream_is_down(gateway: _Gateway) -> None:
    """An upstream down leaves the gateway serving: still 200, status "degraded"."""
    gateway.health = HealthReport(
        listeners={"ssmp-in": True}, upstreams={"rabbit": False, "dmp": True}
    )
    response, body = _request(_stub(gateway), "GET", "/healthz")
    assert response.code == 200
    assert _json(response, body) == {
        "status": "degraded",
        "listeners": {"ssmp-in": {"listening": True}},
        "upstreams": {"dmp": {"connected": True}, "rabbit": {"connected": False}},
    }


def test_healthz_unavailable_when_a_listener_is_not_listening(gateway: _Gateway) -> None:
    """A listener not listening: 503 with status "unavailable", whatever the upstreams."""
    gateway.health = HealthReport(
        listeners={"ssmp-in": False, "qmqp-in": True}, upstreams={"rabbit": True}
    )
    response, body = _request(_stub(gateway), "GET", "/healthz")
    assert response.code == 503
    assert _json(response, body) == {
        "status": "unavailable",
        "listeners": {"qmqp-in": {"listening": True}, "ssmp-in": {"listening": False}},
        "upstreams": {"rabbit": {"connected": True}},
    }


def test_healthz_asks_for_a_fresh_report_per_request(gateway: _Gateway) -> None:
    """The health callable is called on every request, so a change shows at once."""
    stub = _stub(gateway)
    assert _request(stub, "GET", "/healthz")[0].code == 200
    gateway.health = HealthReport(listeners={"ssmp-in": False})
    assert _request(stub, "GET", "/healthz")[0].code == 503
    gateway.health = HealthReport(listeners={"ssmp-in": True})
    assert _request(stub, "GET", "/healthz")[0].code == 200


def test_health_report_states() -> None:
    """``ok`` needs every listener; ``status`` is ok, degraded or unavailable."""
    assert HealthReport().ok
    assert HealthReport().status == "ok"
    degraded = HealthReport(listeners={"a": True}, upstreams={"b": False})
    assert (degraded.ok, degraded.status) == (True, "degraded")
    down = HealthReport(listeners={"a": False}, upstreams={"b": False})
    assert (down.ok, down.status) == (False, "unavailable")


def test_health_report_keeps_its_own_read_only_copy() -> None:
    """Changing the mappings a report was built from does not change the report."""
    listeners = {"a": True}
    report = HealthReport(listeners=listeners)
    listeners["a"] = False
    assert report.ok
    with pytest.raises(TypeError):
        report.listeners["a"] = False  # type: ignore[index]
    assert report == HealthReport(listeners={"a": True})


def test_metrics_serves_the_service_registry(gateway: _Gateway) -> None:
    """``/metrics`` is the service registry in the Prometheus text format, uncached.

    The process-wide default registry (with its ``python_info``) is not what
    is served.
    """
    assert _result(_dispatch(gateway.router, "orders", b"12")).is_accepted
    response, body = _request(_stub(gateway), "GET", "/metrics")
    assert response.code == 200
    assert _header(response, "Content-Type") == CONTENT_TYPE_LATEST
    assert _header(response, "Cache-Control") == "no-store"
    text = body.decode("utf-8")
    assert 'msggateway_route_messages_total{route="orders"} 1.0' in text.splitlines()
    assert 'msggateway_route_bytes_total{route="orders"} 2.0' in text.splitlines()
    assert (
        'msggateway_route_outcomes_total{outcome="accepted",route="orders"} 1.0'
        in text.splitlines()
    )
    assert "python_info" not in text


def test_routes_lists_the_configuration_with_zero_counts(gateway: _Gateway) -> None:
    """Before any traffic, ``/routes`` lists each route's settings and zeros, in order."""
    response, body = _request(_stub(gateway), "GET", "/routes")
    assert response.code == 200
    assert _json(response, body) == [
        {
            "name": "weather",
            "source": "ssmp-in",
            "pattern": "weather.*",
            "destination": "rabbit",
            "target": "archive.{1}",
            "durable": False,
            "timeout_seconds": 5.0,
            "messages": 0,
            "bytes": 0,
            "outcomes": {"accepted": 0, "retry": 0, "rejected": 0},
            "in_flight": 0,
            "forwarder": None,
        },
        {
            "name": "orders",
            "source": "ssmp-in",
            "pattern": "orders",
            "destination": "qmqp-out",
            "target": None,
            "durable": True,
            "timeout_seconds": 30.0,
            "messages": 0,
            "bytes": 0,
            "outcomes": {"accepted": 0, "retry": 0, "rejected": 0},
            "in_flight": 0,
            "forwarder": None,
        },
    ]


def test_routes_shows_live_counts(gateway: _Gateway) -> None:
    """``/routes`` counts messages, bytes, outcomes and deliveries still in flight.

    Three weather messages: one accepted, one rejected, one left without an
    outcome until the route's time-out turns it into a retry.
    """
    stub = _stub(gateway)
    router, weather = gateway.router, gateway.weather
    sent = [_dispatch(router, "weather.paris", b"sunny") for _ in range(3)]
    assert [message.address for message, _ in weather.held] == ["archive.paris"] * 3

    entry = _route(_json(*_request(stub, "GET", "/routes")), "weather")
    assert (entry["messages"], entry["bytes"], entry["in_flight"]) == (3, 15, 3)
    assert entry["outcomes"] == {"accepted": 0, "retry": 0, "rejected": 0}

    weather.held[0][1].callback(Outcome.accepted())
    weather.held[1][1].callback(Outcome.rejected("no such archive"))
    entry = _route(_json(*_request(stub, "GET", "/routes")), "weather")
    assert entry["in_flight"] == 1
    assert entry["outcomes"] == {"accepted": 1, "retry": 0, "rejected": 1}

    gateway.clock.advance(WEATHER.timeout_seconds)
    assert _result(sent[2]).status is Status.RETRY
    routes = _json(*_request(stub, "GET", "/routes"))
    entry = _route(routes, "weather")
    assert entry["in_flight"] == 0
    assert entry["outcomes"] == {"accepted": 1, "retry": 1, "rejected": 1}
    assert _route(routes, "orders")["messages"] == 0


def test_routes_shows_a_reloaded_table(gateway: _Gateway) -> None:
    """After the router's table is replaced, ``/routes`` lists the new routes."""
    stub = _stub(gateway)
    assert [entry["name"] for entry in _json(*_request(stub, "GET", "/routes"))] == [
        "weather",
        "orders",
    ]
    gateway.router.replace_table(RouteTable([BoundRoute(ORDERS, gateway.orders)]))
    assert [entry["name"] for entry in _json(*_request(stub, "GET", "/routes"))] == ["orders"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/nowhere"),
        ("GET", "/healthz/extra"),
        ("GET", "/metrics/"),
        ("GET", "//routes"),
        ("POST", "/nowhere"),
    ],
)
def test_unknown_path_is_a_json_404(gateway: _Gateway, method: str, path: str) -> None:
    """Any path the site does not serve gets a JSON 404 naming it, whatever the method."""
    response, body = _request(_stub(gateway), method, path)
    assert response.code == 404
    value = _json(response, body)
    assert value["error"] == "not found"
    assert value["path"] == path


@pytest.mark.parametrize("path", ["/", "/healthz", "/metrics", "/routes"])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS"])
def test_wrong_method_is_a_json_405(gateway: _Gateway, method: str, path: str) -> None:
    """A method other than GET or HEAD gets a JSON 405 with an Allow header."""
    response, body = _request(_stub(gateway), method, path)
    assert response.code == 405
    assert _header(response, "Allow") == "GET, HEAD"
    assert _json(response, body) == {
        "error": "method not allowed",
        "method": method,
        "allowed": ["GET", "HEAD"],
    }


@pytest.mark.parametrize("path", ["/", "/healthz", "/metrics", "/routes"])
def test_head_gets_the_headers_of_get(gateway: _Gateway, path: str) -> None:
    """HEAD answers with GET's status, type and length, and no body."""
    stub = _stub(gateway)
    got, got_body = _request(stub, "GET", path)
    head, head_body = _request(stub, "HEAD", path)
    assert head_body == b""
    assert head.code == got.code == 200
    assert _header(head, "Content-Type") == _header(got, "Content-Type")
    assert _header(head, "Cache-Control") == "no-store"
    assert int(_header(head, "Content-Length")) == len(got_body)


def test_delivery_doubles_provide_the_interface() -> None:
    """The test deliveries really provide `IRouteDelivery`."""
    assert verifyObject(IRouteDelivery, _HeldDelivery())
    assert verifyObject(IRouteDelivery, _AcceptingDelivery())


class _ConnectionTracker(WrappingFactory):
    """Wraps the site to know when every server-side connection has closed."""

    noisy = False

    def __init__(self, site: Any) -> None:
        super().__init__(site)
        self._waiting: list[Deferred[None]] = []

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:  # noqa: N802  # Twisted's name
        """Forget a closed connection; wake the waiters when none are left."""
        super().unregisterProtocol(p)
        if not self.protocols:
            waiting, self._waiting = self._waiting, []
            for d in waiting:
                d.callback(None)

    def all_closed(self) -> Deferred[None]:
        """Return a Deferred that fires once no connection is open."""
        if not self.protocols:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        return d


@pytest_twisted.inlineCallbacks
def test_loopback_serves_healthz_and_metrics(
    gateway: _Gateway,
) -> Generator[Deferred[Any], Any, None]:
    """On a real loopback port, /healthz and /metrics answer, quietly and cleanly.

    The site writes no access log line, and once the client is done and the
    port has stopped, no connection is left open.
    """
    from twisted.internet import reactor

    assert _result(_dispatch(gateway.router, "orders", b"x")).is_accepted
    site = make_admin_site(
        metrics=gateway.metrics,
        router=gateway.router,
        health=lambda: gateway.health,
        reactor=reactor,
    )
    tracker = _ConnectionTracker(site)
    port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(tracker)
    pool = HTTPConnectionPool(reactor, persistent=False)
    base = f"http://127.0.0.1:{port.getHost().port}"
    try:
        with capturedLogs() as events:
            health = yield treq.get(base + "/healthz", pool=pool)
            health_body = yield treq.json_content(health)
            metrics = yield treq.get(base + "/metrics", pool=pool)
            metrics_text = yield treq.text_content(metrics)
    finally:
        yield port.stopListening()
        yield pool.closeCachedConnections()
    # A bound in case a connection lingers: the test fails instead of hanging.
    yield tracker.all_closed().addTimeout(10, reactor)

    assert health.code == 200
    assert health_body["status"] == "ok"
    assert metrics.code == 200
    assert metrics.headers.getRawHeaders("Content-Type") == [CONTENT_TYPE_LATEST]
    assert 'msggateway_route_messages_total{route="orders"} 1.0' in metrics_text.splitlines()
    logged = [formatEvent(event) for event in events]
    assert not [line for line in logged if "/healthz" in line or "/metrics" in line]
    assert not tracker.protocols


# --- /leases ----------------------------------------------------------------------------------


LEASE_TOKEN = "t0ken"


def _lease_desk() -> tuple[LeaseDesk, DMPServerFactory]:
    """A lease desk over one DMP listener ``dmp`` with sink ``orders``, on a clock."""
    clock = Clock()
    clock.advance(1000)
    factory = DMPServerFactory(
        name="dmp",
        settings=DMPListenerSettings(sinks=frozenset({"orders"}), feeds=frozenset({"alerts"})),
        router=Router(RouteTable(), clock),
        secrets=Secrets(),
        clock=clock,
    )
    factory.login_failures = NO_LOGIN_WAIT  # refused leases answered at once
    desk = LeaseDesk({"dmp": factory}, Secrets(admin_token=LEASE_TOKEN.encode()), clock)
    return desk, factory


def _post_lease(desk: LeaseDesk, body: object) -> tuple[int, Any]:
    """POST /leases with the admin token; the status and JSON answer."""
    gateway_metrics = GatewayMetrics()
    clock = Clock()
    resource = make_admin_resource(
        metrics=gateway_metrics,
        router=Router(RouteTable(), clock),
        health=HealthReport,
        leases=desk,
    )
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response: IResponse = _result(
        StubTreq(resource).post(
            BASE + "/leases", data=data, headers={"Authorization": f"Bearer {LEASE_TOKEN}"}
        )
    )
    return response.code, json.loads(_result(StubTreq(resource).content(response)))


def _open_sink(factory: DMPServerFactory, lease: str, transport: StringTransport) -> int:
    """Open a DMP connection with ``lease``; the code of the lease response."""
    protocol = factory.buildProtocol(None)
    assert protocol is not None
    protocol.makeConnection(transport)
    raw = lease.encode()
    protocol.dataReceived(dmp.PROTOCOL_HEADER + bytes((len(raw),)) + raw)
    answer = read(transport)[-1]
    assert isinstance(answer, dmp.Response)
    return answer.code


@pytest.fixture(scope="module")
def client_ca() -> CertifiedKey:
    """A CA for client certificates."""
    return make_ca("msggateway admin lease tests CA")


def test_post_leases_with_identity_binds_the_lease(client_ca: CertifiedKey) -> None:
    """A lease asked for alice opens the sink for alice's certificate only: 402 otherwise."""
    desk, factory = _lease_desk()
    status, made = _post_lease(desk, {"listener": "dmp", "sink": "orders", "identity": "alice"})
    assert status == 201, made
    assert made["identity"] == "alice"
    grant = factory.granted[made["lease"]]
    assert (grant.identity, grant.certified) == ("alice", True)
    lease = made["lease"]
    assert _open_sink(factory, lease, StringTransport()) == 402
    bob = TLSStringTransport(issue_client_certificate(client_ca, "bob").certificate)
    assert _open_sink(factory, lease, bob) == 402
    alice = TLSStringTransport(issue_client_certificate(client_ca, "alice").certificate)
    assert _open_sink(factory, lease, alice) == 200


def test_post_leases_without_identity_is_unbound() -> None:
    """Without ``identity`` the lease opens the sink for anyone holding it, as before."""
    desk, factory = _lease_desk()
    status, made = _post_lease(desk, {"listener": "dmp", "sink": "orders"})
    assert status == 201 and "identity" not in made
    assert factory.granted[made["lease"]].identity is None
    assert _open_sink(factory, made["lease"], StringTransport()) == 200


@pytest.mark.parametrize(
    ("identity", "reason"),
    [
        ("", "without surrounding spaces"),
        (" alice", "without surrounding spaces"),
        ("al\x00ice", "control or format characters"),
        ("al\u202eice", "control or format characters"),
        ("*", "names no one"),
        ("a" * 1025, "at most 1024 characters"),
        (None, "identity must be a string"),
        (42, "identity must be a string"),
        (["alice"], "identity must be a string"),
    ],
)
def test_post_leases_with_a_bad_identity_is_400(identity: object, reason: str) -> None:
    """An identity that is not a usable name is refused, and no lease is made."""
    desk, factory = _lease_desk()
    status, answer = _post_lease(desk, {"listener": "dmp", "sink": "orders", "identity": identity})
    assert status == 400, answer
    assert reason in answer["error"]
    assert not factory.granted


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"listener": "dmp", "sink": "orders", "identiy": "alice"}, "unknown key(s): 'identiy'"),
        ({"listener": "dmp", "sink": "orders", "feed": "alerts"}, "name a sink or a feed"),
        ({"listener": "dmp"}, "name a sink or a feed"),
        ({"sink": "orders"}, "name the listener"),
        ({"listener": 1, "sink": "orders"}, "listener must be a string"),
        ({"listener": "dmp", "sink": "orders", "ttl_seconds": "60"}, "must be a number"),
        ({"listener": "dmp", "sink": "orders", "ttl_seconds": True}, "must be a number"),
        (["dmp"], "not a JSON object"),
        (b"{", "Expecting"),
    ],
)
def test_post_leases_refuses_what_it_does_not_understand(body: object, reason: str) -> None:
    """Unknown keys (a misspelt identity), wrong types or shapes: 400, no lease."""
    desk, factory = _lease_desk()
    status, answer = _post_lease(desk, body)
    assert status == 400, answer
    assert reason in answer["error"] and '"identity": "alice"' in answer["error"]
    assert not factory.granted
