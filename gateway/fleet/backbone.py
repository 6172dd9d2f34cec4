"""The node's one AMQP 0-9-1 connection to RabbitMQ: what crosses gateway processes.

DESIGN.md, "Scale: a fleet on RabbitMQ". Every gateway process of a fleet
(a node) holds one connection to RabbitMQ, made with pika's Twisted adapter
(`pika.adapters.twisted_connection.TwistedProtocolConnection`), and one
channel on it in publisher-confirm mode. Its users (the SSMP hub's
cross-node seam, `gateway.fleet.hub`; later the fleet's locks, stream
ownership and the DMP and MTL paths) register what they need, and the
backbone declares it on every (re)connection:

- exchanges (`declare_exchange`): durable, so that they outlive any node.
  One declared ``others_only`` never brings this node's own messages back
  to it: the node's bindings to it go through the node's *filter* (below);
- this node's queue: exclusive, named ``msggateway.<node>.<random>`` (one
  name per connection: a reconnection never waits for RabbitMQ to forget
  the queue of the connection that died), deleted by RabbitMQ with all its
  bindings when the connection dies, so that a dead node leaves nothing
  routed to it;
- the node's filter, for ``others_only`` exchanges: a headers exchange
  ``msggateway.node.<node>`` bound there with each of the node's keys (an
  exchange-to-exchange binding), whose one binding sends what carries this
  node's id in its ``o`` header (everything it publishes to such an
  exchange) to ``msggateway.void``, an exchange bound to nothing; the
  rest, unmatched there, goes on through its alternate exchange
  ``msggateway.node.<node>.queue`` (fanout) to the node's queue. So a
  message reaches every node bound for its key but its publisher, and a
  mandatory one comes back (`Published.UNROUTABLE`) when no *other* node
  is bound. The filter outlives a connection (exchanges are not exclusive):
  each connection deletes it and declares it again, which drops the
  bindings of the node's earlier connections; while the node has no
  connection, what its filter takes goes nowhere (its alternate exchange is
  bound to no queue), as if it had no bindings;
- the queue's bindings (`bind`, `unbind`): kept as a set in memory,
  declared again after a reconnection, and changed in batches of at most
  `BIND_BATCH` per round trip (nowait binds, then a barrier: a synchronous
  method whose answer says every earlier one took effect), because
  RabbitMQ serialises a channel's methods and a queue with many thousands
  of bindings stalls publishing when it is deleted (rabbitmq-server#12926).
  `when_bound` calls back once what was asked so far is in place;
- consumers (`consume`): a handler per exchange for what arrives on the
  node's queue;
- streams replayed (`replay`): a durable RabbitMQ stream (``x-queue-type``
  ``stream``) declared with its arguments, and consumed on the backbone's
  channel from its first message, again after every reconnection, under
  the same prefetch and acknowledgements as the node's queue: every node
  reads the whole stream (the fleet's lease revocations,
  `gateway.fleet.leases`). Its deliveries name the stream as their
  ``exchange``;
- exclusive queues claimed (`claim`) and released (`release`) on a channel
  of their own (`gateway.fleet.exclusive`): the fleet's locks
  (`gateway.fleet.locks`). They belong to the connection, not to what is
  declared again: a reconnection holds none of them until claimed again.

Publishing (`publish`) takes one AMQP message (the users batch: one message
per run of events, never one per event), optionally ``mandatory``, with a
``CC`` list (RabbitMQ's sender-selected distribution: one copy per queue
however many of the keys match it) and headers. A publish that wants its
result gets one `Published` value per message, from publisher confirms:
`Published.ROUTED` on the broker's ack, `Published.UNROUTABLE` when a
mandatory message came back (basic.return, which RabbitMQ sends before the
ack of the same message), `Published.NACKED`, or `Published.LOST` when the
connection ended first (or there was none). The results are plain callbacks
in a dict by sequence number: no Deferred per message.

Back-pressure (DESIGN.md, "Back-pressure before loss"; `gateway.core.flow`):

- publishing: ``congestion`` is congested while more than
  ``max_unconfirmed`` messages or ``max_unconfirmed_bytes`` bytes wait for
  their confirm, or while the broker blocked the connection
  (connection.blocked: a memory or disk alarm). Users hold their local
  producers on it (a publisher's `Throttle`), so that a broker that cannot
  keep up slows the gateway's own publishers instead of filling its memory.
  It drains at half the limits. Without a connection nothing is held:
  what would be published is dropped and counted (the gap).
- receiving: deliveries are acknowledged manually, at most ``prefetch``
  unacknowledged at a time. A user that wrote a delivery to congested local
  consumers holds ``receiving`` (a `Throttle`): the backbone then takes no
  further delivery and acknowledges nothing until it is released, so that
  a slow consumer on this node makes RabbitMQ keep the node's backlog in
  its queue, not this process.

Reconnection: the endpoints are tried in turn, the next one at once after a
loss, then again with a back-off (`reconnect_delay`) once all of them
failed. A connection that is not ready within `CONNECT_TIMEOUT_SECONDS` is
given up. While there is none (`lost_since`), other nodes reach nothing of
this one and this one nothing of them: the gap is logged, with its length
and what was dropped, and counted (`gateway.metrics.BackboneStats`).

pika's Twisted adapter wraps channel methods in Deferreds: one per publish
in confirm mode, one per consumed message (a DeferredQueue), and it
remembers only one returned message between two confirms, so that a
multiple ack after two returns would credit the wrong one. The backbone
therefore uses the pika `Connection` behind the adapter (its ``_impl``)
and plain pika channels with callbacks; `tests/fleet/test_backbone.py`
checks that pika still has it.
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import pika
import pika.channel
import pika.connection
import pika.frame
import pika.spec
from pika.adapters.twisted_connection import TwistedProtocolConnection
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.flow import Congestion, Throttle
from gateway.core.interfaces import IBackbone
from gateway.fleet.exclusive import ExclusiveQueues
from gateway.metrics import BackboneStats, GatewayMetrics
from gateway.protocols.tcp import disable_nagle

__all__ = [
    "ACK_DELAY_SECONDS",
    "BIND_BATCH",
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_MAX_UNCONFIRMED",
    "DEFAULT_MAX_UNCONFIRMED_BYTES",
    "DEFAULT_PREFETCH",
    "ORIGIN_HEADER",
    "VOID_EXCHANGE",
    "Backbone",
    "Delivery",
    "Published",
    "filter_exchange",
    "heartbeat_interval",
    "make_backbone",
    "reconnect_delay",
]

BIND_BATCH: Final = 512
"""Binding changes sent per round trip: publishing on the channel waits behind at most
this many (RabbitMQ serialises a channel's methods)."""
CONNECT_TIMEOUT_SECONDS: Final = 3.0
"""An attempt that is not ready (TCP, TLS, AMQP handshake) in this time is given up for
the next endpoint: a black-holed broker must not eat the fleet's reconnection budget."""
DEFAULT_PREFETCH: Final = 64
"""Unacknowledged deliveries RabbitMQ sends this node at most: each is a batch (many SSMP
events), so this keeps the pipe full at a loopback round trip without holding much."""
ACK_DELAY_SECONDS: Final = 0.005
"""Deliveries are acknowledged (one ``multiple`` ack) once half the prefetch window was
handled, or this long after the first one not acknowledged yet: one ack per delivery at a
paced 10,000 a second cost a socket write and a reactor timer each."""
DEFAULT_MAX_UNCONFIRMED: Final = 1024
"""Published messages awaiting their confirm past which local publishers are held."""
DEFAULT_MAX_UNCONFIRMED_BYTES: Final = 8 * 1024 * 1024
"""Published bytes awaiting their confirm past which local publishers are held."""
ORIGIN_HEADER: Final = "o"
"""The header with the publishing node's id, which its filter matches (``others_only``)."""
VOID_EXCHANGE: Final = "msggateway.void"
"""A fanout exchange bound to nothing: where a node's filter sends the node's own messages."""
_FIRST_BACKOFF_SECONDS: Final = 0.25
_MAX_BACKOFF_SECONDS: Final = 5.0
_STOP_SECONDS: Final = 5.0
"""How long a clean stop waits for RabbitMQ to close the connection before aborting it."""


def heartbeat_interval(heartbeat_seconds: float) -> int:
    """The AMQP heartbeat the backbone asks for: whole seconds, at least one."""
    return max(1, round(heartbeat_seconds))


def filter_exchange(node: str) -> str:
    """The headers exchange through which ``node`` is bound to ``others_only`` exchanges."""
    return f"msggateway.node.{node}"


def reconnect_delay(attempt: int, endpoints: int) -> float:
    """Seconds before reconnection attempt ``attempt`` (from 0) over ``endpoints`` endpoints.

    Every endpoint is tried once at once (another cluster node is usually
    up when one died); then each further round waits twice as long as the
    one before, from 0.25 s up to 5 s.
    """
    rounds = attempt // max(endpoints, 1)
    if rounds == 0:
        return 0.0
    return float(min(_MAX_BACKOFF_SECONDS, _FIRST_BACKOFF_SECONDS * 2 ** (rounds - 1)))


class Published(enum.Enum):
    """What became of one published message (its publisher confirm)."""

    ROUTED = "routed"
    """The broker took it (and, mandatory, routed it to at least one queue)."""
    UNROUTABLE = "unroutable"
    """Mandatory, and no queue was bound for it: it came back."""
    NACKED = "nacked"
    """The broker refused it (an internal error)."""
    LOST = "lost"
    """The connection ended before the broker answered, or there was none."""


@attrs.frozen(slots=True)
class Delivery:
    """A message that arrived on this node's queue.

    Attributes:
        exchange: The exchange it was published to (which user it is for).
        routing_key: Its routing key.
        origin: The node that published it (its ``app_id``).
        kind: Its ``type`` property (what the user made of it).
        headers: Its headers.
        body: Its body.
    """

    exchange: str
    routing_key: str
    origin: str
    kind: str
    headers: Mapping[str, Any]
    body: bytes


OnResult = Callable[[Published], None]
_Unconfirmed = tuple[int, OnResult | None]


@implementer(IBackbone)
class Backbone:
    """This node's connection to RabbitMQ, kept up, with what its users declared.

    Args:
        node: This node's id (the publisher of every message, its ``app_id``).
        endpoints: RabbitMQ's AMQP endpoints, each with its description
            (for the log), tried in turn.
        vhost: The virtual host.
        username: The RabbitMQ user.
        password: Its password.
        heartbeat_seconds: The AMQP heartbeat interval.
        clock: The reactor (time, and pika's timers).
        metrics: Where the gap, reconnections and drops are counted (None: nowhere).
        prefetch: Unacknowledged deliveries at most.
        max_unconfirmed: Unconfirmed messages past which publishers are held.
        max_unconfirmed_bytes: Unconfirmed bytes past which publishers are held.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        node: str,
        endpoints: Sequence[tuple[str, IStreamClientEndpoint]],
        vhost: str = "/",
        username: str = "guest",
        password: bytes = b"guest",
        heartbeat_seconds: float = 10.0,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        max_unconfirmed: int = DEFAULT_MAX_UNCONFIRMED,
        max_unconfirmed_bytes: int = DEFAULT_MAX_UNCONFIRMED_BYTES,
    ) -> None:
        if not endpoints:
            raise ValueError("a backbone needs at least one endpoint")
        self.node = node
        self._endpoints = list(endpoints)
        self._parameters = pika.ConnectionParameters(
            virtual_host=vhost,
            credentials=pika.PlainCredentials(username, password.decode("utf-8")),
            heartbeat=heartbeat_interval(heartbeat_seconds),
            client_properties={"connection_name": f"msggateway {node}", "product": "msggateway"},
        )
        self._clock = clock
        self.stats = metrics.backbone() if metrics is not None else BackboneStats()
        self._prefetch = prefetch
        self._max_unconfirmed = max_unconfirmed
        self._max_unconfirmed_bytes = max_unconfirmed_bytes

        self.congestion = Congestion()
        """Congested while the confirm window is full or the broker blocked us: hold on it."""
        self.receiving = Throttle(self._pause_receiving, self._resume_receiving)
        """Hold it while what was delivered waits on congested local consumers."""
        self.queue = ""
        """This node's queue on the current connection (empty while there is none)."""
        self.endpoint: str | None = None
        """The description of the endpoint connected to, if any."""

        self._exchanges: dict[str, str] = {}
        self._others_only: set[str] = set()
        """Exchanges this node's bindings to go through its filter."""
        self._filter = filter_exchange(node)
        self._filter_queue = f"{self._filter}.queue"
        self._filter_declared = False
        """This connection has the filter (declared once an ``others_only`` exchange is)."""
        self._streams: dict[str, dict[str, Any]] = {}
        """Streams replayed, with their declared arguments."""
        self._handlers: dict[str, Callable[[Delivery], None]] = {}
        self._on_connected: list[Callable[[], None]] = []
        self._on_lost: list[Callable[[], None]] = []
        self._wanted: dict[tuple[str, str], None] = {}
        """The bindings users asked for, in order."""
        self._applied: set[tuple[str, str]] = set()
        """The bindings this connection has (asked for, at least)."""
        self._changed: dict[tuple[str, str], None] = {}
        """Bindings whose wanted state may differ from the applied one."""
        self._bind_call: IDelayedCall | None = None
        self._binding = False
        """A batch of binding changes awaits its barrier."""
        self._bound_waiters: list[Callable[[], None]] = []
        self._batch_waiters: list[Callable[[], None]] = []

        self._protocol: TwistedProtocolConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self.ready = False
        """Connected, with everything declared: publishing and deliveries work."""
        self._blocked = False
        self._sequence = 0
        self._unconfirmed: dict[int, _Unconfirmed] = {}
        self._unconfirmed_bytes = 0
        self._returned: set[int] = set()
        self._backlog: deque[tuple[int, Delivery]] = deque()
        self._ack_upto = 0
        self._unacked = 0
        """Deliveries handled since the last ack sent."""
        self._ack_call: IDelayedCall | None = None
        self._held_tag = 0
        self._exclusive = ExclusiveQueues()

        self._running = False
        self._attempt = 0
        """Attempts since the node last was ready (for the back-off)."""
        self._next = 0
        """The endpoint to try next: after a loss, the one after the endpoint that was lost."""
        self._attempt_call: IDelayedCall | None = None
        self._connecting: Deferred[Any] | None = None
        self._timeout_call: IDelayedCall | None = None
        self.lost_since: float | None = None
        """When the node last had no connection (None while it has one)."""
        self._dropped_in_gap = 0

    # --- what users register ------------------------------------------------------------

    def declare_exchange(
        self, name: str, kind: str = "direct", *, others_only: bool = False
    ) -> None:
        """Declare ``name`` (durable) on this and every later connection.

        With ``others_only``, this node's bindings to it go through its
        filter: what this node publishes there never reaches its own queue,
        and a mandatory message comes back when no other node is bound.
        Declare it so before binding to it.
        """
        self._exchanges[name] = kind
        if others_only:
            self._others_only.add(name)
        channel = self._channel
        if channel is not None and self.ready:
            channel.exchange_declare(name, kind, durable=True)
            if others_only and self._declare_filter(channel):
                channel.queue_bind(self.queue, self._filter_queue)  # nowait

    def consume(self, exchange: str, handler: Callable[[Delivery], None]) -> None:
        """Hand what arrives on this node's queue from ``exchange`` to ``handler``."""
        self._handlers[exchange] = handler

    def replay(
        self, stream: str, handler: Callable[[Delivery], None], arguments: Mapping[str, Any]
    ) -> None:
        """Read the stream ``stream`` from its first message, on this and every later connection.

        It is declared durable with ``arguments`` (``x-queue-type`` and
        retention), then consumed from offset ``first``: ``handler`` gets each
        message (``exchange`` is the stream's name), the whole stream again
        after every reconnection. Publish to it through the default exchange
        (``""``, with the stream's name as the key).
        """
        self._streams[stream] = dict(arguments)
        self._handlers[stream] = handler
        channel = self._channel
        if channel is not None and self.ready:
            channel.queue_declare(stream, durable=True, arguments=self._streams[stream])
            self._consume_stream(channel, stream)

    def on_connected(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every (re)connection, once everything is declared."""
        self._on_connected.append(callback)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the connection is lost."""
        self._on_lost.append(callback)

    def bind(self, exchange: str, key: str) -> None:
        """Bind this node's queue to ``exchange`` with ``key`` (now and on every reconnection)."""
        wanted = (exchange, key)
        if wanted in self._wanted:
            return
        self._wanted[wanted] = None
        self._change(wanted)

    def unbind(self, exchange: str, key: str) -> None:
        """Undo `bind`."""
        wanted = (exchange, key)
        if self._wanted.pop(wanted, 0) is None:
            self._change(wanted)

    def bindings(self) -> int:
        """How many bindings the users asked for."""
        return len(self._wanted)

    def when_bound(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every binding change asked for so far took effect.

        At once when there is none pending; after the next connection's
        declarations when there is no connection now.
        """
        if self.ready and not self._changed and not self._binding:
            callback()
        else:
            self._bound_waiters.append(callback)

    # --- exclusive queues (locks) ---------------------------------------------------------

    def claim(self, queue: str) -> Deferred[bool]:
        """Declare ``queue`` exclusive to this connection (`ExclusiveQueues.claim`).

        Returns:
            Fires with True once this connection holds it, False when
            another connection does (or RabbitMQ refused it otherwise), or
            at once when there is no connection, or when it ends first.
        """
        if not self.ready:
            return succeed(False)
        return self._exclusive.claim(queue)

    def release(self, queue: str) -> Deferred[None]:
        """Delete ``queue``; fires once deleted, or once the connection (and the queue) is gone."""
        if not self.ready:
            return succeed(None)
        return self._exclusive.release(queue)

    # --- publishing ------------------------------------------------------------------------

    def publish(
        self,
        exchange: str,
        key: str,
        body: bytes,
        *,
        kind: str,
        headers: Mapping[str, Any] | None = None,
        cc: Sequence[str] = (),
        mandatory: bool = False,
        on_result: OnResult | None = None,
    ) -> bool:
        """Publish one message; False (and ``on_result(LOST)``) when there is no connection.

        Args:
            exchange: Where to.
            key: The routing key.
            body: The body.
            kind: Its ``type`` property, for the receiving user.
            headers: Its headers.
            cc: More routing keys (RabbitMQ's ``CC`` header): one copy per
                queue however many of its keys match.
            mandatory: Come back (`Published.UNROUTABLE`) when no queue is bound.
            on_result: Called once with what became of it.
        """
        channel = self._channel
        if not self.ready or channel is None:
            self.stats.dropped += 1
            self._dropped_in_gap += 1
            if on_result is not None:
                on_result(Published.LOST)
            return False
        self._sequence += 1
        sequence = self._sequence
        table = dict(headers) if headers else {}
        if cc:
            table["CC"] = list(cc)
        if exchange in self._others_only:
            table[ORIGIN_HEADER] = self.node
        properties = pika.BasicProperties(
            type=kind,
            app_id=self.node,
            headers=table or None,
            message_id=str(sequence) if mandatory else None,
        )
        channel.basic_publish(exchange, key, body, properties, mandatory=mandatory)
        size = len(body)
        self._unconfirmed[sequence] = (size, on_result)
        self._unconfirmed_bytes += size
        stats = self.stats
        stats.published += 1
        stats.published_bytes += size
        if not self.congestion.congested and (
            len(self._unconfirmed) >= self._max_unconfirmed
            or self._unconfirmed_bytes >= self._max_unconfirmed_bytes
        ):
            self.congestion.begin()
        return True

    @property
    def unconfirmed(self) -> int:
        """Published messages awaiting their confirm."""
        return len(self._unconfirmed)

    def _confirmed(self, frame: pika.frame.Method[Any]) -> None:
        method = frame.method
        tag = int(method.delivery_tag)
        nacked = isinstance(method, pika.spec.Basic.Nack)
        unconfirmed = self._unconfirmed
        settled: list[tuple[int, _Unconfirmed]] = []
        if method.multiple:
            while unconfirmed:
                first = next(iter(unconfirmed))
                if first > tag:
                    break
                settled.append((first, unconfirmed.pop(first)))
        elif tag in unconfirmed:
            settled.append((tag, unconfirmed.pop(tag)))
        returned = self._returned
        for sequence, (size, on_result) in settled:
            self._unconfirmed_bytes -= size
            if nacked:
                self.stats.nacked += 1
            if on_result is not None:
                if nacked:
                    on_result(Published.NACKED)
                elif sequence in returned:
                    returned.discard(sequence)
                    on_result(Published.UNROUTABLE)
                else:
                    on_result(Published.ROUTED)
        self._maybe_drained()

    def _returned_message(
        self,
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Return,
        properties: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        # RabbitMQ sends basic.return before the ack of the same message.
        if properties.message_id is not None and properties.message_id.isdigit():
            self._returned.add(int(properties.message_id))

    def _maybe_drained(self) -> None:
        if (
            self.congestion.congested
            and not self._blocked
            and len(self._unconfirmed) <= self._max_unconfirmed // 2
            and self._unconfirmed_bytes <= self._max_unconfirmed_bytes // 2
        ):
            self.congestion.drained()

    def _connection_blocked(self, connection: Any, frame: Any) -> None:
        self._blocked = True
        self.stats.blocked = 1
        self._log.warn(
            "fleet: RabbitMQ at {endpoint} blocked publishing ({reason}); local publishers are"
            " held until it unblocks",
            endpoint=self.endpoint,
            reason=getattr(frame.method, "reason", "") or "a resource alarm",
        )
        self.congestion.begin()

    def _connection_unblocked(self, connection: Any, frame: Any) -> None:
        self._blocked = False
        self.stats.blocked = 0
        self._log.info("fleet: RabbitMQ at {endpoint} unblocked publishing", endpoint=self.endpoint)
        self._maybe_drained()

    # --- receiving ---------------------------------------------------------------------------

    def _delivered(
        self,
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        properties: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        if channel is not self._channel:
            return
        self._take(int(method.delivery_tag), _delivery(method.exchange, method, properties, body))

    def _consume_stream(self, channel: pika.channel.Channel, stream: str) -> None:
        """Consume ``stream`` from its first message on ``channel``.

        A stream consumer needs a prefetch (the channel has one) and
        acknowledgements, which give it credit (the node's own).
        """

        def delivered(
            channel: pika.channel.Channel,
            method: pika.spec.Basic.Deliver,
            properties: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:
            if channel is self._channel:
                self._take(int(method.delivery_tag), _delivery(stream, method, properties, body))

        channel.basic_consume(
            stream, delivered, auto_ack=False, arguments={"x-stream-offset": "first"}
        )

    def _take(self, tag: int, delivery: Delivery) -> None:
        self.stats.received += 1
        if self.receiving.held or self._backlog:
            self._backlog.append((tag, delivery))
            return
        self._dispatch(tag, delivery)

    def _dispatch(self, tag: int, delivery: Delivery) -> None:
        handler = self._handlers.get(delivery.exchange)
        if handler is not None:
            try:
                handler(delivery)
            except Exception:
                self._log.failure(
                    "fleet: handling a delivery from {exchange} failed",
                    exchange=delivery.exchange,
                )
        if self.receiving.held:
            self._held_tag = tag  # acknowledged once the local consumers drained
        else:
            self._ack(tag)

    def _ack(self, tag: int) -> None:
        """Acknowledge up to ``tag``: at once past half the window, else after a short delay."""
        self._ack_upto = max(self._ack_upto, tag)
        self._unacked += 1
        if self._unacked * 2 >= self._prefetch:
            if self._ack_call is not None:
                if self._ack_call.active():
                    self._ack_call.cancel()
                self._ack_call = None
            self._send_ack()
        elif self._ack_call is None:
            self._ack_call = self._clock.callLater(ACK_DELAY_SECONDS, self._send_ack)

    def _send_ack(self) -> None:
        self._ack_call = None
        channel = self._channel
        if channel is not None and channel.is_open and self._ack_upto:
            channel.basic_ack(self._ack_upto, multiple=True)
        self._ack_upto = 0
        self._unacked = 0

    def _pause_receiving(self) -> None:
        """Held: deliveries wait in the backlog (at most ``prefetch``), unacknowledged."""

    def _resume_receiving(self) -> None:
        if self._held_tag:
            tag, self._held_tag = self._held_tag, 0
            self._ack(tag)
        backlog = self._backlog
        while backlog and not self.receiving.held:
            tag, delivery = backlog.popleft()
            self._dispatch(tag, delivery)

    # --- binding changes, in batches ------------------------------------------------------------

    def _change(self, binding: tuple[str, str]) -> None:
        self._changed[binding] = None
        self.stats.bindings = len(self._wanted)
        if self.ready and self._bind_call is None and not self._binding:
            self._bind_call = self._clock.callLater(0, self._send_binding_changes)

    def _send_binding_changes(self) -> None:
        """Send at most `BIND_BATCH` changes, then a barrier; the next batch after it."""
        self._bind_call = None
        channel = self._channel
        if not self.ready or channel is None or self._binding:
            return
        sent = 0
        changed = self._changed
        while changed and sent < BIND_BATCH:
            binding = next(iter(changed))
            del changed[binding]
            wanted = binding in self._wanted
            if wanted == (binding in self._applied):
                continue
            if wanted:
                self._send_bind(channel, binding)
                self._applied.add(binding)
            else:
                self._send_unbind(channel, binding)
                self._applied.discard(binding)
            sent += 1
        waiters = self._bound_waiters if not changed else []
        self._bound_waiters = [] if not changed else self._bound_waiters
        if not sent:
            for waiter in waiters:
                waiter()
            return
        self._binding = True
        self._batch_waiters = waiters
        channel.basic_qos(prefetch_count=self._prefetch, callback=self._batch_done)

    def _send_bind(self, channel: pika.channel.Channel, binding: tuple[str, str]) -> None:
        exchange, key = binding
        if exchange in self._others_only:
            channel.exchange_bind(self._filter, exchange, key)  # nowait
        else:
            channel.queue_bind(self.queue, exchange, key)  # nowait

    def _send_unbind(self, channel: pika.channel.Channel, binding: tuple[str, str]) -> None:
        exchange, key = binding
        if exchange in self._others_only:
            channel.exchange_unbind(self._filter, exchange, key)  # nowait
        else:
            channel.queue_unbind(self.queue, exchange, key)  # queue.unbind has no nowait

    def _declare_filter(self, channel: pika.channel.Channel) -> bool:
        """Declare this node's filter anew on this connection (nowait, in order).

        Deleting it first drops what earlier connections (or processes) of
        this node bound to it; the bindings wanted now are declared after.

        Returns:
            False when this connection has it already.
        """
        if self._filter_declared:
            return False
        self._filter_declared = True
        channel.exchange_declare(VOID_EXCHANGE, "fanout", durable=True)
        channel.exchange_declare(self._filter_queue, "fanout")
        channel.exchange_delete(self._filter)
        channel.exchange_declare(
            self._filter, "headers", arguments={"alternate-exchange": self._filter_queue}
        )
        channel.exchange_bind(
            VOID_EXCHANGE, self._filter, arguments={"x-match": "all", ORIGIN_HEADER: self.node}
        )
        return True

    def _batch_done(self, frame: Any) -> None:
        self._binding = False
        waiters, self._batch_waiters = self._batch_waiters, []
        for waiter in waiters:
            waiter()
        if self._changed and self._bind_call is None:
            self._send_binding_changes()
        elif self._bound_waiters and not self._changed:
            waiting, self._bound_waiters = self._bound_waiters, []
            for waiter in waiting:
                waiter()

    # --- connection life ------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, and keep connected until `stop`."""
        if self._running:
            return
        self._running = True
        self.lost_since = self._clock.seconds()
        self._attempt = 0
        self._connect()

    def stop(self) -> Deferred[None]:
        """Unbind in batches, close the connection, stop reconnecting; fires once closed.

        Unbinding first keeps RabbitMQ from deleting a queue that holds many
        bindings at once (rabbitmq-server#12926), bounded by `_STOP_SECONDS`.
        """
        self._running = False
        for call in (self._attempt_call, self._timeout_call, self._bind_call, self._ack_call):
            if call is not None and call.active():
                call.cancel()
        self._attempt_call = self._timeout_call = self._bind_call = self._ack_call = None
        if self._connecting is not None:
            self._connecting.cancel()
        protocol = self._protocol
        if protocol is None:
            return succeed(None)
        done: Deferred[None] = Deferred()
        closed = protocol.closed

        def close(_: object = None) -> None:
            if protocol.is_open:
                protocol.close()

        def finished(_: object) -> None:
            if timer.active():
                timer.cancel()
            if not done.called:
                done.callback(None)

        def too_long() -> None:
            if protocol.transport is not None:
                protocol.transport.abortConnection()
            if not done.called:
                done.callback(None)

        timer = self._clock.callLater(_STOP_SECONDS, too_long)
        if closed is not None:
            closed.addBoth(finished)
        else:
            self._clock.callLater(0, finished, None)
        if self.ready and self._wanted:
            self._wanted.clear()
            self._changed = dict.fromkeys(self._applied)
            self.when_bound(close)
            self._send_binding_changes()
        else:
            close()
        return done

    def _connect(self) -> None:
        self._attempt_call = None
        if not self._running:
            return
        description, endpoint = self._endpoints[self._next]
        self._next = (self._next + 1) % len(self._endpoints)
        self._attempt += 1
        factory = Factory.forProtocol(
            lambda: TwistedProtocolConnection(self._parameters, custom_reactor=self._clock)
        )
        connecting: Deferred[Any] = endpoint.connect(factory)
        self._connecting = connecting
        self._timeout_call = self._clock.callLater(
            CONNECT_TIMEOUT_SECONDS, self._too_slow, description
        )
        connecting.addCallback(self._handshaking, description)
        connecting.addErrback(self._attempt_failed, description)

    def _handshaking(self, protocol: TwistedProtocolConnection, description: str) -> Any:
        self._protocol = protocol
        # pika's own socket adapters turn Nagle off; its Twisted adapter does not. With it on,
        # a publish waits for the broker's acknowledgement of the previous one.
        disable_nagle(protocol.transport)
        ready = protocol.ready
        if ready is None:
            raise RuntimeError("the AMQP connection ended during its handshake")
        return ready.addCallback(lambda _: self._opened(protocol, description))

    def _too_slow(self, description: str) -> None:
        self._timeout_call = None
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None and not self.ready:
            protocol.transport.abortConnection()
        elif self._connecting is not None:
            self._connecting.cancel()
        self._log.warn(
            "fleet: RabbitMQ at {endpoint} not ready within {seconds:g} s",
            endpoint=description,
            seconds=CONNECT_TIMEOUT_SECONDS,
        )

    def _attempt_failed(self, failure: Failure, description: str) -> None:
        self._connecting = None
        self._protocol = None
        if self._timeout_call is not None and self._timeout_call.active():
            self._timeout_call.cancel()
        self._timeout_call = None
        if not self._running:
            return
        self._log.warn(
            "fleet: cannot connect to RabbitMQ at {endpoint}: {reason}",
            endpoint=description,
            reason=failure.getErrorMessage() or type(failure.value).__name__,
        )
        self._retry()

    def _retry(self) -> None:
        if not self._running or self._attempt_call is not None:
            return
        delay = reconnect_delay(self._attempt, len(self._endpoints))
        self._attempt_call = self._clock.callLater(delay, self._connect)

    def _opened(self, protocol: TwistedProtocolConnection, description: str) -> None:
        self._connecting = None
        connection: pika.connection.Connection = protocol._impl
        connection.add_on_connection_blocked_callback(self._connection_blocked)
        connection.add_on_connection_unblocked_callback(self._connection_unblocked)
        self._exclusive.attach(connection)
        closed = protocol.closed
        if closed is not None:
            closed.addBoth(self._closed, protocol, description)
        connection.channel(on_open_callback=lambda channel: self._declare(channel, description))

    def _declare(self, channel: pika.channel.Channel, description: str) -> None:
        """Declare everything on a new channel, step by step; then the node is ready."""
        self._channel = channel
        channel.add_on_close_callback(self._channel_closed)
        channel.add_on_return_callback(self._returned_message)
        queue = f"msggateway.{self.node}.{secrets.token_hex(4)}"

        def confirmed(_: object) -> None:
            channel.basic_qos(prefetch_count=self._prefetch, callback=qos)

        def qos(_: object) -> None:
            for exchange, kind in self._exchanges.items():
                channel.exchange_declare(exchange, kind, durable=True)  # nowait
            if self._others_only:
                self._declare_filter(channel)
            for stream, arguments in self._streams.items():
                channel.queue_declare(stream, durable=True, arguments=arguments)  # nowait
            channel.queue_declare(queue, exclusive=True, auto_delete=True, callback=declared)

        def declared(_: object) -> None:
            self.queue = queue
            if self._filter_declared:
                channel.queue_bind(queue, self._filter_queue)  # nowait
            for binding in list(self._wanted)[:BIND_BATCH]:
                self._send_bind(channel, binding)
                self._applied.add(binding)
            for stream in self._streams:
                self._consume_stream(channel, stream)
            channel.basic_consume(
                queue, self._delivered, auto_ack=False, exclusive=True, callback=consuming
            )

        def consuming(_: object) -> None:
            self._ready_on(description)

        # A channel numbers its confirms from 1: so do this channel's publishes.
        self._sequence = 0
        channel.confirm_delivery(self._confirmed, callback=confirmed)

    def _ready_on(self, description: str) -> None:
        if self._timeout_call is not None and self._timeout_call.active():
            self._timeout_call.cancel()
        self._timeout_call = None
        self.ready = True
        self.endpoint = description
        self._attempt = 0
        now = self._clock.seconds()
        gap = now - self.lost_since if self.lost_since is not None else 0.0
        stats = self.stats
        stats.connected = 1
        if stats.connections:
            stats.reconnects += 1
            stats.gap_seconds += gap
            self._log.warn(
                "fleet: node {node} reconnected to RabbitMQ at {endpoint} after a gap of"
                " {gap:.3f} s; {dropped} message(s) for other nodes were dropped meanwhile,"
                " and what they sent this node then is lost; queue {queue} and {bindings}"
                " binding(s) declared again",
                node=self.node,
                endpoint=description,
                gap=gap,
                dropped=self._dropped_in_gap,
                queue=self.queue,
                bindings=len(self._wanted),
            )
        else:
            self._log.info(
                "fleet: node {node} connected to RabbitMQ at {endpoint} (queue {queue},"
                " {bindings} binding(s))",
                node=self.node,
                endpoint=description,
                queue=self.queue,
                bindings=len(self._wanted),
            )
        stats.connections += 1
        self.lost_since = None
        self._dropped_in_gap = 0
        # Bindings past the first batch, and any asked for meanwhile, go in batches.
        self._changed.update(dict.fromkeys(b for b in self._wanted if b not in self._applied))
        if self._changed:
            self._send_binding_changes()
        elif self._bound_waiters:
            waiting, self._bound_waiters = self._bound_waiters, []
            for waiter in waiting:
                waiter()
        for callback in list(self._on_connected):
            callback()

    def _channel_closed(self, channel: pika.channel.Channel, reason: Exception) -> None:
        if channel is not self._channel:
            return
        protocol = self._protocol
        if self._running:
            self._log.warn(
                "fleet: RabbitMQ closed the channel: {reason}; reconnecting", reason=str(reason)
            )
        if protocol is not None and protocol.is_open:
            protocol.close()

    def _closed(self, reason: object, protocol: TwistedProtocolConnection, endpoint: str) -> None:
        if protocol is not self._protocol:
            return
        was_ready = self.ready
        self._protocol = None
        self._channel = None
        self.ready = False
        self.queue = ""
        self.endpoint = None
        self._applied.clear()
        self._binding = False
        self._changed.clear()
        self._blocked = False
        self._backlog.clear()
        self._held_tag = 0
        self._ack_upto = 0
        self._unacked = 0
        self._filter_declared = False
        for call in (self._bind_call, self._ack_call, self._timeout_call):
            if call is not None and call.active():
                call.cancel()
        self._bind_call = self._ack_call = self._timeout_call = None
        stats = self.stats
        stats.connected = 0
        stats.blocked = 0
        unconfirmed, self._unconfirmed = self._unconfirmed, {}
        self._unconfirmed_bytes = 0
        self._returned.clear()
        stats.dropped += len(unconfirmed)
        self._dropped_in_gap += len(unconfirmed)
        if was_ready:
            self.lost_since = self._clock.seconds()
            if self._running:
                self._log.warn(
                    "fleet: node {node} lost RabbitMQ at {endpoint}: {reason}; {unconfirmed}"
                    " message(s) unconfirmed; reconnecting",
                    node=self.node,
                    endpoint=endpoint,
                    reason=_reason_text(reason),
                    unconfirmed=len(unconfirmed),
                )
        for _size, on_result in unconfirmed.values():
            if on_result is not None:
                on_result(Published.LOST)
        self.congestion.drained()  # nothing is held for a broker that is not there
        if was_ready:
            for callback in list(self._on_lost):
                callback()
        # After the users heard of the loss: what they asked for is answered as gone with it.
        self._exclusive.detach()
        if self._running:
            self._retry()


def _delivery(
    exchange: str,
    method: pika.spec.Basic.Deliver,
    properties: pika.spec.BasicProperties,
    body: bytes,
) -> Delivery:
    return Delivery(
        exchange=exchange,
        routing_key=method.routing_key,
        origin=properties.app_id or "",
        kind=properties.type or "",
        headers=properties.headers or {},
        body=body,
    )


def _reason_text(reason: object) -> str:
    if isinstance(reason, Failure):
        reason = reason.value
    text = str(reason) if reason is not None else ""
    return text or type(reason).__name__


def make_backbone(
    *,
    node: str,
    endpoints: Sequence[str],
    vhost: str,
    heartbeat_seconds: float,
    username: str | None,
    password: bytes | None,
    reactor: Any,
    metrics: GatewayMetrics | None,
) -> Backbone:
    """The backbone for ``[fleet] amqp`` (client endpoint strings) and its credentials.

    Without credentials in the secrets file, RabbitMQ's ``guest`` (which it
    lets in from loopback only).
    """
    return Backbone(
        node=node,
        endpoints=[(text, clientFromString(reactor, text)) for text in endpoints],
        vhost=vhost,
        username=username if username is not None else "guest",
        password=password if password is not None else b"guest",
        heartbeat_seconds=heartbeat_seconds,
        clock=reactor,
        metrics=metrics,
    )
