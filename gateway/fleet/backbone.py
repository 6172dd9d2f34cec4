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

The class is put together from parts of one concern each
(`gateway.fleet.backbonebase` says how): the bindings
(`gateway.fleet.backbonebinding`), publishing and receiving
(`gateway.fleet.backbonetraffic`) and the connection's life
(`gateway.fleet.backbonelink`); here are its set-up, what users register
and the exclusive queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pika
import pika.channel
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from zope.interface import implementer

from gateway.core.flow import Congestion, Throttle
from gateway.core.interfaces import IBackbone
from gateway.fleet.backbonebase import (
    ACK_DELAY_SECONDS,
    BIND_BATCH,
    CONNECT_TIMEOUT_SECONDS,
    DEFAULT_MAX_UNCONFIRMED,
    DEFAULT_MAX_UNCONFIRMED_BYTES,
    DEFAULT_PREFETCH,
    ORIGIN_HEADER,
    VOID_EXCHANGE,
    Delivery,
    Published,
    filter_exchange,
    heartbeat_interval,
    reconnect_delay,
)
from gateway.fleet.backbonelink import BackboneLink
from gateway.fleet.exclusive import ExclusiveQueues
from gateway.metrics import BackboneStats, GatewayMetrics

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


@implementer(IBackbone)
class Backbone(BackboneLink):
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
        self.endpoint = None
        """The description of the endpoint connected to, if any."""

        self._exchanges = {}
        self._others_only = set()
        """Exchanges this node's bindings to go through its filter."""
        self._filter = filter_exchange(node)
        self._filter_queue = f"{self._filter}.queue"
        self._filter_declared = False
        """This connection has the filter (declared once an ``others_only`` exchange is)."""
        self._streams = {}
        """Streams replayed, with their declared arguments."""
        self._handlers = {}
        self._on_connected = []
        self._on_lost = []
        self._wanted = {}
        """The bindings users asked for, in order."""
        self._applied = set()
        """The bindings this connection has (asked for, at least)."""
        self._changed = {}
        """Bindings whose wanted state may differ from the applied one."""
        self._bind_call = None
        self._binding = False
        """A batch of binding changes awaits its barrier."""
        self._bound_waiters = []
        self._batch_waiters = []

        self._protocol = None
        self._channel = None
        self.ready = False
        """Connected, with everything declared: publishing and deliveries work."""
        self._blocked = False
        self._sequence = 0
        self._unconfirmed = {}
        self._unconfirmed_bytes = 0
        self._returned = set()
        self._backlog = deque()
        self._ack_upto = 0
        self._unacked = 0
        """Deliveries handled since the last ack sent."""
        self._ack_call = None
        self._held_tag = 0
        self._exclusive = ExclusiveQueues()

        self._running = False
        self._attempt = 0
        """Attempts since the node last was ready (for the back-off)."""
        self._next = 0
        """The endpoint to try next: after a loss, the one after the endpoint that was lost."""
        self._attempt_call = None
        self._connecting = None
        self._timeout_call = None
        self.lost_since = None
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
