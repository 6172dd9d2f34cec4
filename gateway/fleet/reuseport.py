"""Listening sockets shared by the worker processes of one host: SO_REUSEPORT.

With ``[fleet] processes = N`` every worker listens on each TCP listener's
port itself, with its own socket, and the kernel (Linux) hashes each new
connection to one of the sockets in the port's group: the load spreads
evenly. One listening socket inherited by all workers would not: whichever
process wakes first accepts, and the busiest one keeps winning (libuv#747).

Twisted's endpoints cannot set SO_REUSEPORT, so `ReusePortListening` stands
in for the reactor an endpoint listens with: `serverFromString` builds the
endpoint as usual (``tcp:``, ``tcp6:``, ``ssl:``, ``mtls:``: the same
parameters, defaults, certificates and reloadable TLS context), and when the
endpoint calls ``listenTCP`` or ``listenSSL``, it makes the socket itself
(`reuse_port_socket`) and hands it to the real reactor with
``adoptStreamPort``. TLS is what ``listenSSL`` does in Twisted's own
reactors: the factory wrapped in a `TLSMemoryBIOFactory` around the
endpoint's context factory, which is asked for a context per connection
(so a SIGHUP reload of an ``mtls:`` listener still applies).

`PortReservations` is the supervisor's side: for each shared listener it
binds a SO_REUSEPORT socket and never listens on it. The port is then held
for the group: nobody else (another user, a process without SO_REUSEPORT)
can take it while the workers restart, a port in use fails the start before
any worker runs, and port 0 is resolved once, to a port every worker then
binds. A bound socket that does not listen takes no share of the
connections (Linux hashes over listening sockets only; tested).

Closing a SO_REUSEPORT listening socket drops the connections still queued
on it, not yet accepted: a worker that stops or dies takes those with it,
as a single process would.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.abstract import isIPv6Address
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocolFactory,
    IReactorSSL,
    IReactorTCP,
)
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer

__all__ = [
    "PortReservation",
    "PortReservations",
    "ReusePortListening",
    "reuse_port_socket",
]


def reuse_port_socket(interface: str, port: int, backlog: int | None) -> socket.socket:
    """A TCP socket bound with SO_REUSEADDR and SO_REUSEPORT; listening if ``backlog`` is given.

    The socket is non-blocking and not inherited by child processes.

    Args:
        interface: The address to bind (``""``: every IPv4 interface; an IPv6
            address gives an IPv6 socket).
        port: The port; 0: one the system picks.
        backlog: The listen queue; None: bind only (a reservation).

    Raises:
        CannotListenError: The address cannot be bound or listened on (in
            use by a socket without SO_REUSEPORT or of another user, say).
    """
    family = socket.AF_INET6 if isIPv6Address(interface) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            flags = socket.AI_NUMERICHOST | socket.AI_PASSIVE
            address = socket.getaddrinfo(interface, port, family, socket.SOCK_STREAM, 0, flags)
            sock.bind(address[0][4])
        else:
            sock.bind((interface, port))
        if backlog is not None:
            sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise CannotListenError(interface, port, exc) from None
    return sock


@implementer(IReactorTCP, IReactorSSL)
class ReusePortListening:
    """The reactor an endpoint listens with, when its port is shared with other processes.

    Only listening is changed: ``listenTCP`` and ``listenSSL`` make a
    SO_REUSEPORT socket (`reuse_port_socket`) and have the real reactor
    adopt it; connecting goes to the real reactor unchanged.

    Args:
        reactor: The real reactor; it must provide ``adoptStreamPort``
            (`twisted.internet.interfaces.IReactorSocket`), as every reactor
            of Twisted's on POSIX does.
    """

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def listenTCP(  # noqa: N802 (Twisted's name)
        self, port: int, factory: IProtocolFactory, backlog: int = 50, interface: str = ""
    ) -> IListeningPort:
        """Listen on ``interface:port`` with a socket of this process's own in the port's group.

        Raises:
            CannotListenError: See `reuse_port_socket`.
        """
        sock = reuse_port_socket(interface, port, backlog)
        try:
            listening: IListeningPort = self._reactor.adoptStreamPort(
                sock.fileno(), sock.family, factory
            )
        finally:
            sock.close()  # the reactor's port holds a duplicate of its own
        return listening

    def listenSSL(  # noqa: N802 (Twisted's name)
        self,
        port: int,
        factory: IProtocolFactory,
        contextFactory: Any,  # noqa: N803 (Twisted's name)
        backlog: int = 50,
        interface: str = "",
    ) -> IListeningPort:
        """Listen for TLS as Twisted's reactors do: `listenTCP` with the factory wrapped.

        Raises:
            CannotListenError: See `reuse_port_socket`.
        """
        wrapped = TLSMemoryBIOFactory(contextFactory, False, factory)
        return self.listenTCP(port, wrapped, backlog, interface)

    def connectTCP(  # noqa: N802 (Twisted's name)
        self,
        host: str,
        port: int,
        factory: Any,
        timeout: float = 30,
        bindAddress: Any = None,  # noqa: N803 (Twisted's name)
    ) -> Any:
        """The real reactor's."""
        return self._reactor.connectTCP(host, port, factory, timeout, bindAddress)

    def connectSSL(  # noqa: N802 (Twisted's name)
        self,
        host: str,
        port: int,
        factory: Any,
        contextFactory: Any,  # noqa: N803 (Twisted's name)
        timeout: float = 30,
        bindAddress: Any = None,  # noqa: N803 (Twisted's name)
    ) -> Any:
        """The real reactor's."""
        return self._reactor.connectSSL(host, port, factory, contextFactory, timeout, bindAddress)


@implementer(IListeningPort)
class PortReservation:
    """A port held for a group of SO_REUSEPORT listeners: bound, never listening.

    Args:
        sock: The bound socket (`reuse_port_socket` without a backlog).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        host, port = sock.getsockname()[:2]
        self._address = (
            IPv6Address("TCP", host, port)
            if sock.family == socket.AF_INET6
            else IPv4Address("TCP", host, port)
        )

    @property
    def port(self) -> int:
        """The port held."""
        return self._address.port

    def startListening(self) -> None:  # noqa: N802 (Twisted's name)
        """Nothing: a reservation never listens."""

    def stopListening(self) -> Deferred[None]:  # noqa: N802 (Twisted's name)
        """Release the port."""
        if self._sock is not None:
            sock, self._sock = self._sock, None
            sock.close()
        return succeed(None)

    def getHost(self) -> IPv4Address | IPv6Address:  # noqa: N802 (Twisted's name)
        """The address held."""
        return self._address


@implementer(IReactorTCP, IReactorSSL)
class PortReservations:
    """The reactor a supervisor "listens" with: each listen binds and holds a port.

    The supervisor parses each shared listener's endpoint string with
    `serverFromString` against this object, so the interface and port are
    read exactly as the workers' endpoints will read them (an ``mtls:``
    endpoint's loopback default included), and listens: the endpoint calls
    `listenTCP` or `listenSSL`, which bind and return a `PortReservation`.
    Connecting is not something a reservation does.
    """

    def listenTCP(  # noqa: N802 (Twisted's name)
        self, port: int, factory: object, backlog: int = 50, interface: str = ""
    ) -> PortReservation:
        """Bind and hold ``interface:port``.

        Raises:
            CannotListenError: See `reuse_port_socket`.
        """
        return PortReservation(reuse_port_socket(interface, port, None))

    def listenSSL(  # noqa: N802 (Twisted's name)
        self,
        port: int,
        factory: object,
        contextFactory: object,  # noqa: N803 (Twisted's name)
        backlog: int = 50,
        interface: str = "",
    ) -> PortReservation:
        """Bind and hold ``interface:port`` (TLS is the workers' business).

        Raises:
            CannotListenError: See `reuse_port_socket`.
        """
        return self.listenTCP(port, factory, backlog, interface)

    def connectTCP(self, *args: object, **kwargs: object) -> Any:  # noqa: N802 (Twisted's name)
        """Refused: reservations only listen.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError("a port reservation does not connect")

    def connectSSL(self, *args: object, **kwargs: object) -> Any:  # noqa: N802 (Twisted's name)
        """Refused: reservations only listen.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError("a port reservation does not connect")
