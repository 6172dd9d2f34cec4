"""Durable routes: commit to the log, acknowledge, forward from the log.

A route with ``durable = true`` hands each batch to a `DurableDelivery`,
which appends it (translated for the destination) to the route's own stream
in the embedded log as one append (one chunk, one fsync for all its
senders) and answers every message accepted once the log committed it: the
sender's K, 200 or PublishConfirm means "safe on disk". A `LogForwarder`
then delivers from that stream to the route's destination, with retries, a
dead-letter stream for messages that keep being rejected, and a stored
offset, so a restart resumes where it stopped and loses nothing.

Forwarding is at least once: after a crash the forwarder delivers again
what it had delivered since its offset was last stored. A destination that
deduplicates (`IDeduplicatingDestination`: a local stream, a RabbitMQ
stream) is handed the route's name as producer and each message's offset
plus one as its publishing id, and stores each message once.

What a consumer read (a message with an `Origin`) keeps its origin in the
route's stream, and is delivered under it instead (`gateway.core.origins`):
so a message that a consumer reads again after a takeover, a restart or a
reconnection, and that the route commits again, is stored once in the
destination all the same. Into a fleet-wide destination (a RabbitMQ stream)
the route also keeps what it committed and has not delivered yet
(`PendingOrigins`): the consumer stores no offset past it, so that what a
node killed before delivering it had committed is read again by whoever
reads next.

The committed batch is also handed to the forwarder (`LogForwarder.hold`,
one call per chunk the append went into, at the offsets the log gave it),
so that while the forwarder keeps up with the tail it delivers these very
messages instead of reading and decoding what was just written.

Outcome records (`gateway.core.outcomes`): a committed batch is one range
record naming the route's stream and the offsets it took; a batch the log
did not commit is recorded per message, with what its senders were told.

A batch that reaches the log after it closed (the gateway is stopping) is
answered retry later without a record or a traceback: an orderly stop, not
a fault. One line says so, the first time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.forwarder import ForwarderSettings, LogForwarder
from gateway.core.interfaces import IDeduplicatingDestination, IDestination, IRouteDelivery
from gateway.core.internal import FORWARDER_REFERENCE_PREFIX, ROUTE_STREAM_PREFIX
from gateway.core.log import AppendResult, LogClosedError, LogFullError
from gateway.core.message import Message, Outcome
from gateway.core.origins import PendingOrigins, deliver_once
from gateway.core.outcomes import KIND_ROUTE, OutcomeRecorder
from gateway.core.router import Route

__all__ = [
    "DurableDelivery",
    "DurableRoutes",
    "producer_reference",
    "reader_reference",
    "route_stream_name",
]

MAX_REFERENCE_BYTES: Final = 255
"""Publisher references are short strings in the stream protocol and the log's tracking."""


def route_stream_name(route: str) -> str:
    """The stream a durable route keeps its messages in."""
    return ROUTE_STREAM_PREFIX + route


def _once(
    destination: IDestination, route: str
) -> Callable[[Sequence[Message], Sequence[int]], Deferred[list[Outcome]]] | None:
    """Deliver with the route as producer, where the destination can store each id once.

    Messages a consumer read go under their origin's ids, the others under
    the route's own (`gateway.core.origins.deliver_once`).
    """
    if not IDeduplicatingDestination.providedBy(destination):
        return None

    def deliver(messages: Sequence[Message], ids: Sequence[int]) -> Deferred[list[Outcome]]:
        return deliver_once(destination, route, messages, ids)

    return deliver


def producer_reference(prefix: str, producer: str) -> str:
    """A publisher reference for a durable route's producer, at most 255 UTF-8 bytes.

    ``prefix`` says whose it is (the gateway's own log, or an upstream's
    configured reference); a name too long to fit is replaced by its hash.
    """
    reference = f"{prefix}.route.{producer}"
    if len(reference.encode("utf-8")) <= MAX_REFERENCE_BYTES:
        return reference
    digest = hashlib.sha256(producer.encode("utf-8")).hexdigest()[:32]
    return f"{prefix[: MAX_REFERENCE_BYTES - 40]}.route.{digest}"


def reader_reference(reader: str, producer: str) -> str:
    """The publisher reference for what ``reader`` read, delivered by ``producer``.

    ``<reader>.route.<producer>``: no node id, the same on every node (see
    `gateway.core.origins`); a pair too long for 255 UTF-8 bytes is
    replaced by its hash.
    """
    reference = f"{reader}.route.{producer}"
    if len(reference.encode("utf-8")) <= MAX_REFERENCE_BYTES:
        return reference
    digest = hashlib.sha256(f"{reader}\0{producer}".encode()).hexdigest()[:32]
    return f"msggateway.reader.{digest}"


class _Log(Protocol):
    def get(self, name: str) -> object | None: ...

    def create(self, name: str) -> object: ...


@implementer(IRouteDelivery)
class DurableDelivery:
    """Append each batch to the route's stream; accepted once committed.

    Args:
        route: The route.
        stream: The route's stream (`route_stream_name`).
        encode: A batch's messages to their stored entries.
        clock: Times the outcome records.
        forwarder: The route's forwarder, handed each committed batch.
        recorder: Keeps the outcome records, if any.
        log_closed: Told the route and the count of a batch refused because
            the log is closed (the gateway is stopping), if given.
        pending: Keeps what consumers read and the route committed until
            the forwarder delivered it (`PendingOrigins`), if the route
            delivers by origin into a fleet-wide destination.
    """

    _log = Logger()

    def __init__(
        self,
        route: Route,
        stream: object,
        encode: Callable[[Sequence[Message]], Sequence[bytes | memoryview]],
        *,
        clock: IReactorTime | None = None,
        forwarder: LogForwarder | None = None,
        recorder: OutcomeRecorder | None = None,
        log_closed: Callable[[str, int], None] | None = None,
        pending: PendingOrigins | None = None,
    ) -> None:
        if recorder is not None and clock is None:
            raise ValueError("outcome records need a clock")
        self.route = route
        self._stream = stream
        self._encode = encode
        self._clock = clock
        self._forwarder = forwarder
        self._recorder = recorder
        self._log_closed = log_closed
        self._pending = pending

    def unforwarded(self, reader: str) -> int | None:
        """The lowest offset of ``reader`` committed here and not delivered yet, if any.

        A consumer stores no offset at or past it (`gateway.core.router.Router.unforwarded`).
        """
        return None if self._pending is None else self._pending.lowest(reader)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Commit the batch as one append (one chunk, one fsync); forwarded later."""
        entries = self._encode(messages)
        arrived = 0.0 if self._clock is None else self._clock.seconds()
        try:
            appended: Deferred[AppendResult] = self._stream.append(entries)  # type: ignore[attr-defined]
        except Exception:
            return succeed(self._failed(Failure(), messages, arrived))
        nbytes = sum(map(len, entries)) if self._forwarder is not None else 0
        return appended.addCallbacks(
            self._committed,
            self._failed,
            callbackArgs=(messages, nbytes, arrived),
            errbackArgs=(messages, arrived),
        )

    def _committed(
        self, result: AppendResult, messages: Sequence[Message], nbytes: int, arrived: float
    ) -> list[Outcome]:
        count = len(messages)
        spans = result.spans
        if self._pending is not None and spans and messages[0].origin is not None:
            last, taken = spans[-1]
            self._pending.committed(last + taken - 1, messages[: result.stored])
        forwarder = self._forwarder
        if forwarder is not None and result.stored == count and count:
            if len(spans) == 1:
                forwarder.hold(spans[0][0], messages, nbytes)
            else:  # the batch went into several chunks
                done = 0
                for first, taken in spans:
                    part = messages[done : done + taken]
                    forwarder.hold(first, part, nbytes * taken // count)
                    done += taken
        recorder = self._recorder
        if recorder is not None:
            name = self._stream.name  # type: ignore[attr-defined]
            route = self.route
            accepted = Outcome.accepted()
            for first, taken in spans:
                recorder.record_range(
                    KIND_ROUTE,
                    route.name,
                    route.source,
                    name,
                    first,
                    first + taken - 1,
                    arrived,
                    accepted,
                )
        return [Outcome.accepted()] * count

    def _failed(
        self, failure: Failure, messages: Sequence[Message], arrived: float
    ) -> list[Outcome]:
        route = self.route
        if failure.check(LogClosedError):
            # The gateway is stopping: nothing was stored, and no record can be.
            if self._log_closed is not None:
                self._log_closed(route.name, len(messages))
            return [Outcome.retry(f"route {route.name}: the gateway is stopping")] * len(messages)
        if failure.check(CancelledError):
            # The router's deadline: the commit may still happen (and the
            # forwarder deliver it); the sender was told to retry.
            self._log.warn(
                "durable route {route}: the log did not commit within {seconds} seconds",
                route=route.name,
                seconds=route.timeout_seconds,
            )
            reason = (
                f"route {route.name}: the log did not commit the message"
                f" within {route.timeout_seconds:g} seconds"
            )
        elif failure.check(LogFullError):
            # The stream has logged it (once per failed write, with the file
            # and the free space): no line per batch, no file path to senders.
            reason = (
                f"route {route.name}: the log could not store the message: its file"
                " system is full; writing resumes by itself once there is room"
            )
        else:
            self._log.failure(
                "durable route {route}: could not commit to the log", failure, route=route.name
            )
            reason = f"route {route.name}: the log could not store the message"
        outcomes = [Outcome.retry(reason)] * len(messages)
        recorder = self._recorder
        if recorder is not None and self._clock is not None:
            recorder.record_batch(KIND_ROUTE, route.name, route.source, messages, arrived, outcomes)
        return outcomes


class DurableRoutes:
    """The durable routes of a gateway: their streams, deliveries and forwarders.

    `delivery` is what `bind_routes` calls for a route with ``durable = true``.

    Args:
        store: The embedded log.
        clock: For retries.
        encode: A batch's messages to their stored entries.
        decode: A stored entry (with offset and timestamp) back to a message.
        dead_letter: Given the dead-letter stream's and the route's names,
            returns what writes a message that kept being rejected there.
    """

    _log = Logger()

    def __init__(
        self,
        store: _Log,
        clock: IReactorTime,
        encode: Callable[[Sequence[Message]], Sequence[bytes | memoryview]],
        decode: Callable[[bytes, int, float], Message],
        dead_letter: Callable[[str, str], Callable[[Message, Outcome], Deferred[object]]],
    ) -> None:
        self._store = store
        self._clock = clock
        self._encode = encode
        self._decode = decode
        self._dead_letter = dead_letter
        self.forwarders: dict[str, LogForwarder] = {}
        self._pending: dict[str, PendingOrigins] = {}
        """What each route delivering by origin into a fleet-wide destination has not
        delivered yet; kept across reloads, which replace the route's forwarder."""
        self._running = False
        self.recorder: OutcomeRecorder | None = None
        """Keeps what each route commits and each forwarder forwards (the
        outcome record), when set; set it before `delivery` is called."""
        self.refused_closed = 0
        """Messages answered retry later because the log had closed (a stop)."""

    def _stream(self, name: str) -> object:
        stream = self._store.get(name)
        return stream if stream is not None else self._store.create(name)

    def delivery(self, route: Route, destination: IDestination) -> IRouteDelivery:
        """The delivery for a durable route (its forwarder is made and started too)."""
        stream = self._stream(route_stream_name(route.name))
        previous = self.forwarders.pop(route.name, None)
        if previous is not None:
            previous.stop()
        recorder = self.recorder
        forwarder = LogForwarder(
            reference=FORWARDER_REFERENCE_PREFIX + route.name,
            stream=stream,  # type: ignore[arg-type]
            deliver=destination.deliver,
            to_message=self._decode,
            dead_letter=self._dead_letter(route.dead_letter, route.name),
            clock=self._clock,
            settings=ForwarderSettings(max_attempts=route.max_attempts),
            on_forwarded=(
                None
                if recorder is None
                else recorder.forwarded(route.name, route_stream_name(route.name))
            ),
            deliver_once=_once(destination, route.name),
        )
        self.forwarders[route.name] = forwarder
        if self._running:
            forwarder.start()
        pending: PendingOrigins | None = None
        if IDeduplicatingDestination.providedBy(destination) and destination.fleet_wide:
            pending = self._pending.get(route.name)
            if pending is None:
                pending = self._pending[route.name] = PendingOrigins(forwarder.done_offset)
            pending.delivered = forwarder.done_offset
        return DurableDelivery(
            route,
            stream,
            self._encode,
            clock=self._clock,
            forwarder=forwarder,
            recorder=recorder,
            log_closed=self._refused_closed,
            pending=pending,
        )

    def _refused_closed(self, route: str, count: int) -> None:
        """Say once that the log closed under the durable routes; count the rest."""
        if not self.refused_closed:
            self._log.info(
                "durable route {route}: the log is closed (the gateway is stopping): messages"
                " still arriving are answered retry later",
                route=route,
            )
        self.refused_closed += count

    def retire(self, keep: set[str]) -> None:
        """Stop the forwarders of routes that are no longer durable (after a reload)."""
        for name in list(self.forwarders):
            if name not in keep:
                self.forwarders.pop(name).stop()

    def start(self) -> None:
        """Start every forwarder."""
        self._running = True
        for forwarder in self.forwarders.values():
            forwarder.start()

    def stop(self) -> None:
        """Stop every forwarder (what is in progress is delivered again later)."""
        self._running = False
        for forwarder in self.forwarders.values():
            forwarder.stop()
