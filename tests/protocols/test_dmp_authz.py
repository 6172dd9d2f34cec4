"""DMP identities and allow-lists: `gateway.protocols.dmp.server` and `.principal`.

Leases may be bound to an identity; on an ``mtls:`` listener the client
certificate names the connection. A lease bound to someone else is ``402
BAD-LEASE``; a sink the identity may not publish to, or a feed it may not
consume from, is ``403 NO-ACCESS`` (and a Channel.Close 403 on the
principal connection that asks for the lease).
"""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from gateway.codecs import dmp
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.core.router import Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.server import DMPServerFactory
from gateway.protocols.dmp.settings import DMPListenerSettings, LeaseGrant
from tests.certs import CertifiedKey, issue_client_certificate, make_ca
from tests.doubles import NO_LOGIN_WAIT
from tests.protocols.test_dmp_principal import Listener as PrincipalListener
from tests.protocols.test_dmp_principal import get, put, replies
from tests.protocols.test_dmp_server import read
from tests.protocols.test_ssmp_server import TLSStringTransport

SETTINGS = DMPListenerSettings(
    sinks=frozenset({"orders"}),
    feeds=frozenset({"alerts"}),
    leases={
        "shared-writer": LeaseGrant(kind="sink", target="orders", text=b"W"),
        "shared-reader": LeaseGrant(kind="feed", target="alerts", text=b"R"),
        "alice-reader": LeaseGrant(kind="feed", target="alerts", text=b"AR", identity="alice"),
    },
    principals=frozenset({"alice"}),
)
AUTHZ = Authorization.from_lists(
    {
        "app": (("orders",), ()),  # may write the sink, not read the feed
        "alice": ((), ("alerts",)),
    }
)


@pytest.fixture(scope="module")
def ca() -> CertifiedKey:
    """A test CA for client certificates."""
    return make_ca("msggateway DMP authz tests CA")


def _factory(metrics: GatewayMetrics | None = None) -> DMPServerFactory:
    clock = Clock()
    clock.advance(100)
    factory = DMPServerFactory(
        name="dmp",
        settings=SETTINGS,
        router=Router(bind_routes([], {}), clock, GatewayMetrics()),
        secrets=Secrets(),
        clock=clock,
        metrics=metrics,
    )
    factory.authorization = AUTHZ
    factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits
    return factory


def _open(factory: DMPServerFactory, lease: bytes, transport: StringTransport) -> list[object]:
    protocol = factory.buildProtocol(None)
    assert protocol is not None
    protocol.makeConnection(transport)
    protocol.dataReceived(dmp.PROTOCOL_HEADER + bytes((len(lease),)) + lease)
    return read(transport)[1:]


def _tls(ca: CertifiedKey, name: str) -> TLSStringTransport:
    return TLSStringTransport(issue_client_certificate(ca, name).certificate)


def test_writer_may_write_the_sink_but_not_read_the_feed(ca: CertifiedKey) -> None:
    """``app`` (by certificate) opens the sink; the feed gets 403 NO-ACCESS and a close."""
    metrics = GatewayMetrics()
    factory = _factory(metrics)
    transport = _tls(ca, "app")
    assert _open(factory, b"W", transport) == [
        dmp.Response(200, 'Ready to write to "orders"', "OK")
    ]
    assert factory.connections and next(iter(factory.connections)).identity == "app"
    transport = _tls(ca, "app")
    assert _open(factory, b"R", transport) == [
        dmp.Response(403, "not allowed to consume 'alerts'", "NO-ACCESS")
    ]
    assert transport.disconnecting
    refused = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "dmp", "kind": "forbidden-consume"}
    )
    assert refused == 1


def test_lease_bound_to_another_identity_is_402(ca: CertifiedKey) -> None:
    """A lease bound to alice, with app's certificate or with none, is not valid: 402."""
    factory = _factory()
    for transport in (_tls(ca, "app"), StringTransport()):
        [answer] = _open(factory, b"AR", transport)
        assert isinstance(answer, dmp.Response) and answer.code == 402
        assert transport.disconnecting
    transport = _tls(ca, "alice")
    assert _open(factory, b"AR", transport) == [
        dmp.Response(200, 'Ready to read from "alerts"', "OK")
    ]


def test_without_identity_nothing_opens_under_authorize() -> None:
    """A plain connection with an unbound lease has no identity: 403."""
    [answer] = _open(_factory(), b"W", StringTransport())
    assert isinstance(answer, dmp.Response) and answer.code == 403


def test_principal_leases_carry_the_login_identity() -> None:
    """The principal alice may Get the feed (its lease opens it) but Put gets Channel.Close 403."""
    listener = PrincipalListener(SETTINGS)
    listener.factory.authorization = AUTHZ
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(get(b"alerts"))
    [get_ok] = replies(codec, transport)
    assert get_ok.name == "direct.get-ok"
    _, answers = listener.dmp_open(get_ok.arguments["lease"])
    assert answers[-1] == dmp.Response(200, 'Ready to read from "alerts"', "OK")
    protocol.dataReceived(put(b"orders"))
    [close] = replies(codec, transport)
    assert (close.name, close.arguments["reply_code"]) == ("channel.close", 403)
    assert "alice may not publish 'orders'" in close.arguments["reply_text"]
