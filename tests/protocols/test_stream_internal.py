"""The stream listener, its route destination and the gateway's own streams.

See `gateway.core.internal`.

The listener of `tests.protocols.test_stream_server` over a real log that
holds a durable route's stream and the outcome records, as a gateway's does.
No client creates, deletes, publishes to or stores an offset in a
``msggateway.*`` stream, nor writes under one of the gateway's own
references anywhere; reading one needs a ``consume`` pattern naming
``msggateway.`` under the reader's own identity. Each refusal is answered
16 (Access refused), or dropped for StoreOffset, which has no answer;
counted as ``internal-stream`` and logged with the peer and the identity.

Routes into the listener's streams (`StreamDestination`) never write into
a ``msggateway.*`` stream, and count each write as a hop: a message written
`MAX_HOPS` times already is refused (a loop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_twisted
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.core.internal import (
    HOP_LIMIT,
    HOPS_HEADER,
    INTERNAL_STREAM,
    LOG_EVERY_SECONDS,
    MAX_HOPS,
)
from gateway.core.log import FsyncPolicy, LogStore
from gateway.core.message import Message, Status
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.bridge import StreamDestination
from gateway.protocols.stream.mapping import message_from_entry
from gateway.protocols.stream.server import StreamServerFactory
from gateway.protocols.stream.settings import StreamListenerSettings
from tests.protocols.test_stream_server import (
    FIRST,
    GUEST,
    LISTENER,
    LOG_START_SECONDS,
    Listener,
    Peer,
    _reactor,
    declare,
    delivered,
    subscribe,
)

ACCESS_REFUSED = sp.ResponseCode.ACCESS_REFUSED
OK = sp.ResponseCode.OK
ROUTE_STREAM = "msggateway.route.mail"
FORWARDER = "msggateway.forwarder.mail"
SECRETS = Secrets(logins={"ops": b"ops-secret", "app": b"app-secret", "alice": b"wonderland"})
GRANTS = Authorization.from_lists(
    {
        "ops": ((), ("msggateway.route.*",)),
        "app": (("#",), ("#",)),
        "*": ((), ("msggateway.#",)),  # every identity: not a grant of internal streams
        "alice": ((), ()),
    }
)


@pytest_twisted.async_yield_fixture
async def listener(tmp_path: Path) -> AsyncIterator[Listener]:
    """A log holding a route's stream (one chunk, its forwarder's offset) and the outcomes."""
    log_clock = Clock()
    log_clock.advance(LOG_START_SECONDS)
    store = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER, clock=log_clock)
    store.open()
    harness = Listener(store=store, log_clock=log_clock)
    route = await harness.fill(ROUTE_STREAM, [b"a private mail"])
    route.store_offset(FORWARDER, 0)
    await harness.fill("msggateway.outcomes", [b"{}"])
    await harness.fill("orders", [b"an order"])
    yield harness
    for peer in harness.peers:
        peer.lose()
    await store.close()


def _factory(
    listener: Listener,
    metrics: GatewayMetrics | None = None,
    authorization: Authorization | None = None,
) -> StreamServerFactory:
    factory = StreamServerFactory(
        name=LISTENER,
        settings=GUEST,
        store=listener.store,
        secrets=SECRETS,
        clock=listener.clock,
        metrics=metrics,
    )
    if authorization is not None:
        factory.authorization = authorization
    return factory


def _login(listener: Listener, factory: StreamServerFactory, user: bytes, password: bytes) -> Peer:
    peer = listener.connect(factory)
    peer.authenticate(user, password)
    peer.send(
        sp.Tune(frame_max=0, heartbeat=0), sp.Open(correlation_id=peer.next_id(), virtual_host="/")
    )
    (response,) = peer.frames()
    assert response.code == OK  # type: ignore[union-attr]
    return peer


def _codes(peer: Peer, stream: str, reference: str = "r") -> dict[str, int]:
    """Every command on ``stream`` that has an answer, with the answer's code."""
    answers: dict[str, int] = {}
    for name, request in (
        ("create", sp.Create(correlation_id=peer.next_id(), stream=stream)),
        ("delete", sp.Delete(correlation_id=peer.next_id(), stream=stream)),
        ("declare", declare(peer, 1, stream, reference)),
        (
            "sequence",
            sp.QueryPublisherSequence(
                correlation_id=peer.next_id(), reference=reference, stream=stream
            ),
        ),
        ("subscribe", subscribe(peer, stream, FIRST, 0, subscription_id=9)),
        (
            "query-offset",
            sp.QueryOffset(correlation_id=peer.next_id(), reference=FORWARDER, stream=stream),
        ),
        ("stats", sp.StreamStats(correlation_id=peer.next_id(), stream=stream)),
        (
            "resolve",
            sp.ResolveOffsetSpec(correlation_id=peer.next_id(), stream=stream, offset_spec=FIRST),
        ),
    ):
        answer = peer.ask(request)
        answers[name] = answer.code  # type: ignore[union-attr]
    return answers


def _internal_errors(metrics: GatewayMetrics) -> float:
    found = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": LISTENER, "kind": "internal-stream"}
    )
    return found or 0.0


def test_guest_touches_no_internal_stream(listener: Listener) -> None:
    """On an open listener every command on a ``msggateway.*`` stream is refused, and counted."""
    metrics = GatewayMetrics()
    guest = listener.opened(_factory(listener, metrics))
    for stream in (ROUTE_STREAM, "msggateway.outcomes", "msggateway.dead-letter"):
        assert set(_codes(guest, stream).values()) == {ACCESS_REFUSED}, stream
    guest.send(sp.StoreOffset(reference=FORWARDER, stream=ROUTE_STREAM, offset=10**6))
    assert guest.frames() == []  # StoreOffset has no answer
    route = listener.store.get(ROUTE_STREAM)
    assert route is not None and route.query_offset(FORWARDER) == 0
    assert listener.store.get("msggateway.outcomes") is not None
    assert listener.store.get("msggateway.dead-letter") is None  # not created
    assert _internal_errors(metrics) == 3 * 8 + 1
    assert not guest.closed


def test_metadata_answers_for_internal_streams(listener: Listener) -> None:
    """Metadata says a route's stream exists, as RabbitMQ's answers regardless of rights."""
    guest = listener.opened(_factory(listener))
    answer = guest.ask(sp.Metadata(correlation_id=guest.next_id(), streams=(ROUTE_STREAM,)))
    assert isinstance(answer, sp.MetadataResponse)
    assert [meta.code for meta in answer.streams] == [OK]


def test_the_gateways_references_are_refused_on_client_streams(listener: Listener) -> None:
    """Writing as a route's publisher or storing a feed's offset in ``orders`` is refused.

    Reading them (QueryOffset) is not; and an upstream's default reference
    (``msggateway.NAME``) stays usable, so one gateway's upstream can
    publish to another's listener.
    """
    metrics = GatewayMetrics()
    guest = listener.opened(_factory(listener, metrics))
    for reference in ("msggateway.route.mail", "msggateway.forwarder.mail"):
        assert guest.code(declare(guest, 1, "orders", reference)) == ACCESS_REFUSED
        answer = guest.ask(
            sp.QueryPublisherSequence(
                correlation_id=guest.next_id(), reference=reference, stream="orders"
            )
        )
        assert answer.code == ACCESS_REFUSED  # type: ignore[union-attr]
    guest.send(sp.StoreOffset(reference="msggateway.routes.streams", stream="orders", offset=9))
    orders = listener.store.get("orders")
    assert orders is not None and orders.query_offset("msggateway.routes.streams") is None
    answer = guest.ask(
        sp.QueryOffset(
            correlation_id=guest.next_id(), reference="msggateway.routes.streams", stream="orders"
        )
    )
    assert answer.code == sp.ResponseCode.NO_OFFSET  # type: ignore[union-attr]
    assert guest.code(declare(guest, 2, "orders", "msggateway.gw1")) == OK
    assert _internal_errors(metrics) == 5


def test_an_explicit_grant_reads_and_only_reads(listener: Listener) -> None:
    """``ops`` (``msggateway.route.*``) reads the route's stream; ``#`` and ``*`` grant nothing."""
    factory = _factory(listener, authorization=GRANTS)
    ops = _login(listener, factory, b"ops", b"ops-secret")
    codes = _codes(ops, ROUTE_STREAM, "ops")
    assert codes == {
        "create": ACCESS_REFUSED,
        "delete": ACCESS_REFUSED,
        "declare": ACCESS_REFUSED,
        "sequence": ACCESS_REFUSED,
        "subscribe": OK,
        "query-offset": OK,
        "stats": OK,
        "resolve": OK,
    }
    ops.send(sp.Credit(subscription_id=9, credit=1))
    assert delivered(ops.frames()) == [0]  # the mail, as stored
    ops.send(sp.StoreOffset(reference=FORWARDER, stream=ROUTE_STREAM, offset=10**6))
    route = listener.store.get(ROUTE_STREAM)
    assert route is not None and route.query_offset(FORWARDER) == 0
    assert set(_codes(ops, "msggateway.outcomes").values()) == {ACCESS_REFUSED}  # not granted

    for user, password in ((b"app", b"app-secret"), (b"alice", b"wonderland")):
        peer = _login(listener, factory, user, password)
        assert peer.code(subscribe(peer, ROUTE_STREAM, FIRST, 0)) == ACCESS_REFUSED, user
        assert peer.code(subscribe(peer, "orders", FIRST, 0, subscription_id=2)) == (
            OK if user == b"app" else ACCESS_REFUSED
        )


def test_refusals_are_logged_with_peer_and_identity(listener: Listener) -> None:
    """One line per refusal: listener, identity, peer, the command and the stream."""
    guest = listener.opened(_factory(listener))
    with capturedLogs() as events:
        assert guest.code(sp.Delete(correlation_id=guest.next_id(), stream=ROUTE_STREAM)) == (
            ACCESS_REFUSED
        )
    [event] = [e for e in events if "may not" in e.get("log_format", "")]
    assert event["listener"] == LISTENER
    assert event["identity"] == "guest"
    assert event["peer"] == "127.0.0.1:40404"
    assert event["what"] == f"delete {ROUTE_STREAM!r}"


def test_anonymous_reads_no_internal_stream(listener: Listener) -> None:
    """ANONYMOUS (no identity) is refused like anyone, even on a listener with grants."""
    factory = StreamServerFactory(
        name=LISTENER,
        settings=StreamListenerSettings(guest=True, anonymous=True, heartbeat_seconds=0),
        store=listener.store,
        secrets=SECRETS,
        clock=listener.clock,
    )
    factory.authorization = GRANTS
    peer = listener.connect(factory)
    peer.send(sp.SaslAuthenticate(correlation_id=1, mechanism="ANONYMOUS", data=None))
    peer.send(sp.Tune(frame_max=0, heartbeat=0), sp.Open(correlation_id=2, virtual_host="/"))
    peer.frames()
    assert peer.code(subscribe(peer, ROUTE_STREAM, FIRST, 1)) == ACCESS_REFUSED


# --- routes into the log --------------------------------------------------------------------


def _entries(listener: Listener, name: str) -> list[Message]:
    stream = listener.store.get(name)
    assert stream is not None
    return [
        message_from_entry(bytes(entry), stream=name, timestamp=0.0)
        for chunk in stream.read_chunks(0, 100, 1 << 20)
        for entry in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])
    ]


@pytest_twisted.ensureDeferred
async def test_routes_do_not_deliver_into_internal_streams(listener: Listener) -> None:
    """A route's message for ``msggateway.*`` is rejected for good; its batch's others go on."""
    counted: list[str] = []
    destination = StreamDestination(LISTENER, listener.store, listener.clock, counted.append)
    batch = [
        Message(body=b"loop", address=ROUTE_STREAM),
        Message(body=b"ok", address="orders"),
        Message(body=b"records", address="msggateway.outcomes"),
        Message(body=b"dead", address="msggateway.dead-letter"),
    ]
    with capturedLogs() as events:
        outcomes = await destination.deliver(batch)
        again = await destination.deliver_once(batch[:1], "mail", [7])
    assert [outcome.status for outcome in outcomes] == [
        Status.REJECTED,
        Status.ACCEPTED,
        Status.REJECTED,
        Status.REJECTED,
    ]
    assert {outcomes[i].code for i in (0, 2, 3)} == {INTERNAL_STREAM}
    assert "internal namespace" in outcomes[0].reason
    assert again[0].code == INTERNAL_STREAM
    assert [m.body for m in _entries(listener, ROUTE_STREAM)] == [b"a private mail"]
    assert listener.store.get("msggateway.dead-letter") is None
    assert counted == [INTERNAL_STREAM] * 4
    assert destination.refused[INTERNAL_STREAM].total == 4
    # The first refusal is logged; those that follow within the interval wait for a later line.
    assert len([e for e in events if e.get("stream") == ROUTE_STREAM]) == 1


@pytest_twisted.ensureDeferred
async def test_each_write_counts_a_hop_and_a_loop_stops(listener: Listener) -> None:
    """Written with its hop count plus one; at `MAX_HOPS` the message is refused instead.

    In a batch, only the looping messages are refused (and their ids
    skipped); the others are stored with theirs.
    """
    counted: list[str] = []
    destination = StreamDestination(LISTENER, listener.store, listener.clock, counted.append)
    fresh = Message(body=b"fresh", address="echo", id="f")
    last = Message(body=b"last", address="echo", id="l", headers={HOPS_HEADER: MAX_HOPS - 1})
    looped = Message(body=b"looped", address="echo", id="x", headers={HOPS_HEADER: MAX_HOPS})
    with capturedLogs() as events:
        outcomes = await destination.deliver_once([fresh, looped, last], "r", [1, 2, 3])
        listener.clock.advance(LOG_EVERY_SECONDS)
        alone = await destination.deliver([looped])
    assert [outcome.status for outcome in outcomes] == [
        Status.ACCEPTED,
        Status.REJECTED,
        Status.ACCEPTED,
    ]
    assert outcomes[1].code == alone[0].code == HOP_LIMIT
    stored = _entries(listener, "echo")
    assert [(m.body, m.headers[HOPS_HEADER]) for m in stored] == [
        (b"fresh", 1),
        (b"last", MAX_HOPS),
    ]
    echo = listener.store.get("echo")
    assert echo is not None and echo.writer_sequence("msggateway.route.r") == 3
    assert counted == [HOP_LIMIT] * 2
    assert len([e for e in events if "hops" in e]) == 2  # one per interval


@pytest_twisted.ensureDeferred
async def test_a_batch_of_loops_only_is_refused_without_an_append(listener: Listener) -> None:
    """Every message over the limit: all refused, nothing written, no stream created."""
    destination = StreamDestination(LISTENER, listener.store)
    looped = Message(body=b"x", address="new", headers={HOPS_HEADER: MAX_HOPS})
    outcomes = await destination.deliver([looped, looped])
    assert [outcome.code for outcome in outcomes] == [HOP_LIMIT, HOP_LIMIT]
    assert listener.store.get("new") is None
