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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from zope.interface import implementer

from gateway.codecs import ssmp
from gateway.core.flow import Congestion, Throttle, answer_when_drained
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.protocols.ssmp.mapping import (
    BCAST_ADDRESS,
    bcast_event,
    event_line,
    ucast_event,
    ucast_peer,
)

__all__ = ["Hub", "HubPeer"]


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

    # --- output batching -------------------------------------------------

    def mark_dirty(self, peer: HubPeer) -> None:
        """Remember that ``peer`` has queued output (called once per batch)."""
        self._dirty.append(peer)

    def flush(self, producer: HubPeer | None = None) -> list[HubPeer]:
        """Write every peer's queued output, one write per peer.

        Args:
            producer: The peer whose read queued the output, if one did:
                every recipient congested after its write holds it.

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
            for peer in congested:
                if peer is not producer:
                    peer.congestion.hold(producer.throttle)
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

    def detach(self, peer: HubPeer) -> None:
        """Forget a peer whose connection ended, telling presence subscribers.

        Spec, "Closing connections": the server MUST send UNSUBSCRIBE events
        for all topics the client was subscribed to, whatever the reason.
        """
        if self.peers.get(peer.identity) is peer:
            del self.peers[peer.identity]
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
        subscribers = self.topics.get(topic)
        if subscribers is None:
            subscribers = self.topics[topic] = {}
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
        return True

    def unsubscribe(self, peer: HubPeer, topic: bytes) -> bool:
        """Unsubscribe a peer; False if it was not subscribed (404)."""
        if peer.topics.pop(topic, None) is None:
            return False
        subscribers = self.topics[topic]
        del subscribers[peer]
        if not subscribers:
            del self.topics[topic]
            return True
        event = b"000 " + peer.identity + b" UNSUBSCRIBE " + topic + b"\n"
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

    def bcast(self, sender: HubPeer, event: bytes) -> None:
        """Queue a BCAST event once for every peer sharing a topic with the sender."""
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
        run_topic = b""
        run: list[bytes] = []
        events: Sequence[tuple[_Target, bytes]] | Outcome
        for message in messages:
            if not message.recipients and message.address[:1] != "!":
                encoded = event_line(message, message.address)  # the common case: one topic
                events = encoded if isinstance(encoded, Outcome) else (encoded,)
            else:
                events = self._events(message)
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
                else:
                    target.queue(line)
            outcomes.append(_ACCEPTED)
        if run:
            self._queue_run(run_topic, run)
        if not self._dirty:
            return succeed(outcomes)
        congested = self.flush()
        if not congested:
            return succeed(outcomes)
        return answer_when_drained([peer.congestion for peer in congested], outcomes)

    def _events(self, message: Message) -> list[tuple[_Target, bytes]] | Outcome:
        """A message's events, each with whom it goes to (see `_Target`).

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
                if peer is None:
                    return Outcome.rejected(
                        f"no peer {peer_id!r} is connected to {self.name}", code="404"
                    )
                events.append((peer, ucast[1]))
            elif address == BCAST_ADDRESS:
                bcast = bcast_event(message)
                if isinstance(bcast, Outcome):
                    return bcast
                events.append((_Everyone(bcast[0]), bcast[1]))
            else:
                mcast = event_line(message, address)
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

    def _bcast_all(self, sender: bytes, line: bytes) -> None:
        """Queue a routed BCAST event for every named peer but one with the sender's id."""
        for identity, peer in self.peers.items():
            if identity != sender:
                peer.queue(line)


_ACCEPTED: Final = Outcome.accepted()


class _Everyone:
    """The recipients of a routed BCAST: every named peer but the sender's namesake."""

    __slots__ = ("sender",)

    def __init__(self, sender: bytes) -> None:
        self.sender = sender


_Target = bytes | HubPeer | _Everyone
"""Whom an event goes to: a topic's subscribers (MCAST), one peer (UCAST), or everyone."""


def _presence_event(identity: bytes, topic: bytes, presence: bool) -> bytes:
    tail = b" PRESENCE\n" if presence else b"\n"
    return b"000 " + identity + b" SUBSCRIBE " + topic + tail
