"""SSMP listener (hub) and upstream keys."""

from __future__ import annotations

from typing import Final

from gateway.config.base import (
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    positive,
    required_string,
    strings,
)
from gateway.protocols.ssmp.settings import (
    LOGIN_SCHEMES,
    SSMPListenerSettings,
    SSMPUpstreamSettings,
)

__all__ = ["LISTENER", "UPSTREAM", "read_listener", "read_upstream"]


# --- listener ------------------------------------------------------------------------

SCHEMES: Final = strings(
    "schemes",
    ("secret",),
    doc="Login schemes offered: ``secret`` (secrets file ``[logins]``), ``open`` (debugging"
    " only); ``cert`` needs an mtls: endpoint, and TLS listeners always offer it.",
)
ANONYMOUS: Final = boolean(
    "anonymous", False, doc="Accept ``LOGIN . <scheme>``: anonymous peers may publish only."
)
LOGIN_TIMEOUT_SECONDS: Final = positive(
    "login_timeout_seconds",
    10.0,
    doc="A connection with no complete request this long is closed without a response.",
)
PING_INTERVAL_SECONDS: Final = positive(
    "ping_interval_seconds", 30.0, doc="Idle time after which the hub sends ``000 . PING``."
)
PONG_TIMEOUT_SECONDS: Final = positive(
    "pong_timeout_seconds",
    30.0,
    doc="How long the hub waits for the PONG before aborting the connection.",
)
MAX_PENDING_REPLIES: Final = integer(
    "max_pending_replies",
    1000,
    minimum=1,
    doc="Requests awaiting a route outcome, per connection, before the hub stops reading it.",
)

LISTENER: Final = TableSchema(
    "SSMP listener",
    '[listeners.NAME] protocol = "ssmp"',
    (
        SCHEMES,
        ANONYMOUS,
        LOGIN_TIMEOUT_SECONDS,
        PING_INTERVAL_SECONDS,
        PONG_TIMEOUT_SECONDS,
        MAX_PENDING_REPLIES,
    ),
    doc="The SSMP hub: peers log in, subscribe to topics and MCAST, UCAST and BCAST.",
)


def read_listener(section: Section, tls: bool) -> SSMPListenerSettings:
    """An SSMP listener's own keys."""
    schemes = frozenset(section.read(SCHEMES))
    for scheme in sorted(schemes - LOGIN_SCHEMES):
        section.problem(
            SCHEMES,
            f"unknown scheme {scheme!r}; SSMP schemes are {', '.join(sorted(LOGIN_SCHEMES))}",
        )
    if "cert" in schemes and not tls:
        section.problem(
            SCHEMES, "'cert' needs a TLS endpoint (mtls:...); TLS listeners always offer it"
        )
    return SSMPListenerSettings(
        schemes=frozenset(schemes & LOGIN_SCHEMES),
        anonymous=section.read(ANONYMOUS),
        login_timeout_seconds=section.read(LOGIN_TIMEOUT_SECONDS),
        ping_interval_seconds=section.read(PING_INTERVAL_SECONDS),
        pong_timeout_seconds=section.read(PONG_TIMEOUT_SECONDS),
        max_pending_replies=section.read(MAX_PENDING_REPLIES),
    )


# --- upstream ------------------------------------------------------------------------

IDENTITY: Final = required_string("identity", doc="The SSMP identifier the gateway logs in as.")
SCHEME: Final = choice(
    "scheme",
    frozenset({"secret", "cert", "open"}),
    "secret",
    doc="``secret`` (the upstream's secret), ``cert`` (the endpoint's client certificate)"
    " or ``open``.",
)
SUBSCRIBE: Final = strings(
    "subscribe",
    doc="Topics subscribed to after login; the exact topics of routes from it are added.",
)
PRESENCE: Final = boolean("presence", False, doc="Subscribe with the PRESENCE flag.")
UPSTREAM_PING_INTERVAL_SECONDS: Final = positive(
    "ping_interval_seconds", 30.0, doc="Idle time after which the gateway sends PING."
)
UPSTREAM_PONG_TIMEOUT_SECONDS: Final = positive(
    "pong_timeout_seconds", 30.0, doc="How long it waits for PONG before reconnecting."
)
MAX_LINE_BYTES: Final = integer(
    "max_line_bytes",
    1024,
    minimum=1024,
    doc="Longest line accepted from the server, LF included.",
)
MAX_IN_FLIGHT: Final = integer(
    "max_in_flight",
    1000,
    minimum=1,
    doc="Inbound messages awaiting route outcomes before the gateway stops reading the server.",
)

UPSTREAM: Final = TableSchema(
    "SSMP upstream",
    '[upstreams.NAME] protocol = "ssmp"',
    (
        IDENTITY,
        SCHEME,
        SUBSCRIBE,
        PRESENCE,
        UPSTREAM_PING_INTERVAL_SECONDS,
        UPSTREAM_PONG_TIMEOUT_SECONDS,
        MAX_LINE_BYTES,
        MAX_IN_FLIGHT,
    ),
    doc="Logs in to another SSMP server; routes to it send MCAST (UCAST, BCAST), and what it"
    " receives enters the routes from it.",
)


def read_upstream(section: Section) -> SSMPUpstreamSettings:
    """An SSMP upstream's own keys."""
    identity = section.read(IDENTITY)
    if identity and not _is_ssmp_id(identity):
        section.problem(IDENTITY, f"{identity!r} is not a valid SSMP identifier")
    topics = section.read(SUBSCRIBE)
    for topic in topics:
        if not _is_ssmp_id(topic):
            section.problem(SUBSCRIBE, f"{topic!r} is not a valid SSMP topic")
    return SSMPUpstreamSettings(
        identity=identity or "",
        scheme=section.read(SCHEME),
        subscribe=topics,
        presence=section.read(PRESENCE),
        ping_interval_seconds=section.read(UPSTREAM_PING_INTERVAL_SECONDS),
        pong_timeout_seconds=section.read(UPSTREAM_PONG_TIMEOUT_SECONDS),
        max_line_bytes=section.read(MAX_LINE_BYTES),
        max_in_flight=section.read(MAX_IN_FLIGHT),
    )


def _is_ssmp_id(value: str) -> bool:
    from gateway.codecs.ssmp import is_valid_id

    return value.isascii() and is_valid_id(value.encode("ascii"))
