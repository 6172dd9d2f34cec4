"""SSMP allow-lists: `gateway.protocols.ssmp.server` with an ``authorize`` table.

The hub of `tests.protocols.test_ssmp_server`, its factory given an
`Authorization`: a refused SUBSCRIBE, MCAST, UCAST or BCAST is answered 405
(Not Allowed) and the connection stays; an identity granted nothing, or no
identity at all (anonymous, ``open``), is refused at LOGIN with 401 and a
close, as the spec prescribes for a login that fails.
"""

from __future__ import annotations

import pytest
from twisted.logger import capturedLogs

from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.protocols.ssmp.settings import SSMPListenerSettings
from tests.certs import CertifiedKey, issue_client_certificate, make_ca
from tests.protocols.test_ssmp_server import HubWorld, TLSStringTransport

SETTINGS = SSMPListenerSettings(schemes=frozenset({"open", "secret"}), anonymous=True)
AUTHZ = Authorization.from_lists(
    {
        "sam": (("news.*", "alice"), ()),  # publishes news, consumes nothing
        "alice": ((), ("news.#",)),
    }
)


@pytest.fixture
def world() -> HubWorld:
    """A hub with the allow-lists above; everyone's secret is ``sesame``."""
    hub = HubWorld(SETTINGS)
    hub.factory.authorization = AUTHZ
    hub.factory.secrets = Secrets(logins={"*": b"sesame"})
    return hub


def test_publisher_may_publish_but_not_subscribe(world: HubWorld) -> None:
    """``sam`` may MCAST to news.* but its SUBSCRIBE gets 405, and it stays connected."""
    peer = world.login("sam", "secret sesame")
    with capturedLogs() as events:
        peer.send(b"SUBSCRIBE news.paris\n")
    assert peer.received() == b"405 not allowed to consume news.paris\n"
    assert not peer.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind="forbidden-consume") == 1
    refusal = [event for event in events if event.get("action") == "consume"]
    assert refusal and refusal[0]["identity"] == "sam"
    assert refusal[0]["address"] == "news.paris"
    peer.send(b"MCAST news.paris hello\n")
    assert peer.received() == b"200\n"
    peer.send(b"MCAST weather.paris hello\n")
    assert peer.received() == b"405 not allowed to publish weather.paris\n"
    assert world.sample("msggateway_protocol_errors_total", kind="forbidden-publish") == 1


def test_consumer_receives_but_may_not_publish(ca: CertifiedKey) -> None:
    """``alice`` (by certificate) subscribes and receives, but her MCAST gets 405."""
    world = HubWorld(SETTINGS)
    world.factory.authorization = AUTHZ
    certificate = issue_client_certificate(ca, "alice").certificate
    alice = world.login("alice/laptop", "cert", TLSStringTransport(certificate))
    alice.send(b"SUBSCRIBE news.paris\n")
    assert alice.received() == b"200\n"
    alice.send(b"MCAST news.paris mine\n")
    assert alice.received() == b"405 not allowed to publish news.paris\n"
    sam = world.login("sam", "secret sesame")
    sam.send(b"MCAST news.paris hello\n")
    assert sam.received() == b"200\n"
    assert alice.received() == b"000 sam MCAST news.paris hello\n"


def test_ucast_and_bcast_need_publish_rights(world: HubWorld) -> None:
    """UCAST's address is the recipient; BCAST needs every topic the sender is on."""
    alice = world.login("alice", "secret sesame")
    alice.send(b"SUBSCRIBE news.x\n")
    assert alice.received() == b"200\n"
    sam = world.login("sam", "secret sesame")
    sam.send(b"UCAST alice hi\n")
    assert sam.received() == b"200\n"
    assert alice.received() == b"000 sam UCAST alice hi\n"
    alice.send(b"UCAST sam hi\n")
    assert alice.received() == b"405 not allowed to publish sam\n"
    alice.send(b"BCAST hi\n")
    assert alice.received() == b"405 not allowed to publish news.x\n"


@pytest.mark.parametrize(
    "login", [b"LOGIN . open\n", b"LOGIN bob open\n", b"LOGIN mallory secret sesame\n"]
)
def test_no_identity_or_no_grant_is_refused_at_login(world: HubWorld, login: bytes) -> None:
    """Anonymous and ``open`` logins have no identity, ``mallory`` no grant: 401 and close."""
    peer = world.connect()
    peer.send(login)
    assert peer.received() == b"401 open secret\n"
    assert peer.transport.disconnecting


def test_without_authorize_everything_is_allowed() -> None:
    """No ``authorize`` table: anonymous publishes, anyone subscribes, as before."""
    world = HubWorld(SETTINGS)
    peer = world.login("bob", "open")
    peer.send(b"SUBSCRIBE anything\nMCAST other x\n")
    assert peer.received() == b"200\n200\n"


@pytest.fixture(scope="module")
def ca() -> CertifiedKey:
    """A test CA for client certificates."""
    return make_ca("msggateway authz tests CA")
