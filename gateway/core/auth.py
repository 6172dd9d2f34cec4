"""Secrets: what peers must present, and what the gateway presents upstream.

The secrets file is separate from the main config (DESIGN.md, "Security") so
that configs can be shared and reviewed without leaking credentials. It maps
identities to the secret they log in with (SSMP ``secret``, and later QMQP
``A`` blocks, MTL and stream PLAIN), and upstream names to the secret the
gateway logs in with.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from types import MappingProxyType

import attrs

__all__ = ["ANY_IDENTITY", "Secrets"]

ANY_IDENTITY = "*"
"""A secret under this key is a shared secret any identity may log in with."""


def _frozen(value: Mapping[str, bytes]) -> Mapping[str, bytes]:
    return MappingProxyType(dict(value))


def _frozen_tables(
    value: Mapping[str, Mapping[str, bytes]],
) -> Mapping[str, Mapping[str, bytes]]:
    return MappingProxyType({name: _frozen(table) for name, table in value.items()})


@attrs.define
class Secrets:
    """The contents of the secrets file.

    Every listener and upstream holds the gateway's one `Secrets`; `update`
    swaps its contents when SIGHUP re-reads the file, so logins after a
    reload are checked against the new secrets (sessions already logged in
    stay).

    Attributes:
        logins: Identity to secret, for peers logging in to our listeners.
            The key ``*`` holds a shared secret valid for every identity.
        upstreams: Upstream name to the secret the gateway logs in with.
        frontends: TLS front-end listener name to its table of certificate
            name to the secret it logs in to its backend with (SSMP); ``*``
            in a table is the secret for every name.
    """

    logins: Mapping[str, bytes] = attrs.field(factory=dict, converter=_frozen)
    upstreams: Mapping[str, bytes] = attrs.field(factory=dict, converter=_frozen)
    frontends: Mapping[str, Mapping[str, bytes]] = attrs.field(
        factory=dict, converter=_frozen_tables
    )

    def verify(self, identity: str, secret: bytes | None) -> bool:
        """Whether ``secret`` is the right one for ``identity``.

        Compares in constant time; an identity without its own secret falls
        back to the shared ``*`` secret if there is one.
        """
        if secret is None:
            return False
        expected = self.logins.get(identity)
        if expected is None:
            expected = self.logins.get(ANY_IDENTITY)
        if expected is None:
            # Compare anyway so that unknown identities take as long as known ones.
            hmac.compare_digest(secret, secret)
            return False
        return hmac.compare_digest(expected, secret)

    def update(self, other: Secrets) -> None:
        """Take another secrets file's contents (a reload)."""
        self.logins = other.logins
        self.upstreams = other.upstreams
        self.frontends = other.frontends

    def credential_for(self, upstream: str) -> bytes | None:
        """Return the secret the gateway presents to an upstream, if any."""
        return self.upstreams.get(upstream)
