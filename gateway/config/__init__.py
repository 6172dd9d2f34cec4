"""Configuration: TOML files in, frozen validated objects out.

The main file (``etc/gateway.toml``) names listeners, upstreams and the admin
endpoint; each route is a file of its own (``etc/routes/*.toml``); secrets
live in a separate file. Everything is checked before anything listens, and
every problem found is reported at once, naming the file, the key and what
is wrong (`ConfigError`). Nothing else in the gateway reads configuration.
"""

from gateway.config.loader import (
    DEFAULT_CONFIG_NAME,
    AdminConfig,
    ConfigError,
    ConfigProblem,
    GatewayConfig,
    ListenerConfig,
    LogSettings,
    UpstreamConfig,
    endpoint_with_backlog,
    load_config,
    load_default_config,
    load_routes,
    reload_routes,
    reload_secrets,
)

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
    "reload_secrets",
]
