"""Stream allow-lists: `gateway.protocols.stream.server` with an ``authorize`` table.

The listener of `tests.protocols.test_stream_server` over a real log; its
factory is given an `Authorization`. Publishing requests (Create, Delete,
DeclarePublisher, QueryPublisherSequence) need the right to publish to the
stream, consuming ones (Subscribe, QueryOffset) the right to consume from
it; a refusal is answered with response code 16, Access refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_twisted
from twisted.internet.task import Clock

from gateway.codecs import stream as sp
from gateway.core.authorization import Authorization
from gateway.core.log import FsyncPolicy, LogStore
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.server import StreamServerFactory
from gateway.protocols.stream.settings import StreamListenerSettings
from tests.protocols.test_stream_server import (
    FIRST,
    LISTENER,
    LOG_START_SECONDS,
    SECRETS,
    Listener,
    Peer,
    _reactor,
    declare,
    subscribe,
)

ACCESS_REFUSED = sp.ResponseCode.ACCESS_REFUSED
AUTHZ = Authorization.from_lists(
    {
        "alice": (("orders", "orders.#"), ()),  # publishes, never consumes
        "guest": ((), ("orders",)),
    }
)


@pytest_twisted.async_yield_fixture
async def listener(tmp_path: Path) -> AsyncIterator[Listener]:
    """An open log in a temporary directory; closed (connections lost first) afterwards."""
    log_clock = Clock()
    log_clock.advance(LOG_START_SECONDS)
    store = LogStore(tmp_path / "log", _reactor(), fsync=FsyncPolicy.NEVER, clock=log_clock)
    store.open()
    harness = Listener(store=store, log_clock=log_clock)
    yield harness
    for peer in harness.peers:
        peer.lose()
    await store.close()


def _factory(listener: Listener, metrics: GatewayMetrics | None = None) -> StreamServerFactory:
    factory = StreamServerFactory(
        name=LISTENER,
        settings=StreamListenerSettings(guest=True, anonymous=True, heartbeat_seconds=0),
        store=listener.store,
        secrets=SECRETS,
        clock=listener.clock,
        metrics=metrics,
    )
    factory.authorization = AUTHZ
    return factory


def _opened(listener: Listener, factory: StreamServerFactory, user: bytes, password: bytes) -> Peer:
    peer = listener.connect(factory)
    frames = peer.authenticate(user, password)
    assert frames[-2].code == sp.ResponseCode.OK  # type: ignore[union-attr]
    peer.send(
        sp.Tune(frame_max=0, heartbeat=0), sp.Open(correlation_id=peer.next_id(), virtual_host="/")
    )
    (response,) = peer.frames()
    assert response.code == sp.ResponseCode.OK  # type: ignore[union-attr]
    return peer


def test_publisher_may_publish_but_not_subscribe(listener: Listener) -> None:
    """``alice`` creates and declares a publisher on orders, but Subscribe gets 16."""
    metrics = GatewayMetrics()
    factory = _factory(listener, metrics)
    alice = _opened(listener, factory, b"alice", b"wonderland")
    assert alice.code(sp.Create(correlation_id=alice.next_id(), stream="orders")) == 1
    assert alice.code(declare(alice, 1, "orders")) == 1
    assert alice.code(subscribe(alice, "orders", FIRST, 10)) == ACCESS_REFUSED
    answer = alice.ask(
        sp.QueryOffset(correlation_id=alice.next_id(), reference="r", stream="orders")
    )
    assert isinstance(answer, sp.QueryOffsetResponse) and answer.code == ACCESS_REFUSED
    assert alice.code(sp.Create(correlation_id=alice.next_id(), stream="payroll")) == ACCESS_REFUSED
    refused = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": LISTENER, "kind": "forbidden-consume"}
    )
    assert refused == 2
    assert not alice.closed


def test_consumer_may_subscribe_but_not_publish(listener: Listener) -> None:
    """``guest`` subscribes to orders; DeclarePublisher, Delete and the sequence query get 16."""
    listener.store.create("orders")
    factory = _factory(listener)
    guest = _opened(listener, factory, b"guest", b"guest")
    assert guest.code(subscribe(guest, "orders", FIRST, 10)) == 1
    assert guest.code(declare(guest, 1, "orders")) == ACCESS_REFUSED
    assert guest.code(sp.Delete(correlation_id=guest.next_id(), stream="orders")) == ACCESS_REFUSED
    answer = guest.ask(
        sp.QueryPublisherSequence(correlation_id=guest.next_id(), reference="r", stream="orders")
    )
    assert isinstance(answer, sp.QueryPublisherSequenceResponse)
    assert answer.code == ACCESS_REFUSED
    assert listener.store.get("orders") is not None


def test_anonymous_has_no_identity(listener: Listener) -> None:
    """ANONYMOUS authenticates nobody: under ``authorize`` it may do nothing."""
    listener.store.create("orders")
    peer = listener.connect(_factory(listener))
    peer.send(sp.SaslAuthenticate(correlation_id=1, mechanism="ANONYMOUS", data=None))
    peer.send(sp.Tune(frame_max=0, heartbeat=0), sp.Open(correlation_id=2, virtual_host="/"))
    peer.frames()
    assert peer.code(subscribe(peer, "orders", FIRST, 10)) == ACCESS_REFUSED
    assert peer.code(declare(peer, 1, "orders")) == ACCESS_REFUSED
