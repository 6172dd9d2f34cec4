"""The backbone's bindings: wanted by its users, applied on its connection in batches.

A part of `gateway.fleet.backbone.Backbone` (`gateway.fleet.backbonebase`
says how it is put together); its module docstring says why bindings
change in batches behind a barrier, and what the node's filter is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pika.channel

from gateway.fleet.backbonebase import BIND_BATCH, ORIGIN_HEADER, VOID_EXCHANGE, BackboneBase

__all__ = ["BackboneBindings"]


class BackboneBindings(BackboneBase):
    """`bind`, `unbind` and `when_bound`, and the batches that apply them."""

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
