"""One worker process of a supervisor (`gateway.fleet.supervisor`): a whole gateway.

The supervisor starts worker ``i`` (from 0) as ``twistd --nodaemon ...
msggateway --config FILE --worker i --shared-port NAME=PORT ...``: the same
main file, route files and secrets as every other worker, with only these
differences, made by `worker_config` and `serve_supervisor`:

- its node id is ``<node>-<i>`` (`gateway.config.fleet.worker_node`), the
  node being the supervisor's (``[fleet] node``, or the one kept in
  ``data_dir/node-id``): derived, so nothing is kept for it;
- its data dir is ``<data_dir>/worker-<i>`` (`worker_data_dir`): its own
  embedded log, which no other worker touches;
- every listener but MTL listens on the port the supervisor holds for it
  (``--shared-port``: the configured one, or the one port 0 was given), with
  a socket of its own in the port's SO_REUSEPORT group
  (`gateway.fleet.reuseport`), so the kernel spreads connections over the
  workers;
- a stream listener also listens, in worker i, on a port of the worker's
  own, ``worker_ports`` + i (by default the listener's port + 1 + i; port
  0: a free one), served as ``NAME/worker`` (`WORKER_PORT_SUFFIX`), and
  advertises that one (or ``advertised_port`` + i) in Metadata and Open: a
  client that follows Metadata reaches the worker that owns a stream, while
  the shared port stays the entry point;
- an MTL listener binds port + i for control and ``data_port`` + i for data
  (ZeroMQ sets no SO_REUSEPORT), and the admin endpoint port + i (each
  worker's metrics are its own); port 0 stays 0: each worker picks its own.
  A lease's 202 reply names the data port of the worker that granted it;
- every log line carries its node id (`gateway.logformat.tag_lines`);
- it tells the supervisor, not systemd, when it is ready: one JSON line
  ``{"ready": {NAME: "HOST:PORT", ...}}`` on descriptor `REPORT_FD`;
- its standard input is a pipe from the supervisor, which nothing writes
  to: when it closes, the supervisor is gone (killed, say) and the worker
  stops cleanly instead of serving on alone (`SupervisorWatch`);
- it leaves the supervisor's process group (`leave_process_group`), so
  that a signal sent to the group (Ctrl-C in a terminal, ``timeout``)
  reaches the supervisor alone, which passes it on once: twistd takes a
  second SIGTERM during its stop for an error.

SIGHUP and SIGTERM act on a worker as on any gateway; the supervisor passes
its own on to every worker.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReadDescriptor
from twisted.internet.main import CONNECTION_DONE, CONNECTION_LOST
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.config import GatewayConfig, ListenerConfig
from gateway.config.endpoints import endpoint_port, endpoint_with_port
from gateway.config.fleet import worker_ports_base

__all__ = [
    "REPORT_FD",
    "SUPERVISOR_FD",
    "WORKER_DIR_PREFIX",
    "WORKER_PORT_SUFFIX",
    "SupervisorLink",
    "SupervisorWatch",
    "leave_process_group",
    "report",
    "worker_config",
    "worker_data_dir",
]

WORKER_DIR_PREFIX: Final = "worker-"
"""Worker i's data dir is ``<data_dir>/worker-<i>``."""

WORKER_PORT_SUFFIX: Final = "/worker"
"""A stream listener's own port in a worker is served as ``<listener>/worker`` (a name no
listener can have), and reported so with the worker's addresses."""

REPORT_FD: Final = 3
"""The descriptor a worker writes its reports to, read by the supervisor."""
SUPERVISOR_FD: Final = 0
"""The descriptor whose end tells a worker that its supervisor is gone (its standard input)."""


def worker_data_dir(data_dir: Path, index: int) -> Path:
    """Worker ``index``'s own data dir, inside the supervisor's."""
    return data_dir / f"{WORKER_DIR_PREFIX}{index}"


def worker_config(
    config: GatewayConfig, index: int, shared_ports: Mapping[str, int]
) -> GatewayConfig:
    """The configuration worker ``index`` runs: its data dir, and the ports it listens on.

    Args:
        config: The configuration every worker shares.
        index: The worker, from 0.
        shared_ports: The port the supervisor holds for each shared
            listener; a listener not named keeps its endpoint as written.
    """
    listeners = tuple(
        _worker_listener(listener, index, shared_ports) for listener in config.listeners
    )
    admin = config.admin
    if admin.endpoint is not None:
        admin = attrs.evolve(admin, endpoint=_offset(admin.endpoint, index))
    return attrs.evolve(
        config,
        data_dir=worker_data_dir(config.data_dir, index),
        listeners=listeners,
        admin=admin,
    )


def _worker_listener(
    listener: ListenerConfig, index: int, shared_ports: Mapping[str, int]
) -> ListenerConfig:
    if listener.protocol == "mtl":
        settings = listener.settings
        if settings.data_port:
            settings = attrs.evolve(settings, data_port=settings.data_port + index)
        return attrs.evolve(listener, endpoint=_offset(listener.endpoint, index), settings=settings)
    if listener.protocol == "stream":
        listener = _stream_worker_listener(listener, index)
    port = shared_ports.get(listener.name)
    if port is None:
        return listener
    return attrs.evolve(listener, endpoint=endpoint_with_port(listener.endpoint, port))


def _stream_worker_listener(listener: ListenerConfig, index: int) -> ListenerConfig:
    """Worker ``index``'s own port of a stream listener, and the port it advertises."""
    settings = listener.settings
    base = worker_ports_base(listener)
    advertised = settings.advertised_port
    return attrs.evolve(
        listener,
        settings=attrs.evolve(
            settings,
            worker_port=base + index if base else 0,
            advertised_port=advertised + index if advertised else None,
        ),
    )


def _offset(description: str, index: int) -> str:
    """The endpoint string with its port + ``index``; port 0 (or none) as it is."""
    port = endpoint_port(description)
    if not port:
        return description
    return endpoint_with_port(description, port + index)


def leave_process_group() -> None:
    """Become the leader of a process group of its own (see the module docstring)."""
    # Failing, it is a group's or a session's leader already: signals to another miss it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def report(message: Mapping[str, Any], fd: int = REPORT_FD) -> bool:
    """Write one report line to the supervisor; whether it could be written.

    A line is far shorter than a pipe's atomic write (4 KiB), so it is
    written whole or not at all, without blocking for long.
    """
    line = json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n"
    try:
        os.write(fd, line)
    except OSError:
        return False
    return True


@implementer(IReadDescriptor)
class SupervisorWatch:
    """Reads a worker's standard input, a pipe from its supervisor, to learn when it closes.

    Args:
        gone: Called once the pipe is closed (or fails).
        fd: The descriptor (`SUPERVISOR_FD`).
    """

    def __init__(self, gone: Callable[[], None], fd: int = SUPERVISOR_FD) -> None:
        self._gone = gone
        self._fd = fd
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        """The descriptor watched."""
        return self._fd

    # Twisted's reactors take the exception (twisted.internet.main's), whatever
    # IReadDescriptor's annotation says.
    def doRead(self) -> BaseException | None:  # type: ignore[override]  # noqa: N802
        """Read and drop what is there; the end of the pipe ends the watch (the reactor's way)."""
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return None
        except OSError:
            return CONNECTION_LOST
        return None if data else CONNECTION_DONE

    def connectionLost(self, reason: Failure) -> None:
        """The supervisor is gone."""
        self._gone()

    def logPrefix(self) -> str:
        """How the reactor names it in its log."""
        return "supervisor"


class SupervisorLink(Service):
    """A worker's side of its supervisor: the ready report, and stopping when it is gone.

    Added as the gateway's last child, so that it starts after every
    listener has started listening.

    Args:
        gateway: The worker's gateway (`gateway.service.GatewayService`).
        reactor: The reactor (watches standard input; stopped when the supervisor is gone).
        index: The worker's index.
    """

    _log = Logger()

    def __init__(self, gateway: Any, reactor: Any, index: int) -> None:
        self.setName("supervisor")
        self._gateway = gateway
        self._reactor = reactor
        self._index = index
        self._watch: SupervisorWatch | None = None

    def startService(self) -> None:
        """Watch the supervisor; report ready once every listener listens."""
        super().startService()
        try:
            self._watch = SupervisorWatch(self._supervisor_gone)
        except OSError:
            self._watch = None  # no standard input: nothing to watch
        else:
            self._reactor.addReader(self._watch)
        self._gateway.when_listening().addCallback(self._ready)

    def stopService(self) -> None:
        """Stop watching."""
        super().stopService()
        watch, self._watch = self._watch, None
        if watch is not None:
            self._reactor.removeReader(watch)

    def _ready(self, addresses: dict[str, str]) -> None:
        if not report({"ready": addresses}):
            self._log.warn(
                "msggateway worker {worker}: no supervisor to report to (descriptor {fd}"
                " is not open); --worker is for the supervisor to use",
                worker=self._index,
                fd=REPORT_FD,
            )

    def _supervisor_gone(self) -> None:
        self._watch = None
        if not self.running:
            return
        self._log.warn(
            "msggateway worker {worker}: the supervisor is gone; stopping",
            worker=self._index,
        )
        if self._reactor.running:
            self._reactor.stop()
