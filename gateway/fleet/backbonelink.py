"""The backbone's connection: made, declared, kept up, and stopped.

A part of `gateway.fleet.backbone.Backbone` (`gateway.fleet.backbonebase`
says how it is put together); its module docstring says how endpoints are
tried, what is declared on every connection, and what a gap costs.
"""

from __future__ import annotations

import secrets
from typing import Any

import pika.channel
import pika.connection
from pika.adapters.twisted_connection import TwistedProtocolConnection
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure

from gateway.fleet.backbonebase import (
    BIND_BATCH,
    CONNECT_TIMEOUT_SECONDS,
    STOP_SECONDS,
    Published,
    reason_text,
    reconnect_delay,
)
from gateway.fleet.backbonetraffic import BackboneTraffic
from gateway.protocols.tcp import disable_nagle

__all__ = ["BackboneLink"]


class BackboneLink(BackboneTraffic):
    """`start` and `stop`; each connection's attempt, declarations, readiness and loss."""

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
        bindings at once (rabbitmq-server#12926), bounded by `STOP_SECONDS`.
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

        timer = self._clock.callLater(STOP_SECONDS, too_long)
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
                    reason=reason_text(reason),
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
