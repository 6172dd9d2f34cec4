"""A route file with several problems gets every one reported, by file, key and reason.

The probe: one route file with three problems, one of which (``to`` naming
no listener) is only found by the check across tables. ``msggateway
check-config`` must print all three, and ``twistd msggateway`` must refuse
to start naming all three, as the main file's problems are reported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, GatewayStartError

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""

ROUTE = """
from = "mail"
to = "nowhere"
match = "orders..new"
timeout_seconds = -1
"""
"""Three problems: an unknown destination, an empty pattern word, a negative time-out."""

EXPECTED = (
    ("to", "no listener or upstream named 'nowhere'"),
    ("match", "empty word"),
    ("timeout_seconds", "must be greater than 0"),
)


def _reported(text: str, route: Path) -> None:
    """Check that ``text`` names each expected problem as ``file: key: reason``."""
    lines = [line.strip() for line in text.splitlines()]
    for key, reason in EXPECTED:
        prefix = f"{route}: {key}: "
        found = [line for line in lines if line.startswith(prefix) and reason in line]
        assert len(found) == 1, f"{prefix}{reason} not reported once in:\n{text}"


def test_check_config_reports_all_three(tmp_path: Path) -> None:
    """``msggateway check-config`` prints the route file's three problems and exits 1."""
    (tmp_path / "routes").mkdir()
    route = tmp_path / "routes" / "orders.toml"
    route.write_text(ROUTE)
    main = tmp_path / "gateway.toml"
    main.write_text(CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(main)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    _reported(done.stdout + done.stderr, route)
    assert "3 problem(s) found" in done.stdout + done.stderr


def test_the_gateway_refuses_to_start_naming_all_three(tmp_path: Path) -> None:
    """``twistd msggateway`` exits before listening, its error naming the three problems."""
    gateway = GatewayProcess(tmp_path, CONFIG, routes={"orders": ROUTE})
    with pytest.raises(GatewayStartError) as refused:
        gateway.start()
    _reported(str(refused.value), tmp_path / "routes" / "orders.toml")
