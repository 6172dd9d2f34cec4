"""The getting-started guide's rstream script, as printed, against a real gateway.

The script is taken from docs/getting-started.rst (the literal block that
imports rstream), pointed at a gateway running the embedded default on port
0, and run as a reader would run it: it prints the tour's two messages, and
Ctrl-C (SIGINT) ends it cleanly, without a traceback.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from importlib import resources
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, LineClient

pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.rst"
WAIT_SECONDS = 30.0


def tour_script() -> str:
    """The guide's literal block that imports rstream, dedented."""
    blocks = re.findall(r"::\n\n((?:    .*\n|\n)+)", GUIDE.read_text())
    [script] = [block for block in blocks if "import rstream" in block]
    return textwrap.dedent(script)


def test_the_rstream_script_prints_the_tour_and_ends_on_ctrl_c(tmp_path: Path) -> None:
    """Two messages printed, then SIGINT: exit status 0 and nothing on stderr."""
    default = resources.files("gateway").joinpath("default.toml").read_text("utf-8")
    config = re.sub(
        r"(?m)^data_port = \d+$", "data_port = 0", re.sub(r"tcp:\d+:", "tcp:0:", default)
    )
    gateway = GatewayProcess(tmp_path / "gateway", config).start()
    try:
        with LineClient(gateway.address("ssmp")) as publisher:
            publisher.send(
                "LOGIN . open", "MCAST tour.news hello world", "MCAST tour.news second message"
            )
            publisher.expect("200")
            publisher.expect("200")
        script = tour_script().replace("5552", str(gateway.address("streams")[1]))
        assert script != tour_script()
        (tmp_path / "tour.py").write_text(script)
        reader = subprocess.Popen(
            [sys.executable, "-u", str(tmp_path / "tour.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out = b""
        deadline = time.monotonic() + WAIT_SECONDS
        assert reader.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(reader.stdout, selectors.EVENT_READ)
            while out.count(b"\n") < 2:
                left = deadline - time.monotonic()
                assert left > 0, f"printed {out!r}"
                if selector.select(left):
                    chunk = os.read(reader.stdout.fileno(), 65536)
                    assert chunk, f"ended: {out!r} {reader.stderr.read() if reader.stderr else ''}"
                    out += chunk
        reader.send_signal(signal.SIGINT)
        rest, err = reader.communicate(timeout=WAIT_SECONDS)
        lines = (out + rest).decode().splitlines()
        assert [line.split(" {")[0] for line in lines] == ["0 hello world", "1 second message"]
        assert reader.returncode == 0, err.decode()
        assert err == b"", err.decode()
    finally:
        gateway.stop()
