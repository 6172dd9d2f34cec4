"""The SSMP hub across nodes: the hub's cross-node seam over the node's backbone.

One `FleetHub` per SSMP hub listener, made by the assembly when ``[fleet]
amqp`` is set; it is the hub's ``fleet`` (`gateway.protocols.ssmp.hub.HubLink`).
All nodes of a fleet share one configuration, so a listener has the same
name on every node, and its hubs meet on one direct exchange,
``msggateway.hub.<listener>``, declared ``others_only``: each node is bound
there through its filter (`gateway.fleet.backbone`), so that what a node
publishes reaches every other node bound for its key and never comes back
to itself, and a mandatory message comes back when no other node is bound.
A node is bound there with the routing keys of what it has:

- ``t.<topic>`` while the topic has a subscriber on the node (the hub tells
  the first and the last: reference counting is the hub's topic table);
- ``p.<identity>`` while a named peer is logged in on the node;
- ``s.<topic>`` while the node holds the topic quiet (`gateway.fleet.quiet`);
- ``n.<node>`` (answers to this node) and ``all`` (routed BCASTs), always.

What crosses, each one AMQP message, its ``type`` saying what it is, its
body SSMP event lines written verbatim by the receiving node to its own peers:

- ``mcast`` to ``t.<topic>``: a run of consecutive MCAST events to one
  topic, from one reactor turn (the hub queues, the seam sends on the next
  turn: one AMQP message per run, not per event), header ``n`` = the lines;
  mandatory, and not published while no other node wants the topic (it is
  held *quiet*, `gateway.fleet.quiet`).
- ``ucast`` to ``p.<identity>``, mandatory: consecutive UCAST events to one
  peer. With publisher confirms, an ack means a node has the peer (200) and
  a return that none has (404: the spec's "no peer with the requested
  identifier is currently connected"); no connection to RabbitMQ answers
  ``400 retry:``.
- ``bcast``: routed to ``t.<first topic>`` with the sender's other topics
  in ``CC`` (RabbitMQ's sender-selected distribution: one copy per queue
  however many of its keys match), header ``topics``. The receiving node
  writes the event once to each of its peers sharing any of those topics,
  so that no peer of the fleet gets it twice (spec, "Broadcast"). A sender
  with more than `MAX_CC_TOPICS` topics broadcasts to ``all`` instead.
  ``bcast-all`` to ``all``: a routed BCAST, for every named peer.
- ``presence`` to ``t.<topic>``: SUBSCRIBE and UNSUBSCRIBE events; each
  node writes them to its PRESENCE subscribers of the topic.
- ``evict`` to ``p.<identity>``: a login of that identity, with its time.
- ``roll-call`` to ``t.<topic>`` and ``roll-answer`` to ``n.<node>``: the
  initial presence batch across nodes (below).
- ``probe`` to ``t.<topic>``, ``interest`` to ``s.<topic>`` and
  ``interest-ok`` to ``n.<node>``: quiet topics (`gateway.fleet.quiet`). A
  SUBSCRIBE to a topic new to the node is answered ``200`` once its binding
  took effect and no node holds the topic quiet any more.

Nothing a node publishes comes back to it (its filter); it drops what would
all the same: its own peers had it already, from its hub.

Order. A node publishes on one channel in the order its hub queued, and
RabbitMQ keeps a channel's order into each queue; each node handles its
queue in order. So two messages from one sender to one recipient arrive in
order wherever they are (spec, "Messages": in-order), and a presence
UNSUBSCRIBE never overtakes the SUBSCRIBE of the same subscription.

LOGIN takeover (spec, "Named connections": upon successful login the server
MUST close any previous connection that used the same identifier). A node
binds ``p.<identity>`` for a new login, then, once the binding took effect,
publishes ``evict`` with the login's time to ``p.<identity>``. A node
holding an older login of that identity closes it; one holding a newer
login answers with its own ``evict``. Binding before publishing means that
of two logins racing on two nodes at least one node hears of the other, so
the older always goes. "Older" is by the nodes' clocks (then by node id):
clocks apart by more than the time between two logins of one identity can
close the newer one.

Presence's initial batch. Spec, "Presence notifications": a subscriber with
PRESENCE "will receive an initial batch of SUBSCRIBE events for all current
subscribers". The local ones come from the hub at once. For the others, the
node binds ``t.<topic>`` (if not already), waits until the binding took
effect, and publishes a ``roll-call`` to ``t.<topic>``: every node with
subscribers of the topic answers with a ``roll-answer`` listing them, on the
channel it publishes its presence events on. For `ROLL_CALL_SECONDS` the
newcomer's view is kept: a live presence event from another node that its
answer already covers (or that came before the subscription it would
cancel) is not written twice, so each remote subscriber is announced once
and an UNSUBSCRIBE never precedes the SUBSCRIBE it cancels.
Spec ambiguity: the spec's "initial batch" is one batch on one server; across
nodes it arrives node by node, each node's part in order with that node's
later events, within `ROLL_CALL_SECONDS` (answers later than that are
dropped, logged and counted: the node was stalled that long).

Back-pressure: the hub holds a local publisher on `congestion` (the
backbone's confirm window, the broker's connection.blocked); what arrives
from other nodes is written to the local peers, and a peer congested by it
holds the backbone's ``receiving`` throttle, so the backbone acknowledges
nothing more (prefetch) until it drained.

The gap: without a connection (`gateway.fleet.backbone`), what this node
would send to others is dropped and counted, a UCAST to a peer not here is
answered ``400 retry:``, and what others send to this node is lost. When the
connection is back the bindings are declared again, and every local login
is announced again (``evict``), so that an identity that logged in on
another node meanwhile keeps only its newest connection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Final

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.core.flow import Congestion
from gateway.core.interfaces import IBackbone
from gateway.core.message import Outcome
from gateway.fleet.backbone import Delivery, Published
from gateway.fleet.quiet import INTEREST, INTEREST_OK, PROBE, QuietTopics
from gateway.protocols.ssmp.hub import Hub, HubPeer

__all__ = [
    "ALL_KEY",
    "MAX_BODY_BYTES",
    "MAX_CC_TOPICS",
    "ROLL_CALL_SECONDS",
    "FleetHub",
    "exchange_name",
]

MAX_BODY_BYTES: Final = 64 * 1024
"""A run of events is cut into AMQP messages of at most this many bytes (one frame of
RabbitMQ's default 128 KiB frame_max, and a small share of a node's prefetch window)."""
MAX_CC_TOPICS: Final = 64
"""A BCAST sender with more topics than this broadcasts to every node (``all``) rather than
naming each topic in the CC header."""
COALESCE_SECONDS: Final = 0.0005
"""What is queued this soon after a flush waits for the rest of this long: at a paced
10,000 MCASTs a second, each in a read of its own, one AMQP message per MCAST kept pika,
RabbitMQ and both nodes near two cores' worth of work on this machine (p99 25-80 ms), where
five per message cost a fifth of that. Slower than one per this long, nothing waits."""
ROLL_CALL_SECONDS: Final = 5.0
"""How long a PRESENCE newcomer's roll call waits for other nodes' answers. Answers take a
broker round trip; only a node stalled by congestion takes longer."""
ALL_KEY: Final = "all"

_MCAST: Final = "mcast"
_UCAST: Final = "ucast"
_BCAST: Final = "bcast"
_BCAST_ALL: Final = "bcast-all"
_PRESENCE: Final = "presence"
_EVICT: Final = "evict"
_ROLL_CALL: Final = "roll-call"
_ROLL_ANSWER: Final = "roll-answer"

_NO_FLEET: Final = Outcome.retry("the fleet's broker is not reachable from this node")


def exchange_name(listener: str) -> str:
    """The direct exchange where the hubs of listener ``listener`` meet."""
    return f"msggateway.hub.{listener}"


class _Run:
    """Consecutive events of one kind to one routing key, to go as one AMQP message."""

    __slots__ = ("answers", "count", "headers", "key", "kind", "parts", "size")

    def __init__(
        self,
        kind: str,
        key: bytes,
        data: bytes,
        count: int,
        headers: dict[str, Any] | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self.parts = [data]
        self.count = count
        self.size = len(data)
        self.headers = headers
        self.answers: list[Callable[[Outcome], None]] | None = None


class _RollCall:
    """A PRESENCE newcomer's roll call: whom it was told of, from other nodes."""

    __slots__ = ("peer", "told", "topic")

    def __init__(self, peer: HubPeer, topic: bytes) -> None:
        self.peer = peer
        self.topic = topic
        self.told: set[bytes] = set()


class FleetHub:
    """One hub listener's seam to the other nodes of the fleet.

    Args:
        hub: The listener's hub; this becomes its ``fleet``.
        backbone: The node's backbone.
        clock: For batching per reactor turn and the roll calls' window.
        coalesce_seconds: How long after a flush what is queued waits for more
            (`COALESCE_SECONDS`; 0: flush on the next turn every time).
    """

    _log = Logger()

    def __init__(
        self,
        hub: Hub,
        backbone: IBackbone,
        clock: IReactorTime,
        coalesce_seconds: float = COALESCE_SECONDS,
    ) -> None:
        self.hub = hub
        self.backbone = backbone
        self._clock = clock
        self.node: str = backbone.node
        self.exchange = exchange_name(hub.name)
        self.congestion: Congestion = backbone.congestion
        self._out: list[_Run] = []
        self._flush_call: IDelayedCall | None = None
        self._flushed_at = float("-inf")
        self._coalesce = coalesce_seconds
        self._logins: dict[bytes, int] = {}
        """Local logins by identity, with their time in microseconds (AMQP tables have no
        floats that pika encodes)."""
        self._roll_calls: dict[int, _RollCall] = {}
        self._open: dict[tuple[HubPeer, bytes], _RollCall] = {}
        self._roll_call_ids = 0
        self.late_answers = 0
        """Roll-call answers that came after `ROLL_CALL_SECONDS` (dropped)."""
        self.evictions = 0
        """Local connections closed for a newer login of their identity on another node."""
        self.quiet = QuietTopics(backbone, self.exchange, clock, hub.name)
        self._held = self.quiet.held
        self._receivers: dict[str, Callable[[Delivery], None]] = {
            _MCAST: self._got_mcast,
            _UCAST: self._got_ucast,
            _BCAST: self._got_bcast,
            _BCAST_ALL: self._got_bcast_all,
            _PRESENCE: self._got_presence,
            _EVICT: self._got_evict,
            _ROLL_CALL: self._got_roll_call,
            _ROLL_ANSWER: self._got_roll_answer,
            PROBE: _ignore,
            INTEREST: self.quiet.got_interest,
            INTEREST_OK: self.quiet.got_interest_ok,
        }
        backbone.declare_exchange(self.exchange, others_only=True)
        backbone.consume(self.exchange, self._delivered)
        backbone.bind(self.exchange, f"n.{self.node}")
        backbone.bind(self.exchange, ALL_KEY)
        backbone.on_connected(self._connected)
        backbone.on_lost(self.quiet.lost)
        hub.fleet = self

    # --- HubLink: what the hub tells -------------------------------------------------------

    def topic_added(self, topic: bytes) -> None:
        """Bind ``t.<topic>`` (the first local subscriber); tell nodes holding it quiet."""
        self.backbone.bind(self.exchange, "t." + topic.decode("ascii"))
        self.quiet.topic_added(topic)

    def topic_removed(self, topic: bytes) -> None:
        """Unbind ``t.<topic>``: the last local subscriber went."""
        self.backbone.unbind(self.exchange, "t." + topic.decode("ascii"))

    def when_subscribed(self, topic: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once what other nodes publish to ``topic`` reaches this node.

        That is once the binding took effect and no node holds the topic
        quiet. At once without a connection to RabbitMQ: nothing crosses
        then anyway.
        """
        self.quiet.when_subscribed(topic, callback)

    def peer_added(self, peer: HubPeer) -> None:
        """Bind ``p.<identity>``, then tell the node with an older login of it to close that."""
        identity = peer.identity
        login = int(self._clock.seconds() * 1_000_000)
        self._logins[identity] = login
        self.backbone.bind(self.exchange, "p." + identity.decode("ascii"))
        self.backbone.when_bound(lambda: self._announce(identity, login))

    def peer_removed(self, identity: bytes) -> None:
        """Unbind ``p.<identity>``."""
        self._logins.pop(identity, None)
        self.backbone.unbind(self.exchange, "p." + identity.decode("ascii"))

    def mcast(self, topic: bytes, data: bytes, lines: int = 1) -> None:
        """Queue MCAST events for other nodes: consecutive ones to a topic share a message."""
        held = self._held
        if topic in held:  # held quiet: counted, not published (QuietTopics.held)
            held[topic] += lines
            return
        out = self._out
        if out:
            last = out[-1]
            if (
                last.kind is _MCAST
                and last.key == topic
                and last.size + len(data) <= MAX_BODY_BYTES
            ):
                last.parts.append(data)
                last.count += lines
                last.size += len(data)
                return
        out.append(_Run(_MCAST, topic, data, lines))
        if self._flush_call is None:
            self._schedule()

    def ucast(self, to: bytes, line: bytes, answer: Callable[[Outcome], None]) -> None:
        """Queue a UCAST event for the node that has ``to``; ``answer`` gets its outcome."""
        out = self._out
        last = out[-1] if out else None
        if (
            last is not None
            and last.kind is _UCAST
            and last.key == to
            and last.size + len(line) <= MAX_BODY_BYTES
        ):
            last.parts.append(line)
            last.count += 1
            last.size += len(line)
        else:
            last = _Run(_UCAST, to, line, 1)
            out.append(last)
            self._schedule()
        if last.answers is None:
            last.answers = [answer]
        else:
            last.answers.append(answer)

    def bcast(self, sender: bytes, topics: Iterable[bytes], line: bytes) -> None:
        """Queue a BCAST event for other nodes' peers sharing one of ``topics``."""
        names = [topic.decode("ascii") for topic in topics]
        self._queue(_Run(_BCAST, b"", line, 1, {"topics": names, "sender": sender.decode()}))

    def bcast_all(self, sender: bytes, line: bytes) -> None:
        """Queue a routed BCAST event for every named peer on other nodes but ``sender``."""
        self._queue(_Run(_BCAST_ALL, b"", line, 1, {"sender": sender.decode("ascii")}))

    def presence(self, topic: bytes, line: bytes) -> None:
        """Queue a presence event of ``topic`` for other nodes; consecutive ones share one."""
        out = self._out
        if out:
            last = out[-1]
            if last.kind is _PRESENCE and last.key == topic and last.size < MAX_BODY_BYTES:
                last.parts.append(line)
                last.count += 1
                last.size += len(line)
                return
        self._queue(_Run(_PRESENCE, topic, line, 1))

    def roll_call(self, peer: HubPeer, topic: bytes) -> None:
        """Ask the other nodes with subscribers of ``topic`` for them, for ``peer``."""
        self._roll_call_ids += 1
        number = self._roll_call_ids
        call = _RollCall(peer, topic)
        self._roll_calls[number] = call
        self._open[(peer, topic)] = call
        self._clock.callLater(ROLL_CALL_SECONDS, self._roll_call_over, number)
        headers = {"id": number, "reply": f"n.{self.node}"}

        def call_the_roll() -> None:
            if number in self._roll_calls:  # not over (a gap can outlast it)
                self._queue(_Run(_ROLL_CALL, topic, b"", 0, headers))

        # Once t.<topic> is bound, every event after a node's answer reaches this node.
        self.backbone.when_bound(call_the_roll)

    # --- sending ------------------------------------------------------------------------------

    def _queue(self, run: _Run) -> None:
        self._out.append(run)
        self._schedule()

    def _schedule(self) -> None:
        """Flush on the next turn, or `COALESCE_SECONDS` after the last flush if sooner."""
        if self._flush_call is None:
            wait = self._flushed_at + self._coalesce - self._clock.seconds()
            self._flush_call = self._clock.callLater(max(wait, 0.0), self.flush)

    def flush(self) -> None:
        """Publish what was queued, one AMQP message per run, in order."""
        self._flush_call = None
        self._flushed_at = self._clock.seconds()
        out, self._out = self._out, []
        backbone = self.backbone
        exchange = self.exchange
        for run in out:
            kind = run.kind
            body = run.parts[0] if len(run.parts) == 1 else b"".join(run.parts)
            if kind is _MCAST:
                self.quiet.publish_mcast(run.key, body, run.count)
            elif kind is _UCAST:
                answers = run.answers or []
                backbone.publish(
                    exchange,
                    "p." + run.key.decode("ascii"),
                    body,
                    kind=kind,
                    headers={"n": run.count},
                    mandatory=True,
                    on_result=functools.partial(_answer_all, answers, to=run.key),
                )
            elif kind is _BCAST:
                headers = run.headers or {}
                topics: list[str] = headers.get("topics", [])
                if len(topics) <= MAX_CC_TOPICS:
                    keys = ["t." + topic for topic in topics]
                    backbone.publish(
                        exchange, keys[0], body, kind=kind, headers=headers, cc=keys[1:]
                    )
                else:
                    backbone.publish(exchange, ALL_KEY, body, kind=kind, headers=headers)
            elif kind is _BCAST_ALL:
                backbone.publish(exchange, ALL_KEY, body, kind=kind, headers=run.headers)
            elif kind is _PRESENCE or kind is _ROLL_CALL:
                key = "t." + run.key.decode("ascii")
                backbone.publish(exchange, key, body, kind=kind, headers=run.headers)
            else:  # evict, roll-answer: the key is written out
                backbone.publish(
                    exchange, run.key.decode("ascii"), body, kind=kind, headers=run.headers
                )

    def _announce(self, identity: bytes, login: int) -> None:
        """Tell every node with a login of ``identity`` about ours (the older one goes)."""
        if self._logins.get(identity) != login:
            return  # gone, or replaced here, meanwhile
        self._queue(_Run(_EVICT, b"p." + identity, b"", 0, {"login": login}))

    def _connected(self) -> None:
        """After a gap: announce every login again, so that an identity has one connection.

        And every topic with local subscribers (`QuietTopics.connected`).
        """
        for identity, login in list(self._logins.items()):
            self._queue(_Run(_EVICT, b"p." + identity, b"", 0, {"login": login}))
        self.quiet.connected(list(self.hub.topics))

    def _roll_call_over(self, number: int) -> None:
        call = self._roll_calls.pop(number, None)
        if call is not None and self._open.get((call.peer, call.topic)) is call:
            del self._open[(call.peer, call.topic)]

    # --- receiving ----------------------------------------------------------------------------

    def _delivered(self, delivery: Delivery) -> None:
        """Write what another node sent to the local peers it is for."""
        if delivery.origin == self.node:
            return  # our own: our peers had it from our hub
        receiver = self._receivers.get(delivery.kind)
        if receiver is None:
            self._log.warn(
                "fleet: {listener}: unknown message type {kind!r} from node {origin}; dropped",
                listener=self.hub.name,
                kind=delivery.kind,
                origin=delivery.origin,
            )
            return
        receiver(delivery)
        self.hub.flush(throttle=self.backbone.receiving)

    def _got_mcast(self, delivery: Delivery) -> None:
        subscribers = self.hub.topics.get(delivery.routing_key[2:].encode("ascii"))
        if subscribers:
            count = int(delivery.headers.get("n", 1))
            body = delivery.body
            for peer in subscribers:
                peer.queue(body, count)

    def _got_ucast(self, delivery: Delivery) -> None:
        peer = self.hub.peers.get(delivery.routing_key[2:].encode("ascii"))
        if peer is not None:
            peer.queue(delivery.body, int(delivery.headers.get("n", 1)))

    def _got_bcast(self, delivery: Delivery) -> None:
        sender = str(delivery.headers.get("sender", "")).encode("ascii")
        topics = self.hub.topics
        seen: set[HubPeer] = set()
        for name in delivery.headers.get("topics", ()):
            for peer in topics.get(str(name).encode("ascii"), ()):
                if peer not in seen and peer.identity != sender:
                    seen.add(peer)
                    peer.queue(delivery.body)

    def _got_bcast_all(self, delivery: Delivery) -> None:
        sender = str(delivery.headers.get("sender", "")).encode("ascii")
        for identity, peer in self.hub.peers.items():
            if identity != sender:
                peer.queue(delivery.body)

    def _got_presence(self, delivery: Delivery) -> None:
        topic = delivery.routing_key[2:].encode("ascii")
        subscribers = self.hub.topics.get(topic)
        if not subscribers:
            return
        body = delivery.body
        lines: list[bytes] | None = None
        for peer, wants_presence in subscribers.items():
            if not wants_presence:
                continue
            call = self._open.get((peer, topic))
            if call is None:
                peer.queue(body, body.count(b"\n"))
                continue
            if lines is None:
                lines = body.splitlines(keepends=True)
            for line in lines:
                _, identity, verb, _ = line.split(b" ", 3)
                if verb == b"SUBSCRIBE":
                    if identity in call.told:
                        continue
                    call.told.add(identity)
                elif identity in call.told:
                    call.told.discard(identity)
                else:
                    continue  # before the newcomer's time: its SUBSCRIBE was never told
                peer.queue(line)

    def _got_evict(self, delivery: Delivery) -> None:
        identity = delivery.routing_key[2:].encode("ascii")
        mine = self._logins.get(identity)
        if mine is None or identity not in self.hub.peers:
            return
        theirs = int(delivery.headers.get("login", 0))
        if (mine, self.node) < (theirs, delivery.origin):
            self.evictions += 1
            self._log.info(
                "fleet: {listener}: {identity} logged in on node {origin}; closing its older"
                " connection here",
                listener=self.hub.name,
                identity=identity.decode("ascii"),
                origin=delivery.origin,
            )
            self.hub.evict(identity, f"the same identity logged in on node {delivery.origin}")
        else:
            self._announce(identity, mine)  # ours is newer: the other must go

    def _got_roll_call(self, delivery: Delivery) -> None:
        topic = delivery.routing_key[2:].encode("ascii")
        subscribers = self.hub.topics.get(topic, {})
        lines = [
            b"000 " + peer.identity + b" SUBSCRIBE " + topic + (b" PRESENCE\n" if flag else b"\n")
            for peer, flag in subscribers.items()
        ]
        reply = str(delivery.headers.get("reply", "")).encode("ascii")
        headers = {"id": delivery.headers.get("id", 0)}
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if size + len(line) > MAX_BODY_BYTES and chunk:
                self._queue(_Run(_ROLL_ANSWER, reply, b"".join(chunk), len(chunk), headers))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        self._queue(_Run(_ROLL_ANSWER, reply, b"".join(chunk), len(chunk), headers))

    def _got_roll_answer(self, delivery: Delivery) -> None:
        call = self._roll_calls.get(int(delivery.headers.get("id", 0)))
        if call is None:
            if delivery.body:
                self.late_answers += 1
                self._log.warn(
                    "fleet: {listener}: node {origin} answered a roll call after {seconds:g} s;"
                    " its subscribers are not announced to that PRESENCE subscriber",
                    listener=self.hub.name,
                    origin=delivery.origin,
                    seconds=ROLL_CALL_SECONDS,
                )
            return
        peer = call.peer
        if call.topic not in peer.topics:
            return  # unsubscribed, or gone, meanwhile
        for line in delivery.body.splitlines(keepends=True):
            identity = line.split(b" ", 2)[1]
            if identity not in call.told and identity != peer.identity:
                call.told.add(identity)
                peer.queue(line)


def _ignore(delivery: Delivery) -> None:
    """A probe: nothing to deliver (it only asks whether another node is bound)."""


def _answer_all(answers: list[Callable[[Outcome], None]], result: Published, *, to: bytes) -> None:
    """Give each UCAST of one AMQP message the outcome its confirm says."""
    if result is Published.ROUTED:
        outcome = Outcome.accepted()
    elif result is Published.UNROUTABLE:
        outcome = Outcome.rejected(
            f"no peer {to.decode('ascii')!r} is connected to any node", code="404"
        )
    elif result is Published.LOST:
        outcome = _NO_FLEET
    else:
        outcome = Outcome.retry("RabbitMQ refused the message (nack)")
    for answer in answers:
        answer(outcome)
