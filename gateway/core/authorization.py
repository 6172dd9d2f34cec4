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

The gateway's own streams (`gateway.core.internal`) are outside all of
this: no grant lets a client write to them, and ``#`` does not let it read
them. Reading one needs a ``consume`` pattern that names the internal
namespace literally (``msggateway.#``, ``msggateway.route.*``), under the
reader's own identity (not ``*``): `Authorization.may_read_internal`, and
`check_internal` for the refusal.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs
from twisted.logger import Logger

from gateway.core.addressing import AddressPattern
from gateway.core.internal import (
    INTERNAL_STREAM,
    is_internal,
    is_internal_reference,
    names_internal,
)

__all__ = [
    "ANY_IDENTITY",
    "UNRESTRICTED",
    "Action",
    "Authorization",
    "Grant",
    "check",
    "check_internal",
]

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
    restricted: bool = attrs.field(init=False, eq=False, repr=False)
    """Whether the listener has an ``authorize`` table at all (an attribute: every
    publish asks)."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "restricted", self.grants is not None)

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

    def may_read_internal(self, identity: str | None, stream: str) -> bool:
        """Whether an operator granted ``identity`` reading the gateway's own ``stream``.

        Only a ``consume`` pattern of the identity's own that names the
        internal namespace literally and matches ``stream`` grants it: not
        ``#``, not the ``*`` identity's patterns, never on a listener
        without an ``authorize`` table.
        """
        grants = self.grants
        if grants is None or identity is None:
            return False
        grant = grants.get(identity)
        return grant is not None and any(
            names_internal(pattern.text) and pattern.match(stream) is not None
            for pattern in grant.consume
        )


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


def check_internal(
    authorization: Authorization,
    command: str,
    identity: str | None,
    stream: str,
    *,
    reference: str | None = None,
    read: bool = False,
    listener: str,
    count_error: Callable[[str], None],
    peer: object = None,
    shown_identity: str | None = None,
) -> bool:
    """Whether a client command on ``stream`` leaves the gateway's own streams alone.

    A command on an internal stream (`gateway.core.internal.is_internal`)
    is refused, unless it only reads (``read``) and the operator granted
    ``identity`` that (`Authorization.may_read_internal`); one that writes
    under one of the gateway's own references is refused whatever the
    stream. A refusal is counted as the protocol error kind
    ``internal-stream`` and logged; the caller answers as its protocol says.

    Args:
        authorization: The listener's allow-lists.
        command: What the client asked, for the log (``subscribe to``).
        identity: The authenticated identity the allow-lists see.
        stream: The stream the command names.
        reference: The publisher or offset reference it writes under, if any.
        read: Whether the command only reads the stream.
        listener: The listener's name.
        count_error: Counts a protocol error by kind.
        peer: The client's address.
        shown_identity: How the client is named in the log, when it is
            not ``identity`` (an anonymous login).
    """
    if is_internal(stream):
        if read and authorization.may_read_internal(identity, stream):
            return True
        what = f"{command} {stream!r}"
    elif reference is not None and is_internal_reference(reference):
        what = f"{command} {stream!r} as {reference!r}"
    else:
        return True
    count_error(INTERNAL_STREAM)
    who = shown_identity if shown_identity is not None else identity
    _log.info(
        "{listener}: {identity} from {peer} may not {what}: streams and references named"
        " msggateway.* are the gateway's own",
        listener=listener,
        identity=who if who is not None else "a peer without an identity",
        peer=_peer_text(peer),
        what=what,
    )
    return False
