"""Ports the configuration listens on: two listeners on one port are refused before the start.

The operating system lets one socket listen on an address and port (without
SO_REUSEPORT, which the gateway sets only for a fleet's workers): a second
listener there would make the start fail (`gateway.service.StartFailed`).
`check_ports` finds such a clash when the configuration is checked, naming
both keys. A listener's claim is its endpoint's interface and port; an MTL
listener claims its control and its data port; the admin endpoint claims its
own. Port 0 (the system picks one) never clashes; an interface that is
a wildcard (none given, ``0.0.0.0``, ``::``) clashes with every other address
of its family on that port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Sequence
from typing import Final

import attrs

from gateway.config.base import ConfigProblem
from gateway.config.endpoints import endpoint_port
from gateway.config.gateway import AdminConfig
from gateway.config.listeners import ListenerConfig
from gateway.protocols.mtl.settings import zmq_bind_address
from gateway.tls import split_endpoint_string

__all__ = ["check_ports"]

_ANY: Final = ""
"""The interface of an endpoint string without one: every address of its family."""


@attrs.frozen
class _Claim:
    """A key that listens on ``interface`` and ``port``."""

    key: str
    interface: str
    port: int
    ipv6: bool

    def clashes(self, other: _Claim) -> bool:
        """Whether the two cannot both listen."""
        if self.port != other.port:
            return False
        if self.interface == other.interface:
            return True
        return (self.is_wildcard() and self.covers(other)) or (
            other.is_wildcard() and other.covers(self)
        )

    def is_wildcard(self) -> bool:
        """Whether it listens on every address of its family."""
        return self.interface in (_ANY, "0.0.0.0", "::")

    def covers(self, other: _Claim) -> bool:
        """Whether this wildcard takes ``other``'s address (``::`` takes IPv4 too, dual-stack)."""
        return self.interface == "::" or not other.ipv6

    def where(self) -> str:
        """``127.0.0.1:8787``, ``[::1]:8787``, or ``port 8787`` for every address."""
        if self.is_wildcard():
            return f"port {self.port} (every address)"
        host = f"[{self.interface}]" if ":" in self.interface else self.interface
        return f"{host}:{self.port}"


def check_ports(
    listeners: Sequence[ListenerConfig],
    admin: AdminConfig,
    file: str,
    problems: list[ConfigProblem],
) -> None:
    """Report every listener (or the admin endpoint) on a port an earlier one listens on.

    The problem names the later key, the port and the earlier key.
    """
    claims: list[_Claim] = []
    for claim in _claims(listeners, admin):
        for earlier in claims:
            if claim.clashes(earlier):
                problems.append(
                    ConfigProblem(
                        file,
                        claim.key,
                        f"{claim.where()} is also where {earlier.key} listens; only one can"
                        " listen there",
                    )
                )
                break
        claims.append(claim)


def _claims(listeners: Sequence[ListenerConfig], admin: AdminConfig) -> Iterator[_Claim]:
    """What each listener and the admin endpoint listen on, in file order (port 0 left out)."""
    for listener in listeners:
        key = f"listeners.{listener.name}"
        if listener.protocol == "mtl":
            try:
                host, port = zmq_bind_address(listener.endpoint)
            except ValueError:
                continue  # reported with the listener
            ipv6 = _is_ipv6(host)
            yield from _nonzero(_Claim(f"{key}.endpoint", host, port, ipv6))
            yield from _nonzero(_Claim(f"{key}.data_port", host, listener.settings.data_port, ipv6))
            continue
        yield from _endpoint_claim(f"{key}.endpoint", listener.endpoint)
    if admin.endpoint is not None:
        yield from _endpoint_claim("admin.endpoint", admin.endpoint)


def _endpoint_claim(key: str, description: str) -> Iterator[_Claim]:
    """The claim of a ``tcp:``, ``tcp6:``, ``ssl:`` or ``mtls:`` endpoint string, if any."""
    port = endpoint_port(description)
    if port is None:
        return
    fields = split_endpoint_string(description)
    interface = next(
        (field.partition("=")[2] for field in fields if field.startswith("interface=")), _ANY
    ).replace("\\", "")
    ipv6 = fields[0] == "tcp6" or _is_ipv6(interface)
    if fields[0] == "tcp6" and interface == _ANY:
        interface = "::"
    yield from _nonzero(_Claim(key, interface, port, ipv6))


def _nonzero(claim: _Claim) -> Iterator[_Claim]:
    if claim.port != 0:
        yield claim


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
