"""The stream listener as one node of a fleet: `gateway.protocols.stream.relay` and `.owner`.

Two nodes, each a `StreamServerFactory` over its own log in a temporary
directory. Node ``a`` is the one the client talks to (a `Peer` on a
`StringTransport`, as in tests/protocols/test_stream_server.py); node ``b``
listens on 127.0.0.1 port 0 for real, so that ``a``'s relays
(`OwnerConnection`) reach it over TCP. Who owns which stream is a fixed
table (`Placement`), not the fleet's rule (tests/fleet/test_streams.py).
The behaviour checked is docs/fleet.rst's "Streams across nodes".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import Clock

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.log import FsyncPolicy, LogStore, StreamLog
from gateway.protocols.stream.relay import StreamFleet, connect_tcp
from gateway.protocols.stream.server import StreamServerFactory
from tests.doubles import NO_LOGIN_WAIT
from tests.protocols.test_stream_server import (
    GUEST,
    LISTENER,
    SECRETS,
    Peer,
    declare,
    publish,
    subscribe,
)

NOT_AVAILABLE = 6
FIRST = sp.OffsetSpec(kind=sp.OffsetKind.FIRST)


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


class Placement:
    """A fixed owner table: streams not named are this node's."""

    def __init__(self, node: str, owners: dict[str, str | None]) -> None:
        self.node = node
        self.owners = owners
        self.addresses: dict[str, tuple[str, int]] = {}
        self._callbacks: list[Callable[[], None]] = []

    def owner(self, stream: str) -> str | None:
        """The table's owner of ``stream``."""
        return self.owners.get(stream, self.node)

    def address(self, node: str, listener: str) -> tuple[str, int] | None:
        """The address kept for ``node``."""
        return self.addresses.get(node)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Keep ``callback`` for `moved`."""
        self._callbacks.append(callback)

    def moved(self, **owners: str | None) -> None:
        """Change owners, and say so."""
        self.owners.update(owners)
        for callback in self._callbacks:
            callback()


class Nodes:
    """Node ``a`` (the client's) and node ``b`` (listening on TCP), each with its log."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.stores = {
            name: LogStore(tmp_path / name, _reactor(), fsync=FsyncPolicy.NEVER)
            for name in ("a", "b")
        }
        for store in self.stores.values():
            store.open()
        self.a = self._factory("a")
        self.b = self._factory("b")
        self.placement = Placement("a", {"far": "b", "far-missing": "b", "far-new": "b"})
        self.a.join_fleet(StreamFleet(self.placement, connect_tcp(_reactor())))
        self.port: IListeningPort = _reactor().listenTCP(0, self.b, interface="127.0.0.1")
        self.placement.addresses["b"] = ("127.0.0.1", self.port.getHost().port)
        self.peers: list[Peer] = []

    def _factory(self, node: str) -> StreamServerFactory:
        factory = StreamServerFactory(
            name=LISTENER,
            settings=GUEST,
            store=self.stores[node],
            secrets=SECRETS,
            clock=self.clock,
        )
        factory.login_failures = NO_LOGIN_WAIT
        factory.listening_on(IPv4Address("TCP", "127.0.0.1", 5552 if node == "a" else 5553))
        return factory

    def client(self) -> Peer:
        """A client of node ``a``, through Open."""
        peer = Peer(self.a)
        self.peers.append(peer)
        response = peer.open()
        assert isinstance(response, sp.OpenResponse) and response.code == 1
        return peer

    async def close(self) -> None:
        """Lose the clients, stop listening, close the logs."""
        for peer in self.peers:
            peer.lose()
        for connection in list(self.b.connections):
            assert connection.transport is not None
            connection.transport.loseConnection()
        stopped = self.port.stopListening()
        if stopped is not None:
            await stopped
        for store in self.stores.values():
            await store.close()


@pytest_twisted.async_yield_fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Nodes]:
    """Two nodes; everything closed afterwards."""
    harness = Nodes(tmp_path)
    yield harness
    await harness.close()


def entries(stream: StreamLog) -> list[bytes]:
    """Every message stored in ``stream``."""
    return [
        bytes(message)
        for chunk in stream.read_chunks(0, 100, 1 << 20)
        for message in osiris.iter_entries(chunk.payload[osiris.HEADER_BYTES :])
    ]


async def answer_to(peer: Peer, event: sp.Event) -> sp.Event:
    """Send a relayed request; the next frame (its answer)."""
    peer.send(event)
    return await peer.next_frame()


@pytest_twisted.ensureDeferred
async def test_metadata_names_the_owner_as_leader(nodes: Nodes) -> None:
    """Metadata on any node names the owner's advertised address; the owner says what exists."""
    nodes.stores["b"].create("far")
    nodes.stores["a"].create("near")
    peer = nodes.client()
    response = await answer_to(
        peer, sp.Metadata(correlation_id=7, streams=("far", "near", "far-missing"))
    )
    port = nodes.port.getHost().port
    assert response == sp.MetadataResponse(
        correlation_id=7,
        brokers=(
            sp.Broker(reference=0, host="127.0.0.1", port=5552),
            sp.Broker(reference=1, host="127.0.0.1", port=port),
        ),
        streams=(
            sp.StreamMetadata(stream="far", code=1, leader=1, replicas=()),
            sp.StreamMetadata(stream="near", code=1, leader=0, replicas=()),
            sp.StreamMetadata(stream="far-missing", code=2, leader=sp.NO_LEADER, replicas=()),
        ),
    )


@pytest_twisted.ensureDeferred
async def test_metadata_of_a_stream_without_owner_is_not_available(nodes: Nodes) -> None:
    """A stream whose pinned node is down has no leader: code 6, as RabbitMQ answers."""
    nodes.placement.owners["pinned"] = None
    peer = nodes.client()
    response = peer.ask(sp.Metadata(correlation_id=1, streams=("pinned",)))
    assert isinstance(response, sp.MetadataResponse)
    assert response.streams == (
        sp.StreamMetadata(stream="pinned", code=NOT_AVAILABLE, leader=sp.NO_LEADER, replicas=()),
    )


def test_local_metadata_is_answered_as_before(nodes: Nodes) -> None:
    """Streams this node owns are answered at once, naming this node only."""
    nodes.stores["a"].create("near")
    peer = nodes.client()
    response = peer.ask(sp.Metadata(correlation_id=1, streams=("near",)))
    assert isinstance(response, sp.MetadataResponse)
    assert response.brokers == (sp.Broker(reference=0, host="127.0.0.1", port=5552),)


def test_subscribe_on_a_non_owner_is_refused_not_available(nodes: Nodes) -> None:
    """Subscribe to a stream another node owns: code 6 (stream not available), as RabbitMQ."""
    nodes.stores["b"].create("far")
    peer = nodes.client()
    assert peer.code(subscribe(peer, "far", FIRST, 1)) == NOT_AVAILABLE


@pytest_twisted.ensureDeferred
async def test_publish_through_a_non_owner_lands_at_the_owner_once(nodes: Nodes) -> None:
    """Publishes are relayed with the client's reference: the owner stores and dedups them."""
    far = nodes.stores["b"].create("far")
    peer = nodes.client()
    assert await answer_to(peer, declare(peer, 3, "far", "producer-a")) == sp.Response(
        key=sp.Key.DECLARE_PUBLISHER, correlation_id=peer_last(peer), code=1
    )
    peer.send(publish(3, [1, 2], [b"one", b"two"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=3, publishing_ids=[1, 2])
    peer.send(publish(3, [2, 3], [b"two", b"three"]))  # 2 again: a retry after a doubt
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=3, publishing_ids=[2, 3])
    assert entries(far) == [b"one", b"two", b"three"]
    assert nodes.stores["a"].get("far") is None
    query = sp.QueryPublisherSequence(correlation_id=9, reference="producer-a", stream="far")
    assert await answer_to(peer, query) == sp.QueryPublisherSequenceResponse(
        correlation_id=9, code=1, sequence=3
    )
    assert peer.protocol._unconfirmed == 0


def peer_last(peer: Peer) -> int:
    """The correlation id the peer used last."""
    return next(peer._ids) - 1


@pytest_twisted.ensureDeferred
async def test_requests_are_relayed_to_the_owner(nodes: Nodes) -> None:
    """Create, StreamStats, StoreOffset and QueryOffset on a stream owned elsewhere go there."""
    peer = nodes.client()
    create = sp.Create(correlation_id=21, stream="far-new", arguments={})
    assert await answer_to(peer, create) == sp.Response(
        key=sp.Key.CREATE, correlation_id=21, code=1
    )
    assert nodes.stores["b"].get("far-new") is not None
    assert nodes.stores["a"].get("far-new") is None
    peer.send(sp.StoreOffset(reference="reader", stream="far-new", offset=0))
    query = sp.QueryOffset(correlation_id=22, reference="reader", stream="far-new")
    assert await answer_to(peer, query) == sp.QueryOffsetResponse(
        correlation_id=22, code=1, offset=0
    )
    stats = await answer_to(peer, sp.StreamStats(correlation_id=23, stream="far-new"))
    assert isinstance(stats, sp.StreamStatsResponse) and stats.code == 1


@pytest_twisted.ensureDeferred
async def test_an_owner_that_cannot_be_reached_is_not_available(nodes: Nodes) -> None:
    """No relay to the owner: DeclarePublisher is answered 6."""
    await nodes.port.stopListening()
    peer = nodes.client()
    answer = await answer_to(peer, declare(peer, 1, "far", "producer-a"))
    assert answer == sp.Response(
        key=sp.Key.DECLARE_PUBLISHER, correlation_id=peer_last(peer), code=NOT_AVAILABLE
    )
    nodes.port = _reactor().listenTCP(0, nodes.b, interface="127.0.0.1")


@pytest_twisted.ensureDeferred
async def test_a_relay_that_ends_tells_its_publishers(nodes: Nodes) -> None:
    """The owner's connection goes: the relayed publisher's stream is reported moved (6)."""
    nodes.stores["b"].create("far")
    peer = nodes.client()
    await answer_to(peer, declare(peer, 1, "far", "producer-a"))
    (owner_side,) = nodes.b.connections
    assert owner_side.transport is not None
    owner_side.transport.loseConnection()
    assert await peer.next_frame() == sp.MetadataUpdate(code=NOT_AVAILABLE, stream="far")
    peer.send(publish(1, [1], [b"late"]))
    answer = peer.frames()
    assert answer == [sp.PublishError(publisher_id=1, publishing_ids=[1], codes=[18])]


@pytest_twisted.ensureDeferred
async def test_owners_moving_tell_the_clients(nodes: Nodes) -> None:
    """A stream that moves away from this node, or between others: MetadataUpdate 6."""
    nodes.stores["a"].create("near")
    nodes.stores["b"].create("far")
    peer = nodes.client()
    assert peer.code(declare(peer, 1, "near", "local")) == 1
    await answer_to(peer, declare(peer, 2, "far", "relayed"))
    nodes.placement.moved(near="b", far="a")
    assert set(map(repr, peer.frames())) == {
        repr(sp.MetadataUpdate(code=NOT_AVAILABLE, stream="near")),
        repr(sp.MetadataUpdate(code=NOT_AVAILABLE, stream="far")),
    }
    nodes.placement.moved(far="b")  # back: the owner forgot the publisher, it may come again
    assert await answer_to(peer, declare(peer, 2, "far", "relayed")) == sp.Response(
        key=sp.Key.DECLARE_PUBLISHER, correlation_id=peer_last(peer), code=1
    )


@pytest_twisted.ensureDeferred
async def test_a_relay_is_served_by_the_node_it_reaches(nodes: Nodes) -> None:
    """Two nodes that disagree about an owner do not relay in a circle: the owner stores it."""
    far = nodes.stores["b"].create("far")
    nodes.b.join_fleet(StreamFleet(Placement("b", {"far": "a"}), connect_tcp(_reactor())))
    peer = nodes.client()
    await answer_to(peer, declare(peer, 1, "far", "producer-a"))
    peer.send(publish(1, [1], [b"here"]))
    assert await peer.next_frame() == sp.PublishConfirm(publisher_id=1, publishing_ids=[1])
    assert entries(far) == [b"here"]


def test_without_relays_metadata_names_the_owner_unasked(nodes: Nodes) -> None:
    """A listener that cannot relay (TLS) names the owner; publishers there are refused 6."""
    nodes.a.fleet = StreamFleet(nodes.placement, connect_tcp(_reactor()), tls=True)
    peer = nodes.client()
    response = peer.ask(sp.Metadata(correlation_id=1, streams=("far",)))
    assert isinstance(response, sp.MetadataResponse)
    assert response.streams == (sp.StreamMetadata(stream="far", code=1, leader=1, replicas=()),)
    assert peer.code(declare(peer, 1, "far", "producer-a")) == NOT_AVAILABLE


def test_a_declared_local_publisher_id_is_not_relayed(nodes: Nodes) -> None:
    """A publisher id is the connection's: one declared here cannot be declared for elsewhere."""
    nodes.stores["a"].create("near")
    peer = nodes.client()
    assert peer.code(declare(peer, 1, "near", "local")) == 1
    assert peer.code(declare(peer, 1, "far", "relayed")) == 17


@pytest_twisted.ensureDeferred
async def test_messages_in_flight_when_the_stream_moves_fail_with_6(nodes: Nodes) -> None:
    """Not confirmed yet when the stream moved: PublishError 6, then MetadataUpdate; no more."""
    far = nodes.stores["b"].create("far")
    peer = nodes.client()
    await answer_to(peer, declare(peer, 1, "far", "producer-a"))
    peer.send(publish(1, [1, 2], [b"one", b"two"]))
    assert peer.protocol._unconfirmed == 2
    nodes.placement.moved(far="a")
    assert peer.frames() == [
        sp.PublishError(publisher_id=1, publishing_ids=[1, 2], codes=[NOT_AVAILABLE] * 2),
        sp.MetadataUpdate(code=NOT_AVAILABLE, stream="far"),
    ]
    assert peer.protocol._unconfirmed == 0
    await far.wait_for(0)  # the owner stored them all the same (a retry is deduplicated there)
    # The owner's confirm went out before its answer to this (one connection): not passed on.
    response = await answer_to(peer, sp.Metadata(correlation_id=5, streams=("far-missing",)))
    assert isinstance(response, sp.MetadataResponse)
