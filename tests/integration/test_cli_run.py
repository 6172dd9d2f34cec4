"""``msggateway run OPTION...`` as a user types it: the console script runs the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""

MSGGATEWAY = str(Path(sys.executable).with_name("msggateway"))


@pytest.mark.parametrize("launcher", [["run"], ["run", "--"]], ids=["run", "run --"])
def test_run_with_config_serves_that_configuration(tmp_path: Path, launcher: list[str]) -> None:
    """``msggateway run --config FILE`` (also after ``--``) starts the gateway on FILE."""
    gateway = GatewayProcess(tmp_path, CONFIG, launcher=[MSGGATEWAY, *launcher]).start()
    try:
        assert set(gateway.addresses) == {"hub"}
        with LineClient(gateway.address("hub")) as client:
            client.send("LOGIN someone open")
            client.expect("200")
    finally:
        gateway.stop()
