"""``msggateway init``: the shipped examples, written into a directory for this install.

Starting them for real is tests/integration/test_examples.py's; from the
wheel, tests/integration/test_wheel.py's.
"""

from __future__ import annotations

import io
import stat
from importlib import resources
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.cli.init import examples
from gateway.config import load_config

REPOSITORY = Path(__file__).parents[1]
USE_CASES = ["mtl-ssmp", "qmqp-to-dmp", "ssmp-to-rabbitmq", "tls-frontend"]


def _init(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(["init", *argv], out, err)
    return status, out.getvalue(), err.getvalue()


def test_list_names_the_starter_the_use_cases_and_the_default() -> None:
    """--list: one line per example, name and what it does, the starter first."""
    status, out, _ = _init("--list")
    assert status == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert names == ["starter", *USE_CASES, "default"]
    assert "SSMP publishers into a RabbitMQ stream" in out


def test_print_shows_the_embedded_default_or_an_example() -> None:
    """--print is the embedded default as shipped; --print NAME an example's main file."""
    default = resources.files("gateway").joinpath("default.toml").read_text("utf-8")
    assert _init("--print") == (0, default, "")
    starter = (REPOSITORY / "etc" / "gateway.toml").read_text("utf-8")
    assert _init("--print", "starter") == (0, starter, "")


def test_the_shipped_examples_are_the_checkouts_etc() -> None:
    """The package's examples are etc/ (the wheel carries them; gateway/examples links there)."""
    shipped = examples()
    for name in USE_CASES:
        assert shipped[name].main.read_text("utf-8") == (
            REPOSITORY / "etc" / name / "gateway.toml"
        ).read_text("utf-8")


def test_init_writes_the_starter_made_for_this_install(tmp_path: Path) -> None:
    """Config, routes, secrets (0600, no placeholder left) and unit, with DIR's paths."""
    target = tmp_path / "conf"
    data = tmp_path / "state"
    status, out, err = _init(str(target), "--data-dir", str(data))
    assert status == 0, err
    assert err == ""
    written = sorted(str(path.relative_to(target)) for path in target.rglob("*.*"))
    assert written == [
        "gateway.toml",
        "msggateway.service",
        "routes/alerts-from-central.toml",
        "routes/mail-alerts.toml",
        "routes/weather-to-central.toml",
        "secrets.toml",
    ]
    config = load_config(target / "gateway.toml")
    assert config.data_dir == data
    assert config.secrets_path == target / "secrets.toml"
    assert f"{target / 'gateway.toml'}: OK: 2 listener(s)" in out
    assert f"next: msggateway run --config {target / 'gateway.toml'}" in out
    secrets = (target / "secrets.toml").read_text()
    assert '"change-me' not in secrets
    assert stat.S_IMODE((target / "secrets.toml").stat().st_mode) == 0o600
    alice = config.secrets.logins["alice"]
    assert len(alice) >= 24
    unit = (target / "msggateway.service").read_text()
    twistd = Path(__file__).parents[1] / ".venv" / "bin" / "twistd"
    assert f"--config {target / 'gateway.toml'} " in unit
    assert f"ReadWritePaths={data}\n" in unit and f"WorkingDirectory={data}\n" in unit
    assert "/etc/msggateway" not in unit and "/var/lib/msggateway" not in unit
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith("ExecStart=/") and "/bin/twistd --nodaemon" in exec_start
    assert twistd.exists() == (exec_start.split()[0] == f"ExecStart={twistd}")


def test_init_makes_fresh_secrets_each_time(tmp_path: Path) -> None:
    """Two installs never share a secret."""
    _init(str(tmp_path / "a"), "--data-dir", str(tmp_path))
    _init(str(tmp_path / "b"), "--data-dir", str(tmp_path))
    a = load_config(tmp_path / "a" / "gateway.toml").secrets.logins
    b = load_config(tmp_path / "b" / "gateway.toml").secrets.logins
    assert set(a) == set(b) and all(a[name] != b[name] for name in a)


def test_init_keeps_what_is_there_unless_forced(tmp_path: Path) -> None:
    """A second init into the same directory changes nothing, and says so; --force rewrites."""
    assert _init(str(tmp_path), "--data-dir", str(tmp_path / "var"))[0] == 0
    (tmp_path / "gateway.toml").write_text("# mine\n")
    status, _, err = _init(str(tmp_path), "--data-dir", str(tmp_path / "var"))
    assert status == 1
    assert f"not overwriting {tmp_path / 'gateway.toml'}, " in err and "(--force would)" in err
    assert (tmp_path / "gateway.toml").read_text() == "# mine\n"
    assert _init(str(tmp_path), "--data-dir", str(tmp_path / "var"), "--force")[0] == 0
    assert (tmp_path / "gateway.toml").read_text() != "# mine\n"


@pytest.mark.parametrize("name", [*USE_CASES, "default"])
def test_every_example_is_written_and_checked(tmp_path: Path, name: str) -> None:
    """Each example loads once written; the TLS front-end first wants its certificate files."""
    status, out, err = _init(str(tmp_path), "--example", name, "--data-dir", str(tmp_path / "d"))
    assert status == 0
    if name == "tls-frontend":
        assert err.startswith("before it starts, these need your attention:\n")
        assert f"{tmp_path / 'tls' / 'server.pem'}: cannot read" in err
    else:
        assert err == "", err
        assert f"{tmp_path / 'gateway.toml'}: OK: " in out
        assert load_config(tmp_path / "gateway.toml").data_dir == tmp_path / "d"
    assert (tmp_path / "msggateway.service").is_file()


def test_usage_errors() -> None:
    """No DIR, or an example that does not exist: status 2 with the reason."""
    assert _init() == (2, "", "msggateway: error: init needs DIR (or --list, or --print)\n")
    status, _, err = _init("/nowhere", "--example", "nope")
    assert status == 2
    assert "no example 'nope' (known: starter, " in err
