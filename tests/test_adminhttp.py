"""Tests for `gateway.admin.channel`: the admin site's Host check and bounded request bodies.

The site is `gateway.admin.site.make_admin_site` on a `Clock`, each connection a
`StringTransport` whose local address is where the site listens; requests
are raw bytes, so oversized and chunked bodies are exactly what a client
would send.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.interfaces import IAddress
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.web.server import Site

from gateway.admin.channel import (
    LINGER_SECONDS,
    MAX_BODY_BYTES,
    MAX_BODYLESS_BYTES,
    MAX_LINGER_BYTES,
    AdminChannel,
    HostError,
    HostPolicy,
    host_name,
)
from gateway.admin.health import HealthReport
from gateway.admin.site import make_admin_site
from gateway.core.router import Router, RouteTable
from gateway.metrics import GatewayMetrics

LOOPBACK = IPv4Address("TCP", "127.0.0.1", 8790)
PEER = IPv4Address("TCP", "127.0.0.1", 40000)


class _Transport(StringTransport):
    """A `StringTransport` that can close its write side, as TCP can."""

    write_closed = False

    def loseWriteConnection(self) -> None:  # noqa: N802  # Twisted's name
        """Note the half-close."""
        self.write_closed = True


class _Desk:
    """A lease maker that records what it is asked and grants everything."""

    enabled = True

    def __init__(self) -> None:
        self.asked: list[tuple[object, ...]] = []

    def authorized(self, token: bytes | None) -> bool:
        """Any token will do."""
        return True

    def make(
        self,
        listener: str,
        kind: str,
        target: str,
        ttl_seconds: float,
        identity: str | None = None,
    ) -> dict[str, object]:
        """Record the request; grant it."""
        self.asked.append((listener, kind, target, ttl_seconds, identity))
        return {"lease": "L", "listener": listener, kind: target}

    def revoke(self, text: str) -> bool:
        """Nothing to revoke."""
        return False


class _Served:
    """An admin site on a clock that counts the health reports it renders."""

    def __init__(self, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.clock = Clock()
        self.rendered = 0
        self.desk = _Desk()
        self.site: Site = make_admin_site(
            metrics=GatewayMetrics(),
            router=Router(RouteTable(), self.clock),
            health=self._health,
            reactor=self.clock,
            leases=self.desk,
            allowed_hosts=allowed_hosts,
        )

    def _health(self) -> HealthReport:
        self.rendered += 1
        return HealthReport()

    def connect(self, local: IAddress = LOOPBACK) -> tuple[AdminChannel, _Transport]:
        """A new connection arriving on ``local``."""
        transport = _Transport(local, PEER)
        channel = self.site.buildProtocol(PEER)
        assert isinstance(channel, AdminChannel)
        channel.makeConnection(transport)
        return channel, transport


@pytest.fixture
def served() -> _Served:
    """An admin site on loopback with no extra allowed hosts."""
    return _Served()


def _answer(transport: StringTransport) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body written so far."""
    head, _, body = transport.value().partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, _, value in (f.partition(": ") for f in fields)}
    return int(status.split()[1]), headers, body


def _refusal(transport: StringTransport) -> tuple[int, dict[str, Any]]:
    """A refusal's status and JSON, checking its headers."""
    status, headers, body = _answer(transport)
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert headers["cache-control"] == "no-store"
    assert int(headers["content-length"]) == len(body)
    return status, json.loads(body)


def _get(host: str | None = "127.0.0.1:8790", version: str = "HTTP/1.1") -> bytes:
    """A GET /healthz, with the Host header given (None: none)."""
    lines = [f"GET /healthz {version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# --- Host -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.1:8790", "127.0.0.1:9999", "localhost", "LocalHost.:8790"]
)
def test_loopback_names_are_served(served: _Served, host: str) -> None:
    """On loopback, its address and ``localhost`` are answered, with any port or none."""
    channel, transport = served.connect()
    channel.dataReceived(_get(host))
    assert _answer(transport)[0] == 200
    assert served.rendered == 1


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8790",
        "127.0.0.1.evil.example",
        "localhost.evil.example",
        "10.0.0.1",
        "[::1]:8790",
    ],
)
def test_foreign_hosts_are_misdirected(served: _Served, host: str) -> None:
    """A Host naming anything else (a rebound name, say) is 421 and nothing is rendered."""
    channel, transport = served.connect()
    with capturedLogs() as events:
        channel.dataReceived(_get(host))
    status, answer = _refusal(transport)
    assert status == 421
    assert "does not answer for host" in answer["error"]
    assert "allowed_hosts" in answer["error"]
    assert served.rendered == 0
    assert transport.write_closed
    [logged] = [formatEvent(event) for event in events]
    assert "admin: refused GET /healthz from" in logged and "421" in logged


@pytest.mark.parametrize(
    ("local", "host"),
    [
        (IPv6Address("TCP", "::1", 8790), "[::1]:8790"),
        (IPv6Address("TCP", "::1", 8790), "localhost:8790"),
        (IPv6Address("TCP", "::ffff:127.0.0.1", 8790), "127.0.0.1:8790"),
        (IPv4Address("TCP", "192.0.2.7", 8790), "192.0.2.7:8790"),
        (UNIXAddress(b"/run/msggateway/admin.sock"), "localhost"),
    ],
)
def test_the_address_the_connection_arrived_on_is_served(
    served: _Served, local: IAddress, host: str
) -> None:
    """IPv6, IPv4-mapped, a non-loopback bind and a Unix socket each accept their own names."""
    channel, transport = served.connect(local)
    channel.dataReceived(_get(host))
    assert _answer(transport)[0] == 200


def test_localhost_is_not_served_off_loopback(served: _Served) -> None:
    """Bound to a public address, ``localhost`` is not a name of the endpoint."""
    channel, transport = served.connect(IPv4Address("TCP", "192.0.2.7", 8790))
    channel.dataReceived(_get("localhost:8790"))
    assert _refusal(transport)[0] == 421


def test_allowed_hosts_are_served() -> None:
    """Names of ``allowed_hosts`` are answered, whatever their case and port."""
    served = _Served(("Gateway.Example.org", "[2001:db8::1]"))
    for host in ("gateway.example.org:8790", "GATEWAY.example.org", "[2001:db8::1]:80"):
        channel, transport = served.connect()
        channel.dataReceived(_get(host))
        assert _answer(transport)[0] == 200, host
    channel, transport = served.connect()
    channel.dataReceived(_get("other.example.org"))
    assert _refusal(transport)[0] == 421


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (_get(None), "an HTTP/1.1 request needs a Host header"),
        (b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "give one Host header"),
        (_get("127.0.0.1:http"), "bad port"),
        (_get("127.0.0.1:"), "empty port"),
        (_get("[::1"), "not a host and port"),
        (_get("bad_name"), "not a host name"),
        (_get("caf\u00e9.example"), "not ASCII"),
    ],
)
def test_missing_or_malformed_host_is_400(
    served: _Served, request_bytes: bytes, reason: str
) -> None:
    """HTTP/1.1 without Host, several Hosts or a malformed one: 400, saying why."""
    channel, transport = served.connect()
    channel.dataReceived(request_bytes)
    status, answer = _refusal(transport)
    assert (status, reason in answer["error"]) == (400, True), answer
    assert served.rendered == 0


def test_http_1_0_without_host_is_served(served: _Served) -> None:
    """An HTTP/1.0 request may leave Host out (browsers never do): it is answered."""
    channel, transport = served.connect()
    channel.dataReceived(_get(None, "HTTP/1.0"))
    assert _answer(transport)[0] == 200


def test_head_refusal_has_no_body(served: _Served) -> None:
    """A refused HEAD gets the headers only."""
    channel, transport = served.connect()
    channel.dataReceived(b"HEAD /healthz HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    status, headers, body = _answer(transport)
    assert (status, body) == (421, b"")
    assert int(headers["content-length"]) > 0


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("Example.ORG.", "example.org"),
        ("[::1]", "::1"),
        ("0:0::1", "::1"),
        ("10.0.0.1", "10.0.0.1"),
        ("a-b.c", "a-b.c"),
    ],
)
def test_host_names_are_canonical(text: str, name: str) -> None:
    """Names lose case and trailing dot; addresses take their compressed form."""
    assert host_name(text) == name


@pytest.mark.parametrize("text", ["", ".", "a..b", "-a.b", "a_b", "a:80", "[a]", "x" * 254])
def test_host_names_that_are_not(text: str) -> None:
    """Anything but a DNS name or an IP address is a `HostError`."""
    with pytest.raises(HostError):
        host_name(text)


def test_policy_of_refuses_a_bad_name() -> None:
    """`HostPolicy.of` checks every name."""
    assert HostPolicy.of(["A.example", "::1"]).allowed == {"a.example", "::1"}
    with pytest.raises(HostError):
        HostPolicy.of(["a.example:80"])


# --- bodies ---------------------------------------------------------------------------------


def test_declared_body_past_the_limit_is_413_before_it_is_read(served: _Served) -> None:
    """``GET /metrics`` declaring 100 MB is refused once the headers are in."""
    channel, transport = served.connect()
    channel.dataReceived(
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:8790\r\nContent-Length: 100000000\r\n\r\n"
    )
    status, answer = _refusal(transport)
    assert status == 413
    assert f"at most {MAX_BODYLESS_BYTES} bytes" in answer["error"]
    assert served.rendered == 0
    assert transport.write_closed
    assert channel.requests[0].content is None  # nothing was ever kept


def test_expect_100_continue_past_the_limit_gets_no_continue(served: _Served) -> None:
    """A client that waits for 100 Continue gets the 413 instead, and sends nothing."""
    channel, transport = served.connect()
    channel.dataReceived(
        b"POST /leases HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
    )
    assert transport.value().startswith(b"HTTP/1.1 413 Content Too Large\r\n")
    assert b"100 Continue" not in transport.value()


def test_post_takes_a_body_up_to_its_limit(served: _Served) -> None:
    """A POST body of exactly `MAX_BODY_BYTES` reaches the resource; one byte more is 413."""
    body = json.dumps({"listener": "dmp", "sink": "orders", "padding": ""}).encode()
    body = body.replace(b'""', b'"' + b"x" * (MAX_BODY_BYTES - len(body)) + b'"')
    assert len(body) == MAX_BODY_BYTES
    head = b"POST /leases HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n"
    channel, transport = served.connect()
    channel.dataReceived(head % len(body) + body)
    assert _answer(transport)[0] == 400  # read and parsed: "padding" is not a key
    channel, transport = served.connect()
    channel.dataReceived(head % (len(body) + 1) + body)
    assert _refusal(transport)[0] == 413


def test_small_get_body_is_ignored(served: _Served) -> None:
    """A GET with a small body (some clients send one) is served."""
    channel, transport = served.connect()
    body = b"x" * MAX_BODYLESS_BYTES
    channel.dataReceived(
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert _answer(transport)[0] == 200


def test_chunked_body_is_refused_once_past_the_limit(served: _Served) -> None:
    """Chunks are counted as they come: past the limit, 413, and the rest is dropped."""
    channel, transport = served.connect()
    channel.dataReceived(
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (1024, b"y" * 1024)
    for _ in range(MAX_BODYLESS_BYTES // 1024):
        channel.dataReceived(chunk)
    assert transport.value() == b""  # at the limit: still reading
    channel.dataReceived(chunk + chunk + b"0\r\n\r\n")
    status, answer = _refusal(transport)
    assert status == 413 and "too large" in answer["error"]
    assert served.rendered == 0
    request = channel.requests[0]
    assert request.content is not None
    assert len(request.content.getvalue()) == MAX_BODYLESS_BYTES


def test_chunked_body_within_the_limit_is_served(served: _Served) -> None:
    """A small chunked POST is read whole and handed to the resource."""
    channel, transport = served.connect()
    body = json.dumps({"listener": "dmp", "sink": "orders"}).encode()
    channel.dataReceived(
        b"POST /leases HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    assert _answer(transport)[0] == 201
    assert served.desk.asked == [("dmp", "sink", "orders", 3600.0, None)]


def test_pipelined_request_after_a_refusal_is_not_served(served: _Served) -> None:
    """A request sent behind a refused one on the same connection is dropped."""
    channel, transport = served.connect()
    channel.dataReceived(_get("evil.example") + _get())
    assert _refusal(transport)[0] == 421
    assert served.rendered == 0


def test_after_a_refusal_the_connection_lingers_then_closes(served: _Served) -> None:
    """What the client still sends is dropped; the connection closes after `LINGER_SECONDS`."""
    channel, transport = served.connect()
    channel.dataReceived(
        b"POST /leases HTTP/1.1\r\nHost: localhost\r\nContent-Length: 99999999\r\n\r\n"
    )
    answered = transport.value()
    channel.dataReceived(b"z" * 65536)
    assert transport.value() == answered
    assert not transport.disconnecting
    served.clock.advance(LINGER_SECONDS)
    assert transport.disconnecting


def test_lingering_is_bounded_in_bytes(served: _Served) -> None:
    """A client that keeps sending past `MAX_LINGER_BYTES` is cut at once."""
    channel, transport = served.connect()
    channel.dataReceived(_get("evil.example"))
    channel.dataReceived(b"z" * MAX_LINGER_BYTES)
    assert not transport.disconnecting
    channel.dataReceived(b"z")
    assert transport.disconnecting


def test_without_half_close_a_refusal_closes_at_once(served: _Served) -> None:
    """Over a transport that cannot close only its write side (TLS), it closes whole."""
    transport = StringTransport(LOOPBACK, PEER)
    channel = served.site.buildProtocol(PEER)
    assert channel is not None
    channel.makeConnection(transport)
    channel.dataReceived(_get("evil.example"))
    assert transport.disconnecting
    assert _refusal(transport)[0] == 421
