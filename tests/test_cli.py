"""Tests for the ``msggateway`` command as a whole, and ``check-config``.

Every command's help is plain text and every protocol command has the same
flags; the default addresses are where the embedded default configuration
listens. Most tests call `gateway.cli.main` with in-memory streams; two run
the installed console script or ``python -m gateway.cli`` as real processes.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import build_parser, main
from gateway.cli.connection import DEFAULT_ADDRESSES
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
    assert err == f"{path}: file not found\n1 problem(s) found\n"


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


# --- the command tree ---------------------------------------------------------------------


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with its command path, the top one first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, (*path, name))


PROTOCOL_COMMANDS = [
    ("ssmp", "publish"), ("ssmp", "subscribe"), ("qmqp", "send"),
    ("stream", "publish"), ("stream", "consume"), ("dmp", "put"), ("dmp", "get"),
    ("mtl", "send"), ("mtl", "receive"),
]  # fmt: skip
"""Every command that talks to a server, in both directions where the protocol has two."""


def test_every_help_is_plain_text() -> None:
    """No help text, of any command at any depth, carries RST markup such as double backquotes."""
    seen = []
    for path, parser in parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text, f"msggateway {' '.join(path)} --help: {text}"
        assert ":class:" not in text and ".. " not in text
        seen.append(path)
    assert {(), ("stream",), *PROTOCOL_COMMANDS, ("mtl", "keygen"), ("run",)} <= set(seen)


def test_every_help_says_what_the_command_does_and_names_its_operands() -> None:
    """Every command has a description; usage lines list real options and named operands.

    No ``{archive,report,send}`` where a name belongs (``ACTION``), no
    ``[options]`` in place of the options, and a help text for every operand.
    """
    for path, parser in parsers(build_parser()):
        where = f"msggateway {' '.join(path)}"
        assert parser.description, f"{where} has no description"
        usage = parser.format_usage()
        assert "[options]" not in usage, f"{where}: {usage}"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert action.metavar, f"{where}: {usage}"  # not {archive,report,send}
            elif not action.option_strings:
                assert action.help, f"{where}: {action.metavar or action.dest} has no help"


def test_top_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``msggateway --help`` exits 0 and lists each command with its one-line help."""
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: msggateway [-h] [--version] COMMAND ...")
    for command in ("check-config", "run", "ssmp", "qmqp", "stream", "dmp", "mtl", "spark"):
        assert f"\n    {command}" in out


@pytest.mark.parametrize("path", PROTOCOL_COMMANDS, ids=" ".join)
def test_every_protocol_command_has_the_same_flags(path: tuple[str, str]) -> None:
    """--address, --count, --json, --progress, --force-progress and --timeout everywhere."""
    tree = dict(parsers(build_parser()))
    flags = {option for action in tree[path]._actions for option in action.option_strings}
    assert {"-a", "--address", "--count", "--json", "--progress", "--force-progress",
            "--timeout"} <= flags  # fmt: skip
    if path[0] != "mtl":  # MTL's encryption is CURVE, not TLS
        assert {"--tls", "--cafile", "--cert", "--key"} <= flags
    else:
        assert {"--server-key", "--key-file"} <= flags


def test_default_addresses_are_where_the_default_configuration_listens() -> None:
    """Each protocol's default --address is its listener in the embedded default config."""
    listening = {}
    for listener in load_default_config().listeners:
        port = listener.endpoint.split(":")[1]
        listening[listener.protocol] = f"127.0.0.1:{port}"
    assert listening == DEFAULT_ADDRESSES


def test_python_m_gateway_cli_runs_the_command() -> None:
    """``python -m gateway.cli`` is the same command line."""
    completed = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith(f"{DEFAULT_CONFIG_NAME}: OK:")


def test_usage_errors_exit_2_and_command_errors_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing secret is a usage error (2); a server that is not there is a failure (1)."""
    monkeypatch.delenv("UNSET_SECRET_XYZ", raising=False)
    out, err = io.StringIO(), io.StringIO()
    argv = ["dmp", "get", "-a", "127.0.0.1:1", "--lease-env", "UNSET_SECRET_XYZ"]
    assert main(argv, out, err) == 2
    assert err.getvalue() == "msggateway: error: environment variable UNSET_SECRET_XYZ is not set\n"
    out, err = io.StringIO(), io.StringIO()
    assert main(["stream", "consume", "--stream", "s", "-a", "127.0.0.1:1"], out, err) == 1
    assert err.getvalue().startswith("msggateway: cannot connect to 127.0.0.1:1: ")


# --- run -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "passed"),
    [
        (["run"], []),
        (["run", "--config", "etc/gateway.toml"], ["--config", "etc/gateway.toml"]),
        (["run", "-c", "g.toml", "--log-format", "json"], ["-c", "g.toml", "--log-format", "json"]),
        (["run", "--", "--config", "g.toml"], ["--config", "g.toml"]),
    ],
    ids=["nothing", "config", "short-and-more", "double-dash"],
)
def test_run_passes_every_option_to_the_plugin(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], passed: list[str]
) -> None:
    """``msggateway run OPTION...`` execs twistd with the options after ``msggateway``, unparsed.

    argparse alone refused ``--config`` ("unrecognized arguments") and kept a
    ``--``, which twistd then refused ("Wrong number of arguments").
    """
    execed: list[tuple[str, list[str]]] = []

    def execv(path: str, args: list[str]) -> None:
        execed.append((path, args))

    monkeypatch.setattr("gateway.cli.config.os.execv", execv)
    out, err = io.StringIO(), io.StringIO()
    main(argv, out, err)
    assert err.getvalue() == ""
    [(path, args)] = execed
    assert Path(path).name == "twistd"
    assert args == [path, "--nodaemon", "--pidfile=", "--logfile=-", "msggateway", *passed]


def test_run_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """``msggateway run --help`` prints the command's help, naming --config, and exits 0."""
    with pytest.raises(SystemExit) as exited:
        main(["run", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: msggateway run [-h] ...")
    assert "--config PATH" in out
