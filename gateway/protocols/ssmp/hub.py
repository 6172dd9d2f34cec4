"""The SSMP hub: who is connected, who subscribes to what, and fan-out.

One hub per SSMP listener. It knows peers by identity and topics by name,
forwards MCAST, UCAST and BCAST lines, sends presence events in a safe order,
and is the listener's `IDestination`: routes deliver into it as MCAST events
to a topic's subscribers, and as UCAST and BCAST events for the address
forms ``!ucast.<peer>`` and ``!bcast``.

Output is batched: forwarding only queues bytes on each recipient
(`HubPeer.queue`); the hub then writes each recipient's batch with one
transport write (`Hub.flush`). The server protocol flushes at the end of each
``dataReceived``; a route's delivery flushes when it has queued its batch;
anything else that queues (outcomes arriving later, presence events of a
connection that ended) calls `Hub.schedule_flush`, which flushes once on the
next reactor turn.

Back-pressure (DESIGN.md, "Back-pressure before loss"; `gateway.core.flow`):
a recipient whose transport is full after its write is congested. The
publisher whose read queued to it is then held (it reads nothing more until
every recipient it is held by drained, as lipwig's publisher blocks on a
subscriber's write), and a route's delivery is answered once its congested
recipients drained, so that its sources run out of in-flight room too. A
healthy subscriber that is briefly slower than its publishers thereby
misses nothing; only a stuck one is cut (`gateway.protocols.listener`).

Across nodes (a fleet, docs/fleet.rst): with ``[fleet] amqp`` the hub has a
seam, ``fleet`` (`HubLink`, made by `gateway.fleet.hub.FleetHub`), which it
tells when a topic gets its first or loses its last local subscriber, when
a named peer logs in or out, and of every MCAST, BCAST, UCAST to a peer not
connected here, and presence event that must reach other nodes; the seam
delivers what other nodes send back into the hub's peers. Without one
(``fleet`` is None) the hub behaves, and performs, as a single node's: one
attribute test per forwarded request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from zope.interface import implementer

from gateway.codecs import ssmp
from gateway.core.batch import Answers
from gateway.core.flow import Congestion, Throttle, answer_when_drained
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.protocols.ssmp.mapping import (
    BCAST_ADDRESS,
    EventLines,
    bcast_event,
    ucast_event,
    ucast_peer,
)

__all__ = ["Hub", "HubLink", "HubPeer"]


class HubPeer(Protocol):
    """What the hub needs of a connected, logged-in peer."""

    identity: bytes
    topics: dict[bytes, bool]
    """Topics the peer subscribes to, with its PRESENCE flag."""
    congestion: Congestion
    """As a recipient: whether it is congested, whom it holds and who waits for it."""
    throttle: Throttle
    """As a publisher: the recipients holding it."""

    def queue(self, data: bytes, lines: int = 1) -> None:
        """Queue bytes (``lines`` SSMP lines) for the peer; they are written at the next flush."""

    def flush(self) -> None:
        """Write what is queued."""

    def evict(self, reason: str) -> None:
        """Close the connection because another took its identity."""


class HubLink(Protocol):
    """What the hub needs of its cross-node seam (`gateway.fleet.hub.FleetHub`).

    Everything is queued and sent on the next reactor turn, in the order it
    was asked for; answers (`ucast`) come later.
    """

    congestion: Congestion
    """Congested while the backbone cannot take more: the hub holds publishers on it."""

    def topic_added(self, topic: bytes) -> None:
        """``topic`` got its first local subscriber."""

    def topic_removed(self, topic: bytes) -> None:
        """``topic`` lost its last local subscriber."""

    def peer_added(self, peer: HubPeer) -> None:
        """A named peer logged in here (older connections elsewhere must go)."""

    def peer_removed(self, identity: bytes) -> None:
        """The named peer ``identity`` is no longer connected here."""

    def mcast(self, topic: bytes, data: bytes, lines: int = 1) -> None:
        """MCAST events (``lines`` of them) for other nodes' subscribers of ``topic``."""

    def ucast(self, to: bytes, line: bytes, answer: Callable[[Outcome], None]) -> None:
        """A UCAST event for ``to`` on another node; ``answer`` gets accepted, or 404 rejected."""

    def when_subscribed(self, topic: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once what other nodes publish to ``topic`` reaches this node.

        A SUBSCRIBE is answered then, so that every MCAST other nodes publish
        after the answer reaches the subscriber. At once without a
        connection to RabbitMQ (nothing crosses then anyway).
        """

    def bcast(self, sender: bytes, topics: Iterable[bytes], line: bytes) -> None:
        """A BCAST event for other nodes' peers sharing one of ``topics`` (at most once each)."""

    def bcast_all(self, sender: bytes, line: bytes) -> None:
        """A routed BCAST event for every named peer on other nodes but ``sender``."""

    def presence(self, topic: bytes, line: bytes) -> None:
        """A presence event of ``topic`` for other nodes' PRESENCE subscribers."""

    def roll_call(self, peer: HubPeer, topic: bytes) -> None:
        """``peer`` subscribed with PRESENCE: the other nodes' subscribers of ``topic``, please."""


@implementer(IDestination)
class Hub:
    """Peers and topics of one SSMP listener.

    Args:
        name: The listener's name (routes refer to it).
        clock: For scheduling flushes outside ``dataReceived``.
    """

    def __init__(self, name: str, clock: IReactorTime) -> None:
        self.name = name
        self._clock = clock
        self.peers: dict[bytes, HubPeer] = {}
        self.topics: dict[bytes, dict[HubPeer, bool]] = {}
        self._dirty: list[HubPeer] = []
        self._flush_call: IDelayedCall | None = None
        self.fleet: HubLink | None = None
        """The cross-node seam, with ``[fleet] amqp``; None: this node alone."""

    # --- output batching -------------------------------------------------

    def mark_dirty(self, peer: HubPeer) -> None:
        """Remember that ``peer`` has queued output (called once per batch)."""
        self._dirty.append(peer)

    def flush(
        self, producer: HubPeer | None = None, throttle: Throttle | None = None
    ) -> list[HubPeer]:
        """Write every peer's queued output, one write per peer.

        Args:
            producer: The peer whose read queued the output, if one did:
                every recipient congested after its write holds it, and so
                does the fleet's backbone while it cannot take more.
            throttle: Held instead of the producer's (what another node sent,
                `gateway.fleet.hub`): by every recipient congested after its write.

        Returns:
            The peers written to that are congested now.
        """
        if self._flush_call is not None:
            if self._flush_call.active():
                self._flush_call.cancel()
            self._flush_call = None
        congested: list[HubPeer] = []
        dirty = self._dirty
        while dirty:
            self._dirty = []
            for peer in dirty:
                peer.flush()
                if peer.congestion.congested:
                    congested.append(peer)
            dirty = self._dirty  # a flush may disconnect a peer and queue presence events
        if producer is not None:
            throttle = producer.throttle
            fleet = self.fleet
            if fleet is not None and fleet.congestion.congested:
                fleet.congestion.hold(throttle)
        if throttle is not None:
            for peer in congested:
                if peer is not producer:
                    peer.congestion.hold(throttle)
        return congested

    def schedule_flush(self) -> None:
        """Flush on the next reactor turn, once however often it is asked."""
        if self._flush_call is None:
            self._flush_call = self._clock.callLater(0, self.flush)

    # --- connections -------------------------------------------------------

    def attach(self, peer: HubPeer) -> None:
        """Register a peer that has logged in.

        Spec, "Named connections": upon successful login the server MUST
        close any previous connection that used the same identifier.
        Anonymous peers are not registered: nobody can address them.
        """
        if peer.identity == ssmp.ANONYMOUS:
            return
        previous = self.peers.get(peer.identity)
        if previous is not None and previous is not peer:
            self.detach(previous)
            previous.evict("the same identity logged in on another connection")
        self.peers[peer.identity] = peer
        if self.fleet is not None:
            self.fleet.peer_added(peer)

    def evict(self, identity: bytes, reason: str) -> None:
        """Close the connection of ``identity`` here: it logged in again on another node."""
        peer = self.peers.get(identity)
        if peer is not None:
            self.detach(peer)
            peer.evict(reason)

    def detach(self, peer: HubPeer) -> None:
        """Forget a peer whose connection ended, telling presence subscribers.

        Spec, "Closing connections": the server MUST send UNSUBSCRIBE events
        for all topics the client was subscribed to, whatever the reason.
        """
        if self.peers.get(peer.identity) is peer:
            del self.peers[peer.identity]
            if self.fleet is not None:
                self.fleet.peer_removed(peer.identity)
        for topic in list(peer.topics):
            self.unsubscribe(peer, topic)

    # --- subscriptions -------------------------------------------------------

    def subscribe(self, peer: HubPeer, topic: bytes, presence: bool) -> bool:
        """Subscribe a peer; False if it already was (the caller answers 409).

        Presence subscribers of the topic learn of the newcomer; a newcomer
        asking for PRESENCE gets the initial batch of current subscribers.
        """
        if topic in peer.topics:
            return False
        fleet = self.fleet
        subscribers = self.topics.get(topic)
        if subscribers is None:
            subscribers = self.topics[topic] = {}
            if fleet is not None:
                fleet.topic_added(topic)
        event = _presence_event(peer.identity, topic, presence)
        batch: list[bytes] = []
        for other, wants_presence in subscribers.items():
            if wants_presence:
                other.queue(event)
            if presence:
                batch.append(_presence_event(other.identity, topic, wants_presence))
        subscribers[peer] = presence
        peer.topics[topic] = presence
        if batch:
            peer.queue(b"".join(batch))
        if fleet is not None:
            fleet.presence(topic, event)
            if presence:
                fleet.roll_call(peer, topic)
        return True

    def unsubscribe(self, peer: HubPeer, topic: bytes) -> bool:
        """Unsubscribe a peer; False if it was not subscribed (404)."""
        if peer.topics.pop(topic, None) is None:
            return False
        subscribers = self.topics[topic]
        del subscribers[peer]
        event = b"000 " + peer.identity + b" UNSUBSCRIBE " + topic + b"\n"
        fleet = self.fleet
        if fleet is not None:
            fleet.presence(topic, event)
        if not subscribers:
            del self.topics[topic]
            if fleet is not None:
                fleet.topic_removed(topic)
            return True
        for other, wants_presence in subscribers.items():
            if wants_presence:
                other.queue(event)
        return True

    # --- forwarding ------------------------------------------------------------

    def mcast(self, sender: HubPeer | None, topic: bytes, event: bytes) -> None:
        """Queue an MCAST event for every subscriber of ``topic`` but its sender."""
        subscribers = self.topics.get(topic)
        if subscribers is not None:
            for peer in subscribers:
                if peer is not sender:
                    peer.queue(event)
        if self.fleet is not None:
            self.fleet.mcast(topic, event)

    def bcast(self, sender: HubPeer, event: bytes) -> None:
        """Queue a BCAST event once for every peer sharing a topic with the sender."""
        if self.fleet is not None and sender.topics:
            self.fleet.bcast(sender.identity, sender.topics, event)
        seen: set[HubPeer] = {sender}
        for topic in sender.topics:
            for peer in self.topics[topic]:
                if peer not in seen:
                    seen.add(peer)
                    peer.queue(event)

    # --- IDestination ------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch of routed messages as events; one outcome per message, at once.

        Each message goes to its address, or to each of its recipients (a
        QMQP message for several recipients that a route mapped to topics):
        a topic is delivered as MCAST events to its subscribers,
        ``!ucast.<peer>`` as a UCAST event to that peer and ``!bcast`` as a
        BCAST event to every named peer logged in, except one with the
        message sender's id (`gateway.protocols.ssmp.mapping`).

        SSMP delivery is best effort: a message is accepted once its events
        are queued, even for a topic nobody subscribes to (the spec's MCAST
        never answers 404). A message SSMP cannot carry (an empty body, one
        with LF, too long, an invalid topic or peer id) is rejected, and a
        UCAST to a peer that is not connected is rejected with code ``404``;
        a rejected message is delivered to none of its addresses.

        Consecutive MCASTs to one topic are queued on each subscriber as
        one buffer, and each peer gets one write for the whole batch. The
        outcomes are given once every recipient congested by it drained
        (or was cut as a slow consumer: what the hub took stays accepted).
        """
        outcomes: list[Outcome] = []
        answers: Answers | None = None
        """Outcomes to come from other nodes (UCASTs to peers not connected here)."""
        remote: set[int] = set()
        run_topic = b""
        run: list[bytes] = []
        events: Sequence[tuple[_Target, bytes]] | Outcome
        lines = EventLines()
        for message in messages:
            if not message.recipients and message.address[:1] != "!":
                encoded = lines.line(message, message.address)  # the common case: one topic
                events = encoded if isinstance(encoded, Outcome) else (encoded,)
            else:
                events = self._events(message, lines)
            if isinstance(events, Outcome):
                outcomes.append(events)
                continue
            for target, line in events:
                if isinstance(target, bytes):
                    if target != run_topic and run:
                        self._queue_run(run_topic, run)
                        run = []
                    run_topic = target
                    run.append(line)
                    continue
                if run:
                    self._queue_run(run_topic, run)
                    run = []
                if isinstance(target, _Everyone):
                    self._bcast_all(target.sender, line)
                elif isinstance(target, _Remote):
                    if answers is None:
                        answers = Answers(len(messages))
                    remote.add(len(outcomes))
                    assert self.fleet is not None
                    self.fleet.ucast(
                        target.identity, line, functools.partial(answers.settle, len(outcomes))
                    )
                else:
                    target.queue(line)
            outcomes.append(_ACCEPTED)
        if run:
            self._queue_run(run_topic, run)
        congested = self.flush() if self._dirty else []
        consumers = [peer.congestion for peer in congested]
        fleet = self.fleet
        if fleet is not None and fleet.congestion.congested:
            consumers.append(fleet.congestion)
        if answers is not None:
            # Once the other nodes answered the batch's UCASTs to peers not here.
            for index, outcome in enumerate(outcomes):
                if index not in remote:
                    answers.settle(index, outcome)
            if not consumers:
                return answers.deferred
            return answers.deferred.addCallback(lambda done: answer_when_drained(consumers, done))
        if not consumers:
            return succeed(outcomes)
        return answer_when_drained(consumers, outcomes)

    def _events(self, message: Message, lines: EventLines) -> list[tuple[_Target, bytes]] | Outcome:
        """A message's events, each with whom it goes to (see `_Target`); MCASTs from ``lines``.

        Returns the refusal instead when any of its addresses cannot be delivered.
        """
        events: list[tuple[_Target, bytes]] = []
        for address in message.recipients or (message.address,):
            peer_id = ucast_peer(address)
            if peer_id is not None:
                ucast = ucast_event(message, peer_id)
                if isinstance(ucast, Outcome):
                    return ucast
                peer = self.peers.get(ucast[0])
                if peer is not None:
                    events.append((peer, ucast[1]))
                elif self.fleet is not None:
                    events.append((_Remote(ucast[0]), ucast[1]))  # another node may have it
                else:
                    return Outcome.rejected(
                        f"no peer {peer_id!r} is connected to {self.name}", code="404"
                    )
            elif address == BCAST_ADDRESS:
                bcast = bcast_event(message)
                if isinstance(bcast, Outcome):
                    return bcast
                events.append((_Everyone(bcast[0]), bcast[1]))
            else:
                mcast = lines.line(message, address)
                if isinstance(mcast, Outcome):
                    return mcast
                events.append(mcast)
        return events

    def _queue_run(self, topic: bytes, lines: list[bytes]) -> None:
        """Queue consecutive MCAST events to one topic: one buffer per subscriber."""
        subscribers = self.topics.get(topic)
        if subscribers:
            data = lines[0] if len(lines) == 1 else b"".join(lines)
            count = len(lines)
            for peer in subscribers:
                peer.queue(data, count)
        if self.fleet is not None:
            self.fleet.mcast(topic, lines[0] if len(lines) == 1 else b"".join(lines), len(lines))

    def _bcast_all(self, sender: bytes, line: bytes) -> None:
        """Queue a routed BCAST event for every named peer but one with the sender's id."""
        for identity, peer in self.peers.items():
            if identity != sender:
                peer.queue(line)
        if self.fleet is not None:
            self.fleet.bcast_all(sender, line)


_ACCEPTED: Final = Outcome.accepted()


class _Everyone:
    """The recipients of a routed BCAST: every named peer but the sender's namesake."""

    __slots__ = ("sender",)

    def __init__(self, sender: bytes) -> None:
        self.sender = sender


class _Remote:
    """The recipient of a routed UCAST that is not connected here: maybe on another node."""

    __slots__ = ("identity",)

    def __init__(self, identity: bytes) -> None:
        self.identity = identity


_Target = bytes | HubPeer | _Everyone | _Remote
"""Whom an event goes to: a topic's subscribers (MCAST), one peer (UCAST, here or
perhaps on another node), or everyone."""


def _presence_event(identity: bytes, topic: bytes, presence: bool) -> bytes:
    tail = b" PRESENCE\n" if presence else b"\n"
    return b"000 " + identity + b" SUBSCRIBE " + topic + tail
