"""The SSMP upstream a batch at a time, and UCAST/BCAST across it.

The upstream of `tests.protocols.test_ssmp_client` (one `SSMPClientProtocol`
on a transport, the test playing the server, a `MemoryReactorClock`): a
batch's requests go out in one write and its responses are matched first in,
first out into one list of outcomes; the router's deadline and a lost
connection answer what is known and retry for the rest. Then the address
forms ``!ucast.<peer>`` and ``!bcast`` in both directions, and our client
paired with our hub through `twisted.test.iosim`.
"""

from __future__ import annotations

import attrs
import pytest
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.test.iosim import ConnectionCompleter

from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, RouteTable, bind_routes
from gateway.protocols.ssmp.client import SSMPClientProtocol, SSMPUpstream
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.server import SSMPServerFactory
from gateway.protocols.ssmp.settings import SSMPListenerSettings
from tests.protocols.test_ssmp_client import (
    ALERTS_IN,
    FEED,
    PORT,
    SECRET,
    SETTINGS,
    SINK,
    UPSTREAM,
    WEATHER_OUT,
    AcceptingDestination,
    Connection,
    UpstreamWorld,
    fired,
    weather,
)
from tests.protocols.test_ssmp_server import CountingTransport

TIMED_OUT = "route weather-out: no outcome from central within 5 seconds"

UCAST_OUT = Route(
    name="ucast-out", source=FEED, pattern=AddressPattern("!ucast.#"), destination=UPSTREAM
)
"""UCASTs from the feed go to the upstream's server, to the same peer id."""
BCAST_OUT = Route(
    name="bcast-out", source=FEED, pattern=AddressPattern("!bcast"), destination=UPSTREAM
)
"""BCASTs from the feed go to the upstream's server."""
UCAST_IN = Route(
    name="ucast-in", source=UPSTREAM, pattern=AddressPattern("!ucast.gw"), destination=SINK
)
"""UCASTs the server forwards to the gateway's identity go to the sink."""
BCAST_IN = Route(
    name="bcast-in", source=UPSTREAM, pattern=AddressPattern("!bcast"), destination=SINK
)
"""BCASTs the server forwards to the gateway go to the sink."""


def counted_ready(world: UpstreamWorld) -> Connection:
    """A logged-in, subscribed connection on a `CountingTransport`; nothing left unread."""
    protocol = SSMPClientProtocol(world.upstream)
    transport = CountingTransport()
    protocol.makeConnection(transport)
    connection = Connection(protocol, transport)
    connection.sent()
    connection.server_says(b"200\n")
    connection.server_says(b"200\n" * connection.sent().count(b"\n"))
    assert world.upstream.connected
    return connection


def writes(connection: Connection) -> int:
    """Writes that reached the connection's transport so far."""
    transport = connection.transport
    assert isinstance(transport, CountingTransport)
    return transport.writes


@pytest.fixture
def world() -> UpstreamWorld:
    """An upstream with routes in and out, MCAST, UCAST and BCAST."""
    return UpstreamWorld(
        routes=(ALERTS_IN, WEATHER_OUT, UCAST_OUT, BCAST_OUT, UCAST_IN, BCAST_IN),
        sink=AcceptingDestination(),
    )


# --- batches out ----------------------------------------------------------------------------


def test_batch_is_one_write_and_matches_its_responses(world: UpstreamWorld) -> None:
    """N messages go out as N pipelined MCASTs in one write; N responses give N outcomes."""
    connection = counted_ready(world)
    before = writes(connection)
    sent = world.sample("msggateway_messages_sent_total", endpoint=UPSTREAM)
    outcomes = world.upstream.deliver([weather(body=b"%d" % i) for i in range(20)])
    assert writes(connection) == before + 1
    assert connection.sent() == b"".join(b"MCAST weather.paris %d\n" % i for i in range(20))
    assert world.sample("msggateway_messages_sent_total", endpoint=UPSTREAM) == sent + 20

    connection.server_says(b"200\n" * 10)
    assert not outcomes.called
    connection.server_says(b"200\n" * 4 + b"404 no such topic\n" + b"200\n" * 5)
    results = fired(outcomes)
    assert [result.status for result in results] == [Status.ACCEPTED] * 14 + [Status.REJECTED] + [
        Status.ACCEPTED
    ] * 5
    assert results[14].code == "404"
    assert results[14].reason == "central answered 404 no such topic"


def test_batch_with_partial_refusal(world: UpstreamWorld) -> None:
    """What SSMP cannot carry is rejected and never sent; the rest go out and are matched."""
    connection = counted_ready(world)
    batch = [weather(body=b"one"), weather(body=b"a\nb"), weather(body=b"two"), weather(body=b"")]
    outcomes = world.upstream.deliver(batch)
    assert connection.sent() == b"MCAST weather.paris one\nMCAST weather.paris two\n"
    connection.server_says(b"200\n400 too long\n")
    first, lf, second, empty = fired(outcomes)
    assert first.is_accepted
    assert lf.reason == "SSMP cannot carry a message body containing LF"
    assert second.code == "400"
    assert empty.reason == "SSMP cannot carry an empty message body"


def test_batch_of_nothing_sendable_writes_nothing(world: UpstreamWorld) -> None:
    """A batch that SSMP can carry none of is answered at once, with no write."""
    connection = counted_ready(world)
    before = writes(connection)
    outcomes = fired(world.upstream.deliver([weather(body=b""), weather(address="bad topic")]))
    assert [outcome.status for outcome in outcomes] == [Status.REJECTED] * 2
    assert writes(connection) == before


def test_batch_while_not_connected_is_retry_for_each(world: UpstreamWorld) -> None:
    """Not logged in: every message of the batch is retry later, nothing is written."""
    outcomes = fired(world.upstream.deliver([weather(), weather(body=b"a\nb")]))
    assert [outcome.status for outcome in outcomes] == [Status.RETRY, Status.RETRY]
    assert all("not connected" in outcome.reason for outcome in outcomes)


def test_deadline_cuts_a_batch(world: UpstreamWorld) -> None:
    """At the route's deadline the answered messages keep their outcomes, the rest retry.

    The responses that come later still take their requests' places, so
    the next batch is matched with its own responses.
    """
    connection = counted_ready(world)
    first = world.router.dispatch(FEED, [weather(body=b"%d" % i) for i in range(3)])
    connection.server_says(b"200\n")
    world.clock.advance(5)
    accepted, cut, cut_too = fired(first)
    assert accepted == Outcome.accepted()
    assert isinstance(cut, Outcome)
    assert (cut.status, cut.reason) == (Status.RETRY, TIMED_OUT)
    assert cut_too == cut

    connection.sent()
    second = world.router.dispatch(FEED, [weather(body=b"again")])
    assert connection.sent() == b"MCAST weather.paris again\n"
    connection.server_says(b"404 late\n")  # the first batch's second message
    connection.server_says(b"200\n")  # and its third
    assert not second.called
    connection.server_says(b"405 for the second batch\n")
    [result] = fired(second)
    assert isinstance(result, Outcome)
    assert result.code == "405"
    assert not connection.transport.disconnecting


def test_connection_lost_mid_batch(world: UpstreamWorld) -> None:
    """A connection lost mid-batch: answered messages keep their outcomes, the rest retry."""
    connection = counted_ready(world)
    outcomes = world.upstream.deliver([weather(body=b"%d" % i) for i in range(4)])
    connection.server_says(b"200\n404 nope\n")
    connection.lose()
    accepted, rejected, lost, lost_too = fired(outcomes)
    assert accepted.is_accepted
    assert rejected.code == "404"
    assert lost.status is Status.RETRY
    assert lost.reason == "connection to central lost before it answered"
    assert lost_too == lost


def test_two_batches_in_flight_keep_their_order(world: UpstreamWorld) -> None:
    """Responses are matched across batches first in, first out."""
    connection = counted_ready(world)
    one = world.upstream.deliver([weather(body=b"a"), weather(body=b"b")])
    two = world.upstream.deliver([weather(body=b"c")])
    connection.server_says(b"200\n400 x\n")
    assert [outcome.code for outcome in fired(one)] == [None, "400"]
    assert not two.called
    connection.server_says(b"200\n")
    assert fired(two) == [Outcome.accepted()]


# --- UCAST and BCAST out ----------------------------------------------------------------------


def test_ucast_and_bcast_forms_are_sent_as_such(world: UpstreamWorld) -> None:
    """``!ucast.<peer>`` is sent as UCAST, ``!bcast`` as BCAST, topics as MCAST: one write."""
    connection = counted_ready(world)
    before = writes(connection)
    outcomes = world.upstream.deliver(
        [
            Message(body=b"psst", address="!ucast.bob@far"),
            Message(body=b"hello all", address="!bcast"),
            Message(body=b"news", address="news"),
            Message(body=b"who", address="!ucast.nobody"),
        ]
    )
    assert writes(connection) == before + 1
    assert connection.sent() == (
        b"UCAST bob@far psst\nBCAST hello all\nMCAST news news\nUCAST nobody who\n"
    )
    connection.server_says(b"200\n405 anonymous peers cannot BCAST\n200\n404 no such peer\n")
    ucast, bcast, mcast, absent = fired(outcomes)
    assert ucast.is_accepted
    assert (bcast.status, bcast.code) == (Status.REJECTED, "405")
    assert mcast.is_accepted
    assert (absent.status, absent.code) == (Status.REJECTED, "404")
    assert absent.reason == "central answered 404 no such peer"


# --- events in ------------------------------------------------------------------------------------


def test_events_of_one_read_are_one_batch() -> None:
    """The MCAST, UCAST and BCAST events of one read enter the routes as one batch."""
    everything = Route(
        name="all-in", source=UPSTREAM, pattern=AddressPattern("#"), destination=SINK
    )
    sink = AcceptingDestination()
    world = UpstreamWorld(routes=[everything], sink=sink)
    connection = world.ready()
    world.clock.advance(4)
    connection.server_says(
        b"000 x MCAST news one\n"
        b"000 . PING\n"
        b"000 y UCAST gw two\n"
        b"000 x SUBSCRIBE news\n"
        b"000 z BCAST three\n"
    )
    assert connection.sent() == b"PONG\n"
    [batch] = sink.batches
    assert [(m.address, m.sender, m.body, m.headers["ssmp.verb"]) for m in batch] == [
        ("news", "x", b"one", "MCAST"),
        ("!ucast.gw", "y", b"two", "UCAST"),
        ("!bcast", "z", b"three", "BCAST"),
    ]
    assert {m.timestamp for m in batch} == {4}
    assert world.upstream.in_flight == 0


def test_events_before_bad_input_are_routed(world: UpstreamWorld) -> None:
    """Events decoded before a malformed line are still routed; then the connection closes."""
    connection = world.ready()
    connection.server_says(b"000 x UCAST gw kept\nnonsense\n000 x BCAST lost\n")
    assert isinstance(world.sink, AcceptingDestination)
    assert [m.address for m in world.sink.messages] == ["!ucast.gw"]
    assert connection.transport.disconnecting


def test_inbound_batch_counts_against_max_in_flight() -> None:
    """A read of many events counts each against ``max_in_flight``: reading pauses at once."""
    world = UpstreamWorld(settings=attrs.evolve(SETTINGS, max_in_flight=3))
    connection = world.ready()
    connection.server_says(b"000 x MCAST alerts.a 1\n000 x MCAST alerts.b 2\n000 x MCAST news 3\n")
    assert world.upstream.in_flight == 2  # the unrouted one was answered at once
    assert connection.transport.producerState == "producing"
    connection.server_says(b"000 x MCAST alerts.c 4\n")
    assert connection.transport.producerState == "paused"


def test_address_forms_are_never_subscribed() -> None:
    """Exact route patterns that are address forms, not topics, are left out of SUBSCRIBE."""
    world = UpstreamWorld(
        settings=attrs.evolve(SETTINGS, subscribe=("news",)),
        topics=lambda: ["!ucast.gw", "!bcast", "alerts.fire"],
    )
    assert world.upstream.topics() == ["news", "alerts.fire"]
    connection = world.connect()
    connection.sent()
    connection.server_says(b"200\n")
    assert connection.sent() == b"SUBSCRIBE news\nSUBSCRIBE alerts.fire\n"


# --- our client and our hub ---------------------------------------------------------------------


def test_ucast_and_bcast_both_ways_with_our_hub() -> None:
    """UCAST and BCAST cross between our upstream and our hub, with the hub's outcomes."""
    reactor = MemoryReactorClock()
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
    assert bob is not None
    bob_transport = StringTransport()
    bob.makeConnection(bob_transport)
    bob.dataReceived(b"LOGIN bob secret bobs-secret\nSUBSCRIBE news\n")
    assert bob_transport.value() == b"200\n200\n"
    bob_transport.clear()

    sink = AcceptingDestination()
    router = Router(RouteTable(), reactor)
    upstream = SSMPUpstream(
        name=UPSTREAM,
        settings=attrs.evolve(SETTINGS, subscribe=("news",)),
        endpoint=TCP4ClientEndpoint(reactor, "127.0.0.1", PORT),
        router=router,
        secrets=Secrets(upstreams={UPSTREAM: SECRET}),
        clock=reactor,
        metrics=None,
    )
    routes = [UCAST_OUT, BCAST_OUT, UCAST_IN, BCAST_IN]
    router.replace_table(bind_routes(routes, {SINK: sink, UPSTREAM: upstream}))
    upstream.service.startService()
    pump = ConnectionCompleter(reactor).succeedOnce()
    assert pump is not None
    pump.flush()
    assert upstream.connected

    # Out: UCAST to bob, to nobody, and a BCAST to those sharing a topic with gw.
    results = router.dispatch(
        FEED,
        [
            Message(body=b"psst", address="!ucast.bob", sender="alice"),
            Message(body=b"hm", address="!ucast.nobody", sender="alice"),
            Message(body=b"hello all", address="!bcast", sender="alice"),
        ],
    )
    pump.flush()
    reached, absent, broadcast = fired(results)
    assert reached == Outcome.accepted()
    assert isinstance(absent, Outcome)
    assert (absent.status, absent.code) == (Status.REJECTED, "404")
    assert broadcast == Outcome.accepted()
    assert bob_transport.value() == b"000 gw UCAST bob psst\n000 gw BCAST hello all\n"

    # In: bob's UCAST to gw and his BCAST reach the gateway's routes.
    bob.dataReceived(b"UCAST gw for the gateway\nBCAST to everyone\n")
    pump.flush()
    assert [(m.address, m.sender, m.body) for m in sink.messages] == [
        ("!ucast.gw", "bob", b"for the gateway"),
        ("!bcast", "bob", b"to everyone"),
    ]

    stopped = upstream.service.stopService()
    pump.flush()
    fired(stopped)
