"""Settings of MTL listeners, as validated by `gateway.config`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs

__all__ = [
    "LISTENER_MECHANISMS",
    "MECHANISMS",
    "PROFILES",
    "MTLListenerSettings",
    "MTLUpstreamSettings",
    "curve_key",
    "read_curve_secret_key",
    "zmq_bind_address",
    "zmq_connect_address",
]

_Z85: Final = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
CURVE_KEY_CHARS: Final = 40
"""A CURVE key (32 bytes) in Z85 text, as ``zmq.curve_keypair()`` gives it."""


def curve_key(text: str) -> bytes:
    """Check a Z85 CURVE key (40 characters); return it as bytes for ``setsockopt``.

    Raises:
        ValueError: Not 40 Z85 characters.
    """
    text = text.strip()
    if len(text) != CURVE_KEY_CHARS or not _Z85.issuperset(text):
        raise ValueError(
            f"a CURVE key is {CURVE_KEY_CHARS} Z85 characters, as zmq.curve_keypair() makes"
        )
    return text.encode("ascii")


def read_curve_secret_key(path: Path) -> bytes:
    """Read a CURVE secret key file (its Z85 key, surrounding whitespace ignored).

    Raises:
        ValueError: Unreadable, or not a Z85 key.
    """
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return curve_key(text)


PROFILES = frozenset({"test", "gateway"})
"""The profiles an MTL listener can offer."""

MECHANISMS = ("PLAIN", "SCRAM-SHA-256")
"""The SASL mechanisms an MTL upstream can use, and a listener offer."""
LISTENER_MECHANISMS = (*MECHANISMS, "EXTERNAL")
"""A listener can offer EXTERNAL as well: the identity of the client's CURVE key."""


@attrs.frozen(kw_only=True)
class MTLListenerSettings:
    """How an MTL listener behaves.

    Attributes:
        profiles: Offered in ``201 Ready``: ``test`` (the spec's: one
            resource ``resource``, no confirmations, every writer's content
            to every reader) and ``gateway`` (resources are route addresses).
        require_auth: Answer Connection.Open with ``401`` and take SASL
            (``mechanisms``) against the secrets file's ``[logins]``.
        mechanisms: The SASL mechanisms offered in ``401``, in order:
            ``PLAIN`` (one round) and ``SCRAM-SHA-256`` (``402 Challenged``
            rounds; the password never crosses the wire).
        curve_secret_key: The listener's CURVE secret key (Z85), from
            ``curve_secret_key_file``: both sockets then encrypt and only
            CURVE clients that know the public key can talk to them. None:
            plaintext.
        curve_client_keys: CURVE public keys (Z85) of the clients let in,
            on a CURVE listener; empty: any client key.
        curve_identities: Identity to CURVE public key (Z85): these clients
            are let in too, and SASL EXTERNAL logs them in as that identity.
        allow_addresses: Networks (``127.0.0.1/32``, ``10.0.0.0/8``, IPv6
            too) a peer's address must be in; empty: any. Enforced for both
            sockets by a ZAP handler, before a peer's first message.
        max_sessions: Control peers remembered; past it the least recently
            heard from is forgotten (it must send Connection.Open again).
        max_leases: Lease tokens remembered; past it the oldest no longer
            works for a new data peer (those presented are kept by their peers).
        data_port: Port of the data ROUTER socket (0: one the OS picks); the
            202 reply names it.
        max_backlog_messages: Commands ZeroMQ queues for one data peer that
            does not read (the data socket's ``SNDHWM``), and Contents a
            confirm=full reader may leave unconfirmed. Past the first, what
            ZeroMQ refuses is held for the peer and the data socket is not
            read until it caught up (the listener's ``flow``: a peer stuck
            for ``slow_consumer_seconds`` or past ``max_backlog_bytes`` is
            cut; only under ``disconnect`` is it retry later instead,
            test-profile copies dropped, each counted ``not-sent``); past
            the second, a Content routed to that reader is retry later
            (counted ``not-sent``).
        max_in_flight: Writers' Contents routed and not yet answered, at
            most: past it the data socket is not read (the writers' own
            ZeroMQ queues fill and they wait) until half of them are.
        ping_interval_seconds: Pings to data peers this often.
        dead_after_seconds: A data peer silent for this long is forgotten
            at that moment (its lease and summons dropped, its unconfirmed
            content retried); time the data socket was not read does not
            count.
    """

    profiles: tuple[str, ...] = ("test", "gateway")
    require_auth: bool = False
    mechanisms: tuple[str, ...] = ("PLAIN",)
    curve_secret_key: bytes | None = attrs.field(default=None, repr=False)
    curve_client_keys: tuple[bytes, ...] = ()
    curve_identities: Mapping[str, bytes] = attrs.field(factory=dict)
    allow_addresses: tuple[str, ...] = ()
    max_sessions: int = 10_000
    max_leases: int = 10_000
    data_port: int = 0
    max_backlog_messages: int = 10_000
    max_in_flight: int = 10_000
    ping_interval_seconds: float = 10.0
    dead_after_seconds: float = 30.0


def zmq_bind_address(description: str) -> tuple[str, int]:
    """Host and port of a ``tcp:PORT:interface=HOST`` listener endpoint, for ZeroMQ.

    ``tcp:port=PORT:interface=HOST`` works too; the interface defaults to
    127.0.0.1 (MTL listeners are loopback unless told otherwise).

    Raises:
        ValueError: Not a ``tcp:`` endpoint with a port (ZeroMQ sockets
            cannot use ``mtls:``: TLS for MTL is not built, see docs/protocols/mtl.rst).
    """
    kind, _, rest = description.partition(":")
    if kind != "tcp":
        raise ValueError(f"an MTL listener takes a tcp: endpoint, not {kind!r}")
    port: int | None = None
    host = "127.0.0.1"
    for field in rest.split(":"):
        key, equals, value = field.partition("=")
        if not equals and port is None and key.isdigit():
            port = int(key)
        elif key == "port" and value.isdigit():
            port = int(value)
        elif key == "interface" and value:
            host = value.replace("\\", "")
        elif field:
            raise ValueError(f"an MTL endpoint takes a port and an interface, not {field!r}")
    if port is None or port > 65535:
        raise ValueError(f"no port in {description!r}")
    return host, port


@attrs.frozen(kw_only=True)
class MTLUpstreamSettings:
    """How the gateway works with a remote MTL server.

    Attributes:
        mode: ``writer`` (routes deliver to it: Content to the server) or
            ``reader`` (what the server sends is routed from it).
        profile: The profile to select (``gateway`` on another msggateway).
        resources: Resources to lease (a reader summons each); empty: all.
        confirm: ``none`` or ``full``.
        username: Log in as this user (the password is the upstream's
            secret) when the server answers 401.
        mechanism: ``PLAIN`` or ``SCRAM-SHA-256``.
        curve_server_key: The server's CURVE public key (Z85): both sockets
            then use CURVE. None: plaintext.
        curve_secret_key: The upstream's own CURVE secret key (Z85, from
            ``curve_secret_key_file``), for servers that let in known
            client keys only; None: a fresh key pair per attempt.
        request_timeout_seconds: A control request unanswered this long
            means the server is gone: start over (with backoff).
        ping_interval_seconds: Pings on the data flow this often.
        dead_after_seconds: A data flow silent this long is dead: start over.
    """

    mode: str = "writer"
    profile: str = "gateway"
    resources: tuple[str, ...] = ()
    confirm: str = "full"
    username: str | None = None
    mechanism: str = "PLAIN"
    curve_server_key: bytes | None = None
    curve_secret_key: bytes | None = attrs.field(default=None, repr=False)
    request_timeout_seconds: float = 10.0
    ping_interval_seconds: float = 10.0
    dead_after_seconds: float = 30.0


def zmq_connect_address(description: str) -> tuple[str, int]:
    """Host and port of a ``tcp:host=HOST:port=PORT`` (or ``tcp:HOST:PORT``) upstream endpoint.

    Raises:
        ValueError: Not a ``tcp:`` endpoint with a host and a port.
    """
    kind, _, rest = description.partition(":")
    if kind != "tcp":
        raise ValueError(f"an MTL upstream takes a tcp: endpoint, not {kind!r}")
    host: str | None = None
    port: int | None = None
    positional: list[str] = []
    for field in rest.split(":"):
        key, equals, value = field.partition("=")
        if key == "host" and equals:
            host = value
        elif key == "port" and value.isdigit():
            port = int(value)
        elif key == "timeout" and equals:
            continue
        elif not equals and field:
            positional.append(field)
        else:
            raise ValueError(f"an MTL endpoint takes a host and a port, not {field!r}")
    if positional:
        host = host or positional[0]
        if len(positional) > 1 and positional[1].isdigit():
            port = port or int(positional[1])
    if not host or port is None or port > 65535:
        raise ValueError(f"no host and port in {description!r}")
    return host, port
