"""TLS front-end listener keys."""

from __future__ import annotations

from typing import Final

from gateway.config.base import Section, TableSchema, positive, required_choice, required_string
from gateway.config.endpoints import (
    check_client_endpoint,
    check_client_tls,
    with_paths_resolved,
)
from gateway.protocols.frontend.settings import SPEAKS, FrontendSettings
from gateway.tls import mtls_verify_mode

__all__ = ["LISTENER", "read_listener"]

SPEAKS_KEY: Final = required_choice(
    "speaks", SPEAKS, doc="The protocol on both sides: ``ssmp``, ``qmqp`` or ``stream``."
)
BACKEND: Final = required_string(
    "backend",
    doc="A Twisted client endpoint string for the plaintext backend (``tls:`` re-encrypts,"
    " verifying the backend; ``ssl:``, which does not, is refused).",
)
CONNECT_TIMEOUT_SECONDS: Final = positive(
    "connect_timeout_seconds",
    10.0,
    doc="How long one backend connection may take; past it the backend counts as unreachable.",
)
HANDSHAKE_TIMEOUT_SECONDS: Final = positive(
    "handshake_timeout_seconds",
    10.0,
    doc="How long a client has to finish its TLS handshake (and, for SSMP, its LOGIN line).",
)

LISTENER: Final = TableSchema(
    "TLS front-end listener",
    '[listeners.NAME] protocol = "frontend"',
    (SPEAKS_KEY, BACKEND, CONNECT_TIMEOUT_SECONDS, HANDSHAKE_TIMEOUT_SECONDS),
    doc="The TLS front door of a plaintext server: its endpoint must be ``mtls:`` with"
    " caCerts and verify=required, and each verified client is relayed byte for byte to the"
    " backend. An SSMP front-end's backend secrets are in the secrets file's"
    " ``[frontends.NAME]``. Routes cannot end at it.",
)


def read_listener(section: Section, tls: bool) -> FrontendSettings:
    """A front-end listener's own keys."""
    mode = mtls_verify_mode(str(section.table.get("endpoint", "")))
    if mode in (None, "none"):
        section.problem(
            "endpoint",
            "a front-end needs an mtls: endpoint with caCerts (it lets in only clients "
            "with a verified certificate)",
        )
    elif mode != "required":
        section.problem("endpoint", "a front-end needs verify=required (the default)")
    backend = section.read(BACKEND)
    if backend:
        backend = with_paths_resolved(backend, section)
        check_client_endpoint(section, BACKEND, backend)
        check_client_tls(section, BACKEND, backend)
    return FrontendSettings(
        speaks=section.read(SPEAKS_KEY) or "stream",
        backend=backend or "",
        connect_timeout_seconds=section.read(CONNECT_TIMEOUT_SECONDS),
        handshake_timeout_seconds=section.read(HANDSHAKE_TIMEOUT_SECONDS),
    )
