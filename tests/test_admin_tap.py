"""Tests for the admin endpoint's ``/tap``: the messages on a listener or route, live.

Most tests speak HTTP/1.1 to the real admin `Site` over a `StringTransport`
with a `Clock` for its reactor, so that chunks, pauses and disconnects are
exact; one test streams over a real loopback port with treq.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Sequence
from typing import Any

import pytest
import pytest_twisted
import treq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import (
    MemoryReactorClock,
    StringTransport,
    StringTransportWithDisconnection,
)
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.server import Site
from zope.interface import implementer

from gateway.admin.health import HealthReport
from gateway.admin.site import make_admin_site
from gateway.admin.tap import MAX_TAPS, TAP_END_SECONDS
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.interfaces import IRouteDelivery
from gateway.core.message import Message, Outcome
from gateway.core.router import BoundRoute, Route, Router, RouteTable
from gateway.core.tap import COUNTS_INTERVAL_SECONDS
from gateway.metrics import GatewayMetrics

TOKEN = "t0ken"

WEATHER = Route(
    name="weather",
    source="ssmp-in",
    pattern=AddressPattern("weather.*"),
    destination="rabbit",
    target=AddressTemplate("archive.{1}"),
)


@implementer(IRouteDelivery)
class _Accepting:
    """Accepts every message at once."""

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Accept the batch."""
        return succeed([Outcome.accepted()] * len(messages))


def _router(clock: Clock) -> Router:
    return Router(RouteTable([BoundRoute(WEATHER, _Accepting())]), clock)


def _site(router: Router, clock: Clock, logins: dict[str, bytes] | None = None) -> Site:
    secrets = Secrets(admin_token=TOKEN.encode()) if logins is None else Secrets(logins=logins)
    return make_admin_site(
        metrics=GatewayMetrics(),
        router=router,
        health=lambda: HealthReport(listeners={"ssmp-in": True}, upstreams={"rabbit": True}),
        reactor=clock,
        secrets=secrets,
    )


def _send(router: Router, *addresses: str) -> None:
    """Route one batch from ssmp-in, a message per address (its id is the address)."""
    router.route(
        "ssmp-in",
        [Message(body=b"hello", address=a, id=a) for a in addresses],
        lambda index, result: None,
    )


class _Client:
    """One HTTP/1.1 connection to a site, over a `StringTransport`."""

    def __init__(self, site: Site, *, closes: bool = False) -> None:
        # The site listens on loopback, as the Host header says.
        local = IPv4Address("TCP", "127.0.0.1", 8790)
        peer = IPv4Address("TCP", "127.0.0.1", 40000)
        self.transport = (
            StringTransportWithDisconnection(local, peer)
            if closes
            else StringTransport(local, peer)
        )
        self.channel = site.buildProtocol(peer)
        if closes:
            self.transport.protocol = self.channel
        self.channel.makeConnection(self.transport)

    def request(self, target: str, token: str | None = TOKEN, method: str = "GET") -> None:
        """Send a request."""
        headers = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if token is not None:
            headers += f"Authorization: Bearer {token}\r\n"
        self.channel.dataReceived((headers + "\r\n").encode())

    def head(self) -> tuple[int, dict[str, str]]:
        """The response's status and headers (lower-case names)."""
        head, _, _ = self.transport.value().partition(b"\r\n\r\n")
        status, *fields = head.decode().split("\r\n")
        return int(status.split()[1]), {
            name.lower(): value for name, _, value in (f.partition(": ") for f in fields)
        }

    def body(self) -> bytes:
        """The response body so far, chunks undone; whether it ended is `ended`."""
        return self._dechunk()[0]

    @property
    def ended(self) -> bool:
        """Whether the last chunk has come."""
        return self._dechunk()[1]

    def _dechunk(self) -> tuple[bytes, bool]:
        _, _, rest = self.transport.value().partition(b"\r\n\r\n")
        if self.head()[1].get("transfer-encoding") != "chunked":
            return rest, True
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if not size:
                return body, True
            body, rest = body + rest[:size], rest[size + 2 :]
        return body, False

    def lines(self) -> list[dict[str, Any]]:
        """The JSON lines of the body so far."""
        return [json.loads(line) for line in self.body().splitlines()]

    def error(self) -> tuple[int, dict[str, Any]]:
        """A finished JSON answer: status and value."""
        status, headers = self.head()
        assert headers["content-type"] == "application/json"
        return status, json.loads(self.body())

    def disconnect(self) -> None:
        """The client goes away."""
        self.channel.connectionLost(Failure(ConnectionDone()))


@pytest.fixture
def clock() -> Clock:
    """A clock past zero, for readable times."""
    clock = Clock()
    clock.advance(1000.0)
    return clock


def test_tap_streams_a_routes_messages_with_outcomes(clock: Clock) -> None:
    """A 200 chunked JSON-lines stream: what is tapped, each record, counters; gone on close."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request("/tap?route=weather&match=weather.oslo")
    status, headers = client.head()
    assert status == 200
    assert headers["content-type"] == "application/x-ndjson"
    assert headers["cache-control"] == "no-store"
    assert client.lines() == [
        {
            "tap": {
                "listener": None,
                "route": "weather",
                "match": "weather.oslo",
                "sample": 1.0,
                "max": 1000,
            },
            "time": 1000.0,
        }
    ]
    assert len(router.taps) == 1
    _send(router, "weather.oslo", "weather.rome", "news")
    clock.advance(COUNTS_INTERVAL_SECONDS)
    _, record, counts = client.lines()
    assert record["id"] == "weather.oslo"
    assert record["outcome"] == "accepted"
    assert [
        (r["route"], r["destination"], r["address"], r["status"]) for r in record["routes"]
    ] == [("weather", "rabbit", "archive.oslo", "accepted")]
    assert counts == {"time": 1001.0, "seen": 1, "shown": 1, "sampled_out": 0, "dropped": 0}
    assert not client.ended

    def counters_timers() -> list[object]:
        return [call for call in clock.getDelayedCalls() if "_report" in repr(call.func)]

    assert len(counters_timers()) == 1
    client.disconnect()
    assert router.taps == ()
    assert counters_timers() == []


def test_tap_on_a_listener_with_sampling(clock: Clock) -> None:
    """listener= taps everything arriving there, unrouted included; sample= thins it."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request("/tap?listener=ssmp-in&sample=0.5")
    _send(router, "weather.oslo", "news", "weather.rome", "sport")
    clock.advance(COUNTS_INTERVAL_SECONDS)
    _, first, second, counts = client.lines()
    assert (first["id"], first["outcome"]) == ("weather.oslo", "accepted")
    assert (second["id"], second["outcome"]) == ("weather.rome", "accepted")
    assert (counts["seen"], counts["sampled_out"]) == (4, 2)


def test_a_slow_client_costs_a_bounded_buffer_and_is_told_what_it_lost(clock: Clock) -> None:
    """While the transport is paused nothing is written; past max, records are counted dropped."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request("/tap?listener=ssmp-in&max=2")
    sent = client.transport.value()
    client.transport.producer.pauseProducing()
    _send(router, *(f"weather.w{i}" for i in range(10)))
    clock.advance(COUNTS_INTERVAL_SECONDS)
    assert client.transport.value() == sent
    client.transport.producer.resumeProducing()
    clock.advance(COUNTS_INTERVAL_SECONDS)
    _, first, second, counts = client.lines()
    assert (first["id"], second["id"]) == ("weather.w0", "weather.w1")
    assert (counts["shown"], counts["dropped"]) == (2, 8)


def test_stopping_the_site_ends_every_stream(clock: Clock) -> None:
    """When the admin site stops listening (the gateway stops), each stream ends cleanly."""
    router = _router(clock)
    site = _site(router, clock)
    site.doStart()
    client = _Client(site)
    client.request("/tap?route=weather")
    _send(router, "weather.oslo")
    site.doStop()
    assert client.ended
    *_, last = client.lines()
    assert last["end"] == "the gateway is stopping"
    assert last["shown"] == 1
    assert router.taps == ()


class _Reactor(MemoryReactorClock):
    """A memory reactor whose system event triggers can be removed too."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list[object] = []

    def addSystemEventTrigger(self, *args: Any, **kwargs: Any) -> object:  # noqa: N802
        """Keep the trigger; its id is its place in the list."""
        super().addSystemEventTrigger(*args, **kwargs)
        return (args[0], args[1], len(self.triggers[args[0]][args[1]]) - 1)

    def removeSystemEventTrigger(self, trigger: object) -> None:  # noqa: N802
        """Note the removal."""
        self.removed.append(trigger)


def _shutdown_trigger(reactor: _Reactor) -> Any:
    [(trigger, args, kwargs)] = reactor.triggers["before"]["shutdown"]
    return trigger(*args, **kwargs)


def test_reactor_shutdown_ends_streams_while_they_can_be_sent() -> None:
    """Before the reactor stops, each stream ends, its connection closes, and shutdown waits."""
    reactor = _Reactor()
    router = Router(RouteTable([BoundRoute(WEATHER, _Accepting())]), reactor)
    site = _site(router, reactor)  # type: ignore[arg-type]  # a Clock and more
    site.doStart()
    client = _Client(site, closes=True)
    client.request("/tap?route=weather")
    _send(router, "weather.oslo")
    waited = _shutdown_trigger(reactor)
    assert client.ended
    assert client.lines()[-1]["end"] == "the gateway is stopping"
    assert not client.transport.connected
    assert waited.called
    assert router.taps == ()
    site.doStop()
    assert reactor.removed == []  # it fired: nothing to remove


def test_shutdown_waits_a_bounded_time_for_a_client_that_stays() -> None:
    """A connection that does not close holds the shutdown at most TAP_END_SECONDS."""
    reactor = _Reactor()
    site = _site(_router(reactor), reactor)  # type: ignore[arg-type]  # a Clock and more
    site.doStart()
    client = _Client(site)
    client.request("/tap?route=weather")
    waited = _shutdown_trigger(reactor)
    assert client.transport.disconnecting
    assert not waited.called
    reactor.advance(TAP_END_SECONDS)
    assert waited.called


def test_a_site_stopped_before_shutdown_takes_its_trigger_back() -> None:
    """Stopping the site without a shutdown removes the trigger and ends the streams."""
    reactor = _Reactor()
    site = _site(_router(reactor), reactor)  # type: ignore[arg-type]  # a Clock and more
    site.doStart()
    client = _Client(site, closes=True)
    client.request("/tap?route=weather")
    site.doStop()
    assert reactor.removed == [("before", "shutdown", 0)]
    assert client.lines()[-1]["end"] == "the gateway is stopping"


@pytest.mark.parametrize(
    ("token", "status"),
    [(None, 401), ("wrong", 401), ("", 401)],
)
def test_tap_needs_the_admin_token(clock: Clock, token: str | None, status: int) -> None:
    """Without the admin token: 401 JSON with a Bearer challenge, and nothing tapped."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request("/tap?route=weather", token=token)
    assert client.error() == (status, {"error": "a valid admin token is needed"})
    assert client.head()[1]["www-authenticate"] == 'Bearer realm="msggateway"'
    assert router.taps == ()


def test_tap_is_off_without_an_admin_secret(clock: Clock) -> None:
    """No admin_token in the secrets file: 403 saying how to turn the API on."""
    router = _router(clock)
    client = _Client(_site(router, clock, logins={"alice": b"x", "admin": TOKEN.encode()}))
    client.request("/tap?route=weather")  # with TOKEN, [logins] admin's secret
    status, answer = client.error()
    assert status == 403  # a login named admin is no admin token
    assert "set admin_token in the secrets file" in answer["error"]


@pytest.mark.parametrize(
    ("query", "status", "answer"),
    [
        (
            "listener=nope",
            404,
            {
                "error": "no listener or upstream named 'nope'",
                "listener": "nope",
                "known": ["rabbit", "ssmp-in"],
            },
        ),
        (
            "route=nope",
            404,
            {"error": "no route named 'nope'", "route": "nope", "known": ["weather"]},
        ),
        ("route=weather&match=a..b", 400, None),
        ("route=weather&match=", 400, None),
        ("route=weather&sample=0", 400, None),
        ("route=weather&sample=nan", 400, None),
        ("route=weather&sample=x", 400, None),
        ("route=weather&max=0", 400, None),
        ("route=weather&max=1.5", 400, None),
        ("route=weather&listener=ssmp-in", 400, None),
        ("", 400, None),
        ("route=weather&route=weather", 400, None),
        ("route=weather&rate=0.1", 400, None),
        ("route=weather&per_second=0", 400, None),
        ("route=weather&per_second=x", 400, None),
        ("route=weather&per_second=inf", 400, None),
    ],
)
def test_bad_queries_are_refused(
    clock: Clock, query: str, status: int, answer: dict[str, Any] | None
) -> None:
    """Unknown listener or route: 404 naming it and what exists; a bad query: 400 saying why."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request(f"/tap?{query}")
    got_status, got = client.error()
    assert got_status == status
    if answer is not None:
        assert got == answer
    assert got["error"]
    assert router.taps == ()


def test_a_cap_per_second_is_described_and_kept(clock: Clock) -> None:
    """``per_second=N``: the first line says so, and at most N records come a second."""
    router = _router(clock)
    client = _Client(_site(router, clock))
    client.request("/tap?route=weather&per_second=2")
    assert client.head()[0] == 200
    _send(router, *(f"weather.city{n}" for n in range(5)))
    lines = client.lines()
    assert lines[0]["tap"]["per_second"] == 2
    assert [line["id"] for line in lines[1:]] == ["weather.city0", "weather.city1"]


def test_bad_pattern_says_what_is_wrong(clock: Clock) -> None:
    """A bad pattern's 400 carries the pattern error."""
    client = _Client(_site(_router(clock), clock))
    client.request("/tap?route=weather&match=we*ther")
    status, answer = client.error()
    assert status == 400
    assert answer["match"] == "we*ther"
    assert "wildcards" in answer["error"]


def test_only_get(clock: Clock) -> None:
    """Other methods get a JSON 405 with Allow: GET."""
    client = _Client(_site(_router(clock), clock))
    client.request("/tap?route=weather", method="POST")
    assert client.error()[0] == 405
    assert client.head()[1]["allow"] == "GET"


def test_open_taps_are_bounded(clock: Clock) -> None:
    """Past MAX_TAPS open taps, another is refused with 503 until one closes."""
    router = _router(clock)
    site = _site(router, clock)
    clients = [_Client(site) for _ in range(MAX_TAPS)]
    for client in clients:
        client.request("/tap?route=weather")
    extra = _Client(site)
    extra.request("/tap?route=weather")
    assert extra.error()[0] == 503
    clients[0].disconnect()
    again = _Client(site)
    again.request("/tap?route=weather")
    assert again.head()[0] == 200
    assert len(router.taps) == MAX_TAPS


def test_index_lists_tap(clock: Clock) -> None:
    """The index names /tap among the paths."""
    client = _Client(_site(_router(clock), clock))
    client.request("/", token=None)
    assert "/tap" in client.error()[1]["paths"]


class _ServerSide(WrappingFactory):
    """Wraps the site to learn when its (one) connection has closed."""

    noisy = False

    def __init__(self, site: Site) -> None:
        super().__init__(site)
        self.closed: Deferred[None] = Deferred()

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:  # noqa: N802  # Twisted's name
        """The connection closed."""
        super().unregisterProtocol(p)
        self.closed.callback(None)


class _Lines(Protocol):
    """Reads a streamed body as JSON lines; calls ``on_line`` with the list so far."""

    def __init__(self, on_line: Callable[[list[dict[str, Any]]], None]) -> None:
        self.lines: list[dict[str, Any]] = []
        self._pending = b""
        self._on_line = on_line

    def dataReceived(self, data: bytes) -> None:
        """Split into lines."""
        *complete, self._pending = (self._pending + data).split(b"\n")
        for line in complete:
            self.lines.append(json.loads(line))
            self._on_line(self.lines)

    def leave(self) -> None:
        """Close the connection from the client's side."""
        assert self.transport is not None
        self.transport.stopProducing()


@pytest_twisted.inlineCallbacks
def test_loopback_stream_until_the_client_leaves() -> Generator[Deferred[Any], Any, None]:
    """Over a real loopback port: lines arrive as messages are routed; leaving ends the tap."""
    from twisted.internet import reactor

    router = Router(RouteTable([BoundRoute(WEATHER, _Accepting())]), reactor)
    site = make_admin_site(
        metrics=GatewayMetrics(),
        router=router,
        health=lambda: HealthReport(listeners={"ssmp-in": True}),
        reactor=reactor,
        secrets=Secrets(admin_token=TOKEN.encode()),
    )
    server = _ServerSide(site)
    port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(server)
    pool = HTTPConnectionPool(reactor, persistent=False)
    url = f"http://127.0.0.1:{port.getHost().port}/tap?route=weather"
    three: Deferred[None] = Deferred()

    def on_line(lines: list[dict[str, Any]]) -> None:
        if len(lines) == 1:  # attached: now messages flow
            _send(router, "weather.oslo", "weather.rome")
        elif len(lines) == 3:
            three.callback(None)

    try:
        response = yield treq.get(
            url, headers={"Authorization": f"Bearer {TOKEN}"}, pool=pool, unbuffered=True
        )
        assert response.code == 200
        reader = _Lines(on_line)
        response.deliverBody(reader)
        yield three.addTimeout(10, reactor)
        assert [line.get("id") for line in reader.lines[1:]] == ["weather.oslo", "weather.rome"]
        assert len(router.taps) == 1
        reader.leave()
        yield server.closed.addTimeout(10, reactor)
        assert router.taps == ()
    finally:
        yield port.stopListening()
        yield pool.closeCachedConnections()
