"""A private RabbitMQ node with the stream plugin, for benchmarks and tests.

`RabbitMQNode` is a context manager that starts a throw-away RabbitMQ node
(Debian's ``rabbitmq-server`` package, 3.10 on Debian 12) and stops it on
exit::

    with RabbitMQNode() as node:
        producer = rstream.Producer(**node.stream_connection())

The node is private to its owner:

* a node name of its own (``msggw-<pid>-<random>@localhost``), so it never
  meets a system node;
* its data, logs, configuration, enabled-plugins file, Erlang cookie
  (``HOME``) and pid file in one directory (a temporary one by default);
* only loopback: AMQP, the stream listener (advertised as ``127.0.0.1`` and
  its port), epmd and Erlang distribution, each on a free port of its own;
* only what it started is stopped: the broker with ``rabbitmqctl stop``
  (then SIGTERM and SIGKILL to the process group it created, if it hangs)
  and its own epmd by PID. Nothing in ``/etc/rabbitmq`` is read or written.

The broker is run as ``/usr/lib/rabbitmq/bin/rabbitmq-server`` rather than
``/usr/sbin/rabbitmq-server``: Debian's wrapper switches to the ``rabbitmq``
user when run as root, and that user could not write a root-owned
temporary directory.

`install_rabbitmq` installs the package with apt-get if it is missing
(root only). Failures raise `RabbitMQUnavailable` (cannot be run here: not
installed, not installable) or `RabbitMQStartError` (installed but did not
start, with the tail of its log): callers can skip on the first and fail
on the second. Standard library only; no pytest dependency.
"""

from __future__ import annotations

import contextlib
import os
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
    "RabbitMQError",
    "RabbitMQNode",
    "RabbitMQStartError",
    "RabbitMQUnavailable",
    "find_rabbitmq",
    "install_rabbitmq",
]

RABBITMQ_BIN: Final = Path("/usr/lib/rabbitmq/bin")
"""Where Debian's package keeps the real scripts (not the su wrappers)."""

START_TIMEOUT_SECONDS: Final = 90.0
"""Start to ready is about 5 s on these machines; the first start after an
install also compiles nothing, so 90 s only catches a hang."""

STOP_TIMEOUT_SECONDS: Final = 30.0
CLI_TIMEOUT_SECONDS: Final = 60.0
INSTALL_TIMEOUT_SECONDS: Final = 900.0
POLL_INTERVAL_SECONDS: Final = 0.1
LOG_TAIL_BYTES: Final = 6000

_POLICY_RC_D: Final = Path("/usr/sbin/policy-rc.d")


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
        " install it with `apt-get install rabbitmq-server` (as root) or pass install=True"
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
        _POLICY_RC_D.write_text("#!/bin/sh\n# msggateway bench: no service starts\nexit 101\n")
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
    """Distinct free loopback ports (held open together, so they differ)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


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


class RabbitMQNode:
    """A private RabbitMQ node with ``rabbitmq_stream``, on loopback; a context manager.

    Args:
        directory: Where its files go (a temporary directory, removed at
            exit, if None; kept if given).
        install: Install the Debian package first if it is missing (root).
        start_timeout: Seconds to wait for the node to be ready.

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
    ) -> None:
        self._given_directory = directory
        self._install = install
        self._start_timeout = start_timeout
        self._directory: Path | None = None
        self._bin: Path | None = None
        self._env: dict[str, str] = {}
        self._server: subprocess.Popen[bytes] | None = None
        self._epmd: subprocess.Popen[bytes] | None = None
        self.amqp_port = self.stream_port = self.epmd_port = self.dist_port = 0
        self.node_name = f"msggw-{os.getpid()}-{secrets.token_hex(3)}@localhost"
        self.setup_notes: list[str] = []

    # --- what users of a running node need ----------------------------------------------------

    @property
    def directory(self) -> Path:
        """The node's directory."""
        if self._directory is None:
            raise RabbitMQError("the node is not started")
        return self._directory

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
        directory = self.directory
        main_logs = sorted((directory / "log").glob("*.log"))
        parts = [f"--- console ---\n{_tail(directory / 'console.log')}"]
        parts += [f"--- {path.name} ---\n{_tail(path)}" for path in main_logs]
        return "\n".join(parts)

    def version(self) -> str:
        """The broker's version, as ``rabbitmqctl version`` reports it."""
        return self.rabbitmqctl("version").strip()

    def rabbitmqctl(self, *args: str, timeout: float = CLI_TIMEOUT_SECONDS) -> str:
        """Run ``rabbitmqctl`` against this node; return its output.

        Raises:
            RabbitMQStartError: It failed or timed out (with its output).
        """
        return self._cli("rabbitmqctl", "-n", self.node_name, *args, timeout=timeout)

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
        """Start the node and wait until its stream listener answers.

        Raises:
            RabbitMQUnavailable: Not installed (and not installable).
            RabbitMQStartError: It exited, or was not ready in time (with its log).
        """
        if self._install:
            self.setup_notes += install_rabbitmq()
        self._bin = find_rabbitmq()
        epmd = _find_epmd()
        if self._given_directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="msggw-rabbitmq-"))
        else:
            self._directory = self._given_directory
            self._directory.mkdir(parents=True, exist_ok=True)
        try:
            self._prepare()
            self._epmd = subprocess.Popen(
                [epmd, "-address", "127.0.0.1", "-port", str(self.epmd_port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self._env,
            )
            self._wait_for_port(self.epmd_port, "epmd", self._epmd, time.monotonic() + 10)
            self._cli("rabbitmq-plugins", "--offline", "enable", "rabbitmq_stream")
            with (self.directory / "console.log").open("wb") as console:
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
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self) -> None:
        """Choose ports and write the node's configuration, plugins file and cookie."""
        directory = self.directory
        self.amqp_port, self.stream_port, self.epmd_port, self.dist_port = _free_ports(4)
        home = directory / "home"
        home.mkdir(exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text("".join(secrets.choice(string.ascii_uppercase) for _ in range(20)))
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
        loopback = "-kernel inet_dist_use_interface {127,0,0,1}"
        self._env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(home),
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

    def _cli(self, tool: str, *args: str, timeout: float = CLI_TIMEOUT_SECONDS) -> str:
        """Run one of the node's CLI tools with its environment."""
        assert self._bin is not None
        command = [str(self._bin / tool), *args]
        try:
            result = subprocess.run(
                command,
                env=self._env,
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

    def stop(self) -> None:
        """Stop the broker and its epmd (only those), and remove a temporary directory.

        Safe to call more than once, and after a failed start.
        """
        try:
            self._stop_server()
        finally:
            self._stop_epmd()
            if self._given_directory is None and self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
                self._directory = None

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if server.poll() is None:
            with contextlib.suppress(RabbitMQStartError):
                self.rabbitmqctl("stop", timeout=STOP_TIMEOUT_SECONDS)
        for sent in (None, signal.SIGTERM, signal.SIGKILL):
            if sent is not None:
                # The process group is the one start() created for the broker.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, sent)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(STOP_TIMEOUT_SECONDS if sent is None else 10)
                break
        # The shell has gone; make sure the VM it started has too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)

    def _stop_epmd(self) -> None:
        epmd, self._epmd = self._epmd, None
        if epmd is None or epmd.poll() is not None:
            return
        epmd.terminate()
        try:
            epmd.wait(10)
        except subprocess.TimeoutExpired:
            epmd.kill()
            epmd.wait()
