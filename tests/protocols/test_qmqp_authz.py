"""QMQP identities and allow-lists: `gateway.protocols.qmqp.server` with ``authorize``.

A verified client certificate stands in for the ``A`` block; the
``authorize`` table says which recipient domains an identity may send to, and
a message with any other recipient is answered ``D`` (one reply per message,
as the spec has it), counted and logged.
"""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from gateway.codecs import qmqp
from gateway.core.authorization import Authorization
from gateway.protocols.qmqp.settings import QMQPListenerSettings
from tests.certs import CertifiedKey, issue_client_certificate, make_ca
from tests.protocols.test_qmqp_server import AUTH_OK, AUTH_REQUEST, Client, ListenerWorld, mail
from tests.protocols.test_ssmp_server import TLSStringTransport

AUTHZ = Authorization.from_lists(
    {
        "myusername": (("ok.example",), ()),
        "relay.example.org": (("#.example", "drh.net"), ()),
    }
)


@pytest.fixture(scope="module")
def ca() -> CertifiedKey:
    """A test CA for client certificates."""
    return make_ca("msggateway QMQP authz tests CA")


def _world(*, require_auth: bool = False, authz: Authorization = AUTHZ) -> ListenerWorld:
    world = ListenerWorld(QMQPListenerSettings(require_auth=require_auth))
    world.factory.authorization = authz
    return world


def _connect(world: ListenerWorld, transport: StringTransport) -> Client:
    protocol = world.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
    protocol.makeConnection(transport)  # type: ignore[no-untyped-call]
    return Client(protocol, transport)


def _result(client: Client) -> list[tuple[bytes, bytes, bytes]]:
    out = []
    for block in client.blocks():
        assert isinstance(block, qmqp.ReplyBlock), block
        out.append((block.id, block.status, block.description))
    return sorted(out)  # replies come in completion order (spec): compare them by id


def test_certificate_stands_in_for_the_a_block(ca: CertifiedKey) -> None:
    """With ``require_auth``, a client certificate is enough: its CN is the identity."""
    world = _world(require_auth=True)
    certificate = issue_client_certificate(ca, "relay.example.org").certificate
    client = _connect(world, TLSStringTransport(certificate))
    client.send(mail("m1", "x@ok.example"))
    assert _result(client) == [(b"m1", qmqp.K, b"")]
    assert client.protocol.identity == "relay.example.org"


def test_without_certificate_or_a_block_require_auth_refuses() -> None:
    """A TLS connection without a certificate is still unauthenticated: D."""
    world = _world(require_auth=True)
    client = _connect(world, TLSStringTransport(None))
    client.send(mail("m1", "x@ok.example"))
    [(block_id, status, description)] = _result(client)
    assert (block_id, status) == (b"m1", qmqp.D)
    assert b"client certificate" in description


def test_disallowed_recipient_domain_gets_d(ca: CertifiedKey) -> None:
    """A recipient in a domain the identity may not send to refuses the whole message."""
    world = _world()
    certificate = issue_client_certificate(ca, "relay.example.org").certificate
    client = _connect(world, TLSStringTransport(certificate))
    client.send(mail("m1", "a@ok.example", "b@drh.net") + mail("m2", "a@ok.example", "c@evil.org"))
    replies = _result(client)
    assert replies[0] == (b"m1", qmqp.K, b"")
    assert replies[1] == (
        b"m2",
        qmqp.D,
        b"relay.example.org may not send to recipient domain evil.org",
    )
    delivered = {r for message in world.answers.messages for r in message.recipients}
    assert delivered == {"a@ok.example", "b@drh.net"}  # m2 went nowhere
    assert world.sample("msggateway_protocol_errors_total", kind="forbidden-publish") == 1


def test_a_block_identity_has_its_own_domains() -> None:
    """An identity from an ``A`` block gets its own grant, not anyone else's."""
    world = _world()
    client = world.connect()
    client.send(AUTH_REQUEST)
    assert client.received() == AUTH_OK
    client.send(mail("m1", "x@ok.example") + mail("m2", "x@drh.net"))
    statuses = [(block_id, status) for block_id, status, _ in _result(client)]
    assert statuses == [(b"m1", qmqp.K), (b"m2", qmqp.D)]


def test_no_identity_gets_d_under_authorize() -> None:
    """Without an identity nothing is granted: every message is answered D."""
    world = _world()
    client = world.connect()
    client.send(mail("m1", "x@ok.example"))
    [(_, status, description)] = _result(client)
    assert status == qmqp.D
    assert description.startswith(b"a client without an identity may not send")


def test_without_authorize_nothing_changes() -> None:
    """No ``authorize`` table: an unauthenticated client still sends anywhere routed."""
    world = ListenerWorld()
    client = world.connect()
    client.send(mail("m1", "x@ok.example"))
    assert [status for _, status, _ in _result(client)] == [qmqp.K]
