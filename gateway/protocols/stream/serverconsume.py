"""Consumers on the stream listener: subscriptions, credit, deliveries, offsets.

`ServerSubscriptions` is the part of `StreamServerProtocol` that subscribes
from any offset specification (Subscribe needs the right to consume from the
stream, as QueryOffset does; the gateway's own streams need an explicit
grant), delivers chunks as the log stored them under the client's credit,
stores and queries consumer offsets, and resolves offset specifications.

Slow consumers: a subscription gets at most its credit in
chunks, and never more than the transport takes: once the transport's
buffer is full (it pauses us, at 64 KiB unsent) no further chunk is written,
not even the rest of one read, whatever credit the client keeps granting.
What is not sent stays in the log, where the subscription resumes when the
client reads again; a client that never does costs its connection one
chunk past that buffer, nothing is dropped and no one is disconnected for it.
"""

from __future__ import annotations

import socket
from typing import Any, Final

from gateway.codecs import stream as sp
from gateway.core.authorization import Action
from gateway.core.log import ChunkSpan, StreamLog
from gateway.protocols.sendfile import FileSender
from gateway.protocols.stream.serverbase import (
    ACCESS_REFUSED,
    MAX_REFERENCE_BYTES,
    NO_OFFSET,
    OK,
    PRECONDITION_FAILED,
    STREAM_DOES_NOT_EXIST,
    SUBSCRIPTION_ID_ALREADY_EXISTS,
    SUBSCRIPTION_ID_DOES_NOT_EXIST,
    StreamServerBase,
)

__all__ = ["DELIVER_MAX_BYTES", "MAX_SUBSCRIPTIONS", "ServerSubscriptions"]

MAX_SUBSCRIPTIONS: Final = 256
DELIVER_MAX_BYTES: Final = 4 * 1024 * 1024
"""Chunk bytes read for one subscription in one go."""


class _Subscription:
    __slots__ = ("credit", "id", "next_chunk", "stream", "waiting")

    def __init__(self, subscription_id: int, stream: StreamLog, next_chunk: int, credit: int):
        self.id = subscription_id
        self.stream = stream
        self.next_chunk = next_chunk
        self.credit = credit
        self.waiting: Any = None


class ServerSubscriptions(StreamServerBase):
    """Subscribe, Credit, Unsubscribe, deliveries; StoreOffset, QueryOffset, ResolveOffsetSpec."""

    _subscriptions: dict[int, _Subscription]
    _file_sender: FileSender

    # --- consumers -------------------------------------------------------------------------------

    def _on_subscribe(self, event: sp.Subscribe) -> None:
        if not self._require_open(event):
            return
        stream = self.factory.store.get(event.stream)
        properties = dict(event.properties or {})
        code = OK
        if len(self._subscriptions) >= MAX_SUBSCRIPTIONS:
            code = PRECONDITION_FAILED
        elif self._internal("subscribe to", event.stream, read=True) or self._refused(
            Action.CONSUME, event.stream
        ):
            code = ACCESS_REFUSED
        elif stream is None:
            code = STREAM_DOES_NOT_EXIST
        elif event.subscription_id in self._subscriptions:
            code = SUBSCRIPTION_ID_ALREADY_EXISTS
        elif properties.get("single-active-consumer") == "true" or "super-stream" in properties:
            code = PRECONDITION_FAILED  # not supported here
        self._send(
            sp.Response(key=sp.Key.SUBSCRIBE, correlation_id=event.correlation_id, code=code)
        )
        if code != OK:
            return
        assert stream is not None
        position = stream.seek(_spec(event.offset_spec))
        subscription = _Subscription(event.subscription_id, stream, position, event.credit)
        self._subscriptions[event.subscription_id] = subscription
        self.flush()  # the OK goes before the first Deliver
        self._deliver(subscription)

    def _on_credit(self, event: sp.Credit) -> None:
        if not self._require_open(event):
            return
        subscription = self._subscriptions.get(event.subscription_id)
        if subscription is None:
            self._send(
                sp.CreditResponse(
                    code=SUBSCRIPTION_ID_DOES_NOT_EXIST, subscription_id=event.subscription_id
                )
            )
            return
        subscription.credit += event.credit
        self._deliver(subscription)

    def _on_unsubscribe(self, event: sp.Unsubscribe) -> None:
        if not self._require_open(event):
            return
        subscription = self._subscriptions.pop(event.subscription_id, None)
        if subscription is not None:
            self._stop_waiting(subscription)
        code = OK if subscription is not None else SUBSCRIPTION_ID_DOES_NOT_EXIST
        self._send(
            sp.Response(key=sp.Key.UNSUBSCRIBE, correlation_id=event.correlation_id, code=code)
        )

    def _deliver(self, subscription: _Subscription) -> None:
        """Send chunks while the subscription has credit and the client keeps up.

        On a plain TCP connection with nothing unsent, chunks go from the
        log's file to the socket (`FileSender`) until it is full; what it
        does not take, and the chunks after, go through the transport. The
        transport pauses us (``_congested``) from inside a write once its
        buffer is full: the chunks read after that one wait in the log.
        """
        if self._closing or self._congested or subscription.waiting is not None:
            return
        transport = self.transport
        assert transport is not None
        traffic = self.factory.traffic
        stream = subscription.stream
        while subscription.credit > 0 and not self._congested:
            self.flush()
            sock = self._file_sender.idle_socket(transport)
            spans = None if sock is None else stream.read_spans(*self._wanted(subscription))
            if sock is not None and spans:
                self._send_spans(subscription, sock, spans)
                continue
            chunks = stream.read_chunks(*self._wanted(subscription)) if spans is None else []
            if not chunks:
                waiting = stream.wait_for(subscription.next_chunk)
                subscription.waiting = waiting
                waiting.addCallbacks(self._more_data, lambda _f: None, callbackArgs=(subscription,))
                return
            for chunk in chunks:
                if self._congested:
                    break  # the rest of this read is sent again from the log on resume
                payload = chunk.payload
                prefix = sp.deliver_prefix(subscription.id, len(payload))
                transport.writeSequence([prefix, payload])
                traffic.bytes_out += len(prefix) + len(payload)
                traffic.messages_out += chunk.header.num_records
                subscription.credit -= 1
                subscription.next_chunk = chunk.next_chunk_id
            self._sent_since = True

    @staticmethod
    def _wanted(subscription: _Subscription) -> tuple[int, int, int]:
        """Where a read for ``subscription`` starts, and its most chunks and bytes."""
        return subscription.next_chunk, subscription.credit, DELIVER_MAX_BYTES

    def _send_spans(
        self, subscription: _Subscription, sock: socket.socket, spans: list[ChunkSpan]
    ) -> None:
        """Send chunks from the log's file (`FileSender`) until the socket is full."""
        transport = self.transport
        traffic = self.factory.traffic
        send = self._file_sender.send
        for span in spans:
            prefix = sp.deliver_prefix(subscription.id, span.length)
            whole = send(transport, sock, prefix, span.fd, span.position, span.length)
            traffic.bytes_out += len(prefix) + span.length
            traffic.messages_out += span.records
            subscription.credit -= 1
            subscription.next_chunk = span.next_chunk_id
            if not whole:
                break  # the transport holds the rest: the next chunks go through it
        self._sent_since = True

    def _more_data(self, _: object, subscription: _Subscription) -> None:
        subscription.waiting = None
        if self._subscriptions.get(subscription.id) is subscription:
            self._deliver(subscription)

    def _stop_waiting(self, subscription: _Subscription) -> None:
        if subscription.waiting is not None:
            waiting, subscription.waiting = subscription.waiting, None
            waiting.cancel()

    def _on_store_offset(self, event: sp.StoreOffset) -> None:
        if not self._require_open(event):
            return
        stream = self.factory.store.get(event.stream)
        if self._internal("store an offset in", event.stream, event.reference) or self._refused(
            Action.CONSUME, event.stream
        ):
            return  # StoreOffset has no response; the refusal is counted and logged
        if stream is not None and len(event.reference.encode()) <= MAX_REFERENCE_BYTES:
            stream.store_offset(event.reference, event.offset)

    def _on_query_offset(self, event: sp.QueryOffset) -> None:
        if not self._require_open(event):
            return
        stream = self.factory.store.get(event.stream)
        if self._internal("query an offset in", event.stream, read=True) or self._refused(
            Action.CONSUME, event.stream
        ):
            code, offset = ACCESS_REFUSED, 0
        elif stream is None:
            code, offset = STREAM_DOES_NOT_EXIST, 0
        else:
            stored = stream.query_offset(event.reference)
            code, offset = (NO_OFFSET, 0) if stored is None else (OK, stored)
        self._send(
            sp.QueryOffsetResponse(correlation_id=event.correlation_id, code=code, offset=offset)
        )

    def _on_resolve_offset_spec(self, event: Any) -> None:
        if not self._require_open(event):
            return
        stream, code = self._readable("resolve an offset in", event.stream)
        if stream is None:
            self._send(
                sp.ResolveOffsetSpecResponse(
                    correlation_id=event.correlation_id,
                    code=code,
                    offset_type=int(sp.OffsetKind.OFFSET),
                    offset=0,
                )
            )
            return
        offset = stream.seek(_spec(event.offset_spec))
        self._send(
            sp.ResolveOffsetSpecResponse(
                correlation_id=event.correlation_id,
                code=OK,
                offset_type=int(sp.OffsetKind.OFFSET),
                offset=offset,
            )
        )


def _spec(spec: sp.OffsetSpec) -> tuple[str] | tuple[str, int]:
    """The log's form of an offset specification."""
    name = spec.kind.name.lower()
    return (name,) if spec.value is None else (name, spec.value)
