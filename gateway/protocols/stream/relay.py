"""A stream listener in a fleet: commands on streams another node owns go to that node.

In a fleet (docs/fleet.rst) each stream of the embedded log has one owner
node (`StreamPlacement`, over `gateway.fleet.streams`), as a RabbitMQ
stream has one leader. A stream listener's connection (the server's
`StreamRelays`, one per client connection) handles, for a stream this node
does not own:

- Metadata: names the owner, at the address it advertises for its listener
  of the same name, as the stream's leader, with no replicas (the owner
  says whether the stream exists: it is asked); a stream with no owner now
  (its pinned node is down) is answered code 6, stream not available, with
  no leader;
- Subscribe: answered code 6 (stream not available), as RabbitMQ answers a
  consumer on a node with no member of the stream: the client asks
  Metadata and connects to the owner (rstream's load-balancer mode does);
- DeclarePublisher, Publish, DeletePublisher, QueryPublisherSequence,
  Create, Delete, StreamStats, QueryOffset, StoreOffset and
  ResolveOffsetSpec: relayed to the owner over an
  `gateway.protocols.stream.owner.OwnerConnection` that logs in as the
  client did; the owner's answers, confirms and errors come back as the
  owner sent them. A publisher is declared there with the client's
  publisher id and reference, so that deduplication works end to end: the
  owner's log keeps the reference's last publishing id, and a message sent
  again (through any node) is confirmed without being stored twice.

With ``[fleet] relay_secret`` (the secrets file) a relay logs in as the
fleet, on behalf of the identity the client authenticated as here,
whatever its mechanism (`gateway.protocols.stream.fleetlogin`), and a TLS
listener's relays are TLS (`connect_tls`). Without it, a relay logs in as
the client did, over plain TCP; then a client logged in with EXTERNAL (its
certificate cannot be presented by another node) and every client of a TLS
listener cannot be relayed. What cannot be relayed is answered code 6, as
is what an owner that cannot be reached or refuses the relay is asked.
Metadata for such a client or listener names the owner without asking it
whether the stream exists (code 1): the client learns that there.

When owners change (nodes join or leave), or the connection to an owner
ends, the client's relayed publishers on the streams concerned are told
MetadataUpdate code 6, as RabbitMQ tells of a leader that moved, after
PublishError 6 for their messages not confirmed yet; the client declares
them again (through Metadata) where the stream is now.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from gateway.codecs import stream as sp
from gateway.core.flow import Throttle
from gateway.protocols.stream.fleetlogin import ANONYMOUS, CLIENT, RelayIdentity
from gateway.protocols.stream.owner import ClientLogin, FleetLogin, Login, OwnerConnection
from gateway.tls import relay_client_tls

__all__ = [
    "CONNECT_TIMEOUT_SECONDS",
    "STREAM_NOT_AVAILABLE",
    "StreamFleet",
    "StreamPlacement",
    "StreamRelays",
    "connect_tcp",
    "connect_tls",
]

STREAM_NOT_AVAILABLE: Final = int(sp.ResponseCode.STREAM_NOT_AVAILABLE)
CONNECT_TIMEOUT_SECONDS: Final = 5.0
"""A relay's TCP connection to an owner not made in this time is given up (code 6)."""
_OK: Final = 1
_PRECONDITION_FAILED: Final = 17
_PUBLISHER_DOES_NOT_EXIST: Final = 18


class StreamPlacement(Protocol):
    """Which node owns each stream (`gateway.fleet.streams.StreamOwnership`)."""

    node: str
    """This node's id."""

    def owner(self, stream: str) -> str | None:
        """The node that owns ``stream`` now; None while none does."""

    def address(self, node: str, listener: str) -> tuple[str, int] | None:
        """Where ``node`` advertises its listener ``listener``, if it is live and has it."""

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when owners may have changed."""


Connect = Callable[[str, int, OwnerConnection], "Deferred[Any]"]
"""Connects an `OwnerConnection` to a host and port (TCP)."""


def connect_tcp(reactor: Any) -> Connect:
    """Relays over TCP with ``reactor``: to the owner's advertised host (a name or an address)."""

    def connect(host: str, port: int, connection: OwnerConnection) -> Deferred[Any]:
        endpoint = HostnameEndpoint(reactor, host, port, timeout=CONNECT_TIMEOUT_SECONDS)
        factory = Factory.forProtocol(lambda: connection)
        factory.noisy = False  # one relay per client and owner: no "Starting factory" lines
        connecting: Deferred[Any] = endpoint.connect(factory)
        return connecting

    return connect


def connect_tls(reactor: Any, listener_endpoint: str) -> Connect:
    """Relays over TLS with ``reactor``, to a listener that ``listener_endpoint`` describes.

    The relay presents this node's certificate (the listener's ``certKey``)
    where the listener requires client certificates, and does not verify
    the owner's: the fleet login proves both sides, bound to the TLS
    session (`gateway.protocols.stream.fleetlogin`).

    Raises:
        ValueError: The endpoint's certificate or key cannot be read.
    """
    tls = relay_client_tls(listener_endpoint)

    def connect(host: str, port: int, connection: OwnerConnection) -> Deferred[Any]:
        endpoint = wrapClientTLS(
            tls, HostnameEndpoint(reactor, host, port, timeout=CONNECT_TIMEOUT_SECONDS)
        )
        factory = Factory.forProtocol(lambda: connection)
        factory.noisy = False
        connecting: Deferred[Any] = endpoint.connect(factory)
        return connecting

    return connect


def _no_secret() -> bytes | None:
    return None


@attrs.frozen
class StreamFleet:
    """What a stream listener needs to act as one node of a fleet.

    Attributes:
        placement: Who owns each stream.
        connect: Connects a relay to an owner's address (`connect_tcp`,
            `connect_tls` on a TLS listener).
        tls: Whether the listener is TLS: it relays only with the relay secret.
        relay_secret: The fleet's ``relay_secret`` now (a reload may change
            it); None: relays log in as their clients did.
    """

    placement: StreamPlacement
    connect: Connect
    tls: bool = False
    relay_secret: Callable[[], bytes | None] = _no_secret

    @property
    def relays(self) -> bool:
        """Whether commands may be relayed at all (not on TLS without the secret)."""
        return not self.tls or self.relay_secret() is not None

    def login_for(self, client: tuple[str, bytes], principal: str | None) -> Login | None:
        """How a relay logs in for a client who logged in with ``client`` (None: it cannot).

        Args:
            client: The client's SASL mechanism and response.
            principal: The identity it authenticated as (None: ANONYMOUS).
        """
        secret = self.relay_secret()
        if secret is not None:
            role = CLIENT if principal is not None else ANONYMOUS
            who = RelayIdentity(node=self.placement.node, role=role, principal=principal)
            return FleetLogin(secret=secret, who=who)
        mechanism, data = client
        if self.tls or mechanism == "EXTERNAL":
            return None  # TLS needs the fleet's proof; a certificate cannot be passed on
        return ClientLogin(mechanism=mechanism, data=data)


class RelayedClient(Protocol):
    """What the relay needs of the client's connection (the stream server's protocol)."""

    throttle: Throttle

    def answer(self, event: sp.Event) -> None:
        """Send ``event`` to the client now."""

    def relaying(self, change: int) -> None:
        """``change`` more (or, negative, fewer) relayed messages await their confirm."""


class _Publisher:
    """A publisher of the client's, declared at the owner."""

    __slots__ = ("connection", "in_flight", "stream")

    def __init__(self, connection: OwnerConnection, stream: str) -> None:
        self.connection = connection
        self.stream = stream
        self.in_flight: set[int] = set()


class StreamRelays:
    """One client connection's commands on streams other nodes own (the module docstring).

    Args:
        fleet: Placement and connecting.
        listener: The listener's name (the owner's listener of that name is used).
        client: The client's connection.
        clock: Timers.
        frame_max: The listener's frame_max.
        exists: Whether this node's log has a stream (Metadata for the streams it owns).
        advertised: This node's advertised address (Metadata's broker for them).
        local_publisher: Whether the client declared this publisher id here, locally.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        fleet: StreamFleet,
        listener: str,
        client: RelayedClient,
        clock: IReactorTime,
        frame_max: int,
        exists: Callable[[str], bool],
        advertised: Callable[[], tuple[str, int]],
        local_publisher: Callable[[int], bool],
    ) -> None:
        self._fleet = fleet
        self._placement = fleet.placement
        self._node = fleet.placement.node
        self._listener = listener
        self._client = client
        self._clock = clock
        self._frame_max = frame_max
        self._exists = exists
        self._advertised = advertised
        self._local_publisher = local_publisher
        self.login: tuple[str, bytes] | None = None
        """The client's SASL mechanism and response, once it logged in."""
        self.principal: str | None = None
        """The identity it authenticated as (None: ANONYMOUS)."""
        self.virtual_host = "/"
        self._owners: dict[str, OwnerConnection] = {}
        self._publishers: dict[int, _Publisher] = {}
        self._handlers: dict[type, Callable[[Any], bool]] = {
            sp.Metadata: self._metadata,
            sp.Subscribe: self._subscribe,
            sp.DeclarePublisher: self._declare_publisher,
            sp.Publish: self._publish,
            sp.DeletePublisher: self._delete_publisher,
            sp.StoreOffset: self._store_offset,
            sp.Create: self._request,
            sp.Delete: self._request,
            sp.QueryPublisherSequence: self._request,
            sp.StreamStats: self._request,
            sp.QueryOffset: self._request,
            sp.ResolveOffsetSpec: self._request,
        }

    # --- what the server asks -------------------------------------------------------------

    def take(self, event: sp.Event) -> bool:
        """Handle ``event`` if it concerns a stream owned elsewhere; whether it did."""
        handler = self._handlers.get(type(event))
        return handler is not None and handler(event)

    def has_publisher(self, publisher_id: int) -> bool:
        """Whether the client's publisher ``publisher_id`` is declared at an owner."""
        return publisher_id in self._publishers

    def remote(self, stream: str) -> bool:
        """Whether ``stream`` is owned by another node, or by none now."""
        return self._placement.owner(stream) != self._node

    def owners_changed(self) -> None:
        """Owners may have moved: publishers whose stream moved are told, and forgotten."""
        placement = self._placement
        moved = [
            publisher_id
            for publisher_id, publisher in self._publishers.items()
            if placement.owner(publisher.stream) != publisher.connection.owner
        ]
        self._forget(moved)
        for node, connection in list(self._owners.items()):
            if placement.address(node, self._listener) is None:
                del self._owners[node]  # it left the fleet
                self._forget(self._of(connection))
                connection.close()

    def close(self) -> None:
        """The client's connection ended: close every relay."""
        self._publishers.clear()
        owners, self._owners = self._owners, {}
        for connection in owners.values():
            connection.close()

    # --- commands ------------------------------------------------------------------------------

    def _metadata(self, event: sp.Metadata) -> bool:
        placement = self._placement
        owners = {name: placement.owner(name) for name in event.streams}
        if all(owner == self._node for owner in owners.values()):
            return False
        host, port = self._advertised()
        brokers: dict[str, sp.Broker] = {self._node: sp.Broker(reference=0, host=host, port=port)}
        answers: dict[str, sp.StreamMetadata] = {}
        asked: dict[str, list[str]] = {}
        for name, owner in owners.items():
            if owner == self._node:
                code = _OK if self._exists(name) else int(sp.ResponseCode.STREAM_DOES_NOT_EXIST)
                answers[name] = _stream(name, code, 0 if code == _OK else sp.NO_LEADER)
            elif owner is None or (address := placement.address(owner, self._listener)) is None:
                answers[name] = _stream(name, STREAM_NOT_AVAILABLE)
            else:
                if owner not in brokers:
                    brokers[owner] = sp.Broker(
                        reference=len(brokers), host=address[0], port=address[1]
                    )
                if self._login() is not None:
                    asked.setdefault(owner, []).append(name)
                else:  # the owner cannot be asked from here: the client asks it there
                    answers[name] = _stream(name, _OK, brokers[owner].reference)

        def respond() -> None:
            self._client.answer(
                sp.MetadataResponse(
                    correlation_id=event.correlation_id,
                    brokers=tuple(brokers.values()),
                    streams=tuple(answers[name] for name in dict.fromkeys(event.streams)),
                )
            )

        waiting = [len(asked)]

        def answered(owner: str, names: list[str], response: sp.Event | None) -> None:
            codes = {}
            if isinstance(response, sp.MetadataResponse):
                codes = {item.stream: item.code for item in response.streams}
            for name in names:
                code = codes.get(name, STREAM_NOT_AVAILABLE)
                leader = brokers[owner].reference if code == _OK else sp.NO_LEADER
                answers[name] = _stream(name, code, leader)
            waiting[0] -= 1
            if waiting[0] == 0:
                respond()

        if not asked:
            respond()
        for owner, names in asked.items():
            connection = self._connection(owner)
            request = sp.Metadata(correlation_id=event.correlation_id, streams=tuple(names))
            if connection is None:
                answered(owner, names, None)
            else:
                connection.request(request, functools.partial(answered, owner, names))
        return True

    def _subscribe(self, event: sp.Subscribe) -> bool:
        if not self.remote(event.stream):
            return False
        self._client.answer(
            sp.Response(
                key=sp.Key.SUBSCRIBE,
                correlation_id=event.correlation_id,
                code=STREAM_NOT_AVAILABLE,
            )
        )
        return True

    def _declare_publisher(self, event: sp.DeclarePublisher) -> bool:
        if not self.remote(event.stream):
            return False
        publisher_id = event.publisher_id
        if publisher_id in self._publishers or self._local_publisher(publisher_id):
            self._client.answer(_failure(event, _PRECONDITION_FAILED))
            return True
        connection = self._owner_of(event.stream)
        if connection is None:
            self._client.answer(_failure(event, STREAM_NOT_AVAILABLE))
            return True
        publisher = _Publisher(connection, event.stream)
        self._publishers[publisher_id] = publisher  # Publish frames may follow at once

        def answered(response: sp.Event | None) -> None:
            code = getattr(response, "code", STREAM_NOT_AVAILABLE)
            if code != _OK and self._publishers.get(publisher_id) is publisher:
                self._forget([publisher_id], code=_PUBLISHER_DOES_NOT_EXIST, moved=False)
            self._client.answer(response or _failure(event, STREAM_NOT_AVAILABLE))

        connection.request(event, answered)
        return True

    def _publish(self, event: sp.Publish) -> bool:
        publisher = self._publishers.get(event.publisher_id)
        if publisher is None:
            return False
        ids = event.publishing_ids
        publisher.in_flight.update(ids)
        self._client.relaying(len(ids))
        publisher.connection.send(event)
        return True

    def _delete_publisher(self, event: sp.DeletePublisher) -> bool:
        publisher = self._publishers.pop(event.publisher_id, None)
        if publisher is None:
            return False
        self._client.relaying(-len(publisher.in_flight))
        publisher.connection.request(
            event, lambda response: self._client.answer(response or _failure(event, _OK))
        )
        return True

    def _store_offset(self, event: sp.StoreOffset) -> bool:
        if not self.remote(event.stream):
            return False
        connection = self._owner_of(event.stream)
        if connection is not None:
            connection.send(event)
        return True  # StoreOffset has no response

    def _request(self, event: Any) -> bool:
        if not self.remote(event.stream):
            return False
        connection = self._owner_of(event.stream)
        if connection is None:
            self._client.answer(_failure(event, STREAM_NOT_AVAILABLE))
            return True
        connection.request(
            event,
            lambda response: self._client.answer(response or _failure(event, STREAM_NOT_AVAILABLE)),
        )
        return True

    # --- connections to owners -------------------------------------------------------------

    def _owner_of(self, stream: str) -> OwnerConnection | None:
        owner = self._placement.owner(stream)
        return self._connection(owner) if owner is not None else None

    def _connection(self, owner: str) -> OwnerConnection | None:
        """The relay to ``owner``, made if needed; None when it cannot be."""
        connection = self._owners.get(owner)
        if connection is not None:
            return connection
        address = self._placement.address(owner, self._listener)
        login = self._login()
        if address is None or login is None:
            return None
        connection = OwnerConnection(
            node=self._node,
            owner=owner,
            login=login,
            virtual_host=self.virtual_host,
            frame_max=self._frame_max,
            clock=self._clock,
            events=self,
            client=self._client.throttle,
        )
        self._owners[owner] = connection
        connecting = self._fleet.connect(address[0], address[1], connection)
        connecting.addErrback(connection.connect_failed)
        return connection

    def _login(self) -> Login | None:
        """How relays log in for this client now; None: they cannot."""
        if self.login is None or not self._fleet.relays:
            return None
        return self._fleet.login_for(self.login, self.principal)

    def _of(self, connection: OwnerConnection) -> list[int]:
        return [pid for pid, p in self._publishers.items() if p.connection is connection]

    def _forget(
        self, publisher_ids: Iterable[int], *, code: int = STREAM_NOT_AVAILABLE, moved: bool = True
    ) -> None:
        """Drop relayed publishers: their unconfirmed messages fail with ``code``.

        With ``moved``, the client is then told that their streams moved
        (MetadataUpdate 6), as RabbitMQ tells of a leader that moved.
        """
        streams: dict[str, None] = {}
        for publisher_id in publisher_ids:
            publisher = self._publishers.pop(publisher_id, None)
            if publisher is None:
                continue
            streams[publisher.stream] = None
            # The owner forgets it too, so that the id can be declared there again.
            publisher.connection.request(
                sp.DeletePublisher(correlation_id=0, publisher_id=publisher_id), _ignore
            )
            if publisher.in_flight:
                ids = sorted(publisher.in_flight)
                self._client.relaying(-len(ids))
                self._client.answer(
                    sp.PublishError(
                        publisher_id=publisher_id, publishing_ids=ids, codes=[code] * len(ids)
                    )
                )
        if moved:
            for stream in streams:
                self._client.answer(sp.MetadataUpdate(code=STREAM_NOT_AVAILABLE, stream=stream))

    # --- OwnerEvents ------------------------------------------------------------------------

    def owner_confirmed(self, connection: OwnerConnection, event: sp.PublishConfirm) -> None:
        """Pass the owner's confirms on (of publishers still relayed there)."""
        if self._settled(connection, event.publisher_id, event.publishing_ids):
            self._client.answer(event)

    def owner_refused(self, connection: OwnerConnection, event: sp.PublishError) -> None:
        """Pass the owner's publish errors on (of publishers still relayed there)."""
        if self._settled(connection, event.publisher_id, event.publishing_ids):
            self._client.answer(event)

    def _settled(self, connection: OwnerConnection, publisher_id: int, ids: Iterable[int]) -> bool:
        """Count messages settled; False when the publisher is no longer relayed there.

        The client was told already (PublishError 6) of the messages of a
        publisher forgotten since: what the owner says of them now is not passed on.
        """
        publisher = self._publishers.get(publisher_id)
        if publisher is None or publisher.connection is not connection:
            return False
        in_flight = publisher.in_flight
        before = len(in_flight)
        in_flight.difference_update(ids)
        self._client.relaying(len(in_flight) - before)
        return True

    def owner_update(self, connection: OwnerConnection, event: sp.MetadataUpdate) -> None:
        """A stream changed at its owner: the publishers relayed there on it are gone."""
        gone = [
            pid
            for pid, publisher in self._publishers.items()
            if publisher.connection is connection and publisher.stream == event.stream
        ]
        self._forget(gone, moved=False)  # the owner's own MetadataUpdate says so
        self._client.answer(event)

    def owner_lost(self, connection: OwnerConnection, reason: str) -> None:
        """A relay ended: its publishers are told their streams are not available here."""
        if self._owners.get(connection.owner) is connection:
            del self._owners[connection.owner]
        self._log.info(
            "{listener}: relay to node {owner} ended: {reason}",
            listener=self._listener,
            owner=connection.owner,
            reason=reason,
        )
        self._forget(self._of(connection))


def _ignore(_response: sp.Event | None) -> None:
    """An answer nobody waits for."""


def _stream(name: str, code: int, leader: int = sp.NO_LEADER) -> sp.StreamMetadata:
    return sp.StreamMetadata(stream=name, code=code, leader=leader, replicas=())


def _failure(event: Any, code: int) -> sp.Event:
    """The response to ``event`` (a request) that says ``code``."""
    correlation_id = event.correlation_id
    if isinstance(event, sp.QueryPublisherSequence):
        return sp.QueryPublisherSequenceResponse(
            correlation_id=correlation_id, code=code, sequence=0
        )
    if isinstance(event, sp.QueryOffset):
        return sp.QueryOffsetResponse(correlation_id=correlation_id, code=code, offset=0)
    if isinstance(event, sp.StreamStats):
        return sp.StreamStatsResponse(correlation_id=correlation_id, code=code, statistics={})
    if isinstance(event, sp.ResolveOffsetSpec):
        return sp.ResolveOffsetSpecResponse(
            correlation_id=correlation_id,
            code=code,
            offset_type=int(sp.OffsetKind.OFFSET),
            offset=0,
        )
    return sp.Response(key=_KEYS[type(event)], correlation_id=correlation_id, code=code)


_KEYS: Final[dict[type, int]] = {
    sp.Create: sp.Key.CREATE,
    sp.Delete: sp.Key.DELETE,
    sp.DeclarePublisher: sp.Key.DECLARE_PUBLISHER,
    sp.DeletePublisher: sp.Key.DELETE_PUBLISHER,
    sp.Subscribe: sp.Key.SUBSCRIBE,
}
