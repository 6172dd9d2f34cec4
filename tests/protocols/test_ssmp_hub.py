"""`Hub.deliver`: the SSMP hub as a route destination, a batch at a time.

The hub of `tests.protocols.test_ssmp_server` (real connections on
`StringTransport`, a `Clock`), given batches as a route would give them: one
outcome per message in one list, one write per peer per batch, and the
address forms ``!ucast.<peer>`` and ``!bcast`` delivered as UCAST and BCAST
events.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import ssmp
from gateway.core.message import Message, Outcome, Status
from gateway.protocols.ssmp.mapping import EventLines, event_line
from tests.protocols.test_ssmp_server import CountingTransport, HubWorld, Peer, fired


@pytest.fixture
def world() -> HubWorld:
    """A hub offering ``open`` and anonymous login, with no routes."""
    return HubWorld()


def counted_subscriber(world: HubWorld, identity: str, *topics: str) -> Peer:
    """Log in on a `CountingTransport` and subscribe; every response is consumed."""
    peer = world.login(identity, transport=CountingTransport())
    peer.send(b"".join(b"SUBSCRIBE %s\n" % topic.encode() for topic in topics))
    assert peer.received() == b"200\n" * len(topics)
    return peer


def writes(peer: Peer) -> int:
    """How many writes reached the peer's transport so far."""
    transport = peer.transport
    assert isinstance(transport, CountingTransport)
    return transport.writes


def news(body: bytes, address: str = "news", sender: str | None = "remote") -> Message:
    """A routed message."""
    return Message(body=body, address=address, sender=sender)


# --- batches ------------------------------------------------------------------------------


def test_batch_to_one_topic_is_one_write_per_subscriber(world: HubWorld) -> None:
    """N messages to a topic with S subscribers: N outcomes in one list, exactly S writes."""
    subscribers = [counted_subscriber(world, f"s{i}", "news") for i in range(3)]
    before = [writes(peer) for peer in subscribers]
    sent = world.sample("msggateway_messages_sent_total")

    outcomes = world.hub.deliver([news(b"m%d" % i) for i in range(50)])
    assert fired(outcomes) == [Outcome.accepted()] * 50
    world.clock.advance(0)

    expected = b"".join(b"000 remote MCAST news m%d\n" % i for i in range(50))
    for peer, written in zip(subscribers, before, strict=True):
        assert writes(peer) == written + 1
        assert peer.received() == expected
    assert world.sample("msggateway_messages_sent_total") == sent + 150  # lines, not writes


def test_batch_with_partial_refusal_answers_each(world: HubWorld) -> None:
    """Each message has its own outcome; the refused ones reach nobody, the rest in one write."""
    bob = counted_subscriber(world, "bob", "news")
    before = writes(bob)
    batch = [
        news(b"first"),
        news(b"two\nlines"),
        news(b"second"),
        news(b""),
        news(b"x", address="bad topic"),
        news(b"third"),
    ]
    outcomes = fired(world.hub.deliver(batch))
    assert [outcome.status for outcome in outcomes] == [
        Status.ACCEPTED,
        Status.REJECTED,
        Status.ACCEPTED,
        Status.REJECTED,
        Status.REJECTED,
        Status.ACCEPTED,
    ]
    assert outcomes[1].reason == "SSMP cannot carry a message body containing LF"
    assert outcomes[3].reason == "SSMP cannot carry an empty message body"
    assert "not a valid SSMP topic" in outcomes[4].reason
    world.clock.advance(0)
    assert writes(bob) == before + 1
    assert bob.received() == (
        b"000 remote MCAST news first\n000 remote MCAST news second\n000 remote MCAST news third\n"
    )


def test_batch_keeps_message_order_across_topics(world: HubWorld) -> None:
    """A subscriber of two topics gets a batch's events in message order, in one write."""
    both = counted_subscriber(world, "both", "a", "b")
    only_a = counted_subscriber(world, "only-a", "a")
    before = writes(both), writes(only_a)
    batch = [news(b"1", "a"), news(b"2", "a"), news(b"3", "b"), news(b"4", "a")]
    assert fired(world.hub.deliver(batch)) == [Outcome.accepted()] * 4
    world.clock.advance(0)
    assert (writes(both), writes(only_a)) == (before[0] + 1, before[1] + 1)
    assert both.received() == (
        b"000 remote MCAST a 1\n000 remote MCAST a 2\n000 remote MCAST b 3\n000 remote MCAST a 4\n"
    )
    assert only_a.received() == (
        b"000 remote MCAST a 1\n000 remote MCAST a 2\n000 remote MCAST a 4\n"
    )


def test_empty_batch(world: HubWorld) -> None:
    """An empty batch answers an empty list and schedules nothing."""
    assert fired(world.hub.deliver([])) == []
    assert world.clock.getDelayedCalls() == []


def test_a_batch_is_written_when_delivered(world: HubWorld) -> None:
    """Each batch is one write per subscriber, made before its outcomes are given.

    The hub must know whether the write congested a subscriber before it
    answers (a congested one delays the answer until it drained).
    """
    bob = counted_subscriber(world, "bob", "news")
    before = writes(bob)
    fired(world.hub.deliver([news(b"1"), news(b"2")]))
    assert writes(bob) == before + 1
    fired(world.hub.deliver([news(b"3")]))
    assert writes(bob) == before + 2
    assert bob.received() == (
        b"000 remote MCAST news 1\n000 remote MCAST news 2\n000 remote MCAST news 3\n"
    )


# --- !ucast.<peer> and !bcast ----------------------------------------------------------------


def test_ucast_form_is_a_ucast_event_to_the_peer(world: HubWorld) -> None:
    """``!ucast.bob`` reaches bob alone as ``000 <sender> UCAST bob <body>``."""
    bob = world.login("bob")
    carol = world.subscriber("carol", "news")
    outcomes = world.hub.deliver([news(b"psst", address="!ucast.bob", sender="alice@far")])
    assert fired(outcomes) == [Outcome.accepted()]
    world.clock.advance(0)
    assert bob.received() == b"000 alice@far UCAST bob psst\n"
    assert carol.received() == b""


def test_ucast_form_to_an_absent_peer_is_rejected_404(world: HubWorld) -> None:
    """A UCAST to a peer not connected here is rejected with code 404; nothing is written."""
    bob = world.login("bob")
    [outcome] = fired(world.hub.deliver([news(b"hi", address="!ucast.nobody")]))
    assert outcome.status is Status.REJECTED
    assert outcome.code == "404"
    assert outcome.reason == "no peer 'nobody' is connected to hub"
    world.clock.advance(0)
    assert bob.received() == b""


def test_ucast_form_to_the_anonymous_id_is_rejected(world: HubWorld) -> None:
    """Anonymous peers cannot receive UCAST: ``!ucast..`` is never delivered (404)."""
    anonymous = world.login(".")
    [outcome] = fired(world.hub.deliver([news(b"hi", address="!ucast..")]))
    assert outcome.code == "404"
    world.clock.advance(0)
    assert anonymous.received() == b""


@pytest.mark.parametrize("address", ["!ucast.", "!ucast.bad peer", "!ucast.caf\u00e9"])
def test_ucast_form_without_a_valid_peer_id_is_rejected(world: HubWorld, address: str) -> None:
    """A UCAST address whose peer part is no SSMP id is rejected, without a code."""
    [outcome] = fired(world.hub.deliver([news(b"hi", address=address)]))
    assert outcome.status is Status.REJECTED
    assert outcome.code is None
    assert "not name a valid SSMP peer id" in outcome.reason


def test_ucast_event_too_long_is_rejected(world: HubWorld) -> None:
    """A UCAST whose event would pass 1,024 bytes is rejected; one that just fits is delivered."""
    bob = world.login("bob")
    fixed = len(b"000 remote UCAST bob \n")
    fits = b"x" * (ssmp.MAX_LINE_BYTES - fixed)
    outcomes = fired(
        world.hub.deliver(
            [news(fits, address="!ucast.bob"), news(fits + b"y", address="!ucast.bob")]
        )
    )
    assert outcomes[0].is_accepted
    assert outcomes[1].status is Status.REJECTED
    assert "limit" in outcomes[1].reason
    world.clock.advance(0)
    assert bob.received() == b"000 remote UCAST bob " + fits + b"\n"


def test_bcast_form_reaches_every_named_peer_but_the_senders_namesake(world: HubWorld) -> None:
    """``!bcast`` reaches each named peer once, subscribed or not, but not the sender's namesake."""
    alice = world.subscriber("alice", "news")
    bob = world.subscriber("bob", "news", "sport")
    carol = world.login("carol")  # no subscriptions
    anonymous = world.login(".")
    outcomes = world.hub.deliver([news(b"hello all", address="!bcast", sender="alice")])
    assert fired(outcomes) == [Outcome.accepted()]
    world.clock.advance(0)
    assert bob.received() == b"000 alice BCAST hello all\n"
    assert carol.received() == b"000 alice BCAST hello all\n"
    assert alice.received() == b""
    assert anonymous.received() == b""


def test_bcast_form_without_peers_is_accepted(world: HubWorld) -> None:
    """Like MCAST, a BCAST that reaches nobody is accepted (SSMP is best effort)."""
    [outcome] = fired(world.hub.deliver([news(b"anyone?", address="!bcast", sender=None)]))
    assert outcome.is_accepted


def test_unknown_bang_form_is_rejected(world: HubWorld) -> None:
    """Another ``!`` address is no SSMP topic (``!`` is not an id character): rejected."""
    [outcome] = fired(world.hub.deliver([news(b"hi", address="!multicast.news")]))
    assert outcome.status is Status.REJECTED
    assert "not a valid SSMP topic" in outcome.reason


def test_mixed_batch_keeps_order_in_one_write(world: HubWorld) -> None:
    """MCAST, UCAST and BCAST events of one batch reach a peer in message order, in one write."""
    bob = counted_subscriber(world, "bob", "news")
    before = writes(bob)
    batch = [
        news(b"m1"),
        news(b"u", address="!ucast.bob"),
        news(b"m2"),
        news(b"b", address="!bcast"),
        news(b"m3"),
    ]
    assert fired(world.hub.deliver(batch)) == [Outcome.accepted()] * 5
    world.clock.advance(0)
    assert writes(bob) == before + 1
    assert bob.received() == (
        b"000 remote MCAST news m1\n"
        b"000 remote UCAST bob u\n"
        b"000 remote MCAST news m2\n"
        b"000 remote BCAST b\n"
        b"000 remote MCAST news m3\n"
    )


def test_recipients_in_several_forms(world: HubWorld) -> None:
    """A message's recipients may mix topics and peers; one absent peer refuses it whole."""
    bob = world.login("bob")
    carol = world.subscriber("carol", "news")
    both = Message(body=b"hi", address="news", recipients=("news", "!ucast.bob"), sender="x")
    [outcome] = fired(world.hub.deliver([both]))
    assert outcome.is_accepted
    world.clock.advance(0)
    assert bob.received() == b"000 x UCAST bob hi\n"
    assert carol.received() == b"000 x MCAST news hi\n"

    absent = Message(body=b"hi", address="news", recipients=("news", "!ucast.nobody"), sender="x")
    [outcome] = fired(world.hub.deliver([absent]))
    assert outcome.code == "404"
    world.clock.advance(0)
    assert carol.received() == b""


@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, "alice", "bench@example.com", "not an id", ""]),
            st.sampled_from(["news", "mail", "bad topic", "", "t" * 1020]),
            st.sampled_from([b"hello", b"", b"two\nlines", b"p" * 1000]),
        ),
        max_size=12,
    )
)
def test_a_batchs_event_lines_are_each_messages_own(
    batch: list[tuple[str | None, str, bytes]],
) -> None:
    """Sharing an event's head over a batch (`EventLines`) never changes a line nor a refusal."""
    lines = EventLines()
    for sender, topic, body in batch:
        message = Message(body=body, address=topic, sender=sender)
        assert lines.line(message, topic) == event_line(message, topic)
