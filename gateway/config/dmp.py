"""DMP (AMQP Direct Message Protocol) listener, lease and upstream keys."""

from __future__ import annotations

import datetime
from typing import Final

from gateway.codecs.dmp import DEFAULT_MAX_ENVELOPE_BYTES
from gateway.config.base import (
    Section,
    TableSchema,
    choice,
    integer,
    number,
    optional_string,
    positive,
    string,
    strings,
    tables,
)
from gateway.protocols.dmp.settings import DMPListenerSettings, DMPUpstreamSettings, LeaseGrant

__all__ = ["LEASE", "LISTENER", "UPSTREAM", "read_listener", "read_upstream"]


# --- listener ------------------------------------------------------------------------

SINK: Final = optional_string("sink", doc="The sink the lease writes to.")
FEED: Final = optional_string("feed", doc="The feed the lease reads.")
EXPIRES: Final = optional_string(
    "expires",
    doc="ISO 8601 date and time with a time zone after which the lease is refused.",
    shown="never",
)
TEXT: Final = optional_string(
    "text",
    doc="The lease text itself (the embedded default's); real leases keep it in the secrets file.",
    shown="the text of NAME in the secrets file's [leases]",
)
IDENTITY: Final = optional_string(
    "identity",
    doc="Only a client certificate naming this identity may use the lease.",
    shown="anyone holding it",
)

LEASE: Final = TableSchema(
    "DMP lease",
    "[listeners.NAME.leases.LEASE]",
    (SINK, FEED, EXPIRES, TEXT, IDENTITY),
    doc="A lease a DMP client presents; it names exactly one sink or one feed.",
)

SINKS: Final = strings("sinks", doc="Sink names: what is written to one enters routing.")
FEEDS: Final = strings("feeds", doc="Feed names: routes deliver to them, one reader each.")
LEASES: Final = tables("leases", LEASE, doc="The leases, by name (below).")
HEARTBEAT_SECONDS: Final = number(
    "heartbeat_seconds", 10.0, doc="Null messages written to feed readers this often (0: none)."
)
IDLE_TIMEOUT_SECONDS: Final = number(
    "idle_timeout_seconds",
    0.0,
    doc="A sink writer silent this long is closed (0: never); a feed reader that reads"
    " nothing is cut after ``slow_consumer_seconds``.",
)
HANDSHAKE_TIMEOUT_SECONDS: Final = positive(
    "handshake_timeout_seconds", 10.0, doc="Time for the protocol header and the lease."
)
MAX_ENVELOPE_BYTES: Final = integer(
    "max_envelope_bytes",
    DEFAULT_MAX_ENVELOPE_BYTES,
    minimum=64,
    doc="Largest envelope taken (its size field); a larger one closes the connection.",
)
MAX_IN_FLIGHT: Final = integer(
    "max_in_flight",
    1000,
    minimum=1,
    doc="Sink messages awaiting their route outcome, per connection, before the listener"
    " stops reading it.",
)
PRINCIPALS: Final = strings(
    "principals",
    doc="Identities (secrets file [logins]) that may get leases over a principal AMQP 0-9-1"
    " connection on the same port.",
)
PRINCIPAL_LEASE_SECONDS: Final = positive(
    "principal_lease_seconds", 60.0, doc="How long a lease got over AMQP 0-9-1 stays valid."
)

LISTENER: Final = TableSchema(
    "DMP listener",
    '[listeners.NAME] protocol = "dmp"',
    (
        SINKS,
        FEEDS,
        LEASES,
        HEARTBEAT_SECONDS,
        IDLE_TIMEOUT_SECONDS,
        HANDSHAKE_TIMEOUT_SECONDS,
        MAX_ENVELOPE_BYTES,
        MAX_IN_FLIGHT,
        PRINCIPALS,
        PRINCIPAL_LEASE_SECONDS,
    ),
    doc="The AMQP Direct Message Protocol: clients present a lease, then write envelopes to a"
    " sink (routed from the listener as SINK.ROUTINGKEY) or read a feed (routes deliver to"
    " it).",
)


def read_listener(section: Section, tls: bool) -> DMPListenerSettings:
    """A DMP listener's own keys, its leases included."""
    sinks = frozenset(section.read(SINKS))
    feeds = frozenset(section.read(FEEDS))
    leases: dict[str, LeaseGrant] = {}
    for name, grant in section.table_items(LEASES):
        lease = _lease(grant, sinks, feeds)
        if lease is not None:
            leases[name] = lease
    return DMPListenerSettings(
        sinks=sinks,
        feeds=feeds,
        leases=leases,
        heartbeat_seconds=section.read(HEARTBEAT_SECONDS),
        idle_timeout_seconds=section.read(IDLE_TIMEOUT_SECONDS),
        handshake_timeout_seconds=section.read(HANDSHAKE_TIMEOUT_SECONDS),
        max_envelope_bytes=section.read(MAX_ENVELOPE_BYTES),
        max_in_flight=section.read(MAX_IN_FLIGHT),
        principals=frozenset(section.read(PRINCIPALS)),
        principal_lease_seconds=section.read(PRINCIPAL_LEASE_SECONDS),
    )


def _lease(grant: Section, sinks: frozenset[str], feeds: frozenset[str]) -> LeaseGrant | None:
    sink, feed = grant.read(SINK), grant.read(FEED)
    expires_text = grant.read(EXPIRES)
    text = grant.read(TEXT)
    identity = grant.read(IDENTITY)
    grant.done()
    if sink is not None and feed is None:
        kind, target = "sink", sink
    elif feed is not None and sink is None:
        kind, target = "feed", feed
    else:
        grant.problem(None, "a lease names exactly one sink or one feed")
        return None
    if target not in (sinks if kind == "sink" else feeds):
        grant.problem(kind, f"no {kind} named {target!r} in {kind}s")
        return None
    expires: float | None = None
    if expires_text is not None:
        try:
            moment = datetime.datetime.fromisoformat(expires_text)
        except ValueError:
            grant.problem(EXPIRES, f"{expires_text!r} is not an ISO 8601 date and time")
            return None
        if moment.tzinfo is None:
            grant.problem(EXPIRES, "needs a time zone, such as 2027-01-01T00:00:00Z")
            return None
        expires = moment.timestamp()
    return LeaseGrant(
        kind=kind,
        target=target,
        expires=expires,
        text=text.encode("utf-8") if text is not None else None,
        identity=identity,
    )


# --- upstream ------------------------------------------------------------------------

MODE: Final = choice(
    "mode",
    frozenset({"put", "get"}),
    "put",
    doc="``put``: routes deliver into the remote sink; ``get``: what the remote feed sends is"
    " routed from this upstream.",
)
EXCHANGE: Final = string("exchange", "", doc="Exchange field of the envelopes it writes.")
UPSTREAM_HEARTBEAT_SECONDS: Final = number(
    "heartbeat_seconds", 10.0, doc="Null messages written this often (0: none)."
)
DEAD_AFTER_SECONDS: Final = number(
    "dead_after_seconds",
    0.0,
    doc="A feed silent this long, not even a null message, is reconnected (0: never).",
)
UPSTREAM_MAX_ENVELOPE_BYTES: Final = integer(
    "max_envelope_bytes",
    DEFAULT_MAX_ENVELOPE_BYTES,
    minimum=64,
    doc="Largest envelope taken from a feed.",
)
MAX_BACKLOG_BYTES: Final = integer(
    "max_backlog_bytes",
    4 * 1024 * 1024,
    minimum=65536,
    doc="Bytes waiting for the connection beyond which deliveries are retry later.",
)
PRINCIPAL: Final = optional_string(
    "principal",
    doc="Get a fresh lease before each connection over AMQP 0-9-1, logging in as this"
    " identity with the upstream's secret.",
    shown="none: the lease is the upstream's secret",
)
TARGET: Final = string(
    "target", "", doc="The remote sink or feed (Direct.Put or Direct.Get), with principal."
)

UPSTREAM: Final = TableSchema(
    "DMP upstream",
    '[upstreams.NAME] protocol = "dmp"',
    (
        MODE,
        EXCHANGE,
        UPSTREAM_HEARTBEAT_SECONDS,
        DEAD_AFTER_SECONDS,
        UPSTREAM_MAX_ENVELOPE_BYTES,
        MAX_BACKLOG_BYTES,
        PRINCIPAL,
        TARGET,
    ),
    doc="Opens a remote sink or feed with a lease (the upstream's secret), or with a lease got"
    " over a principal connection.",
)


def read_upstream(section: Section) -> DMPUpstreamSettings:
    """A DMP upstream's own keys."""
    mode = section.read(MODE)
    exchange = section.read(EXCHANGE)
    heartbeat = section.read(UPSTREAM_HEARTBEAT_SECONDS)
    dead_after = section.read(DEAD_AFTER_SECONDS)
    max_envelope = section.read(UPSTREAM_MAX_ENVELOPE_BYTES)
    max_backlog = section.read(MAX_BACKLOG_BYTES)
    principal = section.read(PRINCIPAL)
    target = section.read(TARGET)
    if principal is not None and not target:
        section.problem(TARGET, "names the remote sink or feed when principal is set")
    return DMPUpstreamSettings(
        mode=mode,
        exchange=exchange,
        heartbeat_seconds=heartbeat,
        dead_after_seconds=dead_after,
        max_envelope_bytes=max_envelope,
        max_backlog_bytes=max_backlog,
        principal=principal,
        target=target,
    )
