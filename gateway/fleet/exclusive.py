"""Exclusive queues claimed and released on the backbone's connection: what locks are made of.

DESIGN.md, "Scale: a fleet on RabbitMQ": a lock for work that must run on
one node at a time is an exclusive AMQP 0-9-1 queue with a well-known name.
RabbitMQ lets one connection declare it; any other connection's declare is
refused with channel error 405 (RESOURCE_LOCKED), and RabbitMQ deletes the
queue when the owning connection closes (or dies: its socket closes, or it
misses heartbeats). Declaring it again on the owning connection succeeds,
which is how a holder confirms that it still holds it.

A refused declare closes its channel, so the claims do not share the
backbone's publishing channel: `ExclusiveQueues` keeps a channel of its own,
opened when first needed and again after each refusal. Claims and releases
go one at a time in the order they were asked for (each needs its answer
before the next: after a refusal the next one goes on a new channel), so a
release asked for after a claim of the same queue deletes what that claim
got.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

import pika.channel
import pika.connection
import pika.exceptions
from twisted.internet.defer import Deferred
from twisted.logger import Logger

__all__ = ["RESOURCE_LOCKED", "ExclusiveQueues"]

RESOURCE_LOCKED: Final = 405
"""AMQP 0-9-1's reply code for a queue declared exclusive by another connection."""


class _Operation:
    """One claim or release waiting for its turn or its answer."""

    __slots__ = ("claim", "done", "queue")

    def __init__(self, queue: str, *, claim: bool) -> None:
        self.queue = queue
        self.claim = claim
        self.done: Deferred[Any] = Deferred()

    def finish(self, claimed: bool) -> None:
        """Answer: a claim with whether this connection holds the queue; a release with None."""
        if not self.done.called:
            self.done.callback(claimed if self.claim else None)


class ExclusiveQueues:
    """Claims and releases of exclusive queues on one connection at a time.

    The backbone attaches each new connection (`attach`) and detaches it
    when it ends (`detach`), which answers everything still waiting: claims
    with False (RabbitMQ deletes this connection's exclusive queues with
    it), releases with None.
    """

    _log = Logger()

    def __init__(self) -> None:
        self._connection: pika.connection.Connection | None = None
        self._channel: pika.channel.Channel | None = None
        self._opening = False
        self._waiting: deque[_Operation] = deque()
        self._current: _Operation | None = None

    def attach(self, connection: pika.connection.Connection) -> None:
        """Claims go on ``connection`` from now on."""
        self.detach()
        self._connection = connection

    def detach(self) -> None:
        """The connection ended: answer what waits (not held, released)."""
        self._connection = None
        self._channel = None
        self._opening = False
        current, self._current = self._current, None
        waiting, self._waiting = self._waiting, deque()
        for operation in [*([current] if current is not None else []), *waiting]:
            operation.finish(False)

    def claim(self, queue: str) -> Deferred[bool]:
        """Declare ``queue`` exclusive to this connection.

        Returns:
            Fires with True once this connection holds it (declared now, or
            held already), False when another connection holds it, when
            RabbitMQ refused it otherwise (logged), or when the connection
            ended first.
        """
        return self._enqueue(_Operation(queue, claim=True))

    def release(self, queue: str) -> Deferred[None]:
        """Delete ``queue``; fires once deleted (or the connection ended, which deletes it too)."""
        return self._enqueue(_Operation(queue, claim=False))

    def _enqueue(self, operation: _Operation) -> Deferred[Any]:
        if self._connection is None:
            operation.finish(False)
        else:
            self._waiting.append(operation)
            self._next()
        return operation.done

    def _next(self) -> None:
        connection = self._connection
        if self._current is not None or not self._waiting or connection is None:
            return
        channel = self._channel
        if channel is None or not channel.is_open:
            if not self._opening and connection.is_open:
                self._opening = True
                connection.channel(on_open_callback=self._opened)
            return
        operation = self._current = self._waiting.popleft()
        if operation.claim:
            channel.queue_declare(
                operation.queue,
                exclusive=True,
                auto_delete=False,
                callback=lambda _: self._answered(operation),
            )
        else:
            channel.queue_delete(operation.queue, callback=lambda _: self._answered(operation))

    def _opened(self, channel: pika.channel.Channel) -> None:
        if channel.connection is not self._connection:
            return  # opened on a connection that ended since
        self._opening = False
        self._channel = channel
        channel.add_on_close_callback(self._closed)
        self._next()

    def _answered(self, operation: _Operation) -> None:
        if operation is not self._current:
            return
        self._current = None
        operation.finish(True)
        self._next()

    def _closed(self, channel: pika.channel.Channel, reason: Exception) -> None:
        """RabbitMQ closed the channel: the operation in flight was refused."""
        if channel is not self._channel:
            return
        self._channel = None
        operation, self._current = self._current, None
        if operation is not None:
            refused = isinstance(reason, pika.exceptions.ChannelClosedByBroker)
            code = getattr(reason, "reply_code", None)
            # A channel closed with its connection is no refusal: the backbone hears of that.
            if refused and (code != RESOURCE_LOCKED or not operation.claim):
                self._log.warn(
                    "fleet: RabbitMQ refused to {what} queue {queue}: {reason}",
                    what="declare" if operation.claim else "delete",
                    queue=operation.queue,
                    reason=str(reason),
                )
            operation.finish(False)
        self._next()
