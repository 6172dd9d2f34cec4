"""Start real gateway processes and talk to them with plain sockets.

`GatewayProcess` writes a configuration into a directory, starts ``twistd
msggateway`` on it, and waits for the ``msggateway ready:`` log line, which
names the address of every listener (tests listen on port 0). Waiting is
event-driven: blocking reads with deadlines, never sleeps. With
``supervised=True`` (a configuration with ``[fleet] processes`` above 1) it
waits for ``msggateway supervisor ready`` instead, and keeps each worker's
node, pid and addresses from the supervisor's ``msggateway worker I ready``
lines (`GatewayProcess.workers`), restarts included.

`LineClient` is a blocking line-oriented socket client (optionally TLS) with a
deadline on every read.

For streams, with rstream (imported only when called; ``./dev test``
installs it): `stream_connection` gives its connection arguments for a
gateway's stream listener, `subscribed` runs a consumer from the first
offset, and `read_stream_until` reads until a test has what it wants.

`start_rabbitmq` starts a RabbitMQ node or cluster under the integration
tests' policy: skipped where RabbitMQ cannot run, except under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tests.rabbitmq import RabbitMQStartError, RabbitMQUnavailable

__all__ = [
    "GatewayProcess",
    "GatewayStartError",
    "LineClient",
    "Worker",
    "read_stream_until",
    "start_rabbitmq",
    "stream_connection",
    "subscribed",
    "twistd_path",
    "under_ci",
]

START_TIMEOUT_SECONDS: Final = 30.0
READ_TIMEOUT_SECONDS: Final = 10.0
_READY: Final = re.compile(r"msggateway ready: (.*)$")
_SUPERVISOR_READY: Final = re.compile(r"msggateway supervisor ready: ")
_WORKER_READY: Final = re.compile(r"msggateway worker (\d+) ready \(node (\S+), pid (\d+)\): (.*)$")


@dataclass(frozen=True)
class Worker:
    """One worker of a supervised gateway, as its last ready line named it."""

    node: str
    pid: int
    addresses: dict[str, tuple[str, int]]


def _addresses(text: str) -> dict[str, tuple[str, int]]:
    """``NAME=HOST:PORT ...`` as a mapping."""
    found: dict[str, tuple[str, int]] = {}
    for item in text.split():
        name, _, address = item.partition("=")
        host, _, port = address.rpartition(":")
        found[name] = (host, int(port))
    return found


def twistd_path() -> str:
    """The twistd next to the running Python (the project's virtualenv)."""
    return str(Path(sys.executable).with_name("twistd"))


class GatewayStartError(Exception):
    """The gateway exited or did not become ready; the message holds its log."""


class GatewayProcess:
    """One ``twistd msggateway`` process with its own configuration directory.

    Args:
        directory: Where the configuration and the process's files go.
        config: The main file's TOML text.
        routes: Route file name (without ``.toml``) to TOML text.
        secrets: The secrets file's TOML text, if any.
        reactor: twistd's ``--reactor`` choice (e.g. ``asyncio``); its default if None.
        supervised: The configuration runs workers under a supervisor
            (``[fleet] processes`` above 1).
        launcher: The command that runs the gateway, to which ``--config
            PATH`` is added (default: ``twistd --nodaemon --pidfile=
            --logfile=- msggateway``, with ``reactor``).
    """

    def __init__(
        self,
        directory: Path,
        config: str,
        routes: dict[str, str] | None = None,
        secrets: str | None = None,
        reactor: str | None = None,
        twistd: str | None = None,
        supervised: bool = False,
        launcher: list[str] | None = None,
    ) -> None:
        self.directory = directory
        self.launcher = launcher
        self.supervised = supervised
        self.workers: dict[int, Worker] = {}
        """Each worker's last ready line (supervised only)."""
        self.reactor = reactor
        self.twistd = twistd or twistd_path()
        """The twistd to run (another virtualenv's, to test an installed wheel)."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "routes").mkdir(exist_ok=True)
        for name, text in (routes or {}).items():
            (directory / "routes" / f"{name}.toml").write_text(text)
        if secrets is not None:
            (directory / "secrets.toml").write_text(secrets)
        self.config_path = directory / "gateway.toml"
        self.config_path.write_text(config)
        self.addresses: dict[str, tuple[str, int]] = {}
        self._output: list[str] = []
        self._lock = threading.Condition()
        self._process: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self._ended = False

    @property
    def pid(self) -> int:
        """The process id."""
        assert self._process is not None
        return self._process.pid

    def output(self) -> str:
        """Everything the gateway has logged so far."""
        with self._lock:
            return "".join(self._output)

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> GatewayProcess:
        """Start the process and wait until every listener listens.

        Raises:
            GatewayStartError: It exited or did not get ready in time.
        """
        launcher = self.launcher or [
            self.twistd,
            "--nodaemon",
            "--pidfile=",
            "--logfile=-",
            *([f"--reactor={self.reactor}"] if self.reactor else []),
            "msggateway",
        ]
        command = [*launcher, "--config", str(self.config_path)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._process = subprocess.Popen(
            command,
            cwd=self.directory,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        assert self._process.stdout is not None
        stream = self._process.stdout
        deadline = time.monotonic() + timeout
        pending = b""
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise GatewayStartError(f"not ready in {timeout} s:\n{self.output()}")
                if not selector.select(left):
                    continue
                chunk = os.read(stream.fileno(), 65536)
                if not chunk:
                    self._process.wait()
                    raise GatewayStartError(
                        f"exited with {self._process.returncode}:\n{self.output()}"
                    )
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for index, raw in enumerate(lines):
                    line = raw.decode("utf-8", "replace")
                    with self._lock:
                        self._output.append(line + "\n")
                        self._note_worker(line)
                    found = (_SUPERVISOR_READY if self.supervised else _READY).search(line)
                    if found:
                        if self.supervised:
                            self.addresses = dict(self.workers[0].addresses)
                        else:
                            self._parse_ready(found.group(1))
                        # Lines that came in the same read as the ready line
                        # (an upstream connecting at once) are kept too.
                        rest = b"".join(raw + b"\n" for raw in lines[index + 1 :]) + pending
                        with self._lock:
                            self._output.append(rest.decode("utf-8", "replace"))
                            for later in rest.decode("utf-8", "replace").splitlines():
                                self._note_worker(later)
                        self._drain = threading.Thread(target=self._drain_output, daemon=True)
                        self._drain.start()
                        return self

    def _parse_ready(self, text: str) -> None:
        self.addresses.update(_addresses(text))

    def _note_worker(self, line: str) -> None:
        """Keep a supervisor's ``msggateway worker I ready`` line (the lock is held)."""
        found = _WORKER_READY.search(line)
        if found:
            index, node, pid, addresses = found.groups()
            self.workers[int(index)] = Worker(node, int(pid), _addresses(addresses))

    def _drain_output(self) -> None:
        # Keep reading so that the gateway never blocks on a full pipe.
        assert self._process is not None and self._process.stdout is not None
        for raw in iter(self._process.stdout.readline, b""):
            with self._lock:
                line = raw.decode("utf-8", "replace")
                self._output.append(line)
                self._note_worker(line)
                self._lock.notify_all()
        with self._lock:
            self._ended = True
            self._lock.notify_all()

    def metrics(self, timeout: float = READ_TIMEOUT_SECONDS, worker: int | None = None) -> str:
        """The text of the admin endpoint's ``/metrics`` (the listener named ``admin``).

        Args:
            timeout: How long the request may take.
            worker: Whose admin endpoint, when supervised (None: worker 0's).
        """
        if worker is None:
            host, port = self.address("admin")
        else:
            with self._lock:
                host, port = self.workers[worker].addresses["admin"]
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
            return str(response.read().decode())

    def wait_for_worker(
        self, index: int, not_pid: int | None = None, timeout: float = READ_TIMEOUT_SECONDS
    ) -> Worker:
        """Worker ``index`` once it is ready, as a process other than ``not_pid``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                worker = self.workers.get(index)
                if worker is not None and worker.pid != not_pid:
                    return worker
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    raise AssertionError(
                        f"worker {index} not ready again (was pid {not_pid}):\n{self.output()}"
                    )
                self._lock.wait(left)

    def address(self, name: str) -> tuple[str, int]:
        """Where a listener listens."""
        return self.addresses[name]

    def wait_for_log(self, pattern: str, timeout: float = READ_TIMEOUT_SECONDS) -> str:
        """Return the first log line matching ``pattern``, waiting for it.

        The drain thread notifies on every line it captures; this waits on
        that condition, bounded by ``timeout``.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for line in "".join(self._output).splitlines():
                    if regex.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    break
                self._lock.wait(left)
        raise AssertionError(f"no log line matching {pattern!r}:\n{self.output()}")

    def wait_for_log_count(self, text: str, count: int, timeout: float) -> None:
        """Wait until ``text`` appears ``count`` times in the log, woken by each new line."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while "".join(self._output).count(text) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    raise AssertionError(f"{text!r} not seen {count} times:\n{self.output()}")
                self._lock.wait(left)

    def kill(self) -> None:
        """Kill the process with SIGKILL (no clean shutdown) and reap it."""
        assert self._process is not None
        self._process.kill()
        self._process.wait()

    def signal(self, signum: int) -> None:
        """Send a signal to the process."""
        assert self._process is not None
        self._process.send_signal(signum)

    def wait(self, timeout: float = 10.0) -> int:
        """Wait for the process to exit by itself (after a signal, say); return its status."""
        assert self._process is not None
        return self._process.wait(timeout)

    def stop(self) -> int | None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s); return its status."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._drain is not None:
            self._drain.join(5)
        if process.stdout is not None:
            process.stdout.close()
        return process.returncode


class LineClient:
    """A blocking LF-line client with a deadline on every read.

    Args:
        address: ``(host, port)``.
        context: An `ssl.SSLContext` for TLS, or None for plain TCP.
        server_hostname: The name to check the server certificate against.
        timeout: Seconds any single read may wait.
    """

    def __init__(
        self,
        address: tuple[str, int],
        context: ssl.SSLContext | None = None,
        server_hostname: str = "localhost",
        timeout: float = READ_TIMEOUT_SECONDS,
    ) -> None:
        raw = socket.create_connection(address, timeout=timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: socket.socket = (
            context.wrap_socket(raw, server_hostname=server_hostname) if context else raw
        )
        self.sock.settimeout(timeout)
        self._buffer = b""

    def send(self, *lines: bytes | str) -> None:
        """Send lines, adding the LF each one needs."""
        data = b"".join(
            (line.encode() if isinstance(line, str) else line) + b"\n" for line in lines
        )
        self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def read_line(self) -> bytes:
        """Return the next line without its LF.

        Raises:
            EOFError: The server closed the connection first.
            TimeoutError: Nothing complete arrived in time.
        """
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(f"connection closed; unterminated: {self._buffer!r}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def read_lines(self, count: int) -> list[bytes]:
        """Return the next ``count`` lines."""
        return [self.read_line() for _ in range(count)]

    def expect(self, expected: bytes | str) -> bytes:
        """Read one line and check it equals ``expected``."""
        want = expected.encode() if isinstance(expected, str) else expected
        line = self.read_line()
        assert line == want, f"expected {want!r}, got {line!r}"
        return line

    def expect_code(self, code: int) -> bytes:
        """Read one line and check it is a response with ``code``."""
        line = self.read_line()
        assert line[:3] == b"%03d" % code and line[3:4] in (b"", b" "), (
            f"expected a {code} response, got {line!r}"
        )
        return line

    def expect_closed(self) -> bytes:
        """Wait for the server to close; return any bytes that came before."""
        data = self._buffer
        self._buffer = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                return data
            if not chunk:
                return data
            data += chunk

    def sync(self) -> None:
        """Round-trip a PING so that everything sent before it was handled.

        SSMP answers in order on one connection: once ``000 . PONG`` arrives,
        any line the server sent in reply to earlier requests came first.
        """
        self.send("PING")
        self.expect("000 . PONG")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> LineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- streams, read with rstream ---------------------------------------------------------------


def stream_connection(process: GatewayProcess, listener: str = "streams") -> dict[str, Any]:
    """Rstream's connection arguments (as guest) for a gateway's stream listener."""
    host, port = process.address(listener)
    return {"host": host, "port": port, "username": "guest", "password": "guest"}


@contextlib.asynccontextmanager
async def subscribed(
    connection: Mapping[str, Any],
    stream: str,
    on_message: Callable[[Any, Any], Awaitable[None]],
    *,
    amqp: bool = True,
    offset: Any = None,
) -> AsyncIterator[None]:
    """An rstream consumer of ``stream`` running while the block runs; closed after it.

    Args:
        connection: Rstream's connection arguments.
        stream: The stream.
        on_message: Called with each message and its context.
        amqp: Decode messages as AMQP 1.0 (else they are the stored bytes).
        offset: Where to start, an rstream ``ConsumerOffsetSpecification``
            (None: the first offset).
    """
    import rstream

    consumer = rstream.Consumer(**connection)
    await consumer.start()
    runner: asyncio.Task[None] | None = None
    try:
        await consumer.subscribe(
            stream,
            on_message,
            decoder=rstream.amqp_decoder if amqp else None,
            offset_specification=offset,
        )
        runner = asyncio.create_task(consumer.run())
        yield
    finally:
        await consumer.close()
        if runner is not None:
            runner.cancel()


async def read_stream_until(
    connection: Mapping[str, Any],
    stream: str,
    take: Callable[[Any, Any], bool],
    *,
    create: bool = False,
    amqp: bool = True,
    offset: Any = None,
) -> None:
    """Read ``stream`` until ``take(message, context)`` returns True (see `subscribed`).

    Args:
        connection: Rstream's connection arguments.
        stream: The stream.
        take: Keeps what the test wants of each message; True when it has enough.
        create: Create the stream first, in case the gateway has not yet.
        amqp: Decode messages as AMQP 1.0 (else they are the stored bytes).
        offset: Where to start (None: the first offset).
    """
    import rstream

    if create:
        async with rstream.Producer(**connection) as producer:
            await producer.create_stream(stream, exists_ok=True)
    done = asyncio.Event()

    async def on_message(message: Any, context: Any) -> None:
        if take(message, context):
            done.set()

    async with subscribed(connection, stream, on_message, amqp=amqp, offset=offset):
        await done.wait()


# --- RabbitMQ ------------------------------------------------------------------------------------


def under_ci() -> bool:
    """Whether this is a CI run (``CI=true``), where RabbitMQ must be usable."""
    return os.environ.get("CI", "").lower() == "true"


def start_rabbitmq(start: Callable[[], object], what: str, failed: str) -> None:
    """Call ``start``, or end the test as RabbitMQ's availability says.

    Where RabbitMQ cannot run at all (`RabbitMQUnavailable`: not installed
    and not installable) the test is skipped with the reason, except under
    ``CI=true``, where a skip would hide that it never ran: there it fails.
    One that is installed but does not start (`RabbitMQStartError`) always
    fails, with the reason (the nodes' logs).

    Args:
        start: Starts the node or the cluster.
        what: What it starts, for the reports (``RabbitMQ``, ``a RabbitMQ cluster``).
        failed: What a start error means (``the RabbitMQ cluster did not form``).
    """
    import pytest  # here, not above: the benches use this module without pytest

    unavailable = error = None
    try:
        start()
    except RabbitMQUnavailable as exc:
        unavailable = str(exc)
    except RabbitMQStartError as exc:
        error = str(exc)
    # Outside the except clauses, so the report is the reason, not a chain of tracebacks.
    if unavailable is not None and under_ci():
        pytest.fail(
            f"{what} is required under CI=true but cannot run: {unavailable}", pytrace=False
        )
    if unavailable is not None:
        pytest.skip(f"{what} cannot run on this machine: {unavailable}")
    if error is not None:
        pytest.fail(f"{failed}: {error}", pytrace=False)
