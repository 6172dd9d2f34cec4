"""A durable route's forwarder publishing to RabbitMQ: each message stored once.

`StreamUpstream.deliver_once` (`gateway.protocols.stream.publishing`)
publishes through a publisher per stream whose reference names the route
and whose publishing ids are the ones the forwarder gives (the route log's
offsets plus one), so that the broker drops what a restarted gateway sends
again. The node is played in memory as in `tests.protocols.test_stream_client`.
"""

from __future__ import annotations

from zope.interface.verify import verifyObject

from gateway.codecs import stream as sp
from gateway.core.interfaces import IDeduplicatingDestination
from gateway.core.message import Message, Outcome, Status
from tests.protocols.test_stream_client import NODE, UPSTREAM, World, ids_of, tracked

ROUTE_REFERENCE = f"msggateway.{UPSTREAM}.{NODE}.route.r"
"""The upstream's reference (with the node id), then the route."""


def once(world: World, names: list[str], ids: list[int]) -> list[list[Outcome] | object]:
    """Deliver messages ``names`` as route ``r``'s forwarder would, with ``ids``."""
    messages = [Message(body=b"hello", address="anything", id=name) for name in names]
    return tracked(world.upstream.deliver_once(messages, "r", ids))


def statuses(results: list[object]) -> list[Status] | None:
    """The statuses of a batch's outcomes, or None while it is unanswered."""
    if not results:
        return None
    [outcomes] = results
    assert isinstance(outcomes, list)
    return [outcome.status for outcome in outcomes]


def test_the_upstream_deduplicates() -> None:
    """The stream upstream says it can store each message once."""
    assert verifyObject(IDeduplicatingDestination, World().upstream)


def test_a_routes_messages_go_under_its_reference_with_its_ids() -> None:
    """The route's own publisher, with the forwarder's ids rather than a sequence of its own."""
    world = World()
    node = world.open()
    results = once(world, ["m1", "m2", "m3"], [11, 12, 13])
    declared = node.declare()
    assert declared.reference == ROUTE_REFERENCE
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [11, 12, 13]
    node.confirm(declared.publisher_id, 11, 12, 13)
    assert statuses(results) == [Status.ACCEPTED] * 3


def test_after_a_restart_what_the_broker_has_is_sent_for_it_to_drop() -> None:
    """Ids up to the broker's sequence go out unchanged: the broker confirms and drops them.

    This is the crash case: the forwarder resumes a chunk back and the
    broker already stored its first messages under these very ids.
    """
    world = World()
    node = world.open()
    results = once(world, ["m5", "m6", "m7"], [5, 6, 7])
    declared = node.declare(sequence=6)
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [5, 6, 7]
    node.confirm(declared.publisher_id, 5, 6, 7)
    assert statuses(results) == [Status.ACCEPTED] * 3


def test_in_flight_on_a_lost_connection_is_settled_by_the_sequence() -> None:
    """After a reconnect, ids the broker stored are accepted; the rest go again, same ids."""
    world = World()
    node = world.open()
    results = once(world, ["m1", "m2", "m3"], [1, 2, 3])
    node.declare()
    assert ids_of(node) == ["m1", "m2", "m3"]
    node.lose()
    world.reactor.advance(0.5)
    again = world.open(sequence=2)  # the broker stored ids 1 and 2, unconfirmed
    assert statuses(results) is None
    [frame] = again.of(sp.Publish)
    assert list(frame.publishing_ids) == [3]
    again.confirm(frame.publisher_id, 3)
    assert statuses(results) == [Status.ACCEPTED] * 3


def test_a_refused_message_below_a_stored_one_goes_through_the_plain_publisher() -> None:
    """The broker would drop id 2 once id 3 is stored: sent again under the upstream's reference."""
    world = World()
    node = world.open()
    first = once(world, ["m1", "m2", "m3"], [1, 2, 3])
    declared = node.declare()
    node.of(sp.Publish)
    node.say(sp.PublishError(publisher_id=declared.publisher_id, publishing_ids=[2], codes=[6]))
    node.confirm(declared.publisher_id, 1, 3)
    assert statuses(first) == [Status.ACCEPTED, Status.RETRY, Status.ACCEPTED]
    second = once(world, ["m2"], [2])
    plain = node.declare()
    assert plain.reference == f"msggateway.{UPSTREAM}.{NODE}"
    assert plain.publisher_id != declared.publisher_id
    [frame] = node.of(sp.Publish)
    assert frame.publisher_id == plain.publisher_id
    assert list(frame.publishing_ids) == [1]
    node.confirm(plain.publisher_id, 1)
    assert statuses(second) == [Status.ACCEPTED]


def test_a_confirmed_id_delivered_again_goes_under_its_id_for_the_broker_to_drop() -> None:
    """An id below the next one that the broker confirmed goes again under the same reference.

    What a consumer reads again (or a durable route commits twice) comes
    with ids already confirmed: the broker confirms them without storing
    them twice, where the upstream's own publisher would store a copy.
    """
    world = World()
    node = world.open()
    first = once(world, ["m1", "m2", "m3"], [1, 2, 3])
    declared = node.declare()
    node.of(sp.Publish)
    node.confirm(declared.publisher_id, 1, 2, 3)
    assert statuses(first) == [Status.ACCEPTED] * 3
    again = once(world, ["m2", "m3"], [2, 3])
    [frame] = node.of(sp.Publish)
    assert frame.publisher_id == declared.publisher_id
    assert list(frame.publishing_ids) == [2, 3]
    node.confirm(declared.publisher_id, 2, 3)
    assert statuses(again) == [Status.ACCEPTED] * 2


def test_an_id_still_on_its_way_delivered_again_goes_through_the_plain_publisher() -> None:
    """A second copy of an id not confirmed yet is not sent under it (its first may fail)."""
    world = World()
    node = world.open()
    once(world, ["m1", "m2"], [1, 2])
    declared = node.declare()
    node.of(sp.Publish)
    again = once(world, ["m2"], [2])
    plain = node.declare()
    assert plain.reference == f"msggateway.{UPSTREAM}.{NODE}"
    [frame] = node.of(sp.Publish)
    assert frame.publisher_id == plain.publisher_id
    node.confirm(plain.publisher_id, 1)
    assert statuses(again) == [Status.ACCEPTED]
    assert declared.publisher_id != plain.publisher_id


def test_a_cancelled_id_is_a_hole_delivered_again_through_the_plain_publisher() -> None:
    """Cancelled while queued (never sent), while later ids went: its copy goes plain."""
    world = World()
    node = world.open()
    cancelled = world.upstream.deliver_once(
        [Message(body=b"x", address="anything", id="m1")], "r", [1]
    )
    cancelled.addErrback(lambda _: None)
    cancelled.cancel()
    later = once(world, ["m2"], [2])
    declared = node.declare()
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [2]
    node.confirm(declared.publisher_id, 2)
    assert statuses(later) == [Status.ACCEPTED]
    again = once(world, ["m1"], [1])
    plain = node.declare()
    [frame] = node.of(sp.Publish)
    assert frame.publisher_id == plain.publisher_id
    node.confirm(plain.publisher_id, 1)
    assert statuses(again) == [Status.ACCEPTED]


def test_what_a_consumer_read_goes_under_the_readers_reference_without_the_node() -> None:
    """With a reader, the reference is ``<reader>.route.<route>``: the same on every node."""
    world = World()
    node = world.open()
    messages = [Message(body=b"hello", address="anything", id="m")]
    results = tracked(world.upstream.deliver_once(messages, "r", [8], reader="msggateway.in@s"))
    declared = node.declare()
    assert declared.reference == "msggateway.in@s.route.r"
    [frame] = node.of(sp.Publish)
    assert list(frame.publishing_ids) == [8]
    node.confirm(declared.publisher_id, 8)
    assert statuses(results) == [Status.ACCEPTED]
