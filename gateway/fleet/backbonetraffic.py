"""The backbone's traffic: publishing with confirms, and receiving with acknowledgements.

A part of `gateway.fleet.backbone.Backbone` (`gateway.fleet.backbonebase`
says how it is put together); its module docstring says what a publish
gets back and how both directions hold back under pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pika
import pika.channel
import pika.frame
import pika.spec

from gateway.fleet.backbonebase import (
    ACK_DELAY_SECONDS,
    ORIGIN_HEADER,
    Delivery,
    OnResult,
    Published,
    Unconfirmed,
    delivery_from,
)
from gateway.fleet.backbonebinding import BackboneBindings

__all__ = ["BackboneTraffic"]


class BackboneTraffic(BackboneBindings):
    """`publish` and its confirms; deliveries, their dispatch and acknowledgements."""

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
        settled: list[tuple[int, Unconfirmed]] = []
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
        self._take(
            int(method.delivery_tag), delivery_from(method.exchange, method, properties, body)
        )

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
                self._take(
                    int(method.delivery_tag), delivery_from(stream, method, properties, body)
                )

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
