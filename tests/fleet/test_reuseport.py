"""Ports shared by worker processes (`gateway.fleet.reuseport`): SO_REUSEPORT, held and adopted.

The socket tests use real sockets on 127.0.0.1, port 0: what is tested is
the kernel's behaviour the design relies on (two listening sockets on one
port both take connections; a bound socket that does not listen holds the
port and takes none). The adapters are checked on a `MemoryReactor`, and
once end to end through an ``mtls:`` endpoint on the real reactor.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any, Final

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IAddress, IListeningPort, IReactorSSL, IReactorTCP
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import (
    Certificate,
    PrivateCertificate,
    optionsForClientTLS,
)
from twisted.internet.testing import MemoryReactor
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface.verify import verifyObject

from gateway.fleet.reuseport import (
    PortReservation,
    PortReservations,
    ReusePortListening,
    reuse_port_socket,
)
from gateway.tls import peer_identities
from tests.certs import Pki, make_pki, mtls_endpoint

CONNECTIONS: Final = 64
"""Connections per test: all of them on one of two sockets has a chance of 2 in 2**64."""


def _accepted(listener: socket.socket) -> int:
    """Accept, and close, every connection waiting on a non-blocking listening socket."""
    count = 0
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


def _connect(port: int, count: int) -> Iterator[socket.socket]:
    """``count`` connections to 127.0.0.1:``port``, each made before the next."""
    for _ in range(count):
        yield socket.create_connection(("127.0.0.1", port), timeout=5)


def test_two_listening_sockets_on_one_port_both_accept() -> None:
    """The kernel spreads connections to one port over every socket listening on it."""
    with ExitStack() as stack:
        first = stack.enter_context(reuse_port_socket("127.0.0.1", 0, 128))
        port = first.getsockname()[1]
        second = stack.enter_context(reuse_port_socket("127.0.0.1", port, 128))
        for client in _connect(port, CONNECTIONS):
            stack.enter_context(client)
        counts = (_accepted(first), _accepted(second))
    assert sum(counts) == CONNECTIONS
    assert all(count > 0 for count in counts), counts


def test_a_reservation_holds_the_port_and_takes_no_connection() -> None:
    """A bound socket that does not listen refuses nothing to the group and accepts nothing."""
    with closing(reuse_port_socket("127.0.0.1", 0, None)) as held:
        port = held.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        with closing(reuse_port_socket("127.0.0.1", port, 128)) as listening, ExitStack() as stack:
            for client in _connect(port, CONNECTIONS):
                stack.enter_context(client)
            assert _accepted(listening) == CONNECTIONS


def test_a_port_taken_without_reuseport_cannot_be_shared() -> None:
    """A port another socket holds (without SO_REUSEPORT) cannot be bound: CannotListenError."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(CannotListenError) as raised:
            reuse_port_socket("127.0.0.1", port, 128)
    assert raised.value.port == port


def test_an_ipv6_interface_gives_an_ipv6_socket() -> None:
    """An IPv6 address binds an IPv6 socket (where the host has IPv6 loopback)."""
    try:
        sock = reuse_port_socket("::1", 0, None)
    except CannotListenError:
        pytest.skip("no IPv6 loopback here")
    with sock:
        assert sock.family == socket.AF_INET6


def test_listening_adopts_a_socket_of_its_own() -> None:
    """``listenTCP`` makes the socket and has the reactor adopt it, with the factory as given."""
    reactor = MemoryReactor()
    factory = Factory.forProtocol(Protocol)
    listening = ReusePortListening(reactor)
    assert verifyObject(IReactorTCP, listening)
    assert verifyObject(IReactorSSL, listening)
    serverFromString(listening, "tcp:0:interface=127.0.0.1").listen(factory)
    [(_, family, adopted)] = reactor.adoptedPorts
    assert family == socket.AF_INET
    assert adopted is factory
    assert reactor.tcpServers == []  # not listened on the reactor's own way


def test_tls_is_the_factory_wrapped_with_the_endpoints_context(tmp_path: Path) -> None:
    """An ``mtls:`` endpoint gets a TLS factory around its own, with its reloadable context."""
    reactor = MemoryReactor()
    factory = Factory.forProtocol(Protocol)
    endpoint = serverFromString(ReusePortListening(reactor), mtls_endpoint(make_pki(tmp_path)))
    endpoint.listen(factory)
    [(_, _, adopted)] = reactor.adoptedPorts
    assert isinstance(adopted, TLSMemoryBIOFactory)
    assert adopted.wrappedFactory is factory
    assert reactor.sslServers == []


def test_reservations_parse_endpoints_as_the_workers_do() -> None:
    """Listening through `PortReservations` binds the endpoint's interface and holds a port."""
    reservations = PortReservations()
    held: list[Any] = []
    serverFromString(reservations, "tcp:0:interface=127.0.0.1").listen(Factory()).addCallback(
        held.append
    )
    [reservation] = held
    assert isinstance(reservation, PortReservation)
    assert verifyObject(IListeningPort, reservation)
    address = reservation.getHost()
    assert (address.host, address.port) == ("127.0.0.1", reservation.port)
    assert reservation.port > 0
    reservation.stopListening()
    with closing(socket.socket()) as plain:  # released: anyone may bind it now
        plain.bind(("127.0.0.1", reservation.port))


def test_reservations_do_not_connect() -> None:
    """A reservation is for listening only."""
    with pytest.raises(NotImplementedError):
        PortReservations().connectTCP("127.0.0.1", 1, Factory())


# --- end to end: TLS with client certificates through a shared port -------------------


class _Identities(Protocol):
    """Fires `identified` with the peer's identities once the handshake is done."""

    def __init__(self, identified: Deferred[frozenset[str]]) -> None:
        self._identified = identified

    def dataReceived(self, data: bytes) -> None:
        """The first data comes after the handshake: the identities are known."""
        self._identified.callback(peer_identities(self.transport, frozenset({"cn"})))
        assert self.transport is not None
        self.transport.loseConnection()


class _IdentityFactory(Factory):
    """Builds `_Identities` protocols that report to one Deferred."""

    def __init__(self) -> None:
        self.identified: Deferred[frozenset[str]] = Deferred()

    def buildProtocol(self, addr: IAddress | None) -> _Identities:
        """One protocol per connection."""
        return _Identities(self.identified)


class _Hello(Protocol):
    """Sends ``hello`` once connected (TLS holds it until the handshake is done)."""

    def connectionMade(self) -> None:
        """Send."""
        assert self.transport is not None
        self.transport.write(b"hello")


@pytest_twisted.ensureDeferred
async def test_a_shared_mtls_port_verifies_client_certificates(tmp_path: Path) -> None:
    """Through `ReusePortListening`, ``mtls:`` verifies client certificates as it always does."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol, wrapClientTLS

    pki: Pki = make_pki(tmp_path)
    factory = _IdentityFactory()
    endpoint = serverFromString(ReusePortListening(reactor), mtls_endpoint(pki))
    port = await endpoint.listen(factory)
    try:
        client = PrivateCertificate.loadPEM(pki.alice.certificate_pem() + pki.alice.key_pem())
        options = optionsForClientTLS(
            "localhost",
            trustRoot=Certificate.loadPEM(pki.ca.certificate_pem()),
            clientCertificate=client,
        )
        tcp = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        await connectProtocol(wrapClientTLS(options, tcp), _Hello())
        assert await factory.identified == frozenset({"alice"})
    finally:
        await port.stopListening()
