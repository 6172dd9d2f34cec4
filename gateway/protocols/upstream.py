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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final, Generic, TypeVar, cast

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IConsumer,
    IProtocol,
    IProtocolFactory,
    IPushProducer,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.tcp import UpstreamFactory, disable_nagle

__all__ = [
    "RECONNECT_INITIAL_DELAY_SECONDS",
    "RECONNECT_MAX_DELAY_SECONDS",
    "MovableEndpoint",
    "Upstream",
    "UpstreamConnection",
    "UpstreamService",
]

RECONNECT_INITIAL_DELAY_SECONDS: Final = 0.5
"""First wait before connecting again after a connection failed or ended."""
RECONNECT_MAX_DELAY_SECONDS: Final = 30.0
"""Longest wait between attempts (the wait grows by half each time up to it)."""

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


@implementer(IStreamClientEndpoint)
class MovableEndpoint:
    """Where an upstream's service connects: its configured endpoint, or one it moved to.

    Args:
        home: The configured endpoint.
        failed: Told of each attempt that failed (after the move back home).
    """

    def __init__(self, home: IStreamClientEndpoint, failed: Callable[[Failure], None]) -> None:
        self.home = home
        self.target = home
        """Where the next attempt goes."""
        self._failed = failed

    def __repr__(self) -> str:
        """Where the next attempt goes (ClientService names it in its log lines)."""
        return f"<{type(self).__name__} to {self.target!r}>"

    @property
    def moved(self) -> bool:
        """Whether the next attempt goes elsewhere than the configured endpoint."""
        return self.target is not self.home

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:  # noqa: N803
        """Connect to the target; an attempt that fails sends the next one home."""
        return self.target.connect(protocolFactory).addErrback(self._not_connected)

    def _not_connected(self, failure: Failure) -> Failure:
        # Where it moved may be gone (a leader that failed over): the
        # configured endpoint knows where to go now.
        self.target = self.home
        self._failed(failure)
        return failure


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
    ) -> None:
        self.name = name
        self.clock = clock
        self._metrics = metrics
        self.traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        self._connection: C | None = None
        self._current: C | None = None
        """The connection the service holds, ready or still in its handshake."""
        self._endpoint = endpoint
        self.endpoint = MovableEndpoint(endpoint, self._not_connected)
        self._retry_policy = retry_policy or _backoff
        self._failures = 0
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

    # --- the service's life ---------------------------------------------------

    def start(self) -> None:
        """Connect, and connect again after a back-off whenever the connection ends."""
        self.service.start_connecting()

    def stop(self) -> Deferred[None]:
        """Stop connecting and close the connection; fire once it is closed.

        A subclass that has something to finish on the open connection
        first (store what was consumed) does it, then calls this.
        """
        current = self._current
        if current is not None:
            current.close("the gateway is stopping")
        return self.service.stop_connecting()

    def move_to(self, endpoint: IStreamClientEndpoint, connection: C, why: str) -> None:
        """Connect elsewhere: close ``connection``; the next attempt goes to ``endpoint``.

        The back-off starts over: the service connects there after its first wait.
        """
        self.endpoint.target = endpoint
        self._failures = 0
        connection.close(why)

    def _next_wait(self, _attempts: int) -> float:
        # ClientService counts from the last TCP connection; we count from the
        # last ready one, so that a refused login backs off as well.
        self._failures += 1
        return self._retry_policy(self._failures)

    def _not_connected(self, failure: Failure) -> None:
        if self.running:
            self._log.info(
                "upstream {upstream}: cannot connect: {reason}",
                upstream=self.name,
                reason=failure.getErrorMessage(),
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
        self._failures = 0
        self._log.info("upstream {upstream}: {detail}", upstream=self.name, detail=detail)
        if self._metrics is not None:
            self._m_up.set(1)
            self._metrics.connections.labels(self.name, self.kind).inc()
            self._metrics.connections_total.labels(self.name, self.kind).inc()

    def connection_lost(self, connection: C, reason: Failure) -> None:
        """A connection ended; the service connects again after its back-off.

        A connection that never became ready is only forgotten; for the
        ready one, `connection_ended` says what the protocol does with what
        was in flight, and the log line says why it ended.
        """
        if self._current is connection:
            self._current = None
        if self._connection is not connection:
            return
        self._connection = None
        more = self.connection_ended(connection)
        self._log.info(
            "upstream {upstream}: connection lost: {reason}{more}",
            upstream=self.name,
            reason=reason.getErrorMessage(),
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


@implementer(IPushProducer)
class UpstreamConnection(Protocol, Generic[U]):
    """One connection of an upstream.

    It is a push producer on its transport: `pauseProducing` and
    `resumeProducing` say whether the server reads what we write (the
    subclass decides what to hold back). Subclasses call `write` for
    everything they send and `close` to end the connection, and the
    upstream learns of the end through `Upstream.connection_lost`.
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
        """The TCP (or TLS) connection is up: send what the protocol sends first."""

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
