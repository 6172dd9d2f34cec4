"""The upstream role's shared lifecycle: `gateway.protocols.upstream`.

A small line-based upstream built on `Upstream` and `UpstreamConnection`
(its handshake is one ``HELLO`` line answered ``OK``) connects through an
endpoint that hands each connection a `StringTransport` (or refuses, while
told to); time is a `Clock`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from OpenSSL import SSL
from service_identity import VerificationError
from service_identity.hazmat import DNS_ID, DNSMismatch
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import clientFromString
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import (
    IHandshakeListener,
    IProtocol,
    IProtocolFactory,
    IStreamClientEndpoint,
)
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.metrics import GatewayMetrics
from gateway.protocols.upstream import (
    RECONNECT_INITIAL_DELAY_SECONDS,
    MovableEndpoint,
    Upstream,
    UpstreamConnection,
    describe_endpoint,
)

NAME = "far"


class HelloConnection(UpstreamConnection["HelloUpstream"]):
    """Says HELLO; ready on OK; anything else closes the connection."""

    def __init__(self, upstream: HelloUpstream) -> None:
        super().__init__(upstream)
        self.stopped = 0
        self.tls_up = 0
        upstream.built.append(self)

    def tls_established(self) -> None:
        """Count the handshakes TLS reports."""
        self.tls_up += 1

    def connection_started(self) -> None:
        """Greet the server."""
        self.write(b"HELLO\n")

    def dataReceived(self, data: bytes) -> None:
        """OK makes the connection ready; anything else is refused."""
        if data == b"OK\n":
            self.upstream.connection_ready(self, "greeted")
        else:
            self.upstream.count_error("bad-greeting")
            self.close(f"unexpected {data!r}")

    def connection_stopped(self) -> None:
        """Count the protocol's own clean-up."""
        self.stopped += 1


class HelloUpstream(Upstream[HelloConnection]):
    """The upstream of `HelloConnection`; two messages are always in flight."""

    kind = "hello"

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        clock: Clock,
        metrics: GatewayMetrics,
        retry_policy: Callable[[int], float] | None = None,
    ):
        self.built: list[HelloConnection] = []
        super().__init__(
            name=NAME,
            endpoint=endpoint,
            connection=HelloConnection,
            clock=clock,
            metrics=metrics,
            retry_policy=retry_policy,
        )

    def connection_ended(self, connection: HelloConnection) -> str:
        """Say what a real upstream would send again."""
        return "2 message(s) to resend"


@implementer(IStreamClientEndpoint)
class StringEndpoint:
    """Connects at once, each connection over a new `StringTransport`."""

    def __init__(self) -> None:
        self.transports: list[StringTransport] = []
        self.protocols: list[IProtocol] = []
        """What the factory built: the service's wrapper of each connection."""
        self.attempts = 0
        self.refusing = False
        """While True, attempts fail (the server is down)."""

    def __repr__(self) -> str:
        """What the upstream's log lines call it."""
        return "a string endpoint"

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        """Build the protocol and connect it, or fail while refusing."""
        self.attempts += 1
        if self.refusing:
            return fail(ConnectionRefusedError("nobody listens"))
        protocol = factory.buildProtocol(None)
        assert protocol is not None
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.transports.append(transport)
        self.protocols.append(protocol)
        return succeed(protocol)


def _world(
    retry_policy: Callable[[int], float] | None = None,
) -> tuple[HelloUpstream, StringEndpoint, Clock, GatewayMetrics]:
    clock = Clock()
    metrics = GatewayMetrics()
    endpoint = StringEndpoint()
    upstream = HelloUpstream(endpoint, clock, metrics, retry_policy)
    return upstream, endpoint, clock, metrics


def _seconds(failures: int) -> float:
    """A back-off without jitter: as many seconds as failures in a row."""
    return float(failures)


def _text(event: dict[str, object]) -> str:
    return str(event["log_format"]).format(**event)


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_connects_hands_over_and_counts() -> None:
    """The service connects; the connection produces for its transport and greets."""
    upstream, endpoint, _clock, metrics = _world()
    upstream.service.startService()
    [connection], [transport] = upstream.built, endpoint.transports
    assert transport.value() == b"HELLO\n"
    assert transport.producer is not None and transport.streaming
    assert upstream.traffic.bytes_out == len(b"HELLO\n")
    assert not upstream.connected
    assert _sample(metrics, "msggateway_upstream_connected", upstream=NAME) == 0
    with capturedLogs() as events:
        connection.dataReceived(b"OK\n")
    assert upstream.connected
    assert [_text(e) for e in events] == ["upstream far: greeted"]
    assert _sample(metrics, "msggateway_upstream_connected", upstream=NAME) == 1
    labels = {"endpoint": NAME, "protocol": "hello"}
    assert _sample(metrics, "msggateway_connections", **labels) == 1
    assert _sample(metrics, "msggateway_connections_opened_total", **labels) == 1
    upstream.service.stopService()


def test_a_lost_connection_says_why_and_what_is_resent_then_reconnects() -> None:
    """Losing the ready connection: the gauge drops, the log says why, the service retries."""
    upstream, endpoint, clock, metrics = _world()
    upstream.service.startService()
    [connection] = upstream.built
    connection.dataReceived(b"OK\n")
    with capturedLogs() as events:
        endpoint.protocols[0].connectionLost(Failure(ConnectionLost("reset by peer")))
    assert connection.closing and connection.stopped == 1
    assert not upstream.connected
    [line] = [text for text in map(_text, events) if text.startswith("upstream far")]
    assert line.startswith("upstream far: connection lost: ")
    assert line.endswith("; 2 message(s) to resend")
    assert _sample(metrics, "msggateway_upstream_connected", upstream=NAME) == 0
    labels = {"endpoint": NAME, "protocol": "hello"}
    assert _sample(metrics, "msggateway_connections", **labels) == 0
    # The back-off's first wait, plus up to a second of jitter (backoffPolicy).
    clock.advance(RECONNECT_INITIAL_DELAY_SECONDS - 0.01)
    assert len(endpoint.transports) == 1
    clock.advance(1.01)
    assert len(endpoint.transports) == 2
    stopped: Deferred[None] = upstream.service.stopService()
    assert stopped is not None


def test_a_connection_that_never_became_ready_is_only_forgotten() -> None:
    """A refused handshake: counted, closed once with its reason, no "lost" line."""
    upstream, endpoint, _clock, metrics = _world()
    upstream.service.startService()
    [connection], [transport] = upstream.built, endpoint.transports
    with capturedLogs() as events:
        connection.dataReceived(b"NO\n")
        connection.close("twice")  # a second close does nothing
        endpoint.protocols[0].connectionLost(Failure(ConnectionDone()))
    texts = [text for text in map(_text, events) if text.startswith("upstream far")]
    assert texts == ["upstream far: closing: unexpected b'NO\\n'"]
    assert transport.disconnecting
    assert transport.producer is None  # unregistered, so that TLS can shut down
    assert _sample(metrics, "msggateway_protocol_errors_total", endpoint=NAME, kind="bad-greeting")
    assert not upstream.connected
    upstream.service.stopService()


def test_the_back_off_counts_failures_since_the_last_ready_connection() -> None:
    """Refused handshakes wait longer each time, as failed attempts do; being ready resets it."""
    upstream, endpoint, clock, _metrics = _world(_seconds)
    upstream.service.startService()
    for wait in (1.0, 2.0):
        upstream.built[-1].dataReceived(b"NO\n")
        endpoint.protocols[-1].connectionLost(Failure(ConnectionDone()))
        before = endpoint.attempts
        clock.advance(wait - 0.01)
        assert endpoint.attempts == before
        clock.advance(0.01)
        assert endpoint.attempts == before + 1
    endpoint.refusing = True
    upstream.built[-1].dataReceived(b"NO\n")
    endpoint.protocols[-1].connectionLost(Failure(ConnectionDone()))
    clock.advance(3.0)
    assert endpoint.attempts == 4  # refused: the next wait is 4 s
    endpoint.refusing = False
    clock.advance(4.0)
    upstream.built[-1].dataReceived(b"OK\n")
    assert upstream.connected
    endpoint.protocols[-1].connectionLost(Failure(ConnectionLost("reset")))
    clock.advance(1.0)
    assert endpoint.attempts == 6  # ready in between: 1 s again
    upstream.service.stopService()


def test_move_to_connects_there_next_and_a_failure_there_goes_home() -> None:
    """Moving closes the connection; the service connects to the new target after its first wait.

    An attempt there that fails is logged, and the one after goes to the
    configured endpoint again.
    """
    upstream, home, clock, _metrics = _world(_seconds)
    upstream.service.startService()
    [first] = upstream.built
    first.dataReceived(b"OK\n")
    elsewhere = StringEndpoint()
    elsewhere.refusing = True
    with capturedLogs() as events:
        upstream.move_to(elsewhere, first, "the leader is elsewhere")
    assert home.transports[0].disconnecting
    assert [_text(e) for e in events] == ["upstream far: closing: the leader is elsewhere"]
    assert upstream.endpoint.moved and upstream.endpoint.target is elsewhere
    home.protocols[0].connectionLost(Failure(ConnectionDone()))
    with capturedLogs() as events:
        clock.advance(1.0)
    assert (home.attempts, elsewhere.attempts) == (1, 1)
    assert (
        "upstream far: cannot connect: Connection was refused by other side: nobody listens."
        " (a string endpoint)" in [_text(e) for e in events]
    )
    assert not upstream.endpoint.moved
    clock.advance(2.0)
    assert (home.attempts, elsewhere.attempts) == (2, 1)
    upstream.service.stopService()


def test_a_movable_endpoint_names_its_upstream_and_target() -> None:
    """ClientService's own log lines name the endpoint: the upstream and where it connects."""
    home = StringEndpoint()
    endpoint = MovableEndpoint(home, lambda _failure: None, "far")
    assert repr(endpoint) == "upstream far at a string endpoint"
    endpoint.target = clientFromString(MemoryReactor(), "tcp:host=elsewhere:port=9")
    assert repr(endpoint) == "upstream far at elsewhere:9"


@pytest.mark.parametrize(
    ("description", "address"),
    [
        ("tcp:host=relay.example:port=628", "relay.example:628"),
        ("tcp:host=2001\\:db8\\:\\:1:port=628", "[2001:db8::1]:628"),
        ("tls:host=relay.example:port=628", "relay.example:628 (TLS)"),
        ("ssl:host=relay.example:port=628", "relay.example:628 (TLS)"),
    ],
)
def test_client_endpoints_are_described_by_address(description: str, address: str) -> None:
    """Twisted's tcp:, tls: and ssl: client endpoints read as host:port, TLS marked."""
    assert describe_endpoint(clientFromString(MemoryReactor(), description)) == address


def test_the_service_scheduling_a_retry_names_the_upstream_and_address() -> None:
    """ClientService's "Scheduling retry" line reads "upstream far at relay.example:628"."""
    clock = Clock()
    reactor = MemoryReactor()
    endpoint = clientFromString(reactor, "tcp:host=relay.example:port=628")
    upstream = HelloUpstream(endpoint, clock, GatewayMetrics(), _seconds)
    upstream.service.startService()
    with capturedLogs() as events:
        reactor.tcpClients[0][2].clientConnectionFailed(None, Failure(ConnectionRefusedError()))
    texts = [_text(e) for e in events]
    assert "Scheduling retry 1 to connect upstream far at relay.example:628 in 1.0 seconds." in (
        texts
    )
    upstream.service.stopService()


def test_the_scheduled_wait_is_rounded_to_a_tenth() -> None:
    """With the jittered default back-off, the line says "in 1.3 seconds", not 1.2866920617."""
    clock = Clock()
    reactor = MemoryReactor()
    endpoint = clientFromString(reactor, "tcp:host=relay.example:port=628")
    upstream = HelloUpstream(endpoint, clock, GatewayMetrics())
    upstream.service.startService()
    for attempt in range(1, 6):
        factory = reactor.tcpClients[-1][2]
        with capturedLogs() as events:
            factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        [line] = [_text(e) for e in events if "Scheduling retry" in _text(e)]
        found = re.search(r" in (\S+) seconds\.$", line)
        assert found is not None, line
        assert re.fullmatch(r"\d+\.\d", found.group(1)), line
        assert f"Scheduling retry {attempt} to connect upstream far at relay.example:628" in line
        clock.advance(float(found.group(1)))
    upstream.service.stopService()


# --- TLS ----------------------------------------------------------------------------------------


def _tls_error(*reasons: str) -> Failure:
    return Failure(SSL.Error([("SSL routines", "", reason) for reason in reasons]))


def _tls_failures(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": NAME, "kind": "tls-failed"}
    )
    return 0.0 if value is None else value


def test_a_failed_handshake_is_logged_with_the_reason_and_counted() -> None:
    """OpenSSL's reason, the upstream and its address in one warning; tls-failed counted."""
    upstream, endpoint, _clock, metrics = _world(_seconds)
    upstream.service.startService()
    with capturedLogs() as events:
        endpoint.protocols[0].connectionLost(_tls_error("certificate verify failed"))
    warnings = [_text(e) for e in events if "TLS with" in _text(e)]
    assert warnings == [
        "upstream far: TLS with a string endpoint failed: certificate verify failed. If we"
        " refused the server, its certificate must be issued by a CA in this upstream's"
        " trustRoots and name the host we connect to; if the server refused us, it must trust"
        " the CA of our certificate (certificate=, privateKey=)"
    ]
    assert _tls_failures(metrics) == 1
    upstream.service.stopService()


def test_a_host_name_mismatch_is_logged_too() -> None:
    """service_identity's refusal (a certificate for another host) is a TLS failure as well."""
    upstream, endpoint, _clock, metrics = _world(_seconds)
    upstream.service.startService()
    mismatch = VerificationError(errors=[DNSMismatch(mismatched_id=DNS_ID("relay.example"))])
    with capturedLogs() as events:
        endpoint.protocols[0].connectionLost(Failure(mismatch))
    assert any(
        "does not name the host we connect to" in _text(e) and "relay.example" in _text(e)
        for e in events
    )
    assert _tls_failures(metrics) == 1
    upstream.service.stopService()


def test_failed_handshakes_back_off_further_each_time() -> None:
    """Each failed handshake waits longer: the back-off does not start over."""
    waits: list[int] = []

    def policy(failures: int) -> float:
        waits.append(failures)
        return float(failures)

    upstream, endpoint, clock, _metrics = _world(policy)
    upstream.service.startService()
    for attempt in range(4):
        endpoint.protocols[attempt].connectionLost(_tls_error("certificate verify failed"))
        clock.advance(attempt + 1)
    assert waits == [1, 2, 3, 4]
    assert endpoint.attempts == 5
    upstream.service.stopService()


def test_a_ready_connection_ended_by_tls_does_not_reset_the_back_off() -> None:
    """A server refusing our certificate after the handshake (TLS 1.3): the back-off goes on."""
    waits: list[int] = []

    def policy(failures: int) -> float:
        waits.append(failures)
        return float(failures)

    upstream, endpoint, clock, metrics = _world(policy)
    upstream.service.startService()
    endpoint.protocols[0].connectionLost(_tls_error("certificate verify failed"))
    clock.advance(1)
    upstream.built[1].dataReceived(b"OK\n")  # ready
    endpoint.protocols[1].connectionLost(_tls_error("tlsv13 alert certificate required"))
    clock.advance(2)
    assert waits == [1, 2]
    assert _tls_failures(metrics) == 2
    upstream.built[2].dataReceived(b"OK\n")
    endpoint.protocols[2].connectionLost(Failure(ConnectionDone()))
    assert waits == [1, 2, 1]  # an ordinary end after a ready connection starts over
    upstream.service.stopService()


def test_connections_hear_that_tls_is_established() -> None:
    """Built through the service, a connection is told of the handshake through its proxy."""
    upstream, endpoint, _clock, _metrics = _world(_seconds)
    upstream.service.startService()
    proxy = endpoint.protocols[0]
    assert IHandshakeListener.providedBy(proxy)
    proxy.handshakeCompleted()  # type: ignore[attr-defined]
    assert upstream.built[0].tls_up == 1
    upstream.service.stopService()


def test_stopping_closes_the_connection_and_waits_for_its_end() -> None:
    """The service's stop is the upstream's: one close that says why, then the stop fires.

    The producer is unregistered first (a TLS connection shuts down only
    without one) and nothing connects again.
    """
    upstream, endpoint, clock, _metrics = _world(_seconds)
    upstream.service.startService()
    [connection], [transport] = upstream.built, endpoint.transports
    connection.dataReceived(b"OK\n")
    with capturedLogs() as events:
        stopped: list[object] = []
        upstream.service.stopService().addCallback(stopped.append)
    assert [_text(e) for e in events] == ["upstream far: closing: the gateway is stopping"]
    assert transport.disconnecting and transport.producer is None
    assert stopped == [] and not upstream.running
    endpoint.protocols[0].connectionLost(Failure(ConnectionDone()))
    assert stopped == [None]
    clock.advance(60)
    assert endpoint.attempts == 1


def test_stopping_while_waiting_to_connect_again_is_at_once() -> None:
    """With no connection (between attempts), stop fires at once and cancels the next attempt."""
    upstream, endpoint, clock, _metrics = _world(_seconds)
    endpoint.refusing = True
    with capturedLogs() as events:
        upstream.start()
    assert (
        "upstream far: cannot connect: Connection was refused by other side: nobody listens."
        " (a string endpoint)" in [_text(e) for e in events]
    )
    stopped: list[object] = []
    with capturedLogs() as events:
        upstream.stop().addCallback(stopped.append)
    assert stopped == [None]
    assert not [e for e in events if "upstream far" in _text(e)]
    clock.advance(60)
    assert endpoint.attempts == 1
