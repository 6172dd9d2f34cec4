"""Settings of DMP listeners and upstreams, as validated by `gateway.config`."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from gateway.codecs.dmp import DEFAULT_MAX_ENVELOPE_BYTES

__all__ = ["DMPListenerSettings", "DMPUpstreamSettings", "LeaseGrant"]

SINK: Final = "sink"
FEED: Final = "feed"


@attrs.frozen(kw_only=True)
class LeaseGrant:
    """What one lease opens.

    Attributes:
        kind: ``sink`` (write) or ``feed`` (read).
        target: The sink's or feed's name.
        expires: Unix time after which the lease is refused (None: never).
        text: The lease text itself, when written in the main config (the
            embedded loopback default does); else it is the text of the
            lease's name in the secrets file's ``[leases]``.
        identity: The identity the lease is bound to (None: anyone holding
            it). A DMP connection using it is that identity.
        certified: Whether the connection must prove ``identity`` with a
            verified client certificate naming it (leases of the config);
            leases a principal connection got for its authenticated identity
            need no certificate, but one naming someone else is refused.
    """

    kind: str
    target: str
    expires: float | None = None
    text: bytes | None = None
    identity: str | None = None
    certified: bool = True


def _frozen(value: Mapping[str, LeaseGrant]) -> Mapping[str, LeaseGrant]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class DMPListenerSettings:
    """How a DMP listener behaves.

    Attributes:
        sinks: Sink names: what is written to one enters routing.
        feeds: Feed names: routes deliver to them, one reader each.
        leases: Lease name to grant; the lease itself (what a client
            presents) is that name's text in the secrets file's
            ``[leases]`` (never a login password).
        heartbeat_seconds: Null messages written to feed readers this often
            (0: none).
        idle_timeout_seconds: A sink connection that sends nothing (not even
            a null message) this long is closed as dead (0: never).
        handshake_timeout_seconds: Time for the header and the lease.
        max_envelope_bytes: Largest envelope taken (its size field).
        max_in_flight: Sink messages awaiting their route outcome, per
            connection, before the listener stops reading from it.
        principals: Identities (secrets file ``[logins]``) that may log in
            on a principal AMQP 0-9-1 connection and get leases with
            Direct.Put / Direct.Get (empty: no principal connections).
        principal_lease_seconds: How long such a lease stays valid.
    """

    sinks: frozenset[str] = frozenset()
    feeds: frozenset[str] = frozenset()
    leases: Mapping[str, LeaseGrant] = attrs.field(factory=dict, converter=_frozen)
    heartbeat_seconds: float = 10.0
    idle_timeout_seconds: float = 0.0
    handshake_timeout_seconds: float = 10.0
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES
    max_in_flight: int = 1000
    principals: frozenset[str] = frozenset()
    principal_lease_seconds: float = 60.0


@attrs.frozen(kw_only=True)
class DMPUpstreamSettings:
    """How the gateway opens a sink or a feed on a DMP server.

    The lease it presents is the upstream's secret in the secrets file.

    Attributes:
        mode: ``put`` (routes deliver into the remote sink) or ``get``
            (what the remote feed sends is routed from this upstream).
        exchange: Exchange field of the envelopes it writes (default: empty).
        heartbeat_seconds: Null messages written this often (0: none).
        dead_after_seconds: A feed that sends nothing, not even a null
            message, this long is taken for dead and reconnected (0: never).
        max_envelope_bytes: Largest envelope taken from a feed.
        max_backlog_bytes: Bytes waiting for the connection beyond which
            deliveries are answered retry later.
        principal: When set, the lease is not configured: before each
            connection it is asked for over a principal AMQP 0-9-1
            connection, logging in as this identity with the upstream's
            secret, with Direct.Put (put) or Direct.Get (get) of ``target``.
        target: The remote sink's or feed's name (with ``principal``).
    """

    mode: str = "put"
    exchange: str = ""
    heartbeat_seconds: float = 10.0
    dead_after_seconds: float = 0.0
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES
    max_backlog_bytes: int = 4 * 1024 * 1024
    principal: str | None = None
    target: str = ""
