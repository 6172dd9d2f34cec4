"""``twistd msggateway --log-format json`` for real, as the systemd unit runs it.

twistd runs in the foreground with no ``--logfile`` (stdout, the journal
under systemd) and ``NOTIFY_SOCKET`` naming a datagram socket bound here.
Every line it writes must be one JSON object; the ready line carries each
listener's address as a field and comes with ``READY=1`` on the socket;
connection-level lines (bad input on SSMP and QMQP) carry the listener and
the peer as fields; a refused reload's problems (several lines of text)
stay one JSON line; stopping sends ``STOPPING=1``; nothing goes to stderr.
Reads wait on a queue with a deadline, never sleep.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Final

import pytest

from tests.integration.harness import LineClient, twistd_path

pytestmark = pytest.mark.integration

TIMEOUT_SECONDS: Final = 20.0
CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""


class JSONLogGateway:
    """A ``twistd msggateway --log-format json`` process whose stdout is read as JSON lines.

    Args:
        directory: Where the configuration goes (and the process runs).
        environ: Extra environment variables (``NOTIFY_SOCKET``).
    """

    def __init__(self, directory: Path, environ: dict[str, str]) -> None:
        config = directory / "gateway.toml"
        config.write_text(CONFIG)
        (directory / "routes").mkdir()
        command = [
            twistd_path(),
            "--nodaemon",
            "--pidfile=",
            "msggateway",
            "--config",
            str(config),
            "--log-format",
            "json",
        ]
        self.process = subprocess.Popen(
            command,
            cwd=directory,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, **environ),
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._stdout: queue.Queue[str | None] = queue.Queue()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self._stdout)),
            threading.Thread(target=self._read, args=(self.process.stderr, None)),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[bytes], lines: queue.Queue[str | None] | None) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace")
            if lines is None:
                self.errors.append(text)
            else:
                lines.put(text)
        if lines is not None:
            lines.put(None)

    def wait_for(
        self, matches: Callable[[dict[str, Any]], bool], timeout: float = TIMEOUT_SECONDS
    ) -> dict[str, Any]:
        """Return the first record ``matches`` accepts, parsing every line on the way.

        Raises:
            AssertionError: A line is not a JSON object, the process ended,
                or nothing matched in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._stdout.get(timeout=max(left, 0))
            except queue.Empty:
                raise AssertionError(f"no matching line in {timeout} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"the gateway ended first:\n{self.text()}{self.errors}")
            record = self._record(line)
            if matches(record):
                return record

    def _record(self, line: str) -> dict[str, Any]:
        self.lines.append(line)
        assert line.endswith("\n")
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert {"time", "level", "namespace", "message"} <= record.keys(), line
        assert record["time"].endswith("Z"), line
        return record

    def stop(self) -> int:
        """SIGTERM, wait for the exit, read (and check) every remaining line; the status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(TIMEOUT_SECONDS)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for reader in self._readers:
                reader.join(TIMEOUT_SECONDS)
        while (line := self._stdout.get_nowait()) is not None:
            self._record(line)
        return status

    def text(self) -> str:
        """Every stdout line read so far."""
        return "".join(self.lines)


@pytest.fixture
def notify_socket() -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's, in a short directory (path limits)."""
    with (
        tempfile.TemporaryDirectory(prefix="sd-") as directory,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
    ):
        sock.bind(str(Path(directory) / "notify"))
        sock.settimeout(TIMEOUT_SECONDS)
        yield sock


def _notification(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode("utf-8")
    assert data.endswith("\n"), data
    return dict(line.split("=", 1) for line in data.splitlines())


def test_every_line_is_json_with_the_fields_that_matter(
    tmp_path: Path, notify_socket: socket.socket
) -> None:
    """Ready with addresses, READY=1, listener and peer on connection lines, STOPPING=1.

    A reload refused for a broken route file is one line too, its problems a field.
    """
    gateway = JSONLogGateway(tmp_path, {"NOTIFY_SOCKET": notify_socket.getsockname()})
    try:
        ready = gateway.wait_for(lambda r: r["message"].startswith("msggateway ready:"))
        listening = ready["listening"]
        assert set(listening) == {"hub", "mail", "admin"}
        assert ready["namespace"] == "gateway.service.GatewayService"
        assert ready["level"] == "info"

        told = _notification(notify_socket)
        assert told["READY"] == "1"
        assert f"hub={listening['hub']}" in told["STATUS"]

        host, port = listening["hub"].rsplit(":", 1)
        with LineClient((host, int(port))) as client:
            client.send("NOT-A-REQUEST")
            client.expect_code(400)
            client.expect_closed()
        bad_ssmp = gateway.wait_for(lambda r: r.get("listener") == "hub" and "peer" in r)
        assert bad_ssmp["level"] == "warn"
        assert bad_ssmp["peer"] == "127.0.0.1"  # SSMP names a peer by host until it logs in
        assert bad_ssmp["reason"] and bad_ssmp["reason"] in bad_ssmp["message"]

        host, port = listening["mail"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_SECONDS) as sock:
            sock.sendall(b"not a netstring")
            here = "{}:{}".format(*sock.getsockname())
            bad_qmqp = gateway.wait_for(lambda r: r.get("listener") == "mail" and "peer" in r)
        assert bad_qmqp["peer"] == here
        assert bad_qmqp["message"].startswith(f"mail: bad input from {here}")

        (tmp_path / "routes" / "broken.toml").write_text('from = "mail"\nto = "nowhere"\n')
        gateway.process.send_signal(signal.SIGHUP)
        refused = gateway.wait_for(lambda r: r["message"].startswith("reload refused"))
        assert refused["level"] == "error"
        assert "broken.toml" in refused["problems"]
        assert "\n" in refused["message"]  # one line of JSON all the same
    finally:
        status = gateway.stop()
    assert status in (0, -signal.SIGTERM), gateway.text()  # twistd exits by the signal
    assert _notification(notify_socket) == {"STOPPING": "1"}
    assert any(json.loads(line)["message"] == "Server Shut Down." for line in gateway.lines)
    assert gateway.errors == []
