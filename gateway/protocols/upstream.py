"""What every TCP upstream shares: connecting, reconnecting, its state and its counters.

DESIGN.md, "One lifecycle per role": an upstream (the gateway as the client
of a server) subclasses `Upstream`, which owns the Twisted `ClientService`
that connects and reconnects with back-off, the live connection once it is
ready, the ``upstream_up`` and connection gauges, the log lines of its
coming and going, and its traffic and error counters. Its connections
subclass `UpstreamConnection`: Nagle off, a push producer on the transport,
one close that says why, and the upstream told when the connection ends.
A protocol's own upstream then holds only its handshake, its requests and
their outcomes.

The back-off counts the attempts since the last connection that became
ready, so that a server which accepts the TCP connection but refuses the
login is tried less and less often too (`ClientService` alone counts from
the last TCP connection). The service connects through a `MovableEndpoint`:
an upstream that must reconnect elsewhere (the stream upstream, to the
leader its Metadata names) calls `Upstream.move_to`, and an attempt that
fails there goes back to the configured endpoint. Stopping is `stop`, which
a subclass extends to finish its work on the open connection first; it
closes the connection through `UpstreamConnection.close` (which unregisters
the producer: a TLS connection shuts down only without one).

TLS: a connection is made (and `UpstreamConnection.connection_started`
called) as soon as TCP is up; `UpstreamConnection.tls_established` says when
the handshake is over and the server verified. A handshake that fails, on
either side, ends the connection with OpenSSL's (or service_identity's)
reason: it is logged as a warning naming the upstream, its address and that
reason, counted as ``tls-failed``, and the back-off keeps growing, also when
the server refuses our certificate only after the handshake (TLS 1.3).
ClientService's own "Scheduling retry" lines name the upstream and its
address (`MovableEndpoint`), and the wait, rounded to a tenth of a second.

In a fleet, an upstream whose connection must be one per fleet (a DMP feed
has one reader; an SSMP server keeps one connection per identity) is given
a ``lock`` (`gateway.fleet.locks`): it connects only while this node holds
it, closes its connection the moment the lock is lost (nothing read after
that is handled), and releases the lock once stopped. On the other nodes
it is on `standby`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final, Generic, TypeVar, cast

from OpenSSL import SSL
from service_identity import VerificationError
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IAddress,
    IConsumer,
    IHandshakeListener,
    IProtocol,
    IProtocolFactory,
    IPushProducer,
    IReactorTime,
    ISSLTransport,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import alsoProvides, implementer

from gateway.core.interfaces import IFleetLock
from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.tcp import UpstreamFactory, disable_nagle
from gateway.tls import tls_failure_reason

__all__ = [
    "RECONNECT_INITIAL_DELAY_SECONDS",
    "RECONNECT_MAX_DELAY_SECONDS",
    "RETRY_RESOLUTION_SECONDS",
    "MovableEndpoint",
    "Upstream",
    "UpstreamConnection",
    "UpstreamService",
    "describe_endpoint",
]

RECONNECT_INITIAL_DELAY_SECONDS: Final = 0.5
"""First wait before connecting again after a connection failed or ended."""
RECONNECT_MAX_DELAY_SECONDS: Final = 30.0
"""Longest wait between attempts (the wait grows by half each time up to it)."""
RETRY_RESOLUTION_SECONDS: Final = 0.1
"""Waits are rounded to this, and are never shorter."""

_BACKOFF: Final = backoffPolicy(
    initialDelay=RECONNECT_INITIAL_DELAY_SECONDS, maxDelay=RECONNECT_MAX_DELAY_SECONDS
)


def _backoff(failures: int) -> float:
    """The default wait: `RECONNECT_INITIAL_DELAY_SECONDS` after one failure, then growing.

    `backoffPolicy` adds up to a second of jitter, so that gateways that
    lost the same server do not all come back at once; it counts from 0.
    """
    return _BACKOFF(failures - 1)


C = TypeVar("C", bound="UpstreamConnection[Any]")
U = TypeVar("U", bound="Upstream[Any]")


def describe_endpoint(endpoint: object) -> str:
    """Where a client endpoint connects, for the log: ``host:port``, with ``(TLS)`` if it is.

    Twisted's client endpoints keep their host and port in private
    attributes and have no readable repr (a ``tls:`` one is a
    ``_WrapperEndpoint object at 0x...``); an endpoint this does not know is
    named by its repr.
    """
    if isinstance(endpoint, MovableEndpoint):
        return describe_endpoint(endpoint.target)
    wrapped = getattr(endpoint, "_wrappedEndpoint", None)  # tls: (wrapClientTLS)
    if wrapped is not None:
        return f"{describe_endpoint(wrapped)} (TLS)"
    host = getattr(endpoint, "_hostText", None) or getattr(endpoint, "_host", None)
    port = getattr(endpoint, "_port", None)
    if isinstance(host, str) and isinstance(port, int):
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # ssl: (SSL4ClientEndpoint) has a context factory: TLS, unverified.
        return f"{address} (TLS)" if hasattr(endpoint, "_sslContextFactory") else address
    return repr(endpoint)


@implementer(IStreamClientEndpoint)
class MovableEndpoint:
    """Where an upstream's service connects: its configured endpoint, or one it moved to.

    Args:
        home: The configured endpoint.
        failed: Told of each attempt that failed (after the move back home).
        name: The upstream's name, for the log lines that name the endpoint.
    """

    def __init__(
        self, home: IStreamClientEndpoint, failed: Callable[[Failure], None], name: str
    ) -> None:
        self.home = home
        self.target = home
        """Where the next attempt goes."""
        self._failed = failed
        self.name = name

    def __repr__(self) -> str:
        """The upstream and where its next attempt goes (ClientService's log lines say this)."""
        return f"upstream {self.name} at {describe_endpoint(self.target)}"

    @property
    def moved(self) -> bool:
        """Whether the next attempt goes elsewhere than the configured endpoint."""
        return self.target is not self.home

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:  # noqa: N803
        """Connect to the target; an attempt that fails sends the next one home."""
        factory = _HandshakeRelay(protocolFactory)
        return self.target.connect(factory).addErrback(self._not_connected)

    def _not_connected(self, failure: Failure) -> Failure:
        # Where it moved may be gone (a leader that failed over): the
        # configured endpoint knows where to go now.
        self.target = self.home
        self._failed(failure)
        return failure


@implementer(IProtocolFactory)
class _HandshakeRelay:
    """ClientService's factory, whose connections also hear that TLS is established.

    TLS tells the protocol it wraps when the handshake is over, if that
    protocol provides `IHandshakeListener`; the protocol it wraps is
    ClientService's proxy of ours, which does not say so although it passes
    every attribute, ``handshakeCompleted`` included, on to ours. The relay
    declares it on each proxy of a connection that listens.
    """

    def __init__(self, factory: IProtocolFactory) -> None:
        self._factory = factory

    def buildProtocol(self, addr: IAddress) -> IProtocol | None:
        """The wrapped factory's protocol, declared a handshake listener if it is one."""
        protocol = self._factory.buildProtocol(addr)
        if (
            protocol is not None
            and not IHandshakeListener.providedBy(protocol)
            and callable(getattr(protocol, "handshakeCompleted", None))
        ):
            alsoProvides(protocol, IHandshakeListener)
        return protocol

    def doStart(self) -> None:
        """Start the wrapped factory."""
        self._factory.doStart()

    def doStop(self) -> None:
        """Stop the wrapped factory."""
        self._factory.doStop()


class UpstreamService(ClientService):
    """An upstream's `ClientService`: starting and stopping it start and stop the upstream.

    `Upstream.start` and `Upstream.stop` (which a subclass may extend) call
    `start_connecting` and `stop_connecting`, ClientService's own start and stop.
    """

    def __init__(
        self,
        upstream: Upstream[Any],
        endpoint: IStreamClientEndpoint,
        factory: IProtocolFactory,
        retry_policy: Callable[[int], float],
        clock: IReactorTime,
    ) -> None:
        super().__init__(endpoint, factory, retryPolicy=retry_policy, clock=clock)
        self._upstream = upstream

    def startService(self) -> None:
        """Start the upstream."""
        self._upstream.start()

    def stopService(self) -> Deferred[None]:
        """Stop the upstream; fires once its connection is closed."""
        return self._upstream.stop()

    def start_connecting(self) -> None:
        """Connect, and connect again after a back-off whenever the connection ends."""
        super().startService()

    def stop_connecting(self) -> Deferred[None]:
        """Stop connecting and close the connection; fires once it is closed."""
        return super().stopService()


class Upstream(Generic[C]):
    """A server the gateway connects to: its connection's life and its counters.

    Args:
        name: The upstream's config name (the metrics' label, the routes' source).
        endpoint: Where to connect.
        connection: Builds a connection, given the upstream.
        clock: Reconnect delays (and the subclass's own timers).
        metrics: Counters, or None in tests that do not look.
        retry_policy: The wait before the next attempt, given how many
            attempts failed since a connection was last ready (1 for the
            first); by default from `RECONNECT_INITIAL_DELAY_SECONDS`, half
            as long again each time, to `RECONNECT_MAX_DELAY_SECONDS`, with
            up to a second of jitter.
        lock: Connect only while this node holds this fleet lock (None:
            always).
    """

    kind: ClassVar[str]
    """The protocol, as the connection metrics label it."""
    _log = Logger()

    def __init__(
        self,
        *,
        name: str,
        endpoint: IStreamClientEndpoint,
        connection: type[C],
        clock: IReactorTime,
        metrics: GatewayMetrics | None,
        retry_policy: Callable[[int], float] | None = None,
        lock: IFleetLock | None = None,
    ) -> None:
        self.name = name
        self._lock = lock
        self.clock = clock
        self._metrics = metrics
        self.traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        self._connection: C | None = None
        self._current: C | None = None
        """The connection the service holds, ready or still in its handshake."""
        self._endpoint = endpoint
        self.endpoint = MovableEndpoint(endpoint, self._not_connected, name)
        self._retry_policy = retry_policy or _backoff
        self._failures = 0
        self._failures_before_ready = 0
        self.service = UpstreamService(
            self, self.endpoint, UpstreamFactory(connection, self), self._next_wait, clock
        )
        if metrics is not None:
            self._m_up = metrics.upstream_up.labels(name)
            self._m_up.set(0)

    @property
    def connected(self) -> bool:
        """Whether a connection is ready (handshake, login or dialog done)."""
        return self._connection is not None

    @property
    def connection(self) -> C | None:
        """The ready connection, or None."""
        return self._connection

    @property
    def running(self) -> bool:
        """Whether the upstream is started (connecting, connected or waiting to)."""
        return bool(self.service.running)

    @property
    def standby(self) -> bool:
        """Whether another node of the fleet runs this upstream (its lock is not held here)."""
        return self._lock is not None and not self._lock.held

    # --- the service's life ---------------------------------------------------

    def start(self) -> None:
        """Connect, and connect again after a back-off whenever the connection ends.

        With a lock: ask for it, and connect while it is held.
        """
        if self._lock is None:
            self.service.start_connecting()
        else:
            self._lock.start(self._lock_acquired, self._lock_lost)

    def stop(self) -> Deferred[None]:
        """Stop connecting and close the connection; fire once it is closed.

        A subclass that has something to finish on the open connection
        first (store what was consumed) does it, then calls this. A lock
        is released once the connection is closed.
        """
        current = self._current
        if current is not None:
            current.close("the gateway is stopping")
        stopped = self.service.stop_connecting()
        if self._lock is not None:
            return self._lock.stop(stopped)
        return stopped

    def _lock_acquired(self) -> None:
        self._log.info(
            "upstream {upstream}: this node holds the upstream's fleet lock; connecting",
            upstream=self.name,
        )
        self.service.start_connecting()

    def _lock_lost(self) -> None:
        """Close at once: another node may take over the moment this returns."""
        current = self._current
        if current is not None:
            current.close("this node lost the upstream's fleet lock")
        self.service.stop_connecting()

    def move_to(self, endpoint: IStreamClientEndpoint, connection: C, why: str) -> None:
        """Connect elsewhere: close ``connection``; the next attempt goes to ``endpoint``.

        The back-off starts over: the service connects there after its first wait.
        """
        self.endpoint.target = endpoint
        self._failures = 0
        connection.close(why)

    def _next_wait(self, _attempts: int) -> float:
        # ClientService counts from the last TCP connection; we count from the
        # last ready one, so that a refused login backs off as well. Rounded to
        # a tenth: the jitter needs no more, and ClientService's "Scheduling
        # retry ... in 29.5 seconds" line shows the number as it is.
        self._failures += 1
        return max(round(self._retry_policy(self._failures), 1), RETRY_RESOLUTION_SECONDS)

    def _not_connected(self, failure: Failure) -> None:
        if self.running:
            self._log.info(
                "upstream {upstream}: cannot connect: {reason} ({address})",
                upstream=self.name,
                address=describe_endpoint(self.endpoint),
                reason=failure.getErrorMessage(),
            )

    def _tls_failed(self, reason: str) -> None:
        """Say why TLS with the server failed, and what usually fixes it; counted."""
        self.count_error("tls-failed")
        self._log.warn(
            "upstream {upstream}: TLS with {address} failed: {reason}. If we refused the"
            " server, its certificate must be issued by a CA in this upstream's trustRoots and"
            " name the host we connect to; if the server refused us, it must trust the CA of"
            " our certificate (certificate=, privateKey=)",
            upstream=self.name,
            address=describe_endpoint(self.endpoint),
            reason=reason,
        )

    # --- connections ----------------------------------------------------------

    def connection_made(self, connection: C) -> None:
        """A connection is up and starts its handshake (`stop` closes it)."""
        self._current = connection

    def connection_ready(self, connection: C, detail: str = "connected") -> None:
        """A connection finished its handshake: it carries messages from now on.

        Args:
            connection: The connection.
            detail: What the log line says (``connected``, ``logged in as x``).
        """
        self._connection = connection
        self._failures_before_ready, self._failures = self._failures, 0
        self._log.info("upstream {upstream}: {detail}", upstream=self.name, detail=detail)
        if self._metrics is not None:
            self._m_up.set(1)
            self._metrics.connections.labels(self.name, self.kind).inc()
            self._metrics.connections_total.labels(self.name, self.kind).inc()

    def connection_lost(self, connection: C, reason: Failure) -> None:
        """A connection ended; the service connects again after its back-off.

        A connection that never became ready is only forgotten; for the
        ready one, `connection_ended` says what the protocol does with what
        was in flight, and the log line says why it ended. TLS that failed
        is logged and counted either way (`_tls_failed`); a ready connection
        it ended does not count as a success for the back-off (TLS 1.3
        servers refuse a client certificate only after the handshake).
        """
        if self._current is connection:
            self._current = None
        tls_failure = _tls_failure(reason)
        if tls_failure is not None:
            self._tls_failed(tls_failure)
        if self._connection is not connection:
            return
        self._connection = None
        if tls_failure is not None:
            self._failures = self._failures_before_ready
        more = self.connection_ended(connection)
        self._log.info(
            "upstream {upstream}: connection lost: {reason}{more}",
            upstream=self.name,
            reason=tls_failure or reason.getErrorMessage(),
            more=f"; {more}" if more else "",
        )
        if self._metrics is not None:
            self._m_up.set(0)
            self._metrics.connections.labels(self.name, self.kind).dec()

    def connection_ended(self, connection: C) -> str:
        """The ready connection ended: take back what it had in flight.

        Returns:
            A few words for the log line (what will be sent again), or "".
        """
        return ""

    def count_error(self, kind: str) -> None:
        """Count a protocol error (or a refused or dropped event) of some kind."""
        if self._metrics is not None:
            self._metrics.protocol_errors.labels(self.name, kind).inc()


def _tls_failure(reason: Failure) -> str | None:
    """Why TLS failed, in words, if that is how the connection ended; else None."""
    if reason.check(SSL.Error) and reason.value is not None:
        return tls_failure_reason(reason.value)
    if reason.check(VerificationError):
        return f"the server's certificate does not name the host we connect to ({reason.value})"
    return None


@implementer(IPushProducer, IHandshakeListener)
class UpstreamConnection(Protocol, Generic[U]):
    """One connection of an upstream.

    It is a push producer on its transport: `pauseProducing` and
    `resumeProducing` say whether the server reads what we write (the
    subclass decides what to hold back). Subclasses call `write` for
    everything they send and `close` to end the connection, and the
    upstream learns of the end through `Upstream.connection_lost`. Over
    TLS, `tls_established` says when the handshake is done.
    """

    _log = Logger()

    def __init__(self, upstream: U) -> None:
        self.upstream = upstream
        self._closing = False

    @property
    def closing(self) -> bool:
        """Whether the connection is on its way out (send nothing more on it)."""
        return self._closing

    def connectionMade(self) -> None:
        """Turn Nagle off, produce for the transport, then start the protocol's handshake."""
        disable_nagle(self.transport)
        cast(IConsumer, self.transport).registerProducer(self, True)
        self.upstream.connection_made(self)
        self.connection_started()

    def connection_started(self) -> None:
        """The TCP connection is up: send what the protocol sends first.

        Over TLS, what is written now is sent once the handshake is done; a
        protocol that sends nothing first and becomes ready at once waits
        for `tls_established` instead (`tls`).
        """

    @property
    def tls(self) -> bool:
        """Whether the connection runs over TLS."""
        return ISSLTransport.providedBy(self.transport)

    def handshakeCompleted(self) -> None:
        """TLS is up: the server's certificate (and host name) verified."""
        self.tls_established()

    def tls_established(self) -> None:
        """The TLS handshake is done; nothing by default."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Stop the protocol's own work, then tell the upstream."""
        self._closing = True
        self.connection_stopped()
        self.upstream.connection_lost(self, reason)

    def connection_stopped(self) -> None:
        """The connection ended: cancel the protocol's timers and waiters."""

    def write(self, data: bytes) -> None:
        """Write bytes to the server, counted."""
        assert self.transport is not None
        self.transport.write(data)
        self.upstream.traffic.bytes_out += len(data)

    def close(self, why: str) -> None:
        """Close the connection, saying why in the log (once)."""
        if self._closing:
            return
        self._closing = True
        self._log.warn("upstream {upstream}: closing: {why}", upstream=self.upstream.name, why=why)
        assert self.transport is not None
        cast(IConsumer, self.transport).unregisterProducer()  # TLS shuts down only without one
        self.transport.loseConnection()

    def pauseProducing(self) -> None:
        """The server does not read what we write."""

    def resumeProducing(self) -> None:
        """The server reads again."""

    def stopProducing(self) -> None:
        """The transport is going away; connectionLost does the rest."""
