"""Settings of SSMP listeners and upstreams, as validated by `gateway.config`."""

from __future__ import annotations

from typing import Final

import attrs

__all__ = [
    "LOGIN_SCHEMES",
    "SSMPListenerSettings",
    "SSMPUpstreamSettings",
]

LOGIN_SCHEMES: Final = frozenset({"open", "secret", "cert"})
"""Login schemes the hub implements (spec, "Authentication schemes")."""


@attrs.frozen(kw_only=True)
class SSMPListenerSettings:
    """How an SSMP hub listener behaves.

    Attributes:
        schemes: Login schemes offered besides ``cert``, which every TLS
            listener offers (spec: "All servers that accept connection over
            SSL/TLS MUST allow authentication through client certificates").
            ``open`` is for debugging only and off unless listed.
        anonymous: Whether ``LOGIN . <scheme>`` is accepted (publish only).
        login_timeout_seconds: A connection that sends no complete request
            in this time is closed without a response.
        ping_interval_seconds: Idle time after which the hub sends ``000 . PING``.
        pong_timeout_seconds: How long the hub waits for the answer before
            closing the connection.
        max_pending_replies: Requests awaiting a route outcome, per
            connection, before the hub stops reading from it.
    """

    schemes: frozenset[str] = frozenset({"secret"})
    anonymous: bool = False
    login_timeout_seconds: float = 10.0
    ping_interval_seconds: float = 30.0
    pong_timeout_seconds: float = 30.0
    max_pending_replies: int = 1000


@attrs.frozen(kw_only=True)
class SSMPUpstreamSettings:
    """How the gateway logs in to and talks with another SSMP server.

    Attributes:
        identity: The identifier the gateway logs in as.
        scheme: ``secret`` (from the secrets file), ``cert`` (the endpoint's
            client certificate) or ``open``.
        subscribe: Topics to subscribe to after login (routes from the
            upstream on exact topics add theirs too).
        presence: Subscribe with the PRESENCE flag.
        ping_interval_seconds: Idle time after which the gateway sends PING.
        pong_timeout_seconds: How long it waits for PONG before reconnecting.
        max_line_bytes: Longest line accepted from the server, LF included.
        max_in_flight: Inbound messages awaiting route outcomes before the
            gateway stops reading from the server.
    """

    identity: str
    scheme: str = "secret"
    subscribe: tuple[str, ...] = ()
    presence: bool = False
    ping_interval_seconds: float = 30.0
    pong_timeout_seconds: float = 30.0
    max_line_bytes: int = 1024
    max_in_flight: int = 1000
