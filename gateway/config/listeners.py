"""Listeners (``[listeners.NAME]``): the keys every listener has, and its protocol's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs

from gateway.config import dmp, frontend, mtl, qmqp, ssmp, stream
from gateway.config.base import (
    Section,
    TableSchema,
    choice,
    integer,
    number,
    required_choice,
    required_string,
    strings,
    tables,
)
from gateway.config.endpoints import (
    TLS_SERVER_PREFIXES,
    check_name,
    check_server_endpoint,
    endpoint_with_backlog,
    has_backlog_parameter,
    with_paths_resolved,
)
from gateway.core.addressing import AddressPattern, PatternError
from gateway.core.auth import DEFAULT_LOGIN_FAILURES, LoginFailurePolicy
from gateway.core.authorization import UNRESTRICTED, Authorization, Grant
from gateway.core.flow import (
    DEFAULT_FLOW,
    DEFAULT_MAX_BACKLOG_BYTES,
    DEFAULT_SLOW_CONSUMER_SECONDS,
    PAUSE_PRODUCERS,
    POLICIES,
    FlowPolicy,
)
from gateway.protocols.listener import (
    DEFAULT_FRAME_TIMEOUT_SECONDS,
    DEFAULT_LISTEN_BACKLOG,
    DEFAULT_MAX_CONNECTIONS,
)
from gateway.tls import CERT_NAME_TYPES, DEFAULT_CERT_IDENTITY, MTLSServerParser

__all__ = ["AUTHORIZE", "LISTENER", "PROTOCOLS", "ListenerConfig", "read_listener"]


@attrs.frozen
class ListenerConfig:
    """A listener: a protocol served on an endpoint.

    Attributes:
        name: Its name, used by routes.
        protocol: ``ssmp``, ``qmqp``, ``stream``, ``dmp``, ``mtl`` or ``frontend``.
        endpoint: A Twisted server endpoint string (``tcp:``, ``mtls:``...).
        settings: The protocol's own settings object.
        max_connections: Open connections at most (past it, new ones are
            closed at once).
        max_connections_per_identity: Open connections one authenticated
            identity may hold (0: no limit); past it the login is refused.
        authorization: Its ``authorize`` allow-lists (unrestricted without).
        backlog: The listen queue: connections the kernel holds before they
            are accepted (the endpoint's own ``backlog=`` if it has one).
        frame_timeout_seconds: How long a frame (line, block, envelope) may
            stay incomplete from the read that began it; past it the peer is
            aborted. 0: for ever. MTL has no partial frames of its own to
            time out (ZeroMQ hands over whole messages).
        flow: What a consumer that reads more slowly than its producers
            write costs them, and when it is cut (``slow_consumer_policy``,
            ``slow_consumer_seconds``, ``max_backlog_bytes``).
        login_failures: How refused logins are slowed down and cut off
            (the ``login_failure*`` keys).
        cert_identity: Which names of a verified client certificate are
            identities (`gateway.tls.CERT_NAME_TYPES`); the Common Name only
            by default.
    """

    name: str
    protocol: str
    endpoint: str
    settings: Any
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_identity: int = 0
    authorization: Authorization = UNRESTRICTED
    backlog: int = DEFAULT_LISTEN_BACKLOG
    frame_timeout_seconds: float = DEFAULT_FRAME_TIMEOUT_SECONDS
    flow: FlowPolicy = DEFAULT_FLOW
    login_failures: LoginFailurePolicy = DEFAULT_LOGIN_FAILURES
    cert_identity: tuple[str, ...] = DEFAULT_CERT_IDENTITY

    @property
    def listen_endpoint(self) -> str:
        """The endpoint string to listen on: `endpoint` with the backlog, where it takes one."""
        return endpoint_with_backlog(self.endpoint, self.backlog)

    @property
    def tls(self) -> bool:
        """Whether the endpoint terminates TLS."""
        return self.endpoint.startswith(TLS_SERVER_PREFIXES)


PROTOCOLS: Final[dict[str, tuple[TableSchema, Callable[[Section, bool], Any]]]] = {
    "ssmp": (ssmp.LISTENER, ssmp.read_listener),
    "qmqp": (qmqp.LISTENER, qmqp.read_listener),
    "stream": (stream.LISTENER, stream.read_listener),
    "dmp": (dmp.LISTENER, dmp.read_listener),
    "mtl": (mtl.LISTENER, mtl.read_listener),
    "frontend": (frontend.LISTENER, frontend.read_listener),
}
"""Each listener protocol: its own keys, and the function that reads them (and checks
the endpoint, whose ``tls`` it is told) into its settings object."""


# --- authorize ---------------------------------------------------------------------

PUBLISH: Final = strings(
    "publish", doc="Address patterns the identity may publish to (send, write)."
)
CONSUME: Final = strings(
    "consume", doc="Address patterns the identity may consume from (subscribe, read)."
)
AUTHORIZE: Final = TableSchema(
    "Allow-lists",
    "[listeners.NAME.authorize.IDENTITY]",
    (PUBLISH, CONSUME),
    doc='What one identity may do on the listener; ``IDENTITY`` ``"*"`` adds its patterns to'
    " every authenticated identity. A listener with any authorize table refuses what is not"
    " granted, and grants a connection without an identity nothing.",
)


# --- every listener --------------------------------------------------------------------

PROTOCOL: Final = required_choice(
    "protocol", frozenset(PROTOCOLS), doc="The protocol served (its keys are below)."
)
ENDPOINT: Final = required_string(
    "endpoint",
    doc="A Twisted server endpoint string: ``tcp:PORT:interface=ADDR``, or ``mtls:...`` for"
    " TLS with client certificates.",
)
MAX_CONNECTIONS: Final = integer(
    "max_connections",
    DEFAULT_MAX_CONNECTIONS,
    minimum=1,
    doc="Open connections at most; past it a new connection is closed at once"
    " (too-many-connections).",
)
MAX_CONNECTIONS_PER_IDENTITY: Final = integer(
    "max_connections_per_identity",
    0,
    doc="Open connections one authenticated identity may hold; past it the login is refused.",
    shown="0 (no limit)",
)
BACKLOG: Final = integer(
    "backlog",
    DEFAULT_LISTEN_BACKLOG,
    minimum=1,
    doc="Connections the kernel queues before they are accepted (or the endpoint's own"
    " ``backlog=``, not both); MTL: ZMQ_BACKLOG of both sockets.",
)
FRAME_TIMEOUT_SECONDS: Final = number(
    "frame_timeout_seconds",
    DEFAULT_FRAME_TIMEOUT_SECONDS,
    doc="A frame still incomplete this long after the read that began it aborts the peer"
    " (frame-timeout); 0: off.",
)
SLOW_CONSUMER_POLICY: Final = choice(
    "slow_consumer_policy",
    POLICIES,
    PAUSE_PRODUCERS,
    doc="What a consumer (SSMP subscriber, DMP feed reader, MTL reader) that reads more"
    " slowly than its producers write costs them: ``pause-producers`` stops reading the"
    " producers whose messages wait on it, and answers a route's delivery once it drained,"
    " cutting only a stuck consumer; ``disconnect`` never slows a producer and cuts the"
    " consumer once its backlog passes ``max_backlog_bytes``.",
)
SLOW_CONSUMER_SECONDS: Final = number(
    "slow_consumer_seconds",
    DEFAULT_SLOW_CONSUMER_SECONDS,
    doc="A consumer whose connection stays congested (its buffer not emptied) this long is"
    " stuck: it is disconnected as a slow consumer and its producers read again. It is also"
    " the longest a stuck consumer stalls its producers. 0: never for that reason.",
)
MAX_BACKLOG_BYTES: Final = integer(
    "max_backlog_bytes",
    DEFAULT_MAX_BACKLOG_BYTES,
    minimum=65536,
    doc="Bytes written to a congested consumer past which it is disconnected as a slow"
    " consumer, whatever the policy (the hard cap).",
)
CERT_IDENTITY: Final = strings(
    "cert_identity",
    DEFAULT_CERT_IDENTITY,
    doc="On an ``mtls:`` listener, which names of a verified client certificate are identities"
    f" (logins, allow-lists, limits): any of {', '.join(repr(t) for t in CERT_NAME_TYPES)}"
    " (the subject's Common Name; Subject Alternative Names of type DNS, e-mail, URI, IP"
    " address). Add a SAN type only if the CA issues that type of name to nobody but its owner.",
)
LOGIN_FAILURE_DELAY_SECONDS: Final = number(
    "login_failure_delay_seconds",
    DEFAULT_LOGIN_FAILURES.delay_seconds,
    doc="A refused login (a wrong secret, lease or certificate name, or an identity refused"
    " here) is answered after this; each further refusal in a row for the same peer address"
    " or identity waits twice as long, and no login from that address or for that identity"
    " is checked before the wait is over. 0: at once (tests only).",
)
LOGIN_FAILURE_MAX_DELAY_SECONDS: Final = number(
    "login_failure_max_delay_seconds",
    DEFAULT_LOGIN_FAILURES.max_delay_seconds,
    doc="The longest wait before a refused login is answered.",
)
LOGIN_FAILURES_PER_CONNECTION: Final = integer(
    "login_failures_per_connection",
    DEFAULT_LOGIN_FAILURES.per_connection,
    minimum=1,
    doc="Refused logins one connection may have (QMQP ``A`` blocks; MTL Connection.Authorize"
    " per session); the last is answered, then the connection is closed (MTL: the session"
    " is forgotten). SSMP, the stream protocol and DMP close after the first.",
)
LOGIN_FAILURE_RESET_SECONDS: Final = number(
    "login_failure_reset_seconds",
    DEFAULT_LOGIN_FAILURES.reset_seconds,
    doc="A peer address or identity with no refused login for this long starts again from"
    " ``login_failure_delay_seconds``; an accepted login resets its identity (not its"
    " address) at once.",
)
AUTHORIZE_KEY: Final = tables(
    "authorize", AUTHORIZE, doc="Allow-lists by identity (below); without: unrestricted."
)

LISTENER: Final = TableSchema(
    "Every listener",
    "[listeners.NAME]",
    (
        PROTOCOL,
        ENDPOINT,
        MAX_CONNECTIONS,
        MAX_CONNECTIONS_PER_IDENTITY,
        BACKLOG,
        FRAME_TIMEOUT_SECONDS,
        SLOW_CONSUMER_POLICY,
        SLOW_CONSUMER_SECONDS,
        MAX_BACKLOG_BYTES,
        LOGIN_FAILURE_DELAY_SECONDS,
        LOGIN_FAILURE_MAX_DELAY_SECONDS,
        LOGIN_FAILURES_PER_CONNECTION,
        LOGIN_FAILURE_RESET_SECONDS,
        CERT_IDENTITY,
        AUTHORIZE_KEY,
    ),
    doc="A protocol served on an endpoint. NAME is what routes refer to: letters, digits,"
    " ``_``, ``.`` and ``-``, shared with upstreams.",
)


def read_listener(name: str, section: Section, names: set[str]) -> ListenerConfig | None:
    """One ``[listeners.NAME]`` table; None when it is too broken to use."""
    check_name(section, name, names)
    protocol = section.read(PROTOCOL)
    endpoint = section.read(ENDPOINT)
    if protocol is None or endpoint is None:
        # No section.done(): without protocol and endpoint the protocol's own
        # settings were never read, and calling them unknown keys would mislead.
        return None
    endpoint = with_paths_resolved(endpoint, section)
    check_server_endpoint(section, ENDPOINT, endpoint)
    schema, read_settings = PROTOCOLS[protocol]
    section = section.including(schema)
    settings = read_settings(section, endpoint.startswith(TLS_SERVER_PREFIXES))
    max_connections = section.read(MAX_CONNECTIONS)
    per_identity = section.read(MAX_CONNECTIONS_PER_IDENTITY)
    backlog = section.read(BACKLOG)
    frame_timeout = section.read(FRAME_TIMEOUT_SECONDS)
    flow = FlowPolicy(
        policy=section.read(SLOW_CONSUMER_POLICY),
        slow_consumer_seconds=section.read(SLOW_CONSUMER_SECONDS),
        max_backlog_bytes=section.read(MAX_BACKLOG_BYTES),
    )
    if BACKLOG.name in section.table and has_backlog_parameter(endpoint):
        section.problem(
            BACKLOG, "the endpoint sets backlog= too: give the listen queue in one place"
        )
    login_failures = _login_failures(section)
    authorization = _authorization(section)
    cert_identity = _cert_identity(section, endpoint)
    section.done()
    return ListenerConfig(
        name=name,
        protocol=protocol,
        endpoint=endpoint,
        settings=settings,
        max_connections=max_connections,
        max_connections_per_identity=per_identity,
        authorization=authorization,
        backlog=backlog,
        frame_timeout_seconds=frame_timeout,
        flow=flow,
        login_failures=login_failures,
        cert_identity=cert_identity,
    )


def _cert_identity(section: Section, endpoint: str) -> tuple[str, ...]:
    """Read ``cert_identity``: known name types, at least one, on an ``mtls:`` listener only."""
    types = section.read(CERT_IDENTITY)
    if CERT_IDENTITY.name not in section.table:
        return types
    if not endpoint.startswith(f"{MTLSServerParser.prefix}:"):
        section.problem(
            CERT_IDENTITY,
            "only an mtls: listener verifies client certificates; remove cert_identity here",
        )
    unknown = [t for t in types if t not in CERT_NAME_TYPES]
    if unknown:
        section.problem(
            CERT_IDENTITY,
            f"unknown name type(s) {', '.join(map(repr, unknown))};"
            f" choose from {', '.join(map(repr, CERT_NAME_TYPES))}",
        )
    known = tuple(dict.fromkeys(t for t in types if t in CERT_NAME_TYPES))
    if not known:
        section.problem(CERT_IDENTITY, "name at least one name type (the default is ['cn'])")
        return DEFAULT_CERT_IDENTITY
    return known


def _login_failures(section: Section) -> LoginFailurePolicy:
    """Read the ``login_failure*`` keys; the longest wait may not be shorter than the first."""
    policy = LoginFailurePolicy(
        delay_seconds=section.read(LOGIN_FAILURE_DELAY_SECONDS),
        max_delay_seconds=section.read(LOGIN_FAILURE_MAX_DELAY_SECONDS),
        per_connection=section.read(LOGIN_FAILURES_PER_CONNECTION),
        reset_seconds=section.read(LOGIN_FAILURE_RESET_SECONDS),
    )
    if policy.max_delay_seconds < policy.delay_seconds:
        section.problem(
            LOGIN_FAILURE_MAX_DELAY_SECONDS,
            f"{policy.max_delay_seconds:g} is shorter than login_failure_delay_seconds"
            f" ({policy.delay_seconds:g}): the longest wait cannot be shorter than the first",
        )
    return policy


def _authorization(section: Section) -> Authorization:
    """Read ``[listeners.NAME.authorize.IDENTITY]`` tables of publish and consume patterns."""
    present = AUTHORIZE_KEY.name in section.table
    grants: dict[str, Grant] = {}
    for identity, table in section.table_items(AUTHORIZE_KEY):
        lists: dict[str, tuple[AddressPattern, ...]] = {}
        for key in (PUBLISH, CONSUME):
            patterns = []
            for text in table.read(key):
                try:
                    patterns.append(AddressPattern(text))
                except PatternError as exc:
                    table.problem(key, str(exc))
            lists[key.name] = tuple(patterns)
        table.done()
        grants[identity] = Grant(publish=lists["publish"], consume=lists["consume"])
    # An empty table is restrictive too: nothing granted, everything refused.
    return Authorization(grants) if present else UNRESTRICTED
