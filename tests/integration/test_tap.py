"""``msggateway tap`` against a real gateway process (issue 17 part 4).

The gateway's QMQP listener ``mail`` routes ``*@ok.example`` to its SSMP hub
(route ``to-hub``: K) and ``*@down.example`` to an SSMP upstream that is not
connected (route ``down``: Z); anything else has no route (D). Its admin
endpoint has the admin token of the secrets file. The installed console
script taps a route or the listener as a subprocess while ``msggateway qmqp
send`` (another subprocess) streams mail through it, and prints each
message with its outcome; a wrong token, an unknown route and an HTTP
client without a token are refused; Ctrl-C and a gateway that stops end the
tap. A gateway whose secrets file has no admin token makes one in its data
dir, where the command finds it from the gateway's configuration.

The admin token is checked with or without DMP listeners (whose lease desk
also needs it).
"""

from __future__ import annotations

import http.client
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

TOKEN = "tap-t0ken"
WAIT_SECONDS = 30.0

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "gw"
scheme = "open"
"""

DMP_LISTENER = """
[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["in"]
feeds = ["out"]
"""

SECRETS = f'admin_token = "{TOKEN}"\n'

ROUTES = {
    "to-hub": 'from = "mail"\nmatch = "*@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "down": 'from = "mail"\nmatch = "*@down.example"\nto = "nowhere"\nbody = "subject"\n',
}

BIN = Path(sys.executable).parent
MSGGATEWAY = str(BIN / "msggateway")


def _start(directory: Path, config: str) -> GatewayProcess:
    return GatewayProcess(directory, config, routes=ROUTES, secrets=SECRETS).start()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway with the routes above and the admin token."""
    process = _start(tmp_path_factory.mktemp("tap"), CONFIG + DMP_LISTENER)
    yield process
    process.stop()


def _admin(gateway: GatewayProcess) -> str:
    host, port = gateway.address("admin")
    return f"http://{host}:{port}"


class _TapProcess:
    """``msggateway tap ARGS`` running, its stdout and stderr read with deadlines."""

    def __init__(self, gateway: GatewayProcess, *args: str, token: str | None = TOKEN) -> None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if token is not None:
            env["TAP_TOKEN"] = token
        self.process = subprocess.Popen(
            [MSGGATEWAY, "tap", "--admin", _admin(gateway), "--token-env", "TAP_TOKEN", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.out = b""
        self.err = b""

    def read_until(self, text: str, where: str = "err", timeout: float = WAIT_SECONDS) -> None:
        """Read both pipes until ``text`` is on stderr (``where="out"``: stdout)."""
        assert self.process.stdout is not None and self.process.stderr is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ, "out")
            selector.register(self.process.stderr, selectors.EVENT_READ, "err")
            while text.encode() not in (self.err if where == "err" else self.out):
                left = deadline - time.monotonic()
                assert left > 0, f"no {text!r} on std{where} in {timeout} s: {self.err!r}"
                for key, _ in selector.select(left):
                    chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                    if not chunk:
                        raise AssertionError(f"tap ended: {self.out!r} {self.err!r}")
                    if key.data == "out":
                        self.out += chunk
                    else:
                        self.err += chunk

    def finish(self, timeout: float = WAIT_SECONDS) -> tuple[int, str, str]:
        """Wait for the process to end: its status, all of stdout and stderr."""
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, (self.out + out).decode(), (self.err + err).decode()


def _send_mail(gateway: GatewayProcess, directory: Path, *recipients: str) -> str:
    """Stream one mail per recipient through the QMQP listener; return the summary."""
    directory.mkdir(exist_ok=True)
    paths = []
    for number, recipient in enumerate(recipients):
        path = directory / f"{number}.eml"
        path.write_text(
            f"From: app@example.org\nTo: {recipient}\nSubject: note {number}\n\nbody {number}\n"
        )
        paths.append(str(path))
    host, port = gateway.address("mail")
    done = subprocess.run(
        [MSGGATEWAY, "qmqp", "send", "-a", f"{host}:{port}", *paths],
        capture_output=True,
        text=True,
        timeout=WAIT_SECONDS,
    )
    return done.stdout


def test_tap_a_route_while_mail_flows(gateway: GatewayProcess, tmp_path: Path) -> None:
    """Tapping route to-hub prints each of its messages: source, route, destination, outcome."""
    tap = _TapProcess(gateway, "--route", "to-hub", "--count", "2")
    tap.read_until("msggateway: tapping route to-hub")
    summary = _send_mail(gateway, tmp_path, "ops@ok.example", "x@down.example", "dev@ok.example")
    assert summary.startswith("K 2, Z 1, D 0"), summary
    status, out, err = tap.finish()
    assert status == 0, err
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line, local in zip(lines, ["ops", "dev"], strict=True):
        assert f" mail:{local}@ok.example -> to-hub -> hub:mail.{local} id=" in line
        assert " from=app@example.org " in line
        assert line.endswith(" accepted")


def test_tap_a_listener_as_json(gateway: GatewayProcess, tmp_path: Path) -> None:
    """Tapping the listener shows every message, routed or not, with each outcome."""
    tap = _TapProcess(gateway, "--listener", "mail", "--json", "--count", "3")
    tap.read_until('{"tap"', where="out")  # JSON mode: the first line says it is attached
    _send_mail(gateway, tmp_path, "a@ok.example", "b@down.example", "c@elsewhere.example")
    status, out, err = tap.finish()
    assert status == 0, err
    header, *records = [json.loads(line) for line in out.splitlines()]
    assert header["tap"]["listener"] == "mail"
    outcomes = {record["recipients"][0]: record for record in records}
    assert set(outcomes) == {"a@ok.example", "b@down.example", "c@elsewhere.example"}
    ok = outcomes["a@ok.example"]
    assert (ok["outcome"], ok["listener"], ok["sender"]) == ("accepted", "mail", "app@example.org")
    assert [(r["route"], r["destination"], r["address"]) for r in ok["routes"]] == [
        ("to-hub", "hub", "mail.a")
    ]
    assert ok["size"] > 0
    [down] = outcomes["b@down.example"]["routes"]
    assert (down["route"], down["status"]) == ("down", "retry")
    assert down["reason"]
    assert outcomes["c@elsewhere.example"]["outcome"] == "unrouted"


def test_tap_refusals(gateway: GatewayProcess) -> None:
    """A wrong token is 401, an unknown route 404 naming it: status 1 and the reason."""
    status, _, err = _TapProcess(gateway, "--route", "to-hub", token="wrong").finish()
    assert status == 1
    assert "refused the tap (401): a valid admin token is needed" in err
    status, _, err = _TapProcess(gateway, "--route", "nope").finish()
    assert status == 1
    assert "refused the tap (404): no route named 'nope' (known: " in err


def test_unauthenticated_http_is_refused(gateway: GatewayProcess) -> None:
    """A plain HTTP GET without a token gets 401 JSON and a Bearer challenge."""
    host, port = gateway.address("admin")
    connection = http.client.HTTPConnection(host, port, timeout=WAIT_SECONDS)
    try:
        connection.request("GET", "/tap?route=to-hub")
        response = connection.getresponse()
        body: Any = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 401
    assert response.getheader("WWW-Authenticate") == 'Bearer realm="msggateway"'
    assert body == {"error": "a valid admin token is needed"}


def test_ctrl_c_ends_the_tap_cleanly(gateway: GatewayProcess) -> None:
    """SIGINT ends the command with status 0 and a last word on stderr."""
    tap = _TapProcess(gateway, "--route", "to-hub")
    tap.read_until("msggateway: tapping route to-hub")
    tap.process.send_signal(signal.SIGINT)
    status, _, err = tap.finish()
    assert status == 0
    assert "msggateway: tap ended, 0 message(s) shown" in err


def test_a_stopping_gateway_ends_the_tap(tmp_path: Path) -> None:
    """When the gateway stops, the tap's stream ends saying so: status 1 with the reason."""
    process = _start(tmp_path / "gateway", CONFIG + DMP_LISTENER)
    try:
        tap = _TapProcess(process, "--route", "to-hub")
        tap.read_until("msggateway: tapping route to-hub")
        process.signal(signal.SIGTERM)
        status, _, err = tap.finish()
    finally:
        process.stop()
    assert status == 1
    assert "the gateway ended the tap: the gateway is stopping" in err


def test_tap_without_dmp_listeners(tmp_path: Path) -> None:
    """A gateway without DMP listeners checks the admin token for /tap all the same."""
    process = _start(tmp_path / "gateway", CONFIG)
    try:
        tap = _TapProcess(process, "--route", "to-hub")
        tap.read_until("msggateway: tapping route to-hub", timeout=10.0)
        tap.process.send_signal(signal.SIGINT)
        assert tap.finish()[0] == 0
    finally:
        process.stop()


def test_tap_with_the_token_the_gateway_made(tmp_path: Path) -> None:
    """No admin_token: the gateway makes one (mode 0600) that tap --config finds by itself."""
    config = CONFIG.replace('secrets = "secrets.toml"\n', "")
    process = GatewayProcess(tmp_path / "gateway", config, routes=ROUTES).start()
    try:
        made = tmp_path / "gateway" / "var" / "admin-token"
        assert stat.S_IMODE(made.stat().st_mode) == 0o600
        logged = f"admin API token: {made} (no secrets file gives admin_token;"
        assert logged in process.output()
        args = ["--config", str(process.config_path), "--route", "to-hub", "--count", "1"]
        tap = _TapProcess(process, *args, token=None)
        tap.read_until("msggateway: tapping route to-hub")
        assert _send_mail(process, tmp_path / "mail", "ops@ok.example").startswith("K 1,")
        status, out, err = tap.finish()
        assert status == 0, err
        assert " mail:ops@ok.example -> to-hub -> hub:mail.ops id=" in out
    finally:
        process.stop()
