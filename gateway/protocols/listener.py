"""What every listener's factory shares: its connections, their limit and their counters.

A protocol's server factory subclasses `ListenerFactory`, names its protocol
(the ``protocol`` label of the connection metrics) and its connection class
(``protocol``, built with the factory), and its connections call
`connection_opened` / `connection_closed`; errors are counted by kind with
`count_error`, traffic in `traffic`. Past ``max_connections`` open
connections a new one is closed at once, before a byte is read or written
(counted as ``too-many-connections``): none of the protocols has an answer
for "busy" before its handshake.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

from twisted.internet.protocol import Factory, Protocol

from gateway.core.authorization import UNRESTRICTED, Action, Authorization, check
from gateway.metrics import GatewayMetrics, TrafficCounters

__all__ = ["DEFAULT_LISTEN_BACKLOG", "DEFAULT_MAX_CONNECTIONS", "ListenerFactory"]

DEFAULT_MAX_CONNECTIONS = 1024
"""Open connections per listener unless its config says otherwise."""
DEFAULT_LISTEN_BACKLOG = 1024
"""Connections the kernel queues for a listener before it accepts them (Twisted's
default, 50, drops SYNs when a thousand clients connect at once: a one-second wait)."""

P = TypeVar("P", bound=Protocol)


class ListenerFactory(Factory, Generic[P]):
    """A listener's connections, traffic and error counters.

    Args:
        name: The listener's config name (the metrics' ``listener`` label).
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

    def __init__(self, name: str, metrics: GatewayMetrics | None) -> None:
        self.name = name
        self.connections: set[P] = set()
        self._by_identity: dict[str, int] = {}
        self._identity_of: dict[P, str] = {}
        self._metrics = metrics
        self.traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        if metrics is not None:
            self._m_open = metrics.connections.labels(name, self.kind)
            self._m_opened = metrics.connections_total.labels(name, self.kind)

    def buildProtocol(self, addr: Any) -> P | None:
        """A new connection, or None (closed at once) past ``max_connections``."""
        if len(self.connections) >= self.max_connections:
            self.count_error("too-many-connections")
            return None
        connection_class: Any = self.protocol  # takes the factory, unlike Protocol()
        built: P = connection_class(self)
        return built

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
