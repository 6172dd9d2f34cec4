"""``msggateway mtl send|receive`` against a real gateway process.

The gateway's MTL listener requires a PLAIN login; its gateway profile
routes resources under ``news.`` to the SSMP hub. The command runs
in-process through `gateway.cli.main` (pyzmq sockets against the twistd
subprocess): the test profile's fan-out from a sender to a receiver, and
confirm=full outcomes from the gateway profile.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator

import pytest

from gateway.cli import main
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
require_auth = true
"""
SECRETS = '[logins]\nalice = "wonderland"\n'
ROUTES = {"news": 'from = "mtl"\nmatch = "news.#"\nto = "hub"\n'}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with an MTL listener (PLAIN required) and an SSMP hub."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("cli-mtl"), CONFIG, routes=ROUTES, secrets=SECRETS
    ).start()
    yield process
    process.stop()


@pytest.fixture
def login(monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """The flags that log in as alice, her password in the environment."""
    monkeypatch.setenv("MTL_PASSWORD", "wonderland")
    return ("--username", "alice", "--password-env", "MTL_PASSWORD")


def run(*argv: str) -> tuple[int, str, str]:
    """Run the command line; its status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err, io.BytesIO())
    return status, out.getvalue(), err.getvalue()


def address(gateway: GatewayProcess) -> str:
    """``HOST:PORT`` of the MTL listener's control socket."""
    host, port = gateway.address("mtl")
    return f"{host}:{port}"


def test_send_to_a_receiver_in_the_test_profile(
    gateway: GatewayProcess, login: tuple[str, ...]
) -> None:
    """A receiver prints, as JSON, the contents a sender writes to the test resource."""
    where = ("-a", address(gateway), *login)
    got: list[tuple[int, str, str]] = []
    receive = ("mtl", "receive", *where, "--count", "2", "--json", "--timeout", "20")
    reader = threading.Thread(target=lambda: got.append(run(*receive)))
    reader.start()
    # The test profile fans out to the readers summoned when content comes, and
    # drops it for none: send until the reader has two.
    while reader.is_alive():
        assert run("mtl", "send", *where, "hello") == (0, "1 sent\n", "")
        reader.join(0.2)
    [(status, out, err)] = got
    assert status == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["resource"], r["body"]) for r in records] == [("resource", "hello")] * 2


def test_confirmed_sends_in_the_gateway_profile(
    gateway: GatewayProcess, login: tuple[str, ...]
) -> None:
    """confirm=full: a routed resource is accepted and reaches the hub; an unrouted one is not."""
    host, port = gateway.address("hub")
    full = ("-a", address(gateway), *login, "--profile", "gateway", "--confirm", "full")
    with LineClient((host, port)) as watcher:
        watcher.send("LOGIN watcher open", "SUBSCRIBE news.cli")
        watcher.expect("200")
        watcher.expect("200")
        assert run("mtl", "send", *full, "--resource", "news.cli", "hello") == (
            0,
            "1 accepted\n",
            "",
        )
        watcher.expect("000 . MCAST news.cli hello")
    status, out, _ = run("mtl", "send", *full, "--resource", "elsewhere", "x", "--json")
    assert status == 1
    assert json.loads(out) == {"message": 1, "resource": "elsewhere", "outcome": "rejected"}


def test_refusals(gateway: GatewayProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """No login where one is required, and a wrong password: exit 1, saying why."""
    status, _, err = run("mtl", "receive", "-a", address(gateway), "--count", "1")
    assert status == 1
    assert "the server wants a login: give --username and --password-env" in err
    monkeypatch.setenv("WRONG", "nope")
    status, _, err = run("mtl", "send", "-a", address(gateway), "--username", "alice",
                         "--password-env", "WRONG", "x")  # fmt: skip
    assert status == 1 and "Connection.Open: 401" in err
