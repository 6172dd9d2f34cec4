"""Consuming from RabbitMQ streams: the stream upstream's subscriptions.

`Subscriptions` is the consuming half of `StreamUpstream`. Each stream of
``subscribe`` is read under credit from the offset stored under
``consumer_name`` (or the configured offset the first time; after a
reconnect, from past what was already routed on the connection before:
those messages still get their outcomes, and are not routed twice). Each
Deliver chunk's messages go along the routes from the upstream as one
batch (DESIGN.md, "The batch is the unit of work"); credit is granted once
they all have outcomes, and the last offset whose messages all have
outcomes is stored as soon as a chunk settles, at most once every
``store_offset_interval_seconds``, and at stop.

Each message carries its `Origin`, ``<consumer_name>@<stream>`` and its
offset, so that routes deliver it under ids that whoever reads it again
uses too (`gateway.core.origins`): into a stream (RabbitMQ's or a local
one), what is read again after a reconnection, a restart or a takeover is
stored once. A durable route that has committed such messages and not yet
delivered them holds the stored offset below them (`Router.unforwarded`).

In a fleet, the subscriptions run on the node holding the upstream's lock
(`gateway.fleet.locks`): `forbid` stops them at once when the lock is
lost (the settled offsets are stored, the subscriptions cancelled, and any
delivery still coming is dropped), `allow` subscribes again when it is
held, from the offsets stored under ``consumer_name``, which has no node id
in it, so that a node taking over goes on where the last holder stopped.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.inbox import Inbox
from gateway.core.message import Message, Origin
from gateway.core.router import Result, Unrouted
from gateway.protocols.stream.link import StreamConnection, StreamLink
from gateway.protocols.stream.mapping import message_from_entry

__all__ = ["Subscriptions", "parse_offset"]


def parse_offset(text: str) -> sp.OffsetSpec:
    """Parse ``first``, ``last``, ``next``, ``offset:N`` or ``timestamp:MS``.

    Raises:
        ValueError: Anything else.
    """
    kind, _, value = text.partition(":")
    simple = {"first": sp.OffsetKind.FIRST, "last": sp.OffsetKind.LAST, "next": sp.OffsetKind.NEXT}
    if kind in simple and not value:
        return sp.OffsetSpec(kind=simple[kind])
    if kind in ("offset", "timestamp") and value.lstrip("-").isdigit():
        number = int(value)
        if kind == "offset" and number >= 0:
            return sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=number)
        if kind == "timestamp":
            return sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=number)
    raise ValueError(f"{text!r} is not first, last, next, offset:N or timestamp:MILLISECONDS")


class _Subscription:
    """One consumed stream."""

    __slots__ = ("after", "chunks", "id", "last_stored", "reader", "settled", "skip", "stream")

    def __init__(self, subscription_id: int, stream: str, reader: str) -> None:
        self.id = subscription_id
        self.stream = stream
        self.reader = reader
        """`Origin.reader` of its messages: ``<consumer name>@<stream>``."""
        self.skip = 0
        """Settled chunks to grant no credit for: a new connection's subscription was
        given credit while chunks routed on the one before were still open."""
        self.after = -1
        """Offsets up to this one were dispatched already (whole chunks come again)."""
        self.settled = -1
        """Offsets up to this one have outcomes: the offset that may be stored."""
        self.last_stored = -1
        self.chunks: deque[list[int]] = deque()
        """Dispatched chunks in order, as [last offset, 1 once settled else 0]."""

    def settle(self, chunk: list[int]) -> None:
        """Mark a chunk settled; move `settled` past the settled chunks at the front."""
        chunk[1] = 1
        while self.chunks and self.chunks[0][1]:
            self.settled = max(self.settled, self.chunks.popleft()[0])


def _open_chunks(subscription: _Subscription) -> int:
    """The chunks routed and not settled yet."""
    return sum(1 for chunk in subscription.chunks if not chunk[1])


class Subscriptions:
    """The consumed streams of a stream upstream: subscribing, chunks, credit and offsets.

    Args:
        upstream: The upstream it reads for (its name, route source,
            settings, router, counters, clock and ready connection).
        streams: The streams to subscribe to.
    """

    _log = Logger()

    def __init__(self, upstream: StreamLink, streams: tuple[str, ...]) -> None:
        self._upstream = upstream
        self._name = upstream.name
        self._source = upstream.source
        self._settings = upstream.settings
        self._router = upstream.router
        self._traffic = upstream.traffic
        self._consumer_name = upstream.consumer_name
        self._streams = streams
        self._subscriptions: dict[int, _Subscription] = {}
        self._store_call: IDelayedCall | None = None
        self._stored_at = float("-inf")
        """When offsets were last stored (a store waits out the interval after it)."""
        self._allowed = True
        """Whether this node may consume (it holds the fleet lock, or there is none)."""
        self._epoch = 0
        """Bumped by `allow` and `forbid`: a subscribing run that sees it change stops."""
        self._subscribed_on: StreamConnection | None = None
        """The connection subscribed on (or being subscribed), while allowed."""

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams subscribed to, in their configured order."""
        return self._streams

    def stop(self) -> None:
        """The upstream stops: store what was settled, and nothing more later."""
        if self._store_call is not None and self._store_call.active():
            self._store_call.cancel()
        self._store_call = None
        self.store_offsets()

    @property
    def allowed(self) -> bool:
        """Whether the subscriptions may run on this node."""
        return self._allowed

    def allow(self) -> None:
        """This node may consume (it holds the fleet lock): subscribe on the ready connection.

        Without one, the next connection's handshake subscribes.
        """
        if self._allowed:
            return
        self._allowed = True
        self._epoch += 1
        connection = self._upstream.connection
        if connection is not None and not connection.closing:
            resumed = Deferred.fromCoroutine(self._resume(connection))
            resumed.addErrback(self._resume_failed, connection)

    async def _resume(self, connection: StreamConnection) -> None:
        await self.subscribe_all(connection)
        self.schedule_store()

    def _resume_failed(self, failure: Failure, connection: StreamConnection) -> None:
        # As a failed handshake does: the next connection subscribes again.
        if not connection.closing:
            connection.close(f"subscribing failed: {failure.getErrorMessage()}")

    def forbid(self) -> None:
        """Stop consuming at once (the fleet lock is lost, or not held yet).

        The settled offsets are stored first (the next holder goes on from
        them), the subscriptions cancelled, and what is still delivered for
        them dropped, unrouted and without credit. Messages already routed
        still get their outcomes; their offsets are not stored here.
        """
        self._allowed = False
        self._epoch += 1
        self._subscribed_on = None
        if self._store_call is not None and self._store_call.active():
            self._store_call.cancel()
        self._store_call = None
        self.store_offsets()
        subscriptions, self._subscriptions = self._subscriptions, {}
        connection = self._upstream.connection
        if connection is not None and not connection.closing:
            for subscription in subscriptions.values():
                self._unsubscribe(connection, subscription.id, subscription.stream)

    def _unsubscribe(self, connection: StreamConnection, subscription_id: int, stream: str) -> None:
        def answered(answer: Any) -> None:
            code = getattr(answer, "code", 1)
            if code != 1:
                self._log.warn(
                    "upstream {upstream}: cannot unsubscribe from {stream} (code {code})",
                    upstream=self._name,
                    stream=stream,
                    code=code,
                )

        unsubscribing = connection.request(sp.Unsubscribe, subscription_id=subscription_id)
        # No answer: the connection is closing (or closed), which ends the subscription too.
        unsubscribing.addCallbacks(answered, lambda _: None)

    async def subscribe_all(self, protocol: StreamConnection) -> None:
        """Subscribe to each stream on a new connection, from where reading should go on.

        Nothing while not `allowed`, nor twice on one connection.
        """
        if not self._allowed or self._subscribed_on is protocol:
            return
        self._subscribed_on = protocol
        epoch = self._epoch
        # What the last connection routed: those messages get their outcomes
        # all the same (the router answers every batch), so reading goes on
        # past them, and their chunks settle into the same subscription.
        before = {sub.stream: sub for sub in self._subscriptions.values()}
        self._subscriptions.clear()
        credit = self._settings.credit
        for index, stream in enumerate(self._streams):
            stored = await protocol.request(
                sp.QueryOffset, reference=self._consumer_name, stream=stream
            )
            if epoch != self._epoch:
                return  # forbidden meanwhile
            stored_offset = stored.offset if stored.code == 1 else -1
            subscription = before.get(stream)
            if subscription is None:
                subscription = _Subscription(index, stream, f"{self._consumer_name}@{stream}")
                subscription.last_stored = stored_offset
            resume = max(stored_offset, subscription.after)
            if resume >= 0:
                spec = sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=resume + 1)
                subscription.after = resume
                subscription.settled = max(subscription.settled, stored_offset)
                if not subscription.chunks:
                    subscription.settled = resume
            else:
                spec = parse_offset(self._settings.offset)
                if spec.kind is sp.OffsetKind.OFFSET and spec.value is not None:
                    subscription.after = spec.value - 1
            # The chunks still open count against the credit, which their
            # settling gives back on this connection.
            granted = max(credit - _open_chunks(subscription), 1)
            answer = await protocol.request(
                sp.Subscribe,
                subscription_id=index,
                stream=stream,
                offset_spec=spec,
                credit=granted,
                properties={"name": self._consumer_name},
            )
            if epoch != self._epoch:
                # Forbidden while it was being made: it must not consume.
                if answer.code == 1 and not protocol.closing:
                    self._unsubscribe(protocol, index, stream)
                return
            if answer.code == 1:
                self._subscriptions[index] = subscription
                # Chunks that settled meanwhile granted nothing: make up for them.
                owed = credit - granted - _open_chunks(subscription)
                subscription.skip = max(-owed, 0)
                if owed > 0 and not protocol.closing:
                    protocol.send(sp.Credit(subscription_id=index, credit=owed))
            else:
                self._log.warn(
                    "upstream {upstream}: cannot subscribe to {stream} (code {code})",
                    upstream=self._name,
                    stream=stream,
                    code=answer.code,
                )

    def delivered(self, protocol: StreamConnection, event: sp.Deliver) -> None:
        """Route a chunk's messages; grant credit once they all have outcomes."""
        subscription = self._subscriptions.get(event.subscription_id)
        if subscription is None:
            return
        chunk = bytes(event.chunk)
        try:
            header = osiris.ChunkHeader.unpack(chunk)
            data = chunk[osiris.HEADER_BYTES :]
            if len(data) != header.data_length or zlib.crc32(data) != header.crc:
                raise osiris.OsirisError("chunk length or CRC does not match", kind="bad-crc")
        except osiris.OsirisError as exc:
            self._upstream.count_error(exc.kind)
            protocol.close(f"bad chunk from the server: {exc.reason}")
            return
        entries: list[bytes | memoryview] = []
        try:
            entries.extend(osiris.iter_entries(data))
        except osiris.OsirisError as exc:
            # Intact as sent (the CRC matched) but not readable here, such as
            # a sub-batch compressed with snappy, lz4 or zstd by its
            # publisher: reading it again would not help, so skip the rest.
            self._upstream.count_error(exc.kind)
            self._log.error(
                "upstream {upstream}: skipping the rest of chunk {chunk_id} of {stream}"
                " after {read} readable records: {reason}",
                upstream=self._name,
                chunk_id=header.first_offset,
                stream=subscription.stream,
                read=len(entries),
                reason=exc.reason,
            )
        timestamp = header.timestamp / 1000
        first_offset = header.first_offset
        reader = subscription.reader
        last = first_offset + header.num_records - 1
        first_new = subscription.after + 1 - header.first_offset
        subscription.after = max(subscription.after, last)
        chunk_state = [last, 0]
        subscription.chunks.append(chunk_state)
        self._traffic.messages_in += len(entries)
        stream = subscription.stream
        left = 0
        dispatched = False

        def answer(message: Message, result: Result) -> None:
            nonlocal left
            if isinstance(result, Unrouted):
                self._upstream.count_error("unrouted")
            elif not result.is_accepted:
                self._log.warn(
                    "upstream {upstream}: message {id} from {stream} not delivered: {reason}",
                    upstream=self._name,
                    id=message.id,
                    stream=stream,
                    reason=result.reason,
                )
            left -= 1
            if not left and dispatched:
                self._chunk_settled(protocol, subscription, chunk_state)

        # The chunk is one batch: the router has it all at once, and the
        # chunk is settled (credit, then its offset may be stored) once every
        # message has its result, whatever the result.
        inbox: Inbox[Message] = Inbox(self._router, self._source, answer)
        for index in range(max(first_new, 0), len(entries)):
            offset = first_offset + index
            message = message_from_entry(
                entries[index],
                stream=stream,
                timestamp=timestamp,
                offset=offset,
                origin=Origin(reader, offset),
            )
            inbox.add(message, message)
        left = len(inbox)
        inbox.dispatch()
        dispatched = True
        if not left:
            self._chunk_settled(protocol, subscription, chunk_state)

    def _chunk_settled(
        self, protocol: StreamConnection, subscription: _Subscription, chunk: list[int]
    ) -> None:
        subscription.settle(chunk)
        if self._subscriptions.get(subscription.id) is not subscription:
            return  # forbidden since: the next holder reads on from the stored offset
        self._credit(subscription)
        self.schedule_store()

    def _credit(self, subscription: _Subscription) -> None:
        """Grant one chunk of credit on the connection subscribed now (whichever routed it)."""
        if subscription.skip:
            subscription.skip -= 1
            return
        connection = self._upstream.connection
        if connection is not None and not connection.closing and self._subscribed_on is connection:
            connection.send(sp.Credit(subscription_id=subscription.id, credit=1))

    def schedule_store(self) -> None:
        """Store the settled offsets soon, once the store interval passed since the last one.

        On the next reactor turn if ``store_offset_interval_seconds`` has
        passed already: what settles in this turn goes in the same store.
        """
        if self._store_call is not None and self._store_call.active():
            return
        clock = self._upstream.clock
        wait = self._stored_at + self._settings.store_offset_interval_seconds - clock.seconds()
        self._store_call = clock.callLater(max(wait, 0.0), self._store_tick)

    def _store_tick(self) -> None:
        self._store_call = None
        self._stored_at = self._upstream.clock.seconds()
        if self.store_offsets() and self._upstream.running and self._subscriptions:
            self.schedule_store()  # a route holds an offset back: ask again later

    def store_offsets(self) -> bool:
        """Store each subscription's settled offset, if it moved, on the ready connection.

        Only offsets whose messages all have outcomes, so that a restart
        does not skip messages that were routed but never delivered; and
        below what a durable route committed and has not delivered yet
        (`Router.unforwarded`), so that whoever reads next reads it again.

        Returns:
            Whether a route held an offset back (stored later, then).
        """
        connection = self._upstream.connection
        if connection is None or connection.closing:
            return False
        held = False
        for subscription in self._subscriptions.values():
            offset = subscription.settled
            if offset <= subscription.last_stored:
                continue
            lowest = self._router.unforwarded(self._source, subscription.reader)
            if lowest is not None and lowest <= offset:
                offset = lowest - 1
                held = True
            if offset > subscription.last_stored:
                connection.send(
                    sp.StoreOffset(
                        reference=self._consumer_name,
                        stream=subscription.stream,
                        offset=offset,
                    )
                )
                subscription.last_stored = offset
        return held
