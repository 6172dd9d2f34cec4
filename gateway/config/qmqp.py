"""QMQP streaming listener and upstream keys."""

from __future__ import annotations

from typing import Final

from gateway.config.base import (
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    optional_string,
    positive,
)
from gateway.protocols.qmqp.settings import (
    DEFAULT_MAX_MESSAGE_BYTES,
    QMQPListenerSettings,
    QMQPUpstreamSettings,
)

__all__ = ["LISTENER", "UPSTREAM", "read_listener", "read_upstream"]


# --- listener ------------------------------------------------------------------------

REQUIRE_AUTH: Final = boolean(
    "require_auth",
    False,
    doc="Message blocks before a successful ``A`` block (secrets file ``[logins]``) get D;"
    " on an mtls: listener the client certificate stands in for it.",
)
MAX_MESSAGE_BYTES: Final = integer(
    "max_message_bytes",
    DEFAULT_MAX_MESSAGE_BYTES,
    minimum=1024,
    doc="Largest message block; a larger one is skipped as it streams, never buffered,"
    " and answered D.",
)
MAX_IN_FLIGHT: Final = integer(
    "max_in_flight",
    1000,
    minimum=1,
    doc="Messages awaiting their outcome, per connection, before the listener stops reading it.",
)
MAX_IN_FLIGHT_BYTES: Final = integer(
    "max_in_flight_bytes",
    64 * 1024 * 1024,
    minimum=65536,
    doc="The same, counted in message bytes.",
)
IDLE_TIMEOUT_SECONDS: Final = positive(
    "idle_timeout_seconds",
    120.0,
    doc="A connection that completes no block this long, with no message awaiting an"
    " outcome, is closed (silent or byte-a-second clients).",
)

LISTENER: Final = TableSchema(
    "QMQP listener",
    '[listeners.NAME] protocol = "qmqp"',
    (REQUIRE_AUTH, MAX_MESSAGE_BYTES, MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES, IDLE_TIMEOUT_SECONDS),
    doc="QMQP streaming (GreenArrow's protocol): each message is routed by its recipients and"
    " answered K, Z or D. Routes cannot end at a QMQP listener.",
)


def read_listener(section: Section, tls: bool) -> QMQPListenerSettings:
    """A QMQP listener's own keys."""
    return QMQPListenerSettings(
        require_auth=section.read(REQUIRE_AUTH),
        max_message_bytes=section.read(MAX_MESSAGE_BYTES),
        max_in_flight=section.read(MAX_IN_FLIGHT),
        max_in_flight_bytes=section.read(MAX_IN_FLIGHT_BYTES),
        idle_timeout_seconds=section.read(IDLE_TIMEOUT_SECONDS),
    )


# --- upstream ------------------------------------------------------------------------

USERNAME: Final = optional_string(
    "username",
    doc="Send an ``A`` block as this user, the upstream's secret as password.",
    shown="none: no A block",
)
AUTH_SUCCESS_REPLY: Final = choice(
    "auth_success_reply",
    frozenset({"1", "0"}),
    "1",
    doc='The auth reply that means success: the spec\'s prose says "1", its example shows "0".',
)
WINDOW: Final = integer(
    "window", 100, minimum=1, doc="Messages sent and not yet answered, at most."
)
MAX_QUEUE: Final = integer(
    "max_queue",
    10000,
    minimum=1,
    doc="Messages waiting for the window, at most; past it a delivery is retry later at once.",
)
MAX_ATTEMPTS: Final = integer(
    "max_attempts",
    5,
    minimum=1,
    doc="Sends of a message the server answers Z before the route is told to retry later.",
)
RETRY_INITIAL_SECONDS: Final = positive(
    "retry_initial_seconds", 1.0, doc="First delay before resending after a Z (then doubled)."
)
RETRY_MAX_SECONDS: Final = positive("retry_max_seconds", 30.0, doc="Longest delay between resends.")
UPSTREAM_MAX_MESSAGE_BYTES: Final = integer(
    "max_message_bytes",
    1024 * 1024,
    minimum=1024,
    doc="Largest reply block accepted from the server.",
)

UPSTREAM: Final = TableSchema(
    "QMQP upstream",
    '[upstreams.NAME] protocol = "qmqp"',
    (
        USERNAME,
        AUTH_SUCCESS_REPLY,
        WINDOW,
        MAX_QUEUE,
        MAX_ATTEMPTS,
        RETRY_INITIAL_SECONDS,
        RETRY_MAX_SECONDS,
        UPSTREAM_MAX_MESSAGE_BYTES,
    ),
    doc="Streams messages from routes to a QMQP streaming server (another gateway,"
    " GreenArrow); replies are matched by id.",
)


def read_upstream(section: Section) -> QMQPUpstreamSettings:
    """A QMQP upstream's own keys."""
    return QMQPUpstreamSettings(
        username=section.read(USERNAME),
        auth_success_reply=section.read(AUTH_SUCCESS_REPLY),
        window=section.read(WINDOW),
        max_queue=section.read(MAX_QUEUE),
        max_attempts=section.read(MAX_ATTEMPTS),
        retry_initial_seconds=section.read(RETRY_INITIAL_SECONDS),
        retry_max_seconds=section.read(RETRY_MAX_SECONDS),
        max_message_bytes=section.read(UPSTREAM_MAX_MESSAGE_BYTES),
    )
