"""The SSMP client role: the gateway as a peer of another SSMP server.

`SSMPUpstream` keeps one connection to the server through Twisted's
`ClientService` (reconnects with backoff), logs in (``secret`` from the
secrets file, ``cert`` through the endpoint's client certificate, or
``open``), subscribes to its topics, answers PING and pings an idle server.
It is the upstream's `IDestination` (routes deliver to it as MCAST requests,
or UCAST and BCAST for the address forms ``!ucast.<peer>`` and ``!bcast``;
the responses become outcomes) and a route source (the MCAST, UCAST and
BCAST events of one read are dispatched along the routes from it as one
batch).

Responses carry no request id; SSMP answers requests in order, so responses
are matched first in, first out. A batch of deliveries is written with one
write and waits in the queue of responses as one entry, whose outcomes are
collected in one `Answers`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from zope.interface import implementer

from gateway.codecs import ssmp
from gateway.core.auth import Secrets
from gateway.core.batch import Answers, all_same
from gateway.core.inbox import Inbox, Result
from gateway.core.interfaces import IDestination, IFleetLock
from gateway.core.message import Message, Outcome
from gateway.core.router import Router, Unrouted
from gateway.metrics import GatewayMetrics
from gateway.protocols.ssmp.mapping import (
    message_from_bcast,
    message_from_mcast,
    message_from_ucast,
    outcome_from_response,
    request_line,
)
from gateway.protocols.ssmp.settings import SSMPUpstreamSettings
from gateway.protocols.upstream import Upstream, UpstreamConnection

__all__ = ["SSMPClientProtocol", "SSMPUpstream"]

_PING: Final = b"PING\n"
_PONG: Final = b"PONG\n"

_Callback = Callable[[ssmp.Response | None], None]
"""Called with the matching response, or None if the connection was lost first."""


class _Single:
    """One request of our own (LOGIN, SUBSCRIBE) awaiting its response."""

    __slots__ = ("_callback",)

    def __init__(self, callback: _Callback) -> None:
        self._callback = callback

    def take(self, response: ssmp.Response) -> bool:
        """Its response came; it waits for no more."""
        self._callback(response)
        return True

    def lost(self, upstream: str) -> None:
        """The connection ended first."""
        self._callback(None)


class _Batch:
    """A batch's requests, written together, awaiting their responses in order.

    The responses settle the batch's `Answers`. One that comes after the
    router gave up on the batch (its deadline) still takes its request's
    place in the order, and is otherwise ignored.
    """

    __slots__ = ("_answers", "_indices", "_next", "_upstream")

    def __init__(self, upstream: str, answers: Answers, indices: list[int]) -> None:
        self._upstream = upstream
        self._answers = answers
        self._indices = indices
        self._next = 0

    def take(self, response: ssmp.Response) -> bool:
        """The response to the next request; True when it was the last one."""
        at = self._next
        self._answers.settle(self._indices[at], outcome_from_response(self._upstream, response))
        self._next = at + 1
        return self._next == len(self._indices)

    def lost(self, upstream: str) -> None:
        """The connection ended before the rest were answered."""
        self._answers.settle_rest(
            Outcome.retry(f"connection to {upstream} lost before it answered")
        )


_Awaiting = _Single | _Batch


class SSMPClientProtocol(UpstreamConnection["SSMPUpstream"]):
    """One connection from the gateway to an SSMP server."""

    def __init__(self, upstream: SSMPUpstream) -> None:
        super().__init__(upstream)
        settings = upstream.settings
        self._codec = ssmp.SSMPCodec(ssmp.Role.CLIENT, max_line_bytes=settings.max_line_bytes)
        self._waiters: deque[_Awaiting] = deque()
        self._ready = False
        self._paused = False
        self._last_heard = 0.0
        self._awaiting_pong = False
        self._timer: IDelayedCall | None = None
        self._inbox: Inbox[Message] = Inbox(upstream.router, upstream.name, self._routed)

    # --- connection life ------------------------------------------------------

    def connection_started(self) -> None:
        """Log in."""
        upstream = self.upstream
        settings = upstream.settings
        credential: bytes | None = None
        if settings.scheme == "secret":
            credential = upstream.secrets.credential_for(upstream.name)
        login = ssmp.Login(
            identity=settings.identity.encode("ascii"),
            scheme=settings.scheme.encode("ascii"),
            credential=credential,
        )
        self._write(self._codec.send(login))
        self._waiters.append(_Single(self._logged_in))
        self._last_heard = upstream.clock.seconds()
        self._arm_timer(settings.ping_interval_seconds)

    def connection_stopped(self) -> None:
        """Tell everyone waiting for a response that none will come."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        waiters, self._waiters = self._waiters, deque()
        name = self.upstream.name
        for waiter in waiters:
            waiter.lost(name)

    def _write(self, data: bytes, lines: int = 1) -> None:
        self.write(data)
        self.upstream.traffic.messages_out += lines

    # --- login and subscriptions ----------------------------------------------

    def _logged_in(self, response: ssmp.Response | None) -> None:
        if response is None:
            return
        if response.code != 200:
            payload = (response.payload or b"").decode("utf-8", "replace")
            self.upstream.count_error("login-refused")
            self.close(
                f"login as {self.upstream.settings.identity!r} refused: {response.code} {payload}"
            )
            return
        settings = self.upstream.settings
        for topic in self.upstream.topics():
            line = self._codec.send(
                ssmp.Subscribe(topic=topic.encode("ascii"), presence=settings.presence)
            )
            self._write(line)
            self._waiters.append(_Single(self._subscribed(topic)))
        self._ready = True
        self.upstream.connection_ready(self, f"logged in as {settings.identity}")

    def _subscribed(self, topic: str) -> _Callback:
        def check(response: ssmp.Response | None) -> None:
            # 409 means we already were: fine after a quick reconnect race.
            if response is not None and response.code not in (200, 409):
                payload = (response.payload or b"").decode("utf-8", "replace")
                self._log.warn(
                    "upstream {upstream}: SUBSCRIBE {topic} refused: {code} {payload}",
                    upstream=self.upstream.name,
                    topic=topic,
                    code=response.code,
                    payload=payload,
                )

        return check

    # --- requests -------------------------------------------------------------

    def send_batch(self, lines: list[bytes], answers: Answers, indices: list[int]) -> None:
        """Write a batch's encoded requests at once (pipelined); responses settle ``answers``.

        Args:
            lines: The requests, each LF-terminated.
            answers: The batch's outcomes.
            indices: For each request, its message's index in the batch.
        """
        self._waiters.append(_Batch(self.upstream.name, answers, indices))
        self._write(lines[0] if len(lines) == 1 else b"".join(lines), len(lines))

    # --- input ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Decode responses and events and act on each; route the read's events as one batch."""
        if self._closing:
            return
        self._last_heard = self.upstream.clock.seconds()
        self._awaiting_pong = False
        error: ssmp.SSMPError | None = None
        try:
            lines = self._codec.receive_data(data)
        except ssmp.SSMPError as exc:
            error = exc
            lines = cast(list[ssmp.Line], exc.events)
        self.upstream.count_in(len(lines), len(data))
        waiters = self._waiters
        for line in lines:
            if isinstance(line, ssmp.Response):
                if not waiters:
                    self.close(f"response {line.code} to no request")
                    break
                if waiters[0].take(line):
                    waiters.popleft()
            elif isinstance(line, ssmp.Event):
                self._on_event(line)
            if self._closing:
                break
        self._dispatch()
        if error is not None and not self._closing:
            self.upstream.count_error(error.kind)
            self.close(f"bad input from the server: {error.reason}")

    def _on_event(self, event: ssmp.Event) -> None:
        message = event.message
        now = self.upstream.clock.seconds
        if isinstance(message, ssmp.Mcast):
            routed = message_from_mcast(event.source, message.topic, message.payload, now())
            self._inbox.add(routed, routed)
        elif isinstance(message, ssmp.Ucast):
            routed = message_from_ucast(event.source, message.to, message.payload, now())
            self._inbox.add(routed, routed)
        elif isinstance(message, ssmp.Bcast):
            routed = message_from_bcast(event.source, message.payload, now())
            self._inbox.add(routed, routed)
        elif isinstance(message, ssmp.Ping):
            # Spec, "Server-initiated": clients MUST answer a PING event with PONG.
            self._write(_PONG)
        elif isinstance(message, ssmp.Compat):
            # Spec, "Forward compatibility": unknown event verb, close at once.
            self.upstream.count_error("unknown-event")
            self.close(f"event with unknown verb {message.verb.decode('ascii')}")
        # PONG (liveness already noted) and presence events carry nothing
        # routes take; they are counted as received and dropped.

    def _dispatch(self) -> None:
        """Hand the read's events to the router as one batch; pause past ``max_in_flight``."""
        count = len(self._inbox)
        if not count:
            return
        upstream = self.upstream
        upstream.in_flight += count
        self._inbox.dispatch()
        if upstream.in_flight >= upstream.settings.max_in_flight:
            self.pause_reading()

    def _routed(self, message: Message, result: Result) -> None:
        self.upstream.inbound_done(self, message, result)

    # --- flow control of inbound messages -------------------------------------

    def pause_reading(self) -> None:
        """Stop reading from the server (too many inbound messages in flight)."""
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resume_reading(self) -> None:
        """Read from the server again."""
        if self._paused and not self._closing and self.transport is not None:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    # --- liveness -------------------------------------------------------------

    def _arm_timer(self, delay: float) -> None:
        self._timer = self.upstream.clock.callLater(delay, self._idle_check)

    def _idle_check(self) -> None:
        settings = self.upstream.settings
        quiet = self.upstream.clock.seconds() - self._last_heard
        if self._awaiting_pong:
            if quiet >= settings.pong_timeout_seconds:
                self._timer = None
                self.upstream.count_error("pong-timeout")
                self.close(f"no PONG within {settings.pong_timeout_seconds:g} s")
                return
            self._awaiting_pong = False
        if quiet >= settings.ping_interval_seconds:
            # Spec, "Client-initiated": PING after a period with no server event.
            self._awaiting_pong = True
            self._write(_PING)
            self._arm_timer(settings.pong_timeout_seconds)
            return
        self._arm_timer(settings.ping_interval_seconds - quiet)


@implementer(IDestination)
class SSMPUpstream(Upstream[SSMPClientProtocol]):
    """An SSMP server the gateway connects to, as destination and source.

    Args:
        name: The upstream's config name.
        settings: Its validated settings.
        endpoint: Where to connect (from its endpoint string).
        router: Where received MCAST events go.
        secrets: For the ``secret`` login.
        clock: Timers, timestamps and reconnect delays.
        topics: Returns the topics to subscribe to at each login (settings
            plus exact topics of routes from this upstream, after a reload
            too).
        metrics: Counters, or None.
        lock: In a fleet, the lock under which it connects (`gateway.protocols.upstream`).
    """

    kind = "ssmp"

    def __init__(
        self,
        *,
        name: str,
        settings: SSMPUpstreamSettings,
        endpoint: IStreamClientEndpoint,
        router: Router,
        secrets: Secrets,
        clock: IReactorTime,
        topics: Callable[[], Iterable[str]] | None = None,
        metrics: GatewayMetrics | None = None,
        lock: IFleetLock | None = None,
    ) -> None:
        super().__init__(
            name=name,
            endpoint=endpoint,
            connection=SSMPClientProtocol,
            clock=clock,
            metrics=metrics,
            lock=lock,
        )
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self._topics = topics
        self.in_flight = 0
        """Inbound messages (of every connection) whose routes have not answered yet."""

    def topics(self) -> list[str]:
        """The topics to subscribe to now, each once, in a stable order.

        Exact route patterns that are no SSMP topic (the address forms
        ``!ucast.<peer>`` and ``!bcast``) are left out.
        """
        wanted = dict.fromkeys(self.settings.subscribe)
        if self._topics is not None:
            wanted.update(dict.fromkeys(self._topics()))
        return [topic for topic in wanted if topic.isascii() and ssmp.is_valid_id(topic.encode())]

    # --- connection state (called by the protocol) ----------------------------------------

    # --- IDestination -----------------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Send a batch as requests in one write; the server's responses are the outcomes.

        Each message becomes an MCAST to its address, a UCAST for
        ``!ucast.<peer>`` or a BCAST for ``!bcast`` (`request_line`). A
        ``200`` is accepted, any other response rejected with its code; a
        message SSMP cannot carry is rejected without being sent, and every
        message is retry later while the upstream is not logged in. When
        the router cancels the batch (its deadline), the outcomes known by
        then stand and the rest are `UNANSWERED`.
        """
        count = len(messages)
        connection = self._connection
        if connection is None:
            return all_same(count, Outcome.retry(f"upstream {self.name} is not connected"))
        answers = Answers(count)
        lines: list[bytes] = []
        indices: list[int] = []
        for index, message in enumerate(messages):
            line = request_line(message)
            if isinstance(line, Outcome):
                answers.settle(index, line)
            else:
                lines.append(line)
                indices.append(index)
        if lines:
            connection.send_batch(lines, answers, indices)
        return answers.deferred

    # --- inbound --------------------------------------------------------------

    def inbound_done(
        self, connection: SSMPClientProtocol, message: Message, result: Result
    ) -> None:
        """An inbound message's routes answered (or none took it)."""
        self.in_flight -= 1
        if self.in_flight < self.settings.max_in_flight // 2 + 1:
            connection.resume_reading()
            current = self._connection
            if current is not None and current is not connection:
                # The count includes a lost connection's messages: the one that
                # replaced it may have been paused by them, and must resume too.
                current.resume_reading()
        if isinstance(result, Unrouted):
            self.count_error("unrouted")
        elif not result.is_accepted:
            # SSMP events carry no acknowledgement back: the loss is logged and counted.
            self._log.warn(
                "upstream {upstream}: message on {topic} from {sender} not delivered: {reason}",
                upstream=self.name,
                topic=message.address,
                sender=message.sender,
                reason=result.reason,
            )

    # --- counters -------------------------------------------------------------

    def count_in(self, lines: int, size: int) -> None:
        """Count received lines and bytes."""
        self.traffic.messages_in += lines
        self.traffic.bytes_in += size
