"""The SSMP client role: the gateway as a peer of another SSMP server.

`SSMPUpstream` keeps one connection to the server through Twisted's
`ClientService` (reconnects with backoff), logs in (``secret`` from the
secrets file, ``cert`` through the endpoint's client certificate, or
``open``), subscribes to its topics, answers PING and pings an idle server.
It is the upstream's `IDestination` (routes deliver to it as MCAST requests,
whose responses become outcomes) and a route source (MCAST events it
receives are dispatched along the routes from it).

Responses carry no request id; SSMP answers requests in order, so responses
are matched first in, first out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final, cast

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import ssmp
from gateway.core.auth import Secrets
from gateway.core.batch import deliver_each
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import Router, Unrouted
from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.ssmp.mapping import mcast_request, message_from_mcast
from gateway.protocols.ssmp.settings import SSMPUpstreamSettings
from gateway.protocols.tcp import UpstreamFactory, disable_nagle

__all__ = ["SSMPClientProtocol", "SSMPUpstream"]

RECONNECT_INITIAL_DELAY_SECONDS: Final = 0.5
RECONNECT_MAX_DELAY_SECONDS: Final = 30.0

_PING: Final = b"PING\n"
_PONG: Final = b"PONG\n"

_Waiter = Callable[[ssmp.Response | None], None]
"""Called with the matching response, or None if the connection was lost first."""


class SSMPClientProtocol(Protocol):
    """One connection from the gateway to an SSMP server."""

    _log = Logger()

    def __init__(self, upstream: SSMPUpstream) -> None:
        self.upstream = upstream
        settings = upstream.settings
        self._codec = ssmp.SSMPCodec(ssmp.Role.CLIENT, max_line_bytes=settings.max_line_bytes)
        self._waiters: deque[_Waiter] = deque()
        self._ready = False
        self._closing = False
        self._paused = False
        self._last_heard = 0.0
        self._awaiting_pong = False
        self._timer: IDelayedCall | None = None

    # --- connection life ------------------------------------------------------

    def connectionMade(self) -> None:
        """Log in."""
        disable_nagle(self.transport)
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
        self._waiters.append(self._logged_in)
        self._last_heard = upstream.clock.seconds()
        self._arm_timer(settings.ping_interval_seconds)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Tell everyone waiting for a response that none will come."""
        self._closing = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            waiter(None)
        self.upstream.connection_lost(self, reason)

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)
        self.upstream.count_out(data)

    def _close(self, why: str) -> None:
        if self._closing:
            return
        self._closing = True
        self._log.warn("upstream {upstream}: closing: {why}", upstream=self.upstream.name, why=why)
        assert self.transport is not None
        self.transport.loseConnection()

    # --- login and subscriptions ----------------------------------------------

    def _logged_in(self, response: ssmp.Response | None) -> None:
        if response is None:
            return
        if response.code != 200:
            payload = (response.payload or b"").decode("utf-8", "replace")
            self.upstream.count_error("login-refused")
            self._close(
                f"login as {self.upstream.settings.identity!r} refused: {response.code} {payload}"
            )
            return
        settings = self.upstream.settings
        for topic in self.upstream.topics():
            line = self._codec.send(
                ssmp.Subscribe(topic=topic.encode("ascii"), presence=settings.presence)
            )
            self._write(line)
            self._waiters.append(self._subscribed(topic))
        self._ready = True
        self.upstream.connection_ready(self)

    def _subscribed(self, topic: str) -> _Waiter:
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

    def request(self, line: bytes) -> Deferred[Outcome]:
        """Send an encoded request; the Deferred fires with the mapped response."""
        result: Deferred[Outcome] = Deferred()

        def answered(response: ssmp.Response | None) -> None:
            if result.called:  # the router gave up waiting (time-out)
                return
            if response is None:
                result.callback(
                    Outcome.retry(f"connection to {self.upstream.name} lost before it answered")
                )
            elif response.code == 200:
                result.callback(Outcome.accepted())
            else:
                text = (response.payload or b"").decode("utf-8", "replace")
                result.callback(
                    Outcome.rejected(
                        f"{self.upstream.name} answered {response.code} {text}".rstrip(),
                        code=str(response.code),
                    )
                )

        self._waiters.append(answered)
        self._write(line)
        return result

    # --- input ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Decode responses and events and act on each."""
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
        for line in lines:
            if isinstance(line, ssmp.Response):
                if not self._waiters:
                    self._close(f"response {line.code} to no request")
                    return
                self._waiters.popleft()(line)
            elif isinstance(line, ssmp.Event):
                self._on_event(line)
            if self._closing:
                return
        if error is not None:
            self.upstream.count_error(error.kind)
            self._close(f"bad input from the server: {error.reason}")

    def _on_event(self, event: ssmp.Event) -> None:
        message = event.message
        if isinstance(message, ssmp.Mcast):
            self.upstream.inbound(self, event.source, message.topic, message.payload)
        elif isinstance(message, ssmp.Ping):
            # Spec, "Server-initiated": clients MUST answer a PING event with PONG.
            self._write(_PONG)
        elif isinstance(message, ssmp.Compat):
            # Spec, "Forward compatibility": unknown event verb, close at once.
            self.upstream.count_error("unknown-event")
            self._close(f"event with unknown verb {message.verb.decode('ascii')}")
        # PONG (liveness already noted), presence, UCAST and BCAST events
        # carry nothing routes take; they are counted as received and dropped.

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
                self._close(f"no PONG within {settings.pong_timeout_seconds:g} s")
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
class SSMPUpstream:
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
    """

    _log = Logger()

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
    ) -> None:
        self.name = name
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self.clock = clock
        self._topics = topics
        self._metrics = metrics
        self._traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        self._connection: SSMPClientProtocol | None = None
        self._in_flight = 0
        self.service = ClientService(
            endpoint,
            UpstreamFactory(SSMPClientProtocol, self),
            retryPolicy=backoffPolicy(
                initialDelay=RECONNECT_INITIAL_DELAY_SECONDS,
                maxDelay=RECONNECT_MAX_DELAY_SECONDS,
            ),
            clock=clock,
        )
        if metrics is not None:
            self._m_up = metrics.upstream_up.labels(name)
            self._m_up.set(0)

    @property
    def connected(self) -> bool:
        """Whether the upstream is connected and logged in."""
        return self._connection is not None

    def topics(self) -> list[str]:
        """The topics to subscribe to now, each once, in a stable order."""
        wanted = dict.fromkeys(self.settings.subscribe)
        if self._topics is not None:
            wanted.update(dict.fromkeys(self._topics()))
        return list(wanted)

    # --- connection state (called by the protocol) ----------------------------------------

    def connection_ready(self, connection: SSMPClientProtocol) -> None:
        """The connection is logged in and subscribed."""
        self._connection = connection
        self._log.info(
            "upstream {upstream}: logged in as {identity}",
            upstream=self.name,
            identity=self.settings.identity,
        )
        if self._metrics is not None:
            self._m_up.set(1)
            self._metrics.connections.labels(self.name, "ssmp").inc()
            self._metrics.connections_total.labels(self.name, "ssmp").inc()

    def connection_lost(self, connection: SSMPClientProtocol, reason: Failure) -> None:
        """The connection ended; ClientService reconnects."""
        if self._connection is connection:
            self._connection = None
            self._log.info(
                "upstream {upstream}: connection lost: {reason}",
                upstream=self.name,
                reason=reason.getErrorMessage(),
            )
            if self._metrics is not None:
                self._m_up.set(0)
                self._metrics.connections.labels(self.name, "ssmp").dec()

    # --- IDestination -----------------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch, one message at a time (pipelined)."""
        return deliver_each(self.deliver_one, messages)

    def deliver_one(self, message: Message) -> Deferred[Outcome]:
        """Send the message as an MCAST; the server's response is the outcome."""
        line = mcast_request(message)
        if isinstance(line, Outcome):
            return succeed(line)
        connection = self._connection
        if connection is None:
            return succeed(Outcome.retry(f"upstream {self.name} is not connected"))
        return connection.request(line)

    # --- inbound --------------------------------------------------------------

    def inbound(
        self, connection: SSMPClientProtocol, source: bytes, topic: bytes, payload: bytes
    ) -> None:
        """Dispatch an MCAST event from the server along the routes from here."""
        message = message_from_mcast(source, topic, payload, self.clock.seconds())
        outcome = self.router.dispatch_one(self.name, message)
        if isinstance(outcome, Unrouted):
            self.count_error("unrouted")
            return
        self._in_flight += 1
        if self._in_flight >= self.settings.max_in_flight:
            connection.pause_reading()
        outcome.addBoth(self._inbound_done, connection, message)

    def _inbound_done(
        self, outcome: Outcome | Failure, connection: SSMPClientProtocol, message: Message
    ) -> None:
        self._in_flight -= 1
        if self._in_flight < self.settings.max_in_flight // 2 + 1:
            connection.resume_reading()
            current = self._connection
            if current is not None and current is not connection:
                # The count includes a lost connection's messages: the one that
                # replaced it may have been paused by them, and must resume too.
                current.resume_reading()
        if isinstance(outcome, Failure):
            self._log.failure("upstream {upstream}: routing failed", outcome, upstream=self.name)
        elif not outcome.is_accepted:
            # SSMP events carry no acknowledgement back: the loss is logged and counted.
            self._log.warn(
                "upstream {upstream}: message on {topic} from {sender} not delivered: {reason}",
                upstream=self.name,
                topic=message.address,
                sender=message.sender,
                reason=outcome.reason,
            )

    # --- counters -------------------------------------------------------------

    def count_in(self, lines: int, size: int) -> None:
        """Count received lines and bytes."""
        self._traffic.messages_in += lines
        self._traffic.bytes_in += size

    def count_out(self, data: bytes) -> None:
        """Count a sent line."""
        self._traffic.messages_out += 1
        self._traffic.bytes_out += len(data)

    def count_error(self, kind: str) -> None:
        """Count a protocol error or dropped event."""
        if self._metrics is not None:
            self._metrics.protocol_errors.labels(self.name, kind).inc()
