"""The ``[fleet]`` table: this process as one node of a fleet (DESIGN.md, "Scale").

``node`` names the node; without it (or without the table) the node id is
generated once and kept in the data dir (`gateway.fleet.node`); `node_id`
gives the id a configuration stands for, reading or writing that file.

``processes`` runs that many worker processes on this host under one
supervisor (`gateway.fleet.supervisor`), worker ``i`` being node
``<node>-<i>`` with its own data dir. `check_processes` checks what that
asks of the rest of the configuration: every listener but MTL is shared by
all workers through SO_REUSEPORT, so it must be a TCP endpoint (``tcp:``,
``tcp6:``, ``ssl:``, ``mtls:``); ZeroMQ cannot share a port, nor can the
admin endpoint usefully (each worker has its own metrics), so those take
port + i in worker i, and those ranges must not run into other ports. A
stream listener also listens on a port of each worker's own
(`worker_ports_base` + i), which Metadata names, so that a client reaches
the worker that owns a stream; that range is checked the same way.

``amqp`` joins the node to a fleet: RabbitMQ's AMQP 0-9-1 endpoint, or a
list of them (the nodes of a cluster), tried in turn, as Twisted client
endpoint strings like every upstream (``tcp:host=H:port=5672``, and
``tls:host=H:port=5671:trustRoots=CA-DIR`` for TLS that verifies the broker's
certificate and host name; ``ssl:``, which verifies neither, is refused).
The virtual host is ``vhost``. The credentials are in the secrets file's
``[fleet]`` table (``username``, ``password``), not here: one main file and
one routes directory serve every node, and only the node id, ``data_dir``
and advertised addresses differ. Without ``amqp`` nothing crosses processes
(`gateway.fleet.backbone`).

``unhealthy_after_seconds``: ``/healthz`` answers 503 once the node has had
no connection to RabbitMQ for longer than this (`gateway.fleet.members`).
``[fleet.streams]`` pins streams of the embedded log to the node that owns
them; the others are placed by rendezvous hashing (`gateway.fleet.streams`).

Each key is read by `read_fleet`, one declaration each: a key added later
is one more declaration, one more attribute of `FleetConfig`, and one more
line there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from gateway.config.base import (
    ConfigError,
    ConfigProblem,
    Section,
    TableSchema,
    integer,
    optional_string,
    positive,
    string,
    string_map,
    strings,
)
from gateway.config.endpoints import (
    PORT_ENDPOINT_KINDS,
    check_client_endpoint,
    check_client_tls,
    endpoint_port,
    with_paths_resolved,
)
from gateway.fleet.node import (
    MAX_NODE_ID_CHARS,
    NODE_ID_FILE,
    NodeIdError,
    load_node_id,
    node_id_problem,
)
from gateway.protocols.mtl.settings import zmq_bind_address

if TYPE_CHECKING:
    from gateway.config.gateway import AdminConfig
    from gateway.config.listeners import ListenerConfig

__all__ = [
    "DEFAULT_HEARTBEAT_SECONDS",
    "DEFAULT_UNHEALTHY_AFTER_SECONDS",
    "FLEET",
    "MAX_PROCESSES",
    "FleetConfig",
    "check_processes",
    "node_id",
    "read_fleet",
    "worker_node",
    "worker_ports_base",
]

MAX_PROCESSES: Final = 256
"""The most worker processes one supervisor runs: far more than the cores of a host, and
few enough that a mistyped number does not start a fork storm."""

NODE: Final = optional_string(
    "node",
    doc="This process's node id, part of every publisher reference it uses, so that two"
    " processes never share one: ASCII letters, digits, '-', '_' and '.', at most 64"
    " characters. Each process of a fleet needs its own; with processes > 1, worker i is"
    " node NODE-i.",
    shown=f"generated once (``gw-`` and 8 random characters), kept in data_dir/{NODE_ID_FILE}",
)
PROCESSES: Final = integer(
    "processes",
    1,
    minimum=1,
    doc="Gateway processes on this host, under one supervisor: worker i (from 0) is node"
    " NODE-i with data dir data_dir/worker-i; every listener but MTL is shared by all of them"
    " through SO_REUSEPORT, and MTL listeners and the admin endpoint take port + i."
    f" At most {MAX_PROCESSES}. 1: one process, no supervisor.",
)

DEFAULT_HEARTBEAT_SECONDS: Final = 10.0
"""AMQP heartbeats with the broker: a broker that went silent (a partition, not a crash,
which closes the socket at once) is given up after two missed ones, about 20 s."""
AMQP: Final = strings(
    "amqp",
    doc="RabbitMQ's AMQP 0-9-1 endpoint (a Twisted client endpoint string, ``tcp:host=H:port=P``"
    " or ``tls:...`` that verifies the broker), or a list of them (a cluster's nodes), tried"
    " in turn, for what crosses nodes (docs/fleet.rst). The user name and password are in"
    " the secrets file's ``[fleet]`` table.",
    shown="none: nothing crosses processes",
)
VHOST: Final = string("vhost", "/", doc="The RabbitMQ virtual host the fleet uses.")
HEARTBEAT_SECONDS: Final = positive(
    "heartbeat_seconds",
    DEFAULT_HEARTBEAT_SECONDS,
    doc="AMQP heartbeat interval with RabbitMQ: a broker that stops answering is given up"
    " (and the next endpoint tried) after about twice this.",
)

DEFAULT_UNHEALTHY_AFTER_SECONDS: Final = 10.0
"""A node cut off from RabbitMQ this long is unhealthy: past one reconnection round with its
back-off (a RabbitMQ node restarting takes about 5 s), not past a load balancer's patience."""
UNHEALTHY_AFTER_SECONDS: Final = positive(
    "unhealthy_after_seconds",
    DEFAULT_UNHEALTHY_AFTER_SECONDS,
    doc="``/healthz`` answers 503 (with the reason) once the node has had no connection to"
    " RabbitMQ for longer than this: nothing crosses to or from it meanwhile.",
)
STREAMS: Final = string_map(
    "streams",
    doc="``[fleet.streams]``: stream name = the node that owns it (its log keeps the stream)."
    " While that node is not live the stream has no owner (code 6, stream not available)."
    " Streams not named are placed on the live nodes by rendezvous hashing (docs/fleet.rst).",
)

FLEET: Final = TableSchema(
    "Fleet",
    "[fleet]",
    (NODE, PROCESSES, AMQP, VHOST, HEARTBEAT_SECONDS, UNHEALTHY_AFTER_SECONDS, STREAMS),
    doc="This process as one node of several that act as one gateway. Without the table the"
    " gateway is a single node with a generated id, in a single process; without ``amqp``"
    " nothing crosses processes.",
)


@attrs.frozen
class FleetConfig:
    """The ``[fleet]`` table.

    Attributes:
        node: The configured node id, or None: the one kept in the data dir.
        processes: Worker processes on this host; 1: no supervisor.
        amqp: RabbitMQ's AMQP 0-9-1 endpoints (client endpoint strings), tried
            in turn; empty: no fleet backbone.
        vhost: The virtual host.
        heartbeat_seconds: The AMQP heartbeat interval.
        unhealthy_after_seconds: How long without RabbitMQ makes ``/healthz`` 503.
        streams: Pinned streams: (stream name, owner node) pairs, sorted.
    """

    node: str | None = None
    processes: int = 1
    amqp: tuple[str, ...] = ()
    vhost: str = "/"
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    unhealthy_after_seconds: float = DEFAULT_UNHEALTHY_AFTER_SECONDS
    streams: tuple[tuple[str, str], ...] = ()


def worker_node(node: str, index: int) -> str:
    """The node id of worker ``index`` (from 0) of the supervisor whose node is ``node``."""
    return f"{node}-{index}"


def read_fleet(section: Section) -> FleetConfig:
    """The ``[fleet]`` table; a node id or an endpoint that could not be used is a problem."""
    if isinstance(section.table.get(AMQP.name), str):
        # One endpoint may be written as a string rather than a list of one.
        table = dict(section.table)
        table[AMQP.name] = [table[AMQP.name]]
        section = Section(section.file, section.path, table, section.problems, section.schemas)
    node = section.read(NODE)
    processes = section.read(PROCESSES)
    if processes > MAX_PROCESSES:
        section.problem(PROCESSES, f"must be at most {MAX_PROCESSES}, not {processes}")
        processes = 1
    if node is not None:
        problem = node_id_problem(node)
        if problem is None and processes > 1:
            problem = _worker_node_problem(node, processes)
        if problem is not None:
            section.problem(NODE, problem)
            node = None
    amqp = tuple(with_paths_resolved(description, section) for description in section.read(AMQP))
    for description in amqp:
        check_client_endpoint(section, AMQP, description)
        check_client_tls(section, AMQP, description)
    if AMQP.name in section.table and not amqp:
        section.problem(AMQP, "must name at least one endpoint (leave it out for no fleet)")
    vhost = section.read(VHOST)
    if not vhost:
        section.problem(VHOST, "must not be empty (RabbitMQ's default virtual host is '/')")
        vhost = "/"
    heartbeat = section.read(HEARTBEAT_SECONDS)
    unhealthy_after = section.read(UNHEALTHY_AFTER_SECONDS)
    streams = section.string_map(STREAMS, _pinned_node)
    section.done()
    return FleetConfig(
        node=node,
        processes=processes,
        amqp=amqp,
        vhost=vhost,
        heartbeat_seconds=heartbeat,
        unhealthy_after_seconds=unhealthy_after,
        streams=tuple(sorted(streams.items())),
    )


def _pinned_node(text: str) -> str:
    """A ``[fleet.streams]`` value: a node id.

    Raises:
        ValueError: It is not a valid node id.
    """
    problem = node_id_problem(text)
    if problem is not None:
        raise ValueError(f"the node that owns the stream {problem}")
    return text


def _worker_node_problem(node: str, processes: int) -> str | None:
    """What is wrong with the workers' ids made from ``node``, or None."""
    longest = worker_node(node, processes - 1)
    if len(longest) > MAX_NODE_ID_CHARS:
        return (
            f"with processes = {processes} the workers are nodes {node}-0 to {longest}, which"
            f" must be at most {MAX_NODE_ID_CHARS} characters: shorten it"
        )
    return None


def node_id(fleet: FleetConfig, data_dir: Path) -> str:
    """The node id: ``[fleet] node``, else the one kept in ``data_dir`` (made the first time).

    Raises:
        ConfigError: The kept id cannot be read or written, or is not one;
            the problem names the file.
    """
    try:
        node = load_node_id(data_dir, fleet.node)
    except NodeIdError as exc:
        raise ConfigError([ConfigProblem(str(exc.file), "-", exc.reason)]) from None
    if fleet.processes > 1:
        problem = _worker_node_problem(node, fleet.processes)
        if problem is not None:
            raise ConfigError([ConfigProblem(str(data_dir / NODE_ID_FILE), "-", problem)])
    return node


# --- what processes > 1 asks of the listeners and the admin endpoint -----------------------


def worker_ports_base(listener: ListenerConfig) -> int:
    """Worker 0's own port of a stream listener (worker i's is this + i); 0: each picks one.

    ``worker_ports`` if set, else the listener's port + 1 (0 when its port is 0).
    """
    configured = int(getattr(listener.settings, "worker_ports", 0) or 0)
    if configured:
        return configured
    port = endpoint_port(listener.endpoint)
    return port + 1 if port else 0


@attrs.frozen
class _Ports:
    """The ports one key claims: worker 0's, and those the other workers add (port + i)."""

    key: str
    base: frozenset[int]
    extra: frozenset[int]
    note: str = ""


def check_processes(
    fleet: FleetConfig,
    listeners: Sequence[ListenerConfig],
    admin: AdminConfig,
    file: str,
    problems: list[ConfigProblem],
) -> None:
    """Check that every listener and the admin endpoint can run in ``fleet.processes`` workers.

    Problems name the listener's or the admin endpoint's key; nothing is
    checked for a single process.
    """
    processes = fleet.processes
    if processes <= 1:
        return
    claims: list[_Ports] = []
    kinds = ", ".join(f"{kind}:" for kind in PORT_ENDPOINT_KINDS)
    for listener in listeners:
        key = f"listeners.{listener.name}"
        if listener.protocol == "mtl":
            try:
                _, control_port = zmq_bind_address(listener.endpoint)
            except ValueError:
                continue  # reported with the listener
            claims.append(_offset(f"{key}.endpoint", control_port, processes))
            claims.append(_offset(f"{key}.data_port", listener.settings.data_port, processes))
            continue
        port = endpoint_port(listener.endpoint)
        if port is None:
            problems.append(
                ConfigProblem(
                    file,
                    f"{key}.endpoint",
                    f"with [fleet] processes = {processes} every worker listens on this port"
                    f" (SO_REUSEPORT): use a {kinds} endpoint with a port",
                )
            )
            continue
        claims.append(_Ports(f"{key}.endpoint", frozenset({port} - {0}), frozenset()))
        own = worker_ports_base(listener) if listener.protocol == "stream" else 0
        if own:
            # Every worker's own port is one more than one process would bind.
            claims.append(
                _Ports(
                    f"{key}.worker_ports",
                    frozenset(),
                    frozenset(range(own, own + processes)),
                    note=" (worker_ports: each worker's own stream port; by default the"
                    " listener's port + 1 + i)",
                )
            )
    if admin.endpoint is not None:
        admin_port = endpoint_port(admin.endpoint)
        if admin_port is None:
            problems.append(
                ConfigProblem(
                    file,
                    "admin.endpoint",
                    f"with [fleet] processes = {processes} worker i listens on port + i:"
                    f" use a {kinds} endpoint with a port (or enabled = false)",
                )
            )
        else:
            claims.append(_offset("admin.endpoint", admin_port, processes))
    problems.extend(_collisions(claims, file, processes))


def _offset(key: str, port: int, processes: int) -> _Ports:
    """The ports of something worker i binds at ``port`` + i (port 0: each its own)."""
    if port == 0:
        return _Ports(key, frozenset(), frozenset())
    return _Ports(key, frozenset({port}), frozenset(range(port + 1, port + processes)))


def _collisions(claims: Iterable[_Ports], file: str, processes: int) -> list[ConfigProblem]:
    """A problem for each port that only the workers past the first run into."""
    found: list[ConfigProblem] = []
    claims = list(claims)
    for claim in claims:
        if claim.extra and max(claim.extra) > 65535:
            found.append(
                ConfigProblem(
                    file,
                    claim.key,
                    f"with [fleet] processes = {processes} the last worker's port would be"
                    f" {max(claim.extra)}, past 65535{claim.note}",
                )
            )
            continue
        for other in claims:
            if other is claim:
                continue
            shared = claim.extra & (other.base | other.extra)
            if shared:
                found.append(
                    ConfigProblem(
                        file,
                        claim.key,
                        f"with [fleet] processes = {processes} worker i takes port + i, and"
                        f" port {min(shared)} is also {other.key}'s: leave {processes} ports"
                        f" free from each such port{claim.note}",
                    )
                )
                break
    return found
