"""Tests for ``msggateway tap``'s own parts: its URL, its lines of text, following a stream.

Talking to a real gateway is tests/integration/test_tap.py's.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.cli.errors import CommandError, UsageError
from gateway.cli.output import Output
from gateway.cli.tap import Gateway, admin_token, admin_url, describe, follow, tap_url
from gateway.config import load_config

RECORD: dict[str, Any] = {
    "time": 1714564800.1234,
    "listener": "mail",
    "id": "abc-1",
    "sender": "alice@example.com",
    "address": "ops@example.com",
    "recipients": ["ops@example.com", "dev@example.com"],
    "size": 1234,
    "headers": 0,
    "header_keys": [],
    "routes": [
        {
            "route": "to-hub",
            "destination": "hub",
            "address": "ops.mail",
            "recipients": [],
            "sender": "alice@example.com",
            "size": 1234,
            "status": "accepted",
            "code": None,
            "reason": "",
            "seconds": 0.002,
        },
        {
            "route": "archive",
            "destination": "log",
            "status": "retry",
            "code": "451",
            "reason": "disk full",
        },
    ],
    "outcome": "retry",
}


def _lines(*values: dict[str, Any]) -> list[bytes]:
    return [json.dumps(value).encode() + b"\n" for value in values]


def test_describe_a_record() -> None:
    """A record reads: time, source, routes and destinations, id, sender, size, outcome."""
    assert describe(RECORD) == (
        "2024-05-01T12:00:00.123Z mail:ops@example.com +1 -> to-hub -> hub:ops.mail,"
        " archive -> log id=abc-1 from=alice@example.com 1234 B retry"
        " (archive: retry 451 disk full)"
    )


def test_describe_an_unrouted_message() -> None:
    """A message without a route or sender says so."""
    record = {"time": 0, "listener": "hub", "id": "x", "address": "nowhere", "size": 0}
    assert describe({**record, "routes": [], "outcome": "unrouted"}) == (
        "1970-01-01T00:00:00.000Z hub:nowhere -> (no route) id=x from=- 0 B unrouted"
    )


def test_follow_prints_messages_and_tells_stderr_the_rest() -> None:
    """Text mode: messages on stdout; what is tapped and the counters on stderr."""
    out, err = io.StringIO(), io.StringIO()
    lines = _lines(
        {"tap": {"listener": None, "route": "to-hub", "match": "#", "sample": 0.5}, "time": 1},
        RECORD,
        {"time": 2, "seen": 2, "shown": 1, "sampled_out": 1, "dropped": 0},
        {"time": 3, "seen": 9, "shown": 1, "sampled_out": 4, "dropped": 4},
        RECORD,
    )
    assert follow(lines, Output(out, json_lines=False), err, count=2) == 0
    assert out.getvalue().splitlines() == [describe(RECORD)] * 2
    assert err.getvalue().splitlines() == [
        "msggateway: tapping route to-hub, addresses matching #, 0.5 of them; Ctrl-C stops",
        "msggateway: 2 seen, 1 shown, 1 sampled out, 0 dropped",
        "msggateway: 9 seen, 1 shown, 4 sampled out, 4 dropped (dropped: we read too slowly)",
    ]


def test_follow_json_passes_every_line_through() -> None:
    """--json: every line the gateway sent, as JSON on stdout, nothing on stderr."""
    out, err = io.StringIO(), io.StringIO()
    values = [{"tap": {"route": "r"}, "time": 1}, RECORD, {"time": 2, "seen": 1, "dropped": 0}]
    with pytest.raises(CommandError, match="closed the tap"):
        follow(_lines(*values), Output(out, json_lines=True), err, json_lines=True)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == values
    assert err.getvalue() == ""


def test_follow_reports_the_gateway_ending_the_tap() -> None:
    """An end line is an error (status 1) naming the reason and the counters."""
    out, err = io.StringIO(), io.StringIO()
    end = {"time": 3, "seen": 4, "shown": 4, "sampled_out": 0, "dropped": 0, "end": "stopping"}
    with pytest.raises(CommandError, match=r"ended the tap: stopping \(4 seen, 4 shown"):
        follow(_lines(RECORD, end), Output(out, json_lines=False), err)
    assert out.getvalue().splitlines() == [describe(RECORD)]


def test_follow_refuses_what_is_not_json() -> None:
    """A line that is not JSON breaks off the tap with the line shown."""
    with pytest.raises(CommandError, match="not JSON"):
        follow([b"<html>\n"], Output(io.StringIO(), json_lines=False), io.StringIO())


def _args(**given: Any) -> argparse.Namespace:
    values = {
        "listener": None,
        "route": None,
        "match": None,
        "sample": 1.0,
        "max": None,
        "per_second": None,
    }
    return argparse.Namespace(**{**values, **given})


def test_tap_url() -> None:
    """The query carries what is asked for, under the admin URL's path."""
    url = tap_url("http://127.0.0.1:8790", _args(route="to-hub", match="#@x.org", sample=0.01))
    assert url.geturl() == "http://127.0.0.1:8790/tap?route=to-hub&match=%23%40x.org&sample=0.01"
    url = tap_url("https://gw.example/admin/", _args(listener="mail", max=50))
    assert url.geturl() == "https://gw.example/admin/tap?listener=mail&max=50"
    url = tap_url("http://127.0.0.1:8790", _args(route="r", per_second=20))
    assert url.geturl() == "http://127.0.0.1:8790/tap?route=r&per_second=20"


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["tap", "--listener", "a", "--route", "b"], "not allowed with"),
        (["tap"], "one of the arguments --listener --route is required"),
        (["tap", "--route", "r", "--sample", "0"], "not above 0"),
        (["tap", "--route", "r", "--sample", "1.5"], "at most 1"),
    ],
)
def test_usage_errors(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Asking for both or neither, or a rate out of range, is a usage error."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err


def test_missing_token_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No variable and no token file: status 2 naming both, before any connection."""
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # the embedded default's data dir: var/ here, empty
    err = io.StringIO()
    status = main(
        ["tap", "--route", "r", "--token-env", "NO_SUCH_TOKEN", "--admin", "http://127.0.0.1:9"],
        io.StringIO(),
        err,
    )
    assert status == 2
    assert "no admin token: NO_SUCH_TOKEN is not set" in err.getvalue()
    assert f"{tmp_path / 'var' / 'admin-token'} does not exist" in err.getvalue()


def _config(directory: Path, admin: str, secrets: str | None = None) -> Path:
    """A main file with this admin endpoint (and secrets file); data dir ``data``."""
    text = f"[gateway]\ndata_dir = \"data\"\n[admin]\nendpoint = '{admin}'\n"
    if secrets is not None:
        (directory / "secrets.toml").write_text(secrets)
        text = text.replace("[admin]", 'secrets = "secrets.toml"\n[admin]')
    path = directory / "gateway.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("tcp:8790:interface=127.0.0.1", "http://127.0.0.1:8790"),
        ("tcp:port=7790", "http://127.0.0.1:7790"),
        ("tcp:7790:interface=0.0.0.0", "http://127.0.0.1:7790"),
        ("tcp6:7790:interface=\\:\\:1", "http://[::1]:7790"),
        ("tcp6:7790", "http://[::1]:7790"),
        ("tcp:7790:interface=10.1.2.3", "http://10.1.2.3:7790"),
    ],
)
def test_the_admin_url_comes_from_the_configuration(
    tmp_path: Path, endpoint: str, url: str
) -> None:
    """Without --admin, tap connects where the configuration's admin endpoint listens."""
    assert admin_url(load_config(_config(tmp_path, endpoint))) == url


def test_an_admin_endpoint_that_is_off_or_no_port_needs_admin(tmp_path: Path) -> None:
    """An admin endpoint that is off, or a Unix socket, cannot be guessed: a usage error."""
    path = tmp_path / "gateway.toml"
    path.write_text("[admin]\nenabled = false\n")
    with pytest.raises(UsageError, match="the admin endpoint is off in"):
        admin_url(load_config(path))
    with pytest.raises(UsageError, match="give --admin URL"):
        admin_url(load_config(_config(tmp_path, "unix:/run/msggateway-admin")))


def test_the_token_comes_from_the_variable_the_secrets_file_or_the_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The variable when set; else the secrets file's admin_token; else the made token file."""
    monkeypatch.delenv("TAP_TOKEN", raising=False)
    made = _config(tmp_path, "tcp:0")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "admin-token").write_text("made-token\n")
    assert admin_token("TAP_TOKEN", Gateway(str(made))) == (
        "made-token",
        str(tmp_path / "data" / "admin-token"),
    )
    monkeypatch.setenv("TAP_TOKEN", "from-env")
    assert admin_token("TAP_TOKEN", Gateway(str(made)))[0] == "from-env"
    monkeypatch.delenv("TAP_TOKEN")
    given = tmp_path / "given"
    given.mkdir()
    path = _config(given, "tcp:0", secrets='admin_token = "file-token"\n')
    assert admin_token("TAP_TOKEN", Gateway(str(path))) == (
        "file-token",
        f"admin_token in {given / 'secrets.toml'}",
    )


def test_an_unreadable_token_file_says_whose_it_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A token file the user may not read: status 1 naming it, and the way out."""
    monkeypatch.delenv("TAP_TOKEN", raising=False)
    path = _config(tmp_path, "tcp:0")
    (tmp_path / "data" / "admin-token").mkdir(parents=True)  # reading it fails
    err = io.StringIO()
    status = main(
        ["tap", "--route", "r", "--token-env", "TAP_TOKEN", "--config", str(path)],
        io.StringIO(),
        err,
    )
    assert status == 1
    assert f"cannot read the admin token in {tmp_path / 'data' / 'admin-token'}: " in (
        err.getvalue()
    )
    assert "run this as the gateway's user, or set TAP_TOKEN" in err.getvalue()


def test_admin_must_be_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """--admin that is not an http(s) URL is a usage error."""
    monkeypatch.setenv("TOKEN", "t")
    err = io.StringIO()
    assert (
        main(
            ["tap", "--route", "r", "--token-env", "TOKEN", "--admin", "127.0.0.1:8790"],
            io.StringIO(),
            err,
        )
        == 2
    )
    assert "not an http:// or https:// URL" in err.getvalue()
