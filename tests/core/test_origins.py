"""What a consumer read is delivered under its origin, by direct and durable routes.

`gateway.core.origins`: a message with an `Origin` goes to a deduplicating
destination with its reader as the source of its ids and its offset plus
one as its id, so that reading it again (after a reconnection, a restart
or another node's takeover) stores nothing twice; a durable route keeps
the origin in its stream, and, into a fleet-wide destination, holds the
consumer's offset below what it committed and has not delivered
(`PendingOrigins`, `Router.unforwarded`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from zope.interface import implementer

from gateway.core.addressing import AddressPattern
from gateway.core.durable import DurableRoutes, route_stream_name
from gateway.core.interfaces import IDeduplicatingDestination
from gateway.core.log import LogStore
from gateway.core.message import Message, Origin, Outcome
from gateway.core.origins import PendingOrigins, deliver_once
from gateway.core.router import Route, Router, bind_routes
from gateway.protocols.stream.bridge import dead_letter_writer
from gateway.protocols.stream.mapping import (
    durable_entries,
    durable_entry,
    entry_from_message,
    message_from_entry,
)
from tests.core.test_durable import CountingDecoder, open_store, settle

READER = "msggateway.rabbit@in"


@implementer(IDeduplicatingDestination)
class Once:
    """A deduplicating destination that keeps each call; answers accepted, or later.

    Args:
        fleet_wide: What it says of itself.
        hold: Keep every answer until `answer_all`.
    """

    name = "far"

    def __init__(self, fleet_wide: bool = True, hold: bool = False) -> None:
        self.fleet_wide = fleet_wide
        self.hold = hold
        self.calls: list[tuple[list[str], str | None, list[int] | None, str | None]] = []
        """(message ids, producer, ids, reader) of each call; producer None for `deliver`."""
        self.waiting: list[tuple[int, Deferred[list[Outcome]]]] = []

    def _answer(self, count: int) -> Deferred[list[Outcome]]:
        if not self.hold:
            return succeed([Outcome.accepted()] * count)
        d: Deferred[list[Outcome]] = Deferred()
        self.waiting.append((count, d))
        return d

    def answer_all(self) -> None:
        """Accept every batch held."""
        waiting, self.waiting = self.waiting, []
        for count, d in waiting:
            d.callback([Outcome.accepted()] * count)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the call."""
        self.calls.append(([m.id for m in messages], None, None, None))
        return self._answer(len(messages))

    def deliver_once(
        self,
        messages: Sequence[Message],
        producer: str,
        ids: Sequence[int],
        reader: str | None = None,
    ) -> Deferred[list[Outcome]]:
        """Keep the call."""
        self.calls.append(([m.id for m in messages], producer, list(ids), reader))
        return self._answer(len(messages))


def read(offset: int, reader: str = READER) -> Message:
    """A message a consumer read at ``offset``."""
    return Message(
        body=b"m%d" % offset, address="out", id=f"m{offset}", origin=Origin(reader, offset)
    )


def plain(number: int) -> Message:
    """A message no consumer read."""
    return Message(body=b"p%d" % number, address="out", id=f"p{number}")


def test_a_readers_batch_goes_under_its_offsets_in_one_call() -> None:
    """One reader: one call, the reader as the ids' source, each offset plus one."""
    far = Once()
    done = deliver_once(far, "r", [read(4), read(5), read(9)])
    assert far.calls == [(["m4", "m5", "m9"], "r", [5, 6, 10], READER)]
    assert done.result == [Outcome.accepted()] * 3


def test_a_mixed_batch_is_split_by_reader_and_answered_in_place() -> None:
    """Each reader's part (and the rest, with the route's own ids) in its order; one answer."""
    far = Once()
    batch = [read(1), plain(1), read(7, "other@s"), read(2), plain(2)]
    done = deliver_once(far, "r", batch, [11, 12, 13, 14, 15])
    assert far.calls == [
        (["m1", "m2"], "r", [2, 3], READER),
        (["p1", "p2"], "r", [12, 15], None),
        (["m7"], "r", [8], "other@s"),
    ]
    assert done.result == [Outcome.accepted()] * 5


def test_without_origins_or_ids_it_is_a_plain_delivery() -> None:
    """Nothing read by a consumer and no ids of the route's own: `deliver`."""
    far = Once()
    deliver_once(far, "r", [plain(1), plain(2)])
    assert far.calls == [(["p1", "p2"], None, None, None)]


def test_cancelling_a_split_batch_cancels_its_parts() -> None:
    """The route's deadline reaches every part."""
    far = Once(hold=True)
    done = deliver_once(far, "r", [read(1), plain(1)], [1, 2])
    done.addErrback(lambda _: None)
    done.cancel()
    assert [d.called for _count, d in far.waiting] == [True, True]


def test_pending_origins_is_the_lowest_not_delivered() -> None:
    """The lowest offset of each reader among batches the forwarder is not past yet."""
    delivered = [-1]
    pending = PendingOrigins(lambda: delivered[0])
    pending.committed(9, [read(100), read(101)])
    pending.committed(19, [read(90), read(95)])  # read again: lower offsets later
    pending.committed(29, [read(102), read(7, "other@s")])
    assert pending.lowest(READER) == 90
    assert pending.lowest("other@s") == 7
    delivered[0] = 19
    assert pending.lowest(READER) == 102
    delivered[0] = 29
    assert pending.lowest(READER) is None
    assert pending.lowest("other@s") is None
    assert pending.lowest("nobody@s") is None
    pending.committed(39, [read(103)])  # after its window emptied
    assert pending.lowest(READER) == 103


def test_a_direct_route_delivers_what_a_consumer_read_under_its_origin() -> None:
    """The route's name is the producer, the reader the ids' source."""
    far = Once()
    route = Route(name="copy", source="rabbit", pattern=AddressPattern("#"), destination="far")
    router = Router(bind_routes([route], {"far": far}), Clock())
    results = router.dispatch("rabbit", [read(3), read(4)])
    assert far.calls == [(["m3", "m4"], "copy", [4, 5], READER)]
    assert results.result == [Outcome.accepted()] * 2
    router.dispatch("rabbit", [plain(1)])
    assert far.calls[-1] == (["p1"], None, None, None)
    assert router.unforwarded("rabbit", READER) is None


def test_the_origin_survives_the_durable_entry() -> None:
    """A durable route's entry keeps the origin; other entries do not carry it."""
    message = read(12)
    back = message_from_entry(durable_entry(message), stream="", timestamp=0, address_from_to=True)
    assert back == message
    assert back.origin == Origin(READER, 12)
    assert "x-gateway-origin" not in back.headers
    elsewhere = message_from_entry(entry_from_message(message), stream="out", timestamp=0)
    assert elsewhere.origin is None
    assert "x-gateway-origin" not in elsewhere.headers


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    """An opened log store, closed after the test."""
    log = open_store(tmp_path)
    yield log
    pytest_twisted.blockon(log.close())


def durable(store: LogStore, clock: Clock) -> DurableRoutes:
    """Durable routes as the service builds them (entries keep their origin)."""
    return DurableRoutes(
        store,
        clock,
        encode=durable_entries,
        decode=CountingDecoder(),
        dead_letter=lambda stream, route: dead_letter_writer(store, stream, route),
    )


ROUTE = Route(
    name="copy", source="rabbit", pattern=AddressPattern("#"), destination="far", durable=True
)


@pytest_twisted.ensureDeferred
async def test_a_durable_route_delivers_under_the_origin_and_holds_it_until_then(
    store: LogStore,
) -> None:
    """Committed and not delivered, a reader's offsets hold its consumer back; then not.

    After a restart the forwarder reads the entries back from the log, with
    their origin.
    """
    clock = Clock()
    far = Once(hold=True)
    routes = durable(store, clock)
    router = Router(bind_routes([ROUTE], {"far": far}, routes.delivery), clock)
    routes.start()
    router.dispatch("rabbit", [read(39)])
    await settle(store, clock)
    far.answer_all()
    await settle(store, clock)
    answered = router.dispatch("rabbit", [read(40), read(41)])
    await settle(store, clock)
    assert answered.called  # committed: accepted
    assert far.calls[-1] == (["m40", "m41"], "copy", [41, 42], READER)
    assert router.unforwarded("rabbit", READER) == 40
    assert router.unforwarded("elsewhere", READER) is None
    far.answer_all()
    await settle(store, clock)
    assert router.unforwarded("rabbit", READER) is None

    # Killed before its offset reached the disk: the forwarder reads it back.
    routes.stop()
    route_stream = store.get(route_stream_name(ROUTE.name))
    assert route_stream is not None
    route_stream.store_offset("msggateway.forwarder.copy", 0)
    again = Once()
    restarted = durable(store, clock)
    restarted.delivery(ROUTE, again)
    restarted.start()
    await settle(store, clock)
    assert again.calls == [(["m40", "m41"], "copy", [41, 42], READER)]
    restarted.stop()


@pytest_twisted.ensureDeferred
async def test_into_this_nodes_own_log_nothing_is_held(store: LogStore) -> None:
    """A destination only this process writes to: no node reads again what this one holds."""
    clock = Clock()
    far = Once(fleet_wide=False, hold=True)
    routes = durable(store, clock)
    router = Router(bind_routes([ROUTE], {"far": far}, routes.delivery), clock)
    routes.start()
    router.dispatch("rabbit", [read(1)])
    await settle(store, clock)
    assert far.calls == [(["m1"], "copy", [2], READER)]
    assert router.unforwarded("rabbit", READER) is None
    far.answer_all()
    routes.stop()
