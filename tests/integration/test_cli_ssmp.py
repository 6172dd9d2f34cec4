"""``msggateway ssmp publish|subscribe`` against a real gateway process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["secret"]
anonymous = true
"""

SECRETS = """
[logins]
alice = "alice-secret"
watcher = "watcher-secret"
"""

MSGGATEWAY = str(Path(sys.executable).with_name("msggateway"))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    """A hub with secret logins and anonymous publishers."""
    process = GatewayProcess(tmp_path, CONFIG, secrets=SECRETS).start()
    yield process
    process.stop()


def test_publish_and_subscribe(gateway: GatewayProcess) -> None:
    """The CLI subscriber prints what the CLI publisher sent, as wire lines."""
    host, port = gateway.address("hub")
    address = f"{host}:{port}"
    with LineClient((host, port)) as watcher:
        watcher.send("LOGIN watcher secret watcher-secret", "SUBSCRIBE news PRESENCE")
        watcher.expect("200")
        watcher.expect("200")
        subscriber = subprocess.Popen(
            [MSGGATEWAY, "ssmp", "subscribe", "news", "--address", address, "--identity",
             "alice", "--scheme", "secret", "--secret-env", "ALICE_SECRET", "--count", "2",
             "--timeout", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"ALICE_SECRET": "alice-secret", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        try:
            watcher.expect("000 alice SUBSCRIBE news")  # the CLI subscriber is in
            published = subprocess.run(
                [MSGGATEWAY, "ssmp", "publish", "news", "one", "two words",
                 "--address", address, "--scheme", "secret"],
                capture_output=True,
                text=True,
                timeout=60,
            )  # fmt: skip
            assert published.returncode == 0, published.stderr
            assert published.stdout == "200\n200\n"
        finally:
            out, err = subscriber.communicate(timeout=60)
    assert subscriber.returncode == 0, err
    assert out == "000 . MCAST news one\n000 . MCAST news two words\n"


def test_refused_login_fails_clearly(gateway: GatewayProcess) -> None:
    """A wrong secret: exit status 1 and the server's 401 on stderr."""
    host, port = gateway.address("hub")
    done = subprocess.run(
        [MSGGATEWAY, "ssmp", "publish", "news", "x", "--address", f"{host}:{port}",
         "--identity", "alice", "--scheme", "secret", "--secret-env", "WRONG"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"WRONG": "nope", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "login refused: 401 secret" in done.stderr


def test_publish_to_closed_port_fails_clearly(tmp_path: Path) -> None:
    """Nothing listening: exit status 1 and a message naming the address."""
    done = subprocess.run(
        [MSGGATEWAY, "ssmp", "publish", "news", "x", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "cannot connect to 127.0.0.1:1" in done.stderr


def test_publish_lines_of_stdin_with_json_outcomes(gateway: GatewayProcess) -> None:
    """No BODY: each line of stdin is one MCAST; --json prints one outcome object each."""
    host, port = gateway.address("hub")
    out, err = io.StringIO(), io.StringIO()
    argv = ["ssmp", "publish", "news", "-a", f"{host}:{port}", "--scheme", "secret", "--json"]
    assert main(argv, out, err, io.BytesIO(b"first line\nsecond\n")) == 0, err.getvalue()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["message"], r["outcome"], r["code"]) for r in records] == [
        (1, "accepted", 200),
        (2, "accepted", 200),
    ]
