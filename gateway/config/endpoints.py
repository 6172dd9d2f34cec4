"""Endpoint strings and names in the configuration: checked before anything listens."""

from __future__ import annotations

import re
from typing import Any, Final

from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.testing import MemoryReactor

from gateway.config.base import NAME, Key, Section

__all__ = [
    "TLS_SERVER_PREFIXES",
    "check_client_endpoint",
    "check_name",
    "check_server_endpoint",
    "endpoint_with_backlog",
    "has_backlog_parameter",
]

TLS_SERVER_PREFIXES: Final = ("mtls:", "ssl:")
"""Server endpoints that terminate TLS."""

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


def check_server_endpoint(section: Section, key: Key[Any] | str, description: str) -> None:
    """Report a server endpoint string that Twisted cannot parse, as a problem of ``key``."""
    try:
        serverFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        section.problem(key, f"bad server endpoint {description!r}: {_exc_text(exc)}")


def check_client_endpoint(section: Section, key: Key[Any] | str, description: str) -> None:
    """Report a client endpoint string that Twisted cannot parse, as a problem of ``key``."""
    try:
        clientFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        section.problem(key, f"bad client endpoint {description!r}: {_exc_text(exc)}")


def check_name(section: Section, name: str, names: set[str]) -> None:
    """Report a listener or upstream name that is malformed or already taken; take it."""
    if not NAME.match(name):
        section.problem(None, "a name must be letters, digits, _ . - (and start with one)")
    if name in names:
        section.problem(None, f"name {name!r} is used twice; listeners and upstreams share names")
    names.add(name)


def _exc_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, TypeError) and "unexpected keyword" in text:
        return f"unknown parameter ({text})"
    return text
