"""Routes into a stream listener, in a fleet: what they deliver is appended at the stream's owner.

In a fleet (docs/fleet.rst) each stream of the embedded log has one owner
node. A route that delivers into a stream listener's stream
(`gateway.protocols.stream.bridge.StreamDestination`) on a node that does
not own it appends at the owner, as the listener relays its clients'
publishers: `OwnerAppends` keeps one relay per owner node
(`gateway.protocols.stream.owner.OwnerConnection`, to the owner's listener
of the same name) that logs in as the fleet on behalf of this node's routes
(`gateway.protocols.stream.fleetlogin`, which needs ``[fleet]
relay_secret``). The owner writes what comes on it as its own routes do: no
allow-lists, the gateway's own references allowed, its own streams refused.

Over that relay, for each stream (and publisher reference) a publisher is
declared at the owner, the stream created there first if it is missing (as
a route creates one locally), and the messages are published, as many per
Publish frame as the tuned frame_max allows; the owner's PublishConfirm is
the route's *accepted*, once the owner's log committed them. A message
delivered with deduplication (`deliver_once`: a durable route's forwarder)
keeps its publishing id, under the route's reference with this node's id
added (`node_reference`): the owner's log keeps each node's last id apart
(each numbers by its own log's offsets), so what this node delivers again
after a crash is stored there once.

What cannot be appended at the owner is answered *retry later*: an owner
that cannot be reached (or refuses the relay), a relay that ends with
messages unconfirmed, a stream that changes at the owner meanwhile, more
than `MAX_IN_FLIGHT_MESSAGES` unconfirmed for one owner. The owner's
refusals (access refused, precondition failed) are *rejected*, as a local
append's would be; a message larger than a frame too.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import Final

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from gateway.codecs import stream as sp
from gateway.codecs.stream import ENTRY_OVERHEAD_BYTES, PUBLISH_OVERHEAD_BYTES
from gateway.core.batch import Answers, all_same
from gateway.core.flow import Throttle
from gateway.core.message import Outcome
from gateway.protocols.stream.fleetlogin import ROUTES, RelayIdentity
from gateway.protocols.stream.owner import FleetLogin, OwnerConnection
from gateway.protocols.stream.relay import StreamFleet

__all__ = ["MAX_IN_FLIGHT_MESSAGES", "MAX_PUBLISHERS", "OwnerAppends", "node_reference"]

MAX_IN_FLIGHT_MESSAGES: Final = 50_000
"""Messages appended at one owner and not confirmed yet, at most (the listener's default
``max_unconfirmed``, past which the owner stops reading the relay); past it, retry later."""
MAX_PUBLISHERS: Final = 256
"""Publishers one relay declares at its owner (a publisher id is a byte)."""
MAX_REFERENCE_BYTES: Final = 255
_OK: Final = 1
_STREAM_DOES_NOT_EXIST: Final = 2
_STREAM_ALREADY_EXISTS: Final = 5
_PUBLISHER_DOES_NOT_EXIST: Final = 18
_REJECTING: Final = frozenset({16, 17})
"""The owner's answers that no retry changes: access refused, precondition failed."""


def node_reference(reference: str, node: str) -> str:
    """``reference`` as node ``node``'s own at an owner: ``<reference>@<node>``, within 255 bytes.

    ``@`` is in neither a route name nor a node id, so no two pairs give one
    reference; one too long is replaced by its hash under the same prefix
    (the gateway's references stay reserved at the owner). A reference that
    has an ``@`` already is kept as it is: its ids are not this node's own
    log offsets but those of whoever it names (a consumer that read the
    messages), the same whichever node delivers them.
    """
    if "@" in reference:
        return reference
    qualified = f"{reference}@{node}"
    if len(qualified.encode("utf-8")) <= MAX_REFERENCE_BYTES:
        return qualified
    digest = hashlib.sha256(qualified.encode("utf-8")).hexdigest()[:32]
    prefix = reference.encode("utf-8")[: MAX_REFERENCE_BYTES - 33].decode("utf-8", "ignore")
    return f"{prefix}@{digest}"


def _nothing() -> None:
    """A throttle's pause and resume: a route's deliveries are bounded by their count."""


class _Batch:
    """One append's messages waiting for their publisher to be declared."""

    __slots__ = ("answers", "entries", "ids")

    def __init__(self, answers: Answers, entries: Sequence[bytes], ids: Sequence[int] | None):
        self.answers = answers
        self.entries = entries
        self.ids = ids


class _Publisher:
    """A publisher declared (or being declared) at the owner for one stream and reference."""

    __slots__ = ("id", "next_id", "pending", "ready", "reference", "stream", "waiting")

    def __init__(self, publisher_id: int, stream: str, reference: str | None) -> None:
        self.id = publisher_id
        self.stream = stream
        self.reference = reference
        self.ready = False
        self.next_id = 1
        """The next publishing id, for messages without one of their own (no reference)."""
        self.waiting: list[_Batch] = []
        self.pending: dict[int, list[tuple[Answers, int]]] = {}
        """Publishing id to the messages sent under it and not confirmed yet."""


class _OwnerLink:
    """The routes' relay to one owner node, and what is in flight on it (`OwnerEvents`)."""

    _log = Logger()

    def __init__(self, appends: OwnerAppends, owner: str) -> None:
        self._appends = appends
        self.owner = owner
        self.throttle = Throttle(_nothing, _nothing)
        self.connection: OwnerConnection | None = None
        self.publishers: dict[tuple[str, str | None], _Publisher] = {}
        self.by_id: dict[int, _Publisher] = {}
        self.in_flight = 0
        self.closed = False

    def _where(self) -> str:
        return f"stream listener {self._appends.listener}: node {self.owner}"

    # --- appending ------------------------------------------------------------------------

    def append(
        self,
        stream: str,
        entries: Sequence[bytes],
        reference: str | None,
        ids: Sequence[int] | None,
    ) -> Deferred[list[Outcome]]:
        count = len(entries)
        if self.in_flight + count > MAX_IN_FLIGHT_MESSAGES:
            return all_same(
                count,
                Outcome.retry(
                    f"{self._where()} has {self.in_flight} routed message(s) unconfirmed"
                    f" (at most {MAX_IN_FLIGHT_MESSAGES})"
                ),
            )
        publisher = self._publisher(stream, reference)
        if publisher is None:
            return all_same(
                count,
                Outcome.retry(
                    f"{self._where()}: routes write into {MAX_PUBLISHERS} of its streams"
                    " at once already"
                ),
            )
        answers = Answers(count)
        batch = _Batch(answers, entries, ids)
        if publisher.ready:
            self._send(publisher, batch)
        else:
            publisher.waiting.append(batch)
        return answers.deferred

    def _send(self, publisher: _Publisher, batch: _Batch) -> None:
        """Publish a batch in as few frames as frame_max allows."""
        connection = self.connection
        assert connection is not None
        frame_max = connection.frame_max
        budget = frame_max - PUBLISH_OVERHEAD_BYTES if frame_max else sys.maxsize
        answers = batch.answers
        pending = publisher.pending
        ids: list[int] = []
        messages: list[bytes] = []
        size = 0
        for index, entry in enumerate(batch.entries):
            cost = ENTRY_OVERHEAD_BYTES + len(entry)
            if cost > budget:
                answers.settle(
                    index,
                    Outcome.rejected(
                        f"{self._where()}: a message of {len(entry)} bytes does not fit in a"
                        f" frame of {frame_max} bytes"
                    ),
                )
                continue
            if size + cost > budget:
                connection.send(
                    sp.Publish(publisher_id=publisher.id, publishing_ids=ids, messages=messages)
                )
                ids, messages, size = [], [], 0
            if batch.ids is not None:
                publishing_id = batch.ids[index]
            else:
                publishing_id = publisher.next_id
                publisher.next_id += 1
            pending.setdefault(publishing_id, []).append((answers, index))
            self.in_flight += 1
            ids.append(publishing_id)
            messages.append(entry)
            size += cost
        if ids:
            connection.send(
                sp.Publish(publisher_id=publisher.id, publishing_ids=ids, messages=messages)
            )

    # --- publishers at the owner ------------------------------------------------------------

    def _publisher(self, stream: str, reference: str | None) -> _Publisher | None:
        key = (stream, reference)
        publisher = self.publishers.get(key)
        if publisher is not None:
            return publisher
        publisher_id = self._free_id()
        if publisher_id is None:
            return None
        publisher = _Publisher(publisher_id, stream, reference)
        self.publishers[key] = publisher
        self.by_id[publisher_id] = publisher
        self._declare(publisher, create=True)
        return publisher

    def _free_id(self) -> int | None:
        """A publisher id not in use; an idle publisher's is taken back when all are."""
        if len(self.by_id) < MAX_PUBLISHERS:
            return next(i for i in range(MAX_PUBLISHERS) if i not in self.by_id)
        for publisher in self.by_id.values():
            if publisher.ready and not publisher.pending and not publisher.waiting:
                self._forget(publisher)
                return publisher.id
        return None

    def _declare(self, publisher: _Publisher, *, create: bool) -> None:
        connection = self.connection
        assert connection is not None

        def answered(response: sp.Event | None) -> None:
            if self.by_id.get(publisher.id) is not publisher:
                return  # forgotten meanwhile (its batches were answered then)
            code = getattr(response, "code", None)
            if code == _OK:
                publisher.ready = True
                waiting, publisher.waiting = publisher.waiting, []
                for batch in waiting:
                    self._send(publisher, batch)
            elif code == _STREAM_DOES_NOT_EXIST and create:
                self._create(publisher)
            else:
                self._drop(
                    publisher, self._outcome(code, f"declaring a publisher on {publisher.stream!r}")
                )

        connection.request(
            sp.DeclarePublisher(
                correlation_id=0,
                publisher_id=publisher.id,
                reference=publisher.reference or "",
                stream=publisher.stream,
            ),
            answered,
        )

    def _create(self, publisher: _Publisher) -> None:
        """Create the stream at the owner (a route creates a missing stream), then declare again."""
        connection = self.connection
        assert connection is not None

        def answered(response: sp.Event | None) -> None:
            if self.by_id.get(publisher.id) is not publisher:
                return
            code = getattr(response, "code", None)
            if code in (_OK, _STREAM_ALREADY_EXISTS):
                if code == _OK:
                    self._log.info(
                        "{listener}: created stream {stream} at node {owner} for a route",
                        listener=self._appends.listener,
                        stream=publisher.stream,
                        owner=self.owner,
                    )
                self._declare(publisher, create=False)
            else:
                self._drop(publisher, self._outcome(code, f"creating stream {publisher.stream!r}"))

        connection.request(
            sp.Create(correlation_id=0, stream=publisher.stream, arguments={}), answered
        )

    def _outcome(self, code: int | None, doing: str) -> Outcome:
        if code is None:
            return Outcome.retry(f"{self._where()}: no answer {doing} (the relay ended)")
        if code in _REJECTING:
            return Outcome.rejected(f"{self._where()} refused {doing}: code {code}")
        return Outcome.retry(f"{self._where()}: {doing} failed: code {code}")

    def _forget(self, publisher: _Publisher) -> None:
        """No longer use ``publisher``; the owner forgets it too (its id may come again)."""
        self.publishers.pop((publisher.stream, publisher.reference), None)
        if self.by_id.get(publisher.id) is publisher:
            del self.by_id[publisher.id]
        connection = self.connection
        if publisher.ready and connection is not None and not connection.closed:
            connection.request(
                sp.DeletePublisher(correlation_id=0, publisher_id=publisher.id), _ignore
            )

    def _drop(self, publisher: _Publisher, outcome: Outcome) -> None:
        """Forget ``publisher``; what waits or is in flight on it gets ``outcome``."""
        self._forget(publisher)
        self._settle_all(publisher, outcome)

    def _settle_all(self, publisher: _Publisher, outcome: Outcome) -> None:
        waiting, publisher.waiting = publisher.waiting, []
        for batch in waiting:
            batch.answers.settle_rest(outcome)
        pending, publisher.pending = publisher.pending, {}
        for messages in pending.values():
            self.in_flight -= len(messages)
            for answers, index in messages:
                answers.settle(index, outcome)

    def _settle(self, publisher_id: int, ids: Sequence[int], outcome: Outcome) -> _Publisher | None:
        publisher = self.by_id.get(publisher_id)
        if publisher is None:
            return None
        pending = publisher.pending
        for publishing_id in ids:
            messages = pending.pop(publishing_id, None)
            if messages is None:
                continue
            self.in_flight -= len(messages)
            for answers, index in messages:
                answers.settle(index, outcome)
        return publisher

    def close(self, reason: str) -> None:
        """Close the relay; what is in flight is answered retry later."""
        if self.closed:
            return
        self.closed = True
        self._lost(reason)
        if self.connection is not None:
            self.connection.close()

    def _lost(self, reason: str) -> None:
        outcome = Outcome.retry(f"{self._where()}: the relay of routes ended: {reason}")
        publishers = list(self.by_id.values())
        self.publishers.clear()
        self.by_id.clear()
        for publisher in publishers:
            self._settle_all(publisher, outcome)

    # --- OwnerEvents -------------------------------------------------------------------------

    def owner_confirmed(self, connection: OwnerConnection, event: sp.PublishConfirm) -> None:
        """The owner stored them: accepted."""
        self._settle(event.publisher_id, event.publishing_ids, Outcome.accepted())

    def owner_refused(self, connection: OwnerConnection, event: sp.PublishError) -> None:
        """The owner refused them: rejected for good, or retry later (and declare again)."""
        by_code: dict[int, list[int]] = {}
        for publishing_id, code in zip(event.publishing_ids, event.codes, strict=False):
            by_code.setdefault(code, []).append(publishing_id)
        for code, ids in by_code.items():
            outcome = self._outcome(code, f"appending to a stream (publisher {event.publisher_id})")
            publisher = self._settle(event.publisher_id, ids, outcome)
            if publisher is not None and code in (
                _STREAM_DOES_NOT_EXIST,
                _PUBLISHER_DOES_NOT_EXIST,
            ):
                self._drop(publisher, outcome)  # declared again by the next delivery

    def owner_update(self, connection: OwnerConnection, event: sp.MetadataUpdate) -> None:
        """The stream changed at the owner (deleted): its publishers there are gone."""
        outcome = Outcome.retry(f"{self._where()}: stream {event.stream!r} changed there")
        for publisher in [p for p in self.by_id.values() if p.stream == event.stream]:
            publisher.ready = False  # the owner forgot it already
            self._drop(publisher, outcome)

    def owner_lost(self, connection: OwnerConnection, reason: str) -> None:
        """The relay failed or ended: what is in flight is answered retry later."""
        if self.closed:
            return
        self.closed = True
        self._appends.link_lost(self)
        self._log.info(
            "{listener}: relay of routes to node {owner} ended: {reason}",
            listener=self._appends.listener,
            owner=self.owner,
            reason=reason,
        )
        self._lost(reason)


def _ignore(_response: sp.Event | None) -> None:
    """An answer nobody waits for."""


class OwnerAppends:
    """Appends routed messages at the nodes that own their streams (the module docstring).

    Args:
        fleet: Placement, connecting, and the fleet's relay secret.
        listener: The stream listener's name (the owners' listener of that name is used).
        clock: Timers.
        frame_max: The largest frame to tune relays to (the listener's).
        virtual_host: The virtual host the relays open (one the listener accepts).
    """

    def __init__(
        self,
        *,
        fleet: StreamFleet,
        listener: str,
        clock: IReactorTime,
        frame_max: int,
        virtual_host: str,
    ) -> None:
        self._fleet = fleet
        self._placement = fleet.placement
        self.listener = listener
        self._clock = clock
        self._frame_max = frame_max
        self._virtual_host = virtual_host
        self._links: dict[str, _OwnerLink] = {}
        self._placement.on_change(self._owners_changed)

    @property
    def node(self) -> str:
        """This node's id."""
        return self._placement.node

    def available(self) -> bool:
        """Whether routed messages can be appended at other nodes (the relay secret is set)."""
        return self._fleet.relay_secret() is not None

    def owner(self, stream: str) -> str | None:
        """The node that owns ``stream`` now (None: none does)."""
        return self._placement.owner(stream)

    def append(
        self,
        owner: str,
        stream: str,
        entries: Sequence[bytes],
        reference: str | None,
        ids: Sequence[int] | None,
    ) -> Deferred[list[Outcome]]:
        """Append ``entries`` to ``stream`` at node ``owner``; the outcomes, once it answered.

        Args:
            owner: The stream's owner (another node).
            stream: The stream.
            entries: The messages, as stored (AMQP 1.0).
            reference: The route's publisher reference, with ``ids`` (this
                node's id is added to it at the owner); None: no deduplication.
            ids: One publishing id per entry, with ``reference``.
        """
        link = self._link(owner)
        if link is None:
            return all_same(
                len(entries),
                Outcome.retry(
                    f"stream listener {self.listener}: node {owner}, which owns stream"
                    f" {stream!r}, cannot be reached now"
                ),
            )
        if reference is not None:
            reference = node_reference(reference, self.node)
        return link.append(stream, entries, reference, ids)

    def _link(self, owner: str) -> _OwnerLink | None:
        link = self._links.get(owner)
        if link is not None:
            return link
        address = self._placement.address(owner, self.listener)
        secret = self._fleet.relay_secret()
        if address is None or secret is None:
            return None
        link = _OwnerLink(self, owner)
        connection = OwnerConnection(
            node=self.node,
            owner=owner,
            login=FleetLogin(secret=secret, who=RelayIdentity(node=self.node, role=ROUTES)),
            virtual_host=self._virtual_host,
            frame_max=self._frame_max,
            clock=self._clock,
            events=link,
            client=link.throttle,
        )
        link.connection = connection
        self._links[owner] = link
        self._fleet.connect(address[0], address[1], connection).addErrback(
            connection.connect_failed
        )
        return link

    def link_lost(self, link: _OwnerLink) -> None:
        """A relay ended: the next delivery to that owner makes a new one."""
        if self._links.get(link.owner) is link:
            del self._links[link.owner]

    def _owners_changed(self) -> None:
        """Close the relays to nodes that left the fleet."""
        for owner, link in list(self._links.items()):
            if self._placement.address(owner, self.listener) is None:
                del self._links[owner]
                link.close("it left the fleet")

    def close(self) -> None:
        """Close every relay (what is in flight is answered retry later)."""
        links, self._links = self._links, {}
        for link in links.values():
            link.close("the listener stopped")
