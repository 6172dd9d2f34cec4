"""Per-listener allow-lists: which identities may publish to and consume from which addresses.

A listener's ``authorize`` table maps identities to two lists of address
patterns, ``publish`` and ``consume``, written in the route pattern language
of `gateway.core.addressing` (an exact name, ``*`` for one word, ``#`` for
any run of words, ``.`` and ``@`` separating words; ``#`` alone takes every
address). The identity ``*`` holds patterns that every authenticated
identity gets in addition to its own.

A listener without an ``authorize`` table is unrestricted (`UNRESTRICTED`).
With one, everything not granted is refused, and a connection without an
authenticated identity (``None``) is granted nothing: only a login (a
secret, a certificate, SASL, a lease principal) gives an identity.

What an address is, and which requests publish or consume, is each
protocol's business (docs/tls.rst has the table); the protocols all ask the
same two questions here, `Authorization.may_publish` and
`Authorization.may_consume`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs
from twisted.logger import Logger

from gateway.core.addressing import AddressPattern

__all__ = ["ANY_IDENTITY", "UNRESTRICTED", "Action", "Authorization", "Grant", "check"]

ANY_IDENTITY = "*"
"""Patterns under this identity are granted to every authenticated identity."""


class Action(enum.Enum):
    """What a peer asks to do with an address."""

    PUBLISH = "publish"
    CONSUME = "consume"


@attrs.frozen
class Grant:
    """The addresses one identity may publish to and consume from.

    Attributes:
        publish: Patterns of the addresses it may publish to.
        consume: Patterns of the addresses it may consume from.
    """

    publish: tuple[AddressPattern, ...] = ()
    consume: tuple[AddressPattern, ...] = ()

    def patterns(self, action: Action) -> tuple[AddressPattern, ...]:
        """The patterns for one action."""
        return self.publish if action is Action.PUBLISH else self.consume


def _frozen(value: Mapping[str, Grant] | None) -> Mapping[str, Grant] | None:
    return None if value is None else MappingProxyType(dict(value))


@attrs.frozen
class Authorization:
    """One listener's allow-lists.

    Attributes:
        grants: Identity to its `Grant`, or None for a listener without an
            ``authorize`` table (everything allowed, to everyone).
    """

    grants: Mapping[str, Grant] | None = attrs.field(default=None, converter=_frozen)

    @classmethod
    def from_lists(
        cls, table: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]
    ) -> Authorization:
        """Build from identity to ``(publish patterns, consume patterns)`` as text.

        Raises:
            PatternError: A pattern that cannot be used.
        """
        return cls(
            {
                identity: Grant(
                    publish=tuple(map(AddressPattern, publish)),
                    consume=tuple(map(AddressPattern, consume)),
                )
                for identity, (publish, consume) in table.items()
            }
        )

    @property
    def restricted(self) -> bool:
        """Whether the listener has an ``authorize`` table at all."""
        return self.grants is not None

    def knows(self, identity: str | None) -> bool:
        """Whether the identity is granted anything here (always True when unrestricted)."""
        grants = self.grants
        if grants is None:
            return True
        if identity is None:
            return False
        return identity in grants or ANY_IDENTITY in grants

    def allows(self, action: Action, identity: str | None, address: str) -> bool:
        """Whether ``identity`` may do ``action`` with ``address``.

        Args:
            action: Publish or consume.
            identity: The authenticated identity, None if there is none.
            address: The protocol's address (topic, stream, sink, feed,
                resource, recipient domain).
        """
        grants = self.grants
        if grants is None:
            return True
        if identity is None:
            return False
        for name in (identity, ANY_IDENTITY):
            grant = grants.get(name)
            if grant is not None and any(
                pattern.match(address) is not None for pattern in grant.patterns(action)
            ):
                return True
        return False

    def may_publish(self, identity: str | None, address: str) -> bool:
        """Whether ``identity`` may publish to ``address``."""
        return self.allows(Action.PUBLISH, identity, address)

    def may_consume(self, identity: str | None, address: str) -> bool:
        """Whether ``identity`` may consume from ``address``."""
        return self.allows(Action.CONSUME, identity, address)


UNRESTRICTED = Authorization()
"""The allow-lists of a listener without an ``authorize`` table: everything allowed."""

_log = Logger(namespace="gateway.authorization")


def _peer_text(peer: object) -> str:
    """``host:port`` of an address object, or its text."""
    if peer is None:
        return "?"
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    if host is not None:
        return f"{host}:{port}" if port is not None else str(host)
    return str(peer)


def check(
    authorization: Authorization,
    action: Action,
    identity: str | None,
    address: str,
    *,
    listener: str,
    count_error: Callable[[str], None],
    peer: object = None,
) -> bool:
    """Whether ``identity`` may do ``action`` with ``address``; a refusal is counted and logged.

    The refusal is counted as the protocol error kind ``forbidden-publish``
    or ``forbidden-consume`` and logged with what to change; the caller
    answers the peer the way its protocol prescribes.
    """
    if authorization.allows(action, identity, address):
        return True
    count_error(f"forbidden-{action.value}")
    _log.info(
        "{listener}: {identity} from {peer} may not {action} {address!r}; grant it under"
        " [listeners.{listener}.authorize] if it should",
        listener=listener,
        identity=identity if identity is not None else "a peer without an identity",
        peer=_peer_text(peer),
        action=action.value,
        address=address,
    )
    return False
