"""Configuration: TOML files in, frozen validated objects out.

The main file (``etc/gateway.toml``) names listeners, upstreams and the admin
endpoint; each route is a file of its own (``etc/routes/*.toml``); secrets
live in a separate file. Everything is checked before anything listens, and
every problem found is reported at once, naming the file, the key and what
is wrong (`ConfigError`). Nothing else in the gateway reads configuration.

Every key is declared once, with its type, default, bounds and meaning, in
the module of the table it belongs to (laid out as Synapse's config is): the
shared base (`base`: `Key`, `TableSchema`, the `Section` reader), the main
file's own tables (`gateway`), `listeners` and `upstreams` with one module
per protocol (`ssmp`, `qmqp`, `stream`, `dmp`, `mtl`, `frontend`), `routes`
and `secrets`; `loader` reads them together, and `reference` renders the
declarations as the configuration reference.
"""

from gateway.config.base import ConfigError, ConfigProblem
from gateway.config.endpoints import endpoint_with_backlog
from gateway.config.gateway import AdminConfig, LogSettings
from gateway.config.listeners import ListenerConfig
from gateway.config.loader import (
    DEFAULT_CONFIG_NAME,
    GatewayConfig,
    load_config,
    load_default_config,
    reload_routes,
    reload_secrets,
)
from gateway.config.routes import load_routes
from gateway.config.upstreams import UpstreamConfig

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
