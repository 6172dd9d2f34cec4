"""A private RabbitMQ node with the stream plugin, for tests and benchmarks.

`RabbitMQNode` is a context manager that starts a throw-away RabbitMQ node
(Debian's ``rabbitmq-server`` package, 3.10 on Debian 12) and stops it on
exit::

    with RabbitMQNode() as node:
        producer = rstream.Producer(**node.stream_connection())
        ...
        node.restart()  # same node name, ports and data: streams survive

The node is private to its owner:

* a node name of its own (``msggw-<pid>-<random>@localhost``), so it never
  meets a system node;
* its data, logs, configuration, enabled-plugins file, Erlang cookie
  (``HOME``) and pid file in one directory (a temporary one by default);
* only loopback: AMQP, the stream listener (advertised as ``127.0.0.1`` and
  its port), epmd and Erlang distribution, each on a free port of its own,
  chosen below the kernel's ephemeral range so that no client connection
  takes one while the broker is down for a restart;
* only what it started is stopped: the broker with ``rabbitmqctl stop``
  (then SIGTERM and SIGKILL to the process group it created, if it hangs),
  its own epmd by PID, and then any process still carrying this node's
  marker in its environment (the VM's port programs, such as
  ``inet_gethost``, run in sessions of their own and outlive a killed VM
  for a moment). Every step has a deadline. Nothing in ``/etc/rabbitmq``
  is read or written.

`RabbitMQNode.stop_broker` stops the broker alone (gracefully, or with
SIGKILL to simulate a crash) and `RabbitMQNode.start` brings it back on the
same node name, ports and data directory; `RabbitMQNode.restart` does both
and returns once the broker and every stream it had are back.

The broker is run as ``/usr/lib/rabbitmq/bin/rabbitmq-server`` rather than
``/usr/sbin/rabbitmq-server``: Debian's wrapper switches to the ``rabbitmq``
user when run as root, and that user could not write a root-owned
temporary directory.

`install_rabbitmq` installs the package with apt-get if it is missing
(root only), without letting the package start a system node. Failures
raise `RabbitMQUnavailable` (cannot be run here: not installed, not
installable) or `RabbitMQStartError` (installed but did not start, with the
tail of its log): callers can skip on the first and fail on the second.
Standard library only; no pytest dependency.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final

__all__ = [
    "RABBITMQ_BIN",
    "RabbitMQCluster",
    "RabbitMQError",
    "RabbitMQNode",
    "RabbitMQStartError",
    "RabbitMQUnavailable",
    "StreamAdminClient",
    "find_rabbitmq",
    "install_rabbitmq",
]

RABBITMQ_BIN: Final = Path("/usr/lib/rabbitmq/bin")
"""Where Debian's package keeps the real scripts (not the su wrappers)."""

START_TIMEOUT_SECONDS: Final = 90.0
"""Start to ready is about 5 s on these machines; 90 s only catches a hang."""

STOP_TIMEOUT_SECONDS: Final = 30.0
"""For ``rabbitmqctl stop`` and the VM's exit together (about 2 s seen)."""

SIGNAL_TIMEOUT_SECONDS: Final = 10.0
"""For the broker's process group to exit after SIGTERM, and again after SIGKILL."""

LEFTOVER_TIMEOUT_SECONDS: Final = 5.0
"""For the VM's port programs to exit on their own after it, before SIGKILL."""

CLI_TIMEOUT_SECONDS: Final = 60.0
INSTALL_TIMEOUT_SECONDS: Final = 900.0
POLL_INTERVAL_SECONDS: Final = 0.1
LOG_TAIL_BYTES: Final = 6000

LOWEST_PORT: Final = 10000
"""Ports are picked from here up to the kernel's ephemeral range."""

MARKER_VARIABLE: Final = "MSGGATEWAY_RABBITMQ_NODE"
"""Set to the node name in the environment of every process a node starts."""

_POLICY_RC_D: Final = Path("/usr/sbin/policy-rc.d")
_HANDED_OUT: set[int] = set()
"""Ports `_free_ports` chose in this process: never chosen twice, so that nodes
started side by side (a cluster) cannot pick the same free port before either listens."""
_EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")


class RabbitMQError(Exception):
    """Base of this module's errors."""


class RabbitMQUnavailable(RabbitMQError):  # noqa: N818 (a state, not a failure of ours)
    """RabbitMQ cannot be run on this machine (not installed, or not installable)."""


class RabbitMQStartError(RabbitMQError):
    """RabbitMQ is installed but the node did not start (or stop) as it should."""


def find_rabbitmq() -> Path:
    """Return the directory of the ``rabbitmq-server`` and ``rabbitmqctl`` scripts.

    Raises:
        RabbitMQUnavailable: The package is not installed.
    """
    if (RABBITMQ_BIN / "rabbitmq-server").exists():
        return RABBITMQ_BIN
    raise RabbitMQUnavailable(
        f"rabbitmq-server is not installed ({RABBITMQ_BIN / 'rabbitmq-server'} is missing);"
        " `./dev test` installs it when run as root, or run"
        " `apt-get install rabbitmq-server` as root"
    )


def _find_epmd() -> str:
    """The epmd executable that ships with Erlang."""
    found = shutil.which("epmd")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))
    if candidates:
        return str(candidates[-1])
    raise RabbitMQUnavailable(
        "epmd (Erlang's port mapper) was not found; is erlang-base installed?"
    )


def install_rabbitmq(*, update: bool = True) -> list[str]:
    """Install Debian's ``rabbitmq-server`` package unless it is installed already.

    The package's maintainer scripts would start a system-wide node on every
    interface; where no ``/usr/sbin/policy-rc.d`` exists, a temporary one
    that forbids starting services is put in place for the install and
    removed afterwards (Docker images usually ship one already).

    Args:
        update: Run ``apt-get update`` first.

    Returns:
        What was done, one line per step (empty if it was installed already).

    Raises:
        RabbitMQUnavailable: Not root, no apt-get, or apt-get failed (with its output).
    """
    with contextlib.suppress(RabbitMQUnavailable):
        find_rabbitmq()
        return []
    if os.geteuid() != 0:
        raise RabbitMQUnavailable("rabbitmq-server is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise RabbitMQUnavailable("rabbitmq-server is not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    commands = [["apt-get", "update"]] if update else []
    commands.append(["apt-get", "install", "-y", "--no-install-recommends", "rabbitmq-server"])
    done: list[str] = []
    made_policy = not _POLICY_RC_D.exists()
    if made_policy:
        _POLICY_RC_D.write_text("#!/bin/sh\n# msggateway tests: no service starts\nexit 101\n")
        _POLICY_RC_D.chmod(0o755)
    try:
        for command in commands:
            started = time.monotonic()
            try:
                result = subprocess.run(
                    command,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=INSTALL_TIMEOUT_SECONDS,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise RabbitMQUnavailable(
                    f"`{' '.join(command)}` took longer than {INSTALL_TIMEOUT_SECONDS:.0f} s"
                ) from exc
            if result.returncode != 0:
                raise RabbitMQUnavailable(
                    f"`{' '.join(command)}` failed with status {result.returncode}:\n"
                    + (result.stdout + result.stderr)[-LOG_TAIL_BYTES:]
                )
            done.append(f"{' '.join(command)}: {time.monotonic() - started:.1f} s")
    finally:
        if made_policy:
            _POLICY_RC_D.unlink(missing_ok=True)
    find_rabbitmq()
    return done


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports below the ephemeral range (held open together).

    A port the kernel hands out for port 0 may later become the source port
    of some client connection; one below the ephemeral range only goes to a
    listener that asks for it, so the node can get its ports back after a
    restart. Without a readable range, the kernel chooses.
    """
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    below = range(LOWEST_PORT, low)
    candidates = random.sample(below, min(200, len(below)))
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for candidate in [*candidates, *[0] * count]:
            if len(ports) == count:
                break
            if candidate in _HANDED_OUT:
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            ports.append(sock.getsockname()[1])
        _HANDED_OUT.update(ports)
        return ports


def _run_epmd(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start an epmd on loopback (stopped by its PID, by whoever started it)."""
    return subprocess.Popen(
        [_find_epmd(), "-address", "127.0.0.1", "-port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def _stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM a process we started, SIGKILL it if it lingers, and reap it."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(SIGNAL_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _answers(port: int) -> bool:
    """Whether something accepts TCP connections on a loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _tail(path: Path) -> str:
    """The end of a log file, or a note that there is none."""
    try:
        data = path.read_bytes()
    except OSError:
        return f"(no {path.name})"
    return data[-LOG_TAIL_BYTES:].decode("utf-8", "replace")


def _marked_processes(marker: bytes, exclude: set[int]) -> set[int]:
    """PIDs of live processes whose environment holds ``marker`` (zombies have exited)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in exclude:
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                found.add(int(entry.name))
    return found


class RabbitMQNode:
    """A private RabbitMQ node with ``rabbitmq_stream``, on loopback; a context manager.

    Args:
        directory: Where its files go (a temporary directory, removed by
            `stop`, if None; kept if given).
        install: Install the Debian package first if it is missing (root).
        start_timeout: Seconds to wait for the node to be ready.
        epmd_port: An epmd that someone else runs (a `RabbitMQCluster`, whose
            nodes must find each other in one); None: the node starts its own.
        cookie: The Erlang cookie (the same for every node of a cluster);
            None: a random one.
        node_name: The Erlang node name; None: ``msggw-<pid>-<random>@localhost``.

    Attributes:
        host: Always ``127.0.0.1``.
        amqp_port: The AMQP 0-9-1 listener's port.
        stream_port: The stream listener's (and advertised) port.
        epmd_port: Its private epmd's port.
        dist_port: Its Erlang distribution port.
        node_name: Its Erlang node name.
        username: ``guest`` (may log in from loopback only).
        password: ``guest``.
        setup_notes: What was done to make it runnable (install steps).
    """

    host: Final = "127.0.0.1"
    username: Final = "guest"
    password: Final = "guest"

    def __init__(
        self,
        directory: Path | None = None,
        *,
        install: bool = False,
        start_timeout: float = START_TIMEOUT_SECONDS,
        epmd_port: int | None = None,
        cookie: str | None = None,
        node_name: str | None = None,
    ) -> None:
        self._given_directory = directory
        self._install = install
        self._start_timeout = start_timeout
        self._shared_epmd_port = epmd_port
        self._cookie = cookie or "".join(secrets.choice(string.ascii_uppercase) for _ in range(20))
        self._directory: Path | None = None
        self._bin: Path | None = None
        self._env: dict[str, str] = {}
        self._server: subprocess.Popen[bytes] | None = None
        self._epmd: subprocess.Popen[bytes] | None = None
        self.amqp_port = self.stream_port = self.epmd_port = self.dist_port = 0
        self.node_name = node_name or f"msggw-{os.getpid()}-{secrets.token_hex(3)}@localhost"
        self.setup_notes: list[str] = []

    # --- what users of a running node need ----------------------------------------------------

    @property
    def directory(self) -> Path:
        """The node's directory."""
        if self._directory is None:
            raise RabbitMQError("the node is not started")
        return self._directory

    @property
    def running(self) -> bool:
        """Whether the broker process is alive (started and not stopped)."""
        return self._server is not None and self._server.poll() is None

    @property
    def server_pid(self) -> int | None:
        """The Erlang VM's process id (from the node's pid file), once it wrote it."""
        try:
            return int((self.directory / "rabbitmq.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stream_connection(self) -> dict[str, Any]:
        """Keyword arguments for rstream's ``Producer`` and ``Consumer``."""
        return {
            "host": self.host,
            "port": self.stream_port,
            "username": self.username,
            "password": self.password,
        }

    def log_tail(self) -> str:
        """The end of the broker's console output and of its main log."""
        if self._directory is None:
            return "(the node has no directory)"
        directory = self._directory
        main_logs = sorted((directory / "log").glob("*.log"))
        parts = [f"--- console ---\n{_tail(directory / 'console.log')}"]
        parts += [f"--- {path.name} ---\n{_tail(path)}" for path in main_logs]
        return "\n".join(parts)

    def version(self) -> str:
        """The broker's version, as ``rabbitmqctl version`` reports it."""
        return self.rabbitmqctl("version").strip()

    def rabbitmqctl(self, *args: str, timeout: float = CLI_TIMEOUT_SECONDS) -> str:
        """Run ``rabbitmqctl`` against this node; return its output.

        For example ``node.rabbitmqctl("list_queues", "name", "type")``.

        Raises:
            RabbitMQStartError: It failed or timed out (with its output).
        """
        return self._cli("rabbitmqctl", "-n", self.node_name, *args, timeout=timeout)

    def streams(self) -> dict[str, str]:
        """The node's streams (virtual host ``/``): name to state (``running`` when usable)."""
        output = self.rabbitmqctl(
            "list_queues", "name", "type", "state", "--formatter", "json", "--quiet"
        )
        rows = json.loads(output or "[]")
        return {row["name"]: str(row["state"]) for row in rows if row.get("type") == "stream"}

    def join_cluster(self, seed: RabbitMQNode) -> None:
        """Join ``seed``'s cluster: ``stop_app``, ``join_cluster``, ``start_app``, await startup.

        Both nodes must share an epmd and a cookie (a `RabbitMQCluster` sees to it).

        Raises:
            RabbitMQStartError: A step failed or timed out (with its output).
        """
        self.rabbitmqctl("stop_app")
        self.rabbitmqctl("join_cluster", seed.node_name)
        self.rabbitmqctl("start_app")
        self.rabbitmqctl("await_startup", "--timeout", str(int(self._start_timeout)))

    def stream_client(self, timeout: float = CLI_TIMEOUT_SECONDS) -> StreamAdminClient:
        """A logged-in `StreamAdminClient` on this node's stream port (a context manager)."""
        return StreamAdminClient(
            self.host, self.stream_port, self.username, self.password, timeout=timeout
        )

    def delete_stream(self, name: str) -> None:
        """Delete a stream (``rabbitmqctl delete_queue`` works for streams on 3.10).

        Raises:
            RabbitMQStartError: There is no such stream, or the command failed.
        """
        self.rabbitmqctl("delete_queue", name)

    # --- start and stop --------------------------------------------------------------------

    def __enter__(self) -> RabbitMQNode:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> RabbitMQNode:
        """Start the node and wait until it is ready; returns the node.

        The first start sets the node up (directory, ports, configuration,
        plugin, epmd). After `stop_broker` it starts the broker again with
        the same node name, ports and data, and also waits until every
        stream it had is running again. After `stop`, it starts afresh.

        Raises:
            RabbitMQUnavailable: Not installed (and not installable).
            RabbitMQStartError: It exited, or was not ready in time (with its log).
        """
        if self.running:
            raise RabbitMQError("the node is running already")
        first = self._directory is None
        try:
            if first:
                self._set_up()
            elif self._shared_epmd_port is None and (
                self._epmd is None or self._epmd.poll() is not None
            ):
                self._start_epmd()
            self._start_server(await_streams=not first)
        except BaseException:
            if first:
                self.stop()
            else:
                self._stop_server(graceful=False)
            raise
        return self

    def stop_broker(self, *, graceful: bool = True) -> None:
        """Stop the broker only, keeping its epmd, ports, directory and data for `start`.

        Args:
            graceful: Stop it with ``rabbitmqctl stop``; if False, SIGKILL it
                at once (a crash: what was confirmed is on disk, not fsynced).
        """
        self._stop_server(graceful=graceful)

    def restart(self, *, graceful: bool = True) -> RabbitMQNode:
        """`stop_broker`, then `start`: the same node, ports and streams; returns the node."""
        self.stop_broker(graceful=graceful)
        return self.start()

    def stop(self) -> None:
        """Stop everything it started and remove a temporary directory.

        Bounded in time; safe to call more than once, and after a failed start.
        """
        try:
            self._stop_server(graceful=True)
        finally:
            self._stop_epmd()
            self._stop_leftovers(exclude=set())
            if self._given_directory is None and self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    # --- how ---------------------------------------------------------------------------------

    def _set_up(self) -> None:
        """Install if asked; make the directory, configuration and plugins file; start epmd."""
        if self._install:
            self.setup_notes += install_rabbitmq()
        self._bin = find_rabbitmq()
        if self._given_directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="msggw-rabbitmq-"))
        else:
            self._directory = self._given_directory
            self._directory.mkdir(parents=True, exist_ok=True)
        self._prepare()
        if self._shared_epmd_port is None:
            self._start_epmd()

    def _prepare(self) -> None:
        """Choose ports and write the node's configuration, plugins file and cookie."""
        directory = self.directory
        if self._shared_epmd_port is None:
            self.amqp_port, self.stream_port, self.epmd_port, self.dist_port = _free_ports(4)
        else:
            self.amqp_port, self.stream_port, self.dist_port = _free_ports(3)
            self.epmd_port = self._shared_epmd_port
        home = directory / "home"
        home.mkdir(exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.unlink(missing_ok=True)
        cookie.write_text(self._cookie)
        cookie.chmod(0o400)
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"stream.listeners.tcp.1 = 127.0.0.1:{self.stream_port}\n"
            "stream.advertised_host = 127.0.0.1\n"
            f"stream.advertised_port = {self.stream_port}\n"
            "loopback_users.guest = true\n"
            "log.file.level = info\n"
        )
        (directory / "rabbitmq-env.conf").write_text("# private node: nothing from /etc\n")
        # What `rabbitmq-plugins --offline enable rabbitmq_stream` writes, without
        # the second or two its CLI takes; dependencies are resolved at boot.
        (directory / "enabled_plugins").write_text("[rabbitmq_stream].\n")
        loopback = "-kernel inet_dist_use_interface {127,0,0,1}"
        self._env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(home),
            MARKER_VARIABLE: self.node_name,
            "RABBITMQ_NODENAME": self.node_name,
            "RABBITMQ_BASE": str(directory),
            "RABBITMQ_CONF_ENV_FILE": str(directory / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(directory / "plugins-expand"),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": loopback,
            "RABBITMQ_CTL_ERL_ARGS": loopback,
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
        }

    def _start_epmd(self) -> None:
        """Start the node's own epmd on loopback and wait until it answers.

        It runs for the node's whole life (across restarts), so the VM and
        the CLI tools never start a daemonised epmd of their own.
        """
        self._epmd = _run_epmd(self.epmd_port, self._env)
        self._wait_for_port(self.epmd_port, "epmd", self._epmd, time.monotonic() + 10)

    def _start_server(self, *, await_streams: bool) -> None:
        """Start the broker in a process group of its own and wait until it is ready."""
        assert self._bin is not None
        (self.directory / "rabbitmq.pid").unlink(missing_ok=True)
        with (self.directory / "console.log").open("ab") as console:
            self._server = subprocess.Popen(
                [str(self._bin / "rabbitmq-server")],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=self._env,
                cwd=self.directory,
                start_new_session=True,  # its own process group, ours to signal
            )
        deadline = time.monotonic() + self._start_timeout
        self._wait_for_port(self.stream_port, "the stream listener", self._server, deadline)
        left = max(1.0, deadline - time.monotonic())
        self.rabbitmqctl("await_startup", "--timeout", str(int(left)), timeout=left + 10)
        if await_streams:
            self._await_streams(deadline)

    def _await_streams(self, deadline: float) -> None:
        """Wait until every stream of the node is running again (after a restart)."""
        while True:
            states = self.streams()
            waiting = {name: state for name, state in states.items() if state != "running"}
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RabbitMQStartError(
                    f"streams not running again in time: {waiting}\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL_SECONDS)

    def _cli(self, tool: str, *args: str, timeout: float = CLI_TIMEOUT_SECONDS) -> str:
        """Run one of the node's CLI tools with its environment."""
        if self._bin is None:
            raise RabbitMQError("the node is not started")
        command = [str(self._bin / tool), *args]
        try:
            result = subprocess.run(
                command,
                env=self._env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RabbitMQStartError(f"`{' '.join(command)}` took over {timeout:.0f} s") from exc
        if result.returncode != 0:
            raise RabbitMQStartError(
                f"`{' '.join(command)}` failed with status {result.returncode}:\n"
                f"{result.stdout}{result.stderr}\n{self.log_tail()}"
            )
        return result.stdout

    def _wait_for_port(
        self, port: int, what: str, process: subprocess.Popen[bytes], deadline: float
    ) -> None:
        """Poll a port until it answers; fail if the process exits or time runs out."""
        while not _answers(port):
            if process.poll() is not None:
                raise RabbitMQStartError(
                    f"{what} exited with status {process.returncode} before port {port}"
                    f" answered:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RabbitMQStartError(
                    f"{what} did not answer on port {port} in time:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL_SECONDS)

    def _stop_server(self, *, graceful: bool) -> None:
        """Stop the broker's process group, then its port programs; bounded in time."""
        server, self._server = self._server, None
        if server is None:
            return
        if graceful and server.poll() is None:
            deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
            with contextlib.suppress(RabbitMQStartError):
                self.rabbitmqctl("stop", timeout=STOP_TIMEOUT_SECONDS)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(max(0.1, deadline - time.monotonic()))
        for sent in (signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,):
            if server.poll() is not None:
                break
            # The process group is the one _start_server created for the broker.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, sent)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(SIGNAL_TIMEOUT_SECONDS)
        # The shell has gone; make sure the VM it started has too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        self._stop_leftovers(exclude={self._epmd.pid} if self._epmd is not None else set())

    def _stop_leftovers(self, exclude: set[int]) -> None:
        """Wait a little for this node's remaining processes to exit, then SIGKILL them.

        Found by the marker in their environment, so only processes this
        node started (directly or not) are touched, never another node's.
        """
        marker = f"{MARKER_VARIABLE}={self.node_name}".encode()
        deadline = time.monotonic() + LEFTOVER_TIMEOUT_SECONDS
        left = _marked_processes(marker, exclude)
        while left and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_SECONDS)
            left = _marked_processes(marker, exclude)
        for pid in left:  # found alive by the scan just above
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _stop_epmd(self) -> None:
        """Stop the node's own epmd by its PID (a shared one is its owner's to stop)."""
        epmd, self._epmd = self._epmd, None
        _stop_process(epmd)


class StreamAdminClient:
    """A blocking stream-protocol client for setting up and checking: create, delete, metadata.

    It speaks through the gateway's own codec (`gateway.codecs.stream`,
    standard library only): peer properties, SASL PLAIN, tune (no
    heartbeats), open ``/``, then one request at a time, each answered
    within ``timeout`` seconds. It does not publish or consume (rstream
    does that in the tests); it is what rstream's locator connection does
    to create a stream with arguments and to ask where a stream's leader is.

    Args:
        host: The node's stream host.
        port: Its stream port.
        username: Logs in with SASL PLAIN as this user.
        password: And this password.
        timeout: Seconds the connection and each answer may take.

    Raises:
        OSError: The connection failed or an answer did not come in time.
        RabbitMQError: The login or the virtual host was refused.
    """

    def __init__(
        self,
        host: str,
        port: int,
        username: str,
        password: str,
        *,
        timeout: float = CLI_TIMEOUT_SECONDS,
    ) -> None:
        from gateway.codecs import stream as sp  # the project's codec, only when used

        self._sp = sp
        self._timeout = timeout
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._events: list[Any] = []
        self._correlation = 0
        self._sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self._handshake(username, password)
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> StreamAdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def create_stream(self, stream: str, arguments: dict[str, str] | None = None) -> int:
        """Create a stream; return the response code (1: created, 5: it exists).

        Args:
            stream: Its name.
            arguments: The stream protocol's string arguments, e.g.
                ``initial-cluster-size``, ``queue-leader-locator``,
                ``max-length-bytes``.
        """
        answer = self._request(self._sp.Create, stream=stream, arguments=arguments or {})
        return int(answer.code)

    def delete_stream(self, stream: str) -> int:
        """Delete a stream; return the response code (1: deleted)."""
        return int(self._request(self._sp.Delete, stream=stream).code)

    def metadata(self, stream: str) -> tuple[int, tuple[str, int] | None, list[tuple[str, int]]]:
        """Ask where a stream lives.

        Returns:
            The stream's code (1 when it is usable), its leader's advertised
            ``(host, port)`` (None while it has none) and its replicas'.
        """
        answer = self._request(self._sp.Metadata, streams=(stream,))
        brokers = {broker.reference: (broker.host, broker.port) for broker in answer.brokers}
        (entry,) = answer.streams
        replicas = [brokers[r] for r in entry.replicas if r in brokers]
        return int(entry.code), brokers.get(entry.leader), replicas

    def _handshake(self, username: str, password: str) -> None:
        sp = self._sp
        self._request(sp.PeerProperties, properties={"product": "msggateway-tests"})
        self._request(sp.SaslHandshake)
        plain = b"\0" + username.encode() + b"\0" + password.encode()
        answer = self._request(sp.SaslAuthenticate, mechanism="PLAIN", data=plain)
        if answer.code != sp.ResponseCode.OK:
            raise RabbitMQError(f"stream login as {username!r} refused (code {answer.code})")
        tune = self._next(lambda event: isinstance(event, sp.Tune))
        self._send(sp.Tune(frame_max=tune.frame_max, heartbeat=0))
        opened = self._request(sp.Open, virtual_host="/")
        if opened.code != sp.ResponseCode.OK:
            raise RabbitMQError(f"virtual host / refused (code {opened.code})")

    def _send(self, event: Any) -> None:
        self._sock.sendall(self._codec.send(event))

    def _request(self, request: Any, **fields: Any) -> Any:
        self._correlation += 1
        correlation = self._correlation
        self._send(request(correlation_id=correlation, **fields))
        return self._next(lambda event: getattr(event, "correlation_id", None) == correlation)

    def _next(self, wanted: Any) -> Any:
        """The first event (kept or read next) that ``wanted`` accepts; others are dropped."""
        deadline = time.monotonic() + self._timeout
        while True:
            for index, event in enumerate(self._events):
                if wanted(event):
                    del self._events[: index + 1]
                    return event
            self._events.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the stream port in {self._timeout} s")
            self._sock.settimeout(left)
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("the stream port closed the connection")
            self._events.extend(self._codec.receive_data(data))


class RabbitMQCluster:
    """Private RabbitMQ nodes on loopback, joined in one cluster; a context manager.

    Each node is a `RabbitMQNode` with a name, ports (AMQP, stream
    advertised as ``127.0.0.1`` and its port, Erlang distribution) and data
    directory of its own; they share one epmd on a free loopback port (so
    that they find each other) and one Erlang cookie. The nodes boot side by
    side, then every node after the first joins it (``rabbitmqctl
    stop_app``, ``join_cluster``, ``start_app``)::

        with RabbitMQCluster(3) as cluster:
            leader = cluster.nodes[0]
            cluster.create_stream("orders", on=leader)  # 3 replicas, leader there
            cluster.await_stream("orders")
            leader.stop_broker(graceful=False)  # a crash of the stream's leader
            new_leader, replicas = cluster.stream_members("orders")

    Stopping stops every node (as `RabbitMQNode.stop` does, so only what
    this cluster started), then the epmd by its PID, then removes a
    temporary directory.

    Args:
        size: How many nodes (3 tolerates one down: streams need a majority).
        directory: Where the nodes' directories go (temporary and removed
            if None).
        install: Install the Debian package first if it is missing (root).
        start_timeout: Seconds each node may take to be ready.

    Attributes:
        nodes: The nodes; the first is the one the others joined.
        epmd_port: The shared epmd's port.
    """

    def __init__(
        self,
        size: int = 3,
        directory: Path | None = None,
        *,
        install: bool = False,
        start_timeout: float = START_TIMEOUT_SECONDS,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster has at least one node, not {size}")
        self.size = size
        self._given_directory = directory
        self._install = install
        self._start_timeout = start_timeout
        self._directory: Path | None = None
        self._epmd: subprocess.Popen[bytes] | None = None
        self.epmd_port = 0
        self.nodes: list[RabbitMQNode] = []
        self.setup_notes: list[str] = []

    def __enter__(self) -> RabbitMQCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> RabbitMQCluster:
        """Start the epmd and the nodes, join them into one cluster; returns the cluster.

        Raises:
            RabbitMQUnavailable: Not installed (and not installable).
            RabbitMQStartError: A node did not start, or did not join (with its log).
        """
        if self.nodes:
            raise RabbitMQError("the cluster is started already")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self._install:
            self.setup_notes += install_rabbitmq()
        find_rabbitmq()
        if self._given_directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="msggw-rabbitmq-cluster-"))
        else:
            self._directory = self._given_directory
            self._directory.mkdir(parents=True, exist_ok=True)
        (self.epmd_port,) = _free_ports(1)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
        self._epmd = _run_epmd(self.epmd_port, env)
        deadline = time.monotonic() + 10
        while not _answers(self.epmd_port):
            if self._epmd.poll() is not None or time.monotonic() > deadline:
                raise RabbitMQStartError(f"epmd did not answer on port {self.epmd_port}")
            time.sleep(POLL_INTERVAL_SECONDS)
        cookie = "".join(secrets.choice(string.ascii_uppercase) for _ in range(20))
        prefix = f"msggw-{os.getpid()}-{secrets.token_hex(3)}"
        self.nodes = [
            RabbitMQNode(
                self._directory / f"node{index}",
                start_timeout=self._start_timeout,
                epmd_port=self.epmd_port,
                cookie=cookie,
                node_name=f"{prefix}-{index}@localhost",
            )
            for index in range(1, self.size + 1)
        ]
        self._each(RabbitMQNode.start, self.nodes)
        seed = self.nodes[0]
        for node in self.nodes[1:]:
            node.join_cluster(seed)

    @staticmethod
    def _each(step: Any, nodes: list[RabbitMQNode]) -> None:
        """Run ``step(node)`` for each node side by side; raise the first failure."""
        if not nodes:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            results = [pool.submit(step, node) for node in nodes]
        for result in results:
            result.result()

    def start_stopped(self) -> None:
        """Start every node that was stopped (`RabbitMQNode.stop_broker`) again, side by side.

        Each comes back with its name, ports and data, and rejoins the cluster.

        Raises:
            RabbitMQStartError: One did not start (with its log).
        """
        self._each(RabbitMQNode.start, [node for node in self.nodes if not node.running])

    def stop(self) -> None:
        """Stop every node, then the epmd; remove a temporary directory. Bounded in time."""
        nodes, self.nodes = self.nodes, []
        try:
            if nodes:
                with concurrent.futures.ThreadPoolExecutor(max_workers=len(nodes)) as pool:
                    list(pool.map(RabbitMQNode.stop, nodes))
        finally:
            epmd, self._epmd = self._epmd, None
            _stop_process(epmd)
            if self._given_directory is None and self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def running_nodes(self) -> list[RabbitMQNode]:
        """The nodes whose broker is running."""
        return [node for node in self.nodes if node.running]

    def node_at(self, address: tuple[str, int] | None) -> RabbitMQNode | None:
        """The node that advertises ``(host, port)`` for streams, if any."""
        for node in self.nodes:
            if address == (node.host, node.stream_port):
                return node
        return None

    def create_stream(self, stream: str, *, on: RabbitMQNode | None = None) -> None:
        """Create a stream with a member on every node, its leader on ``on`` (the first node).

        Through the stream protocol on ``on``, with ``initial-cluster-size``
        set to the cluster's size and ``queue-leader-locator`` set to
        ``client-local``.

        Raises:
            RabbitMQError: The node refused (the code says why).
        """
        node = on or self.nodes[0]
        with node.stream_client() as client:
            code = client.create_stream(
                stream,
                {"initial-cluster-size": str(self.size), "queue-leader-locator": "client-local"},
            )
        if code != 1:
            raise RabbitMQError(f"creating stream {stream} on {node.node_name}: code {code}")

    def stream_members(
        self, stream: str, *, via: RabbitMQNode | None = None
    ) -> tuple[RabbitMQNode | None, list[RabbitMQNode]]:
        """The stream's leader (None while it has none) and replicas, from its Metadata.

        Asked through the stream protocol on ``via`` (the first running node by default).
        """
        node = via or self.running_nodes()[0]
        with node.stream_client() as client:
            _code, leader, replicas = client.metadata(stream)
        found = [self.node_at(replica) for replica in replicas]
        return self.node_at(leader), [replica for replica in found if replica is not None]

    def await_stream(
        self, stream: str, *, replicas: int | None = None, timeout: float = CLI_TIMEOUT_SECONDS
    ) -> RabbitMQNode:
        """Wait until the stream has a leader and ``replicas`` replicas; return the leader.

        ``replicas`` defaults to one on every other running node. Polled
        through Metadata until the deadline.

        Raises:
            RabbitMQStartError: Not so in time.
        """
        want = len(self.running_nodes()) - 1 if replicas is None else replicas
        deadline = time.monotonic() + timeout
        while True:
            leader, members = self.stream_members(stream)
            if leader is not None and len(members) >= want:
                return leader
            if time.monotonic() > deadline:
                raise RabbitMQStartError(
                    f"stream {stream}: leader {leader and leader.node_name},"
                    f" {len(members)} replicas, not {want}, after {timeout} s"
                )
            time.sleep(POLL_INTERVAL_SECONDS)
