"""The supervisor of N workers (`gateway.fleet.supervisor`), on a fake process reactor and a Clock.

`_ProcessReactor` is a `Clock` that records the processes it is asked to
spawn and the signals they are sent; a test plays each worker's part by
calling its protocol: a ready report on descriptor 3, or its end. Shared
ports are held for real (127.0.0.1, port 0).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
from twisted.application.internet import backoffPolicy
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import ProcessExitedAlready, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs
from twisted.python.failure import Failure

from gateway.config import load_config
from gateway.fleet.reuseport import PortReservations
from gateway.fleet.supervisor import (
    STABLE_SECONDS,
    STOP_MARGIN_SECONDS,
    Supervisor,
    make_supervisor,
    worker_command,
    worker_environment,
)
from gateway.fleet.worker import REPORT_FD, SUPERVISOR_FD
from gateway.startup import StartFailed

STOP_SECONDS: Final = 7.0
NO_JITTER: Final = backoffPolicy(initialDelay=0.5, maxDelay=30.0, factor=2.0, jitter=lambda: 0)


@attrs.define
class _Process:
    """A spawned worker: its arguments, the signals it got, whether it ended."""

    pid: int
    protocol: ProcessProtocol
    args: list[str]
    env: Mapping[str, str]
    child_fds: Mapping[int, object]
    signals: list[str] = attrs.field(factory=list)
    ended: bool = False

    def signalProcess(self, name: str) -> None:  # noqa: N802 (Twisted's name)
        """Note the signal; refuse once ended, as Twisted does."""
        if self.ended:
            raise ProcessExitedAlready()
        self.signals.append(name)

    def report_ready(self, **addresses: str) -> None:
        """Write a ready report on the report descriptor, in two pieces."""
        line = json.dumps({"ready": addresses}).encode() + b"\n"
        self.protocol.childDataReceived(REPORT_FD, line[:5])
        self.protocol.childDataReceived(REPORT_FD, line[5:])

    def end(self, signal: int | None = None, status: int | None = None) -> None:
        """End, by a signal or with an exit status."""
        self.ended = True
        self.pid = None  # type: ignore[assignment]  # as Twisted's transport forgets it
        self.protocol.processEnded(Failure(ProcessTerminated(status, signal)))


class _ProcessReactor(Clock):
    """A Clock that spawns `_Process` records and can be stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[_Process] = []
        self.running = True

    def spawnProcess(  # noqa: N802 (Twisted's name)
        self,
        processProtocol: ProcessProtocol,  # noqa: N803 (Twisted's name)
        executable: str,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        path: str | None = None,
        uid: int | None = None,
        gid: int | None = None,
        usePTY: bool = False,  # noqa: N803 (Twisted's name)
        childFDs: Mapping[int, object] | None = None,  # noqa: N803 (Twisted's name)
    ) -> _Process:
        """Record the process."""
        assert executable == args[0]
        process = _Process(
            1000 + len(self.spawned), processProtocol, list(args), dict(env or {}), childFDs or {}
        )
        processProtocol.makeConnection(process)
        self.spawned.append(process)
        return process

    def stop(self) -> None:
        """Stop: the reactor no longer runs."""
        self.running = False

    def latest(self, index: int) -> _Process:
        """The last process spawned for worker ``index`` (its ``--worker`` argument)."""
        return [p for p in self.spawned if p.args[p.args.index("--worker") + 1] == str(index)][-1]


def _command(index: int, shared_ports: Mapping[str, int]) -> list[str]:
    """A stand-in worker command that shows its index and the ports it was given."""
    ports = [f"{name}={port}" for name, port in shared_ports.items()]
    return ["python", "--worker", str(index), *ports]


def _supervisor(
    reactor: _ProcessReactor, processes: int = 2, listeners: Mapping[str, Any] | None = None
) -> Supervisor:
    """A supervisor of ``processes`` workers with one shared listener on a free port."""
    if listeners is None:
        listeners = {"hub": serverFromString(PortReservations(), "tcp:0:interface=127.0.0.1")}
    return Supervisor(
        node="edge",
        processes=processes,
        listeners=listeners,
        command=_command,
        environment={"PATH": "/bin"},
        reactor=reactor,
        stop_timeout_seconds=STOP_SECONDS,
        restart_delay=NO_JITTER,
    )


def _stop(reactor: _ProcessReactor, supervisor: Supervisor) -> None:
    """Stop the supervisor, every worker ending at its SIGTERM."""
    stopped = supervisor.stopService()
    for process in reactor.spawned:
        if not process.ended:
            process.end(signal=15)
    assert stopped.called


@pytest.fixture
def reactor() -> _ProcessReactor:
    """A fresh fake process reactor."""
    return _ProcessReactor()


@pytest.fixture
def running(reactor: _ProcessReactor) -> Iterator[Supervisor]:
    """A started supervisor of two workers, both ready; stopped at the end."""
    supervisor = _supervisor(reactor)
    supervisor.startService()
    for index in (0, 1):
        reactor.latest(index).report_ready(hub="127.0.0.1:1", admin=f"127.0.0.1:{10 + index}")
    yield supervisor
    if supervisor.running:
        _stop(reactor, supervisor)


# --- starting ----------------------------------------------------------------------------


def test_workers_are_started_with_the_held_ports(reactor: _ProcessReactor) -> None:
    """Each worker gets its index, the port held for each shared listener, and the pipes."""
    supervisor = _supervisor(reactor, processes=3)
    supervisor.startService()
    try:
        port = supervisor.shared_ports["hub"]
        assert port > 0
        assert [process.args for process in reactor.spawned] == [
            ["python", "--worker", str(index), f"hub={port}"] for index in range(3)
        ]
        for process in reactor.spawned:
            assert process.env == {"PATH": "/bin"}
            assert process.child_fds == {SUPERVISOR_FD: "w", 1: 1, 2: 2, REPORT_FD: "r"}
        assert [slot.node for slot in supervisor.slots] == ["edge-0", "edge-1", "edge-2"]
    finally:
        _stop(reactor, supervisor)


def test_ready_once_every_worker_reported(reactor: _ProcessReactor) -> None:
    """One ready line per worker as it reports, then the supervisor's once all have."""
    supervisor = _supervisor(reactor)
    with capturedLogs() as events:
        supervisor.startService()
        reactor.latest(1).report_ready(hub="127.0.0.1:5")
        assert not supervisor.ready
        reactor.latest(0).report_ready(hub="127.0.0.1:5")
    assert supervisor.ready
    assert supervisor.slots[1].addresses == {"hub": "127.0.0.1:5"}
    messages = [event["log_format"] for event in events]
    assert sum("msggateway worker {worker} ready" in message for message in messages) == 2
    assert any("msggateway supervisor ready" in message for message in messages)
    _stop(reactor, supervisor)


def test_a_port_in_use_fails_the_start(reactor: _ProcessReactor) -> None:
    """A shared port another socket holds fails the start before any worker is spawned.

    The critical line says why; the process ends with status 1 and no traceback.
    """
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        endpoint = serverFromString(PortReservations(), f"tcp:{port}:interface=127.0.0.1")
        supervisor = _supervisor(reactor, listeners={"hub": endpoint})
        with capturedLogs() as events, pytest.raises(StartFailed) as failed:
            supervisor.startService()
    assert failed.value.code == 1
    assert reactor.spawned == []
    assert [event["log_level"] for event in events] == [LogLevel.critical]


def test_a_worker_that_ends_before_all_are_ready_stops_the_supervisor(
    reactor: _ProcessReactor,
) -> None:
    """The start fails, as a single gateway's would: no restart, the reactor is stopped."""
    supervisor = _supervisor(reactor)
    supervisor.startService()
    reactor.latest(0).report_ready(hub="127.0.0.1:5")
    with capturedLogs() as events:
        reactor.latest(1).end(status=1)
    assert not reactor.running
    assert reactor.getDelayedCalls() == []
    assert [event["log_level"] for event in events] == [LogLevel.critical]
    _stop(reactor, supervisor)


# --- restarts ----------------------------------------------------------------------------


def test_a_worker_that_dies_is_restarted_with_backoff(
    reactor: _ProcessReactor, running: Supervisor
) -> None:
    """0.5 s, then 1 s, then 2 s while it keeps dying young; counted and logged."""
    for restarts, delay in enumerate((0.5, 1.0, 2.0), start=1):
        reactor.advance(1)
        dead = reactor.latest(1)
        with capturedLogs() as events:
            dead.end(signal=9)
        [event] = events
        assert event["log_level"] == LogLevel.warn
        assert event["restarts"] == restarts
        assert event["delay"] == delay
        reactor.advance(delay - 0.01)
        assert reactor.latest(1) is dead
        reactor.advance(0.01)
        assert reactor.latest(1) is not dead
        reactor.latest(1).report_ready(hub="127.0.0.1:1")
    assert running.restarts == 3
    assert running.slots[1].restarts == 3
    assert running.slots[0].restarts == 0


def test_a_worker_that_ran_long_is_restarted_soon_again(
    reactor: _ProcessReactor, running: Supervisor
) -> None:
    """After `STABLE_SECONDS` of running, an exit is restarted after the first delay."""
    for _ in range(3):
        reactor.latest(0).end(status=1)
        reactor.advance(30)
    reactor.advance(STABLE_SECONDS)
    dead = reactor.latest(0)
    dead.end(status=1)
    reactor.advance(0.5)
    assert reactor.latest(0) is not dead


def test_restart_reuses_the_held_ports(reactor: _ProcessReactor, running: Supervisor) -> None:
    """A restarted worker is given the same ports as before."""
    before = reactor.latest(1).args
    reactor.latest(1).end(signal=9)
    reactor.advance(1)
    assert reactor.latest(1).args == before


# --- signals and stopping ---------------------------------------------------------------


def test_reload_passes_sighup_to_every_running_worker(
    reactor: _ProcessReactor, running: Supervisor
) -> None:
    """SIGHUP goes to each worker that runs; a dead one waiting for its restart is skipped."""
    reactor.latest(1).end(signal=9)
    assert running.reload() == 1
    assert reactor.latest(0).signals == ["HUP"]


def test_stop_terms_every_worker_and_waits_for_them(
    reactor: _ProcessReactor, running: Supervisor
) -> None:
    """SIGTERM to all; the stop is done when the last has ended; the ports are released."""
    stopped = running.stopService()
    assert [reactor.latest(index).signals for index in (0, 1)] == [["TERM"], ["TERM"]]
    reactor.latest(0).end(signal=15)
    assert not stopped.called
    reactor.latest(1).end(signal=15)
    assert stopped.called
    assert running.reservations == {}
    assert len(reactor.spawned) == 2  # no restarts while stopping


def test_stop_kills_what_outlives_the_time_out(
    reactor: _ProcessReactor, running: Supervisor
) -> None:
    """A worker still there after the stop time-out gets SIGKILL."""
    stopped = running.stopService()
    reactor.latest(0).end(signal=15)
    reactor.advance(STOP_SECONDS)
    assert reactor.latest(1).signals == ["TERM", "KILL"]
    reactor.latest(1).end(signal=9)
    assert stopped.called


def test_stop_cancels_a_pending_restart(reactor: _ProcessReactor, running: Supervisor) -> None:
    """A worker waiting for its restart is not started again by a stop."""
    reactor.latest(1).end(signal=9)
    stopped = running.stopService()
    reactor.latest(0).end(signal=15)
    assert stopped.called
    reactor.advance(60)
    assert len(reactor.spawned) == 2


# --- the command line and the environment ------------------------------------------------


def test_the_worker_command_logs_where_the_supervisor_logs(tmp_path: Path) -> None:
    """To stdout in the foreground; to ``FILE.worker-i`` with --logfile; to syslog with it."""
    config = tmp_path / "gateway.toml"
    foreground = worker_command(config, "json", {"nodaemon": True, "logfile": None}, "py")
    assert foreground(1, {"hub": 4000}) == [
        "py",
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "--nodaemon",
        "--pidfile=",
        "--logfile=-",
        "msggateway",
        "--config",
        str(config),
        "--log-format",
        "json",
        "--worker",
        "1",
        "--shared-port",
        "hub=4000",
    ]
    to_file = worker_command(config, "text", {"logfile": "/var/log/gw.log", "reactor": "asyncio"})
    assert "--logfile=/var/log/gw.log.worker-2" in to_file(2, {})
    assert "--reactor=asyncio" in to_file(2, {})
    daemon = worker_command(config, "text", {"nodaemon": False, "logfile": None})
    assert "--logfile=twistd.log.worker-0" in daemon(0, {})
    syslog = worker_command(config, "text", {"syslog": True, "prefix": "gw"})
    assert {"--syslog", "--prefix=gw"} <= set(syslog(0, {}))


def test_workers_do_not_get_systemds_socket() -> None:
    """Only the supervisor talks to systemd."""
    assert worker_environment({"NOTIFY_SOCKET": "/run/notify", "HOME": "/x"}) == {"HOME": "/x"}


def test_make_supervisor_shares_every_listener_but_mtl(tmp_path: Path) -> None:
    """MTL listeners take a port per worker: only the others' ports are held."""
    main = tmp_path / "gateway.toml"
    main.write_text(
        "[gateway]\nshutdown_grace_seconds = 3\n[fleet]\nprocesses = 2\n[admin]\nenabled = false\n"
        '[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0:interface=127.0.0.1"\n'
        '[listeners.m]\nprotocol = "mtl"\nendpoint = "tcp:0:interface=127.0.0.1"\n'
    )
    reactor = _ProcessReactor()
    supervisor = make_supervisor(load_config(main), "edge", main, "text", None, reactor)
    supervisor.startService()
    try:
        assert list(supervisor.shared_ports) == ["hub"]
        assert supervisor._stop_timeout == 3 + STOP_MARGIN_SECONDS
        args = reactor.spawned[0].args
        assert args[args.index("--config") + 1] == str(main.resolve())
    finally:
        _stop(reactor, supervisor)
