"""UCAST and BCAST through routes on the SSMP listener, and the address forms.

The hub of `tests.protocols.test_ssmp_server` with routes taking
``!ucast.#`` and ``!bcast`` to a held destination: a UCAST to a peer that is
not connected goes to the routes (``404`` only when no route takes it), a
BCAST goes to the hub's sharing peers and to the routes, and each response
waits for the route's outcome in request order. Then the pure mapping
(`gateway.protocols.ssmp.mapping`), and two hubs of one gateway bridged by
routes.
"""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.core.message import Message, Outcome
from gateway.core.router import Route, Router, Unrouted, bind_routes
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.mapping import (
    BCAST_ADDRESS,
    message_from_bcast,
    message_from_ucast,
    request_line,
    ucast_address,
    ucast_peer,
)
from gateway.protocols.ssmp.server import SSMPServerFactory, ucast_response
from tests.protocols.test_ssmp_server import LISTENER, ORDERS, SETTINGS, SINK, HubWorld, Peer

UCAST_OUT = Route(
    name="ucast-out",
    source=LISTENER,
    pattern=AddressPattern("!ucast.*@far"),
    destination=SINK,
    timeout_seconds=10.0,
)
"""UCASTs to ``<someone>@far`` (never connected here) go to the held destination."""
BCAST_OUT = Route(
    name="bcast-out",
    source=LISTENER,
    pattern=AddressPattern("!bcast"),
    destination=SINK,
    timeout_seconds=10.0,
)
"""BCASTs go to the held destination too."""


@pytest.fixture
def routed() -> HubWorld:
    """A hub whose UCASTs to ``*@far`` and BCASTs are routed to a held destination."""
    return HubWorld(routes=[UCAST_OUT, BCAST_OUT])


# --- UCAST -----------------------------------------------------------------------------------


def test_ucast_to_a_local_peer_stays_local(routed: HubWorld) -> None:
    """A UCAST to a connected peer is delivered on the hub, even when a route would match."""
    local = routed.login("bob@far")
    alice = routed.login("alice")
    alice.send(b"UCAST bob@far hi\n")
    assert alice.received() == b"200\n"
    assert local.received() == b"000 alice UCAST bob@far hi\n"
    assert routed.sink.messages == []


def test_ucast_to_an_absent_peer_goes_to_the_route(routed: HubWorld) -> None:
    """A UCAST to a peer not connected here, matching a route, waits for the route's outcome."""
    alice = routed.login("alice")
    routed.clock.advance(3)
    alice.send(b"UCAST carol@far are you there\n")
    assert alice.received() == b""
    [message] = routed.sink.messages
    assert (message.address, message.sender, message.body) == (
        "!ucast.carol@far",
        "alice",
        b"are you there",
    )
    assert message.headers == {"ssmp.verb": "UCAST"}
    assert message.timestamp == 3

    routed.sink.outcomes[0].callback(Outcome.accepted())
    routed.clock.advance(0)
    assert alice.received() == b"200\n"


@pytest.mark.parametrize(
    ("outcome", "line"),
    [
        (Outcome.rejected("far answered 404 gone", code="404"), b"404 far answered 404 gone\n"),
        (Outcome.rejected("full", code="405"), b"400 rejected: full\n"),
        (Outcome.retry("far is down"), b"400 retry: far is down\n"),
    ],
)  # fmt: skip
def test_routed_ucast_outcomes(routed: HubWorld, outcome: Outcome, line: bytes) -> None:
    """The route's 404 is the sender's 404 (no such peer there either); others as for MCAST."""
    alice = routed.login("alice")
    alice.send(b"UCAST carol@far hi\n")
    routed.sink.outcomes[0].callback(outcome)
    routed.clock.advance(0)
    assert alice.received() == line


def test_ucast_without_peer_or_route_is_404(routed: HubWorld) -> None:
    """No peer here and no route for it: 404 at once, as without routes."""
    alice = routed.login("alice")
    alice.send(b"UCAST carol@near hi\nUCAST . hi\n")
    assert alice.received() == b"404 no such peer\n405 anonymous peers cannot receive UCAST\n"
    assert routed.sink.messages == []


def test_ucast_that_no_route_takes_after_all_is_404() -> None:
    """A route that matches the address but not the sender (``match_sender``) leaves 404."""
    only_bob = Route(
        name="only-bob",
        source=LISTENER,
        pattern=AddressPattern("!ucast.#"),
        destination=SINK,
        match_sender=AddressPattern("bob"),
    )
    world = HubWorld(routes=[only_bob])
    alice = world.login("alice")
    alice.send(b"UCAST carol hi\n")
    world.clock.advance(0)
    assert alice.received() == b"404 no such peer\n"
    assert world.sink.messages == []


def test_ucast_response_mapping() -> None:
    """`ucast_response`: accepted 200, unrouted or a 404 rejection 404, else as MCAST."""
    assert ucast_response(Outcome.accepted()) == b"200\n"
    assert ucast_response(Unrouted(("!ucast.x",))) == b"404 no such peer\n"
    assert ucast_response(Outcome.rejected("gone", code="404")) == b"404 gone\n"
    assert ucast_response(Outcome.retry("later", code="404")) == b"400 retry: later\n"
    assert ucast_response(Outcome.rejected("no", code="550")) == b"400 rejected: no\n"


# --- BCAST -----------------------------------------------------------------------------------


def test_routed_bcast_reaches_the_hub_at_once_and_waits_for_the_route(routed: HubWorld) -> None:
    """A BCAST reaches the sharing peers at once; its 200 waits for the ``!bcast`` route."""
    bob = routed.subscriber("bob", "news")
    alice = routed.subscriber("alice", "news")
    alice.send(b"BCAST hello everyone\n")
    assert bob.received() == b"000 alice BCAST hello everyone\n"
    assert alice.received() == b""
    [message] = routed.sink.messages
    assert (message.address, message.sender, message.body) == (
        "!bcast",
        "alice",
        b"hello everyone",
    )
    assert message.headers == {"ssmp.verb": "BCAST"}
    routed.sink.outcomes[0].callback(Outcome.retry("far is down"))
    routed.clock.advance(0)
    assert alice.received() == b"400 retry: far is down\n"


def test_bcast_without_route_is_answered_at_once() -> None:
    """With no ``!bcast`` route a BCAST is answered 200 at once (the hub alone)."""
    world = HubWorld(routes=[ORDERS])
    alice = world.subscriber("alice", "news")
    alice.send(b"BCAST hi\n")
    assert alice.received() == b"200\n"
    assert world.sink.messages == []


def test_anonymous_bcast_is_405_and_not_routed(routed: HubWorld) -> None:
    """Spec: an anonymous BCAST gets 405, routes or not."""
    anonymous = routed.login(".")
    anonymous.send(b"BCAST hi\n")
    assert anonymous.received() == b"405 anonymous peers cannot BCAST\n"
    assert routed.sink.messages == []


def test_routed_bcast_needs_the_right_to_publish_to_bcast(routed: HubWorld) -> None:
    """On a listener with allow-lists, a BCAST that a route takes needs ``!bcast`` granted."""
    routed.factory.authorization = Authorization.from_lists(
        {"sam": (("!bcast",), ()), "eve": ((), ())}
    )
    routed.factory.secrets = Secrets(logins={"*": b"sesame"})
    eve = routed.login("eve", "secret sesame")
    eve.send(b"BCAST hi\n")
    assert eve.received() == b"405 not allowed to publish !bcast\n"
    sam = routed.login("sam", "secret sesame")
    sam.send(b"BCAST hi\n")
    assert [m.sender for m in routed.sink.messages] == ["sam"]


# --- one read, one batch ------------------------------------------------------------------------


def test_one_read_is_one_batch_with_responses_in_order() -> None:
    """Routed MCAST, UCAST and BCAST of one read go as one batch; responses keep request order."""
    everything = Route(
        name="everything", source=LISTENER, pattern=AddressPattern("#"), destination=SINK
    )
    world = HubWorld(routes=[everything])
    bob = world.login("bob")
    alice = world.subscriber("alice", "news")
    alice.send(b"MCAST news 1\nUCAST bob 2\nUCAST carol 3\nPING\nBCAST 4\nUCAST nobody@x 5\n")
    assert alice.received() == b"000 . PONG\n"  # the events come at once, responses wait
    assert bob.received() == b"000 alice UCAST bob 2\n"
    [batch] = world.sink.batches
    assert [(m.address, m.body) for m in batch] == [
        ("news", b"1"),
        ("!ucast.carol", b"3"),
        ("!bcast", b"4"),
        ("!ucast.nobody@x", b"5"),
    ]
    first, second, third, fourth = world.sink.outcomes
    fourth.callback(Outcome.rejected("unknown", code="404"))
    second.callback(Outcome.accepted())
    third.callback(Outcome.accepted())
    world.clock.advance(0)
    assert alice.received() == b""
    first.callback(Outcome.accepted())
    world.clock.advance(0)
    assert alice.received() == b"200\n200\n200\n200\n404 unknown\n"


# --- the mapping ----------------------------------------------------------------------------------


def test_address_forms() -> None:
    """``!ucast.<peer>`` and ``!bcast``: no SSMP topic can be either (``!`` is no id character)."""
    assert ucast_address(b"alice@far") == "!ucast.alice@far"
    assert ucast_peer("!ucast.alice@far") == "alice@far"
    assert ucast_peer("ucast.alice") is None
    assert ucast_peer(BCAST_ADDRESS) is None
    assert AddressPattern("!ucast.#").match("!ucast.alice.smith@far") == ("alice.smith@far",)
    assert AddressPattern("!ucast.*@far").match("!ucast.alice@far") == ("alice",)
    assert AddressPattern("!bcast").match("!bcast") == ()
    assert AddressTemplate("!ucast.{1}").expand("x", ("bob",)) == "!ucast.bob"


def test_messages_from_ucast_and_bcast() -> None:
    """UCAST and BCAST become messages on their address forms, with the verb in a header."""
    ucast = message_from_ucast(b"alice", b"bob", b"hi", 7.0)
    assert (ucast.address, ucast.sender, ucast.body, ucast.timestamp) == (
        "!ucast.bob",
        "alice",
        b"hi",
        7.0,
    )
    assert ucast.headers == {"ssmp.verb": "UCAST"}
    bcast = message_from_bcast(b"alice", b"all", 7.0)
    assert (bcast.address, bcast.sender, bcast.headers) == (
        "!bcast",
        "alice",
        {"ssmp.verb": "BCAST"},
    )


@pytest.mark.parametrize(
    ("address", "line"),
    [
        ("news", b"MCAST news hi\n"),
        ("!ucast.bob@far", b"UCAST bob@far hi\n"),
        ("!bcast", b"BCAST hi\n"),
    ],
)
def test_request_line(address: str, line: bytes) -> None:
    """Each address form becomes its request."""
    assert request_line(Message(body=b"hi", address=address)) == line


@pytest.mark.parametrize(
    ("address", "body", "reason"),
    [
        ("!ucast.", b"hi", "does not name a valid SSMP peer id"),
        ("!ucast.bad id", b"hi", "does not name a valid SSMP peer id"),
        ("!bcast.x", b"hi", "is not a valid SSMP topic"),
        ("news", b"a\nb", "SSMP cannot carry a message body containing LF"),
        ("!bcast", b"", "SSMP cannot carry an empty message body"),
        ("!ucast.bob", b"x" * 1100, "over SSMP's 1024-byte limit"),
    ],
)
def test_request_line_refusals(address: str, body: bytes, reason: str) -> None:
    """What SSMP cannot carry is a rejected outcome saying why."""
    outcome = request_line(Message(body=body, address=address))
    assert isinstance(outcome, Outcome)
    assert not outcome.is_accepted
    assert reason in outcome.reason


# --- two hubs of one gateway --------------------------------------------------------------------


def test_ucast_and_bcast_between_two_hubs() -> None:
    """Two hubs bridged by routes: UCAST to a peer of the other hub, its 404, and BCAST."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    hubs = {"east": Hub("east", clock), "west": Hub("west", clock)}
    factories = {
        name: SSMPServerFactory(
            name=name,
            settings=SETTINGS,
            hub=hub,
            router=router,
            secrets=Secrets(),
            clock=clock,
        )
        for name, hub in hubs.items()
    }
    routes = [
        Route(
            name="east-ucast",
            source="east",
            pattern=AddressPattern("!ucast.*@west"),
            destination="west",
            target=AddressTemplate("!ucast.{1}"),
        ),
        Route(
            name="east-bcast", source="east", pattern=AddressPattern("!bcast"), destination="west"
        ),
    ]
    router.replace_table(bind_routes(routes, dict(hubs)))

    def login(listener: str, identity: str) -> Peer:
        protocol = factories[listener].buildProtocol(IPv4Address("TCP", "192.0.2.1", 1))
        assert protocol is not None
        peer = Peer(protocol, StringTransport())
        protocol.makeConnection(peer.transport)
        peer.send(b"LOGIN %s open\n" % identity.encode())
        assert peer.received() == b"200\n"
        return peer

    alice = login("east", "alice")
    bob = login("west", "bob")
    alice.send(b"UCAST bob@west hi bob\nUCAST carol@west hi carol\nBCAST hi all\n")
    clock.advance(0)
    assert alice.received() == b"200\n404 no peer 'carol' is connected to west\n200\n"
    assert bob.received() == b"000 alice UCAST bob hi bob\n000 alice BCAST hi all\n"
