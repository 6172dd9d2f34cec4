"""systemd: sd_notify (`gateway.systemd`) on real unix datagram sockets, and etc/msggateway.service.

The unit is parsed here (keys, and ExecStart through twistd's own option
parser) and, where ``systemd-analyze`` is installed, verified by it.
"""

from __future__ import annotations

import inspect
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from twisted.logger import capturedLogs, formatEvent
from twisted.scripts._twistd_unix import ServerOptions

from gateway import logformat
from gateway import service as service_module
from gateway.logformat import json_observer
from gateway.systemd import NOTIFY_SOCKET, notify, tell_systemd


@pytest.fixture
def systemd_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound where systemd would put it, and its path.

    A short temporary directory of its own: unix socket paths are limited
    to about 100 bytes, which pytest's tmp_path can pass.
    """
    with tempfile.TemporaryDirectory(prefix="sd-") as directory:
        path = str(Path(directory) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            sock.settimeout(5)
            yield sock, path


def test_ready_reaches_the_socket(systemd_socket: tuple[socket.socket, str]) -> None:
    """Every key goes out as one KEY=VALUE line, in one datagram."""
    sock, path = systemd_socket
    sent = notify({"READY": "1", "STATUS": "listening: hub=127.0.0.1:1"}, {NOTIFY_SOCKET: path})
    assert sent
    assert sock.recv(4096) == b"READY=1\nSTATUS=listening: hub=127.0.0.1:1\n"


def test_an_abstract_socket_is_named_with_an_at_sign() -> None:
    """``@name`` is a socket in the abstract namespace (Linux): a NUL byte, then the name."""
    name = f"msggateway-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert notify({"STOPPING": "1"}, {NOTIFY_SOCKET: "@" + name})
        assert sock.recv(4096) == b"STOPPING=1\n"


def test_without_systemd_nothing_is_sent() -> None:
    """No NOTIFY_SOCKET (or an empty one): nothing to do, and no error."""
    assert not notify({"READY": "1"}, {})
    assert not notify({"READY": "1"}, {NOTIFY_SOCKET: ""})


def test_the_process_environment_is_the_default(
    systemd_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an explicit environment, os.environ names the socket."""
    sock, path = systemd_socket
    monkeypatch.setitem(os.environ, NOTIFY_SOCKET, path)
    assert notify({"READY": "1"})
    assert sock.recv(4096) == b"READY=1\n"


def test_a_missing_socket_raises() -> None:
    """A named socket that is not there is an OSError from notify."""
    with tempfile.TemporaryDirectory(prefix="sd-") as directory, pytest.raises(OSError):
        notify({"READY": "1"}, {NOTIFY_SOCKET: str(Path(directory) / "gone")})


@pytest.mark.parametrize(
    ("environ", "state"),
    [
        ({NOTIFY_SOCKET: "vsock:2:1234"}, {"READY": "1"}),
        ({NOTIFY_SOCKET: "/run/x"}, {"STATUS": "two\nlines"}),
    ],
)
def test_what_cannot_be_sent_is_a_value_error(
    environ: dict[str, str], state: dict[str, str]
) -> None:
    """A vsock address, or a value with a line break, is refused before anything is sent."""
    with pytest.raises(ValueError):
        notify(state, environ)


def test_tell_systemd_logs_a_failure_saying_what_to_check() -> None:
    """A send that fails is one warning naming the socket and what to check; no exception."""
    with tempfile.TemporaryDirectory(prefix="sd-") as directory:
        missing = str(Path(directory) / "gone")
        with capturedLogs() as events:
            tell_systemd({"READY": "1"}, {NOTIFY_SOCKET: missing})
    [event] = events
    text = formatEvent(event)
    assert f"NOTIFY_SOCKET={missing}" in text
    assert "READY=1" in text
    assert "NotifyAccess" in text


def test_tell_systemd_is_quiet_outside_systemd() -> None:
    """No socket named: nothing logged."""
    with capturedLogs() as events:
        tell_systemd({"READY": "1"}, {})
    assert events == []


# --- etc/msggateway.service ----------------------------------------------------------------

UNIT: Final = Path(__file__).resolve().parents[1] / "etc" / "msggateway.service"


def _unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """Parse a unit file the way systemd reads one: sections, repeatable keys, comments.

    Lines ending in a backslash continue on the next line; ``#`` and ``;``
    start comments.
    """
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting outside any section: {line}"
        key, separator, value = line.partition("=")
        assert separator, f"not KEY=VALUE: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _setting(section: dict[str, list[str]], key: str) -> str:
    """The one value of ``key`` (the last, as systemd takes it)."""
    assert key in section, f"{key}= is missing"
    return section[key][-1]


def test_the_unit_is_type_notify_with_limits_and_hardening() -> None:
    """Type=notify, a user, LimitNOFILE, restart, reload, and the hardening options."""
    unit = _unit_sections(UNIT.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "User": "msggateway",
        "LimitNOFILE": "65536",
        "Restart": "on-failure",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "CapabilityBoundingSet": "",  # no capabilities: the example ports are above 1024
        "SystemCallFilter": "@system-service",
        "ReadWritePaths": "/var/lib/msggateway",
        "WorkingDirectory": "/var/lib/msggateway",
    }
    assert {key: _setting(service, key) for key in expected} == expected
    # AF_UNIX for the journal and the notification socket (gateway.systemd).
    assert set(_setting(service, "RestrictAddressFamilies").split()) == {
        "AF_INET",
        "AF_INET6",
        "AF_UNIX",
    }
    assert "AmbientCapabilities" not in service  # only in a comment, for ports below 1024
    assert _setting(unit["Install"], "WantedBy") == "multi-user.target"


def test_exec_start_is_a_command_line_twistd_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExecStart parses as twistd reads it: foreground, no pid file, JSON logs to stdout."""
    monkeypatch.setattr(logformat, "_destination", logformat._destination)  # put back after
    command = shlex.split(_setting(_unit_sections(UNIT.read_text())["Service"], "ExecStart"))
    assert command[0] == "/opt/msggateway/bin/twistd"
    config = command.index("--config") + 1
    assert command[config] == "/etc/msggateway/gateway.toml"
    local = tmp_path / "gateway.toml"
    local.write_text('[listeners.hub]\nprotocol = "ssmp"\nendpoint = "tcp:0"\n')
    command[config] = str(local)
    options = ServerOptions()
    options.parseOptions(command[1:])
    assert options.subCommand == "msggateway"
    assert options["nodaemon"] and options["pidfile"] == ""
    assert options.subOptions["log-format"] == "json"
    assert options["logger"] is json_observer
    assert logformat._destination.stdout  # the journal


def test_sighup_is_what_reload_sends_and_the_gateway_reloads_on_it() -> None:
    """ExecReload's SIGHUP is the gateway's reload, or the supervisor's passing it on."""
    source = inspect.getsource(service_module.makeService)
    assert "_reload_on_hangup(reactor, gateway.reload)" in source
    assert "_reload_on_hangup(reactor, supervisor.reload)" in source
    assert "signal.SIGHUP" in inspect.getsource(service_module._reload_on_hangup)


def test_systemd_stops_the_supervisor_alone() -> None:
    """KillMode=mixed: SIGTERM to twistd only, which stops its workers (each once)."""
    assert "\nKillMode=mixed\n" in UNIT.read_text()


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """systemd-analyze verify finds nothing to say (ExecStart pointed at this twistd)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    twistd = Path(sys.executable).with_name("twistd")
    copy = tmp_path / "msggateway.service"
    copy.write_text(UNIT.read_text().replace("/opt/msggateway/bin/twistd", str(twistd)))
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
