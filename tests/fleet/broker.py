"""An in-memory broker and backbones: the fleet's nodes in one process, on a `Clock`.

`MemoryBroker` is a small, real implementation of what the fleet uses of
RabbitMQ: durable direct exchanges, one exclusive queue per node with its
bindings (gone when the node's connection is), exchanges that never bring
a node's own messages back to it (``others_only``: the node's filter on
RabbitMQ), publishing with ``CC``
(one copy per queue), ``mandatory`` returns and confirms, deliveries
with a prefetch window, exclusive queues claimed by name (the fleet's
locks: one connection holds each; gone with it), and durable streams that
each reader reads from the first message (published to through the default
exchange, ``""``). `MemoryBackbone` provides
`IBackbone` over it, as `gateway.fleet.backbone.Backbone` does over RabbitMQ.

As on RabbitMQ, a node's methods (publishes and binding changes) are
handled in the order the node sent them, a turn after it sent them
(``clock.advance(0)`` runs the world until it is quiet); confirms and
deliveries come a turn later again.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from zope.interface import implementer

from gateway.core.flow import Congestion, Throttle
from gateway.core.interfaces import IBackbone
from gateway.fleet.backbone import Delivery, Published

__all__ = ["MemoryBackbone", "MemoryBroker"]


class MemoryBroker:
    """Direct exchanges and the nodes' queues, in memory.

    Args:
        clock: The world's clock.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.bindings: dict[tuple[str, str], set[MemoryBackbone]] = {}
        self.exchanges: set[str] = set()
        self.published = 0
        self.exclusive: dict[str, MemoryBackbone] = {}
        """Exclusive queues claimed by name, and the connection holding each."""
        self.streams: dict[str, list[Delivery]] = {}
        """Durable streams and their messages (they outlive every connection)."""
        self.readers: dict[str, set[MemoryBackbone]] = {}
        """The connections reading each stream live."""

    def route(
        self, exchange: str, keys: Sequence[str], origin: MemoryBackbone | None = None
    ) -> set[MemoryBackbone]:
        """The queues (nodes) a message to ``exchange`` with ``keys`` reaches, once each.

        Not its publisher ``origin`` when that node declared the exchange
        ``others_only`` (its bindings go through its filter, which drops its own).
        """
        found: set[MemoryBackbone] = set()
        for key in keys:
            found |= self.bindings.get((exchange, key), set())
        if origin is not None and exchange in origin.others_only:
            found.discard(origin)
        return found

    def forget(self, node: MemoryBackbone) -> None:
        """A node's connection died: its queue and bindings go, and its exclusive queues."""
        for holders in self.bindings.values():
            holders.discard(node)
        for readers in self.readers.values():
            readers.discard(node)
        for queue in [queue for queue, holder in self.exclusive.items() if holder is node]:
            del self.exclusive[queue]


@implementer(IBackbone)
class MemoryBackbone:
    """A node's connection to a `MemoryBroker`.

    Args:
        broker: The broker.
        node: The node id.
        prefetch: Unacknowledged deliveries at most.
        max_unconfirmed: Unconfirmed messages past which ``congestion`` is congested.
    """

    def __init__(
        self, broker: MemoryBroker, node: str, prefetch: int = 8, max_unconfirmed: int = 1000
    ) -> None:
        self.broker = broker
        self.node = node
        self.ready = True
        self.lost_since: float | None = None
        self.congestion = Congestion()
        self.receiving = Throttle(lambda: None, self._resumed)
        self._prefetch = prefetch
        self._max_unconfirmed = max_unconfirmed
        self._unconfirmed = 0
        self._wanted: dict[tuple[str, str], None] = {}
        self._exchanges: set[str] = set()
        self.others_only: set[str] = set()
        """Exchanges whose messages from this node never come back to it."""
        self._streams: set[str] = set()
        self._handlers: dict[str, Callable[[Delivery], None]] = {}
        self._connected: list[Callable[[], None]] = []
        self._lost: list[Callable[[], None]] = []
        self._methods: deque[Callable[[], None]] = deque()
        self._queue: deque[Delivery] = deque()
        self._unacked = 0
        self._answers: list[tuple[Deferred[Any], Any]] = []
        """Claims and releases sent and not answered yet."""
        self.stalled = False
        self.generation = 0
        self.deliveries = 0

    # --- IBackbone ---------------------------------------------------------------------

    def declare_exchange(
        self, name: str, kind: str = "direct", *, others_only: bool = False
    ) -> None:
        """Declare a direct exchange; ``others_only``: this node's own messages never come back."""
        self._exchanges.add(name)
        self.broker.exchanges.add(name)
        if others_only:
            self.others_only.add(name)

    def consume(self, exchange: str, handler: Callable[[Any], None]) -> None:
        """Hand deliveries from ``exchange`` to ``handler``."""
        self._handlers[exchange] = handler

    def replay(
        self, stream: str, handler: Callable[[Any], None], arguments: Mapping[str, Any]
    ) -> None:
        """Read ``stream`` from its first message, now and after every reconnection."""
        self._handlers[stream] = handler
        self._streams.add(stream)
        self.broker.streams.setdefault(stream, [])
        if self.ready:
            self._send(functools.partial(self._read_stream, stream))

    def on_connected(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every reconnection."""
        self._connected.append(callback)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the connection dies."""
        self._lost.append(callback)

    def bind(self, exchange: str, key: str) -> None:
        """Bind, in order with what the node published before."""
        if (exchange, key) in self._wanted:
            return
        self._wanted[(exchange, key)] = None
        self._send(lambda: self._apply(exchange, key, True))

    def unbind(self, exchange: str, key: str) -> None:
        """Unbind, in order."""
        if self._wanted.pop((exchange, key), 0) is None:
            self._send(lambda: self._apply(exchange, key, False))

    def when_bound(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the changes sent so far took effect."""
        generation = self.generation
        self._send(lambda: self._later(callback, generation))

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
        on_result: Callable[[Any], None] | None = None,
    ) -> bool:
        """Route at the broker's next turn; confirm a turn after."""
        if not self.ready:
            if on_result is not None:
                on_result(Published.LOST)
            return False
        for name, value in (headers or {}).items():
            # What pika can put in an AMQP table (it has no encoding for floats).
            assert isinstance(value, str | int | list), (name, value)
        delivery = Delivery(exchange, key, self.node, kind, dict(headers or {}), body)
        self._unconfirmed += 1
        if self._unconfirmed >= self._max_unconfirmed:
            self.congestion.begin()
        generation = self.generation

        def route() -> None:
            if exchange == "" and key in self.broker.streams:
                self._append(key, delivery)
                self.broker.clock.callLater(
                    0, self._confirm, on_result, Published.ROUTED, generation
                )
                return
            queues = self.broker.route(exchange, [key, *cc], self)
            self.broker.published += 1
            for queue in queues:
                queue.enqueue(delivery)
            result = Published.UNROUTABLE if mandatory and not queues else Published.ROUTED
            self.broker.clock.callLater(0, self._confirm, on_result, result, generation)

        self._send(route)
        return True

    def claim(self, queue: str) -> Deferred[bool]:
        """Take the exclusive queue ``queue`` unless another connection holds it."""

        def declare() -> bool:
            holder = self.broker.exclusive.setdefault(queue, self)
            return holder is self

        return self._ask(declare, False)

    def release(self, queue: str) -> Deferred[None]:
        """Delete the exclusive queue ``queue`` if this connection holds it."""

        def delete() -> None:
            if self.broker.exclusive.get(queue) is self:
                del self.broker.exclusive[queue]

        return self._ask(delete, None)

    def _ask(self, method: Callable[[], Any], gone: Any) -> Deferred[Any]:
        """Send a synchronous method; its answer comes a turn after the broker handled it."""
        answer: Deferred[Any] = Deferred()
        if not self.ready:
            answer.callback(gone)
            return answer
        self._answers.append((answer, gone))
        generation = self.generation

        def handle() -> None:
            result = method()

            def reply() -> None:
                if generation == self.generation and not answer.called:
                    self._answers.remove((answer, gone))
                    answer.callback(result)

            self.broker.clock.callLater(0, reply)

        self._send(handle)
        return answer

    # --- the broker's side -----------------------------------------------------------------

    def _send(self, method: Callable[[], None]) -> None:
        self._methods.append(method)
        if len(self._methods) == 1:
            self.broker.clock.callLater(0, self._handle_methods, self.generation)

    def _handle_methods(self, generation: int) -> None:
        if generation != self.generation or self.stalled:
            return
        while self._methods:
            self._methods.popleft()()

    def _read_stream(self, stream: str) -> None:
        """The broker's side of a stream consumer from offset first."""
        for delivery in self.broker.streams[stream]:
            self.enqueue(delivery)
        self.broker.readers.setdefault(stream, set()).add(self)

    def _append(self, stream: str, delivery: Delivery) -> None:
        """A message published to a stream: kept, and delivered to its live readers."""
        kept = Delivery(
            stream, stream, delivery.origin, delivery.kind, delivery.headers, delivery.body
        )
        self.broker.streams[stream].append(kept)
        for reader in self.broker.readers.get(stream, ()):
            reader.enqueue(kept)

    def _apply(self, exchange: str, key: str, bound: bool) -> None:
        holders = self.broker.bindings.setdefault((exchange, key), set())
        if bound:
            holders.add(self)
        else:
            holders.discard(self)

    def _later(self, callback: Callable[[], None], generation: int) -> None:
        def call() -> None:
            if generation == self.generation:
                callback()

        self.broker.clock.callLater(0, call)

    def _confirm(
        self, on_result: Callable[[Any], None] | None, result: Published, generation: int
    ) -> None:
        if generation != self.generation:
            return
        self._unconfirmed -= 1
        if self.congestion.congested and self._unconfirmed <= self._max_unconfirmed // 2:
            self.congestion.drained()
        if on_result is not None:
            on_result(result)

    def enqueue(self, delivery: Delivery) -> None:
        """A message routed to this node's queue."""
        self._queue.append(delivery)
        self.broker.clock.callLater(0, self._deliver_next)

    def _resumed(self) -> None:
        self._unacked = 0  # what waited on the local consumers is acknowledged now
        self._deliver_next()

    def _deliver_next(self) -> None:
        while (
            self.ready
            and self._queue
            and not self.receiving.held
            and self._unacked < self._prefetch
        ):
            delivery = self._queue.popleft()
            self._unacked += 1
            self.deliveries += 1
            handler = self._handlers.get(delivery.exchange)
            if handler is not None:
                handler(delivery)
            if not self.receiving.held:
                self._unacked = 0  # acknowledged (multiple)

    # --- faults ----------------------------------------------------------------------------

    def stall(self) -> None:
        """Nothing this node sends reaches the broker any more (a partition); still connected."""
        self.stalled = True

    def unstall(self) -> None:
        """What the node sent meanwhile reaches the broker now."""
        self.stalled = False
        self.broker.clock.callLater(0, self._handle_methods, self.generation)

    def kill(self) -> None:
        """The node's connection dies: its queue, bindings and unconfirmed messages go."""
        self.ready = False
        self.generation += 1
        self.lost_since = self.broker.clock.seconds()
        self.broker.forget(self)
        self._methods.clear()
        self._queue.clear()
        self._unacked = 0
        self._unconfirmed = 0
        self.congestion.drained()
        for callback in list(self._lost):
            callback()
        answers, self._answers = self._answers, []
        for answer, gone in answers:
            answer.callback(gone)  # a claim is not held, a release is done: the queues went

    def reconnect(self) -> None:
        """A new connection: the exchanges and bindings are declared again."""
        self.ready = True
        self.lost_since = None
        for exchange, key in self._wanted:
            self._send(functools.partial(self._apply, exchange, key, True))
        for stream in self._streams:
            self._send(functools.partial(self._read_stream, stream))
        for callback in list(self._connected):
            callback()
