"""The main file's own tables: ``[gateway]`` (paths, stopping), ``[log]`` and ``[admin]``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from gateway.admin.channel import HostError, host_name
from gateway.config.base import (
    Section,
    TableSchema,
    boolean,
    choice,
    integer,
    number,
    optional_string,
    positive,
    string,
    strings,
)
from gateway.config.endpoints import check_server_endpoint, with_paths_resolved
from gateway.core.log.writer import INLINE_MAX_BYTES

__all__ = [
    "ADMIN",
    "DEFAULT_SHUTDOWN_GRACE_SECONDS",
    "GATEWAY",
    "LOG",
    "AdminConfig",
    "GatewayTable",
    "LogSettings",
    "read_admin",
    "read_gateway",
    "read_log",
]


# --- [gateway] ------------------------------------------------------------------

DATA_DIR: Final = string(
    "data_dir", "var", doc="Where the gateway keeps state: the durable log lives in data_dir/log."
)
ROUTES_DIR: Final = optional_string(
    "routes",
    doc="A directory of route files, one route per ``*.toml`` file (reloaded on SIGHUP).",
    shown="none: routes are only ``[routes.NAME]`` tables",
)
SECRETS_FILE: Final = optional_string(
    "secrets", doc="The secrets file (reloaded on SIGHUP).", shown="none: no secrets"
)

DEFAULT_SHUTDOWN_GRACE_SECONDS: Final = 10.0
"""How long a stop may take to answer what was read before it closes connections: long
enough for a durable route's last group commits and a direct route's last outcomes,
short enough for the 30 s a service manager commonly allows a stop (TimeoutStopSec)."""
SHUTDOWN_GRACE_SECONDS: Final = number(
    "shutdown_grace_seconds",
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    doc="On SIGTERM or SIGINT the gateway stops listening and reading, then waits this long"
    " at most for what it read to be answered (committed, delivered) and for its connections"
    " to close; what is unanswered then is told to retry later as its protocol allows."
    " 0: close at once. A service manager's stop time-out must exceed it.",
)

GATEWAY: Final = TableSchema(
    "Gateway",
    "[gateway]",
    (DATA_DIR, ROUTES_DIR, SECRETS_FILE, SHUTDOWN_GRACE_SECONDS),
    doc="Where things are, and how long a stop may take. Relative paths are relative to the"
    " main file's directory.",
)


@attrs.frozen
class GatewayTable:
    """The ``[gateway]`` table, with its paths made absolute.

    Attributes:
        data_dir: Where the gateway keeps state.
        routes_dir: The route files' directory, if any.
        secrets_path: The secrets file, if any.
        shutdown_grace_seconds: The longest a clean stop waits for answers
            and closes (`SHUTDOWN_GRACE_SECONDS`).
    """

    data_dir: Path
    routes_dir: Path | None
    secrets_path: Path | None
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS


def read_gateway(section: Section, base: Path) -> GatewayTable:
    """The ``[gateway]`` table; its paths relative to ``base``."""
    data_dir = base / section.read(DATA_DIR)
    routes = section.read(ROUTES_DIR)
    secrets = section.read(SECRETS_FILE)
    grace = section.read(SHUTDOWN_GRACE_SECONDS)
    section.done()
    return GatewayTable(
        data_dir=data_dir,
        routes_dir=base / routes if routes is not None else None,
        secrets_path=base / secrets if secrets is not None else None,
        shutdown_grace_seconds=grace,
    )


# --- [log] ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LogSettings:
    """The embedded durable log (``[log]`` in the main file).

    Attributes:
        fsync: ``always`` (every commit is fsynced before it is acknowledged),
            ``interval`` (acknowledged after the write, fsynced at most every
            ``fsync_interval_seconds``) or ``never`` (left to the OS, as a
            single RabbitMQ node does).
        fsync_interval_seconds: See ``fsync``.
        inline_commit_max_bytes: Under ``fsync = "always"``, a commit up to
            this size is written and fsynced on the reactor thread while the
            writer thread is idle and the disk is quick
            (`gateway.core.log.writer`); 0: never.
        segment_bytes: A stream's segment file is rolled past this size.
        max_bytes: Default retention by size of each stream (None: keep all).
        max_age_seconds: Default retention by age (None: keep all).
        record_outcomes: Keep each message's route, source, arrival, outcome
            and its time in the ``msggateway.outcomes`` stream, for the
            Spark report (`gateway.core.outcomes`).
    """

    fsync: str = "always"
    fsync_interval_seconds: float = 0.2
    inline_commit_max_bytes: int = INLINE_MAX_BYTES
    segment_bytes: int = 64 * 1024 * 1024
    max_bytes: int | None = None
    max_age_seconds: float | None = None
    record_outcomes: bool = True


FSYNC: Final = choice(
    "fsync",
    frozenset({"always", "interval", "never"}),
    "always",
    doc="``always``: every commit is fsynced before anything is acknowledged; ``interval``:"
    " acknowledged after the write, fsynced every fsync_interval_seconds; ``never``: left to"
    " the operating system, as a single RabbitMQ node does.",
)
FSYNC_INTERVAL_SECONDS: Final = positive(
    "fsync_interval_seconds", 0.2, doc='How often the log is fsynced under fsync = "interval".'
)
INLINE_COMMIT_MAX_BYTES: Final = integer(
    "inline_commit_max_bytes",
    INLINE_MAX_BYTES,
    doc='Under fsync = "always", a commit of up to this many bytes is written and fsynced by'
    " the gateway's main thread instead of being handed to the log's writer thread, while"
    " that thread is idle and recent fsyncs took under 1 ms: the handoff costs more than a"
    " quick fsync (docs/durability.rst). 0: always hand over.",
)
SEGMENT_BYTES: Final = integer(
    "segment_bytes",
    LogSettings().segment_bytes,
    minimum=4096,
    doc="A stream's segment file is rolled past this size.",
)
MAX_BYTES: Final = integer(
    "max_bytes",
    0,
    doc="Default retention of each stream by size: whole segments past it are dropped.",
    shown="0 (keep all)",
)
MAX_AGE_SECONDS: Final = number(
    "max_age_seconds",
    0.0,
    doc="Default retention of each stream by age: whole segments older are dropped.",
    shown="0 (keep all)",
)
RECORD_OUTCOMES: Final = boolean(
    "record_outcomes",
    True,
    doc="Keep each message's route, source, arrival and outcome in the msggateway.outcomes"
    " stream, for the Spark report.",
)

LOG: Final = TableSchema(
    "Durable log",
    "[log]",
    (
        FSYNC,
        FSYNC_INTERVAL_SECONDS,
        INLINE_COMMIT_MAX_BYTES,
        SEGMENT_BYTES,
        MAX_BYTES,
        MAX_AGE_SECONDS,
        RECORD_OUTCOMES,
    ),
    doc="The embedded durable log, opened when a stream listener or a durable route needs it.",
)


def read_log(section: Section) -> LogSettings:
    """The ``[log]`` table."""
    max_bytes = section.read(MAX_BYTES)
    max_age = section.read(MAX_AGE_SECONDS)
    settings = LogSettings(
        fsync=section.read(FSYNC),
        fsync_interval_seconds=section.read(FSYNC_INTERVAL_SECONDS),
        inline_commit_max_bytes=section.read(INLINE_COMMIT_MAX_BYTES),
        segment_bytes=section.read(SEGMENT_BYTES),
        max_bytes=max_bytes or None,
        max_age_seconds=max_age or None,
        record_outcomes=section.read(RECORD_OUTCOMES),
    )
    section.done()
    return settings


# --- [admin] --------------------------------------------------------------------------


@attrs.frozen
class AdminConfig:
    """The admin HTTP endpoint.

    Attributes:
        endpoint: Where it listens; None disables it.
        allowed_hosts: Host names (and addresses) its requests may name
            besides the address they arrive on (and ``localhost`` on
            loopback), in canonical form (`gateway.admin.channel.host_name`).
    """

    endpoint: str | None = "tcp:8790:interface=127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()


ADMIN_ENDPOINT: Final = string(
    "endpoint",
    "tcp:8790:interface=127.0.0.1",
    doc="A Twisted server endpoint string for /healthz, /metrics, /routes, /leases and /tap.",
)
ENABLED: Final = boolean("enabled", True, doc="false: no admin endpoint.")
ALLOWED_HOSTS: Final = strings(
    "allowed_hosts",
    doc="Host names and IP addresses a request's Host header may name, besides the address"
    " the request arrived on and ``localhost`` on loopback (any port). Others get 421: a web"
    " page whose name was rebound to this host (DNS rebinding) cannot read the endpoint.",
    shown="[] (the address and, on loopback, localhost)",
)

ADMIN: Final = TableSchema(
    "Admin endpoint",
    "[admin]",
    (ADMIN_ENDPOINT, ENABLED, ALLOWED_HOSTS),
    doc="The admin HTTP endpoint. Its token is ``admin_token`` in the secrets file, or without"
    " one the token the gateway makes in data_dir/admin-token (mode 0600).",
)


def read_admin(section: Section) -> AdminConfig:
    """The ``[admin]`` table."""
    endpoint = section.read(ADMIN_ENDPOINT)
    hosts: list[str] = []
    for name in section.read(ALLOWED_HOSTS):
        try:
            hosts.append(host_name(name))
        except HostError as exc:
            section.problem(ALLOWED_HOSTS, f"{exc}: give a host name or an IP address, no port")
    if section.read(ENABLED):
        endpoint = with_paths_resolved(endpoint, section)
        check_server_endpoint(section, ADMIN_ENDPOINT, endpoint)
        admin = AdminConfig(endpoint, tuple(dict.fromkeys(hosts)))
    else:
        admin = AdminConfig(None)
    section.done()
    return admin
