"""One connection of the stream upstream: frames, requests and heartbeats.

`StreamClientProtocol` feeds the sans-IO codec (`gateway.codecs.stream`) in
the client role, writes what it returns, matches responses to requests by
correlation id, keeps the server's Tune for the handshake, sends heartbeats
and closes after two silent periods. The frames that are the upstream's
business go on at once: Deliver to its subscriptions
(`gateway.protocols.stream.consuming`), PublishConfirm and PublishError to
its publishers (`gateway.protocols.stream.publishing`). The handshake
itself is the upstream's (`StreamUpstream.handshake`), started here once
the connection is up; the rest of its life (Nagle off, a push producer, one
close that says why) is `gateway.protocols.upstream.UpstreamConnection`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from gateway.codecs import stream as sp
from gateway.protocols.upstream import UpstreamConnection

if TYPE_CHECKING:
    from gateway.protocols.stream.client import StreamUpstream

__all__ = ["REQUEST_TIMEOUT_SECONDS", "StreamClientProtocol"]

REQUEST_TIMEOUT_SECONDS: Final = 30.0
"""How long a request waits for its response before the connection is given up."""


class StreamClientProtocol(UpstreamConnection["StreamUpstream"]):
    """One connection to a stream node."""

    def __init__(self, upstream: StreamUpstream) -> None:
        super().__init__(upstream)
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._correlation = itertools.count(1)
        self._waiting: dict[int, Deferred[Any]] = {}
        self._tune: Deferred[sp.Tune] = Deferred()
        self.frame_max = upstream.settings.frame_max
        self.heartbeat = 0
        self._heard = True
        self._silent = 0
        self._timers: list[IDelayedCall] = []
        # Looked up once: the frames of the hot path go straight there.
        self._delivered = upstream.subscriptions.delivered
        self._confirmed = upstream.publishers.confirmed
        self._publish_failed = upstream.publishers.failed

    # --- connection life ------------------------------------------------------

    def connection_started(self) -> None:
        """Start the handshake."""
        Deferred.fromCoroutine(self.upstream.handshake(self)).addErrback(self._handshake_failed)

    def _handshake_failed(self, failure: Failure) -> None:
        if not self._closing:
            self.close(f"handshake failed: {failure.getErrorMessage()}")

    def connection_stopped(self) -> None:
        """Cancel the heartbeats; fail what waits for an answer."""
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        waiting, self._waiting = self._waiting, {}
        for d in waiting.values():
            d.errback(ConnectionError("connection lost"))
        if not self._tune.called:
            self._tune.errback(ConnectionError("connection lost"))
            # A handshake waiting for Tune has its failure by now; one that
            # ended before (a refused login) does not wait: nothing is left
            # to report as an unhandled error when the Deferred is collected.
            self._tune.addErrback(lambda _: None)

    # --- output ---------------------------------------------------------------

    def send(self, event: sp.Event) -> None:
        """Send one frame."""
        self.write(self._codec.send(event))

    def send_all(self, events: Sequence[sp.Event]) -> None:
        """Send frames in one write."""
        send = self._codec.send
        frames = [send(event) for event in events]
        assert self.transport is not None
        self.transport.writeSequence(frames)
        self.upstream.traffic.bytes_out += sum(map(len, frames))

    def request(self, request: Callable[..., sp.Event], **fields: Any) -> Deferred[Any]:
        """Send ``request(correlation_id=..., **fields)``; fire with its response."""
        correlation = next(self._correlation)
        answer: Deferred[Any] = Deferred()
        self._waiting[correlation] = answer
        self.send(request(correlation_id=correlation, **fields))
        answer.addTimeout(REQUEST_TIMEOUT_SECONDS, self.upstream.clock)
        return answer

    def tuned(self) -> Deferred[sp.Tune]:
        """Fire with the server's Tune."""
        return self._tune

    # --- input ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Dispatch responses and server frames."""
        if self._closing:
            return
        self._heard = True
        self.upstream.traffic.bytes_in += len(data)
        try:
            events = self._codec.receive_data(data)
        except sp.StreamError as exc:
            events = cast(list[sp.Event], exc.events)
            self._handle_all(events)
            self.upstream.count_error(exc.kind)
            self.close(f"bad frame from the server: {exc.reason}")
            return
        self._handle_all(events)

    def _handle_all(self, events: list[sp.Event]) -> None:
        for event in events:
            if isinstance(event, sp.Deliver):
                self._delivered(self, event)
            elif isinstance(event, sp.PublishConfirm):
                self._confirmed(event)
            elif isinstance(event, sp.PublishError):
                self._publish_failed(event)
            elif isinstance(event, sp.Tune):
                if not self._tune.called:
                    self._tune.callback(event)
            elif isinstance(event, sp.Heartbeat | sp.CreditResponse):
                if isinstance(event, sp.CreditResponse):
                    self.upstream.count_error("credit-refused")
            elif isinstance(event, sp.MetadataUpdate):
                self.upstream.forget_member()
                self.close(f"stream {event.stream} changed (code {event.code})")
            elif isinstance(event, sp.Close):
                self.send(sp.CloseResponse(correlation_id=event.correlation_id, code=1))
                self.close(f"the server closed the connection: {event.code} {event.reason}")
            else:
                correlation = getattr(event, "correlation_id", None)
                waiter = self._waiting.pop(correlation, None) if correlation is not None else None
                if waiter is not None:
                    waiter.callback(event)
            if self._closing:
                return

    # --- heartbeats -----------------------------------------------------------

    def start_heartbeats(self, seconds: int) -> None:
        """Send heartbeats every ``seconds`` and close after two silent periods."""
        self.heartbeat = seconds
        if seconds:
            self._timers.append(self.upstream.clock.callLater(seconds, self._beat))

    def _beat(self) -> None:
        if self._closing:
            return
        self.send(sp.Heartbeat())
        if self._heard:
            self._silent = 0
        else:
            self._silent += 1
            if self._silent >= 2:
                self.close(f"no frame from the server for {2 * self.heartbeat} s")
                return
        self._heard = False
        self._timers = [t for t in self._timers if t.active()]
        self._timers.append(self.upstream.clock.callLater(self.heartbeat, self._beat))
