"""A durable route into a local stream stores each message once, however often forwarded.

Forwarding from a route's log is at least once: after a crash the forwarder
resumes from its last stored offset and delivers again what it had
delivered since. The gateway's own stream destination deduplicates as the
log does for stream clients (`gateway.core.log.StreamLog.append` with a
reference and publishing ids): the route's name is the producer and each
message's log offset plus one its publishing id. The crash is played by
storing the forwarder's offset back, as a gateway killed before its offset
reached the disk would find it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from gateway.core.durable import producer_reference, route_stream_name
from gateway.core.log import LogStore
from gateway.protocols.stream.bridge import StreamDestination
from tests.core.test_durable import (
    REFERENCE,
    ROUTE,
    CountingDecoder,
    durable_routes,
    mail,
    open_store,
    settle,
)
from tests.core.test_log import read_all


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    """An opened log store, closed after the test."""
    log = open_store(tmp_path)
    yield log
    pytest_twisted.blockon(log.close())


def stored_ids(store: LogStore, name: str) -> list[str]:
    """The message ids in a local stream, in offset order."""
    from gateway.codecs import osiris
    from gateway.protocols.stream.mapping import message_from_entry

    stream = store.get(name)
    assert stream is not None
    return [
        message_from_entry(bytes(entry), stream=name, timestamp=0).id
        for chunk in read_all(stream)
        for entry in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])
    ]


@pytest_twisted.ensureDeferred
async def test_delivered_again_after_a_crash_it_is_stored_once(store: LogStore) -> None:
    """A forwarder resuming from an offset stored long ago adds nothing to the destination."""
    clock = Clock()
    destination = StreamDestination("streams", store)
    routes = durable_routes(store, clock, CountingDecoder())
    delivery = routes.delivery(ROUTE, destination)
    routes.start()
    for first in range(0, 9, 3):
        await delivery.deliver([mail(first), mail(first + 1), mail(first + 2)])
        await settle(store, clock)
    expected = [f"m{number}" for number in range(9)]
    assert stored_ids(store, "mail.far") == expected
    routes.stop()

    # Killed after delivering, before the forwarder's offset got to the disk:
    # the next start finds the offset of the first batch and resumes there.
    route_stream = store.get(route_stream_name(ROUTE.name))
    assert route_stream is not None
    route_stream.store_offset(REFERENCE, 2)
    await settle(store, clock)
    restarted = durable_routes(store, clock, CountingDecoder())
    delivery = restarted.delivery(ROUTE, destination)
    restarted.start()
    await settle(store, clock)
    forwarder = restarted.forwarders[ROUTE.name]
    assert forwarder.chunks_read == 2 and forwarder.delivered == 6
    assert stored_ids(store, "mail.far") == expected

    # Afterwards new messages are stored as before, once each.
    await delivery.deliver([mail(9)])
    await settle(store, clock)
    assert stored_ids(store, "mail.far") == [*expected, "m9"]
    destination_stream = store.get("mail.far")
    assert destination_stream is not None
    reference = producer_reference("msggateway", ROUTE.name)
    last = read_all(route_stream)[-1].next_chunk_id - 1  # m9's offset in the route's stream
    assert destination_stream.writer_sequence(reference) == last + 1
    restarted.stop()


def test_a_long_route_name_still_makes_a_reference_a_stream_can_keep() -> None:
    """References are at most 255 UTF-8 bytes; a longer one is a hash, stable and distinct."""
    long = "r" * 300
    reference = producer_reference("msggateway", long)
    assert len(reference.encode()) <= 255
    assert reference == producer_reference("msggateway", long)
    assert reference != producer_reference("msggateway", long + "x")
    assert producer_reference("msggateway", "r") == "msggateway.route.r"
