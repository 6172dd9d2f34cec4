"""Settings of QMQP listeners and upstreams, as validated by `gateway.config`."""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "QMQPListenerSettings", "QMQPUpstreamSettings"]

DEFAULT_MAX_MESSAGE_BYTES: Final = 32 * 1024 * 1024
"""Largest message block taken; larger ones are skipped and answered D."""


@attrs.frozen(kw_only=True)
class QMQPListenerSettings:
    """How a QMQP streaming listener behaves.

    Attributes:
        require_auth: Message blocks before a successful ``A`` block get D.
        max_message_bytes: Largest message block; larger ones are skipped
            without being buffered and answered D.
        max_in_flight: Messages awaiting their outcome, per connection,
            before the listener stops reading from it.
        max_in_flight_bytes: The same, counted in message bytes.
        idle_timeout_seconds: A connection that completes no block for this
            long, while none of its messages awaits an outcome, is closed:
            silent clients and clients sending a byte at a time. The time
            counts from the last complete block, or from the reply to the
            last outstanding message if that came later.
    """

    require_auth: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_in_flight: int = 1000
    max_in_flight_bytes: int = 64 * 1024 * 1024
    idle_timeout_seconds: float = 120.0


@attrs.frozen(kw_only=True)
class QMQPUpstreamSettings:
    """How the gateway streams messages to a QMQP streaming server.

    Attributes:
        username: If set, the gateway authenticates with an ``A`` block, with
            the secret of this upstream from the secrets file as password.
        auth_success_reply: The auth reply that means success. The spec's
            prose says ``1``; its example shows ``0``. Set ``0`` for a server
            that follows the example.
        window: Messages sent and not yet answered, at most.
        max_queue: Messages waiting for the window, at most; past it a
            delivery is answered "retry later" at once.
        max_attempts: Sends of one message that the server answers Z before
            the route is told to retry later.
        retry_initial_seconds: First delay before resending after a Z.
        retry_max_seconds: Longest delay between resends.
        max_message_bytes: Largest reply block accepted from the server.
    """

    username: str | None = None
    auth_success_reply: str = "1"
    window: int = 100
    max_queue: int = 10000
    max_attempts: int = 5
    retry_initial_seconds: float = 1.0
    retry_max_seconds: float = 30.0
    max_message_bytes: int = 1024 * 1024
