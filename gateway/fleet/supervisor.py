"""N gateway processes on one host under one supervisor (``[fleet] processes``).

With ``processes = N`` (N > 1), ``twistd msggateway`` runs no gateway
itself: `gateway.service.makeService` returns a `Supervisor`, which

1. holds each shared listener's port (every listener but MTL): it parses
   the endpoint string as the workers will and binds a SO_REUSEPORT socket
   that never listens (`gateway.fleet.reuseport.PortReservations`). A port
   in use fails the start here, as it would a single gateway's; port 0 is
   resolved once, to the port every worker then shares; and the port stays
   the group's while workers restart;
2. starts N workers, each the same Python running ``twistd --nodaemon ...
   msggateway --config FILE --worker i --shared-port NAME=PORT ...``: a
   whole gateway, as node ``<node>-<i>`` in ``<data_dir>/worker-<i>``
   (`gateway.fleet.worker`). Their standard output and error are the
   supervisor's own, so their lines go where its lines go (each tagged with
   its node id); with ``--logfile FILE``, worker i writes ``FILE.worker-i``.
   Each reports ``ready`` with its addresses on descriptor 3; once every
   worker has, the supervisor logs ``msggateway supervisor ready`` and
   tells systemd ``READY=1`` (the workers never talk to systemd);
3. restarts a worker that exits on its own, after a back-off
   (`DEFAULT_RESTART_DELAY`: 0.5 s doubling to 30 s, with up to 1 s of
   jitter; it starts again from 0.5 s once a worker ran `STABLE_SECONDS`),
   logging each exit with its status and the restart count (also in
   systemd's ``STATUS``). A worker that exits before the workers were all
   ready once fails the start instead: the supervisor stops (the same
   configuration would fail the same way again);
4. passes SIGHUP on to every worker (each reloads routes, secrets and
   certificates itself), and on SIGTERM or SIGINT sends every worker
   SIGTERM, waits for them all for ``shutdown_grace_seconds`` plus
   `STOP_MARGIN_SECONDS` (each drains within the grace), then sends SIGKILL
   to any left, and releases the ports.

The supervisor has no admin endpoint of its own: each worker has one, on
the admin port + i, with that worker's metrics and health.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from twisted.application.internet import backoffPolicy
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IDelayedCall, IProcessTransport
from twisted.internet.protocol import Factory, ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.config import GatewayConfig
from gateway.config.fleet import worker_node
from gateway.fleet.reuseport import PortReservation, PortReservations
from gateway.fleet.worker import REPORT_FD, SUPERVISOR_FD
from gateway.startup import StartFailed
from gateway.systemd import NOTIFY_SOCKET, tell_systemd

__all__ = [
    "DEFAULT_RESTART_DELAY",
    "KILL_WAIT_SECONDS",
    "MAX_REPORT_BYTES",
    "STABLE_SECONDS",
    "STOP_MARGIN_SECONDS",
    "Supervisor",
    "WorkerSlot",
    "make_supervisor",
    "worker_command",
    "worker_environment",
]

DEFAULT_RESTART_DELAY: Final = backoffPolicy(initialDelay=0.5, maxDelay=30.0, factor=2.0)
"""Seconds before restarting a worker that exited, by its failures in a row (from 0):
soon the first time (the others carry the load meanwhile), never a tight loop."""
STABLE_SECONDS: Final = 60.0
"""A worker that ran this long before it exited is restarted as if for the first time."""
STOP_MARGIN_SECONDS: Final = 5.0
"""What a worker's stop may take past ``shutdown_grace_seconds`` (closing its log,
leaving the reactor) before it is killed."""
KILL_WAIT_SECONDS: Final = 5.0
"""How long the supervisor waits for killed workers to be gone before it exits anyway."""
MAX_REPORT_BYTES: Final = 65536
"""A worker's report line is at most this long (its addresses); a longer one is dropped."""

_TWISTD: Final = "from twisted.scripts.twistd import run; run()"
"""twistd, run by the supervisor's own Python (whatever its virtualenv and path)."""


@attrs.define(eq=False)
class WorkerSlot:
    """One of the supervisor's N workers, across its restarts.

    Attributes:
        index: Its index, from 0.
        node: Its node id.
        process: Its running process, or None between a death and its restart.
        pid: Its process's id (the last one's, after it ended).
        started: When its process was started (the supervisor's clock).
        addresses: What it listens on, from its ready report; None until then.
        restarts: How many times it was restarted.
        failures: Exits in a row that came before `STABLE_SECONDS` (the back-off).
        restart: The pending restart, if any.
        ended: Fired when its process ends (while stopping).
    """

    index: int
    node: str
    process: IProcessTransport | None = None
    pid: int | None = None
    started: float = 0.0
    addresses: dict[str, str] | None = None
    restarts: int = 0
    failures: int = 0
    restart: IDelayedCall | None = None
    ended: list[Deferred[None]] = attrs.field(factory=list)


class _WorkerProtocol(ProcessProtocol):
    """A worker process as the supervisor sees it: its reports and its end."""

    def __init__(self, supervisor: Supervisor, slot: WorkerSlot) -> None:
        self._supervisor = supervisor
        self._slot = slot
        self._pending = b""

    def childDataReceived(self, childFD: int, data: bytes) -> None:  # noqa: N802, N803 (Twisted's name)
        """Take the report lines written to `REPORT_FD`."""
        if childFD != REPORT_FD:
            return
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > MAX_REPORT_BYTES:
            self._pending = b""
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._supervisor.reported(self._slot, message)

    def processEnded(self, reason: Failure) -> None:
        """Tell the supervisor."""
        self._supervisor.ended(self._slot, reason)


class Supervisor(Service):
    """Runs N gateway workers: starts, restarts, signals and stops them.

    Args:
        node: The supervisor's node id; worker i is node ``<node>-<i>``.
        processes: How many workers.
        listeners: Each shared listener's endpoint, parsed against
            `PortReservations` (listening holds its port).
        command: The argument list that starts worker i, given the ports held.
        environment: The workers' environment.
        reactor: Spawns the workers (`IReactorProcess`) and keeps time.
        stop_timeout_seconds: How long a stop waits for the workers before
            it kills those left.
        restart_delay: Seconds before a restart, by failures in a row.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        node: str,
        processes: int,
        listeners: Mapping[str, Any],
        command: Callable[[int, Mapping[str, int]], Sequence[str]],
        environment: Mapping[str, str],
        reactor: Any,
        stop_timeout_seconds: float,
        restart_delay: Callable[[int], float] = DEFAULT_RESTART_DELAY,
    ) -> None:
        self.setName("supervisor")
        self.node = node
        self.slots = [WorkerSlot(index, worker_node(node, index)) for index in range(processes)]
        self._listeners = dict(listeners)
        self._command = command
        self._environment = dict(environment)
        self._reactor = reactor
        self._stop_timeout = stop_timeout_seconds
        self._restart_delay = restart_delay
        self.reservations: dict[str, PortReservation] = {}
        self.restarts = 0
        """Restarts of all workers since the supervisor started."""
        self.ready = False
        """Whether every worker has been ready at least once."""
        self._stopping = False

    @property
    def shared_ports(self) -> dict[str, int]:
        """The port held for each shared listener."""
        return {name: held.port for name, held in self.reservations.items()}

    # --- start -----------------------------------------------------------------------

    def startService(self) -> None:
        """Hold every shared listener's port, then start the workers.

        Raises:
            StartFailed: A port cannot be held (in use); the critical line
                says why, and the process ends with status 1, no traceback.
        """
        super().startService()
        for name, endpoint in self._listeners.items():
            held: list[Any] = []
            failed: list[Failure] = []
            endpoint.listen(Factory()).addCallbacks(held.append, failed.append)
            if failed:
                self._release()
                self._log.critical(
                    "msggateway cannot start: listener {listener}: {reason}",
                    listener=name,
                    reason=failed[0].getErrorMessage(),
                )
                raise StartFailed
            self.reservations[name] = held[0]
        self._log.info(
            "msggateway supervisor starting {count} worker(s), nodes {first} to {last};"
            " shared ports: {ports}",
            count=len(self.slots),
            first=self.slots[0].node,
            last=self.slots[-1].node,
            ports=" ".join(f"{name}={port}" for name, port in self.shared_ports.items()) or "none",
        )
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: WorkerSlot) -> None:
        slot.restart = None
        if self._stopping:
            return
        argv = list(self._command(slot.index, self.shared_ports))
        slot.addresses = None
        slot.started = self._now()
        process = slot.process = self._reactor.spawnProcess(
            _WorkerProtocol(self, slot),
            argv[0],
            argv,
            env=self._environment,
            childFDs={SUPERVISOR_FD: "w", 1: 1, 2: 2, REPORT_FD: "r"},
        )
        slot.pid = process.pid

    # --- what workers say, and their ends --------------------------------------------

    def reported(self, slot: WorkerSlot, message: Mapping[str, Any]) -> None:
        """A worker's report: ``{"ready": {NAME: "HOST:PORT", ...}}``."""
        addresses = message.get("ready")
        if not isinstance(addresses, dict):
            return
        slot.addresses = {str(name): str(address) for name, address in addresses.items()}
        text = " ".join(f"{name}={address}" for name, address in slot.addresses.items())
        self._log.info(
            "msggateway worker {worker} ready (node {node}, pid {pid}): {addresses}",
            worker=slot.index,
            node=slot.node,
            pid=slot.pid,
            addresses=text,
            listening=slot.addresses,
        )
        if not self.ready and all(other.addresses is not None for other in self.slots):
            self.ready = True
            self._log.info(
                "msggateway supervisor ready: {count} worker(s), nodes {first} to {last}",
                count=len(self.slots),
                first=self.slots[0].node,
                last=self.slots[-1].node,
            )
            tell_systemd({"READY": "1", "STATUS": self._status()})
        elif self.ready:
            tell_systemd({"STATUS": self._status()})

    def ended(self, slot: WorkerSlot, reason: Failure) -> None:
        """A worker's process ended: restart it, unless stopping (or still starting)."""
        pid, slot.process = slot.pid, None  # the transport forgets its pid when it ends
        was_ready = slot.addresses is not None
        slot.addresses = None
        status = _exit_status(reason)
        ran = self._now() - slot.started
        if self._stopping:
            self._log.info(
                "msggateway worker {worker} (node {node}, pid {pid}) stopped: {status}",
                worker=slot.index,
                node=slot.node,
                pid=pid,
                status=status,
            )
            waiting, slot.ended = slot.ended, []
            for done in waiting:
                done.callback(None)
            return
        if not self.ready:
            self._log.critical(
                "msggateway cannot start: worker {worker} (node {node}, pid {pid}) {status}"
                " before the workers were all ready; stopping (its own lines say why)",
                worker=slot.index,
                node=slot.node,
                pid=pid,
                status=status,
            )
            if self._reactor.running:
                self._reactor.stop()
            return
        slot.failures = 0 if ran >= STABLE_SECONDS else slot.failures + 1
        delay = self._restart_delay(max(slot.failures - 1, 0))
        slot.restarts += 1
        self.restarts += 1
        self._log.warn(
            "msggateway worker {worker} (node {node}, pid {pid}) {status} after {seconds:.1f} s"
            "{before}; restart {restarts} of it ({total} in all) in {delay:.1f} s",
            worker=slot.index,
            node=slot.node,
            pid=pid,
            status=status,
            seconds=ran,
            before="" if was_ready else ", before it was ready",
            restarts=slot.restarts,
            total=self.restarts,
            delay=delay,
        )
        tell_systemd({"STATUS": self._status()})
        slot.restart = self._reactor.callLater(delay, self._spawn, slot)

    # --- signals -----------------------------------------------------------------------

    def reload(self) -> int:
        """Pass SIGHUP on to every running worker; return how many got it."""
        sent = sum(self._signal(slot, "HUP") for slot in self.slots)
        self._log.info("reload: SIGHUP passed on to {count} worker(s)", count=sent)
        return sent

    def stopService(self) -> Deferred[None]:
        """Stop every worker (SIGTERM; SIGKILL past the time-out), then release the ports."""
        super().stopService()
        tell_systemd({"STOPPING": "1"})
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        self._stopping = True
        started = self._now()
        for slot in self.slots:
            if slot.restart is not None and slot.restart.active():
                slot.restart.cancel()
            slot.restart = None
        running = [slot for slot in self.slots if slot.process is not None]
        self._log.info(
            "msggateway supervisor stopping {count} worker(s), within {seconds:g} s",
            count=len(running),
            seconds=self._stop_timeout,
        )
        for slot in running:
            self._signal(slot, "TERM")
        await self._wait_for(running, self._stop_timeout)
        left = [slot for slot in running if slot.process is not None]
        if left:
            self._log.warn(
                "msggateway supervisor: {count} worker(s) still running after {seconds:g} s:"
                " killing pids {pids}",
                count=len(left),
                seconds=self._stop_timeout,
                pids=" ".join(str(slot.pid) for slot in left),
            )
            for slot in left:
                self._signal(slot, "KILL")
            await self._wait_for(left, KILL_WAIT_SECONDS)
        self._release()
        self._log.info(
            "msggateway supervisor stopped in {seconds:.2f} s",
            seconds=self._now() - started,
        )

    async def _wait_for(self, slots: list[WorkerSlot], seconds: float) -> None:
        """Wait until the processes of ``slots`` have ended, ``seconds`` at most."""
        waits: list[Deferred[None]] = []
        for slot in slots:
            if slot.process is not None:
                done: Deferred[None] = Deferred()
                slot.ended.append(done)
                waits.append(done)
        if not waits:
            return
        every: Deferred[Any] = DeferredList(waits, consumeErrors=True)
        timer = self._reactor.callLater(seconds, every.cancel)
        try:
            await every
        except CancelledError:
            pass  # the time is up; the caller looks at what is left
        finally:
            if timer.active():
                timer.cancel()
        for slot in slots:
            for done in slot.ended:
                if not done.called:
                    done.cancel()
            slot.ended = [done for done in slot.ended if not done.called]

    def _signal(self, slot: WorkerSlot, name: str) -> bool:
        """Send signal ``name`` to the worker's process; whether it was running."""
        if slot.process is None:
            return False
        try:
            slot.process.signalProcess(name)
        except ProcessExitedAlready:
            return False
        return True

    def _release(self) -> None:
        reservations, self.reservations = self.reservations, {}
        for held in reservations.values():
            held.stopListening()

    def _status(self) -> str:
        """The STATUS told to systemd: how many workers are ready, and the restarts so far."""
        ready = sum(slot.addresses is not None for slot in self.slots)
        return f"{ready} of {len(self.slots)} workers ready; {self.restarts} restart(s)"

    def _now(self) -> float:
        return float(self._reactor.seconds())


def _exit_status(reason: Failure) -> str:
    """How a process ended, in words."""
    error = reason.value
    if isinstance(error, ProcessDone):
        return "exited with status 0"
    if isinstance(error, ProcessTerminated):
        if error.signal is not None:
            return f"ended by signal {error.signal}"
        return f"exited with status {error.exitCode}"
    return f"ended: {reason.getErrorMessage()}"


# --- assembly for twistd ---------------------------------------------------------------


def worker_command(
    config_path: Path,
    log_format: str,
    twistd: Mapping[str, Any] | None,
    python: str = sys.executable,
) -> Callable[[int, Mapping[str, int]], list[str]]:
    """How to start worker i: the supervisor's Python running twistd, logging where it logs.

    Args:
        config_path: The main file.
        log_format: ``--log-format``.
        twistd: twistd's own options (where the supervisor logs, its
            reactor); None outside twistd: log to stdout, default reactor.
        python: The Python to run.
    """
    twistd = twistd or {}
    logging: list[str]
    if twistd.get("syslog"):
        logging = ["--syslog", f"--prefix={twistd.get('prefix') or 'twisted'}"]
        logfile = None
    else:
        logfile = twistd.get("logfile")
        to_stdout = logfile == "-" or (not logfile and twistd.get("nodaemon", True))
        logfile = None if to_stdout else (logfile or "twistd.log")
        logging = ["--logfile=-"]
    reactor = [f"--reactor={twistd['reactor']}"] if twistd.get("reactor") else []

    def command(index: int, shared_ports: Mapping[str, int]) -> list[str]:
        own_log = [f"--logfile={logfile}.worker-{index}"] if logfile else logging
        ports = [
            argument
            for name, port in shared_ports.items()
            for argument in ("--shared-port", f"{name}={port}")
        ]
        return [
            python,
            "-c",
            _TWISTD,
            "--nodaemon",
            "--pidfile=",
            *own_log,
            *reactor,
            "msggateway",
            "--config",
            str(config_path),
            "--log-format",
            log_format,
            "--worker",
            str(index),
            *ports,
        ]

    return command


def worker_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: the supervisor's, without systemd's notification socket.

    Workers report to the supervisor, which alone tells systemd (a unit's
    ``NotifyAccess=main`` would refuse, and log, what a worker sent).
    """
    source = os.environ if environ is None else environ
    return {key: value for key, value in source.items() if key != NOTIFY_SOCKET}


def make_supervisor(
    config: GatewayConfig,
    node: str,
    config_path: Path,
    log_format: str,
    twistd: Mapping[str, Any] | None,
    reactor: Any,
) -> Supervisor:
    """The supervisor of ``config.fleet.processes`` workers, for twistd.

    Args:
        config: The validated configuration (``processes`` > 1).
        node: The supervisor's node id; the workers' are derived from it.
        config_path: The main file, for the workers to load.
        log_format: ``--log-format``, for the workers.
        twistd: twistd's own options, or None.
        reactor: The global reactor.
    """
    reservations = PortReservations()
    listeners = {
        listener.name: serverFromString(reservations, listener.listen_endpoint)
        for listener in config.listeners
        if listener.protocol != "mtl"
    }
    return Supervisor(
        node=node,
        processes=config.fleet.processes,
        listeners=listeners,
        command=worker_command(config_path.resolve(), log_format, twistd),
        environment=worker_environment(),
        reactor=reactor,
        stop_timeout_seconds=config.shutdown_grace_seconds + STOP_MARGIN_SECONDS,
    )
