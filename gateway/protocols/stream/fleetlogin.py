"""How one node of a fleet logs in to another's stream listener: the relay login.

A node relays to a stream's owner (`gateway.protocols.stream.relay`) what
its clients ask of the stream, and appends there what its routes deliver
into it (`gateway.protocols.stream.routed`). With ``[fleet] relay_secret``
in the secrets file, such a relay logs in as *the fleet*, with SASL
mechanism `RELAY_MECHANISM`, and states on whose behalf it acts: the
identity its client authenticated as at the relaying node (PLAIN,
EXTERNAL or ANONYMOUS alike), or the gateway's routes. The owner takes that
identity only from a relay that proved it holds the secret, and then checks
the client's rights with it as if the client were its own (``authorize``,
``max_connections_per_identity``); the routes' relay acts as the routes do
on the owner itself.

The proof is an HMAC-SHA256 under the secret, never the secret itself, over
a transcript (`_transcript`) of:

- a random nonce of the owner's (`NONCE_PROPERTY` in its PeerProperties
  answer) and one of the relay's (the same property in its PeerProperties):
  a proof is good for one connection only, so a recorded login cannot be
  replayed;
- the TLS channel binding (`channel_binding`: keying material exported
  from the TLS session, RFC 5705, as SCRAM's ``tls-exporter``), on a TLS
  listener: a proof made for one TLS session fails on any other, so a man
  in the middle who terminates TLS cannot pass a login on (empty on plain
  TCP, where an active attacker on the path can take over any connection);
- the relaying node, the role (`ROLES`) and the client's identity.

The owner answers a good login with a proof of its own over the same
transcript (in SaslAuthenticateResponse's challenge field, which RabbitMQ
uses for SASL's last server message): the relay checks it before it sends
anything, so that a relay is never given to a node that does not hold the
secret. Neither side needs to trust the other's certificate for this.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Iterable
from typing import Final

import attrs
from twisted.internet.interfaces import ISSLTransport

__all__ = [
    "CLIENT",
    "NONCE_PROPERTY",
    "RELAY_MECHANISM",
    "ROLES",
    "ROUTES",
    "RelayIdentity",
    "channel_binding",
    "check_owner_proof",
    "check_relay_response",
    "new_nonce",
    "owner_proof",
    "relay_response",
]

RELAY_MECHANISM: Final = "MSGGATEWAY-RELAY"
"""The SASL mechanism of a fleet relay's login (offered to relays only, with a secret)."""
NONCE_PROPERTY: Final = "msggateway-relay-nonce"
"""Peer property with each side's nonce (hex)."""
NONCE_BYTES: Final = 16
CLIENT: Final = "client"
"""A client's relay: the client authenticated as the identity given."""
ANONYMOUS: Final = "anonymous"
"""A client's relay: the client logged in with ANONYMOUS (it has no identity)."""
ROUTES: Final = "routes"
"""The routes' relay: messages the relaying node's routes deliver into streams."""
ROLES: Final = frozenset({CLIENT, ANONYMOUS, ROUTES})
EXPORTER_LABEL: Final = b"EXPORTER-msggateway-relay"
"""RFC 5705 label of the TLS channel binding."""
EXPORTER_BYTES: Final = 32
_VERSION: Final = b"msggateway-relay-1"
_MAC_HEX_CHARS: Final = 64
_LENGTH: Final = struct.Struct(">I")


@attrs.frozen
class RelayIdentity:
    """On whose behalf a relay acts.

    Attributes:
        node: The relaying node.
        role: `CLIENT`, `ANONYMOUS` or `ROUTES`.
        principal: The client's identity (`CLIENT` only; None otherwise).
    """

    node: str
    role: str
    principal: str | None = None


def new_nonce() -> str:
    """A random nonce for one connection, as hex."""
    return secrets.token_hex(NONCE_BYTES)


def channel_binding(transport: object) -> bytes:
    """The TLS session's exported keying material; empty for a connection without TLS."""
    tls = ISSLTransport(transport, None)
    handle = getattr(tls, "getHandle", None)
    if handle is None:
        return b""
    connection = handle()
    export = getattr(connection, "export_keying_material", None)
    if export is None:
        return b""
    material: bytes = export(EXPORTER_LABEL, EXPORTER_BYTES)
    return material


def _transcript(
    label: bytes, owner_nonce: str, relay_nonce: str, binding: bytes, who: RelayIdentity
) -> bytes:
    """Every field length-prefixed: no field can run into the next."""
    fields: Iterable[bytes] = (
        _VERSION,
        label,
        owner_nonce.encode("ascii", "replace"),
        relay_nonce.encode("ascii", "replace"),
        binding,
        who.node.encode("utf-8"),
        who.role.encode("utf-8"),
        (who.principal or "").encode("utf-8"),
    )
    return b"".join(_LENGTH.pack(len(field)) + field for field in fields)


def _mac(secret: bytes, transcript: bytes) -> str:
    return hmac.new(secret, transcript, hashlib.sha256).hexdigest()


def relay_response(
    secret: bytes, *, owner_nonce: str, relay_nonce: str, binding: bytes, who: RelayIdentity
) -> bytes:
    """The relay's SaslAuthenticate data: ``node NUL role NUL principal NUL proof``."""
    proof = _mac(secret, _transcript(b"relay", owner_nonce, relay_nonce, binding, who))
    return "\0".join((who.node, who.role, who.principal or "", proof)).encode("utf-8")


def check_relay_response(
    secret: bytes, data: bytes, *, owner_nonce: str, relay_nonce: str, binding: bytes
) -> RelayIdentity | None:
    """The identity a relay's login states, if its proof holds; else None.

    Args:
        secret: The fleet's relay secret.
        data: The SaslAuthenticate data.
        owner_nonce: The nonce this listener gave the connection.
        relay_nonce: The nonce the relay gave in its PeerProperties.
        binding: This connection's `channel_binding`.
    """
    try:
        node, role, principal, proof = data.decode("utf-8").split("\0")
    except ValueError:  # not UTF-8 (UnicodeDecodeError is one), or not four fields
        return None
    if role not in ROLES or not node or len(proof) != _MAC_HEX_CHARS:
        return None
    if (role == CLIENT) != bool(principal):
        return None
    who = RelayIdentity(node=node, role=role, principal=principal or None)
    expected = _mac(secret, _transcript(b"relay", owner_nonce, relay_nonce, binding, who))
    if not hmac.compare_digest(expected, proof):
        return None
    return who


def owner_proof(
    secret: bytes, *, owner_nonce: str, relay_nonce: str, binding: bytes, who: RelayIdentity
) -> bytes:
    """The owner's answer to a good relay login: its own proof of the secret."""
    return _mac(secret, _transcript(b"owner", owner_nonce, relay_nonce, binding, who)).encode(
        "ascii"
    )


def check_owner_proof(
    secret: bytes,
    proof: bytes | None,
    *,
    owner_nonce: str,
    relay_nonce: str,
    binding: bytes,
    who: RelayIdentity,
) -> bool:
    """Whether the owner's answer proves that it holds the secret too."""
    if proof is None:
        return False
    expected = owner_proof(
        secret, owner_nonce=owner_nonce, relay_nonce=relay_nonce, binding=binding, who=who
    )
    return hmac.compare_digest(expected, proof)
