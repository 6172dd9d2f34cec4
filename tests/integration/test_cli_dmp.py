"""``msggateway dmp put|get`` against a real gateway process.

The gateway's DMP listener routes its sink ``in`` to its feed ``out``. The
command runs in-process through `gateway.cli.main` (blocking sockets against
the twistd subprocess): a reader waits on the feed while a writer puts.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.cli import main
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["in"]
feeds = ["out"]

[listeners.dmp.leases]
writer = { sink = "in", text = "wl" }
reader = { feed = "out", text = "rl" }
"""
ROUTES = {"loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n'}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with the DMP loop."""
    process = GatewayProcess(tmp_path_factory.mktemp("cli-dmp"), CONFIG, routes=ROUTES).start()
    yield process
    process.stop()


def run(*argv: str) -> tuple[int, str, str]:
    """Run the command line; its status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err)
    return status, out.getvalue(), err.getvalue()


def test_put_then_get(gateway: GatewayProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader on the feed prints the two messages a writer puts into the sink."""
    monkeypatch.setenv("W_LEASE", "wl")
    monkeypatch.setenv("R_LEASE", "rl")
    host, port = gateway.address("dmp")
    address = f"{host}:{port}"
    got: list[tuple[int, str, str]] = []
    reader = threading.Thread(
        target=lambda: got.append(
            run("dmp", "get", "-a", address, "--lease-env", "R_LEASE", "--count", "2")
        )
    )
    reader.start()
    # Until the reader is attached the route answers retry later and the sink drops
    # the message (DMP has no acknowledgement): put both, together, until it has them.
    deadline = time.monotonic() + 15
    while reader.is_alive() and time.monotonic() < deadline:
        status, out, _ = run(
            "dmp",
            "put",
            "-a",
            address,
            "--lease-env",
            "W_LEASE",
            "--routing-key",
            "k",
            "one",
            "two",
        )
        assert (status, out) == (0, "wrote 2 message(s)\n")
        reader.join(0.2)
    reader.join(1)
    [(status, out, err)] = got
    assert status == 0, err
    # Each line: the routing key (the feed's address), the message id (made by the gateway), body.
    lines = [line.split(" ", 2) for line in out.splitlines()]
    assert [(key, body) for key, _, body in lines] == [("out", "one"), ("out", "two")]
    assert all(message_id != "-" for _, message_id, _ in lines)


def test_refusals(gateway: GatewayProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad lease is 402 on stderr with status 1; a missing variable is a usage error."""
    host, port = gateway.address("dmp")
    monkeypatch.setenv("BAD", "nope")
    status, _, err = run("dmp", "put", "-a", f"{host}:{port}", "--lease-env", "BAD", "x")
    assert status == 1 and "402 BAD-LEASE" in err
    monkeypatch.delenv("UNSET_LEASE", raising=False)
    status, _, err = run("dmp", "get", "-a", f"{host}:{port}", "--lease-env", "UNSET_LEASE")
    assert status == 2 and "UNSET_LEASE is not set" in err
