r"""TLS listeners with client-certificate verification, and certificate identities.

Twisted's ``ssl:`` server endpoint cannot verify client certificates, and
Twisted already owns ``tls:``; every TLS listener of the gateway is therefore
an ``mtls:`` endpoint string, parsed here (the plugin that makes
`twisted.internet.endpoints.serverFromString` find it is
``twisted/plugins/msggateway_endpoints.py``)::

    mtls:8788:interface=0.0.0.0:certKey=/etc/gw/server.pem:privateKey=/etc/gw/server.key
        :caCerts=/etc/gw/clients-ca.pem:verify=required

(one line in practice). Parameters, all optional except the port and a
certificate with its key:

``port`` (or the first positional parameter)
    TCP port, ``0`` to ``65535``; ``0`` picks a free one.
``interface``
    The IP address to listen on; default ``127.0.0.1``. This deliberately
    differs from ``ssl:`` and ``tcp:`` (all interfaces): a listener that other
    hosts can reach is something an operator writes down, as ``0.0.0.0`` (all
    IPv4 interfaces) or ``\:\:`` (all interfaces; colons are escaped in
    endpoint strings).
``backlog``
    Listen queue length; default ``50``.
``certKey``
    PEM file with the server certificate first, optionally followed by its
    intermediate certificates and, without ``privateKey``, by its key.
``privateKey``
    PEM file with the unencrypted private key; default: read from
    ``certKey``. As with ``ssl:``, ``privateKey`` alone means that file holds
    both certificate and key.
``extraCertChain``
    PEM file with intermediate certificates to send after the server's own.
``caCerts``
    PEM file with one or more CA certificates, or a directory whose ``*.pem``
    files hold them: the CAs that sign acceptable client certificates.
``verify``
    ``required`` (a client must present a certificate signed by one of
    ``caCerts``), ``optional`` (a client may present none, but one it
    presents must be valid) or ``none`` (none is asked for). Default:
    ``required`` with ``caCerts``, else ``none``. ``required`` and
    ``optional`` need ``caCerts``; ``none`` refuses it, as it would be
    silently ignored.
``minimumTLS``
    ``1.2`` (default) or ``1.3``. Older versions are insecure and refused.
``ciphers``
    An OpenSSL cipher string for TLS 1.2; default: Twisted's safe defaults.
    TLS 1.3 suites are OpenSSL's (all of them AEAD) and not affected.

Every file is read and checked when the string is parsed, so configuration
checks (``msggateway check-config``) report a bad one before anything
listens; every problem is a `ValueError` naming the parameter, the file and
what is wrong (all problems of one string at once, separated by ``; ``).

`peer_identities` reads the names a verified client certificate vouches for,
of the name types a listener takes as identities (its ``cert_identity``):
by default the subject's Common Name only; Subject Alternative Names of
type DNS, e-mail, URI or IP address only where the listener says so, since
a CA that vouches for a host name or a mailbox does not thereby vouch for a
login name.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import ipaddress
import os
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Final, ParamSpec, TypeVar

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import NameOID
from OpenSSL import SSL, crypto
from twisted.internet.endpoints import SSL4ServerEndpoint
from twisted.internet.interfaces import (
    IAcceptableCiphers,
    IOpenSSLClientConnectionCreator,
    IOpenSSLContextFactory,
    IReactorCore,
    IReactorSSL,
    ISSLTransport,
    IStreamServerEndpoint,
    IStreamServerEndpointStringParser,
)
from twisted.internet.ssl import AcceptableCiphers, CertificateOptions, TLSVersion
from twisted.plugin import IPlugin
from zope.interface import implementer

__all__ = [
    "CERT_NAME_TYPES",
    "DEFAULT_BACKLOG",
    "DEFAULT_CERT_IDENTITY",
    "DEFAULT_INTERFACE",
    "DEFAULT_MINIMUM_TLS",
    "MINIMUM_TLS_VERSIONS",
    "VERIFY_MODES",
    "MTLSServerParser",
    "ReloadableServerTLS",
    "client_endpoint_at",
    "external_identity",
    "mtls_verify_mode",
    "parse_mtls_server",
    "peer_identities",
    "relay_client_tls",
    "server_tls_options",
    "split_endpoint_string",
    "tls_failure_reason",
]

VERIFY_MODES: Final = ("required", "optional", "none")
"""The values of ``verify``."""

MINIMUM_TLS_VERSIONS: Final[Mapping[str, object]] = {
    "1.2": TLSVersion.TLSv1_2,
    "1.3": TLSVersion.TLSv1_3,
}
"""The values of ``minimumTLS`` and the Twisted `TLSVersion` each stands for."""

CERT_NAME_TYPES: Final = ("cn", "dns", "email", "uri", "ip")
"""The certificate name types a listener may take as identities (``cert_identity``): the
subject's Common Name, and Subject Alternative Names of type DNS, e-mail (RFC 822), URI and IP
address (in text form)."""
DEFAULT_CERT_IDENTITY: Final = ("cn",)
"""The name types a listener takes as identities unless its config says otherwise."""

DEFAULT_MINIMUM_TLS: Final = "1.2"
DEFAULT_INTERFACE: Final = "127.0.0.1"
DEFAULT_BACKLOG: Final = 50

_INSECURE_TLS_VERSIONS: Final = frozenset({"1.0", "1.1"})
_MAX_PORT: Final = 65535
_PEM_CERTIFICATE: Final = b"-----BEGIN CERTIFICATE-----"
_PEM_PRIVATE_KEY: Final = b"PRIVATE KEY-----"
# Endpoint-string parameter (Twisted's ``ssl:`` spelling) -> keyword of
# `parse_mtls_server`.
_PARAMETERS: Final[Mapping[str, str]] = {
    "port": "port",
    "interface": "interface",
    "backlog": "backlog",
    "certKey": "cert_key",
    "privateKey": "private_key",
    "extraCertChain": "extra_cert_chain",
    "caCerts": "ca_certs",
    "verify": "verify",
    "minimumTLS": "minimum_tls",
    "ciphers": "ciphers",
}

_PathArg = str | os.PathLike[str]
_P = ParamSpec("_P")
_T = TypeVar("_T")
# The private keys pyOpenSSL can hand to OpenSSL for a server certificate.
_PrivateKey = (
    rsa.RSAPrivateKey
    | ec.EllipticCurvePrivateKey
    | ed25519.Ed25519PrivateKey
    | ed448.Ed448PrivateKey
    | dsa.DSAPrivateKey
)


# --- the endpoint -------------------------------------------------------------------------


@implementer(IPlugin, IStreamServerEndpointStringParser)
class MTLSServerParser:
    """The ``mtls:`` server endpoint string parser.

    Twisted discovers the lazy twin of this class in
    ``twisted/plugins/msggateway_endpoints.py``; this one can be used directly.
    """

    prefix = "mtls"

    def parseStreamServer(
        self, reactor: IReactorCore, *args: object, **kwargs: object
    ) -> IStreamServerEndpoint:
        """Build the endpoint an ``mtls:`` string describes.

        Args:
            reactor: The reactor the endpoint listens with; it must provide
                `IReactorSSL`, as every reactor with TLS support does.
            *args: Positional parameters: at most one, the port.
            **kwargs: Named parameters, spelled as in the module docstring.

        Returns:
            An SSL server endpoint; nothing listens until it is used.

        Raises:
            ValueError: A parameter is unknown, repeated or wrong.
        """
        port, options = _endpoint_arguments(args, kwargs)
        return parse_mtls_server(IReactorSSL(reactor), port, **options)


def parse_mtls_server(
    reactor: IReactorSSL,
    port: str | int | None = None,
    *,
    interface: str = DEFAULT_INTERFACE,
    backlog: str | int = DEFAULT_BACKLOG,
    cert_key: _PathArg | None = None,
    private_key: _PathArg | None = None,
    extra_cert_chain: _PathArg | None = None,
    ca_certs: _PathArg | None = None,
    verify: str | None = None,
    minimum_tls: str = DEFAULT_MINIMUM_TLS,
    ciphers: str | None = None,
) -> IStreamServerEndpoint:
    """Build a TLS server endpoint from ``mtls:`` parameters.

    Each keyword is the snake_case twin of the endpoint-string parameter
    described in the module docstring (``cert_key`` is ``certKey``); error
    messages use the endpoint-string names, which are what operators write.

    Args:
        reactor: The reactor the endpoint listens with.
        port: TCP port (``0`` for any free one).
        interface: IP address to listen on.
        backlog: Listen queue length.
        cert_key: See ``certKey``.
        private_key: See ``privateKey``.
        extra_cert_chain: See ``extraCertChain``.
        ca_certs: See ``caCerts``.
        verify: See ``verify``.
        minimum_tls: See ``minimumTLS``.
        ciphers: See ``ciphers``.

    Returns:
        An `SSL4ServerEndpoint` (IPv6 too: Twisted picks the address family
        from the interface); nothing listens until it is used.

    Raises:
        ValueError: Every problem found, each naming its parameter.
    """
    problems: list[str] = []
    port_number = _attempt(problems, _port, port)
    backlog_size = _attempt(problems, _positive_int, "backlog", backlog)
    address = _attempt(problems, _interface, interface)
    load = functools.partial(
        server_tls_options,
        cert_key=cert_key,
        private_key=private_key,
        extra_cert_chain=extra_cert_chain,
        ca_certs=ca_certs,
        verify=verify,
        minimum_tls=minimum_tls,
        ciphers=ciphers,
    )
    options = _attempt(problems, load)
    _raise_problems(problems)
    assert port_number is not None
    assert backlog_size is not None
    assert address is not None
    assert options is not None
    material = ReloadableServerTLS(options, load, f"mtls:{port_number} ({cert_key or private_key})")
    return SSL4ServerEndpoint(
        reactor,
        port_number,
        material,
        backlog=backlog_size,
        interface=address,
    )


@implementer(IOpenSSLContextFactory)
class ReloadableServerTLS:
    """A listener's TLS material, which SIGHUP can replace (`reload_server_tls`).

    Twisted asks it for an OpenSSL context for every connection it accepts,
    so a connection made after a reload gets the new certificate, key and
    client CAs, while established connections keep the context they were
    made with: nothing is dropped. A reload that fails (a missing file, a
    key that does not match) keeps the old material.

    Args:
        options: The material in effect.
        load: Reads the files again (`server_tls_options` with the listener's arguments).
        where: How logs name the listener (its endpoint kind and port).
    """

    def __init__(
        self, options: CertificateOptions, load: Callable[[], CertificateOptions], where: str
    ) -> None:
        self.options = options
        self._load = load
        self.where = where
        _RELOADABLE.add(self)

    def getContext(self) -> SSL.Context:  # noqa: N802 (Twisted's name)
        """The OpenSSL context for a new connection: the current material's."""
        return self.options.getContext()

    def __getattr__(self, name: str) -> object:
        """Everything else is the current material's (its verify mode, CAs, ...)."""
        return getattr(self.options, name)

    def reload(self) -> None:
        """Read the files again and use them for new connections.

        Raises:
            ValueError: Every problem found; the old material stays.
        """
        self.options = self._load()


_RELOADABLE: Final[weakref.WeakSet[ReloadableServerTLS]] = weakref.WeakSet()


def reload_server_tls() -> list[tuple[str, str | None]]:
    """Reload the material of every ``mtls:`` listener; ``(listener, problem or None)``."""
    results: list[tuple[str, str | None]] = []
    for material in list(_RELOADABLE):
        try:
            material.reload()
        except ValueError as exc:
            results.append((material.where, str(exc)))
        else:
            results.append((material.where, None))
    return results


def server_tls_options(
    *,
    cert_key: _PathArg | None = None,
    private_key: _PathArg | None = None,
    extra_cert_chain: _PathArg | None = None,
    ca_certs: _PathArg | None = None,
    verify: str | None = None,
    minimum_tls: str = DEFAULT_MINIMUM_TLS,
    ciphers: str | None = None,
) -> CertificateOptions:
    """Read and check the TLS files and settings of a server.

    Args:
        cert_key: See ``certKey`` in the module docstring.
        private_key: See ``privateKey``.
        extra_cert_chain: See ``extraCertChain``.
        ca_certs: See ``caCerts``.
        verify: See ``verify``.
        minimum_tls: See ``minimumTLS``.
        ciphers: See ``ciphers``.

    Returns:
        Twisted server TLS options with the certificate, its chain, the
        client CAs and the verification mode.

    Raises:
        ValueError: Every problem found, each naming its parameter.
    """
    problems: list[str] = []
    mode = _attempt(problems, _verify_mode, verify, ca_certs)
    version = _attempt(problems, _minimum_tls, minimum_tls)
    acceptable = _attempt(problems, _acceptable_ciphers, ciphers)
    identity = _attempt(problems, _server_identity, cert_key, private_key)
    extra: list[x509.Certificate] | None = []
    if extra_cert_chain is not None:
        extra = _attempt(problems, _load_certificates, "extraCertChain", extra_cert_chain)
    client_cas: list[x509.Certificate] | None = []
    if ca_certs is not None and mode != "none":
        client_cas = _attempt(problems, _load_ca_certificates, ca_certs)
    _raise_problems(problems)
    assert identity is not None
    assert extra is not None
    assert client_cas is not None
    key, chain = identity
    chain = chain + extra
    try:
        options = CertificateOptions(
            privateKey=crypto.PKey.from_cryptography_key(key),
            certificate=crypto.X509.from_cryptography(chain[0]),
            extraCertChain=[crypto.X509.from_cryptography(c) for c in chain[1:]] or None,
            verify=mode != "none",
            caCerts=[crypto.X509.from_cryptography(c) for c in client_cas] or None,
            requireCertificate=mode == "required",
            raiseMinimumTo=version,
            acceptableCiphers=acceptable,
        )
        # Build the OpenSSL context now rather than at the first connection,
        # so that what OpenSSL alone refuses is reported here too.
        options.getContext()
    except (ValueError, SSL.Error) as exc:
        # Everything else was checked above: it is the cipher list that
        # leaves nothing usable (only TLS 1.3 suites, say, which OpenSSL
        # configures apart).
        raise ValueError(
            f"ciphers: {ciphers!r} leaves no usable cipher for the TLS versions allowed"
        ) from exc
    return options


def _endpoint_arguments(
    args: tuple[object, ...], kwargs: Mapping[str, object]
) -> tuple[str | None, dict[str, str]]:
    """Map endpoint-string parameters to `parse_mtls_server` arguments."""
    problems: list[str] = []
    options: dict[str, str] = {}
    unknown: list[str] = []
    for name, value in kwargs.items():
        keyword = _PARAMETERS.get(name)
        if keyword is None:
            close = difflib.get_close_matches(name, list(_PARAMETERS), n=1, cutoff=0.6)
            unknown.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        else:
            options[keyword] = _text(value)
    if unknown:
        problems.append(
            f"unknown parameter {', '.join(unknown)}; known: {', '.join(sorted(_PARAMETERS))}"
        )
    if len(args) > 1:
        problems.append(
            "at most one positional parameter (the port) is allowed, got "
            f"{len(args)}: {', '.join(repr(_text(arg)) for arg in args)}"
        )
    if args and "port" in options:
        problems.append("port: given twice (positional and port=)")
    port = options.pop("port", None)
    if args:
        port = _text(args[0])
    _raise_problems(problems)
    return port, options


def _raise_problems(problems: list[str]) -> None:
    """Raise one `ValueError` listing every problem (each once), if there are any."""
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))


def _text(value: object) -> str:
    # serverFromString hands over bytes when it was given a bytes description.
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _attempt(
    problems: list[str], check: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> _T | None:
    """Run ``check``; on `ValueError` note its message and return None."""
    try:
        return check(*args, **kwargs)
    except ValueError as exc:
        problems.append(str(exc))
        return None


# --- plain parameters ---------------------------------------------------------------------


def _port(port: str | int | None) -> int:
    if port is None or port == "":
        raise ValueError("port: missing (mtls:PORT:... or port=PORT; 0 picks a free port)")
    number = _integer("port", port)
    if not 0 <= number <= _MAX_PORT:
        raise ValueError(f"port: {number} is not between 0 and {_MAX_PORT}")
    return number


def _positive_int(name: str, value: str | int) -> int:
    number = _integer(name, value)
    if number < 1:
        raise ValueError(f"{name}: {number} is not a positive number")
    return number


def _integer(name: str, value: str | int) -> int:
    if isinstance(value, int):
        return value
    text = value.strip()
    if not text.isdecimal():
        raise ValueError(f"{name}: {value!r} is not a whole number")
    return int(text)


def _interface(interface: str) -> str:
    try:
        return str(ipaddress.ip_address(interface))
    except ValueError:
        raise ValueError(
            f"interface: {interface!r} is not an IP address (0.0.0.0 is every IPv4 "
            "interface, \\:\\: every interface, 127.0.0.1 loopback only)"
        ) from None


def _verify_mode(verify: str | None, ca_certs: _PathArg | None) -> str:
    if verify is None:
        return "none" if ca_certs is None else "required"
    mode = verify.strip().lower()
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify: {verify!r} is not one of {', '.join(VERIFY_MODES)}")
    if mode != "none" and ca_certs is None:
        raise ValueError(
            f"verify: {mode} needs caCerts (the CA certificates that sign client certificates)"
        )
    if mode == "none" and ca_certs is not None:
        raise ValueError(
            "verify: none would ignore caCerts; use verify=required or verify=optional, "
            "or drop caCerts"
        )
    return mode


def _minimum_tls(minimum_tls: str) -> object:
    text = minimum_tls.strip()
    version = MINIMUM_TLS_VERSIONS.get(text)
    if version is not None:
        return version
    choices = " or ".join(MINIMUM_TLS_VERSIONS)
    if text in _INSECURE_TLS_VERSIONS:
        raise ValueError(f"minimumTLS: TLS {text} is insecure and not supported; use {choices}")
    raise ValueError(f"minimumTLS: {minimum_tls!r} is not {choices}")


def _acceptable_ciphers(ciphers: str | None) -> IAcceptableCiphers | None:
    if ciphers is None:
        return None
    try:
        # What Twisted does too, but Twisted turns "matches nothing" into an
        # empty list that only fails later, without naming the parameter.
        SSL.Context(SSL.TLS_METHOD).set_cipher_list(ciphers.encode("ascii"))
    except UnicodeEncodeError:
        raise ValueError(f"ciphers: {ciphers!r} is not ASCII") from None
    except SSL.Error:
        raise ValueError(
            f"ciphers: {ciphers!r} matches no TLS 1.2 cipher this OpenSSL supports"
        ) from None
    acceptable: IAcceptableCiphers = AcceptableCiphers.fromOpenSSLCipherString(ciphers)
    return acceptable


# --- files --------------------------------------------------------------------------------


def _server_identity(
    cert_key: _PathArg | None, private_key: _PathArg | None
) -> tuple[_PrivateKey, list[x509.Certificate]]:
    """Load the server key and its certificate chain, leaf first."""
    if cert_key is None and private_key is None:
        raise ValueError(
            "certKey: missing (the server certificate, PEM; its key goes in privateKey "
            "or in the same file)"
        )
    certificate_path = cert_key if cert_key is not None else private_key
    key_path = private_key if private_key is not None else cert_key
    assert certificate_path is not None
    assert key_path is not None
    certificate_param = "certKey" if cert_key is not None else "privateKey"
    key_param = "privateKey" if private_key is not None else "certKey"
    problems: list[str] = []
    chain = _attempt(problems, _load_certificates, certificate_param, certificate_path)
    key = _attempt(problems, _load_private_key, key_param, key_path)
    _raise_problems(problems)
    assert chain is not None
    assert key is not None
    if _public_der(chain[0].public_key()) != _public_der(key.public_key()):
        raise ValueError(
            f"{key_param}: {os.fspath(key_path)}: this key does not belong to the certificate "
            f"in {certificate_param} {os.fspath(certificate_path)} (their public keys differ)"
        )
    return key, chain


def _public_der(public_key: CertificatePublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _read(param: str, path: _PathArg) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{param}: {os.fspath(path)}: cannot read: {exc.strerror or exc}") from exc


def _load_certificates(param: str, path: _PathArg) -> list[x509.Certificate]:
    """Load every certificate of a PEM file, in file order."""
    data = _read(param, path)
    if _PEM_CERTIFICATE not in data:
        raise ValueError(
            f"{param}: {os.fspath(path)}: holds no PEM certificate "
            f"(no {_PEM_CERTIFICATE.decode()} line)"
        )
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ValueError(f"{param}: {os.fspath(path)}: bad PEM certificate ({exc})") from exc


def _load_ca_certificates(path: _PathArg) -> list[x509.Certificate]:
    """Load the CA certificates of a PEM file or of a directory's ``*.pem`` files."""
    directory = Path(path)
    if not directory.is_dir():
        return _load_certificates("caCerts", path)
    files = sorted(
        child for child in directory.iterdir() if child.suffix.lower() == ".pem" and child.is_file()
    )
    if not files:
        raise ValueError(f"caCerts: {os.fspath(path)}: directory holds no *.pem file")
    certificates: list[x509.Certificate] = []
    for file in files:
        certificates.extend(_load_certificates("caCerts", file))
    # The same CA in two files is harmless; hand OpenSSL each once.
    return list(dict.fromkeys(certificates))


def _load_private_key(param: str, path: _PathArg) -> _PrivateKey:
    data = _read(param, path)
    where = f"{param}: {os.fspath(path)}"
    if _PEM_PRIVATE_KEY not in data:
        raise ValueError(
            f"{where}: holds no PEM private key "
            f"(no -----BEGIN ... {_PEM_PRIVATE_KEY.decode()} line)"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:
        raise ValueError(
            f"{where}: the key is encrypted; the gateway needs it unencrypted ({exc})"
        ) from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"{where}: bad PEM private key ({exc})") from exc
    if not isinstance(key, _PrivateKey):
        raise ValueError(f"{where}: unsupported key type {type(key).__name__} for a TLS server")
    return key


# --- a fleet relay's client side -------------------------------------------------------------


@implementer(IOpenSSLClientConnectionCreator)
class _RelayClientTLS:
    """TLS to another node's listener: this node's certificate if asked for, nothing verified.

    The files are read again when they changed (a certificate renewed), for
    the next connection.
    """

    def __init__(self, cert_key: _PathArg | None, private_key: _PathArg | None) -> None:
        self._paths = [Path(path) for path in (cert_key, private_key) if path is not None]
        self._cert_key = cert_key
        self._private_key = private_key
        self._stamp: tuple[int, ...] | None = None
        self._options = self._load()

    def _stamps(self) -> tuple[int, ...]:
        try:
            return tuple(path.stat().st_mtime_ns for path in self._paths)
        except OSError:
            return ()

    def _load(self) -> CertificateOptions:
        stamp = self._stamps()
        if self._paths:
            key, chain = _server_identity(self._cert_key, self._private_key)
            options = CertificateOptions(
                privateKey=crypto.PKey.from_cryptography_key(key),
                certificate=crypto.X509.from_cryptography(chain[0]),
                extraCertChain=[crypto.X509.from_cryptography(c) for c in chain[1:]] or None,
                verify=False,
                raiseMinimumTo=TLSVersion.TLSv1_2,
            )
        else:
            options = CertificateOptions(verify=False, raiseMinimumTo=TLSVersion.TLSv1_2)
        options.getContext()
        self._stamp = stamp
        return options

    def clientConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:  # noqa: N802, N803
        """A client TLS connection (Twisted's name and argument)."""
        if self._paths and self._stamps() != self._stamp:
            # Being replaced, say: the files as they were read last still serve.
            with contextlib.suppress(ValueError):
                self._options = self._load()
        connection = SSL.Connection(self._options.getContext(), None)
        connection.set_app_data(tlsProtocol)
        return connection


def relay_client_tls(description: str) -> IOpenSSLClientConnectionCreator:
    """TLS for a fleet relay to another node's listener like the one ``description`` names.

    Where that ``mtls:`` listener requires client certificates
    (``verify=required``), the relay presents this node's own certificate
    (the endpoint's ``certKey`` and ``privateKey``), which the listener's
    ``caCerts`` must have signed; elsewhere (``verify`` optional or none,
    ``ssl:``) none. The relay verifies nothing of the owner's certificate:
    the fleet's relay login proves both sides to each other, bound to the
    TLS session (`gateway.protocols.stream.fleetlogin`).

    Raises:
        ValueError: The certificate or its key cannot be read.
    """
    fields = split_endpoint_string(description)
    if fields[0] != MTLSServerParser.prefix:
        return _RelayClientTLS(None, None)
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for field in fields[1:]:
        name, equals, value = field.partition("=")
        if equals:
            kwargs[name] = value.replace("\\:", ":")
        else:
            args.append(field)
    _port, options = _endpoint_arguments(tuple(args), kwargs)
    if _verify_mode(options.get("verify"), options.get("ca_certs")) != "required":
        return _RelayClientTLS(None, None)
    return _RelayClientTLS(options.get("cert_key"), options.get("private_key"))


# --- identities ---------------------------------------------------------------------------


def peer_identities(
    transport: object, name_types: Collection[str] = DEFAULT_CERT_IDENTITY
) -> frozenset[str]:
    """Return the names the peer's certificate vouches for, of the types given.

    On an ``mtls:`` listener with ``verify`` ``required`` or ``optional`` a
    certificate is there only if it verified against ``caCerts``; TLS
    verifies it during the handshake, so call this from
    ``handshakeCompleted`` or once data has arrived.

    Args:
        transport: A protocol's transport, TLS or not.
        name_types: Which names count (`CERT_NAME_TYPES`): ``cn`` the
            subject's Common Names, ``dns``, ``email``, ``uri`` and ``ip`` the
            Subject Alternative Names of that type. A listener passes its
            ``cert_identity``; the default is the Common Name only.

    Returns:
        The names, or an empty set for a transport without TLS, without a
        peer certificate (yet), with a certificate nothing can be read
        from, or without a name of those types. Parts of an odd certificate
        that cannot be decoded are skipped; this never raises for a
        certificate.
    """
    peer = _peer_certificate(transport)
    if peer is None:
        return frozenset()
    return _certificate_names(peer, frozenset(name_types))


def external_identity(
    transport: object, requested: str = "", name_types: Collection[str] = DEFAULT_CERT_IDENTITY
) -> str | None:
    """The identity a SASL EXTERNAL login gets from the peer's certificate, if any.

    ``requested`` (the EXTERNAL authorization identity) must be one of the
    names the certificate vouches for (`peer_identities` of ``name_types``);
    when it is empty, the identity is the subject's Common Name (when
    ``cn`` is one of the types), or the one name the certificate holds.

    Returns:
        The identity, or None: no verified certificate, a name it does not
        hold, or several names and no Common Name to choose by.
    """
    names = peer_identities(transport, name_types)
    if not names:
        return None
    if requested:
        return requested if requested in names else None
    if "cn" in name_types:
        peer = _peer_certificate(transport)
        common = _common_names(peer) if peer is not None else []
        if len(common) == 1 and common[0] in names:
            return common[0]
    return next(iter(names)) if len(names) == 1 else None


def _peer_certificate(transport: object) -> x509.Certificate | None:
    tls = ISSLTransport(transport, None)
    if tls is None:
        return None
    peer = tls.getPeerCertificate()
    if isinstance(peer, crypto.X509):
        try:
            peer = peer.to_cryptography()
        except ValueError:
            return None
    return peer if isinstance(peer, x509.Certificate) else None


def _common_names(certificate: x509.Certificate) -> list[str]:
    try:
        attributes = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError:
        return []  # An undecodable subject: the SANs may still be readable.
    return [a.value for a in attributes if isinstance(a.value, str) and a.value]


def _certificate_names(certificate: x509.Certificate, name_types: frozenset[str]) -> frozenset[str]:
    names: set[str] = set()
    if "cn" in name_types:
        names.update(_common_names(certificate))
    if not name_types & _SAN_TYPES:
        return frozenset(names)
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (
        x509.ExtensionNotFound,
        x509.DuplicateExtension,
        x509.UnsupportedGeneralNameType,
        ValueError,
    ):
        san = None
    if san is not None:
        if "dns" in name_types:
            names.update(san.get_values_for_type(x509.DNSName))
        if "email" in name_types:
            names.update(san.get_values_for_type(x509.RFC822Name))
        if "uri" in name_types:
            names.update(san.get_values_for_type(x509.UniformResourceIdentifier))
        if "ip" in name_types:
            names.update(str(address) for address in san.get_values_for_type(x509.IPAddress))
    names.discard("")
    return frozenset(names)


_SAN_TYPES: Final = frozenset(CERT_NAME_TYPES) - {"cn"}


def tls_failure_reason(error: BaseException) -> str:
    """OpenSSL's reasons, as words (``certificate verify failed``), not nested tuples.

    pyOpenSSL's `SSL.Error` holds a list of ``(library, function, reason)``
    tuples; anything else is described by its message or its type.
    """
    reasons = [
        str(detail[2])
        for detail in (error.args[0] if error.args and isinstance(error.args[0], list) else [])
        if isinstance(detail, tuple) and len(detail) == 3
    ]
    return "; ".join(reasons) or str(error) or type(error).__name__


def client_endpoint_at(description: str, host: str, port: int) -> str:
    r"""The same ``tcp:`` or ``tls:`` client endpoint string, aimed at another host and port.

    Every other parameter (a ``tls:`` endpoint's ``trustRoots``,
    ``certificate``, ``privateKey``, a ``timeout``) is kept as written, so a
    connection moved to another node of a cluster is verified the same way,
    against that node's own name.

    Raises:
        ValueError: Not a ``tcp:`` or ``tls:`` description.
    """
    fields = split_endpoint_string(description)
    kind = fields[0]
    if kind not in ("tcp", "tls"):
        raise ValueError(f"cannot move a {kind!r} endpoint to another host")
    kept = [
        field
        for field in fields[1:]
        if "=" in field and field.split("=", 1)[0] not in ("host", "port")
    ]
    escaped = host.replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")
    return ":".join([kind, f"host={escaped}", f"port={port}", *kept])


def mtls_verify_mode(description: str) -> str | None:
    """What an ``mtls:`` endpoint string asks of clients: ``required``, ``optional`` or ``none``.

    None for another kind of endpoint, or one whose parameters do not parse
    (`parse_mtls_server` says why when the endpoint is built).
    """
    fields = split_endpoint_string(description)
    if fields[0] != MTLSServerParser.prefix:
        return None
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for field in fields[1:]:
        name, equals, value = field.partition("=")
        if equals:
            kwargs[name] = value
        else:
            args.append(field)
    try:
        _port, options = _endpoint_arguments(tuple(args), kwargs)
        return _verify_mode(options.get("verify"), options.get("ca_certs"))
    except ValueError:
        return None


def split_endpoint_string(description: str) -> list[str]:
    """Split an endpoint string at the colons a backslash does not escape (kept escaped)."""
    fields: list[str] = []
    start = index = 0
    while index < len(description):
        char = description[index]
        if char == "\\":
            index += 2
            continue
        if char == ":":
            fields.append(description[start:index])
            start = index + 1
        index += 1
    fields.append(description[start:])
    return fields
