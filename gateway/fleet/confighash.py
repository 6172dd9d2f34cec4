"""The configuration's fingerprint: whether the nodes of a fleet run one configuration.

One main file and one routes directory serve every node of a fleet
(docs/fleet.rst); a node started from another version of them behaves
differently where the fleet expects it to behave alike (a route here and
not there, a stream listener with other limits). Each node publishes a
hash of its configuration with its announcements (`gateway.fleet.members`),
and a node whose hash differs from this one's is logged and counted.

The hash is over the configuration as loaded (`GatewayConfig`: validated
values with their defaults, not the file's text, so comments, key order and
spelling out a default change nothing) and the routes in effect (a SIGHUP
reload changes it). What legitimately differs between nodes is left out:

- the secrets file (``secrets``, ``secrets_path``): secrets never leave the
  node, not even hashed;
- where the node keeps its files and found them (``source``, ``data_dir``,
  ``routes_dir``);
- the node id and the processes of its host (``[fleet] node``,
  ``[fleet] processes``);
- the advertised addresses (a stream listener's ``advertised_host`` and
  ``advertised_port``);
- per-worker ports: a worker hashes the configuration its supervisor read,
  before the ports it adds its index to (the assembly passes it).

Values are reduced to a canonical form (`canonical`): attrs classes and
dataclasses by their compared fields, mappings with sorted keys, sets
sorted, paths and enums as text, and everything else by ``repr``; the hash
is SHA-256 of its JSON, of which the first 16 hex digits are shown.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:
    from gateway.config.loader import GatewayConfig
    from gateway.core.router import Route, Router

__all__ = ["HASH_HEX_DIGITS", "canonical", "config_hash", "live_config_hash"]

HASH_HEX_DIGITS: Final = 16
"""64 bits of SHA-256: two configurations of one fleet share a hash by chance about never."""

_LEFT_OUT: Final = frozenset({"source", "secrets", "secrets_path", "data_dir", "routes_dir"})
"""`GatewayConfig` fields that are the node's own (where its files are, its secrets)."""
_NODE_FLEET_KEYS: Final = frozenset({"node", "processes"})
_ADVERTISED: Final = frozenset({"advertised_host", "advertised_port"})


def canonical(value: Any) -> Any:
    """A JSON-able form of ``value`` that is equal for equal values in every process.

    Sets are sorted by the JSON of their members (their iteration order
    depends on the process's hash seed); attrs classes and dataclasses are
    their class name and the fields they compare by.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if attrs.has(type(value)):
        fields = {
            field.name: canonical(getattr(value, field.name))
            for field in attrs.fields(type(value))
            if field.eq
        }
        return {type(value).__name__: fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            field.name: canonical(getattr(value, field.name))
            for field in dataclasses.fields(value)
            if field.compare
        }
        return {type(value).__name__: fields}
    if isinstance(value, Mapping):
        return {"{}": sorted(([canonical(k), canonical(v)] for k, v in value.items()), key=_json)}
    if isinstance(value, set | frozenset):
        return {"set": sorted((canonical(member) for member in value), key=_json)}
    if isinstance(value, list | tuple):
        return [canonical(member) for member in value]
    return {"repr": repr(value)}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def config_hash(config: GatewayConfig, routes: tuple[Route, ...] | None = None) -> str:
    """The hash of ``config`` with ``routes`` in effect (default: the loaded ones).

    What differs legitimately between nodes is left out (the module docstring).
    """
    fields: dict[str, Any] = {}
    for field in attrs.fields(type(config)):
        name = field.name
        if name in _LEFT_OUT or name == "inline_routes":
            continue  # inline routes are among the routes
        value = getattr(config, name)
        if name == "routes":
            value = routes if routes is not None else value
        elif name == "fleet":
            value = {
                key: canonical(getattr(value, key))
                for key in attrs.fields_dict(type(value))
                if key not in _NODE_FLEET_KEYS
            }
        elif name == "listeners":
            value = [_listener(listener) for listener in value]
        fields[name] = canonical(value)
    digest = hashlib.sha256(_json(fields).encode("utf-8")).hexdigest()
    return digest[:HASH_HEX_DIGITS]


def _listener(listener: Any) -> Any:
    """A listener without its advertised address (each node advertises its own)."""
    settings = listener.settings
    if attrs.has(type(settings)) and _ADVERTISED & set(attrs.fields_dict(type(settings))):
        listener = attrs.evolve(
            listener,
            settings=attrs.evolve(settings, advertised_host=None, advertised_port=None),
        )
    return listener


def live_config_hash(config: GatewayConfig, router: Router) -> Callable[[], str]:
    """The hash of ``config`` with the routes the router has now, computed once per route table."""
    cached: list[Any] = [None, ""]

    def current() -> str:
        table = router.table
        if cached[0] is not table:
            routes = tuple(bound.route for bound in table.routes)
            cached[:] = [table, config_hash(config, routes)]
        return str(cached[1])

    return current
