"""Test certificates: a throw-away PKI generated with `cryptography`.

Unit tests of `gateway.tls` and end-to-end tests of TLS listeners share these
helpers. Keys are EC P-256 (fast to generate); every certificate is valid from
a day ago to 30 days ahead, so clock skew between the test and OpenSSL does
not matter. Nothing here touches the network.

`make_pki` writes the usual set of files into a directory; `make_ca`,
`issue_server_certificate`, `issue_client_certificate` and `write_pem` build
anything else a test needs.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "ALICE_IDENTITIES",
    "CertifiedKey",
    "Pki",
    "issue_client_certificate",
    "issue_server_certificate",
    "make_ca",
    "make_pki",
    "mtls_endpoint",
    "write_pem",
]

VALID_BEFORE_NOW: Final = datetime.timedelta(days=1)
VALID_AFTER_NOW: Final = datetime.timedelta(days=30)

ALICE_IDENTITIES: Final = frozenset(
    {"alice", "alice.example.org", "alice@example.org", "urn:msggateway:alice"}
)
"""The names `peer_identities` reads from the client certificate ``alice`` of `make_pki`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CertifiedKey:
    """A certificate and its private key.

    Attributes:
        certificate: The certificate.
        key: Its private key.
    """

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def certificate_pem(self) -> bytes:
        """Return the certificate in PEM form."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """Return the private key, unencrypted, in PKCS#8 PEM form."""
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Pki:
    """The files `make_pki` wrote, and the objects behind them.

    Attributes:
        directory: The directory holding every file below.
        ca: The CA that signs the server's and alice's certificates.
        ca_cert: ``ca.pem``, the CA certificate.
        trust_dir: ``trust/``, a directory holding only a copy of ``ca.pem``
            (Twisted's ``tls:`` client endpoint wants a directory for
            ``trustRoots``).
        server: The server's certificate (CN ``localhost``, SAN DNS
            ``localhost`` and IP ``127.0.0.1``).
        server_cert: ``server.pem``.
        server_key: ``server.key``.
        alice: A client certificate signed by ``ca`` (CN ``alice`` plus the
            SANs in `ALICE_IDENTITIES`).
        alice_cert: ``alice.pem``.
        alice_key: ``alice.key``.
        wrong_ca: A second CA, unrelated to ``ca``.
        wrong_ca_cert: ``wrong-ca.pem``.
        mallory: A client certificate (CN ``mallory``) signed by ``wrong_ca``.
        mallory_cert: ``mallory.pem``.
        mallory_key: ``mallory.key``.
    """

    directory: Path
    ca: CertifiedKey
    ca_cert: Path
    trust_dir: Path
    server: CertifiedKey
    server_cert: Path
    server_key: Path
    alice: CertifiedKey
    alice_cert: Path
    alice_key: Path
    wrong_ca: CertifiedKey
    wrong_ca_cert: Path
    mallory: CertifiedKey
    mallory_cert: Path
    mallory_key: Path


def make_ca(common_name: str) -> CertifiedKey:
    """Create a self-signed certificate authority.

    Args:
        common_name: The CA's subject Common Name.

    Returns:
        The CA certificate (basic constraints ``CA:TRUE``, may sign
        certificates) and its key.
    """
    key = _new_key()
    name = _name(common_name)
    certificate = (
        _builder(name, name, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertifiedKey(certificate=certificate, key=key)


def issue_server_certificate(
    ca: CertifiedKey, common_name: str = "localhost", dns_names: Iterable[str] = ("localhost",)
) -> CertifiedKey:
    """Issue a TLS server certificate, by default for the loopback host.

    Args:
        ca: The CA that signs it.
        common_name: The subject Common Name.
        dns_names: Its SAN DNS names; with ``localhost`` it also names IP
            ``127.0.0.1`` (another list makes a wrong-hostname certificate).

    Returns:
        A certificate with those SANs and extended key usage ``serverAuth``,
        and its key.
    """
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    if "localhost" in dns_names:
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    return _issue(ca, common_name, names, ExtendedKeyUsageOID.SERVER_AUTH)


def issue_client_certificate(
    ca: CertifiedKey,
    common_name: str | None,
    *,
    dns_names: Iterable[str] = (),
    emails: Iterable[str] = (),
    uris: Iterable[str] = (),
    ip_addresses: Iterable[str] = (),
    validity: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> CertifiedKey:
    """Issue a TLS client certificate.

    Args:
        ca: The CA that signs it.
        common_name: The subject Common Name, or None for an empty subject.
        dns_names: Subject Alternative Names of type DNS.
        emails: Subject Alternative Names of type RFC 822 (e-mail).
        uris: Subject Alternative Names of type URI.
        ip_addresses: Subject Alternative Names of type IP address (text form).
        validity: Not before and not after (default: from an hour ago for a year);
            for expired and not-yet-valid certificates.

    Returns:
        A certificate with extended key usage ``clientAuth``, and its key.
        Without any alternative name it has no SAN extension at all.
    """
    names: list[x509.GeneralName] = [
        *(x509.DNSName(name) for name in dns_names),
        *(x509.RFC822Name(email) for email in emails),
        *(x509.UniformResourceIdentifier(uri) for uri in uris),
        *(x509.IPAddress(ipaddress.ip_address(address)) for address in ip_addresses),
    ]
    return _issue(ca, common_name, names, ExtendedKeyUsageOID.CLIENT_AUTH, validity)


def write_pem(directory: Path, name: str, certified: CertifiedKey) -> tuple[Path, Path]:
    """Write a certificate and its key as ``NAME.pem`` and ``NAME.key``.

    Args:
        directory: Where to write them (must exist).
        name: The file name without its suffix.
        certified: What to write.

    Returns:
        The paths of the certificate file and of the key file.
    """
    certificate_path = directory / f"{name}.pem"
    key_path = directory / f"{name}.key"
    certificate_path.write_bytes(certified.certificate_pem())
    key_path.write_bytes(certified.key_pem())
    return certificate_path, key_path


def make_pki(directory: Path) -> Pki:
    """Generate a CA, a server, a good and a bad client, and write their files.

    Args:
        directory: An existing, preferably empty, directory (``tmp_path``).

    Returns:
        What was written where; see `Pki`.
    """
    ca = make_ca("msggateway test CA")
    server = issue_server_certificate(ca)
    alice = issue_client_certificate(
        ca,
        "alice",
        dns_names=["alice.example.org"],
        emails=["alice@example.org"],
        uris=["urn:msggateway:alice"],
    )
    wrong_ca = make_ca("unrelated CA")
    mallory = issue_client_certificate(wrong_ca, "mallory")

    ca_cert, _ = write_pem(directory, "ca", ca)
    trust_dir = directory / "trust"
    trust_dir.mkdir()
    (trust_dir / "ca.pem").write_bytes(ca.certificate_pem())
    server_cert, server_key = write_pem(directory, "server", server)
    alice_cert, alice_key = write_pem(directory, "alice", alice)
    wrong_ca_cert, _ = write_pem(directory, "wrong-ca", wrong_ca)
    mallory_cert, mallory_key = write_pem(directory, "mallory", mallory)
    return Pki(
        directory=directory,
        ca=ca,
        ca_cert=ca_cert,
        trust_dir=trust_dir,
        server=server,
        server_cert=server_cert,
        server_key=server_key,
        alice=alice,
        alice_cert=alice_cert,
        alice_key=alice_key,
        wrong_ca=wrong_ca,
        wrong_ca_cert=wrong_ca_cert,
        mallory=mallory,
        mallory_cert=mallory_cert,
        mallory_key=mallory_key,
    )


def mtls_endpoint(pki: Pki, verify: str | None = None) -> str:
    """An ``mtls:`` server endpoint on a free loopback port with the test PKI's server.

    Client certificates must come from the test CA; ``verify`` (``required``,
    ``optional``) is added when given, else the endpoint's default applies
    (``required`` with ``caCerts``).
    """
    endpoint = (
        f"mtls:0:interface=127.0.0.1:certKey={pki.server_cert}:privateKey={pki.server_key}"
        f":caCerts={pki.ca_cert}"
    )
    return endpoint if verify is None else f"{endpoint}:verify={verify}"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str | None) -> x509.Name:
    if common_name is None:
        return x509.Name([])
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    validity: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    start, end = validity or (now - VALID_BEFORE_NOW, now + VALID_AFTER_NOW)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )


def _issue(
    ca: CertifiedKey,
    common_name: str | None,
    alternative_names: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    validity: tuple[datetime.datetime, datetime.datetime] | None = None,
) -> CertifiedKey:
    key = _new_key()
    builder = (
        _builder(_name(common_name), ca.certificate.subject, key, validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if alternative_names:
        # RFC 5280, 4.2.1.6: with an empty subject the SAN extension is critical.
        builder = builder.add_extension(
            x509.SubjectAlternativeName(alternative_names), critical=common_name is None
        )
    return CertifiedKey(certificate=builder.sign(ca.key, hashes.SHA256()), key=key)
