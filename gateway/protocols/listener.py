"""What every listener shares: its factory's connections and counters, and each connection's life.

`ListenerFactory` is the factory side: connection counting,
``max_connections``, per-identity limits, authorization, error and traffic
counters. A protocol's server factory subclasses it, names its protocol (the
``protocol`` label of the connection metrics) and its connection class
(``protocol``, built with the factory). Past ``max_connections`` open
connections a new one is closed at once, before a byte is read or written
(counted as ``too-many-connections``): none of the protocols has an answer
for "busy" before its handshake.

`ListenerConnection` is the connection side (DESIGN.md, "One lifecycle per
role"): registration as the transport's streaming producer, the connection
counted open and closed, timers cancelled when it ends, output written in
one write with its traffic counted, a graceful close and an abort,
back-pressure, and the frame time-out. A protocol's connection class
subclasses it and keeps only what is its own.

A clean stop (the gateway is stopping): `ListenerFactory.stop_reading`
stops every connection's reading for good (what was read is still
answered), then `ListenerFactory.close_connections` closes them gracefully
and tells when all are gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, Final, Generic, NotRequired, TypedDict, TypeVar, cast

from OpenSSL import SSL
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import (
    IConsumer,
    IDelayedCall,
    IPushProducer,
    IReactorTime,
    ISSLTransport,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.auth import DEFAULT_LOGIN_FAILURES, LoginFailurePolicy, Secrets
from gateway.core.authorization import UNRESTRICTED, Action, Authorization, check
from gateway.core.flow import DEFAULT_FLOW, Congestion, FlowPolicy, Throttle
from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.logins import LoginRefusals
from gateway.protocols.sendnow import send_now, unsent
from gateway.protocols.tcp import RefusedConnection, disable_nagle
from gateway.tls import DEFAULT_CERT_IDENTITY, tls_failure_reason

__all__ = [
    "DEFAULT_FRAME_TIMEOUT_SECONDS",
    "DEFAULT_LISTEN_BACKLOG",
    "DEFAULT_MAX_CONNECTIONS",
    "PUSH_MAX_ANSWERS",
    "ListenerArgs",
    "ListenerConnection",
    "ListenerFactory",
]

DEFAULT_MAX_CONNECTIONS = 1024
"""Open connections per listener unless its config says otherwise."""
DEFAULT_LISTEN_BACKLOG = 1024
"""Connections the kernel queues for a listener before it accepts them (Twisted's
default, 50, drops SYNs when a thousand clients connect at once: a one-second wait)."""
DEFAULT_FRAME_TIMEOUT_SECONDS: Final = 30.0
"""How long a frame (a line, a block, an envelope) may take from its first byte to its
last, unless the listener's config says otherwise (issue 18: a half-sent frame after
the handshake was held open for ever)."""
_PRUNE_TIMERS_PAST: Final = 8
"""Timers a connection remembers before it forgets those that fired or were cancelled."""
STOP_QUIET_SECONDS: Final = 0.5
"""As the gateway stops, a half-closed connection whose peer sent nothing for this long is
closed: with nothing unread, closing it is no reset, and the answers still go out."""
PUSH_MAX_ANSWERS: Final = 32
"""A batch answered outside a read with at most this many answers goes to the socket at once
(`ListenerConnection.push_answers`). A larger one means a busy connection whose answers the
next poll writes soon anyway, together with others: pushed at once, they let the client send
sooner and a durable log commit smaller (a QMQP durable route at full speed lost 4% of its
rate)."""

P = TypeVar("P", bound=Protocol)
S = TypeVar("S")


class ListenerArgs(TypedDict, Generic[S]):
    """What every listener factory is built with; a protocol's factory adds its own."""

    name: str
    settings: S
    secrets: Secrets
    clock: IReactorTime
    metrics: NotRequired[GatewayMetrics | None]


class ListenerFactory(Factory[P], Generic[P, S]):
    """A listener's connections, settings, traffic and error counters.

    Args:
        name: The listener's config name (the metrics' ``listener`` label).
        settings: The protocol's validated settings for this listener.
        secrets: The gateway's secrets.
        clock: Timers and timestamps.
        metrics: Counters, or None in tests that do not look.

    Attributes:
        connections: The open connections.
        traffic: Messages and bytes in and out (plain ints).
    """

    kind: ClassVar[str]
    """The protocol, as the connection metrics label it."""
    noisy = False  # the service logs one "ready" line for every listener
    max_connections = DEFAULT_MAX_CONNECTIONS
    """Open connections at most; the assembly sets it from the listener's config."""
    authorization: Authorization = UNRESTRICTED
    """Who may publish and consume what; the assembly sets it from ``authorize``."""
    max_connections_per_identity = 0
    """Open connections one authenticated identity may hold (0: no limit)."""
    frame_timeout_seconds: float = DEFAULT_FRAME_TIMEOUT_SECONDS
    """How long a frame may stay incomplete (0: for ever); the assembly sets it."""
    flow: FlowPolicy = DEFAULT_FLOW
    """What a consumer that reads more slowly than its producers write costs them, and when
    it is cut (`gateway.core.flow`); the assembly sets it."""
    login_failures: LoginFailurePolicy = DEFAULT_LOGIN_FAILURES
    """How refused logins are slowed down and cut off (`gateway.core.auth`); set by the assembly."""
    cert_identity: tuple[str, ...] = DEFAULT_CERT_IDENTITY
    """Which names of a verified client certificate are identities (`gateway.tls.peer_identities`);
    the assembly sets it from ``cert_identity``."""

    def __init__(
        self,
        *,
        name: str,
        settings: S,
        secrets: Secrets,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.secrets = secrets
        self.clock = clock
        self.connections: set[P] = set()
        self._by_identity: dict[str, int] = {}
        self._identity_of: dict[P, str] = {}
        self._metrics = metrics
        self.traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        if metrics is not None:
            self._m_open = metrics.connections.labels(name, self.kind)
            self._m_opened = metrics.connections_total.labels(name, self.kind)

    # Twisted types it P | None, but its TLS wrapper cannot take None (RefusedConnection says why).
    def buildProtocol(self, addr: Any) -> P | RefusedConnection:  # type: ignore[override]
        """A new connection, or past ``max_connections`` one closed at once (on TLS too)."""
        if len(self.connections) >= self.max_connections:
            self.count_error("too-many-connections")
            return RefusedConnection()
        connection_class: Any = self.protocol  # takes the factory, unlike Protocol()
        built: P = connection_class(self)
        return built

    @functools.cached_property
    def logins(self) -> LoginRefusals:
        """Its refused logins: waits, counter and log (made from ``login_failures`` when used)."""
        return LoginRefusals(self.name, self.login_failures, self.clock, self._metrics)

    def connection_opened(self, connection: P) -> None:
        """Count a new connection."""
        self.connections.add(connection)
        if self._metrics is not None:
            self._m_open.inc()
            self._m_opened.inc()

    def admit(self, connection: P, identity: str | None) -> bool:
        """Count a connection under the identity it authenticated as, within the limit.

        Returns:
            False when the identity already holds ``max_connections_per_identity``
            connections here (counted as ``too-many-connections-per-identity``);
            the caller refuses the login the way its protocol prescribes.
            True for connections without an identity: only authenticated
            names are limited.
        """
        if identity is None or connection in self._identity_of:
            return True
        held = self._by_identity.get(identity, 0)
        limit = self.max_connections_per_identity
        if limit and held >= limit:
            self.count_error("too-many-connections-per-identity")
            return False
        self._by_identity[identity] = held + 1
        self._identity_of[connection] = identity
        return True

    def per_identity_refusal(self, identity: str) -> str:
        """Why `admit` said no, for logs and for the protocols that can say why."""
        return (
            f"{identity} already has {self.max_connections_per_identity} connection(s) to"
            f" {self.name} (max_connections_per_identity)"
        )

    def connection_closed(self, connection: P) -> None:
        """Count a closed connection."""
        self.connections.discard(connection)
        self.release(connection)
        if self._metrics is not None:
            self._m_open.dec()
        if self._when_closed is not None and not self.connections:
            self._all_closed()

    def release(self, connection: P) -> None:
        """No longer count a connection under its identity (closed, or being replaced)."""
        identity = self._identity_of.pop(connection, None)
        if identity is not None:
            left = self._by_identity[identity] - 1
            if left:
                self._by_identity[identity] = left
            else:
                del self._by_identity[identity]

    def authorized(
        self, action: Action, identity: str | None, address: str, peer: object = None
    ) -> bool:
        """Whether ``identity`` may publish to or consume from ``address`` here.

        A refusal is counted (protocol error kind ``forbidden-publish`` or
        ``forbidden-consume``) and logged; the caller answers the peer the
        way its protocol prescribes.
        """
        return check(
            self.authorization,
            action,
            identity,
            address,
            listener=self.name,
            count_error=self.count_error,
            peer=peer,
        )

    def count_error(self, kind: str) -> None:
        """Count a protocol error of some kind."""
        if self._metrics is not None:
            self._metrics.protocol_errors.labels(self.name, kind).inc()

    def count_slow_consumer(self) -> None:
        """Count a connection aborted as a slow consumer (stuck, or past the hard byte cap)."""
        if self._metrics is not None:
            self._metrics.slow_consumers.labels(self.name).inc()

    # --- a clean stop (the gateway is stopping) --------------------------------------------

    _when_closed: list[Deferred[None]] | None = None
    """Who waits for every connection to be gone (`close_connections`)."""

    def stop_reading(self) -> None:
        """Read nothing more from any connection, for good; they still answer what they read."""
        for connection in list(self.connections):
            cast(ListenerConnection[Any], connection).stop_reading()

    def close_connections(self) -> Deferred[None]:
        """Close every connection gracefully (its queued output first); fire once all are gone."""
        for connection in list(self.connections):
            cast(ListenerConnection[Any], connection).close_for_stop()
        if not self.connections:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        if self._when_closed is None:
            self._when_closed = []
        self._when_closed.append(waiter)
        return waiter

    def _all_closed(self) -> None:
        waiters, self._when_closed = self._when_closed or [], None
        for waiter in waiters:
            if not waiter.called:  # not cancelled
                waiter.callback(None)


F = TypeVar("F", bound="ListenerFactory[Any, Any]")


@implementer(IPushProducer)
class ListenerConnection(Protocol, Generic[F]):
    """One connection to a listener: the life, output, back-pressure and time-outs all share.

    Life: `connectionMade` turns Nagle's algorithm off, registers the
    connection as its transport's streaming producer, counts it open and
    calls `_connection_started`; `connectionLost` marks it closing, cancels
    every timer started with `_call_later`, drops unwritten output, calls
    `_connection_ended` and counts it closed. `_close` writes what is queued
    and closes once the transport has written it; `_abort` closes at once,
    dropping what is unwritten, for a peer given up on (one that does not
    read must not keep its buffered output).

    Output: bytes queued in ``_out`` (``_out_count`` messages) go out in
    one write at `flush`, counted in the listener's traffic; `_write`
    queues and flushes at once.

    Back-pressure (`gateway.core.flow`, the factory's ``flow``): when the
    transport's buffer fills (the peer reads slower than we write) it calls
    `pauseProducing`: the connection is congested and reading it stops.
    As a consumer, it then holds the producers whose messages wait on it
    (its ``congestion``: the hub holds a publisher's ``throttle``, a
    route's answer waits) until the transport calls `resumeProducing`
    (emptied), which releases them. What is still written to it meanwhile
    is counted as backlog (Twisted calls `pauseProducing` on every write
    while its buffer is full: the backlog counts from the first). A
    consumer that stays congested for ``slow_consumer_seconds``, or whose
    backlog passes ``max_backlog_bytes``, is stuck: aborted as a slow
    consumer, counted and logged, which releases its producers. Under the
    ``disconnect`` policy nobody is held: only the cap and the time apply.
    As a producer, a connection held by any consumer reads nothing.
    Reading resumes when the peer caught up, no consumer holds it, the
    connection is not finishing or closing, and `_may_read` says the
    protocol's own limits allow it.

    Frame time-out: after a read the protocol calls `_frame_read`; a
    frame its codec holds part of (`_partial_frame_bytes`) must be complete
    within the factory's ``frame_timeout_seconds`` of the read that began
    it, else the peer is aborted (it sent nothing complete: nothing is owed
    to it), counted as ``frame-timeout`` and logged. Time during which we do
    not read the peer does not count.

    Args:
        factory: The listener's factory.
    """

    _log = Logger()
    factory: F

    def __init__(self, factory: F) -> None:
        self.factory = factory
        self._closing = False
        """Closing or closed: nothing more is read, written or answered."""
        self._finishing = False
        """Reading nothing more; the protocol closes once it has answered what it read."""
        self._aborted = False
        self._reading_paused = False
        self._congested = False
        self._congested_since = 0.0
        self._stuck_call: IDelayedCall | None = None
        self._backlog = 0
        self.congestion = Congestion()
        """As a consumer: the producers it holds and the answers waiting for it to drain."""
        self.throttle = Throttle(self._pause_reading, self._resume_reading)
        """As a producer: the consumers holding it (it reads nothing while any does)."""
        self._out: list[bytes] = []
        self._out_count = 0
        self._timers: list[IDelayedCall] = []
        self._partial_since: float | None = None
        self._frame_call: IDelayedCall | None = None

    # --- hooks ----------------------------------------------------------------------------

    def _connection_started(self) -> None:
        """The protocol's own start (its first timers); nothing by default."""

    def _connection_ended(self, reason: Failure) -> None:
        """The protocol's own cleanup once the connection is gone; nothing by default."""

    def _may_read(self) -> bool:
        """Whether the protocol's own limits let reading resume; yes by default."""
        return True

    def _partial_frame_bytes(self) -> int:
        """Bytes the protocol's codec holds of an incomplete frame; none by default."""
        return 0

    def _who(self) -> str:
        """The peer, for the log: its address unless the protocol knows a name."""
        peer = self._peer()
        return f"{getattr(peer, 'host', peer)}:{getattr(peer, 'port', '')}"

    # --- life -----------------------------------------------------------------------------

    def connectionMade(self) -> None:
        """Register as the transport's producer (a slow reader stops our reading); count it."""
        disable_nagle(self.transport)
        cast(IConsumer, self.transport).registerProducer(self, True)
        self.factory.connection_opened(self)
        self._connection_started()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Stop every timer, drop what was not written, clean up, count it closed."""
        self._closing = True
        for call in self._timers:
            if call.active():
                call.cancel()
        self._timers.clear()
        self._frame_call = self._stuck_call = None
        self._out.clear()
        self.congestion.gone()  # its producers read again, its waiting answers are given
        self.throttle.forget()
        if reason.check(SSL.Error):
            self._tls_failed(reason)
        self._connection_ended(reason)
        self.factory.connection_closed(self)

    def _tls_failed(self, reason: Failure) -> None:
        """Say why TLS with the peer failed, and what usually fixes it; counted."""
        self.factory.count_error("tls-failed")
        self._log.warn(
            "{listener}: TLS with {peer} failed: {reason}. If the peer was refused, it must"
            " present a certificate issued by a CA of this listener's caCerts; if the peer"
            " refused us, it must trust the CA of this listener's certKey (and use its name)",
            listener=self.factory.name,
            peer=self._who(),
            reason=tls_failure_reason(reason.value) if reason.value is not None else "unknown",
        )

    def _call_later(self, seconds: float, call: Callable[..., object], *args: Any) -> IDelayedCall:
        """Call ``call(*args)`` in ``seconds`` on the factory's clock unless the connection ends."""
        timers = self._timers
        if len(timers) >= _PRUNE_TIMERS_PAST:
            timers[:] = [timer for timer in timers if timer.active()]
        delayed: IDelayedCall = self.factory.clock.callLater(seconds, call, *args)
        timers.append(delayed)
        return delayed

    def _close(self) -> None:
        """Write what is queued, then close once the transport has written it."""
        if self._closing:
            return
        self._closing = True
        self.flush()
        transport = self.transport
        assert transport is not None
        # A TLS transport waits for its producer to go away before it shuts down.
        cast(IConsumer, transport).unregisterProducer()
        transport.loseConnection()

    def _abort(self) -> None:
        """Close at once, dropping what is queued and what the transport holds."""
        if self._aborted or self.transport is None:
            return
        self._closing = self._aborted = True
        self._out.clear()
        self.congestion.gone()  # given up on: its producers need not wait for connectionLost
        cast(ITCPTransport, self.transport).abortConnection()

    def _peer(self) -> object:
        """The peer's address, or None before the connection is made."""
        return self.transport.getPeer() if self.transport is not None else None

    # --- output ---------------------------------------------------------------------------

    def flush(self, *, at_once: bool = False) -> None:
        """Write everything queued in ``_out`` in one write, counted; a slow consumer is aborted.

        The transport sends it when the reactor next polls, with whatever else
        this turn writes to it. With ``at_once`` (`flush_now`), on plain TCP
        it goes to the socket now when the transport holds nothing
        (`gateway.protocols.sendnow`).
        """
        out = self._out
        if not out or self.transport is None:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        traffic = self.factory.traffic
        traffic.messages_out += self._out_count
        traffic.bytes_out += len(data)
        self._out_count = 0
        if self._congested:
            self._backlog += len(data)
            limit = self.factory.flow.max_backlog_bytes
            if limit and self._backlog > limit:
                self._slow_consumer(
                    f"{self._backlog} bytes written to it since its transport's buffer filled,"
                    f" and not emptied since (max_backlog_bytes {limit})"
                )
                return
        if at_once:
            send_now(self.transport, data)
        else:
            self.transport.write(data)

    def push_answers(self, count: int) -> None:
        """Write ``count`` answers made outside a read: a few at once (`flush_now`), more later.

        A route answers outside a read when its destination confirms (a
        durable route's commit, a broker's confirm), in a call that goes on
        to other work; its senders need not wait for the reactor's next
        poll. Past `PUSH_MAX_ANSWERS` the connection is busy: the answers go
        when the reactor next polls, which is soon anyway.
        """
        if count <= PUSH_MAX_ANSWERS:
            self.flush_now()
        else:
            self.flush()

    def flush_now(self) -> None:
        """`flush`, then have the socket take what the transport holds now, not a turn later.

        A transport writes what it is given when the reactor next polls: after
        whatever else this turn does. An answer made outside a read (a durable
        route's commit, acknowledged in a timed call that goes on to deliver
        what it stored) need not wait for that: at 10,000 QMQP messages a
        second it took 0.17 ms off the median reply (docs/performance.rst).
        On plain TCP the socket takes it at once, past the transport's buffer
        (`gateway.protocols.sendnow`); what a transport still holds (TLS: the
        TCP connection under it holds the encrypted bytes) is handed to the
        socket now, on a TCP connection that is neither closing nor holding
        its producer back; otherwise the reactor writes, as usual.
        """
        if not self._out:
            return
        self.flush(at_once=True)
        transport: Any = self.transport
        if transport is not None and not hasattr(transport, "doWrite"):
            transport = getattr(transport, "transport", None)  # TLS: the TCP connection under it
        if (
            transport is None
            or not hasattr(transport, "doWrite")
            or not unsent(transport)
            or not transport.connected
            or transport.disconnecting
            or getattr(transport, "producerPaused", False)
        ):
            return
        # A failed send stays with the transport: the reactor's next write reports it.
        transport.doWrite()

    def _write(self, data: bytes, messages: int = 0) -> None:
        """Write ``data`` (``messages`` messages) now, after anything queued, in one write."""
        self._out.append(data)
        self._out_count += messages
        self.flush()

    def _slow_consumer(self, why: str) -> None:
        """Abort a consumer given up on (stuck, or past the cap), counted and logged."""
        self._log.warn(
            "{listener}: disconnecting {identity}, a slow consumer: {why}",
            listener=self.factory.name,
            identity=self._who(),
            why=why,
        )
        self.factory.count_slow_consumer()
        self._abort()

    # --- IPushProducer: the transport tells us when the peer is slow ----------------------

    def pauseProducing(self) -> None:
        """The peer does not keep up: stop reading it, hold its producers, count the backlog."""
        if not self._congested:
            self._congested = True
            self._backlog = 0
            flow = self.factory.flow
            if flow.pauses_producers:
                self.congestion.begin()
            if flow.slow_consumer_seconds > 0:
                self._congested_since = self.factory.clock.seconds()
                if self._stuck_call is None and not self._closing:
                    self._stuck_call = self._call_later(
                        flow.slow_consumer_seconds, self._stuck_check
                    )
        self._pause_reading()

    def resumeProducing(self) -> None:
        """The peer caught up: no backlog; release its producers; read it again if we may."""
        self._congested = False
        self._backlog = 0
        self.congestion.drained()
        self._resume_reading()

    def stopProducing(self) -> None:
        """The transport is going away; `connectionLost` (called next) cleans up."""

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def _resume_reading(self) -> None:
        if (
            self._reading_paused
            and not self._congested
            and not self._closing
            and not self._finishing
            and not self._stopping
            and not self.throttle.held
            and self.transport is not None
            and self._may_read()
        ):
            self._reading_paused = False
            if self._partial_since is not None:
                self._partial_since = self.factory.clock.seconds()  # our pause is not its delay
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _stuck_check(self) -> None:
        """Cut a consumer congested without a drain for ``slow_consumer_seconds``.

        One timer per connection, re-armed for the time left: a consumer
        that drains and fills again many times a second costs no timer churn.
        """
        self._stuck_call = None
        if not self._congested or self._closing:
            return
        seconds = self.factory.flow.slow_consumer_seconds
        left = self._congested_since + seconds - self.factory.clock.seconds()
        if left > 0:
            self._stuck_call = self._call_later(left, self._stuck_check)
            return
        self._slow_consumer(
            f"its transport's buffer has not emptied for {seconds:g} s"
            f" (slow_consumer_seconds; {self.congestion.held_count} producer(s) held)"
        )

    # --- a clean stop (the gateway is stopping) --------------------------------------------

    _stopping = False
    """Reading stopped for good: the gateway is stopping (`stop_reading`)."""

    def stop_reading(self) -> None:
        """Read nothing more, for good: nothing resumes it. What was read is still answered."""
        self._stopping = True
        self._pause_reading()

    def close_for_stop(self) -> None:
        """Close as the gateway stops, so that every answer written reaches the peer.

        A socket closed with input unread is reset (RFC 1122, 4.2.2.13),
        and the reset drops what the kernel had not sent yet: answers, when
        the peer was still streaming. So the connection says it is done
        after its last answer (a FIN; with TLS, close_notify) and reads on,
        dropping what it reads, until the peer closes its side or has sent
        nothing for `STOP_QUIET_SECONDS`; then it closes.
        """
        transport = self.transport
        if self._closing or transport is None:
            return
        self._closing = True
        self.flush()
        # A TLS transport waits for its producer to go away before it shuts down.
        cast(IConsumer, transport).unregisterProducer()
        tls = ISSLTransport.providedBy(transport)
        if ITCPTransport.providedBy(transport) and not tls:
            transport.loseWriteConnection()
        else:  # TLS: close_notify, and closed once the peer's arrives
            transport.loseConnection()
        if tls or not getattr(transport, "disconnecting", True):  # it can still be read
            self.dataReceived = self._drop_input  # type: ignore[method-assign]
            self._heard_at = self.factory.clock.seconds()
            self._call_later(STOP_QUIET_SECONDS, self._quiet_check)
            self._reading_paused = False
            transport.resumeProducing()  # type: ignore[attr-defined]

    _heard_at = 0.0
    """When a closing connection last read input (`close_for_stop`)."""

    def _drop_input(self, data: bytes) -> None:
        """Read a closing connection's input and drop it: it is answered nothing."""
        self._heard_at = self.factory.clock.seconds()

    def _quiet_check(self) -> None:
        """Close a half-closed connection once its peer has been quiet for a while."""
        left = self._heard_at + STOP_QUIET_SECONDS - self.factory.clock.seconds()
        if left > 0:
            self._call_later(left, self._quiet_check)
            return
        transport = self.transport
        if transport is None:
            return
        if ISSLTransport.providedBy(transport):
            cast(ITCPTransport, transport).abortConnection()  # no close_notify came back
        else:
            transport.loseConnection()

    # --- frame time-out -------------------------------------------------------------------

    def _frame_read(self, completed: bool, held: int) -> None:
        """Note the end of a read: time the frame it leaves incomplete, if any.

        A protocol calls it after a read that leaves part of a frame held, or
        when an earlier one did (``_partial_since`` is set): a read that ends
        between frames, after one that did too, needs no call.

        Args:
            completed: Whether the read completed a frame (a frame left
                incomplete then began in this read).
            held: The bytes of an incomplete frame its codec holds now.
        """
        if not held:
            self._partial_since = None
            return
        if completed or self._partial_since is None:
            self._partial_since = self.factory.clock.seconds()
            timeout = self.factory.frame_timeout_seconds
            if self._frame_call is None and timeout > 0 and not self._closing:
                self._frame_call = self._call_later(timeout, self._frame_check)

    def _frame_check(self) -> None:
        self._frame_call = None
        since = self._partial_since
        if since is None or self._closing:
            return
        timeout = self.factory.frame_timeout_seconds
        left = since + timeout - self.factory.clock.seconds()
        if left > 0 or self._reading_paused:
            self._frame_call = self._call_later(left if left > 0 else timeout, self._frame_check)
            return
        self.factory.count_error("frame-timeout")
        self._log.info(
            "{listener}: aborting {peer}: a frame is incomplete after {seconds:g} s"
            " ({held} bytes of it held)",
            listener=self.factory.name,
            peer=self._who(),
            seconds=timeout,
            held=self._partial_frame_bytes(),
        )
        self._abort()
