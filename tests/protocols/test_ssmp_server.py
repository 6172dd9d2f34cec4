"""In-memory tests of the SSMP hub: `gateway.protocols.ssmp.server` and `.hub`.

Every connection is an `SSMPServerProtocol` built by one `SSMPServerFactory`
and attached to a `StringTransport`; time is a `Clock`; routes go through a
real `Router` to a small destination whose outcomes the test fires when it
wants. Peers going away are simulated by calling ``connectionLost``. The
behaviour checked is the spec's (../shared/specs/ssmp.txt) and
docs/protocols/ssmp.rst's (with "Flow control").
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from typing import TypeVar

import attrs
import pytest
from cryptography import x509
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import ISSLTransport
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, capturedLogs, textFileLogObserver
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import ssmp
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization, Grant
from gateway.core.batch import Answers
from gateway.core.flow import DEFAULT_FLOW, DISCONNECT, FlowPolicy
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.logformat import EscapingObserver, event_as_json
from gateway.metrics import GatewayMetrics
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.server import (
    SSMPServerFactory,
    SSMPServerProtocol,
    cert_identity_matches,
    outcome_response,
    secret_name_for,
)
from gateway.protocols.ssmp.settings import SSMPListenerSettings
from tests.certs import CertifiedKey, issue_client_certificate, make_ca
from tests.doubles import NO_LOGIN_WAIT, WritingTransport
from tests.protocols.test_listener import BufferingTransport

T = TypeVar("T")

LISTENER = "hub"
SINK = "sink"
SETTINGS = SSMPListenerSettings(
    schemes=frozenset({"open", "secret"}),
    anonymous=True,
    login_timeout_seconds=10.0,
    ping_interval_seconds=30.0,
    pong_timeout_seconds=30.0,
)
SECRETS = Secrets(logins={"sam": b"sesame"})
ORDERS = Route(
    name="orders",
    source=LISTENER,
    pattern=AddressPattern("orders.#"),
    destination=SINK,
    timeout_seconds=10.0,
)
"""MCASTs from the hub on ``orders.#`` go to the test's held destination."""

LIMIT = ssmp.MAX_LINE_BYTES
MCAST_WITHOUT_PAYLOAD = b"400 MCAST needs a topic and a non-empty payload\n"


# --- test doubles and helpers ------------------------------------------------------------


class HeldOutcome:
    """The outcome of one message held by a `HeldDestination`, for the test to give."""

    def __init__(self, answers: Answers, index: int) -> None:
        self._answers = answers
        self._index = index

    @property
    def called(self) -> bool:
        """Whether the message has its outcome (given, or its batch given up)."""
        return self._answers.outcomes[self._index] is not None or self._answers.deferred.called

    def callback(self, outcome: Outcome) -> None:
        """Give the message its outcome."""
        self._answers.settle(self._index, outcome)

    def errback(self, error: Exception) -> None:
        """Fail the message's whole batch unexpectedly, as a broken destination would."""
        self._answers.deferred.errback(error)


@implementer(IDestination)
class HeldDestination:
    """A route destination that records batches and lets the test decide each outcome.

    Each batch gets one `Answers`; ``outcomes`` holds a `HeldOutcome` per
    message, in arrival order, which the test fires (or lets the router
    time out) whenever it wants.
    """

    def __init__(self, name: str = SINK) -> None:
        self.name = name
        self.batches: list[list[Message]] = []
        self.messages: list[Message] = []
        self.outcomes: list[HeldOutcome] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Record the batch; its outcomes come when the test gives them."""
        answers = Answers(len(messages))
        self.batches.append(list(messages))
        self.messages.extend(messages)
        self.outcomes.extend(HeldOutcome(answers, index) for index in range(len(messages)))
        return answers.deferred


class CountingTransport(StringTransport):
    """A StringTransport that counts how many writes reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        """Count, then buffer."""
        self.writes += 1
        super().write(data)

    def writeSequence(self, data: Iterable[bytes]) -> None:  # noqa: N802 (Twisted's name)
        """Count a sequence as one write, then buffer."""
        self.writes += 1
        super().writeSequence(data)


@implementer(ISSLTransport)
class TLSStringTransport(StringTransport):
    """A StringTransport that looks like TLS, with a given peer certificate (or none)."""

    def __init__(self, certificate: x509.Certificate | None) -> None:
        super().__init__()
        self._certificate = certificate

        self.no_delay = False

    def getPeerCertificate(self) -> x509.Certificate | None:
        """Return the client certificate the test chose."""
        return self._certificate

    def setTcpNoDelay(self, enabled: bool) -> None:  # noqa: N802 (Twisted's name)
        """Record the TCP_NODELAY setting (ISSLTransport extends ITCPTransport)."""
        self.no_delay = enabled

    def getTcpNoDelay(self) -> bool:  # noqa: N802 (Twisted's name)
        """Return the recorded TCP_NODELAY setting."""
        return self.no_delay

    def setTcpKeepAlive(self, enabled: bool) -> None:  # noqa: N802 (Twisted's name)
        """Ignore keep-alive (part of ITCPTransport)."""

    def getTcpKeepAlive(self) -> bool:  # noqa: N802 (Twisted's name)
        """Keep-alive is off (part of ITCPTransport)."""
        return False

    def loseWriteConnection(self) -> None:  # noqa: N802 (Twisted's name)
        """Close the write side, as far as a test can tell (part of ITCPTransport)."""
        self.loseConnection()


class Peer:
    """One connection to the hub, seen from the test."""

    def __init__(self, protocol: SSMPServerProtocol, transport: StringTransport) -> None:
        self.protocol = protocol
        self.transport = transport

    def send(self, data: bytes) -> None:
        """Deliver bytes from the peer, as the reactor would."""
        self.protocol.dataReceived(data)

    def received(self) -> bytes:
        """Return what the hub wrote to the peer since the last call."""
        data: bytes = self.transport.value()
        self.transport.clear()
        return data

    def lose(self) -> None:
        """Simulate the connection going away."""
        self.protocol.connectionLost(Failure(ConnectionLost("gone")))


class HubWorld:
    """One SSMP listener with its hub, router, secrets, clock and metrics."""

    def __init__(
        self,
        settings: SSMPListenerSettings = SETTINGS,
        routes: Iterable[Route] = (),
        flow: FlowPolicy = DEFAULT_FLOW,
    ) -> None:
        self.clock = Clock()
        self.metrics = GatewayMetrics()
        self.sink = HeldDestination()
        self.hub = Hub(LISTENER, self.clock)
        table = bind_routes(routes, {SINK: self.sink, LISTENER: self.hub})
        self.router = Router(table, self.clock, self.metrics)
        self.factory = SSMPServerFactory(
            name=LISTENER,
            settings=settings,
            hub=self.hub,
            router=self.router,
            secrets=SECRETS,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.factory.flow = flow
        self.factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits

    def connect(self, transport: StringTransport | None = None) -> Peer:
        """Open a connection (no LOGIN yet)."""
        if transport is None:
            transport = StringTransport()
        protocol = self.factory.buildProtocol(IPv4Address("TCP", "192.0.2.1", 40000))
        protocol.makeConnection(transport)
        return Peer(protocol, transport)

    def login(
        self,
        identity: str = "alice",
        scheme: str = "open",
        transport: StringTransport | None = None,
    ) -> Peer:
        """Open a connection and log in; the 200 is consumed."""
        peer = self.connect(transport)
        peer.send(f"LOGIN {identity} {scheme}\n".encode())
        assert peer.received() == b"200\n"
        return peer

    def subscriber(self, identity: str, *topics: str, presence: bool = False) -> Peer:
        """Log in and subscribe to topics; every response is consumed."""
        peer = self.login(identity)
        flag = " PRESENCE" if presence else ""
        peer.send(b"".join(f"SUBSCRIBE {topic}{flag}\n".encode() for topic in topics))
        assert peer.received() == b"200\n" * len(topics)
        return peer

    def sample(self, name: str, **labels: str) -> float:
        """Return a metric's current value (0 when it was never set)."""
        value = self.metrics.registry.get_sample_value(name, {"endpoint": LISTENER, **labels})
        return 0.0 if value is None else value


def fired(deferred: Deferred[T]) -> T:
    """Return the result of a Deferred that must already have fired successfully."""
    results: list[T | Failure] = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


@pytest.fixture
def world() -> HubWorld:
    """A hub offering ``open`` and ``secret`` and anonymous login, with no routes."""
    return HubWorld()


@pytest.fixture
def routed() -> HubWorld:
    """A hub whose MCASTs on ``orders.#`` are routed to a held destination."""
    return HubWorld(routes=[ORDERS])


@pytest.fixture(scope="module")
def ca() -> CertifiedKey:
    """A test CA for client certificates."""
    return make_ca("msggateway protocol tests CA")


# --- cert_identity_matches and outcome_response ---------------------------------------------


@pytest.mark.parametrize(
    ("identity", "expected"),
    [
        ("alice", True),  # the Common Name
        ("alice.example.org", True),  # a SAN
        ("alice/1", True),  # NAME/suffix: several connections with one certificate
        ("alice.example.org/phone-2", True),
        ("alice/", False),  # a slash needs one or more ID characters after it
        ("alicex", False),  # a prefix without the slash is another name
        ("alice.example", False),
        ("bob", False),
        ("xalice/1", False),
    ],
)
def test_cert_identity_matches(identity: str, expected: bool) -> None:
    """A LOGIN id matches the certificate's names exactly, or as ``NAME/suffix``."""
    assert cert_identity_matches(identity, frozenset({"alice", "alice.example.org"})) is expected


def test_cert_identity_matches_nothing_without_names() -> None:
    """A certificate without names vouches for no identifier."""
    assert not cert_identity_matches("alice", frozenset())


@pytest.mark.parametrize(
    ("identity", "owner"),
    [
        ("alice", "alice"),
        ("alice/phone", "alice"),  # NAME/suffix: NAME's secret, as for certificates
        ("alice/phone/2", "alice"),
        ("team/a/x", "team/a"),  # the longest name with a secret of its own
        ("own/x", "own/x"),  # a secret of its own comes first
        ("alice/", "alice/"),  # a slash needs one or more ID characters after it
        ("carol/x", "carol/x"),  # nobody's: only the shared * secret would do
        ("alicex", "alicex"),
    ],
)
def test_secret_name_for(identity: str, owner: str) -> None:
    """Whose secret a ``secret`` login presents: its own, else the name it extends."""
    logins = {"alice": b"a", "team/a": b"t", "team": b"u", "own/x": b"o", "own": b"p", "*": b"s"}
    assert secret_name_for(identity, logins) == owner


def test_secret_login_as_name_suffix_takes_the_names_secret() -> None:
    """``sam/phone`` logs in with sam's secret and is sam for the allow-lists; not with another."""
    world = HubWorld()
    world.factory.authorization = Authorization({"sam": Grant(publish=(AddressPattern("t"),))})
    peer = world.connect()
    peer.send(b"LOGIN sam/phone secret sesame\nMCAST t hi\n")
    assert peer.received() == b"200\n200\n"
    refused = world.connect()
    refused.send(b"LOGIN sam/phone secret wrong\n")
    world.clock.advance(60)  # refused logins are answered after the throttle's wait
    assert refused.received().startswith(b"401")


@pytest.mark.parametrize(
    ("outcome", "line"),
    [
        (Outcome.accepted(), b"200\n"),
        (Outcome.accepted("kept"), b"200\n"),
        (Outcome.retry("queue full"), b"400 retry: queue full\n"),
        (Outcome.rejected("no such sink", code="404"), b"400 rejected: no such sink\n"),
        (Outcome.rejected("two\nlines"), b"400 rejected: two lines\n"),
    ],
)
def test_outcome_response(outcome: Outcome, line: bytes) -> None:
    """Accepted is 200; retry and rejected are 400 with ``retry:``/``rejected:`` reasons."""
    assert outcome_response(outcome) == line


# --- login ----------------------------------------------------------------------------------


def test_open_login_answers_200_without_payload(world: HubWorld) -> None:
    """``LOGIN id open`` succeeds with a bare 200; a credential is ignored."""
    alice = world.connect()
    alice.send(b"LOGIN alice open whatever\n")
    assert alice.received() == b"200\n"
    assert not alice.transport.disconnecting
    assert world.hub.peers[b"alice"] is alice.protocol


def test_secret_login_checks_the_secret(world: HubWorld) -> None:
    """The ``secret`` scheme accepts the secret from Secrets and nothing else."""
    sam = world.connect()
    sam.send(b"LOGIN sam secret sesame\n")
    assert sam.received() == b"200\n"

    for line in (b"LOGIN sam secret wrong\n", b"LOGIN sam secret\n", b"LOGIN eve secret sesame\n"):
        peer = world.connect()
        peer.send(line)
        assert peer.received() == b"401 open secret\n", line
        assert peer.transport.disconnecting, line
    assert world.sample("msggateway_protocol_errors_total", kind="unauthorized") == 3


def test_unsupported_scheme_is_401_listing_offered_schemes(world: HubWorld) -> None:
    """An unknown scheme, or ``cert`` on a plain connection, gets 401 <schemes> and a close."""
    for line in (b"LOGIN bob kerberos\n", b"LOGIN bob cert\n"):
        peer = world.connect()
        peer.send(line + b"MCAST news ignored\n")
        assert peer.received() == b"401 open secret\n", line
        assert peer.transport.disconnecting
    assert world.hub.peers == {}


def test_open_is_off_unless_listed() -> None:
    """A listener with the default schemes refuses ``open`` and offers only ``secret``."""
    world = HubWorld(settings=SSMPListenerSettings())
    peer = world.connect()
    peer.send(b"LOGIN bob open\n")
    assert peer.received() == b"401 secret\n"
    assert peer.transport.disconnecting


def test_anonymous_login_when_enabled(world: HubWorld) -> None:
    """``LOGIN . open`` succeeds when anonymous login is on; several at once; not a named peer."""
    first = world.login(".")
    second = world.login(".")
    assert not first.transport.disconnecting
    assert not second.transport.disconnecting
    assert world.hub.peers == {}


def test_anonymous_login_refused_when_disabled() -> None:
    """With ``anonymous = false`` the reserved ``.`` id is refused with 401."""
    world = HubWorld(settings=attrs.evolve(SETTINGS, anonymous=False))
    peer = world.connect()
    peer.send(b"LOGIN . open\n")
    assert peer.received() == b"401 open secret\n"
    assert peer.transport.disconnecting


def test_anonymous_login_with_unsupported_scheme_is_401(world: HubWorld) -> None:
    """Spec, "Login": an unsupported scheme gets 401 even for the anonymous id."""
    peer = world.connect()
    peer.send(b"LOGIN . kerberos\n")
    assert peer.received() == b"401 open secret\n"
    assert peer.transport.disconnecting


def test_second_login_is_405(world: HubWorld) -> None:
    """A LOGIN after a successful one is answered 405 and the connection stays."""
    alice = world.login("alice")
    alice.send(b"LOGIN bob open\n")
    assert alice.received() == b"405 already logged in\n"
    assert not alice.transport.disconnecting
    assert set(world.hub.peers) == {b"alice"}


def test_first_request_not_login_is_400_and_close(world: HubWorld) -> None:
    """Spec, "Login": a first request other than LOGIN gets 400 and an immediate close."""
    peer = world.connect()
    peer.send(b"SUBSCRIBE news\n")
    assert peer.received() == b"400 the first request must be LOGIN\n"
    assert peer.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind="no-login") == 1


def test_cert_login_over_tls(world: HubWorld, ca: CertifiedKey) -> None:
    """On TLS, ``cert`` accepts the CN, a SAN of a type the listener takes and ``NAME/suffix``."""
    world.factory.cert_identity = ("cn", "dns")
    alice = issue_client_certificate(ca, "alice", dns_names=["alice.example.org"]).certificate
    for identity in ("alice", "alice.example.org", "alice/laptop"):
        transport = TLSStringTransport(alice)
        peer = world.connect(transport)
        assert transport.no_delay  # we batch writes ourselves
        peer.send(f"LOGIN {identity} cert\n".encode())
        assert peer.received() == b"200\n", identity
    for identity in ("bob", "alice/", "alicex"):
        peer = world.connect(TLSStringTransport(alice))
        peer.send(f"LOGIN {identity} cert\n".encode())
        assert peer.received() == b"401 cert open secret\n", identity
        assert peer.transport.disconnecting


def test_cert_login_by_the_common_name_only_by_default(world: HubWorld, ca: CertifiedKey) -> None:
    """By default SANs are no identities: CN alice with SANs bob, admin logs in as alice only."""
    alice = issue_client_certificate(
        ca, "alice", dns_names=["bob"], emails=["admin"], uris=["urn:x:carol"]
    ).certificate
    for identity, reply in (
        ("alice", b"200\n"),
        ("alice/x", b"200\n"),
        ("bob", b"401 cert open secret\n"),
        ("bob/x", b"401 cert open secret\n"),
        ("admin", b"401 cert open secret\n"),
        ("urn:x:carol", b"401 cert open secret\n"),
    ):
        peer = world.connect(TLSStringTransport(alice))
        peer.send(f"LOGIN {identity} cert\n".encode())
        assert peer.received() == reply, identity


def test_cert_login_without_certificate_is_401(world: HubWorld) -> None:
    """A TLS connection without a client certificate cannot log in with ``cert``."""
    peer = world.connect(TLSStringTransport(None))
    peer.send(b"LOGIN alice cert\n")
    assert peer.received() == b"401 cert open secret\n"
    assert peer.transport.disconnecting


def test_refused_login_is_logged(world: HubWorld) -> None:
    """A refused LOGIN is logged once with identity, scheme, peer address and why."""
    peer = world.connect()
    with capturedLogs() as events:
        peer.send(b"LOGIN sam secret wrong\n")
    refused = [event for event in events if "why" in event]
    assert len(refused) == 1
    assert refused[0]["identity"] == "sam"
    assert refused[0]["mechanism"] == "LOGIN secret"
    assert refused[0]["peer"] == "192.168.1.1:54321"  # StringTransport's peer
    assert refused[0]["why"] == "wrong or missing secret"


# --- login time-out and pings ---------------------------------------------------------------


def test_login_timeout_closes_without_response(world: HubWorld) -> None:
    """Spec, "Login": no request in time closes the connection without a response."""
    peer = world.connect()
    peer.send(b"LOGIN al")  # not a complete request
    world.clock.advance(9.9)
    assert not peer.transport.disconnecting
    world.clock.advance(0.1)
    assert peer.transport.disconnecting
    assert peer.received() == b""
    assert world.sample("msggateway_protocol_errors_total", kind="login-timeout") == 1


def test_login_in_time_cancels_the_timeout(world: HubWorld) -> None:
    """A LOGIN before the time-out keeps the connection open past it."""
    peer = world.connect()
    world.clock.advance(9)
    peer.send(b"LOGIN alice open\n")
    world.clock.advance(5)
    assert not peer.transport.disconnecting
    assert peer.received() == b"200\n"


def test_server_pings_when_idle_and_closes_without_pong(world: HubWorld) -> None:
    """After ``ping_interval`` of silence the hub sends ``000 . PING``, then closes without PONG."""
    alice = world.login("alice")
    world.clock.advance(29.9)
    assert alice.received() == b""
    world.clock.advance(0.1)
    assert alice.received() == b"000 . PING\n"
    world.clock.advance(29.9)
    assert not alice.transport.disconnecting
    world.clock.advance(0.1)
    assert alice.transport.disconnecting
    assert alice.received() == b""
    assert world.sample("msggateway_protocol_errors_total", kind="pong-timeout") == 1


def test_a_peer_without_pong_is_aborted(world: HubWorld) -> None:
    """Issue 18: the pong time-out gives up on the peer: aborted, not left to drain its buffer."""
    alice = world.login("alice")
    world.clock.advance(30)
    assert alice.received() == b"000 . PING\n"
    world.clock.advance(30)
    assert alice.transport.disconnected  # abortConnection, not loseConnection
    assert alice.transport.producer is alice.protocol  # no graceful close was begun


def test_pong_keeps_the_connection(world: HubWorld) -> None:
    """A PONG gets no answer and keeps the connection; the next PING follows a new silence."""
    alice = world.login("alice")
    world.clock.advance(30)
    assert alice.received() == b"000 . PING\n"
    world.clock.advance(5)
    alice.send(b"PONG\n")
    assert alice.received() == b""  # Spec: no message in response to PONG.
    world.clock.advance(25)  # pong time-out passes: the PONG came
    assert not alice.transport.disconnecting
    assert alice.received() == b""
    world.clock.advance(5)  # 30 s after the PONG
    assert alice.received() == b"000 . PING\n"


def test_other_traffic_counts_as_alive(world: HubWorld) -> None:
    """Any request after the PING shows the peer is alive: no close at the pong time-out."""
    alice = world.login("alice")
    world.clock.advance(30)
    assert alice.received() == b"000 . PING\n"
    world.clock.advance(10)
    alice.send(b"SUBSCRIBE news\n")
    world.clock.advance(20)
    assert not alice.transport.disconnecting
    assert alice.received() == b"200\n"


def test_traffic_postpones_the_ping(world: HubWorld) -> None:
    """Requests reset the idle clock: the PING comes ``ping_interval`` after the last one."""
    alice = world.login("alice")
    world.clock.advance(20)
    alice.send(b"MCAST news hello\n")
    assert alice.received() == b"200\n"
    world.clock.advance(10)
    assert alice.received() == b""
    world.clock.advance(20)
    assert alice.received() == b"000 . PING\n"


def test_ping_request_is_answered_pong(world: HubWorld) -> None:
    """Spec, "Client-initiated": PING gets ``000 . PONG``."""
    alice = world.login("alice")
    alice.send(b"PING\n")
    assert alice.received() == b"000 . PONG\n"


def test_connection_lost_cancels_timers(world: HubWorld) -> None:
    """No timer of a closed connection is left on the clock."""
    waiting = world.connect()
    alice = world.login("alice")
    waiting.lose()
    alice.lose()
    world.clock.advance(0)  # the hub's flush of presence events
    assert world.clock.getDelayedCalls() == []


# --- simple requests ---------------------------------------------------------------------


def test_close_answers_200_and_closes(world: HubWorld) -> None:
    """CLOSE gets 200 and the connection closes; requests after it are not handled."""
    alice = world.login("alice")
    alice.send(b"CLOSE\nSUBSCRIBE news\n")
    assert alice.received() == b"200\n"
    assert alice.transport.disconnecting
    assert world.hub.topics == {}


def test_unknown_verb_is_501(world: HubWorld) -> None:
    """Spec, "Forward compatibility": an unrecognized verb gets 501; the connection stays."""
    alice = world.login("alice")
    alice.send(b"FROB thing some payload\nFROB\n")
    assert alice.received() == b"501 FROB is not implemented\n" * 2
    assert not alice.transport.disconnecting


def test_subscribe_twice_is_409(world: HubWorld) -> None:
    """SUBSCRIBE answers 200, then 409 for a topic already subscribed to."""
    alice = world.login("alice")
    alice.send(b"SUBSCRIBE news\nSUBSCRIBE news PRESENCE\nSUBSCRIBE sport\n")
    assert alice.received() == b"200\n409 already subscribed\n200\n"
    assert alice.protocol.topics == {b"news": False, b"sport": False}


def test_unsubscribe_not_subscribed_is_404(world: HubWorld) -> None:
    """UNSUBSCRIBE answers 200 once, then 404."""
    alice = world.login("alice")
    alice.send(b"SUBSCRIBE news\nUNSUBSCRIBE news\nUNSUBSCRIBE news\nUNSUBSCRIBE sport\n")
    assert alice.received() == b"200\n200\n404 not subscribed\n404 not subscribed\n"
    assert world.hub.topics == {}


def test_anonymous_may_only_publish(world: HubWorld) -> None:
    """Anonymous peers get 405 for SUBSCRIBE, UNSUBSCRIBE and BCAST, but may MCAST and UCAST."""
    bob = world.subscriber("bob", "news")
    anon = world.login(".")
    anon.send(b"SUBSCRIBE news\nUNSUBSCRIBE news\nBCAST hi\nMCAST news hello\nUCAST bob psst\n")
    assert anon.received() == (
        b"405 anonymous peers cannot SUBSCRIBE\n"
        b"405 anonymous peers cannot UNSUBSCRIBE\n"
        b"405 anonymous peers cannot BCAST\n"
        b"200\n"
        b"200\n"
    )
    assert bob.received() == b"000 . MCAST news hello\n000 . UCAST bob psst\n"


# --- presence ------------------------------------------------------------------------------


def test_presence_initial_batch_and_events(world: HubWorld) -> None:
    """PRESENCE gives an initial batch of current subscribers, then SUBSCRIBE events."""
    alice = world.subscriber("alice", "news", presence=True)
    bob = world.subscriber("bob", "news")
    assert alice.received() == b"000 bob SUBSCRIBE news\n"

    carol = world.login("carol")
    carol.send(b"SUBSCRIBE news PRESENCE\n")
    assert carol.received() == b"200\n000 alice SUBSCRIBE news PRESENCE\n000 bob SUBSCRIBE news\n"
    assert alice.received() == b"000 carol SUBSCRIBE news PRESENCE\n"
    assert bob.received() == b""  # bob did not ask for presence


def test_presence_unsubscribe_events(world: HubWorld) -> None:
    """UNSUBSCRIBE is announced to presence subscribers, never before its SUBSCRIBE."""
    alice = world.subscriber("alice", "news", presence=True)
    bob = world.login("bob")
    bob.send(b"SUBSCRIBE news\nUNSUBSCRIBE news\n")
    assert bob.received() == b"200\n200\n"
    assert alice.received() == b"000 bob SUBSCRIBE news\n000 bob UNSUBSCRIBE news\n"


def test_connection_lost_sends_unsubscribe_events(world: HubWorld) -> None:
    """Spec, "Closing connections": a lost peer's topics get UNSUBSCRIBE events."""
    alice = world.subscriber("alice", "news", "sport", presence=True)
    bob = world.subscriber("bob", "news", "sport", "weather")
    assert alice.received() == b"000 bob SUBSCRIBE news\n000 bob SUBSCRIBE sport\n"
    bob.lose()
    assert alice.received() == b""  # written on the next reactor turn
    world.clock.advance(0)
    assert alice.received() == b"000 bob UNSUBSCRIBE news\n000 bob UNSUBSCRIBE sport\n"
    assert b"bob" not in world.hub.peers
    assert set(world.hub.topics) == {b"news", b"sport"}


def test_close_sends_unsubscribe_events(world: HubWorld) -> None:
    """A peer that sends CLOSE is unsubscribed from everything once its connection ends."""
    alice = world.subscriber("alice", "news", presence=True)
    bob = world.subscriber("bob", "news")
    alice.received()
    bob.send(b"CLOSE\n")
    assert bob.transport.disconnecting
    bob.lose()
    world.clock.advance(0)
    assert alice.received() == b"000 bob UNSUBSCRIBE news\n"


# --- forwarding ------------------------------------------------------------------------------


def test_ucast(world: HubWorld) -> None:
    """UCAST reaches the named peer; 404 for an unknown peer, 405 for the anonymous id."""
    alice = world.login("alice")
    bob = world.login("bob")
    alice.send(b"UCAST bob hello there\nUCAST nobody hi\nUCAST . hi\n")
    assert alice.received() == b"200\n404 no such peer\n405 anonymous peers cannot receive UCAST\n"
    assert bob.received() == b"000 alice UCAST bob hello there\n"


def test_mcast_is_not_echoed_and_never_404(world: HubWorld) -> None:
    """MCAST reaches every subscriber but its sender; a topic without subscribers is 200."""
    alice = world.subscriber("alice", "news")
    bob = world.subscriber("bob", "news")
    carol = world.subscriber("carol", "sport")
    alice.send(b"MCAST news big news\nMCAST empty nobody listens\n")
    assert alice.received() == b"200\n200\n"
    assert bob.received() == b"000 alice MCAST news big news\n"
    assert carol.received() == b""


def test_mcast_without_subscription(world: HubWorld) -> None:
    """A client does not need to be subscribed to a topic to publish to it."""
    bob = world.subscriber("bob", "news")
    dave = world.login("dave")
    dave.send(b"MCAST news hi\n")
    assert dave.received() == b"200\n"
    assert bob.received() == b"000 dave MCAST news hi\n"


def test_bcast_reaches_each_sharing_peer_once(world: HubWorld) -> None:
    """BCAST reaches every peer sharing a topic with the sender exactly once, not the sender."""
    alice = world.subscriber("alice", "a", "b")
    bob = world.subscriber("bob", "a", "b")
    carol = world.subscriber("carol", "b", "c")
    dave = world.subscriber("dave", "c")
    alice.send(b"BCAST hello all\n")
    assert alice.received() == b"200\n"
    assert bob.received() == b"000 alice BCAST hello all\n"
    assert carol.received() == b"000 alice BCAST hello all\n"
    assert dave.received() == b""


def test_new_login_evicts_the_older_connection(world: HubWorld) -> None:
    """Spec, "Named connections": a login with a connected identity closes the older one."""
    watcher = world.subscriber("watcher", "news", presence=True)
    old = world.subscriber("alice", "news")
    assert watcher.received() == b"000 alice SUBSCRIBE news\n"

    new = world.login("alice")
    assert old.transport.disconnecting
    assert watcher.received() == b"000 alice UNSUBSCRIBE news\n"
    assert world.hub.peers[b"alice"] is new.protocol

    watcher.send(b"UCAST alice for the new one\nMCAST news nobody\n")
    assert watcher.received() == b"200\n200\n"
    assert new.received() == b"000 watcher UCAST alice for the new one\n"
    assert old.received() == b""

    old.lose()  # the old connection's end must not unregister the new one
    world.clock.advance(0)
    assert world.hub.peers[b"alice"] is new.protocol
    assert watcher.received() == b""


def test_one_write_per_peer_per_batch(world: HubWorld) -> None:
    """Many MCASTs in one read give ONE write per subscriber and one for the publisher."""
    bob_transport = CountingTransport()
    bob = world.login("bob", transport=bob_transport)
    bob.send(b"SUBSCRIBE news\n")
    bob.received()
    alice_transport = CountingTransport()
    alice = world.login("alice", transport=alice_transport)
    bob_writes, alice_writes = bob_transport.writes, alice_transport.writes

    alice.send(b"".join(b"MCAST news message %d\n" % i for i in range(50)))
    assert bob_transport.writes == bob_writes + 1
    assert alice_transport.writes == alice_writes + 1
    assert bob.received() == b"".join(b"000 alice MCAST news message %d\n" % i for i in range(50))
    assert alice.received() == b"200\n" * 50


@pytest.mark.parametrize(
    ("template", "fixed"),
    [
        (b"MCAST news %s\n", len(b"000 alice MCAST news \n")),
        (b"UCAST bob %s\n", len(b"000 alice UCAST bob \n")),
        (b"BCAST %s\n", len(b"000 alice BCAST \n")),
    ],
)
def test_too_long_to_forward_is_400(world: HubWorld, template: bytes, fixed: int) -> None:
    """A request whose event would pass 1,024 bytes gets 400; one that just fits is forwarded."""
    bob = world.subscriber("bob", "news")
    alice = world.subscriber("alice", "news")
    fits = b"x" * (LIMIT - fixed)
    alice.send(template % fits)
    assert alice.received() == b"200\n"
    event = bob.received()
    assert len(event) == LIMIT
    assert event.endswith(fits + b"\n")

    alice.send(template % (fits + b"y"))
    assert alice.received().startswith(b"400 too long to forward")
    assert bob.received() == b""
    assert not alice.transport.disconnecting


def test_malformed_input_is_400_and_close_after_earlier_lines(world: HubWorld) -> None:
    """Lines before a malformed one are handled; then ``400 <reason>`` and a close."""
    bob = world.subscriber("bob", "news")
    alice = world.login("alice")
    alice.send(b"SUBSCRIBE sport\nMCAST news first\nMCAST news\nSUBSCRIBE weather\n")
    assert alice.received() == b"200\n200\n" + MCAST_WITHOUT_PAYLOAD
    assert alice.transport.disconnecting
    assert bob.received() == b"000 alice MCAST news first\n"
    assert set(world.hub.topics) == {b"news", b"sport"}
    assert world.sample("msggateway_protocol_errors_total", kind="malformed") == 1

    alice.send(b"MCAST news ignored\n")  # nothing more is read
    assert alice.received() == b""
    assert bob.received() == b""


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"subscribe news\n", "bad-verb"),
        (b"SUBSCRIBE bad*topic\n", "bad-id"),
        (b"\n", "empty"),
        (b"MCAST news " + b"x" * LIMIT, "line-too-long"),
    ],
)
def test_malformed_requests(world: HubWorld, data: bytes, kind: str) -> None:
    """Bad verbs, bad ids, empty lines and over-long lines get 400 and a close; others go on."""
    bob = world.login("bob")
    alice = world.login("alice")
    alice.send(data)
    answer = alice.received()
    assert answer.startswith(b"400 ")
    assert answer.endswith(b"\n")
    assert alice.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", kind=kind) == 1
    alice.lose()
    bob.send(b"PING\n")
    assert bob.received() == b"000 . PONG\n"


def test_a_hostile_verb_is_answered_and_logged_escaped(world: HubWorld) -> None:
    """A verb of terminal escapes ending in CR: one clean 400 line, one clean log line each way."""
    alice = world.login("alice")
    with capturedLogs() as events:
        alice.send(b"\x1b[2J\x1b[31mroot\r\nFORGED 200 all is well\n")
    quoted = "'\\x1b[2J\\x1b[31mroot\\r'"
    assert alice.received() == f"400 verb {quoted} is not upper-case letters\n".encode()
    assert alice.transport.disconnecting
    [warning] = [event for event in events if event["log_level"] == LogLevel.warn]

    out = io.StringIO()
    EscapingObserver(textFileLogObserver(out))(warning)
    text = out.getvalue()
    assert text.count("\n") == 1
    assert not any(ord(char) < 0x20 or ord(char) == 0x7F for char in text.rstrip("\n"))
    assert f"hub: bad input from alice: verb {quoted} is not upper-case letters;" in text
    record = json.loads(event_as_json(warning))
    assert record["reason"] == f"verb {quoted} is not upper-case letters"
    assert record["message"].endswith("answering 400 and closing")
    assert "FORGED" not in text + record["message"]  # the codec is dead after the bad line


def test_metrics_count_connections_lines_and_bytes(world: HubWorld) -> None:
    """Connections, received and sent lines and bytes are counted per listener."""
    bob = world.subscriber("bob", "news")
    alice = world.login("alice")
    assert world.sample("msggateway_connections", protocol="ssmp") == 2
    assert world.sample("msggateway_connections_opened_total", protocol="ssmp") == 2
    received = world.sample("msggateway_messages_received_total")
    sent = world.sample("msggateway_messages_sent_total")
    bytes_in = world.sample("msggateway_received_bytes_total")
    bytes_out = world.sample("msggateway_sent_bytes_total")

    request = b"MCAST news hello\nMCAST news again\n"
    alice.send(request)
    written = len(alice.received()) + len(bob.received())
    assert world.sample("msggateway_messages_received_total") == received + 2
    assert world.sample("msggateway_received_bytes_total") == bytes_in + len(request)
    assert world.sample("msggateway_messages_sent_total") == sent + 4  # two 200s, two events
    assert world.sample("msggateway_sent_bytes_total") == bytes_out + written

    alice.lose()
    bob.lose()
    assert world.sample("msggateway_connections", protocol="ssmp") == 0
    assert world.factory.connections == set()


# --- routes --------------------------------------------------------------------------------


def test_held_destination_provides_idestination() -> None:
    """The test's destination is a real IDestination, like the hub itself."""
    assert verifyObject(IDestination, HeldDestination())
    assert verifyObject(IDestination, Hub(LISTENER, Clock()))


def test_a_routed_batch_answered_outside_a_read_is_pushed_to_the_socket(routed: HubWorld) -> None:
    """The route's 200s, answered as its destination confirms, go to the socket at once.

    Not a reactor turn or two later (`ListenerConnection.push_answers`);
    within a read, a batch answered at once goes with the read's write.
    """
    transport = WritingTransport()
    alice = routed.login("alice", transport=transport)
    alice.send(b"MCAST orders.new 3 apples\n")
    pushed = transport.pushed
    routed.sink.outcomes[0].callback(Outcome.accepted())
    assert alice.received() == b"200\n"
    assert transport.pushed == pushed + 1


def test_a_routed_batch_answered_within_its_read_goes_with_the_reads_write() -> None:
    """A route that answers at once (to the hub itself): no push of its own."""
    loop = attrs.evolve(
        ORDERS, name="loop", destination=LISTENER, target=AddressTemplate("copy.{address}")
    )
    world = HubWorld(routes=[loop])
    transport = WritingTransport()
    alice = world.login("alice", transport=transport)
    alice.send(b"MCAST orders.new 3 apples\n")
    assert alice.received() == b"200\n"
    assert transport.pushed == 0


def test_routed_mcast_waits_for_the_outcome(routed: HubWorld) -> None:
    """The publisher's 200 waits for the route's outcome; subscribers get the event at once."""
    bob = routed.subscriber("bob", "orders.new")
    alice = routed.login("alice")
    alice.send(b"MCAST orders.new 3 apples\n")
    routed.clock.advance(0)
    assert alice.received() == b""
    assert bob.received() == b"000 alice MCAST orders.new 3 apples\n"
    [message] = routed.sink.messages
    assert (message.address, message.sender, message.body) == ("orders.new", "alice", b"3 apples")
    assert message.headers == {"ssmp.verb": "MCAST"}

    routed.sink.outcomes[0].callback(Outcome.accepted())
    assert alice.received() == b"200\n"  # answered outside a read: written at once
    assert (
        routed.metrics.registry.get_sample_value(
            "msggateway_route_outcomes_total", {"route": "orders", "outcome": "accepted"}
        )
        == 1
    )


def test_unrouted_mcast_is_answered_at_once(routed: HubWorld) -> None:
    """An MCAST that no route takes is answered 200 straight away."""
    alice = routed.login("alice")
    alice.send(b"MCAST news hi\n")
    assert alice.received() == b"200\n"
    assert routed.sink.messages == []


def test_responses_stay_in_request_order(routed: HubWorld) -> None:
    """Later immediate answers wait behind an earlier routed MCAST, in request order."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.a 1\nSUBSCRIBE news\nMCAST orders.b 2\nMCAST news 3\nFROB\n")
    routed.clock.advance(0)
    assert alice.received() == b""
    first, second = routed.sink.outcomes

    second.callback(Outcome.rejected("no"))
    routed.clock.advance(0)
    assert alice.received() == b""
    first.callback(Outcome.accepted())
    routed.clock.advance(0)
    assert alice.received() == b"200\n200\n400 rejected: no\n200\n501 FROB is not implemented\n"


def test_a_routes_batch_is_answered_in_one_write(routed: HubWorld) -> None:
    """A read's routed MCASTs, answered together by their route, go out in one write.

    Each still gets its own response, in request order, the unrouted ones in
    between included; and each takes the read's arrival time.
    """
    transport = CountingTransport()
    alice = routed.login("alice", transport=transport)
    routed.clock.advance(7)
    alice.send(b"MCAST orders.a 1\nMCAST news 2\nMCAST orders.b 3\nMCAST orders.c 4\n")
    assert [m.timestamp for m in routed.sink.messages] == [7, 7, 7]
    first, second, third = routed.sink.outcomes
    first.callback(Outcome.accepted())
    third.callback(Outcome.rejected("no"))
    routed.clock.advance(0)
    writes = transport.writes
    assert alice.received() == b""
    second.callback(Outcome.accepted())
    routed.clock.advance(0)
    assert alice.received() == b"200\n200\n200\n400 rejected: no\n"
    assert transport.writes == writes + 1


@pytest.mark.parametrize(
    ("outcome", "line"),
    [
        (Outcome.retry("sink is full"), b"400 retry: sink is full\n"),
        (Outcome.rejected("sink refused it", code="550"), b"400 rejected: sink refused it\n"),
    ],
)
def test_failed_outcomes_map_to_400(routed: HubWorld, outcome: Outcome, line: bytes) -> None:
    """Retry and rejected outcomes reach the publisher as ``400 retry:``/``400 rejected:``."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\n")
    routed.sink.outcomes[0].callback(outcome)
    routed.clock.advance(0)
    assert alice.received() == line
    assert not alice.transport.disconnecting


def test_destination_failure_is_retry(routed: HubWorld) -> None:
    """An unexpected failure of the destination reaches the publisher as ``400 retry:``."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\n")
    with capturedLogs() as events:
        routed.sink.outcomes[0].errback(RuntimeError("boom"))
    routed.clock.advance(0)
    assert alice.received().startswith(b"400 retry: internal error")
    assert any(event.get("log_level") is LogLevel.critical for event in events)


def test_close_answers_pending_mcast_first(routed: HubWorld) -> None:
    """CLOSE after a pending routed MCAST: its answer first, then 200, then the close."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\nCLOSE\nMCAST orders.y never\n")
    routed.clock.advance(0)
    assert alice.received() == b""
    assert not alice.transport.disconnecting
    assert len(routed.sink.messages) == 1

    routed.sink.outcomes[0].callback(Outcome.accepted())
    assert alice.received() == b"200\n200\n"
    assert alice.transport.disconnecting


def test_bad_input_after_pending_mcast_answers_it_first(routed: HubWorld) -> None:
    """A malformed line after a pending routed MCAST: its answer, then 400, then the close."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\nMCAST\n")
    assert alice.received() == b""
    assert not alice.transport.disconnecting
    routed.sink.outcomes[0].callback(Outcome.retry("later"))
    assert alice.received() == b"400 retry: later\n" + MCAST_WITHOUT_PAYLOAD
    assert alice.transport.disconnecting


def test_max_pending_replies_pauses_reading() -> None:
    """With ``max_pending_replies`` outcomes pending the hub stops reading, then resumes."""
    world = HubWorld(settings=attrs.evolve(SETTINGS, max_pending_replies=2), routes=[ORDERS])
    alice = world.login("alice")
    alice.send(b"MCAST orders.a 1\n")
    assert alice.transport.producerState == "producing"
    alice.send(b"MCAST orders.b 2\n")
    assert alice.transport.producerState == "paused"

    world.sink.outcomes[0].callback(Outcome.accepted())
    assert alice.transport.producerState == "producing"
    world.sink.outcomes[1].callback(Outcome.accepted())
    world.clock.advance(0)
    assert alice.received() == b"200\n200\n"


def test_reading_resumes_when_caught_up_and_below_pending_limit() -> None:
    """Reading resumes only once the peer caught up and its pending outcomes are below the limit."""
    world = HubWorld(settings=attrs.evolve(SETTINGS, max_pending_replies=1), routes=[ORDERS])
    alice = world.login("alice")
    alice.send(b"MCAST orders.a 1\n")
    assert alice.transport.producerState == "paused"
    alice.protocol.pauseProducing()
    alice.protocol.resumeProducing()  # caught up, but an outcome is still pending
    assert alice.transport.producerState == "paused"

    alice.protocol.pauseProducing()
    world.sink.outcomes[0].callback(Outcome.accepted())  # answered, but the peer is behind
    assert alice.transport.producerState == "paused"
    alice.protocol.resumeProducing()
    assert alice.transport.producerState == "producing"
    world.clock.advance(0)
    assert alice.received() == b"200\n"


def test_route_timeout_answers_retry(routed: HubWorld) -> None:
    """No outcome within the route's ``timeout_seconds``: the publisher gets ``400 retry:``."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\n")
    routed.clock.advance(9.9)
    assert alice.received() == b""
    routed.clock.advance(0.1)
    routed.clock.advance(0)
    assert alice.received() == (
        b"400 retry: route orders: no outcome from sink within 10 seconds\n"
    )


def test_outcome_after_connection_lost_is_dropped(routed: HubWorld) -> None:
    """An outcome that arrives after the publisher left writes nothing and breaks nothing."""
    alice = routed.login("alice")
    alice.send(b"MCAST orders.x payload\n")
    alice.lose()
    routed.sink.outcomes[0].callback(Outcome.accepted())
    routed.clock.advance(0)
    assert alice.received() == b""


# --- half-sent lines (issue 18) -----------------------------------------------------------


def test_a_half_sent_line_after_login_is_aborted() -> None:
    """Part of a request and nothing more: aborted at the frame time-out (30 s), counted."""
    world = HubWorld(settings=attrs.evolve(SETTINGS, ping_interval_seconds=300.0))
    alice = world.login("alice")
    alice.send(b"MCAST news half a li")
    world.clock.advance(29.9)
    assert not alice.transport.disconnecting
    world.clock.advance(0.1)
    assert alice.transport.disconnected
    assert world.sample("msggateway_protocol_errors_total", kind="frame-timeout") == 1


def test_a_slow_but_whole_line_is_served() -> None:
    """A line finished within the frame time-out is answered, and the next one has its own."""
    world = HubWorld(settings=attrs.evolve(SETTINGS, ping_interval_seconds=300.0))
    alice = world.login("alice")
    for _ in range(5):
        alice.send(b"MCAST news ")
        world.clock.advance(20)
        alice.send(b"hello\nMCAST")
        world.clock.advance(20)
        alice.send(b" news again\n")
    assert alice.received() == b"200\n" * 10
    assert not alice.transport.disconnecting


# --- flow control ----------------------------------------------------------------------------


_CUT_AT_1000 = FlowPolicy(policy=DISCONNECT, max_backlog_bytes=1000)
"""NATS's policy: publishers never slowed, a subscriber 1,000 bytes behind cut."""


def _slow_world(flow: FlowPolicy = _CUT_AT_1000) -> tuple[HubWorld, Peer, Peer]:
    """A hub with a subscriber ``slow`` of ``news`` and a publisher."""
    world = HubWorld(flow=flow)
    slow = world.subscriber("slow", "news")
    publisher = world.login("pub")
    return world, slow, publisher


def _congesting_world(
    flow: FlowPolicy = DEFAULT_FLOW, high_water: int = 1000
) -> tuple[HubWorld, Peer, BufferingTransport]:
    """A hub whose subscriber ``sub`` of ``news`` reads only when the test drains it."""
    world = HubWorld(flow=flow)
    transport = BufferingTransport(high_water=high_water)
    sub = world.login("sub", transport=transport)
    sub.send(b"SUBSCRIBE news\n")
    transport.drain()
    return world, sub, transport


_LINE = b"MCAST news " + b"x" * 200 + b"\n"
_EVENT_BYTES = len(b"000 pub MCAST news \n") + 200


def test_a_congested_subscriber_holds_its_publishers_until_it_drains() -> None:
    """Back-pressure before loss: the publishers whose reads fill a subscriber stop being read.

    What they sent is answered 200 and delivered; once the subscriber read
    its buffer, they are read again. Nobody is cut, nothing is lost.
    """
    world, _, transport = _congesting_world()
    first, second = world.login("pub"), world.login("pub2")
    first.send(_LINE * 5)  # 5 events of 220 bytes: past the 1,000-byte buffer
    assert first.received() == b"200\n" * 5
    assert first.transport.producerState == "paused"  # held: not read from
    second.send(_LINE)
    assert second.received() == b"200\n"
    assert second.transport.producerState == "paused"
    delivered = transport.drain()
    assert delivered.count(b"\n") == 6
    assert first.transport.producerState == "producing"
    assert second.transport.producerState == "producing"
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 0


def test_a_publisher_held_by_two_subscribers_reads_once_both_drained() -> None:
    """A publisher is read again only when every subscriber holding it has drained."""
    world = HubWorld()
    transports = [BufferingTransport(high_water=500) for _ in range(2)]
    for index, transport in enumerate(transports):
        peer = world.login(f"sub{index}", transport=transport)
        peer.send(b"SUBSCRIBE news\n")
        transport.drain()
    publisher = world.login("pub")
    publisher.send(_LINE * 3)
    assert publisher.transport.producerState == "paused"
    transports[0].drain()
    assert publisher.transport.producerState == "paused"
    transports[1].drain()
    assert publisher.transport.producerState == "producing"


def test_a_publisher_is_not_held_by_its_own_replies_nor_a_subscriber_that_kept_up() -> None:
    """Only a recipient congested by the read holds its publisher."""
    world, _, transport = _congesting_world(high_water=100_000)
    publisher = world.login("pub")
    publisher.send(_LINE * 5)
    assert publisher.transport.producerState == "producing"
    assert transport.drain().count(b"\n") == 5


def test_a_stuck_subscriber_is_cut_after_slow_consumer_seconds_and_releases_its_publishers() -> (
    None
):
    """No drain for ``slow_consumer_seconds``: aborted, counted, logged; publishers read again."""
    world, _sub, transport = _congesting_world(FlowPolicy(slow_consumer_seconds=10))
    publisher = world.login("pub")
    publisher.send(_LINE * 5)
    assert publisher.transport.producerState == "paused"
    world.clock.advance(9.5)
    assert not transport.disconnected
    with capturedLogs() as events:
        world.clock.advance(0.5)
    assert transport.disconnected  # aborted: it keeps nothing it did not read
    assert publisher.transport.producerState == "producing"
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 1
    [warning] = [event for event in events if "slow consumer" in event["log_format"]]
    assert warning["identity"] == "sub"
    assert "has not emptied for 10 s" in warning["why"]
    assert "1 producer(s) held" in warning["why"]


def test_a_subscriber_that_drains_now_and_then_is_never_cut() -> None:
    """Each drain restarts the clock: congested often, but never 10 s in a row, is healthy."""
    world, _sub, transport = _congesting_world(FlowPolicy(slow_consumer_seconds=10))
    publisher = world.login("pub")
    for _ in range(12):  # 48 s: congested 4 s of every 4, under the PONG time-out
        publisher.send(_LINE * 5)
        publisher.received()
        world.clock.advance(4)
        transport.drain()
    assert not transport.disconnected
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 0


def test_a_held_publisher_that_leaves_is_forgotten() -> None:
    """A publisher that closes while held leaves nothing behind to release."""
    world, sub, transport = _congesting_world()
    publisher = world.login("pub")
    publisher.send(_LINE * 5)
    assert sub.protocol.congestion.held_count == 1
    publisher.lose()
    assert sub.protocol.congestion.held_count == 0
    transport.drain()


def test_the_hard_cap_cuts_a_subscriber_many_publishers_fill() -> None:
    """Past ``max_backlog_bytes`` written while congested, even under pause-producers: cut."""
    world, _sub, transport = _congesting_world(FlowPolicy(max_backlog_bytes=2000), high_water=500)
    publishers = [world.login(f"pub{index}") for index in range(15)]
    for publisher in publishers:
        publisher.send(_LINE)
    assert transport.disconnected
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 1
    assert all(p.transport.producerState == "producing" for p in publishers)


def test_slow_consumer_is_disconnected_under_the_disconnect_policy() -> None:
    """``disconnect``: a paused peer past ``max_backlog_bytes`` is aborted; publishers go on."""
    world, slow, publisher = _slow_world()
    slow.protocol.pauseProducing()  # the transport's buffer is full
    assert slow.transport.producerState == "paused"  # we stop reading the slow peer

    payload = b"x" * 200
    event_size = len(b"000 pub MCAST news \n") + len(payload)
    with capturedLogs() as events:
        for _ in range(1000 // event_size):
            publisher.send(b"MCAST news " + payload + b"\n")
            assert publisher.received() == b"200\n"
        assert not slow.transport.disconnected
        publisher.send(b"MCAST news " + payload + b"\n")
        assert publisher.received() == b"200\n"
    assert slow.transport.disconnected  # abortConnection
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 1
    [warning] = [event for event in events if "slow consumer" in event["log_format"]]
    assert warning["identity"] == "slow"
    assert "max_backlog_bytes 1000" in warning["why"]

    publisher.send(b"MCAST news more\n")  # the publisher is never slowed down
    assert publisher.received() == b"200\n"
    assert publisher.transport.producerState == "producing"
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 1


def test_slow_consumer_gets_unsubscribe_events() -> None:
    """A slow consumer's topics get UNSUBSCRIBE events once its connection ends."""
    world = HubWorld(flow=FlowPolicy(policy=DISCONNECT, max_backlog_bytes=100))
    watcher = world.subscriber("watcher", "news", presence=True)
    slow = world.subscriber("slow", "news")
    publisher = world.login("pub")
    watcher.received()
    slow.protocol.pauseProducing()
    publisher.send(b"MCAST news " + b"x" * 200 + b"\n")
    assert slow.transport.disconnected
    slow.lose()
    world.clock.advance(0)
    assert watcher.received() == b"000 pub MCAST news " + b"x" * 200 + b"\n" + (
        b"000 slow UNSUBSCRIBE news\n"
    )


def test_resume_producing_resets_the_backlog() -> None:
    """A peer that catches up starts from an empty backlog, and is read from again."""
    world, slow, publisher = _slow_world()
    line = b"MCAST news " + b"x" * 380 + b"\n"  # events of 400 bytes
    for _ in range(3):
        slow.protocol.pauseProducing()
        publisher.send(line + line)
        assert publisher.received() == b"200\n200\n"
        slow.protocol.resumeProducing()
        assert slow.transport.producerState == "producing"
    assert not slow.transport.disconnected
    assert len(slow.received()) == 6 * 400
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 0


def test_a_subscriber_that_never_reads_is_aborted_past_its_backlog() -> None:
    """Twisted pauses us on every write while its buffer is full; the backlog adds up.

    Under ``disconnect``, one subscriber that never reads and one publisher
    sending MCASTs of 200 bytes: the subscriber is aborted once more than
    ``max_backlog_bytes`` were written after its transport first asked us
    to pause, and counted.
    """
    world = HubWorld(flow=FlowPolicy(policy=DISCONNECT, max_backlog_bytes=65536))
    transport = BufferingTransport(high_water=16384)
    slow = world.login("slow", transport=transport)
    slow.send(b"SUBSCRIBE news\n")
    publisher = world.login("pub")
    sent = 0
    while not transport.disconnected and sent < 2000:
        publisher.send(_LINE * 10)
        assert publisher.received() == b"200\n" * 10  # the publisher is never slowed down
        sent += 10
    assert transport.disconnected  # aborted
    assert transport.producerState == "paused"  # and not read from since the first pause
    assert sent * _EVENT_BYTES <= 16384 + 65536 + 10 * _EVENT_BYTES + 4096
    assert world.sample("msggateway_slow_consumer_disconnects_total") == 1
    publisher.send(_LINE)
    assert publisher.received() == b"200\n"


def test_unpaused_peer_has_no_backlog_limit() -> None:
    """Only a peer whose transport asked us to pause is subject to the backlog limit."""
    _, slow, publisher = _slow_world()
    for _ in range(10):
        publisher.send(b"MCAST news " + b"x" * 200 + b"\n")
    assert not slow.transport.disconnected
    assert slow.received().count(b"\n") == 10


def test_a_route_delivery_into_a_congested_subscriber_is_answered_once_it_drained() -> None:
    """The hub's outcome (a QMQP sender's K) waits until the batch was written under the limit."""
    world, _, transport = _congesting_world()
    batch = [Message(body=b"y" * 300, address="news", sender="remote") for _ in range(5)]
    outcomes = world.hub.deliver(batch)
    assert not outcomes.called
    assert transport.drain().count(b"\n") == 5
    assert fired(outcomes) == [Outcome.accepted()] * 5


def test_a_route_delivery_waiting_on_a_subscriber_cut_as_stuck_is_answered() -> None:
    """A subscriber cut as stuck frees what waited on it: the hub took it (best effort)."""
    world, _, transport = _congesting_world()
    outcomes = world.hub.deliver([Message(body=b"y" * 900, address="news", sender="r")] * 2)
    assert not outcomes.called
    world.clock.advance(DEFAULT_FLOW.slow_consumer_seconds)
    assert transport.disconnected
    assert fired(outcomes) == [Outcome.accepted()] * 2


def test_a_route_delivery_waiting_at_the_route_deadline_is_answered_as_written() -> None:
    """The router cancels at the route's deadline: what was written stands."""
    world, _, _ = _congesting_world()
    outcomes = world.hub.deliver([Message(body=b"y" * 900, address="news", sender="r")] * 2)
    outcomes.cancel()
    assert fired(outcomes) == [Outcome.accepted()] * 2


def test_a_route_delivery_under_the_disconnect_policy_is_answered_at_once() -> None:
    """``disconnect``: nothing waits for a congested subscriber."""
    world, _, _ = _congesting_world(FlowPolicy(policy=DISCONNECT))
    outcomes = world.hub.deliver([Message(body=b"y" * 900, address="news", sender="r")] * 2)
    assert fired(outcomes) == [Outcome.accepted()] * 2


# --- Hub.deliver: the listener as a route destination -------------------------------------------


def test_hub_deliver_to_subscribers(world: HubWorld) -> None:
    """A routed message reaches the topic's subscribers as an MCAST event, written at once."""
    bob = world.subscriber("bob", "news")
    carol = world.subscriber("carol", "news")
    outcomes = world.hub.deliver([Message(body=b"from afar", address="news", sender="remote")])
    assert fired(outcomes) == [Outcome.accepted()]
    assert bob.received() == b"000 remote MCAST news from afar\n"
    assert carol.received() == b"000 remote MCAST news from afar\n"


@pytest.mark.parametrize("sender", [None, "not an id", "caf\u00e9", ""])
def test_hub_deliver_anonymous_sender(world: HubWorld, sender: str | None) -> None:
    """A sender that is not a valid SSMP id is shown as the anonymous ``.``."""
    bob = world.subscriber("bob", "news")
    [outcome] = fired(world.hub.deliver([Message(body=b"hi", address="news", sender=sender)]))
    assert outcome.is_accepted
    world.clock.advance(0)
    assert bob.received() == b"000 . MCAST news hi\n"


def test_hub_deliver_without_subscribers_is_accepted(world: HubWorld) -> None:
    """MCAST never answers 404: a delivery to a topic nobody reads is accepted."""
    [outcome] = fired(world.hub.deliver([Message(body=b"hi", address="quiet", sender="x")]))
    assert outcome.is_accepted
    assert world.clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    "message",
    [
        Message(body=b"two\nlines", address="news"),
        Message(body=b"", address="news"),
        Message(body=b"x" * LIMIT, address="news"),
        Message(body=b"hi", address="bad topic"),
        Message(body=b"hi", address="caf\u00e9"),
    ],
)
def test_hub_deliver_rejects_what_ssmp_cannot_carry(world: HubWorld, message: Message) -> None:
    """Bodies with LF, empty or too long, and invalid topics are rejected; nobody gets them."""
    bob = world.subscriber("bob", "news")
    [outcome] = fired(world.hub.deliver([message]))
    assert outcome.status is Status.REJECTED
    assert outcome.reason
    world.clock.advance(0)
    assert bob.received() == b""


def test_hub_as_route_destination() -> None:
    """A route from another endpoint into the hub delivers MCAST events to its subscribers."""
    inbound = Route(
        name="inbound",
        source="feed",
        pattern=AddressPattern("weather.*"),
        destination=LISTENER,
        timeout_seconds=5.0,
    )
    world = HubWorld(routes=[inbound])
    bob = world.subscriber("bob", "weather.paris")
    results = world.router.dispatch(
        "feed", [Message(body=b"sunny", address="weather.paris", sender="station-7")]
    )
    assert fired(results) == [Outcome.accepted()]
    world.clock.advance(0)
    assert bob.received() == b"000 station-7 MCAST weather.paris sunny\n"


def test_connection_lost_with_done_reason(world: HubWorld) -> None:
    """A clean close (ConnectionDone) cleans up like any other."""
    alice = world.subscriber("alice", "news")
    alice.protocol.connectionLost(Failure(ConnectionDone()))
    assert world.hub.peers == {}
    assert world.hub.topics == {}
