"""sd_notify for ``Type=notify`` units (`gateway.systemd`), over real unix datagram sockets."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from twisted.logger import capturedLogs, formatEvent

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
