"""MTL (Message Transport Layer over ZeroMQ) listener and upstream keys."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Final

from gateway.config.base import (
    Key,
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    optional_string,
    positive,
    string,
    string_map,
    strings,
)
from gateway.protocols.mtl.settings import (
    LISTENER_MECHANISMS,
    MECHANISMS,
    PROFILES,
    MTLListenerSettings,
    MTLUpstreamSettings,
    curve_key,
    read_curve_secret_key,
    zmq_bind_address,
    zmq_connect_address,
)

__all__ = ["LISTENER", "UPSTREAM", "read_listener", "read_upstream"]


# --- listener ------------------------------------------------------------------------

PROFILES_KEY: Final = strings(
    "profiles",
    ("test", "gateway"),
    doc="Profiles offered: ``test`` (the spec's: one resource, no confirmations, fan-out) and"
    " ``gateway`` (resources are route addresses).",
)
REQUIRE_AUTH: Final = boolean(
    "require_auth",
    False,
    doc="Answer Connection.Open with 401 and take SASL against the secrets file's [logins].",
)
MECHANISMS_KEY: Final = strings(
    "mechanisms",
    ("PLAIN",),
    doc="SASL mechanisms offered in the 401 reply, in order: PLAIN, SCRAM-SHA-256, EXTERNAL"
    " (needs curve_identities).",
)
CURVE_SECRET_KEY_FILE: Final = optional_string(
    "curve_secret_key_file",
    doc="A file holding the listener's Z85 CURVE secret key (``msggateway mtl keygen``):"
    " both sockets encrypt. Relative to the main file.",
    shown="none: plaintext",
)
CURVE_CLIENT_KEYS: Final = strings(
    "curve_client_keys",
    doc="Z85 public keys of the CURVE clients let in; empty: any client key.",
)
CURVE_IDENTITIES: Final = string_map(
    "curve_identities",
    doc="Identity = Z85 CURVE public key: these clients are let in too, and SASL EXTERNAL logs"
    " them in as that identity.",
)
ALLOW_ADDRESSES: Final = strings(
    "allow_addresses",
    doc="Networks (``10.0.0.0/8``, ``::1/128``) a peer's address must be in, on both sockets;"
    " empty: any.",
)
DATA_PORT: Final = integer(
    "data_port", 0, doc="Port of the data socket (0: one the OS picks; the 202 reply names it)."
)
MAX_BACKLOG_MESSAGES: Final = integer(
    "max_backlog_messages",
    10_000,
    minimum=1,
    doc="Commands ZeroMQ queues for a data peer that does not read (the data socket's SNDHWM),"
    " and Contents a confirm=full reader may leave unconfirmed. Past the first, what ZeroMQ"
    " refuses is held for the peer and the writers wait until it catches up (a peer stuck for"
    " slow_consumer_seconds, or holding more than max_backlog_bytes, is cut); only under"
    ' slow_consumer_policy = "disconnect" is it retry later instead. Past the second, a'
    " Content for that reader is retry later until it confirms.",
)
MAX_IN_FLIGHT: Final = integer(
    "max_in_flight",
    10_000,
    minimum=1,
    doc="Writers' Contents routed and not yet answered, at most: past it the data socket is"
    " not read (the writers' own ZeroMQ queues fill and their sends wait) until half of them"
    " are answered.",
)
PING_INTERVAL_SECONDS: Final = positive(
    "ping_interval_seconds", 10.0, doc="Pings to data peers this often."
)
DEAD_AFTER_SECONDS: Final = positive(
    "dead_after_seconds",
    30.0,
    doc="A data peer silent this long is forgotten then (its lease and summons go, its"
    " unconfirmed content is retried); time the listener did not read the data socket does"
    " not count.",
)

LISTENER: Final = TableSchema(
    "MTL listener",
    '[listeners.NAME] protocol = "mtl"',
    (
        PROFILES_KEY,
        REQUIRE_AUTH,
        MECHANISMS_KEY,
        CURVE_SECRET_KEY_FILE,
        CURVE_CLIENT_KEYS,
        CURVE_IDENTITIES,
        ALLOW_ADDRESSES,
        DATA_PORT,
        MAX_BACKLOG_MESSAGES,
        MAX_IN_FLIGHT,
        PING_INTERVAL_SECONDS,
        DEAD_AFTER_SECONDS,
    ),
    doc="Two ZeroMQ ROUTER sockets: control on the endpoint's port (a ``tcp:`` endpoint"
    " only), data on data_port.",
)


def read_listener(section: Section, tls: bool) -> MTLListenerSettings:
    """An MTL listener's own keys."""
    profiles = tuple(profile.lower() for profile in section.read(PROFILES_KEY))
    unknown = [profile for profile in profiles if profile not in PROFILES]
    if unknown or not profiles:
        section.problem(PROFILES_KEY, f"choose from {', '.join(sorted(PROFILES))}")
    endpoint = section.table.get("endpoint")
    if isinstance(endpoint, str):
        try:
            zmq_bind_address(endpoint)
        except ValueError as exc:
            section.problem("endpoint", str(exc))
    mechanisms = tuple(mechanism.upper() for mechanism in section.read(MECHANISMS_KEY))
    if not mechanisms or any(mechanism not in LISTENER_MECHANISMS for mechanism in mechanisms):
        section.problem(MECHANISMS_KEY, f"choose from {', '.join(LISTENER_MECHANISMS)}")
    curve_secret = _curve_secret(section, CURVE_SECRET_KEY_FILE)
    identities = section.string_map(CURVE_IDENTITIES, curve_key)
    if identities and curve_secret is None and CURVE_SECRET_KEY_FILE.name not in section.table:
        section.problem(CURVE_IDENTITIES, "needs curve_secret_key_file (CURVE on)")
    if "EXTERNAL" in mechanisms and not identities:
        section.problem(
            MECHANISMS_KEY, "EXTERNAL needs curve_identities (the identities of CURVE client keys)"
        )
    return MTLListenerSettings(
        profiles=profiles,
        require_auth=section.read(REQUIRE_AUTH),
        mechanisms=mechanisms,
        curve_secret_key=curve_secret,
        curve_client_keys=_client_keys(section, curve_secret),
        curve_identities=identities,
        allow_addresses=_networks(section),
        data_port=section.read(DATA_PORT),
        max_backlog_messages=section.read(MAX_BACKLOG_MESSAGES),
        max_in_flight=section.read(MAX_IN_FLIGHT),
        ping_interval_seconds=section.read(PING_INTERVAL_SECONDS),
        dead_after_seconds=section.read(DEAD_AFTER_SECONDS),
    )


def _curve_secret(section: Section, key: Key[str | None]) -> bytes | None:
    name = section.read(key)
    if name is None:
        return None
    try:  # relative to the file that names it
        return read_curve_secret_key(Path(section.file).parent / name)
    except ValueError as exc:
        section.problem(key, str(exc))
        return None


def _client_keys(section: Section, curve_secret: bytes | None) -> tuple[bytes, ...]:
    keys = []
    for text in section.read(CURVE_CLIENT_KEYS):
        try:
            keys.append(curve_key(text))
        except ValueError as exc:
            section.problem(CURVE_CLIENT_KEYS, str(exc))
    if keys and curve_secret is None and CURVE_SECRET_KEY_FILE.name not in section.table:
        section.problem(CURVE_CLIENT_KEYS, "needs curve_secret_key_file (CURVE on)")
    return tuple(keys)


def _networks(section: Section) -> tuple[str, ...]:
    networks = section.read(ALLOW_ADDRESSES)
    for text in networks:
        try:
            ipaddress.ip_network(text, strict=False)
        except ValueError as exc:
            section.problem(ALLOW_ADDRESSES, str(exc))
    return networks


# --- upstream ------------------------------------------------------------------------

MODE: Final = choice(
    "mode",
    frozenset({"writer", "reader"}),
    "writer",
    doc="``writer``: routes deliver to it, as Content; ``reader``: what the server sends on its"
    " resources is routed from it.",
)
PROFILE: Final = string(
    "profile",
    "gateway",
    doc="The profile to select: ``gateway`` (another msggateway) or ``test``.",
)
RESOURCES: Final = strings(
    "resources", doc="Resources to lease (a reader summons each); empty: all."
)
CONFIRM: Final = choice(
    "confirm",
    frozenset({"none", "full"}),
    "full",
    doc="``full``: Confirm and Reject become route outcomes; the test profile needs ``none``.",
)
USERNAME: Final = optional_string(
    "username",
    doc="Log in as this user when answered 401; the password is the upstream's secret.",
    shown="none: no login",
)
MECHANISM: Final = choice(
    "mechanism", frozenset(MECHANISMS), "PLAIN", doc="``PLAIN`` or ``SCRAM-SHA-256``."
)
CURVE_SERVER_KEY: Final = optional_string(
    "curve_server_key",
    doc="The listener's Z85 CURVE public key: both sockets use CURVE.",
    shown="none: plaintext",
)
UPSTREAM_CURVE_SECRET_KEY_FILE: Final = optional_string(
    "curve_secret_key_file",
    doc="A file holding its own Z85 CURVE secret key, for servers that let in known client"
    " keys only. Relative to the main file.",
    shown="a fresh key pair per attempt",
)
REQUEST_TIMEOUT_SECONDS: Final = positive(
    "request_timeout_seconds", 10.0, doc="A control request unanswered this long: start over."
)
UPSTREAM_PING_INTERVAL_SECONDS: Final = positive(
    "ping_interval_seconds", 10.0, doc="Pings on the data flow this often."
)
UPSTREAM_DEAD_AFTER_SECONDS: Final = positive(
    "dead_after_seconds", 30.0, doc="A data flow silent this long: start over."
)

UPSTREAM: Final = TableSchema(
    "MTL upstream",
    '[upstreams.NAME] protocol = "mtl"',
    (
        MODE,
        PROFILE,
        RESOURCES,
        CONFIRM,
        USERNAME,
        MECHANISM,
        CURVE_SERVER_KEY,
        UPSTREAM_CURVE_SECRET_KEY_FILE,
        REQUEST_TIMEOUT_SECONDS,
        UPSTREAM_PING_INTERVAL_SECONDS,
        UPSTREAM_DEAD_AFTER_SECONDS,
    ),
    doc="A writer or reader on a remote MTL server (REQ and DEALER sockets); the endpoint is"
    " ``tcp:host=H:port=P``.",
)


def read_upstream(section: Section) -> MTLUpstreamSettings:
    """An MTL upstream's own keys."""
    endpoint = section.table.get("endpoint")
    if isinstance(endpoint, str):
        try:
            zmq_connect_address(endpoint)
        except ValueError as exc:
            section.problem("endpoint", str(exc))
    username = section.read(USERNAME)
    profile = section.read(PROFILE).lower()
    if profile not in PROFILES:
        section.problem(PROFILE, f"choose from {', '.join(sorted(PROFILES))}")
    confirm = section.read(CONFIRM)
    if profile == "test" and confirm == "full":
        section.problem(
            CONFIRM, 'the test profile never confirms (the server answers 501): set "none"'
        )
    server_key = _curve_public(section)
    if server_key is None and UPSTREAM_CURVE_SECRET_KEY_FILE.name in section.table:
        section.problem(UPSTREAM_CURVE_SECRET_KEY_FILE, "needs curve_server_key (CURVE on)")
    return MTLUpstreamSettings(
        mode=section.read(MODE),
        profile=profile,
        resources=section.read(RESOURCES),
        confirm=confirm,
        username=username,
        mechanism=section.read(MECHANISM),
        curve_server_key=server_key,
        curve_secret_key=_curve_secret(section, UPSTREAM_CURVE_SECRET_KEY_FILE),
        request_timeout_seconds=section.read(REQUEST_TIMEOUT_SECONDS),
        ping_interval_seconds=section.read(UPSTREAM_PING_INTERVAL_SECONDS),
        dead_after_seconds=section.read(UPSTREAM_DEAD_AFTER_SECONDS),
    )


def _curve_public(section: Section) -> bytes | None:
    text = section.read(CURVE_SERVER_KEY)
    if text is None:
        return None
    try:
        return curve_key(text)
    except ValueError as exc:
        section.problem(CURVE_SERVER_KEY, str(exc))
        return None
