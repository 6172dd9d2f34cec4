"""In-memory tests of the SSMP upstream: `gateway.protocols.ssmp.client`.

Most tests drive one `SSMPClientProtocol` of an `SSMPUpstream` over a
`StringTransport`, playing the server by hand; time is a
`MemoryReactorClock`, and the upstream's `ClientService` is not started (its
endpoint would connect only in memory anyway). Routes go through a real
`Router` to a small destination that records messages and whose outcomes
the test holds. The last tests start the `ClientService` on the memory
reactor and pair our client with our own hub through `twisted.test.iosim`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import attrs
import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.test.iosim import ConnectionCompleter
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, RouteTable, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.ssmp.client import SSMPClientProtocol, SSMPUpstream
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.server import SSMPServerFactory, SSMPServerProtocol
from gateway.protocols.ssmp.settings import SSMPListenerSettings, SSMPUpstreamSettings
from tests.protocols.test_ssmp_server import HeldDestination

T = TypeVar("T")

UPSTREAM = "central"
SINK = "sink"
FEED = "feed"
HOST = "central.example"
PORT = 8787
SECRET = b"s3cret"
SETTINGS = SSMPUpstreamSettings(
    identity="gw",
    scheme="secret",
    subscribe=("news", "alerts.fire"),
    ping_interval_seconds=30.0,
    pong_timeout_seconds=30.0,
)
ALERTS_IN = Route(
    name="alerts-in",
    source=UPSTREAM,
    pattern=AddressPattern("alerts.#"),
    destination=SINK,
    timeout_seconds=10.0,
)
"""MCAST events from the upstream on ``alerts.#`` go to the test's destination."""
WEATHER_OUT = Route(
    name="weather-out",
    source=FEED,
    pattern=AddressPattern("weather.#"),
    destination=UPSTREAM,
    timeout_seconds=5.0,
)
"""Messages from another endpoint on ``weather.#`` go to the upstream as MCASTs."""


# --- test doubles and helpers ------------------------------------------------------------


@implementer(IDestination)
class AcceptingDestination:
    """A route destination that records batches and accepts every message at once."""

    def __init__(self, name: str = SINK) -> None:
        self.name = name
        self.batches: list[list[Message]] = []
        self.messages: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Record the batch and accept it."""
        self.batches.append(list(messages))
        self.messages.extend(messages)
        return succeed([Outcome.accepted()] * len(messages))


class Connection:
    """One client connection, with the test playing the server."""

    def __init__(self, protocol: SSMPClientProtocol, transport: StringTransport) -> None:
        self.protocol = protocol
        self.transport = transport

    def server_says(self, data: bytes) -> None:
        """Deliver bytes from the server, as the reactor would."""
        self.protocol.dataReceived(data)

    def sent(self) -> bytes:
        """Return what the client wrote since the last call."""
        data: bytes = self.transport.value()
        self.transport.clear()
        return data

    def lose(self) -> None:
        """Simulate the connection going away."""
        self.protocol.connectionLost(Failure(ConnectionLost("gone")))


class UpstreamWorld:
    """One SSMP upstream with its router, secrets, clock and metrics."""

    def __init__(
        self,
        settings: SSMPUpstreamSettings = SETTINGS,
        routes: Iterable[Route] = (ALERTS_IN, WEATHER_OUT),
        topics: Callable[[], Iterable[str]] | None = None,
        sink: IDestination | None = None,
    ) -> None:
        self.clock = MemoryReactorClock()
        self.metrics = GatewayMetrics()
        self.sink = sink if sink is not None else HeldDestination()
        self.router = Router(RouteTable(), self.clock, self.metrics)
        self.upstream = SSMPUpstream(
            name=UPSTREAM,
            settings=settings,
            endpoint=TCP4ClientEndpoint(self.clock, HOST, PORT),
            router=self.router,
            secrets=Secrets(upstreams={UPSTREAM: SECRET}),
            clock=self.clock,
            topics=topics,
            metrics=self.metrics,
        )
        self.router.replace_table(bind_routes(routes, {SINK: self.sink, UPSTREAM: self.upstream}))

    def connect(self) -> Connection:
        """Open a connection: the client sends its LOGIN."""
        protocol = SSMPClientProtocol(self.upstream)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return Connection(protocol, transport)

    def ready(self) -> Connection:
        """Connect, accept the login and every SUBSCRIBE; nothing is left unread."""
        connection = self.connect()
        connection.sent()
        connection.server_says(b"200\n")
        subscribes = connection.sent().count(b"\n")
        connection.server_says(b"200\n" * subscribes)
        assert self.upstream.connected
        return connection

    def sample(self, name: str, **labels: str) -> float:
        """Return a metric's current value (0 when it was never set)."""
        value = self.metrics.registry.get_sample_value(name, labels)
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


def weather(body: bytes = b"sunny", address: str = "weather.paris") -> Message:
    """A message for the upstream."""
    return Message(body=body, address=address, sender="station-7")


@pytest.fixture
def world() -> UpstreamWorld:
    """An upstream logging in with a secret, with routes in and out."""
    return UpstreamWorld()


# --- login and subscriptions ------------------------------------------------------------


def test_upstream_provides_idestination(world: UpstreamWorld) -> None:
    """The upstream is a real IDestination named after its config entry."""
    assert verifyObject(IDestination, world.upstream)
    assert world.upstream.name == UPSTREAM


def test_login_with_secret_on_connect(world: UpstreamWorld) -> None:
    """On connect the client logs in with its identity and the upstream's secret, nothing else."""
    connection = world.connect()
    assert connection.sent() == b"LOGIN gw secret s3cret\n"
    assert not world.upstream.connected


@pytest.mark.parametrize("scheme", ["cert", "open"])
def test_login_without_credential(scheme: str) -> None:
    """Schemes ``cert`` (the endpoint's certificate) and ``open`` send no credential."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, scheme=scheme))
    connection = world.connect()
    assert connection.sent() == f"LOGIN gw {scheme}\n".encode()


def test_subscribes_only_after_login_200() -> None:
    """After the login's 200: SUBSCRIBE each settings topic and route topic, once."""
    world = UpstreamWorld(topics=lambda: ["alerts.fire", "orders"])
    connection = world.connect()
    assert connection.sent() == b"LOGIN gw secret s3cret\n"
    world.clock.advance(5)
    assert connection.sent() == b""  # nothing before the 200

    connection.server_says(b"200\n")
    assert connection.sent() == b"SUBSCRIBE news\nSUBSCRIBE alerts.fire\nSUBSCRIBE orders\n"
    assert world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 1
    connection.server_says(b"200\n409 already subscribed\n200\n")
    assert not connection.transport.disconnecting


def test_subscribes_with_presence() -> None:
    """With ``presence = true`` every SUBSCRIBE carries the PRESENCE flag."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, presence=True, subscribe=("news",)))
    connection = world.connect()
    connection.sent()
    connection.server_says(b"200\n")
    assert connection.sent() == b"SUBSCRIBE news PRESENCE\n"


def test_topics_are_asked_at_each_login() -> None:
    """The ``topics`` callable is asked at every login, so a reload's topics are used."""
    current = ["a"]
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, subscribe=()), topics=lambda: current)
    first = world.connect()
    first.sent()
    first.server_says(b"200\n")
    assert first.sent() == b"SUBSCRIBE a\n"
    first.lose()
    current = ["b"]
    second = world.connect()
    second.sent()
    second.server_says(b"200\n")
    assert second.sent() == b"SUBSCRIBE b\n"


def test_refused_subscribe_is_logged_and_tolerated(world: UpstreamWorld) -> None:
    """A refused SUBSCRIBE is logged; the connection stays."""
    connection = world.connect()
    connection.sent()
    connection.server_says(b"200\n")
    connection.sent()
    with capturedLogs() as events:
        connection.server_says(b"405 nope\n200\n")
    assert [event["topic"] for event in events if "topic" in event] == ["news"]
    assert not connection.transport.disconnecting


def test_login_refused_closes_and_subscribes_nothing(world: UpstreamWorld) -> None:
    """A refused login closes the connection; nothing is subscribed, the upstream is not up."""
    connection = world.connect()
    connection.sent()
    with capturedLogs() as events:
        connection.server_says(b"401 cert\n")
    assert connection.transport.disconnecting
    assert connection.sent() == b""
    assert not world.upstream.connected
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="login-refused")
    assert any("refused" in event.get("why", "") for event in events)


# --- deliveries to the upstream -----------------------------------------------------------


def test_deliver_while_not_connected_is_retry(world: UpstreamWorld) -> None:
    """A delivery with no logged-in connection is answered retry at once."""
    [outcome] = fired(world.upstream.deliver([weather()]))
    assert outcome.status is Status.RETRY
    assert "not connected" in outcome.reason

    connection = world.connect()  # connected, login not answered yet
    [outcome] = fired(world.upstream.deliver([weather()]))
    assert outcome.status is Status.RETRY
    assert connection.sent() == b"LOGIN gw secret s3cret\n"


def test_deliver_writes_mcast_and_200_is_accepted(world: UpstreamWorld) -> None:
    """When ready, a delivery is an MCAST request; the server's 200 makes it accepted."""
    connection = world.ready()
    outcomes = world.upstream.deliver([weather()])
    assert connection.sent() == b"MCAST weather.paris sunny\n"
    assert not outcomes.called
    connection.server_says(b"200\n")
    assert fired(outcomes) == [Outcome.accepted()]


def test_error_response_is_rejected_with_code(world: UpstreamWorld) -> None:
    """A non-200 response is a rejected outcome carrying the server's code and text."""
    connection = world.ready()
    outcomes = world.upstream.deliver([weather()])
    connection.server_says(b"404 no such topic\n")
    [result] = fired(outcomes)
    assert result.status is Status.REJECTED
    assert result.code == "404"
    assert result.reason == "central answered 404 no such topic"


def test_connection_lost_before_answer_is_retry(world: UpstreamWorld) -> None:
    """A request whose connection is lost before the answer gets a retry outcome."""
    connection = world.ready()
    outcomes = world.upstream.deliver([weather()])
    connection.lose()
    [result] = fired(outcomes)
    assert result.status is Status.RETRY
    assert "lost" in result.reason
    assert not world.upstream.connected
    assert world.sample("msggateway_upstream_connected", upstream=UPSTREAM) == 0
    assert fired(world.upstream.deliver([weather()]))[0].status is Status.RETRY


def test_message_ssmp_cannot_carry_is_rejected(world: UpstreamWorld) -> None:
    """A body with LF, or a topic that is not an SSMP id, is rejected and never sent."""
    connection = world.ready()
    for message in (weather(body=b"a\nb"), weather(address="not a topic"), weather(body=b"")):
        [outcome] = fired(world.upstream.deliver([message]))
        assert outcome.status is Status.REJECTED
    assert connection.sent() == b""


def test_responses_match_requests_first_in_first_out(world: UpstreamWorld) -> None:
    """Pipelined requests get their responses in order, after the pending SUBSCRIBEs'."""
    connection = world.connect()
    connection.sent()
    connection.server_says(b"200\n")
    assert connection.sent() == b"SUBSCRIBE news\nSUBSCRIBE alerts.fire\n"
    outcomes = [world.upstream.deliver([weather(body=b"%d" % i)]) for i in range(3)]
    assert (
        connection.sent()
        == b"MCAST weather.paris 0\nMCAST weather.paris 1\nMCAST weather.paris 2\n"
    )

    connection.server_says(b"200\n200\n200\n400 too long\n")  # two SUBSCRIBEs first
    assert fired(outcomes[0])[0].is_accepted
    assert fired(outcomes[1])[0].code == "400"
    assert not outcomes[2].called
    connection.server_says(b"200\n")
    assert fired(outcomes[2])[0].is_accepted


def test_router_timeout_does_not_break_the_next_response(world: UpstreamWorld) -> None:
    """A request the router gave up on still consumes its response; the next gets its own."""
    connection = world.ready()
    first = world.router.dispatch(FEED, [weather(body=b"first")])
    world.clock.advance(5)
    [result] = fired(first)
    assert isinstance(result, Outcome)
    assert result.status is Status.RETRY
    assert result.reason == "route weather-out: no outcome from central within 5 seconds"

    second = world.router.dispatch(FEED, [weather(body=b"second")])
    assert connection.sent() == b"MCAST weather.paris first\nMCAST weather.paris second\n"
    connection.server_says(b"404 late answer to the first\n")
    assert not second.called
    connection.server_says(b"200\n")
    assert fired(second) == [Outcome.accepted()]
    assert not connection.transport.disconnecting


def test_response_to_no_request_closes(world: UpstreamWorld) -> None:
    """A response when no request is waiting breaks SSMP's order: the client closes."""
    connection = world.ready()
    connection.server_says(b"200\n")
    assert connection.transport.disconnecting


# --- events from the upstream ---------------------------------------------------------------


def test_mcast_events_are_routed_with_upstream_as_source() -> None:
    """``000 x MCAST t p`` enters the routes from the upstream, as a message from ``x`` on ``t``."""
    sink = AcceptingDestination()
    world = UpstreamWorld(sink=sink)
    connection = world.ready()
    world.clock.advance(12)
    connection.server_says(b"000 sensor-3 MCAST alerts.fire it is hot in here\n")
    [message] = sink.messages
    assert message.address == "alerts.fire"
    assert message.sender == "sensor-3"
    assert message.body == b"it is hot in here"
    assert message.headers == {"ssmp.verb": "MCAST"}
    assert message.timestamp == 12
    assert connection.sent() == b""  # SSMP events carry no acknowledgement
    assert world.sample("msggateway_route_messages_total", route="alerts-in") == 1


def test_unrouted_and_other_events_are_dropped(world: UpstreamWorld) -> None:
    """Events no route takes, presence and PONG are dropped; the connection stays.

    MCAST, UCAST (``!ucast.gw``) and BCAST (``!bcast``) events are all
    routable: without a route each is counted as unrouted.
    """
    connection = world.ready()
    connection.server_says(
        b"000 x MCAST news not routed\n"
        b"000 x SUBSCRIBE news PRESENCE\n"
        b"000 x UNSUBSCRIBE news\n"
        b"000 x UCAST gw psst\n"
        b"000 x BCAST hello\n"
        b"000 . PONG\n"
    )
    assert isinstance(world.sink, HeldDestination)
    assert world.sink.messages == []
    assert not connection.transport.disconnecting
    assert connection.sent() == b""
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="unrouted") == 3


def test_unknown_event_verb_closes(world: UpstreamWorld) -> None:
    """Spec, "Forward compatibility": an event with an unknown verb closes the connection."""
    connection = world.ready()
    connection.server_says(b"000 x FROB thing\n000 y MCAST alerts.fire never\n")
    assert connection.transport.disconnecting
    assert isinstance(world.sink, HeldDestination)
    assert world.sink.messages == []
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="unknown-event")


def test_ping_event_is_answered_pong(world: UpstreamWorld) -> None:
    """Spec, "Server-initiated": ``000 . PING`` is answered ``PONG``."""
    connection = world.ready()
    connection.server_says(b"000 . PING\n")
    assert connection.sent() == b"PONG\n"


def test_client_pings_when_idle_and_closes_without_pong(world: UpstreamWorld) -> None:
    """After ``ping_interval`` without input the client PINGs; without a PONG it closes."""
    connection = world.ready()
    world.clock.advance(29.9)
    assert connection.sent() == b""
    world.clock.advance(0.1)
    assert connection.sent() == b"PING\n"
    world.clock.advance(29.9)
    assert not connection.transport.disconnecting
    world.clock.advance(0.1)
    assert connection.transport.disconnecting
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="pong-timeout")


def test_pong_keeps_the_connection(world: UpstreamWorld) -> None:
    """A PONG in time keeps the connection; the next PING follows a new silence."""
    connection = world.ready()
    world.clock.advance(30)
    assert connection.sent() == b"PING\n"
    world.clock.advance(10)
    connection.server_says(b"000 . PONG\n")
    world.clock.advance(20)
    assert not connection.transport.disconnecting
    assert connection.sent() == b""
    world.clock.advance(10)  # 30 s after the PONG
    assert connection.sent() == b"PING\n"


def test_connection_lost_cancels_the_timer(world: UpstreamWorld) -> None:
    """No timer of a lost connection stays on the clock."""
    connection = world.ready()
    connection.lose()
    assert world.clock.getDelayedCalls() == []


def test_inbound_flow_control_pauses_and_resumes() -> None:
    """With ``max_in_flight`` outcomes pending the client stops reading, then resumes."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_in_flight=2))
    assert isinstance(world.sink, HeldDestination)
    connection = world.ready()
    connection.server_says(b"000 x MCAST alerts.a 1\n")
    assert connection.transport.producerState == "producing"
    connection.server_says(b"000 x MCAST alerts.b 2\n")
    assert connection.transport.producerState == "paused"

    world.sink.outcomes[0].callback(Outcome.accepted())
    assert connection.transport.producerState == "producing"
    with capturedLogs() as events:
        world.sink.outcomes[1].callback(Outcome.rejected("full"))
    assert [event["reason"] for event in events if "reason" in event] == ["full"]


def test_malformed_input_closes(world: UpstreamWorld) -> None:
    """Input that breaks the grammar closes the connection without a word; lines before count."""
    connection = world.ready()
    outcomes = world.upstream.deliver([weather()])
    connection.sent()
    connection.server_says(b"200\nhello there\n200\n")
    assert fired(outcomes) == [Outcome.accepted()]
    assert connection.transport.disconnecting
    assert connection.sent() == b""
    assert world.sample("msggateway_protocol_errors_total", endpoint=UPSTREAM, kind="bad-code")


def test_overlong_line_closes() -> None:
    """A line longer than ``max_line_bytes`` closes the connection as soon as it passes it."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_line_bytes=64))
    connection = world.ready()
    connection.server_says(b"000 x MCAST news " + b"x" * 60)
    assert connection.transport.disconnecting


# --- the ClientService, and our client paired with our hub ---------------------------------------


def test_service_connects_through_the_endpoint_and_retries() -> None:
    """Starting the service connects to the endpoint; a failed attempt is retried with backoff."""
    world = UpstreamWorld()
    world.upstream.service.startService()
    [(host, port, *_)] = world.clock.tcpClients
    assert (host, port) == (HOST, PORT)
    ConnectionCompleter(world.clock).failOnce()
    assert world.clock.tcpClients == []
    world.clock.advance(2)  # the first delay is 0.5 s plus up to 1 s of jitter
    assert len(world.clock.tcpClients) == 1
    world.upstream.service.stopService()


def test_client_and_hub_in_memory() -> None:
    """Our client logs in to our hub, subscribes, and carries routed messages both ways."""
    reactor = MemoryReactorClock()

    # The far side: an SSMP hub that knows the gateway's secret.
    hub = Hub("hub", reactor)
    server_factory = SSMPServerFactory(
        name="hub",
        settings=SSMPListenerSettings(schemes=frozenset({"secret"})),
        hub=hub,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(logins={"gw": SECRET, "bob": b"bobs-secret"}),
        clock=reactor,
    )
    reactor.listenTCP(PORT, server_factory)
    bob = server_factory.buildProtocol(None)
    bob_transport = StringTransport()
    bob.makeConnection(bob_transport)
    bob.dataReceived(b"LOGIN bob secret bobs-secret\nSUBSCRIBE weather.paris\n")
    assert bob_transport.value() == b"200\n200\n"

    # Our side: the upstream, with routes in and out.
    sink = AcceptingDestination()
    metrics = GatewayMetrics()
    router = Router(RouteTable(), reactor, metrics)
    upstream = SSMPUpstream(
        name=UPSTREAM,
        settings=attrs.evolve(SETTINGS, subscribe=("news",)),
        endpoint=TCP4ClientEndpoint(reactor, "127.0.0.1", PORT),
        router=router,
        secrets=Secrets(upstreams={UPSTREAM: SECRET}),
        clock=reactor,
        topics=lambda: ["alerts.fire"],
        metrics=metrics,
    )
    router.replace_table(bind_routes([ALERTS_IN, WEATHER_OUT], {SINK: sink, UPSTREAM: upstream}))
    upstream.service.startService()
    pump = ConnectionCompleter(reactor).succeedOnce()
    assert pump is not None
    pump.flush()

    assert upstream.connected
    gateway_peer = hub.peers[b"gw"]
    assert isinstance(gateway_peer, SSMPServerProtocol)
    assert gateway_peer.topics == {b"news": False, b"alerts.fire": False}

    # Out: a routed message becomes an MCAST on the hub; the hub's 200 is the outcome.
    bob_transport.clear()
    outcome = router.dispatch(FEED, [weather()])
    assert not outcome.called
    pump.flush()
    assert fired(outcome) == [Outcome.accepted()]
    assert bob_transport.value() == b"000 gw MCAST weather.paris sunny\n"

    # In: an MCAST on the hub reaches the gateway and enters its routes.
    bob.dataReceived(b"MCAST alerts.fire smoke on floor 2\n")
    pump.flush()
    [message] = sink.messages
    assert (message.address, message.sender, message.body) == (
        "alerts.fire",
        "bob",
        b"smoke on floor 2",
    )

    # Stopping the service closes the connection; the hub forgets the gateway.
    stopped = upstream.service.stopService()
    pump.flush()
    fired(stopped)
    assert not upstream.connected
    assert b"gw" not in hub.peers


def test_new_connection_resumes_after_outcomes_of_a_lost_one() -> None:
    """Outcomes of a lost connection's messages resume reading on its replacement."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_in_flight=2))
    assert isinstance(world.sink, HeldDestination)
    old = world.ready()
    old.server_says(b"000 x MCAST alerts.a 1\n000 x MCAST alerts.b 2\n")
    assert old.transport.producerState == "paused"
    old.lose()

    new = world.ready()
    new.server_says(b"000 x MCAST alerts.c 3\n")
    assert new.transport.producerState == "paused"  # three in flight
    world.sink.outcomes[2].callback(Outcome.accepted())
    world.sink.outcomes[0].callback(Outcome.accepted())
    world.sink.outcomes[1].callback(Outcome.accepted())
    assert new.transport.producerState == "producing"
