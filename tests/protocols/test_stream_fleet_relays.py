"""Relays between fleet nodes that log in as the fleet, over TCP and TLS, and routes at owners.

Two nodes as in tests/protocols/test_stream_fleet.py: ``a``, whose clients
are `Peer` objects on in-memory transports, and ``b``, listening on
127.0.0.1 for real (plain TCP, or an ``mtls:`` endpoint), which owns the
streams named ``far*``. Both know the fleet's ``relay_secret``
(`gateway.protocols.stream.fleetlogin`) unless a test says otherwise.
Checked, as docs/fleet.rst says ("Streams across nodes", "The relay
login"): a relay carries the identity its client authenticated as (PLAIN,
EXTERNAL, ANONYMOUS), which the owner's allow-lists check; another secret
is refused, and so is an owner without it; a TLS listener's relays are TLS,
with the node's certificate presented where the listener requires one; and
routes into the listener on ``a`` append at ``b``
(`gateway.protocols.stream.routed`), deduplicated under the route's
reference with ``a``'s node id added.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import crypto
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, ISSLTransport
from twisted.internet.task import Clock
from twisted.logger import LogEvent, globalLogPublisher
from zope.interface import implementer

from gateway.codecs import stream as sp
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.core.log import FsyncPolicy, LogStore
from gateway.core.message import Message, Status
from gateway.protocols.stream.bridge import StreamDestination
from gateway.protocols.stream.mapping import message_from_entry
from gateway.protocols.stream.relay import StreamFleet, connect_tcp, connect_tls
from gateway.protocols.stream.routed import OwnerAppends, node_reference
from gateway.protocols.stream.server import StreamServerFactory
from gateway.protocols.stream.settings import StreamListenerSettings
from tests.certs import CertifiedKey, Pki, make_pki, write_pem
from tests.doubles import NO_LOGIN_WAIT
from tests.protocols.test_stream_fleet import Placement, entries
from tests.protocols.test_stream_server import LISTENER, Peer, WatchedTransport, declare, publish

SECRET = b"the fleet's relay secret, long enough"
SETTINGS = StreamListenerSettings(guest=True, anonymous=True, heartbeat_seconds=0)
NOT_AVAILABLE = 6
ACCESS_REFUSED = 16
OWNERS = {"far": "b", "far-closed": "b", "far-new": "b", "far-routed": "b"}


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


class Nodes:
    """Node ``a`` (the client's) and node ``b`` (listening), each with its log and fleet."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.clock = Clock()
        self.stores = {
            name: LogStore(tmp_path / name, _reactor(), fsync=FsyncPolicy.NEVER)
            for name in ("a", "b")
        }
        for store in self.stores.values():
            store.open()
        self.secrets = {"a": SECRET, "b": SECRET}
        self.a = self._factory("a", Secrets(logins={"alice": b"wonderland"}))
        self.b = self._factory("b", Secrets())  # alice's password is not needed there
        self.placement = Placement("a", dict(OWNERS))
        self.port: IListeningPort | None = None
        self.peers: list[Peer] = []
        self.appends: OwnerAppends | None = None

    def _factory(self, node: str, secrets: Secrets) -> StreamServerFactory:
        factory = StreamServerFactory(
            name=LISTENER,
            settings=SETTINGS,
            store=self.stores[node],
            secrets=secrets,
            clock=self.clock,
        )
        factory.login_failures = NO_LOGIN_WAIT
        factory.listening_on(IPv4Address("TCP", "127.0.0.1", 5552))
        return factory

    def _secret(self, node: str) -> bytes | None:
        return self.secrets[node]

    async def listen(self, endpoint: str = "tcp:0:interface=127.0.0.1") -> None:
        """Node ``b`` listens; node ``a`` relays there (TLS for a TLS endpoint)."""
        tls = not endpoint.startswith("tcp:")
        connect = connect_tls(_reactor(), endpoint) if tls else connect_tcp(_reactor())
        fleet_a = StreamFleet(
            self.placement, connect, tls=tls, relay_secret=lambda: self._secret("a")
        )
        self.a.join_fleet(fleet_a)
        self.b.join_fleet(
            StreamFleet(
                Placement("b", {}), connect, tls=tls, relay_secret=lambda: self._secret("b")
            )
        )
        self.port = await serverFromString(_reactor(), endpoint).listen(self.b)
        self.placement.addresses["b"] = ("127.0.0.1", self.port.getHost().port)
        self.appends = OwnerAppends(
            fleet=fleet_a, listener=LISTENER, clock=self.clock, frame_max=1 << 20, virtual_host="/"
        )

    def client(self, user: bytes = b"guest", password: bytes = b"guest") -> Peer:
        """A client of node ``a``, through Open, logged in with PLAIN."""
        peer = Peer(self.a)
        self.peers.append(peer)
        peer.authenticate(user, password)
        return self._open(peer)

    def _open(self, peer: Peer) -> Peer:
        peer.send(
            sp.Tune(frame_max=0, heartbeat=0),
            sp.Open(correlation_id=peer.next_id(), virtual_host="/"),
        )
        (response,) = peer.frames()
        assert isinstance(response, sp.OpenResponse) and response.code == 1, response
        return peer

    def anonymous(self) -> Peer:
        """A client of node ``a`` logged in with ANONYMOUS."""
        peer = Peer(self.a)
        self.peers.append(peer)
        peer.send(
            sp.PeerProperties(correlation_id=peer.next_id(), properties={}),
            sp.SaslHandshake(correlation_id=peer.next_id()),
            sp.SaslAuthenticate(correlation_id=peer.next_id(), mechanism="ANONYMOUS", data=b""),
        )
        assert peer.frames()[2] == sp.SaslAuthenticateResponse(correlation_id=3, code=1)
        return self._open(peer)

    def external(self, certificate: CertifiedKey) -> Peer:
        """A client of node ``a`` that presented ``certificate`` and logs in with EXTERNAL."""
        peer = CertifiedPeer(self.a, certificate)
        self.peers.append(peer)
        peer.send(
            sp.PeerProperties(correlation_id=peer.next_id(), properties={}),
            sp.SaslHandshake(correlation_id=peer.next_id()),
            sp.SaslAuthenticate(correlation_id=peer.next_id(), mechanism="EXTERNAL", data=b""),
        )
        assert peer.frames()[2] == sp.SaslAuthenticateResponse(correlation_id=3, code=1)
        return self._open(peer)

    def destination(self) -> StreamDestination:
        """Node ``a``'s route destination into the listener, in the fleet."""
        assert self.appends is not None
        destination = StreamDestination(LISTENER, self.stores["a"])
        destination.join_fleet(self.appends)
        return destination

    async def close(self) -> None:
        """Lose the clients and relays, stop listening, close the logs."""
        for peer in self.peers:
            peer.lose()
        if self.appends is not None:
            self.appends.close()
        for connection in list(self.b.connections):
            assert connection.transport is not None
            connection.transport.loseConnection()
        if self.port is not None:
            await self.port.stopListening()
        for store in self.stores.values():
            await store.close()


@implementer(ISSLTransport)
class CertifiedTransport(WatchedTransport):
    """A client transport whose peer presented a verified certificate (as TLS would say)."""

    def __init__(self, peer: IPv4Address, certificate: CertifiedKey) -> None:
        super().__init__(peer)
        self._certificate = certificate

    def getPeerCertificate(self) -> crypto.X509:
        """The client's certificate."""
        return crypto.X509.from_cryptography(self._certificate.certificate)

    def setTcpNoDelay(self, enabled: bool) -> None:  # noqa: N802 (Twisted's name)
        """Nothing to set in memory."""


class CertifiedPeer(Peer):
    """A `Peer` over a `CertifiedTransport`."""

    def __init__(self, factory: StreamServerFactory, certificate: CertifiedKey) -> None:
        address = IPv4Address("TCP", "127.0.0.1", 40405)
        self.transport = CertifiedTransport(address, certificate)
        self.protocol = factory.buildProtocol(address)
        self.protocol.makeConnection(self.transport)
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._events: list[sp.Event] = []
        self._ids = itertools.count(1)


@pytest_twisted.async_yield_fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    """Two nodes, not listening yet; everything closed afterwards."""
    harness = Nodes(tmp_path)
    yield harness
    await harness.close()


def message(body: bytes, stream: str = "far-routed") -> Message:
    """A routed message for ``stream``."""
    return Message(body=body, address=stream)


def bodies(stream: Any) -> list[bytes]:
    """The AMQP 1.0 bodies stored in ``stream`` (the data section's bytes)."""
    return [message_from_entry(entry, stream="", timestamp=0.0).body for entry in entries(stream)]


async def answer_to(peer: Peer, event: sp.Event) -> sp.Event:
    """Send a relayed request; the next frame (its answer)."""
    peer.send(event)
    return await peer.next_frame()


def captured(into: list[LogEvent]) -> Any:
    """Add an observer that keeps every log event; return it (to remove later)."""
    observer = into.append
    globalLogPublisher.addObserver(observer)
    return observer


# --- the relay login -----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_owner_checks_the_relayed_identity(nodes: Nodes) -> None:
    """alice, checked on ``a``, is alice at ``b``: its allow-lists, not its password, apply."""
    nodes.b.authorization = Authorization.from_lists({"alice": (("far",), ())})
    await nodes.listen()
    far = nodes.stores["b"].create("far")
    nodes.stores["b"].create("far-closed")
    alice = nodes.client(b"alice", b"wonderland")
    answer = await answer_to(alice, declare(alice, 1, "far", "alice-producer"))
    assert isinstance(answer, sp.Response) and answer.code == 1
    alice.send(publish(1, [1, 2], [b"one", b"two"]))
    assert await alice.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 2])
    assert entries(far) == [b"one", b"two"]
    refused = await answer_to(alice, declare(alice, 2, "far-closed", "alice-producer"))
    assert isinstance(refused, sp.Response) and refused.code == ACCESS_REFUSED
    (owner_side,) = nodes.b.connections
    assert owner_side.identity == "alice"


@pytest_twisted.ensureDeferred
async def test_external_and_anonymous_clients_are_relayed(nodes: Nodes, tmp_path: Path) -> None:
    """A certificate's identity and ANONYMOUS cross too, which a client login could not."""
    await nodes.listen()
    far = nodes.stores["b"].create("far")
    pki = pki_in(tmp_path / "pki")
    alice = nodes.external(pki.alice)
    anonymous = nodes.anonymous()
    for number, peer in enumerate((alice, anonymous), start=1):
        answer = await answer_to(peer, declare(peer, 1, "far", f"producer-{number}"))
        assert isinstance(answer, sp.Response) and answer.code == 1, answer
        peer.send(publish(1, [1], [f"from {number}".encode()]))
        assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1])
    assert entries(far) == [b"from 1", b"from 2"]
    assert {connection.identity for connection in nodes.b.connections} == {"alice", "anonymous"}


@pytest_twisted.ensureDeferred
async def test_another_secret_is_refused_and_logged(nodes: Nodes) -> None:
    """An owner with another relay secret refuses the relay: the client gets code 6."""
    nodes.secrets["b"] = b"another secret, as long as the first"
    await nodes.listen()
    nodes.stores["b"].create("far")
    events: list[LogEvent] = []
    observer = captured(events)
    try:
        peer = nodes.client()
        answer = await answer_to(peer, declare(peer, 1, "far", "p"))
    finally:
        globalLogPublisher.removeObserver(observer)
    assert isinstance(answer, sp.Response) and answer.code == NOT_AVAILABLE
    formats = " ".join(str(event.get("log_format", "")) for event in events)
    assert "fleet login from {peer} was refused" in formats
    assert "relay to node {owner} ended" in formats


@pytest_twisted.ensureDeferred
async def test_an_owner_without_the_secret_gets_no_relay(nodes: Nodes) -> None:
    """The relay insists on the fleet's login: an owner that cannot take it is not used."""
    nodes.secrets["b"] = None
    await nodes.listen()
    nodes.stores["b"].create("far")
    peer = nodes.client()
    answer = await answer_to(peer, declare(peer, 1, "far", "p"))
    assert isinstance(answer, sp.Response) and answer.code == NOT_AVAILABLE
    assert nodes.stores["b"].get("far").writer_sequence("p") == 0  # type: ignore[union-attr]


# --- TLS ---------------------------------------------------------------------------------------


def pki_in(directory: Path) -> Pki:
    """The test PKI, written into ``directory`` (made here)."""
    directory.mkdir()
    return make_pki(directory)


def node_certificate(pki: Pki) -> tuple[Path, Path]:
    """A node's certificate for both ends of TLS (server and client), signed by the test CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(pki.ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(pki.ca.key, hashes.SHA256())
    )
    return write_pem(pki.directory, "node", CertifiedKey(certificate=certificate, key=key))


@pytest.mark.parametrize("verify", ["required", "optional"])
@pytest_twisted.ensureDeferred
async def test_a_tls_listener_relays_over_tls(nodes: Nodes, tmp_path: Path, verify: str) -> None:
    """On ``mtls:``, relays are TLS: the node's certificate where the listener requires one."""
    pki = pki_in(tmp_path / "pki")
    cert, key = node_certificate(pki)
    await nodes.listen(
        f"mtls:0:interface=127.0.0.1:certKey={cert}:privateKey={key}:caCerts={pki.ca_cert}"
        f":verify={verify}"
    )
    far = nodes.stores["b"].create("far")
    peer = nodes.client()
    answer = await answer_to(peer, declare(peer, 1, "far", "tls-producer"))
    assert isinstance(answer, sp.Response) and answer.code == 1, answer
    peer.send(publish(1, [1], [b"over TLS"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1])
    assert entries(far) == [b"over TLS"]
    (owner_side,) = nodes.b.connections
    assert ISSLTransport.providedBy(owner_side.transport)


@pytest_twisted.ensureDeferred
async def test_without_the_secret_a_tls_listener_does_not_relay(
    nodes: Nodes, tmp_path: Path
) -> None:
    """No secret, no proof of the owner: Metadata names it, publishers there get 6."""
    nodes.secrets = {"a": None, "b": None}
    pki = pki_in(tmp_path / "pki")
    cert, key = node_certificate(pki)
    await nodes.listen(f"mtls:0:interface=127.0.0.1:certKey={cert}:privateKey={key}")
    peer = nodes.client()
    assert peer.code(declare(peer, 1, "far", "p")) == NOT_AVAILABLE
    assert not nodes.b.connections


# --- routes into the listener ----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_routes_append_at_the_owner(nodes: Nodes) -> None:
    """A route's messages for a stream ``b`` owns land in ``b``'s log, created if missing."""
    nodes.b.authorization = Authorization.from_lists({"nobody": ((), ())})  # routes pass
    await nodes.listen()
    destination = nodes.destination()
    outcomes = await destination.deliver([message(b"one"), message(b"two")])
    assert [outcome.status for outcome in outcomes] == [Status.ACCEPTED] * 2
    far = nodes.stores["b"].get("far-routed")
    assert far is not None and bodies(far) == [b"one", b"two"]
    assert nodes.stores["a"].get("far-routed") is None
    outcomes = await destination.deliver([message(b"local", "near")])
    assert [outcome.status for outcome in outcomes] == [Status.ACCEPTED]
    near = nodes.stores["a"].get("near")
    assert near is not None and bodies(near) == [b"local"]


@pytest_twisted.ensureDeferred
async def test_routes_deduplicate_at_the_owner_under_this_nodes_reference(nodes: Nodes) -> None:
    """deliver_once: ids stored under the route's reference plus ``@a``; a repeat is not stored."""
    await nodes.listen()
    nodes.stores["b"].create("far-routed")
    destination = nodes.destination()
    first = await destination.deliver_once([message(b"1"), message(b"2")], "orders", [1, 2])
    again = await destination.deliver_once([message(b"2"), message(b"3")], "orders", [2, 3])
    assert [o.status for o in (*first, *again)] == [Status.ACCEPTED] * 4
    far = nodes.stores["b"].get("far-routed")
    assert far is not None and bodies(far) == [b"1", b"2", b"3"]
    assert far.writer_sequence(node_reference("msggateway.route.orders", "a")) == 3
    assert far.writer_sequence("msggateway.route.orders") == 0  # b's own route's, apart


@pytest_twisted.ensureDeferred
async def test_routes_retry_when_the_owner_cannot_be_reached(nodes: Nodes) -> None:
    """No owner now, or an owner not listening: retry later, nothing stored here."""
    await nodes.listen()
    assert nodes.port is not None
    await nodes.port.stopListening()
    nodes.port = None
    destination = nodes.destination()
    (outcome,) = await destination.deliver([message(b"lost?")])
    assert outcome.status is Status.RETRY
    nodes.placement.owners["far-routed"] = None
    (outcome,) = await destination.deliver([message(b"lost?")])
    assert outcome.status is Status.RETRY and "no owner" in outcome.reason
    assert nodes.stores["a"].get("far-routed") is None


@pytest_twisted.ensureDeferred
async def test_without_the_secret_routes_append_locally(nodes: Nodes) -> None:
    """No relay secret: the routing node's own log takes it, as before (and says so once)."""
    nodes.secrets = {"a": None, "b": None}
    await nodes.listen()
    destination = nodes.destination()
    events: list[LogEvent] = []
    observer = captured(events)
    try:
        for body in (b"one", b"two"):
            (outcome,) = await destination.deliver([message(body)])
            assert outcome.status is Status.ACCEPTED
    finally:
        globalLogPublisher.removeObserver(observer)
    here = nodes.stores["a"].get("far-routed")
    assert here is not None and bodies(here) == [b"one", b"two"]
    told = [event for event in events if "relay_secret" in str(event.get("log_format", ""))]
    assert len(told) == 1


def test_node_references_keep_nodes_apart_within_255_bytes() -> None:
    """Each node's ids under its own reference; one naming its reader already is kept."""
    assert node_reference("msggateway.route.orders", "a") == "msggateway.route.orders@a"
    assert node_reference("msggateway.route.orders", "b") != node_reference(
        "msggateway.route.orders", "a"
    )
    assert node_reference("msggateway.route.orders@reader", "a") == "msggateway.route.orders@reader"
    long = "msggateway.route." + "r" * 240
    qualified = node_reference(long, "node-with-a-long-id")
    assert len(qualified.encode()) <= 255 and qualified.startswith("msggateway.route.")
    assert qualified != node_reference(long, "another-node")
