"""Tests for the ``msggateway`` command: ``check-config``.

Most tests call `gateway.cli.main` with in-memory streams; one runs the
installed console script as a real process.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from gateway.cli import main
from gateway.config import DEFAULT_CONFIG_NAME, load_config, load_default_config

REPOSITORY = Path(__file__).parents[1]

INVALID = """\
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:notaport"
login_timeout_seconds = 0

[upstreams.hub]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=9787"
identity = "gateway-1"
scheme = "open"
"""
"""A main file with three problems: endpoint, time-out and a duplicate name."""


def _check_config(*args: str) -> tuple[int, str, str]:
    """Run ``msggateway check-config ARGS``; return status, stdout and stderr."""
    out = io.StringIO()
    err = io.StringIO()
    status = main(["check-config", *args], out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_valid_file_prints_the_summary() -> None:
    """A valid configuration exits 0 and prints its one-line summary, nothing else."""
    path = REPOSITORY / "etc" / "gateway.toml"
    status, out, err = _check_config(str(path))
    assert status == 0
    assert out == load_config(path).summary() + "\n"
    assert out.startswith(f"{path}: OK: 2 listener(s) [hub (ssmp), mail (qmqp)]")
    assert err == ""


def test_no_path_checks_the_embedded_default() -> None:
    """Without a path the embedded default is checked, and it is valid."""
    status, out, err = _check_config()
    assert status == 0
    assert out == load_default_config().summary() + "\n"
    assert out.startswith(f"{DEFAULT_CONFIG_NAME}: OK:")
    assert err == ""


def test_invalid_file_prints_every_problem_and_a_count(tmp_path: Path) -> None:
    """An invalid configuration exits 1 with one ``file: key: reason`` line per problem."""
    path = tmp_path / "gateway.toml"
    path.write_text(INVALID, encoding="utf-8")
    status, out, err = _check_config(str(path))
    assert status == 1
    assert out == ""
    lines = err.splitlines()
    assert lines[-1] == "3 problem(s) found"
    assert sorted(line.split(": ", 2)[1] for line in lines[:-1]) == [
        "listeners.hub.endpoint",
        "listeners.hub.login_timeout_seconds",
        "upstreams.hub",
    ]
    for line in lines[:-1]:
        file, _key, reason = line.split(": ", 2)
        assert file == str(path)
        assert reason
    assert f"{path}: upstreams.hub: name 'hub' is used twice" in err


def test_missing_file_is_one_problem(tmp_path: Path) -> None:
    """A path that does not exist is reported, not raised."""
    path = tmp_path / "nowhere.toml"
    status, out, err = _check_config(str(path))
    assert status == 1
    assert out == ""
    assert err == f"{path}: -: file not found\n1 problem(s) found\n"


def test_console_script_reports_problems_on_stderr(tmp_path: Path) -> None:
    """The installed ``msggateway`` command exits 1 and writes the problems to stderr."""
    path = tmp_path / "gateway.toml"
    path.write_text(INVALID, encoding="utf-8")
    script = Path(sys.executable).with_name("msggateway")
    completed = subprocess.run(
        [str(script), "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout == ""
    assert f"{path}: listeners.hub.login_timeout_seconds: must be greater than 0" in (
        completed.stderr
    )
    assert completed.stderr.endswith("3 problem(s) found\n")
