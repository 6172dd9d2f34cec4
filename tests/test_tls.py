r"""Tests for `gateway.tls`: the ``mtls:`` endpoint and `peer_identities`.

Parser tests build endpoints on a `MemoryReactor`; handshake tests listen on
127.0.0.1 port 0 with the real reactor and connect Twisted TLS clients to it.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID, NameOID
from OpenSSL import SSL, crypto
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    SSL4ServerEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    clientFromString,
    connectProtocol,
    serverFromString,
    wrapClientTLS,
)
from twisted.internet.interfaces import (
    IAddress,
    IHandshakeListener,
    ISSLTransport,
    IStreamClientEndpoint,
    IStreamServerEndpointStringParser,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    TLSVersion,
    optionsForClientTLS,
)
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.plugin import IPlugin, getPlugins
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.tls import (
    CERT_NAME_TYPES,
    DEFAULT_CERT_IDENTITY,
    MTLSServerParser,
    ReloadableServerTLS,
    client_endpoint_at,
    external_identity,
    mtls_verify_mode,
    parse_mtls_server,
    peer_identities,
    tls_failure_reason,
)
from tests.certs import (
    ALICE_IDENTITIES,
    CertifiedKey,
    Pki,
    issue_client_certificate,
    make_pki,
    write_pem,
)

# Twisted 26.10 still hands pyOpenSSL X509/PKey objects to OpenSSL.SSL.Context,
# which pyOpenSSL 26 deprecates; that is Twisted's to fix, not ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Passing pyOpenSSL (X509|PKey) objects is deprecated:DeprecationWarning"
)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh CA, server, good client (alice) and bad client (mallory)."""
    return make_pki(tmp_path)


def _server_params(pki: Pki) -> str:
    """The certificate part of an ``mtls:`` string for the test server."""
    return f"certKey={pki.server_cert}:privateKey={pki.server_key}"


def _memory_listen(description: str) -> tuple[Any, ...]:
    """Listen on a `MemoryReactor` and return what ``listenSSL`` was given.

    Returns:
        ``(port, factory, contextFactory, backlog, interface)``.
    """
    reactor = MemoryReactor()
    endpoint = serverFromString(reactor, description)
    endpoint.listen(Factory.forProtocol(Protocol))
    (listened,) = reactor.sslServers
    return tuple(listened)


def _parse_error(description: str) -> str:
    """Parse ``description``, expecting a `ValueError`, and return its message."""
    with pytest.raises(ValueError) as caught:
        serverFromString(MemoryReactor(), description)
    return str(caught.value)


# --- plugin discovery ---------------------------------------------------------------------


def test_plugin_is_discovered() -> None:
    """Twisted's plugin system finds a parser with prefix ``mtls`` that verifies."""
    parsers = [
        parser
        for parser in getPlugins(IStreamServerEndpointStringParser)
        if parser.prefix == "mtls"
    ]
    assert len(parsers) == 1
    assert verifyObject(IPlugin, parsers[0])
    assert verifyObject(IStreamServerEndpointStringParser, parsers[0])


def test_parser_class_provides_interfaces() -> None:
    """`MTLSServerParser` provides the interfaces Twisted asks of a parser plugin."""
    parser = MTLSServerParser()
    assert parser.prefix == "mtls"
    assert verifyObject(IPlugin, parser)
    assert verifyObject(IStreamServerEndpointStringParser, parser)


def test_plugin_module_is_lazy() -> None:
    """Importing the plugin module does not import `gateway.tls`."""
    code = (
        "import sys, twisted.plugins.msggateway_endpoints; sys.exit('gateway.tls' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_server_from_string(pki: Pki) -> None:
    """``serverFromString`` turns an ``mtls:`` string into an SSL endpoint."""
    endpoint = serverFromString(
        MemoryReactor(), f"mtls:0:{_server_params(pki)}:caCerts={pki.ca_cert}"
    )
    assert isinstance(endpoint, SSL4ServerEndpoint)


# --- parameters that work -----------------------------------------------------------------


def test_defaults_without_ca(pki: Pki) -> None:
    """Without caCerts: loopback, backlog 50, no client certificate asked for."""
    port, _, options, backlog, interface = _memory_listen(f"mtls:8788:{_server_params(pki)}")
    assert (port, backlog, interface) == (8788, 50, "127.0.0.1")
    assert isinstance(options, ReloadableServerTLS)  # the material SIGHUP can replace
    assert isinstance(options.options, CertificateOptions)
    assert options.verify is False


def test_ca_certs_default_to_required(pki: Pki) -> None:
    """With caCerts and no verify, a client certificate is required."""
    *_, options, _, _ = _memory_listen(f"mtls:0:{_server_params(pki)}:caCerts={pki.ca_cert}")
    assert options.verify is True
    assert options.requireCertificate is True


def test_verify_optional(pki: Pki) -> None:
    """``verify=optional`` verifies a certificate but does not require one."""
    *_, options, _, _ = _memory_listen(
        f"mtls:0:{_server_params(pki)}:caCerts={pki.ca_cert}:verify=optional"
    )
    assert options.verify is True
    assert options.requireCertificate is False


def test_named_port_interface_backlog(pki: Pki) -> None:
    """``port=``, an escaped IPv6 ``interface`` and ``backlog`` are honoured."""
    port, _, _, backlog, interface = _memory_listen(
        f"mtls:port=0:interface=\\:\\:1:backlog=7:{_server_params(pki)}"
    )
    assert (port, backlog, interface) == (0, 7, "::1")


def test_cert_and_key_in_cert_key(pki: Pki) -> None:
    """``certKey`` alone may hold the certificate followed by its key."""
    combined = pki.directory / "combined.pem"
    combined.write_bytes(pki.server.certificate_pem() + pki.server.key_pem())
    _memory_listen(f"mtls:0:certKey={combined}")


def test_cert_and_key_in_private_key(pki: Pki) -> None:
    """As with ``ssl:``, ``privateKey`` alone may hold key and certificate."""
    combined = pki.directory / "combined.pem"
    combined.write_bytes(pki.server.key_pem() + pki.server.certificate_pem())
    _memory_listen(f"mtls:0:privateKey={combined}")


def test_chain_after_certificate_and_extra_chain(pki: Pki) -> None:
    """Certificates after the first in certKey, and extraCertChain, form the chain."""
    full_chain = pki.directory / "fullchain.pem"
    full_chain.write_bytes(pki.server.certificate_pem() + pki.ca.certificate_pem())
    *_, options, _, _ = _memory_listen(
        f"mtls:0:certKey={full_chain}:privateKey={pki.server_key}"
        f":extraCertChain={pki.wrong_ca_cert}"
    )
    chain = [c.to_cryptography() for c in options.extraCertChain]
    assert chain == [pki.ca.certificate, pki.wrong_ca.certificate]


def test_ca_directory(pki: Pki) -> None:
    """``caCerts`` may be a directory of PEM files, all of whose CAs are trusted."""
    ca_dir = pki.directory / "cas"
    ca_dir.mkdir()
    (ca_dir / "one.pem").write_bytes(pki.ca.certificate_pem())
    (ca_dir / "two.PEM").write_bytes(pki.wrong_ca.certificate_pem() + pki.ca.certificate_pem())
    (ca_dir / "README").write_text("not a certificate, and not *.pem")
    *_, options, _, _ = _memory_listen(f"mtls:0:{_server_params(pki)}:caCerts={ca_dir}")
    subjects = sorted(c.to_cryptography().subject.rfc4514_string() for c in options.caCerts)
    assert subjects == ["CN=msggateway test CA", "CN=unrelated CA"]


def test_minimum_tls_and_ciphers(pki: Pki) -> None:
    """``minimumTLS=1.3`` and a valid cipher string are accepted."""
    _memory_listen(
        f"mtls:0:{_server_params(pki)}:minimumTLS=1.3:ciphers=ECDHE-ECDSA-AES128-GCM-SHA256"
    )


def test_parse_mtls_server_from_python(pki: Pki) -> None:
    """`parse_mtls_server` takes snake_case keywords, paths and an integer port."""
    endpoint = parse_mtls_server(
        MemoryReactor(),
        0,
        cert_key=pki.server_cert,
        private_key=pki.server_key,
        ca_certs=pki.ca_cert,
    )
    assert isinstance(endpoint, SSL4ServerEndpoint)


# --- parameters that do not work ----------------------------------------------------------


def _bad_files(pki: Pki) -> dict[str, Path]:
    """Files that are wrong in a way a parameter must notice."""
    directory = pki.directory
    garbage = directory / "garbage.pem"
    garbage.write_bytes(
        b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"
    )
    encrypted = directory / "encrypted.key"
    encrypted.write_bytes(
        pki.server.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    empty_dir = directory / "empty"
    empty_dir.mkdir()
    return {"garbage": garbage, "encrypted": encrypted, "empty_dir": empty_dir}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(
            "certKey={d}/missing.pem:privateKey={d}/server.key",
            ["certKey", "{d}/missing.pem", "No such file"],
            id="missing-cert",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/missing.key",
            ["privateKey", "{d}/missing.key", "No such file"],
            id="missing-key",
        ),
        pytest.param(
            "certKey={d}:privateKey={d}/server.key",
            ["certKey", "{d}", "cannot read"],
            id="cert-is-directory",
        ),
        pytest.param(
            "certKey={d}/server.key:privateKey={d}/server.key",
            ["certKey", "{d}/server.key", "no PEM certificate"],
            id="cert-is-key",
        ),
        pytest.param(
            "certKey={d}/garbage.pem:privateKey={d}/server.key",
            ["certKey", "{d}/garbage.pem", "bad PEM certificate"],
            id="cert-garbage",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.pem",
            ["privateKey", "{d}/server.pem", "no PEM private key"],
            id="key-is-cert",
        ),
        pytest.param(
            "certKey={d}/server.pem",
            ["certKey", "{d}/server.pem", "no PEM private key"],
            id="cert-key-without-key",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/alice.key",
            ["privateKey", "{d}/alice.key", "does not belong", "{d}/server.pem"],
            id="key-mismatch",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/encrypted.key",
            ["privateKey", "{d}/encrypted.key", "encrypted"],
            id="key-encrypted",
        ),
        pytest.param("interface=127.0.0.1", ["certKey", "missing"], id="no-cert"),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.key:extraCertChain={d}/server.key",
            ["extraCertChain", "{d}/server.key", "no PEM certificate"],
            id="chain-is-key",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.key:caCerts={d}/nope.pem",
            ["caCerts", "{d}/nope.pem", "No such file"],
            id="missing-ca",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.key:caCerts={d}/server.key",
            ["caCerts", "{d}/server.key", "no PEM certificate"],
            id="ca-is-key",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.key:caCerts={d}/empty",
            ["caCerts", "{d}/empty", "no *.pem"],
            id="ca-empty-directory",
        ),
        pytest.param(
            "certKey={d}/server.pem:privateKey={d}/server.key:caCerts={d}",
            ["caCerts", "{d}/garbage.pem", "bad PEM certificate"],
            id="ca-directory-with-garbage",
        ),
    ],
)
def test_bad_files(pki: Pki, params: str, expected: list[str]) -> None:
    """A missing, unreadable or wrong file names its parameter, its path and the problem."""
    _bad_files(pki)
    directory = str(pki.directory)
    message = _parse_error("mtls:0:" + params.format(d=directory))
    for part in expected:
        assert part.format(d=directory) in message


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param("verify=sometimes", ["verify", "'sometimes'", "required"], id="verify-bad"),
        pytest.param("verify=required", ["verify", "needs caCerts"], id="required-no-ca"),
        pytest.param("verify=optional", ["verify", "needs caCerts"], id="optional-no-ca"),
        pytest.param("verify=none:caCerts={ca}", ["verify", "ignore caCerts"], id="none-with-ca"),
        pytest.param("minimumTLS=1.1", ["minimumTLS", "insecure"], id="tls-1.1"),
        pytest.param("minimumTLS=1.0", ["minimumTLS", "insecure"], id="tls-1.0"),
        pytest.param("minimumTLS=2", ["minimumTLS", "'2'", "1.2 or 1.3"], id="tls-2"),
        pytest.param("ciphers=NO-SUCH-CIPHER", ["ciphers", "NO-SUCH-CIPHER"], id="ciphers-none"),
        pytest.param("ciphers=eNULL", ["ciphers", "eNULL", "no usable cipher"], id="ciphers-null"),
        pytest.param("ciphers=", ["ciphers"], id="ciphers-empty"),
        pytest.param("port=http", ["port", "'http'", "whole number"], id="port-name"),
        pytest.param("port=65536", ["port", "65536", "65535"], id="port-range"),
        pytest.param("backlog=0", ["backlog", "positive"], id="backlog-zero"),
        pytest.param("interface=example.org", ["interface", "example.org"], id="interface-name"),
        pytest.param("cacerts={ca}", ["unknown parameter 'cacerts'", "'caCerts'"], id="unknown"),
    ],
)
def test_bad_settings(pki: Pki, params: str, expected: list[str]) -> None:
    """A bad setting raises a ValueError naming the parameter and what is wrong."""
    port = "" if "port=" in params else "port=0:"
    message = _parse_error(f"mtls:{port}{_server_params(pki)}:" + params.format(ca=pki.ca_cert))
    for part in expected:
        assert part in message


def test_missing_port(pki: Pki) -> None:
    """An ``mtls:`` string without a port says the port is missing."""
    assert "port: missing" in _parse_error(f"mtls:{_server_params(pki)}")


def test_port_given_twice(pki: Pki) -> None:
    """A port both positional and named is refused."""
    assert "port: given twice" in _parse_error(f"mtls:1:port=2:{_server_params(pki)}")


def test_every_problem_at_once(pki: Pki) -> None:
    """All problems of one string are reported together, each once."""
    message = _parse_error(
        f"mtls:0:certKey={pki.directory}/gone.pem:verify=maybe:minimumTLS=1.1:backlog=x"
    )
    for parameter in ("certKey", "verify", "minimumTLS", "backlog"):
        assert parameter in message
    assert message.count("gone.pem") == 1


# --- peer_identities without a network ----------------------------------------------------


@implementer(ISSLTransport)
class _FakeTLSTransport(StringTransport):
    """A `StringTransport` that claims TLS and has a given peer certificate."""

    def __init__(self, peer: object) -> None:
        super().__init__()
        self._peer = peer

    def getPeerCertificate(self) -> object:
        """Return the peer certificate given to the constructor."""
        return self._peer


def test_plain_transport_has_no_identities() -> None:
    """A transport without TLS has no identities."""
    assert peer_identities(StringTransport()) == frozenset()


def test_no_transport_has_no_identities() -> None:
    """No transport at all (before connectionMade) has no identities."""
    assert peer_identities(None) == frozenset()


def test_tls_without_peer_certificate() -> None:
    """A TLS transport whose peer sent no certificate has no identities."""
    assert peer_identities(_FakeTLSTransport(None)) == frozenset()


def test_identities_from_pyopenssl_certificate(pki: Pki) -> None:
    """A pyOpenSSL certificate gives its CN and, when asked for, its DNS, e-mail and URI SANs."""
    peer = crypto.X509.from_cryptography(pki.alice.certificate)
    assert peer_identities(_FakeTLSTransport(peer), CERT_NAME_TYPES) == ALICE_IDENTITIES


def test_identities_from_cryptography_certificate(pki: Pki) -> None:
    """A `cryptography` certificate (pyOpenSSL's ``as_cryptography``) works too."""
    transport = _FakeTLSTransport(pki.alice.certificate)
    assert peer_identities(transport, CERT_NAME_TYPES) == ALICE_IDENTITIES


def test_the_common_name_alone_by_default(pki: Pki) -> None:
    """Without name types given, only the Common Name is an identity, not the SANs."""
    issued = issue_client_certificate(
        pki.ca, "alice", dns_names=["bob"], emails=["admin"], uris=["urn:x:carol"]
    )
    transport = _FakeTLSTransport(issued.certificate)
    assert DEFAULT_CERT_IDENTITY == ("cn",)
    assert peer_identities(transport) == {"alice"}
    assert external_identity(transport) == "alice"
    assert external_identity(transport, "bob") is None
    assert external_identity(transport, "admin") is None


@pytest.mark.parametrize(
    ("name_types", "expected"),
    [
        (("cn",), {"alice"}),
        (("dns",), {"bob.example.org"}),
        (("email",), {"admin@example.org"}),
        (("uri",), {"urn:x:carol"}),
        (("ip",), {"192.0.2.9"}),
        (("cn", "email"), {"alice", "admin@example.org"}),
        ((), set()),
    ],
)
def test_each_name_type_alone(pki: Pki, name_types: tuple[str, ...], expected: set[str]) -> None:
    """Each name type gives its own names and no other type's."""
    issued = issue_client_certificate(
        pki.ca,
        "alice",
        dns_names=["bob.example.org"],
        emails=["admin@example.org"],
        uris=["urn:x:carol"],
        ip_addresses=["192.0.2.9"],
    )
    assert peer_identities(_FakeTLSTransport(issued.certificate), name_types) == expected


def test_external_identity_of_a_san_type(pki: Pki) -> None:
    """With SAN types only, EXTERNAL without a name is the one SAN, or nobody among several."""
    one = issue_client_certificate(pki.ca, "alice", dns_names=["alice.example.org"])
    assert external_identity(_FakeTLSTransport(one.certificate), "", ("dns",)) == (
        "alice.example.org"
    )
    two = issue_client_certificate(pki.ca, "alice", dns_names=["a.example.org", "b.example.org"])
    transport = _FakeTLSTransport(two.certificate)
    assert external_identity(transport, "", ("dns",)) is None
    assert external_identity(transport, "b.example.org", ("dns",)) == "b.example.org"
    assert external_identity(transport, "", ("cn", "dns")) == "alice"


def test_ip_address_identities(pki: Pki) -> None:
    """IP address SANs appear in their text form, IPv4 and IPv6."""
    issued = issue_client_certificate(pki.ca, "device", ip_addresses=["192.0.2.7", "2001:db8::1"])
    assert peer_identities(_FakeTLSTransport(issued.certificate), ("cn", "ip")) == {
        "device",
        "192.0.2.7",
        "2001:db8::1",
    }


def test_no_common_name(pki: Pki) -> None:
    """A certificate with an empty subject gives its SANs only, and nothing by default."""
    issued = issue_client_certificate(pki.ca, None, dns_names=["only-san.example.org"])
    transport = _FakeTLSTransport(issued.certificate)
    assert peer_identities(transport, CERT_NAME_TYPES) == {"only-san.example.org"}
    assert peer_identities(transport) == frozenset()


def test_nothing_to_read(pki: Pki) -> None:
    """A certificate with neither CN nor SAN gives no identities."""
    issued = issue_client_certificate(pki.ca, None)
    assert peer_identities(_FakeTLSTransport(issued.certificate)) == frozenset()


def test_undecodable_san(pki: Pki) -> None:
    """A SAN extension that cannot be decoded is skipped; the CN still counts."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    # A SEQUENCE holding one iPAddress of a single byte: neither IPv4 nor IPv6.
    bad_san = x509.UnrecognizedExtension(
        ExtensionOID.SUBJECT_ALTERNATIVE_NAME, b"0\x03\x87\x01\x01"
    )
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")]))
        .issuer_name(pki.ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(bad_san, critical=False)
        .sign(pki.ca.key, hashes.SHA256())
    )
    peer = crypto.X509.from_cryptography(certificate)
    assert peer_identities(_FakeTLSTransport(peer), CERT_NAME_TYPES) == {"odd"}


def test_unknown_certificate_type() -> None:
    """Something that is not a certificate gives no identities instead of an error."""
    assert peer_identities(_FakeTLSTransport("not a certificate")) == frozenset()


def test_tls_failure_reason_in_words() -> None:
    """OpenSSL's reasons are joined as words; other errors give their message or type."""
    error = SSL.Error(
        [
            ("SSL routines", "", "certificate verify failed"),
            ("SSL routines", "", "tlsv1 alert unknown ca"),
        ]
    )
    assert tls_failure_reason(error) == "certificate verify failed; tlsv1 alert unknown ca"
    assert tls_failure_reason(SSL.Error("plain words")) == "plain words"
    assert tls_failure_reason(SSL.Error()) == "Error"


# --- real handshakes ----------------------------------------------------------------------


def _reactor() -> Any:
    """The reactor pytest-twisted runs (imported late, as Twisted's standard asks)."""
    from twisted.internet import reactor

    return reactor


@implementer(IHandshakeListener)
class _ServerProtocol(Protocol):
    """Records the handshake and the first data, then closes the connection."""

    def __init__(self) -> None:
        self.identities: frozenset[str] | None = None
        self.version: str | None = None
        self.received = b""
        self.lost: Deferred[None] = Deferred()

    def handshakeCompleted(self) -> None:
        """Note the peer's identities (of every name type) and the TLS version once TLS is up."""
        self.identities = peer_identities(self.transport, CERT_NAME_TYPES)
        tls = ISSLTransport(self.transport)
        self.version = tls.getHandle().get_protocol_version_name()

    def dataReceived(self, data: bytes) -> None:
        """Keep the data and close: one message is all a test sends."""
        self.received += data
        assert self.transport is not None
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Tell the test the connection is gone."""
        self.lost.callback(None)


class _ServerFactory(Factory):
    """Builds one `_ServerProtocol` and hands it to the test."""

    def __init__(self) -> None:
        self.built: Deferred[_ServerProtocol] = Deferred()

    def buildProtocol(self, addr: IAddress) -> _ServerProtocol:
        """Build the server protocol and fire `built` with it."""
        protocol = _ServerProtocol()
        self.built.callback(protocol)
        return protocol


class _ClientProtocol(Protocol):
    """Sends ``hello`` as soon as it is connected and waits for the end."""

    def __init__(self) -> None:
        self.reason: Failure | None = None
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        """Send one message (TLS holds it until the handshake is done)."""
        assert self.transport is not None
        self.transport.write(b"hello")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Note why the connection is gone and tell the test."""
        self.reason = reason
        self.lost.callback(None)


async def _exchange(
    server_params: str,
    client_endpoint: Callable[[int], IStreamClientEndpoint],
    interface: str = "127.0.0.1",
) -> _ServerProtocol:
    """Listen with ``mtls:``, connect a client that sends ``hello``, wait for both ends to close.

    Args:
        server_params: The ``mtls:`` parameters besides port and interface.
        client_endpoint: Makes the client endpoint for the port listened on.
        interface: The interface to listen on, endpoint-string escaped.

    Returns:
        The server protocol, once both sides have seen the connection lost.
    """
    reactor = _reactor()
    factory = _ServerFactory()
    endpoint = serverFromString(reactor, f"mtls:0:interface={interface}:{server_params}")
    port = await endpoint.listen(factory)
    try:
        client = _ClientProtocol()
        await connectProtocol(client_endpoint(port.getHost().port), client)
        server = await factory.built
        await client.lost
        await server.lost
    finally:
        await port.stopListening()
    return server


def _client(
    pki: Pki,
    certified: CertifiedKey | None,
    maximum: Any = None,
    tcp: type[TCP4ClientEndpoint] | type[TCP6ClientEndpoint] = TCP4ClientEndpoint,
    host: str = "127.0.0.1",
) -> Callable[[int], IStreamClientEndpoint]:
    """A Twisted TLS client trusting the test CA, with an optional client certificate.

    Args:
        pki: The test PKI.
        certified: The client certificate and key to present, or None.
        maximum: The highest TLS version the client speaks, or None for any.
        tcp: The TCP client endpoint class to wrap.
        host: The address to connect to.

    Returns:
        A function from port to client endpoint.
    """
    client_certificate = None
    if certified is not None:
        client_certificate = PrivateCertificate.loadPEM(
            certified.certificate_pem() + certified.key_pem()
        )
    options = optionsForClientTLS(
        "localhost",
        trustRoot=Certificate.loadPEM(pki.ca.certificate_pem()),
        clientCertificate=client_certificate,
        extraCertificateOptions=None if maximum is None else {"lowerMaximumSecurityTo": maximum},
    )
    return lambda port: wrapClientTLS(options, tcp(_reactor(), host, port))


def _verified(pki: Pki, verify: str = "required") -> str:
    """``mtls:`` parameters: the test server, verifying clients against the test CA."""
    return f"{_server_params(pki)}:caCerts={pki.ca_cert}:verify={verify}"


@pytest_twisted.ensureDeferred
async def test_client_certificate_gives_identities(pki: Pki) -> None:
    """A client with a certificate from caCerts gets in; its CN and SANs are its identities.

    The client is built from a ``tls:`` client endpoint string, as upstreams are.
    """

    def client(port: int) -> IStreamClientEndpoint:
        return clientFromString(
            _reactor(),
            f"tls:localhost:{port}:endpoint=tcp\\:127.0.0.1\\:{port}"
            f":trustRoots={pki.trust_dir}"
            f":certificate={pki.alice_cert}:privateKey={pki.alice_key}",
        )

    server = await _exchange(_verified(pki), client)
    assert server.received == b"hello"
    assert server.identities == ALICE_IDENTITIES


@pytest.mark.parametrize("verify", ["required", "optional"])
@pytest_twisted.ensureDeferred
async def test_wrong_ca_is_refused(pki: Pki, verify: str) -> None:
    """A certificate from another CA fails the handshake, even when certificates are optional."""
    server = await _exchange(_verified(pki, verify), _client(pki, pki.mallory))
    assert server.received == b""
    assert server.identities is None


@pytest_twisted.ensureDeferred
async def test_no_certificate_is_refused_when_required(pki: Pki) -> None:
    """With ``verify=required`` a client without a certificate fails the handshake."""
    server = await _exchange(_verified(pki, "required"), _client(pki, None))
    assert server.received == b""
    assert server.identities is None


@pytest_twisted.ensureDeferred
async def test_no_certificate_is_accepted_when_optional(pki: Pki) -> None:
    """With ``verify=optional`` a client without a certificate gets in, with no identities."""
    server = await _exchange(_verified(pki, "optional"), _client(pki, None))
    assert server.received == b"hello"
    assert server.identities == frozenset()


@pytest_twisted.ensureDeferred
async def test_certificate_is_not_asked_for_without_ca(pki: Pki) -> None:
    """Without caCerts no certificate is asked for, so none is seen."""
    server = await _exchange(_server_params(pki), _client(pki, pki.alice))
    assert server.received == b"hello"
    assert server.identities == frozenset()


@pytest.mark.parametrize(
    ("minimum", "accepted"), [pytest.param("1.2", True), pytest.param("1.3", False)]
)
@pytest_twisted.ensureDeferred
async def test_tls_1_2_client(pki: Pki, minimum: str, accepted: bool) -> None:
    """A client that speaks at most TLS 1.2 gets in with ``minimumTLS=1.2`` only."""
    server = await _exchange(
        f"{_verified(pki)}:minimumTLS={minimum}",
        _client(pki, pki.alice, maximum=TLSVersion.TLSv1_2),
    )
    if accepted:
        assert server.received == b"hello"
        assert server.version == "TLSv1.2"
        assert server.identities == ALICE_IDENTITIES
    else:
        assert server.received == b""
        assert server.identities is None


@pytest_twisted.ensureDeferred
async def test_tls_1_3_by_default(pki: Pki) -> None:
    """A client that can speak TLS 1.3 does so, also with ``minimumTLS=1.3``."""
    server = await _exchange(f"{_verified(pki)}:minimumTLS=1.3", _client(pki, pki.alice))
    assert server.version == "TLSv1.3"
    assert server.identities == ALICE_IDENTITIES


def _ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest_twisted.ensureDeferred
async def test_ipv6_interface(pki: Pki) -> None:
    """An IPv6 interface listens on IPv6 and still verifies clients."""
    server = await _exchange(
        _verified(pki),
        _client(pki, pki.alice, tcp=TCP6ClientEndpoint, host="::1"),
        interface="\\:\\:1",
    )
    assert server.identities == ALICE_IDENTITIES


def test_write_pem_round_trip(tmp_path: Path, pki: Pki) -> None:
    """`write_pem` writes files that load back to the same certificate and key."""
    certificate_path, key_path = write_pem(tmp_path, "again", pki.alice)
    assert x509.load_pem_x509_certificate(certificate_path.read_bytes()) == pki.alice.certificate
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == pki.alice.key.public_key()


def test_client_endpoint_at_keeps_everything_but_the_address() -> None:
    """A tls: or tcp: description aimed elsewhere keeps its other parameters, escapes intact."""
    moved = client_endpoint_at(
        r"tls:rabbit.example:5551:trustRoots=/etc/ca\:dir:timeout=5", "node-2.example", 5552
    )
    assert moved == r"tls:host=node-2.example:port=5552:trustRoots=/etc/ca\:dir:timeout=5"
    assert client_endpoint_at("tcp:host=10.0.0.1:port=5552", "::1", 6000) == (
        r"tcp:host=\:\:1:port=6000"
    )
    with pytest.raises(ValueError, match="unix"):
        client_endpoint_at("unix:/run/rabbit.sock", "a", 1)


@pytest.mark.parametrize(
    ("description", "mode"),
    [
        ("mtls:0:certKey=a.pem:caCerts=ca.pem", "required"),
        ("mtls:0:certKey=a.pem:caCerts=ca.pem:verify=optional", "optional"),
        ("mtls:0:certKey=a.pem", "none"),
        ("mtls:0:certKey=C\\:/a.pem:caCerts=C\\:/ca.pem", "required"),  # escaped colons
        ("mtls:0:certKey=a.pem:verify=optional", None),  # does not parse: no caCerts
        ("mtls:0:certkey=a.pem", None),  # unknown parameter
        ("tcp:0", None),
        ("ssl:0:certKey=a.pem", None),
    ],
)
def test_mtls_verify_mode(description: str, mode: str | None) -> None:
    """What an endpoint string asks of clients, read with the endpoint's own parameter rules."""
    assert mtls_verify_mode(description) == mode
