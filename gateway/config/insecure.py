"""What a valid configuration still exposes: warnings for ``check-config`` and every start.

Nothing here refuses a configuration (`gateway.config.endpoints` refuses what
must never run); it names settings an operator may have chosen on purpose
but should see every time the gateway starts:

* an upstream on an ``ssl:`` endpoint, accepted with ``allow_unverified_tls``:
  anyone on the path can stand in for the server;
* a plaintext listener that other hosts can reach and that takes passwords or
  secrets in clear: stream SASL PLAIN (always offered), SSMP ``secret``
  logins, QMQP ``A`` blocks (``require_auth``), DMP principal logins, MTL
  SASL PLAIN without CURVE.

A listener is reachable from other hosts unless it listens on a loopback
address (``127.0.0.0/8``, ``::1``, ``localhost``) or a Unix socket; ``tcp:``
without ``interface=`` listens on every interface.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING, Final

from gateway.config.endpoints import TLS_SERVER_PREFIXES
from gateway.protocols.mtl.settings import zmq_bind_address

if TYPE_CHECKING:
    from gateway.config.listeners import ListenerConfig
    from gateway.config.loader import GatewayConfig

__all__ = ["insecure_settings", "listen_interface"]

_ALL_INTERFACES: Final = {"tcp": "0.0.0.0", "tcp6": "::"}
_UNESCAPED_COLON: Final = re.compile(r"(?<!\\):")


def insecure_settings(config: GatewayConfig) -> list[str]:
    """One sentence for each exposed setting, naming the listener or upstream and the remedy."""
    warnings = [
        f"upstream {upstream.name}: {upstream.endpoint.split(':', 1)[0]}: does not verify the"
        " server's certificate or host name (allow_unverified_tls = true): anyone on the path"
        " can stand in for it; use tls:host=HOST:port=PORT:trustRoots=CA-DIRECTORY"
        for upstream in config.upstreams
        if upstream.unverified_tls and upstream.allow_unverified_tls
    ]
    for listener in config.listeners:
        secret = _secrets_taken(listener)
        if secret is None:
            continue
        interface = _plain_interface(listener)
        if interface is None or _loopback(interface):
            continue
        warnings.append(
            f"listener {listener.name}: {secret} in clear on {interface}, reachable from other"
            " hosts without TLS: anyone on the path can read them; use an mtls: endpoint or"
            " interface=127.0.0.1"
        )
    return warnings


def listen_interface(description: str) -> str | None:
    """The address a ``tcp:`` or ``tcp6:`` server endpoint listens on; None for another kind.

    Without ``interface=`` it is every interface: ``0.0.0.0`` (``tcp:``) or ``::``.
    """
    kind, _, rest = description.partition(":")
    every = _ALL_INTERFACES.get(kind)
    if every is None:
        return None
    for field in _UNESCAPED_COLON.split(rest):
        name, equals, value = field.partition("=")
        if equals and name == "interface":
            return value.replace("\\", "") or every
    return every


def _secrets_taken(listener: ListenerConfig) -> str | None:
    """What passwords or secrets the listener takes from its peers, or None."""
    settings = listener.settings
    match listener.protocol:
        case "stream":
            return "SASL PLAIN passwords"
        case "ssmp" if "secret" in settings.schemes:
            return "SSMP secret logins"
        case "qmqp" if settings.require_auth:
            return "QMQP A-block passwords"
        case "dmp" if settings.principals:
            return "DMP principal passwords"
        case "mtl" if "PLAIN" in settings.mechanisms and settings.curve_secret_key is None:
            return "SASL PLAIN passwords (no CURVE)"
    return None


def _plain_interface(listener: ListenerConfig) -> str | None:
    """The address a plaintext TCP listener listens on; None for TLS, Unix sockets and others."""
    if listener.endpoint.startswith(TLS_SERVER_PREFIXES):
        return None
    if listener.protocol == "mtl":
        try:
            return zmq_bind_address(listener.endpoint)[0]
        except ValueError:
            return None
    return listen_interface(listener.endpoint)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
