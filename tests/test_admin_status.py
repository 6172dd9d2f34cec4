"""Tests for the admin endpoint's status API and status page (`gateway.admin.status`, `.page`).

The gateway is built from a real configuration on a `MemoryReactorClock`
(`build_gateway`, as the service builds it) and started; its admin site's
resource tree is served in memory through `treq.testing.StubTreq`. A QMQP
connection made by hand on an in-memory transport brings traffic. The
page in a real browser, with the log's streams and durable routes, is
`tests.integration.test_status_page`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.web.iweb import IResponse

from gateway.admin.base import CONTENT_SECURITY_POLICY
from gateway.admin.site import AdminSite
from gateway.admin.status import nodes
from gateway.codecs import qmqp
from gateway.config import load_config
from gateway.fleet.members import Membership
from gateway.protocols.listener import ListenerConnection
from gateway.service import GatewayService, build_gateway
from tests.fleet.broker import MemoryBackbone, MemoryBroker
from tests.protocols.test_listener import _TCPTransport

BASE = "http://admin.invalid"

CONFIG = """
[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"

[routes.mail]
from = "mail"
match = "#@example.org"
to = "hub"
"""


class _Gateway:
    """A started gateway on a memory reactor, and an in-memory client of its admin site."""

    def __init__(self, directory: Path) -> None:
        (directory / "gateway.toml").write_text(CONFIG)
        self.reactor = MemoryReactorClock()
        self.gateway: GatewayService = build_gateway(
            load_config(directory / "gateway.toml"), self.reactor, node="test-node"
        )
        self.gateway.startService()
        assert self.gateway.admin is not None
        site = self.gateway.admin.factory
        assert isinstance(site, AdminSite)
        self.client = StubTreq(site.resource)

    def request(
        self, path: str, accept: str = "application/json", method: str = "GET"
    ) -> tuple[IResponse, bytes]:
        """One request; the response and its whole body."""
        response: IResponse = _result(
            self.client.request(method, BASE + path, headers={"Accept": [accept]})
        )
        return response, _result(self.client.content(response))

    def json(self, path: str) -> Any:
        """A status path's JSON."""
        response, body = self.request(path)
        assert response.code == 200
        assert response.headers.getRawHeaders("Content-Type") == ["application/json"]
        return json.loads(body)

    def send_mail(self, count: int) -> ListenerConnection:
        """Open a QMQP connection to ``mail`` and stream ``count`` messages on it."""
        factory = self.gateway.listeners()["mail"].factory
        connection = factory.buildProtocol(None)
        assert isinstance(connection, ListenerConnection)
        connection.makeConnection(_TCPTransport())
        connection.dataReceived(
            b"".join(
                qmqp.encode(
                    qmqp.MessageBlock(
                        id=b"m%d" % n,
                        message=b"hi",
                        sender=b"a@example.org",
                        recipients=(b"b@example.org",),
                    )
                )
                for n in range(count)
            )
        )
        return connection


def _result(d: Deferred[Any]) -> Any:
    """What an already fired Deferred fired with."""
    results: list[Any] = []
    failures: list[Failure] = []
    d.addCallbacks(results.append, failures.append)
    if failures:
        failures[0].raiseException()
    assert results, "the Deferred has not fired"
    return results[0]


@pytest.fixture
def running(tmp_path: Path) -> Iterator[_Gateway]:
    """The gateway above, started."""
    yield _Gateway(tmp_path)


def _header(response: IResponse, name: str) -> str:
    values = response.headers.getRawHeaders(name)
    assert values is not None and len(values) == 1, f"{name}: {values}"
    return str(values[0])


def test_listeners_shows_each_listener_with_its_traffic(running: _Gateway) -> None:
    """``/listeners``: configuration order, listening, connections and counters that move."""
    before = running.json("/listeners")
    assert [(entry["name"], entry["protocol"]) for entry in before] == [
        ("mail", "qmqp"),
        ("hub", "ssmp"),
    ]
    mail = before[0]
    assert mail["listening"] is True
    assert mail["tls"] is False
    assert mail["address"]
    assert (mail["connections"], mail["messages_in"], mail["bytes_in"]) == (0, 0, 0)
    running.send_mail(3)
    mail = running.json("/listeners")[0]
    assert mail["connections"] == 1
    assert mail["connections_opened"] == 1
    assert mail["messages_in"] == 3
    assert mail["bytes_in"] > 0
    assert mail["protocol_errors"] == mail["login_failures"] == 0
    assert mail["slow_consumer_disconnects"] == 0


def test_listeners_shows_one_that_stopped_listening(running: _Gateway) -> None:
    """A listener whose port is closed is listed as not listening, without an address."""
    running.gateway.listeners()["hub"].stop_listening()
    hub = running.json("/listeners")[1]
    assert (hub["name"], hub["listening"], hub["address"]) == ("hub", False, None)


def test_upstreams_shows_state_address_and_reconnects(running: _Gateway) -> None:
    """``/upstreams``: an upstream still connecting, where to, and no reconnects yet."""
    [nowhere] = running.json("/upstreams")
    assert nowhere["name"] == "nowhere"
    assert nowhere["protocol"] == "ssmp"
    assert nowhere["address"] == "127.0.0.1:1"
    assert nowhere["state"] == "connecting"
    assert nowhere["connected"] is False
    assert nowhere["reconnects"] == 0
    assert nowhere["messages_out"] == 0


def test_routes_has_no_forwarder_for_a_direct_route(running: _Gateway) -> None:
    """A direct route's ``forwarder`` is null; its counts come from the route's numbers."""
    running.send_mail(2)
    [mail] = running.json("/routes")
    assert (mail["name"], mail["durable"], mail["forwarder"]) == ("mail", False, None)
    assert mail["messages"] == 2


def test_streams_is_empty_without_the_log(running: _Gateway) -> None:
    """Without a durable route or a stream listener, no log is open: no streams."""
    assert running.json("/streams") == []


def test_nodes_outside_a_fleet_is_this_node(running: _Gateway) -> None:
    """Outside a fleet, ``/nodes`` lists this node alone, with its listeners' addresses."""
    [node] = running.json("/nodes")
    assert node["node"] == "test-node"
    assert node["this"] is True
    assert node["fleet"] is False
    assert node["config_matches"] is True
    assert sorted(node["listeners"]) == ["hub", "mail"]


def test_a_browser_gets_the_status_page_at_the_root(running: _Gateway) -> None:
    """``/`` with ``Accept: text/html`` is the page, which loads only the gateway's own files."""
    response, body = running.request("/", accept="text/html,application/xhtml+xml,*/*;q=0.8")
    assert response.code == 200
    assert _header(response, "Content-Type") == "text/html; charset=utf-8"
    assert _header(response, "Vary") == "Accept"
    assert _header(response, "Content-Security-Policy") == CONTENT_SECURITY_POLICY.decode()
    assert _header(response, "Cache-Control") == "no-store"
    page = body.decode("utf-8")
    assert '<script src="static/status.js" defer></script>' in page
    assert "<script>" not in page  # nothing inline: the policy would refuse it
    assert "http://" not in page and "https://" not in page
    for table in ("listeners", "routes", "upstreams", "streams", "nodes", "tap"):
        assert f'<table id="{table}"' in page


def test_other_clients_still_get_the_json_index(running: _Gateway) -> None:
    """``/`` without text/html in Accept answers the JSON index, with the same policy."""
    response, body = running.request("/", accept="*/*")
    assert _header(response, "Content-Type") == "application/json"
    assert _header(response, "Content-Security-Policy") == CONTENT_SECURITY_POLICY.decode()
    assert "/listeners" in json.loads(body)["paths"]


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("status.js", "text/javascript; charset=utf-8"),
        ("status.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ],
)
def test_the_page_files_are_served(running: _Gateway, name: str, content_type: str) -> None:
    """The script, style and icon are served from the package, with their types."""
    response, body = running.request(f"/static/{name}", accept="*/*")
    assert response.code == 200
    assert _header(response, "Content-Type") == content_type
    assert _header(response, "X-Content-Type-Options") == "nosniff"
    assert body
    head, head_body = running.request(f"/static/{name}", method="HEAD")
    assert head.code == 200 and head_body == b""
    assert int(_header(head, "Content-Length")) == len(body)


@pytest.mark.parametrize("path", ["/static", "/static/", "/static/x.js", "/static/status.js/x"])
def test_nothing_else_is_under_static(running: _Gateway, path: str) -> None:
    """Anything under ``/static`` but the page's files is a JSON 404."""
    response, body = running.request(path)
    assert response.code == 404
    assert json.loads(body)["error"] == "not found"


def test_the_page_reads_only_the_status_api() -> None:
    """The script fetches the admin API's paths, relative to the page, and nothing else."""
    from importlib import resources

    script = (resources.files("gateway.admin") / "static" / "status.js").read_text()
    assert '["healthz", "routes", "listeners", "upstreams", "streams", "nodes"]' in script
    assert "localStorage" not in script  # the token lives in sessionStorage only
    assert "sessionStorage.setItem(TOKEN_KEY" in script
    assert 'fetch("tap?"' in script


class _FleetNode:
    """What ``/nodes`` reads of a gateway in a fleet: its id and its membership."""

    def __init__(self, broker: MemoryBroker, node: str, config: str) -> None:
        self.node = node
        self.membership = Membership(
            MemoryBackbone(broker, node),
            broker.clock,
            config_hash=lambda: config,
            addresses=lambda: {"hub": ("127.0.0.1", 7000 + len(node))},
            unhealthy_after_seconds=10.0,
        )
        self.membership.start()


def test_nodes_in_a_fleet_lists_the_live_nodes() -> None:
    """In a fleet, ``/nodes`` lists every live node, which is this one, and whose config differs."""
    clock = Clock()
    clock.advance(1_000)
    broker = MemoryBroker(clock)
    a = _FleetNode(broker, "a", "c1")
    _FleetNode(broker, "bb", "c2")
    clock.advance(0)
    found = nodes(a)  # a stand-in with the part of a GatewayView that /nodes reads
    assert [(n["node"], n["this"], n["fleet"], n["config_matches"]) for n in found] == [
        ("a", True, True, True),
        ("bb", False, True, False),
    ]
    assert found[1]["listeners"] == {"hub": "127.0.0.1:7002"}
    assert found[0]["started"] == 1_000
