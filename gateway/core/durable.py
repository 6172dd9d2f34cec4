"""Durable routes: commit to the log, acknowledge, forward from the log.

A route with ``durable = true`` hands each message to a `DurableDelivery`,
which appends it (translated for the destination) to the route's own stream
in the embedded log and answers accepted once the log committed it: the
sender's K, 200 or PublishConfirm means "safe on disk". A `LogForwarder`
then delivers from that stream to the route's destination, with retries, a
dead-letter stream for messages that keep being rejected, and a stored
offset, so a restart resumes where it stopped and loses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.forwarder import ForwarderSettings, LogForwarder
from gateway.core.interfaces import IDestination, IRouteDelivery
from gateway.core.message import Message, Outcome
from gateway.core.outcomes import OutcomeRecorder
from gateway.core.router import Route

__all__ = ["DurableDelivery", "DurableRoutes", "route_stream_name"]

ROUTE_STREAM_PREFIX: Final = "msggateway.route."


def route_stream_name(route: str) -> str:
    """The stream a durable route keeps its messages in."""
    return ROUTE_STREAM_PREFIX + route


class _Log(Protocol):
    def get(self, name: str) -> object | None: ...

    def create(self, name: str) -> object: ...


@implementer(IRouteDelivery)
class DurableDelivery:
    """Append each batch to the route's stream; accepted once committed."""

    _log = Logger()

    def __init__(self, route: Route, stream: object, encode: Callable[[Message], bytes]) -> None:
        self.route = route
        self._stream = stream
        self._encode = encode

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Commit the batch as one append (one chunk, one fsync); forwarded later."""
        encode = self._encode
        try:
            appended: Deferred[object] = self._stream.append(  # type: ignore[attr-defined]
                [encode(message) for message in messages]
            )
        except Exception:
            return succeed(self._failed(Failure(), len(messages)))
        return appended.addCallbacks(
            self._committed,
            self._failed,
            callbackArgs=(len(messages),),
            errbackArgs=(len(messages),),
        )

    def _committed(self, _result: object, count: int) -> list[Outcome]:
        return [Outcome.accepted()] * count

    def _failed(self, failure: Failure, count: int) -> list[Outcome]:
        self._log.failure(
            "durable route {route}: could not commit to the log", failure, route=self.route.name
        )
        return [
            Outcome.retry(f"route {self.route.name}: the log could not store the message")
        ] * count


class DurableRoutes:
    """The durable routes of a gateway: their streams, deliveries and forwarders.

    `delivery` is what `bind_routes` calls for a route with ``durable = true``.

    Args:
        store: The embedded log.
        clock: For retries.
        encode: A message to a stored entry.
        decode: A stored entry (with offset and timestamp) back to a message.
        dead_letter: Given the dead-letter stream's and the route's names,
            returns what writes a message that kept being rejected there.
    """

    _log = Logger()

    def __init__(
        self,
        store: _Log,
        clock: IReactorTime,
        encode: Callable[[Message], bytes],
        decode: Callable[[bytes, int, float], Message],
        dead_letter: Callable[[str, str], Callable[[Message, Outcome], Deferred[object]]],
    ) -> None:
        self._store = store
        self._clock = clock
        self._encode = encode
        self._decode = decode
        self._dead_letter = dead_letter
        self.forwarders: dict[str, LogForwarder] = {}
        self._running = False
        self.recorder: OutcomeRecorder | None = None
        """Told what each forwarder settles (the outcome record), when set."""

    def _stream(self, name: str) -> object:
        stream = self._store.get(name)
        return stream if stream is not None else self._store.create(name)

    def delivery(self, route: Route, destination: IDestination) -> IRouteDelivery:
        """The delivery for a durable route (its forwarder is made and started too)."""
        stream = self._stream(route_stream_name(route.name))
        previous = self.forwarders.pop(route.name, None)
        if previous is not None:
            previous.stop()
        forwarder = LogForwarder(
            reference=f"msggateway.forwarder.{route.name}",
            stream=stream,  # type: ignore[arg-type]
            deliver=destination.deliver,
            to_message=self._decode,
            dead_letter=self._dead_letter(route.dead_letter, route.name),
            clock=self._clock,
            settings=ForwarderSettings(max_attempts=route.max_attempts),
            on_settled=None if self.recorder is None else self.recorder.forwarded(route.name),
        )
        self.forwarders[route.name] = forwarder
        if self._running:
            forwarder.start()
        return DurableDelivery(route, stream, self._encode)

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
