"""Endpoint strings and names in the configuration: checked before anything listens."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final

from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.testing import MemoryReactor

from gateway.config.base import NAME, Key, Section
from gateway.tls import split_endpoint_string

__all__ = [
    "MAX_PORT",
    "PORT_ENDPOINT_KINDS",
    "TLS_SERVER_PREFIXES",
    "UNVERIFIED_TLS_CLIENT_PREFIX",
    "check_client_endpoint",
    "check_client_tls",
    "check_name",
    "check_server_endpoint",
    "endpoint_port",
    "endpoint_with_backlog",
    "endpoint_with_port",
    "has_backlog_parameter",
    "with_paths_resolved",
]

TLS_SERVER_PREFIXES: Final = ("mtls:", "ssl:")
"""Server endpoints that terminate TLS."""

UNVERIFIED_TLS_CLIENT_PREFIX: Final = "ssl:"
"""Twisted's ``ssl:`` client endpoint: TLS that checks neither the server's host name nor,
without ``caCertsDir``, its certificate (``tls:`` checks both, with service_identity)."""

_BACKLOG_ENDPOINTS: Final = ("tcp:", "tcp6:", "ssl:", "unix:", "mtls:")
_BACKLOG_PARAMETER: Final = re.compile(r"(?<!\\):backlog=")


def has_backlog_parameter(description: str) -> bool:
    """Whether a server endpoint string sets ``backlog=`` itself."""
    return _BACKLOG_PARAMETER.search(description) is not None


def endpoint_with_backlog(description: str, backlog: int) -> str:
    """A server endpoint string with ``backlog=`` added, unless it has one or takes none."""
    if not description.startswith(_BACKLOG_ENDPOINTS) or has_backlog_parameter(description):
        return description
    return f"{description}:backlog={backlog}"


PORT_ENDPOINT_KINDS: Final = ("tcp", "tcp6", "ssl", "mtls")
"""Server endpoint kinds whose port is the first positional parameter, or ``port=``."""


def _port_field(fields: list[str]) -> int | None:
    """Which of an endpoint string's fields names its port; None: none does."""
    if fields[0] not in PORT_ENDPOINT_KINDS:
        return None
    for index, field in enumerate(fields[1:], start=1):
        name, equals, _ = field.partition("=")
        if not equals or name == "port":
            return index
    return None


def endpoint_port(description: str) -> int | None:
    """The port a ``tcp:``, ``tcp6:``, ``ssl:`` or ``mtls:`` server endpoint string names.

    None for another kind, or a string that names no port as a whole number
    (Twisted's parser, `check_server_endpoint`, says what is wrong with it).
    """
    fields = split_endpoint_string(description)
    index = _port_field(fields)
    if index is None:
        return None
    value = fields[index].rpartition("=")[2]
    return int(value) if value.isdigit() else None


def endpoint_with_port(description: str, port: int) -> str:
    """The same server endpoint string with another port; everything else kept as written.

    Raises:
        ValueError: Not a kind of endpoint with a port (`endpoint_port` is None).
    """
    fields = split_endpoint_string(description)
    index = _port_field(fields)
    if index is None or endpoint_port(description) is None:
        raise ValueError(f"{description!r} names no port to change")
    fields[index] = f"port={port}" if "=" in fields[index] else str(port)
    return ":".join(fields)


MAX_PORT: Final = 65535

PATH_PARAMETERS: Final = frozenset(
    {
        "certKey",
        "privateKey",
        "caCerts",
        "caCertsDir",
        "certificate",
        "trustRoots",
        "extraCertChain",
        "dhParameters",
    }
)
"""Endpoint parameters that name key and certificate files (``ssl:``, ``mtls:``, ``tls:``)."""


def with_paths_resolved(description: str, section: Section) -> str:
    """An endpoint string whose relative key and certificate paths are the config file's.

    The configuration says relative paths are relative to the main file, not
    to where the gateway happens to run: ``certKey=tls/server.pem`` in
    ``/etc/msggateway/gateway.toml`` is ``/etc/msggateway/tls/server.pem``.
    A string read from no file on disk (the embedded default) is kept.
    """
    source = Path(section.file)
    if not source.is_file():
        return description
    base = source.resolve().parent
    fields = split_endpoint_string(description)
    changed = False
    for index, field in enumerate(fields[1:], start=1):
        name, equals, value = field.partition("=")
        if equals and name in PATH_PARAMETERS and value and not Path(value).is_absolute():
            fields[index] = f"{name}={(base / value).as_posix()}".replace(":", "\\:")
            changed = True
    return ":".join(fields) if changed else description


def check_server_endpoint(section: Section, key: Key[Any] | str, description: str) -> None:
    """Report a server endpoint string that Twisted cannot parse, as a problem of ``key``."""
    try:
        serverFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        reason = _exc_text(exc, description)
        section.problem(key, f"bad server endpoint {description!r}: {reason}")
        return
    port = endpoint_port(description)
    if port is not None and port > MAX_PORT:
        section.problem(key, f"bad server endpoint {description!r}: port {port} is past 65535")


def check_client_endpoint(section: Section, key: Key[Any] | str, description: str) -> None:
    """Report a client endpoint string that Twisted cannot parse, as a problem of ``key``."""
    try:
        clientFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        reason = _exc_text(exc, description)
        section.problem(key, f"bad client endpoint {description!r}: {reason}")
        return
    port = _client_port(description)
    if port is not None and port > MAX_PORT:
        section.problem(key, f"bad client endpoint {description!r}: port {port} is past 65535")


def _client_port(description: str) -> int | None:
    """The port a ``tcp:``, ``tls:`` or ``ssl:`` client endpoint string names, if a number."""
    fields = split_endpoint_string(description)
    if fields[0] not in ("tcp", "tls", "ssl"):
        return None
    positional = [field for field in fields[1:] if "=" not in field]
    named = dict(field.partition("=")[::2] for field in fields[1:] if "=" in field)
    value = named.get("port", positional[1] if len(positional) > 1 else "")
    return int(value) if value.isdigit() else None


def check_client_tls(
    section: Section, key: Key[Any] | str, description: str, opt_out: Key[bool] | None = None
) -> None:
    """Refuse an ``ssl:`` client endpoint, which does not verify the server, unless opted out.

    Twisted's ``ssl:`` client checks no host name at all, and no certificate
    without ``caCertsDir``: a connection that looks encrypted to an operator
    goes to whoever answers. ``tls:`` verifies both. ``opt_out`` (a boolean
    key of the same table) accepts an ``ssl:`` endpoint anyway, which the
    gateway then logs as a warning at every start; without one (None), an
    ``ssl:`` endpoint is always refused. An opt-out set for an endpoint that
    is not ``ssl:`` is refused too, so that none stays behind unnoticed.
    """
    unverified = description.startswith(UNVERIFIED_TLS_CLIENT_PREFIX)
    allowed = opt_out is not None and bool(section.read(opt_out))
    if unverified and not allowed:
        escape = f", or set {opt_out.name} = true to connect unverified" if opt_out else ""
        section.problem(
            key,
            "ssl: does not verify the server (no host name check; no certificate check"
            " without caCertsDir): use tls:host=HOST:port=PORT:trustRoots=CA-DIRECTORY"
            f" (with certificate= and privateKey= for a client certificate){escape}",
        )
    elif allowed and not unverified:
        assert opt_out is not None
        section.problem(
            opt_out, "only an ssl: endpoint connects unverified; remove it (tls: verifies)"
        )


def check_name(section: Section, name: str, names: set[str]) -> None:
    """Report a listener or upstream name that is malformed or already taken; take it."""
    if not NAME.match(name):
        section.problem(None, "a name must be letters, digits, _ . - (and start with one)")
    if name in names:
        section.problem(None, f"name {name!r} is used twice; listeners and upstreams share names")
    names.add(name)


_NOT_A_NUMBER: Final = re.compile(r"invalid literal for int\(\) with base 10: '(.*)'")
_UNKNOWN_PARAMETER: Final = re.compile(r"unexpected keyword argument '(\w+)'")
_MISSING: Final = re.compile(r"missing \d+ required positional arguments?: (.*)")


def _exc_text(exc: BaseException, description: str) -> str:
    """What Twisted's endpoint parser found wrong, in the words of the endpoint string.

    Its parser calls ``int()`` and the endpoint's constructor with the
    fields, so a mistyped port or parameter surfaces as Python's own message
    (``invalid literal for int() with base 10: '9787x'``); those are said
    again naming the field. Other messages (a certificate file not found)
    are readable as they are.
    """
    text = str(exc) or type(exc).__name__
    if found := _NOT_A_NUMBER.search(text):
        return _not_a_number(found.group(1), description)
    if found := _UNKNOWN_PARAMETER.search(text):
        return f"unknown parameter {found.group(1)!r}"
    if found := _MISSING.search(text):
        names = re.findall(r"'(\w+)'", found.group(1)) or ["a parameter"]
        return f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} missing"
    return text


def _not_a_number(value: str, description: str) -> str:
    """``port must be a whole number, not '9787x'``, naming the field that holds ``value``."""
    fields = split_endpoint_string(description)
    named = [field.partition("=")[0] for field in fields[1:] if field.endswith(f"={value}")]
    if named:
        return f"{named[0]} must be a whole number, not {value!r}"
    index = _port_field(fields)
    if index is not None and fields[index] == value:
        return f"port must be a whole number, not {value!r}"
    return f"{value!r} is not a whole number"
