"""Configuration: TOML files in, frozen validated objects out.

The main file (``etc/gateway.toml``) names listeners, upstreams and the admin
endpoint; each route is a file of its own (``etc/routes/*.toml``); secrets
live in a separate file. Everything is checked before anything listens, and
every problem found is reported at once, naming the file, the key and what
is wrong (`ConfigError`). Nothing else in the gateway reads configuration.

Protocol-specific settings are validated by one function per protocol
(`_LISTENER_SETTINGS`, `_UPSTREAM_SETTINGS`); a new protocol adds its entry.
"""

from __future__ import annotations

import datetime
import difflib
import ipaddress
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Final

import attrs
from twisted.internet.endpoints import clientFromString, serverFromString
from twisted.internet.testing import MemoryReactor

from gateway.codecs.dmp import DEFAULT_MAX_ENVELOPE_BYTES as DEFAULT_DMP_MAX_ENVELOPE_BYTES
from gateway.core.addressing import AddressPattern, AddressTemplate, PatternError
from gateway.core.auth import Secrets
from gateway.core.authorization import UNRESTRICTED, Authorization, Grant
from gateway.core.router import DEFAULT_ROUTE_TIMEOUT_SECONDS, Route
from gateway.core.transforms import TRANSFORMS
from gateway.protocols.dmp.settings import DMPListenerSettings, DMPUpstreamSettings, LeaseGrant
from gateway.protocols.frontend.settings import SPEAKS, FrontendSettings
from gateway.protocols.listener import (
    DEFAULT_FRAME_TIMEOUT_SECONDS,
    DEFAULT_LISTEN_BACKLOG,
    DEFAULT_MAX_CONNECTIONS,
)
from gateway.protocols.mtl.settings import LISTENER_MECHANISMS as MTL_LISTENER_MECHANISMS
from gateway.protocols.mtl.settings import MECHANISMS as MTL_MECHANISMS
from gateway.protocols.mtl.settings import PROFILES as MTL_PROFILES
from gateway.protocols.mtl.settings import (
    MTLListenerSettings,
    MTLUpstreamSettings,
    curve_key,
    read_curve_secret_key,
    zmq_bind_address,
    zmq_connect_address,
)
from gateway.protocols.qmqp.settings import (
    DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_QMQP_MAX_MESSAGE_BYTES,
)
from gateway.protocols.qmqp.settings import QMQPListenerSettings, QMQPUpstreamSettings
from gateway.protocols.ssmp.settings import (
    DEFAULT_MAX_BACKLOG_BYTES,
    LOGIN_SCHEMES,
    SSMPListenerSettings,
    SSMPUpstreamSettings,
)
from gateway.protocols.stream.client import parse_offset
from gateway.protocols.stream.settings import (
    CONSUME_FROM,
    DEFAULT_FRAME_MAX,
    StreamListenerSettings,
    StreamUpstreamSettings,
)
from gateway.tls import mtls_verify_mode

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "AdminConfig",
    "ConfigError",
    "ConfigProblem",
    "GatewayConfig",
    "ListenerConfig",
    "LogSettings",
    "UpstreamConfig",
    "endpoint_with_backlog",
    "load_config",
    "load_default_config",
    "load_routes",
    "reload_routes",
]

DEFAULT_CONFIG_NAME: Final = "<embedded default>"
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_TLS_SERVER_PREFIXES: Final = ("mtls:", "ssl:")


# --- errors ------------------------------------------------------------------


@attrs.frozen
class ConfigProblem:
    """One thing wrong with the configuration.

    Attributes:
        file: The file it is in.
        key: The dotted key path (``listeners.hub.endpoint``), or ``-`` for
            the file as a whole.
        reason: What is wrong, and if possible what would be right.
    """

    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}"


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` says every reason."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


# --- frozen configuration ---------------------------------------------------------


@attrs.frozen
class ListenerConfig:
    """A listener: a protocol served on an endpoint.

    Attributes:
        name: Its name, used by routes.
        protocol: ``ssmp`` (more protocols arrive with their issues).
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

    @property
    def listen_endpoint(self) -> str:
        """The endpoint string to listen on: `endpoint` with the backlog, where it takes one."""
        return endpoint_with_backlog(self.endpoint, self.backlog)

    @property
    def tls(self) -> bool:
        """Whether the endpoint terminates TLS."""
        return self.endpoint.startswith(_TLS_SERVER_PREFIXES)


@attrs.frozen
class UpstreamConfig:
    """An upstream: a server the gateway connects to.

    Attributes:
        name: Its name, used by routes.
        protocol: ``ssmp`` (more protocols arrive with their issues).
        endpoint: A Twisted client endpoint string (``tcp:``, ``tls:``...).
        settings: The protocol's own settings object.
    """

    name: str
    protocol: str
    endpoint: str
    settings: Any


@attrs.frozen(kw_only=True)
class LogSettings:
    """The embedded durable log (``[log]`` in the main file).

    Attributes:
        fsync: ``always`` (every commit is fsynced before it is acknowledged),
            ``interval`` (acknowledged after the write, fsynced at most every
            ``fsync_interval_seconds``) or ``never`` (left to the OS, as a
            single RabbitMQ node does).
        fsync_interval_seconds: See ``fsync``.
        segment_bytes: A stream's segment file is rolled past this size.
        max_bytes: Default retention by size of each stream (None: keep all).
        max_age_seconds: Default retention by age (None: keep all).
        record_outcomes: Keep each message's route, source, arrival, outcome
            and its time in the ``msggateway.outcomes`` stream, for the
            Spark report (`gateway.core.outcomes`).
    """

    fsync: str = "always"
    fsync_interval_seconds: float = 0.2
    segment_bytes: int = 64 * 1024 * 1024
    max_bytes: int | None = None
    max_age_seconds: float | None = None
    record_outcomes: bool = True


@attrs.frozen
class AdminConfig:
    """The admin HTTP endpoint; ``endpoint`` None disables it."""

    endpoint: str | None = "tcp:8790:interface=127.0.0.1"


@attrs.frozen
class GatewayConfig:
    """The whole validated configuration.

    Attributes:
        source: The main file's path, or `DEFAULT_CONFIG_NAME`.
        listeners: Listeners in file order.
        upstreams: Upstreams in file order.
        routes: Routes, sorted by name.
        admin: The admin endpoint.
        secrets: The secrets file's contents (empty without one).
        data_dir: Where the gateway keeps state (the durable log, issue 4).
        routes_dir: The directory route files were read from, if any.
        secrets_path: The secrets file, if any.
        inline_routes: Routes written as ``[routes.NAME]`` in the main file.
        log: The embedded log's settings.
    """

    source: str
    listeners: tuple[ListenerConfig, ...]
    upstreams: tuple[UpstreamConfig, ...]
    routes: tuple[Route, ...]
    admin: AdminConfig
    secrets: Secrets = attrs.field(factory=Secrets, repr=False)
    data_dir: Path = Path("var")
    routes_dir: Path | None = None
    secrets_path: Path | None = None
    inline_routes: tuple[Route, ...] = ()
    log: LogSettings = LogSettings()

    def endpoint_names(self) -> dict[str, str]:
        """Every listener and upstream name, with its protocol."""
        names = {listener.name: listener.protocol for listener in self.listeners}
        names.update({upstream.name: upstream.protocol for upstream in self.upstreams})
        return names

    def summary(self) -> str:
        """One line saying what the configuration contains."""

        def names(items: tuple[ListenerConfig, ...] | tuple[UpstreamConfig, ...]) -> str:
            return ", ".join(f"{item.name} ({item.protocol})" for item in items) or "none"

        return (
            f"{self.source}: OK: {len(self.listeners)} listener(s) [{names(self.listeners)}],"
            f" {len(self.upstreams)} upstream(s) [{names(self.upstreams)}],"
            f" {len(self.routes)} route(s),"
            f" admin {'on ' + self.admin.endpoint if self.admin.endpoint else 'off'}"
        )


# --- reading typed values with their key path ---------------------------------------


_REQUIRED: Final = object()


class _Section:
    """A TOML table being read: typed getters that record problems by key path."""

    def __init__(
        self, file: str, path: str, table: Mapping[str, Any], problems: list[ConfigProblem]
    ) -> None:
        self.file = file
        self.path = path
        self.table = table
        self.problems = problems
        self._seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def problem(self, name: str | None, reason: str) -> None:
        key = self.key(name) if name is not None else (self.path or "-")
        self.problems.append(ConfigProblem(self.file, key, reason))

    def _get(self, name: str, default: object, kind: type | tuple[type, ...], what: str) -> Any:
        self._seen.add(name)
        if name not in self.table:
            if default is _REQUIRED:
                self.problem(name, f"is required ({what})")
            return default
        value = self.table[name]
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            self.problem(name, f"must be {what}, not a boolean")
            return default
        if not isinstance(value, kind):
            self.problem(name, f"must be {what}, not {_describe(value)}")
            return default
        return value

    def string(self, name: str, default: object = _REQUIRED) -> Any:
        value = self._get(name, default, str, "a string")
        if isinstance(value, str) and not value and default is _REQUIRED:
            self.problem(name, "must not be empty")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return bool(self._get(name, default, bool, "true or false"))

    def number(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._get(name, default, (int, float), "a number")
        if value is not default and value < minimum:
            self.problem(name, f"must be at least {minimum:g}, not {value}")
            return default
        return float(value)

    def positive(self, name: str, default: float) -> float:
        value = self._get(name, default, (int, float), "a number")
        if value is not default and value <= 0:
            self.problem(name, f"must be greater than 0, not {value}")
            return default
        return float(value)

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        value = self._get(name, default, int, "a whole number")
        if value is not default and value < minimum:
            self.problem(name, f"must be at least {minimum}, not {value}")
            return default
        return int(value)

    def strings(self, name: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self._get(name, list(default), list, "a list of strings")
        bad = [item for item in value if not isinstance(item, str)]
        if bad:
            self.problem(name, f"must hold only strings, not {_describe(bad[0])}")
            return default
        return tuple(value)

    def choice(self, name: str, choices: frozenset[str], default: object = _REQUIRED) -> Any:
        value = self.string(name, default)
        if isinstance(value, str) and value not in choices:
            self.problem(name, f"must be one of {', '.join(sorted(choices))}, not {value!r}")
            return default if default is not _REQUIRED else None
        return value

    def table_items(self, name: str) -> Iterator[tuple[str, _Section]]:
        tables = self._get(name, {}, dict, "a table")
        for child, table in tables.items():
            path = self.key(f"{name}.{child}")
            if not isinstance(table, dict):
                self.problems.append(
                    ConfigProblem(self.file, path, f"must be a table, not {_describe(table)}")
                )
                continue
            yield child, _Section(self.file, path, table, self.problems)

    def section(self, name: str) -> _Section:
        table = self._get(name, {}, dict, "a table")
        return _Section(self.file, self.key(name), table, self.problems)

    def done(self) -> None:
        """Report keys nobody asked for: typos, mostly."""
        for name in self.table:
            if name in self._seen:
                continue
            close = difflib.get_close_matches(name, sorted(self._seen), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known = ", ".join(sorted(self._seen)) or "none"
            self.problem(name, f"unknown key{hint} (known here: {known})")


def _describe(value: object) -> str:
    kind = {
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "a table",
    }
    return f"{kind.get(type(value), type(value).__name__)} ({value!r})"


# --- protocol settings ---------------------------------------------------------------


def _ssmp_listener(section: _Section, tls: bool) -> SSMPListenerSettings:
    schemes = frozenset(section.strings("schemes", ("secret",)))
    for scheme in sorted(schemes - LOGIN_SCHEMES):
        section.problem(
            "schemes",
            f"unknown scheme {scheme!r}; SSMP schemes are {', '.join(sorted(LOGIN_SCHEMES))}",
        )
    if "cert" in schemes and not tls:
        section.problem(
            "schemes", "'cert' needs a TLS endpoint (mtls:...); TLS listeners always offer it"
        )
    return SSMPListenerSettings(
        schemes=frozenset(schemes & LOGIN_SCHEMES),
        anonymous=section.boolean("anonymous", False),
        login_timeout_seconds=section.positive("login_timeout_seconds", 10.0),
        ping_interval_seconds=section.positive("ping_interval_seconds", 30.0),
        pong_timeout_seconds=section.positive("pong_timeout_seconds", 30.0),
        max_backlog_bytes=section.integer(
            "max_backlog_bytes", DEFAULT_MAX_BACKLOG_BYTES, minimum=65536
        ),
        max_pending_replies=section.integer("max_pending_replies", 1000, minimum=1),
    )


def _ssmp_upstream(section: _Section) -> SSMPUpstreamSettings:
    identity = section.string("identity")
    if isinstance(identity, str) and identity and not _is_ssmp_id(identity):
        section.problem("identity", f"{identity!r} is not a valid SSMP identifier")
    topics = section.strings("subscribe")
    for topic in topics:
        if not _is_ssmp_id(topic):
            section.problem("subscribe", f"{topic!r} is not a valid SSMP topic")
    return SSMPUpstreamSettings(
        identity=identity if isinstance(identity, str) else "",
        scheme=section.choice("scheme", frozenset({"secret", "cert", "open"}), "secret"),
        subscribe=topics,
        presence=section.boolean("presence", False),
        ping_interval_seconds=section.positive("ping_interval_seconds", 30.0),
        pong_timeout_seconds=section.positive("pong_timeout_seconds", 30.0),
        max_line_bytes=section.integer("max_line_bytes", 1024, minimum=1024),
        max_in_flight=section.integer("max_in_flight", 1000, minimum=1),
    )


def _qmqp_listener(section: _Section, tls: bool) -> QMQPListenerSettings:
    return QMQPListenerSettings(
        require_auth=section.boolean("require_auth", False),
        max_message_bytes=section.integer(
            "max_message_bytes", DEFAULT_QMQP_MAX_MESSAGE_BYTES, minimum=1024
        ),
        max_in_flight=section.integer("max_in_flight", 1000, minimum=1),
        max_in_flight_bytes=section.integer("max_in_flight_bytes", 64 * 1024 * 1024, minimum=65536),
        idle_timeout_seconds=section.positive("idle_timeout_seconds", 120.0),
    )


def _qmqp_upstream(section: _Section) -> QMQPUpstreamSettings:
    username = section.string("username", None)
    return QMQPUpstreamSettings(
        username=username if isinstance(username, str) else None,
        auth_success_reply=section.choice("auth_success_reply", frozenset({"1", "0"}), "1"),
        window=section.integer("window", 100, minimum=1),
        max_queue=section.integer("max_queue", 10000, minimum=1),
        max_attempts=section.integer("max_attempts", 5, minimum=1),
        retry_initial_seconds=section.positive("retry_initial_seconds", 1.0),
        retry_max_seconds=section.positive("retry_max_seconds", 30.0),
        max_message_bytes=section.integer("max_message_bytes", 1024 * 1024, minimum=1024),
    )


def _dmp_listener(section: _Section, tls: bool) -> DMPListenerSettings:
    sinks = frozenset(section.strings("sinks"))
    feeds = frozenset(section.strings("feeds"))
    leases: dict[str, LeaseGrant] = {}
    for name, grant in section.table_items("leases"):
        sink, feed = grant.string("sink", None), grant.string("feed", None)
        expires_text = grant.string("expires", None)
        text = grant.string("text", None)
        identity = grant.string("identity", None)
        grant.done()
        if (sink is None) == (feed is None):
            grant.problem(None, "a lease names exactly one sink or one feed")
            continue
        kind, target = ("sink", sink) if sink is not None else ("feed", feed)
        if target not in (sinks if kind == "sink" else feeds):
            grant.problem(kind, f"no {kind} named {target!r} in {kind}s")
            continue
        expires: float | None = None
        if isinstance(expires_text, str):
            try:
                moment = datetime.datetime.fromisoformat(expires_text)
            except ValueError:
                grant.problem("expires", f"{expires_text!r} is not an ISO 8601 date and time")
                continue
            if moment.tzinfo is None:
                grant.problem("expires", "needs a time zone, such as 2027-01-01T00:00:00Z")
                continue
            expires = moment.timestamp()
        leases[name] = LeaseGrant(
            kind=kind,
            target=target,
            expires=expires,
            text=text.encode("utf-8") if isinstance(text, str) else None,
            identity=identity if isinstance(identity, str) else None,
        )
    return DMPListenerSettings(
        sinks=sinks,
        feeds=feeds,
        leases=leases,
        heartbeat_seconds=section.number("heartbeat_seconds", 10.0),
        idle_timeout_seconds=section.number("idle_timeout_seconds", 0.0),
        handshake_timeout_seconds=section.positive("handshake_timeout_seconds", 10.0),
        max_envelope_bytes=section.integer(
            "max_envelope_bytes", DEFAULT_DMP_MAX_ENVELOPE_BYTES, minimum=64
        ),
        max_in_flight=section.integer("max_in_flight", 1000, minimum=1),
        max_feed_backlog_bytes=section.integer(
            "max_feed_backlog_bytes", 4 * 1024 * 1024, minimum=65536
        ),
        principals=frozenset(section.strings("principals")),
        principal_lease_seconds=section.positive("principal_lease_seconds", 60.0),
    )


def _mtl_listener(section: _Section, tls: bool) -> MTLListenerSettings:
    profiles = tuple(
        profile.lower() for profile in section.strings("profiles", ("test", "gateway"))
    )
    unknown = [profile for profile in profiles if profile not in MTL_PROFILES]
    if unknown or not profiles:
        section.problem("profiles", f"choose from {', '.join(sorted(MTL_PROFILES))}")
    endpoint = section.table.get("endpoint")
    if isinstance(endpoint, str):
        try:
            zmq_bind_address(endpoint)
        except ValueError as exc:
            section.problem("endpoint", str(exc))
    mechanisms = tuple(mechanism.upper() for mechanism in section.strings("mechanisms", ("PLAIN",)))
    if not mechanisms or any(mechanism not in MTL_LISTENER_MECHANISMS for mechanism in mechanisms):
        section.problem("mechanisms", f"choose from {', '.join(MTL_LISTENER_MECHANISMS)}")
    curve_secret = _mtl_curve_secret(section)
    identities = _mtl_curve_identities(section, curve_secret)
    if "EXTERNAL" in mechanisms and not identities:
        section.problem(
            "mechanisms", "EXTERNAL needs curve_identities (the identities of CURVE client keys)"
        )
    return MTLListenerSettings(
        profiles=profiles,
        require_auth=section.boolean("require_auth", False),
        mechanisms=mechanisms,
        curve_secret_key=curve_secret,
        curve_client_keys=_mtl_client_keys(section, curve_secret),
        curve_identities=identities,
        allow_addresses=_mtl_networks(section),
        data_port=section.integer("data_port", 0, minimum=0),
        max_backlog_messages=section.integer("max_backlog_messages", 10_000, minimum=1),
        ping_interval_seconds=section.positive("ping_interval_seconds", 10.0),
        dead_after_seconds=section.positive("dead_after_seconds", 30.0),
    )


def _mtl_curve_secret(section: _Section) -> bytes | None:
    name = section.string("curve_secret_key_file", None)
    if not isinstance(name, str):
        return None
    try:  # relative to the file that names it
        return read_curve_secret_key(Path(section.file).parent / name)
    except ValueError as exc:
        section.problem("curve_secret_key_file", str(exc))
        return None


def _mtl_client_keys(section: _Section, curve_secret: bytes | None) -> tuple[bytes, ...]:
    keys = []
    for text in section.strings("curve_client_keys"):
        try:
            keys.append(curve_key(text))
        except ValueError as exc:
            section.problem("curve_client_keys", str(exc))
    if keys and curve_secret is None and "curve_secret_key_file" not in section.table:
        section.problem("curve_client_keys", "needs curve_secret_key_file (CURVE on)")
    return tuple(keys)


def _mtl_curve_identities(section: _Section, curve_secret: bytes | None) -> dict[str, bytes]:
    """``[listeners.NAME.curve_identities]``: identity = Z85 CURVE public key."""
    table = section.section("curve_identities")
    identities: dict[str, bytes] = {}
    for name in list(table.table):
        text = table.string(name)
        if not isinstance(text, str):
            continue
        try:
            identities[name] = curve_key(text)
        except ValueError as exc:
            table.problem(name, str(exc))
    table.done()
    if identities and curve_secret is None and "curve_secret_key_file" not in section.table:
        section.problem("curve_identities", "needs curve_secret_key_file (CURVE on)")
    return identities


def _mtl_networks(section: _Section) -> tuple[str, ...]:
    networks = section.strings("allow_addresses")
    for text in networks:
        try:
            ipaddress.ip_network(text, strict=False)
        except ValueError as exc:
            section.problem("allow_addresses", str(exc))
    return networks


def _mtl_curve_public(section: _Section) -> bytes | None:
    text = section.string("curve_server_key", None)
    if not isinstance(text, str):
        return None
    try:
        return curve_key(text)
    except ValueError as exc:
        section.problem("curve_server_key", str(exc))
        return None


def _mtl_upstream(section: _Section) -> MTLUpstreamSettings:
    endpoint = section.table.get("endpoint")
    if isinstance(endpoint, str):
        try:
            zmq_connect_address(endpoint)
        except ValueError as exc:
            section.problem("endpoint", str(exc))
    username = section.string("username", None)
    profile = section.string("profile", "gateway")
    if isinstance(profile, str) and profile.lower() not in MTL_PROFILES:
        section.problem("profile", f"choose from {', '.join(sorted(MTL_PROFILES))}")
    confirm = section.choice("confirm", frozenset({"none", "full"}), "full")
    if isinstance(profile, str) and profile.lower() == "test" and confirm == "full":
        section.problem(
            "confirm", 'the test profile never confirms (the server answers 501): set "none"'
        )
    server_key = _mtl_curve_public(section)
    if server_key is None and "curve_secret_key_file" in section.table:
        section.problem("curve_secret_key_file", "needs curve_server_key (CURVE on)")
    return MTLUpstreamSettings(
        mode=section.choice("mode", frozenset({"writer", "reader"}), "writer"),
        profile=profile.lower() if isinstance(profile, str) else "gateway",
        resources=section.strings("resources"),
        confirm=confirm,
        username=username if isinstance(username, str) else None,
        mechanism=section.choice("mechanism", frozenset(MTL_MECHANISMS), "PLAIN"),
        curve_server_key=server_key,
        curve_secret_key=_mtl_curve_secret(section),
        request_timeout_seconds=section.positive("request_timeout_seconds", 10.0),
        ping_interval_seconds=section.positive("ping_interval_seconds", 10.0),
        dead_after_seconds=section.positive("dead_after_seconds", 30.0),
    )


def _dmp_upstream(section: _Section) -> DMPUpstreamSettings:
    return DMPUpstreamSettings(
        mode=section.choice("mode", frozenset({"put", "get"}), "put"),
        exchange=section.string("exchange", ""),
        heartbeat_seconds=section.number("heartbeat_seconds", 10.0),
        dead_after_seconds=section.number("dead_after_seconds", 0.0),
        max_envelope_bytes=section.integer(
            "max_envelope_bytes", DEFAULT_DMP_MAX_ENVELOPE_BYTES, minimum=64
        ),
        max_backlog_bytes=section.integer("max_backlog_bytes", 4 * 1024 * 1024, minimum=65536),
        **_dmp_principal(section),
    )


def _dmp_principal(section: _Section) -> dict[str, Any]:
    principal = section.string("principal", None)
    target = section.string("target", "")
    if principal is not None and not target:
        section.problem("target", "names the remote sink or feed when principal is set")
    return {"principal": principal, "target": target}


def _log_settings(section: _Section) -> LogSettings:
    max_bytes = section.integer("max_bytes", 0, minimum=0)
    max_age = section.number("max_age_seconds", 0.0)
    return LogSettings(
        fsync=section.choice("fsync", frozenset({"always", "interval", "never"}), "always"),
        fsync_interval_seconds=section.positive("fsync_interval_seconds", 0.2),
        segment_bytes=section.integer("segment_bytes", 64 * 1024 * 1024, minimum=4096),
        max_bytes=max_bytes or None,
        max_age_seconds=max_age or None,
        record_outcomes=section.boolean("record_outcomes", True),
    )


def _stream_listener(section: _Section, tls: bool) -> StreamListenerSettings:
    port = section.integer("advertised_port", 0, minimum=0)
    host = section.string("advertised_host", None)
    return StreamListenerSettings(
        advertised_host=host if isinstance(host, str) else None,
        advertised_port=port or None,
        guest=section.boolean("guest", False),
        anonymous=section.boolean("anonymous", False),
        virtual_hosts=frozenset(section.strings("virtual_hosts", ("/",))),
        frame_max=section.integer("frame_max", DEFAULT_FRAME_MAX, minimum=0),
        heartbeat_seconds=section.integer("heartbeat_seconds", 60, minimum=0),
        max_unconfirmed=section.integer("max_unconfirmed", 50_000, minimum=1),
        handshake_timeout_seconds=section.positive("handshake_timeout_seconds", 10.0),
    )


def _stream_upstream(section: _Section) -> StreamUpstreamSettings:
    stream = section.string("stream", None)
    reference = section.string("publisher_reference", None)
    consumer = section.string("consumer_name", None)
    offset = section.string("offset", "next")
    if isinstance(offset, str):
        try:
            parse_offset(offset)
        except ValueError as exc:
            section.problem("offset", str(exc))
            offset = "next"
    return StreamUpstreamSettings(
        username=section.string("username", "guest"),
        virtual_host=section.string("virtual_host", "/"),
        stream=stream if isinstance(stream, str) else None,
        publisher_reference=reference if isinstance(reference, str) else None,
        batch_size=section.integer("batch_size", 1000, minimum=1),
        max_unconfirmed=section.integer("max_unconfirmed", 20_000, minimum=1),
        max_queue=section.integer("max_queue", 100_000, minimum=1),
        subscribe=section.strings("subscribe"),
        offset=offset,
        consumer_name=consumer if isinstance(consumer, str) else None,
        store_offset_interval_seconds=section.positive("store_offset_interval_seconds", 5.0),
        credit=section.integer("credit", 10, minimum=1),
        create_streams=section.boolean("create_streams", False),
        heartbeat_seconds=section.integer("heartbeat_seconds", 60, minimum=0),
        frame_max=section.integer("frame_max", DEFAULT_FRAME_MAX, minimum=0),
        consume_from=section.choice("consume_from", CONSUME_FROM, "leader"),
    )


def _frontend_listener(section: _Section, tls: bool) -> FrontendSettings:
    mode = mtls_verify_mode(str(section.table.get("endpoint", "")))
    if mode in (None, "none"):
        section.problem(
            "endpoint",
            "a front-end needs an mtls: endpoint with caCerts (it lets in only clients "
            "with a verified certificate)",
        )
    elif mode != "required":
        section.problem("endpoint", "a front-end needs verify=required (the default)")
    backend = section.string("backend")
    if isinstance(backend, str) and backend:
        _check_client_endpoint(section, "backend", backend)
    return FrontendSettings(
        speaks=section.choice("speaks", SPEAKS) or "stream",
        backend=backend if isinstance(backend, str) else "",
        connect_timeout_seconds=section.positive("connect_timeout_seconds", 10.0),
        handshake_timeout_seconds=section.positive("handshake_timeout_seconds", 10.0),
    )


def _is_ssmp_id(value: str) -> bool:
    from gateway.codecs.ssmp import is_valid_id

    return value.isascii() and is_valid_id(value.encode("ascii"))


_LISTENER_SETTINGS: Final[dict[str, Callable[[_Section, bool], Any]]] = {
    "ssmp": _ssmp_listener,
    "qmqp": _qmqp_listener,
    "stream": _stream_listener,
    "dmp": _dmp_listener,
    "mtl": _mtl_listener,
    "frontend": _frontend_listener,
}
_UPSTREAM_SETTINGS: Final[dict[str, Callable[[_Section], Any]]] = {
    "ssmp": _ssmp_upstream,
    "qmqp": _qmqp_upstream,
    "stream": _stream_upstream,
    "dmp": _dmp_upstream,
    "mtl": _mtl_upstream,
}


# --- endpoints --------------------------------------------------------------------------


_BACKLOG_ENDPOINTS: Final = ("tcp:", "tcp6:", "ssl:", "unix:", "mtls:")
_BACKLOG_PARAMETER: Final = re.compile(r"(?<!\\):backlog=")


def endpoint_with_backlog(description: str, backlog: int) -> str:
    """A server endpoint string with ``backlog=`` added, unless it has one or takes none."""
    if not description.startswith(_BACKLOG_ENDPOINTS) or _BACKLOG_PARAMETER.search(description):
        return description
    return f"{description}:backlog={backlog}"


def _check_server_endpoint(section: _Section, name: str, description: str) -> None:
    try:
        serverFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        section.problem(name, f"bad server endpoint {description!r}: {_exc_text(exc)}")


def _check_client_endpoint(section: _Section, name: str, description: str) -> None:
    try:
        clientFromString(MemoryReactor(), description)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        section.problem(name, f"bad client endpoint {description!r}: {_exc_text(exc)}")


def _exc_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, TypeError) and "unexpected keyword" in text:
        return f"unknown parameter ({text})"
    return text


# --- files --------------------------------------------------------------------------------


def _read_toml(path: Path, problems: list[ConfigProblem]) -> dict[str, Any] | None:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        problems.append(ConfigProblem(str(path), "-", "file not found"))
    except OSError as exc:
        problems.append(ConfigProblem(str(path), "-", f"cannot read: {exc.strerror}"))
    except tomllib.TOMLDecodeError as exc:
        problems.append(ConfigProblem(str(path), "-", f"not valid TOML: {exc}"))
    return None


def _load_secrets(path: Path, problems: list[ConfigProblem]) -> Secrets:
    data = _read_toml(path, problems)
    if data is None:
        return Secrets()
    root = _Section(str(path), "", data, problems)
    groups: dict[str, dict[str, bytes]] = {}
    for group in ("logins", "upstreams"):
        section = root.section(group)
        values: dict[str, bytes] = {}
        for key in section.table:
            value = section.string(key)
            if isinstance(value, str):
                values[key] = value.encode("utf-8")
        groups[group] = values
    frontends: dict[str, dict[str, bytes]] = {}
    for listener, table in root.table_items("frontends"):
        frontends[listener] = {}
        for key in table.table:
            value = table.string(key)
            if isinstance(value, str):
                frontends[listener][key] = value.encode("utf-8")
    root.done()
    return Secrets(logins=groups["logins"], upstreams=groups["upstreams"], frontends=frontends)


def _route_from(
    file: str, name: str, path: str, data: dict[str, Any], problems: list[ConfigProblem]
) -> Route | None:
    """Validate one route: a whole route file (``path`` empty) or a ``[routes.NAME]`` table."""
    section = _Section(file, path, data, problems)
    before = len(problems)
    section.string("description", "")
    source = section.string("from")
    destination = section.string("to")
    match = section.string("match")
    address = section.string("address", None)
    match_sender = section.string("match_sender", None)
    recipients = section.strings("recipients")
    envelope_sender = section.string("envelope_sender", None)
    body = section.choice("body", frozenset(TRANSFORMS), "unchanged")
    durable = section.boolean("durable", False)
    max_attempts = section.integer("max_attempts", 5, minimum=1)
    dead_letter = section.string("dead_letter", "msggateway.dead-letter")
    timeout = section.positive("timeout_seconds", DEFAULT_ROUTE_TIMEOUT_SECONDS)
    section.done()
    pattern: AddressPattern | None = None
    target: AddressTemplate | None = None
    sender_pattern: AddressPattern | None = None
    if isinstance(match, str) and match:
        try:
            pattern = AddressPattern(match)
        except PatternError as exc:
            section.problem("match", str(exc))
    if isinstance(match_sender, str):
        try:
            sender_pattern = AddressPattern(match_sender)
        except PatternError as exc:
            section.problem("match_sender", str(exc))
    if recipients and address is not None:
        section.problem(
            "recipients", "give either address (a template) or recipients (fixed), not both"
        )
    for recipient in recipients:
        if not recipient or recipient != recipient.strip():
            section.problem("recipients", f"{recipient!r} is not an address")
    if isinstance(address, str):
        try:
            target = AddressTemplate(address)
            if pattern is not None:
                target.check_against(pattern)
        except PatternError as exc:
            section.problem("address", str(exc))
    if len(problems) > before or pattern is None:
        return None
    return Route(
        name=name,
        source=source,
        pattern=pattern,
        destination=destination,
        target=target,
        durable=durable,
        timeout_seconds=timeout,
        match_sender=sender_pattern,
        recipients=recipients,
        envelope_sender=envelope_sender if isinstance(envelope_sender, str) else None,
        body=body if isinstance(body, str) else "unchanged",
        max_attempts=max_attempts,
        dead_letter=dead_letter if isinstance(dead_letter, str) else "msggateway.dead-letter",
    )


def load_routes(directory: Path, problems: list[ConfigProblem]) -> tuple[Route, ...]:
    """Read every ``*.toml`` route file of a directory, in name order."""
    if not directory.is_dir():
        problems.append(ConfigProblem(str(directory), "-", "routes directory not found"))
        return ()
    routes: list[Route] = []
    for path in sorted(directory.glob("*.toml")):
        if not _NAME.match(path.stem):
            problems.append(
                ConfigProblem(str(path), "-", "a route file name must be letters, digits, _.-")
            )
            continue
        data = _read_toml(path, problems)
        if data is not None:
            route = _route_from(str(path), path.stem, "", data, problems)
            if route is not None:
                routes.append(route)
    return tuple(routes)


_UNDELIVERABLE_LISTENERS: Final = {
    "qmqp": "a QMQP listener (its clients send; nothing is delivered to them)",
    "frontend": "a TLS front-end (it relays its clients to its backend, outside any route)",
}
"""Listener protocols that routes cannot deliver to, and why."""


def _check_routes(
    routes: tuple[Route, ...], config: GatewayConfig, problems: list[ConfigProblem]
) -> None:
    endpoints = config.endpoint_names()
    listeners = {listener.name: listener.protocol for listener in config.listeners}
    known = ", ".join(sorted(endpoints)) or "none"
    for route in routes:
        file, prefix = _route_file(config, route)
        why = _UNDELIVERABLE_LISTENERS.get(listeners.get(route.destination, ""))
        if why is not None:
            reason = f"{route.destination!r} is {why}; routes cannot end there"
            problems.append(ConfigProblem(file, prefix + "to", reason))
        for key, name in (("from", route.source), ("to", route.destination)):
            if name not in endpoints:
                reason = f"no listener or upstream named {name!r} (known: {known})"
                problems.append(ConfigProblem(file, prefix + key, reason))
        # A DMP listener's sinks feed routing and its feeds are delivered to:
        # sink to feed on one listener is no loop.
        if route.source == route.destination and listeners.get(route.source) != "dmp":
            reason = "a route must not deliver back to where it takes from"
            problems.append(ConfigProblem(file, prefix + "to", reason))


def _parse_main(
    file: str,
    data: dict[str, Any],
    base: Path,
    problems: list[ConfigProblem],
) -> GatewayConfig:
    root = _Section(file, "", data, problems)
    gateway = root.section("gateway")
    data_dir = base / gateway.string("data_dir", "var")
    routes_name = gateway.string("routes", None)
    secrets_name = gateway.string("secrets", None)
    gateway.done()

    log_section = root.section("log")
    log = _log_settings(log_section)
    log_section.done()

    admin_section = root.section("admin")
    admin_endpoint = admin_section.string("endpoint", AdminConfig().endpoint)
    if admin_section.boolean("enabled", True) and isinstance(admin_endpoint, str):
        _check_server_endpoint(admin_section, "endpoint", admin_endpoint)
        admin = AdminConfig(admin_endpoint)
    else:
        admin = AdminConfig(None)
    admin_section.done()

    names: set[str] = set()
    listeners: list[ListenerConfig] = []
    for name, section in root.table_items("listeners"):
        listener = _listener(name, section, names)
        if listener is not None:
            listeners.append(listener)
    upstreams: list[UpstreamConfig] = []
    for name, section in root.table_items("upstreams"):
        upstream = _upstream(name, section, names)
        if upstream is not None:
            upstreams.append(upstream)
    inline: list[Route] = []
    for name, section in root.table_items("routes"):
        route = _route_from(file, name, section.path, dict(section.table), problems)
        if route is not None:
            inline.append(route)
    root.done()

    secrets_path = base / secrets_name if isinstance(secrets_name, str) else None
    secrets = _load_secrets(secrets_path, problems) if secrets_path else Secrets()
    for listener in listeners:
        for lease, grant in getattr(listener.settings, "leases", {}).items():
            if grant.text is None and lease not in secrets.logins:
                problems.append(
                    ConfigProblem(
                        str(secrets_path) if secrets_path else file,
                        f"listeners.{listener.name}.leases.{lease}",
                        f"lease {lease!r} has no lease text: put it under [logins] {lease}",
                    )
                )
    for listener in listeners:
        if (
            listener.protocol == "frontend"
            and listener.settings.speaks == "ssmp"
            and not secrets.frontends.get(listener.name)
        ):
            problems.append(
                ConfigProblem(
                    str(secrets_path) if secrets_path else file,
                    f"frontends.{listener.name}",
                    "an SSMP front-end logs in to its backend with a secret per certificate "
                    f"name: put them (or '*') under [frontends.{listener.name}]",
                )
            )
    for upstream in upstreams:
        username = getattr(upstream.settings, "username", None)
        if getattr(upstream.settings, "scheme", None) == "secret":
            how = "logs in with scheme 'secret'"
        elif upstream.protocol == "dmp" and getattr(upstream.settings, "principal", None):
            how = f"logs in as principal {upstream.settings.principal!r} (its secret)"
        elif upstream.protocol == "dmp":
            how = "presents a lease (its secret)"
        elif username is not None and not (upstream.protocol == "stream" and username == "guest"):
            how = f"authenticates as {username!r}"
        else:
            continue  # no secret needed (a stream upstream's guest defaults to "guest")
        if secrets.credential_for(upstream.name) is None:
            where = str(secrets_path) if secrets_path else file
            problems.append(
                ConfigProblem(
                    where,
                    f"upstreams.{upstream.name}",
                    f"upstream {how} but no secret is configured for it"
                    + ("" if secrets_path else " (and gateway.secrets names no secrets file)"),
                )
            )

    routes_dir = base / routes_name if isinstance(routes_name, str) else None
    config = GatewayConfig(
        source=file,
        listeners=tuple(listeners),
        upstreams=tuple(upstreams),
        routes=(),
        admin=admin,
        secrets=secrets,
        data_dir=data_dir,
        routes_dir=routes_dir,
        secrets_path=secrets_path,
        inline_routes=tuple(inline),
        log=log,
    )
    routes = _all_routes(config, problems)
    return attrs.evolve(config, routes=routes)


def _all_routes(config: GatewayConfig, problems: list[ConfigProblem]) -> tuple[Route, ...]:
    """The main file's ``[routes.NAME]`` tables plus the route files, checked together."""
    from_files = load_routes(config.routes_dir, problems) if config.routes_dir else ()
    inline_names = {route.name for route in config.inline_routes}
    for route in from_files:
        if route.name in inline_names:
            problems.append(
                ConfigProblem(
                    _route_file(config, route)[0],
                    "-",
                    f"route {route.name!r} is also defined in {config.source} [routes]",
                )
            )
    routes = tuple(sorted((*config.inline_routes, *from_files), key=lambda route: route.name))
    _check_routes(routes, config, problems)
    return routes


def _route_file(config: GatewayConfig, route: Route) -> tuple[str, str]:
    """Where a route was written: its file, and the key prefix within it."""
    if route in config.inline_routes:
        return config.source, f"routes.{route.name}."
    if config.routes_dir is not None:
        return str(config.routes_dir / f"{route.name}.toml"), ""
    return route.name, ""


def _endpoint_head(
    section: _Section, name: str, names: set[str], protocols: frozenset[str]
) -> tuple[str, str] | None:
    if not _NAME.match(name):
        section.problem(None, "a name must be letters, digits, _ . - (and start with one)")
    if name in names:
        section.problem(None, f"name {name!r} is used twice; listeners and upstreams share names")
    names.add(name)
    protocol = section.choice("protocol", protocols)
    endpoint = section.string("endpoint")
    if not isinstance(protocol, str) or not isinstance(endpoint, str):
        return None
    return protocol, endpoint


def _listener(name: str, section: _Section, names: set[str]) -> ListenerConfig | None:
    head = _endpoint_head(section, name, names, frozenset(_LISTENER_SETTINGS))
    if head is None:
        # No section.done(): without protocol and endpoint the protocol's own
        # settings were never read, and calling them unknown keys would mislead.
        return None
    protocol, endpoint = head
    _check_server_endpoint(section, "endpoint", endpoint)
    tls = endpoint.startswith(_TLS_SERVER_PREFIXES)
    settings = _LISTENER_SETTINGS[protocol](section, tls)
    max_connections = section.integer("max_connections", DEFAULT_MAX_CONNECTIONS, minimum=1)
    per_identity = section.integer("max_connections_per_identity", 0, minimum=0)
    backlog = section.integer("backlog", DEFAULT_LISTEN_BACKLOG, minimum=1)
    frame_timeout = section.number("frame_timeout_seconds", DEFAULT_FRAME_TIMEOUT_SECONDS)
    if "backlog" in section.table and _BACKLOG_PARAMETER.search(endpoint):
        section.problem(
            "backlog", "the endpoint sets backlog= too: give the listen queue in one place"
        )
    authorization = _authorization(section)
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
    )


def _authorization(section: _Section) -> Authorization:
    """Read ``[listeners.NAME.authorize.IDENTITY]`` tables of publish and consume patterns."""
    present = "authorize" in section.table
    grants: dict[str, Grant] = {}
    for identity, table in section.table_items("authorize"):
        lists: dict[str, tuple[AddressPattern, ...]] = {}
        for action in ("publish", "consume"):
            patterns = []
            for text in table.strings(action):
                try:
                    patterns.append(AddressPattern(text))
                except PatternError as exc:
                    table.problem(action, str(exc))
            lists[action] = tuple(patterns)
        table.done()
        grants[identity] = Grant(publish=lists["publish"], consume=lists["consume"])
    # An empty table is restrictive too: nothing granted, everything refused.
    return Authorization(grants) if present else UNRESTRICTED


def _upstream(name: str, section: _Section, names: set[str]) -> UpstreamConfig | None:
    head = _endpoint_head(section, name, names, frozenset(_UPSTREAM_SETTINGS))
    if head is None:
        # No section.done(): without protocol and endpoint the protocol's own
        # settings were never read, and calling them unknown keys would mislead.
        return None
    protocol, endpoint = head
    _check_client_endpoint(section, "endpoint", endpoint)
    settings = _UPSTREAM_SETTINGS[protocol](section)
    section.done()
    return UpstreamConfig(name=name, protocol=protocol, endpoint=endpoint, settings=settings)


# --- entry points ------------------------------------------------------------------------------


def load_config(path: Path) -> GatewayConfig:
    """Read and validate a main config file, its route files and secrets.

    Relative paths in the file (``data_dir``, ``routes``, ``secrets``) are
    relative to the file's directory.

    Raises:
        ConfigError: With every problem found.
    """
    problems: list[ConfigProblem] = []
    data = _read_toml(path, problems)
    if data is None:
        raise ConfigError(problems)
    config = _parse_main(str(path), data, path.parent, problems)
    if problems:
        raise ConfigError(problems)
    return config


def load_default_config() -> GatewayConfig:
    """Return the embedded default: everything on loopback, nothing external.

    Raises:
        ConfigError: Never for the shipped file; tests make sure of it.
    """
    text = resources.files("gateway").joinpath("default.toml").read_text("utf-8")
    problems: list[ConfigProblem] = []
    config = _parse_main(DEFAULT_CONFIG_NAME, tomllib.loads(text), Path.cwd(), problems)
    if problems:
        raise ConfigError(problems)
    return config


def reload_secrets(config: GatewayConfig) -> Secrets | None:
    """Re-read the secrets file of a running configuration (SIGHUP); None without one.

    Raises:
        ConfigError: The file cannot be read or is invalid; the caller keeps the old secrets.
    """
    if config.secrets_path is None:
        return None
    problems: list[ConfigProblem] = []
    secrets = _load_secrets(config.secrets_path, problems)
    if problems:
        raise ConfigError(problems)
    return secrets


def reload_routes(config: GatewayConfig) -> tuple[Route, ...]:
    """Re-read the route files of a running configuration (SIGHUP).

    Routes in the main file stay as they were loaded.

    Raises:
        ConfigError: The new routes are invalid; the caller keeps the old ones.
    """
    problems: list[ConfigProblem] = []
    routes = _all_routes(config, problems)
    if problems:
        raise ConfigError(problems)
    return routes
