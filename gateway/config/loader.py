"""Loading: the main file, its route files and secrets, checked together into `GatewayConfig`.

Each table is read by the module that declares its keys (`gateway.config.gateway`,
`listeners`, `upstreams`, `routes`, `secrets`, one module per protocol); this
module reads the main file's top level, then checks what spans tables: route
ends, names, ports (`gateway.config.ports`), secrets.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Final

import attrs

from gateway.config.base import (
    ConfigError,
    ConfigProblem,
    Section,
    TableSchema,
    read_toml,
    table,
    tables,
)
from gateway.config.fleet import FLEET, FleetConfig, check_processes, read_fleet
from gateway.config.gateway import (
    ADMIN,
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    GATEWAY,
    LOG,
    AdminConfig,
    LogSettings,
    read_admin,
    read_gateway,
    read_log,
)
from gateway.config.listeners import LISTENER, ListenerConfig, read_listener
from gateway.config.ports import check_ports
from gateway.config.routes import (
    ROUTE,
    UNDELIVERABLE_LISTENERS,
    WrittenRoute,
    load_routes,
    read_route,
)
from gateway.config.secrets import check_lease_secret, check_secrets, load_secrets
from gateway.config.upstreams import UPSTREAM, UpstreamConfig, read_upstream
from gateway.core.auth import Secrets
from gateway.core.internal import INTERNAL_PREFIX, is_internal
from gateway.core.router import Route

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "MAIN",
    "GatewayConfig",
    "load_config",
    "load_default_config",
    "reload_routes",
    "reload_secrets",
]

DEFAULT_CONFIG_NAME: Final = "<embedded default>"

GATEWAY_KEY: Final = table(
    "gateway", GATEWAY, doc="Where things are, and how long a stop may take (below)."
)
LOG_KEY: Final = table("log", LOG, doc="The embedded durable log (below).")
ADMIN_KEY: Final = table("admin", ADMIN, doc="The admin HTTP endpoint (below).")
FLEET_KEY: Final = table("fleet", FLEET, doc="This process as a node of a fleet (below).")
LISTENERS: Final = tables("listeners", LISTENER, doc="Listeners by name (below).")
UPSTREAMS: Final = tables("upstreams", UPSTREAM, doc="Upstreams by name (below).")
ROUTES: Final = tables(
    "routes", ROUTE, doc="Routes by name, written in the main file (the embedded default does)."
)

MAIN: Final = TableSchema(
    "Top level",
    "gateway.toml",
    (GATEWAY_KEY, LOG_KEY, ADMIN_KEY, FLEET_KEY, LISTENERS, UPSTREAMS, ROUTES),
    doc="``msggateway check-config FILE`` validates it, with its route files and secrets file,"
    " and prints every problem as ``file: key: reason``. The gateway validates the same way"
    " before anything listens. Without a main file, the gateway runs an embedded default"
    " with every listener on loopback.",
)


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
        shutdown_grace_seconds: The longest a clean stop waits for what was
            read to be answered, and for connections to close.
        fleet: This process as a node of a fleet (its node id, its processes).
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
    log: LogSettings = attrs.field(factory=LogSettings)
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    fleet: FleetConfig = attrs.field(factory=FleetConfig)

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
            + (f", {self.fleet.processes} processes" if self.fleet.processes > 1 else "")
        )


def _parse_main(
    file: str,
    data: dict[str, Any],
    base: Path,
    problems: list[ConfigProblem],
) -> GatewayConfig:
    root = Section(file, "", data, problems, (MAIN,))
    paths = read_gateway(root.section(GATEWAY_KEY), base)
    data_dir, routes_dir, secrets_path = paths.data_dir, paths.routes_dir, paths.secrets_path
    log = read_log(root.section(LOG_KEY))
    admin = read_admin(root.section(ADMIN_KEY))
    fleet = read_fleet(root.section(FLEET_KEY))
    names: set[str] = set()
    listeners: list[ListenerConfig] = []
    for name, section in root.table_items(LISTENERS):
        listener = read_listener(name, section, names)
        if listener is not None:
            listeners.append(listener)
    upstreams: list[UpstreamConfig] = []
    for name, section in root.table_items(UPSTREAMS):
        upstream = read_upstream(name, section, names)
        if upstream is not None:
            upstreams.append(upstream)
    inline: list[Route] = []
    written: list[WrittenRoute] = []
    for name, section in root.table_items(ROUTES):
        written.append(read_route(file, name, section.path, dict(section.table), problems))
        if written[-1].route is not None:
            inline.append(written[-1].route)
    root.done()
    check_ports(listeners, admin, file, problems)
    check_processes(fleet, listeners, admin, file, problems)

    secrets = load_secrets(secrets_path, problems) if secrets_path else Secrets()
    check_secrets(listeners, upstreams, secrets, secrets_path, file, problems)
    in_fleet, admin_on = bool(fleet.amqp), admin.endpoint is not None
    check_lease_secret(in_fleet, admin_on, listeners, secrets, secrets_path, file, problems)
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
        shutdown_grace_seconds=paths.shutdown_grace_seconds,
        fleet=fleet,
    )
    routes = _all_routes(config, problems, tuple(written))
    return attrs.evolve(config, routes=routes)


def _all_routes(
    config: GatewayConfig,
    problems: list[ConfigProblem],
    inline: tuple[WrittenRoute, ...] | None = None,
) -> tuple[Route, ...]:
    """The main file's ``[routes.NAME]`` tables plus the route files, checked together.

    Every route as written is checked against the listeners and upstreams,
    a route with problems of its own too: one run reports every problem.

    Args:
        config: The configuration the routes belong to.
        problems: Where problems go.
        inline: The main file's route tables as written, valid or not
            (default: its valid routes, as kept in ``config``).
    """
    if inline is None:
        inline = tuple(
            WrittenRoute(
                name=route.name,
                file=config.source,
                path=f"routes.{route.name}",
                source=route.source,
                destination=route.destination,
                route=route,
            )
            for route in config.inline_routes
        )
    from_files = load_routes(config.routes_dir, problems) if config.routes_dir else ()
    inline_names = {written.name for written in inline}
    for written in from_files:
        if written.name in inline_names:
            problems.append(
                ConfigProblem(
                    written.file,
                    "-",
                    f"route {written.name!r} is also defined in {config.source} [routes]",
                )
            )
    every = (*inline, *from_files)
    _check_routes(every, config, problems)
    valid = (written.route for written in every if written.route is not None)
    return tuple(sorted(valid, key=lambda route: route.name))


def _check_routes(
    routes: tuple[WrittenRoute, ...], config: GatewayConfig, problems: list[ConfigProblem]
) -> None:
    """Check each route's ends against the listeners and upstreams."""
    endpoints = config.endpoint_names()
    listeners = {listener.name: listener.protocol for listener in config.listeners}
    known = ", ".join(sorted(endpoints)) or "none"
    for route in routes:
        why = UNDELIVERABLE_LISTENERS.get(listeners.get(route.destination or "", ""))
        if why is not None:
            reason = f"{route.destination!r} is {why}; routes cannot end there"
            problems.append(ConfigProblem(route.file, route.key("to"), reason))
        for key, name in (("from", route.source), ("to", route.destination)):
            if name is not None and name not in endpoints:
                reason = f"no listener or upstream named {name!r} (known: {known})"
                problems.append(ConfigProblem(route.file, route.key(key), reason))
        # A DMP listener's sinks feed routing and its feeds are delivered to:
        # sink to feed on one listener is no loop.
        if (
            route.source is not None
            and route.source == route.destination
            and listeners.get(route.source) != "dmp"
        ):
            reason = "a route must not deliver back to where it takes from"
            problems.append(ConfigProblem(route.file, route.key("to"), reason))
        if listeners.get(route.destination or "") == "stream" and route.route is not None:
            for key, address in _fixed_addresses(route.route):
                if is_internal(address):
                    reason = (
                        f"{address!r} is one of the gateway's own streams (names starting"
                        f" {INTERNAL_PREFIX!r}); routes cannot write there"
                    )
                    problems.append(ConfigProblem(route.file, route.key(key), reason))


def _fixed_addresses(route: Route) -> list[tuple[str, str]]:
    """The destination addresses a route names outright, each with the key that names it."""
    if route.recipients:
        return [("recipients", address) for address in route.recipients]
    if route.target is not None:
        return [] if "{" in route.target.text else [("address", route.target.text)]
    return [("match", route.pattern.text)] if route.pattern.is_exact else []


# --- entry points ------------------------------------------------------------------------------


def load_config(path: Path) -> GatewayConfig:
    """Read and validate a main config file, its route files and secrets.

    Relative paths in the file (``data_dir``, ``routes``, ``secrets``) are
    relative to the file's directory.

    Raises:
        ConfigError: With every problem found.
    """
    problems: list[ConfigProblem] = []
    data = read_toml(path, problems)
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
    secrets = load_secrets(config.secrets_path, problems)
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
