"""Leases made and revoked at run time (the admin API), for DMP listeners.

A lease made here grants one sink or feed of one DMP listener until it
expires (`DMPServerFactory.issue_lease`). Outside a fleet it is a random
text (`secrets.token_urlsafe`) kept in that listener's factory
(`DMPServerFactory.granted`), living as long as the process; in a fleet it
is a text signed with the fleet's lease secret that every node accepts
(`gateway.fleet.leases`), and revoking it reaches every node through
RabbitMQ (the answer waits for RabbitMQ to take it). Making and revoking
need the admin token: ``admin_token`` in the secrets file (never a login
password, nor a login password the token), or without one the token the
gateway made (`gateway.config.admintoken`).

A lease made for an identity is bound to it as a lease of the config with
``identity`` is (`LeaseGrant.identity`, ``certified``): only a connection
whose verified client certificate names that identity may use it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Final

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime

from gateway.core.auth import ANY_IDENTITY, Secrets
from gateway.protocols.dmp.server import DMPServerFactory

__all__ = ["LeaseDesk", "LeaseRefusedError"]

MAX_TTL_SECONDS: Final = 366 * 86400
MAX_IDENTITY_CHARS: Final = 1024
"""An identity is a certificate name (CN, DNS, e-mail, URI or IP SAN); URIs are the longest."""


class LeaseRefusedError(ValueError):
    """A lease request that cannot be granted; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class LeaseDesk:
    """Makes and revokes run-time leases on the gateway's DMP listeners.

    Args:
        listeners: DMP listener name to its factory.
        secrets: Where the admin token is.
        clock: For expiry times.
    """

    def __init__(
        self, listeners: Mapping[str, DMPServerFactory], secrets: Secrets, clock: IReactorTime
    ) -> None:
        self._listeners = dict(listeners)
        self._secrets = secrets
        self._clock = clock

    @property
    def enabled(self) -> bool:
        """Whether there is an admin token (the secrets file's, or the one the gateway made)."""
        return self._secrets.effective_admin_token is not None

    def authorized(self, token: bytes | None) -> bool:
        """Whether ``token`` is the admin token (constant-time)."""
        return self._secrets.is_admin_token(token)

    def make(
        self,
        listener: str,
        kind: str,
        target: str,
        ttl_seconds: float,
        identity: str | None = None,
    ) -> dict[str, object]:
        """Grant a lease; return its text and expiry (and identity, if bound).

        Args:
            listener: The DMP listener's name.
            kind: ``sink`` or ``feed``.
            target: The sink's or feed's name.
            ttl_seconds: How long the lease is valid.
            identity: Bind the lease to this identity: only a client
                certificate naming it may use the lease. None: anyone
                holding the lease text may.

        Raises:
            LeaseRefusedError: No such listener (404), sink or feed (404), or a bad
                kind, time to live or identity (400).
        """
        factory = self._listeners.get(listener)
        if factory is None:
            known = ", ".join(sorted(self._listeners)) or "none"
            raise LeaseRefusedError(404, f"no DMP listener named {listener!r} (known: {known})")
        if kind not in ("sink", "feed"):
            raise LeaseRefusedError(400, "name a sink or a feed")
        targets = factory.settings.sinks if kind == "sink" else factory.settings.feeds
        if target not in targets:
            raise LeaseRefusedError(404, f"{listener} has no {kind} named {target!r}")
        if not 0 < ttl_seconds <= MAX_TTL_SECONDS:
            raise LeaseRefusedError(
                400, f"ttl_seconds must be above 0 and at most {MAX_TTL_SECONDS}"
            )
        if identity is not None:
            _check_identity(identity)
        expires = self._clock.seconds() + ttl_seconds
        try:
            text = factory.issue_lease(kind, target, expires, identity, certified=True)
        except ValueError as exc:
            raise LeaseRefusedError(400, str(exc)) from exc
        self._forget_expired()
        made: dict[str, object] = {"lease": text, "listener": listener, kind: target}
        if identity is not None:
            made["identity"] = identity
        made["expires"] = expires
        return made

    def revoke(self, text: str) -> bool | Deferred[bool]:
        """Revoke a run-time lease; whether it existed. Open connections stay open.

        Returns:
            Whether it existed; in a fleet, a Deferred with that once
            RabbitMQ took the revocation for every node, failing with
            `LeaseRefusedError` (503) when it could not.
        """
        found = False
        published: list[Deferred[bool]] = []
        for factory in self._listeners.values():
            revoked = factory.revoke_lease(text)
            if isinstance(revoked, Deferred):
                published.append(revoked)
            elif revoked:
                found = True
        if not published:
            return found

        def taken(results: list[bool]) -> bool:
            if not all(results):
                raise LeaseRefusedError(
                    503,
                    "revoked on this node, but RabbitMQ did not take the revocation: the other"
                    " nodes accept the lease until it expires; try again",
                )
            return True

        return gatherResults(published).addCallback(taken)

    def _forget_expired(self) -> None:
        for factory in self._listeners.values():
            factory.forget_expired_leases()


def _check_identity(identity: str) -> None:
    """Refuse an identity no certificate could name.

    Raises:
        LeaseRefusedError: 400: empty, too long, with surrounding spaces or
            control characters, or the allow-lists' wildcard.
    """
    if not identity or identity != identity.strip():
        raise LeaseRefusedError(400, "identity must be a name, without surrounding spaces")
    if len(identity) > MAX_IDENTITY_CHARS:
        raise LeaseRefusedError(400, f"identity is at most {MAX_IDENTITY_CHARS} characters")
    if any(unicodedata.category(char).startswith("C") for char in identity):
        raise LeaseRefusedError(400, "identity must not hold control or format characters")
    if identity == ANY_IDENTITY:
        raise LeaseRefusedError(
            400,
            f"identity {ANY_IDENTITY!r} names no one: leave identity out for a lease"
            " anyone holding it may use",
        )
