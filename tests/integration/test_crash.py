"""SIGKILL at a random moment loses nothing acknowledged and stores nothing twice.

The small version of ``bench/crash.py`` (whose docstring describes the
scenarios and how draining is detected): one run of each scenario, a few
thousand messages, the kill moment drawn from a seed printed on failure.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from bench.crash import Run, qmqp_run, rstream_run

pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

MESSAGES = 3000


def check(run: Run, seed: int) -> None:
    """Nothing lost, nothing twice, and the kill hit a run in progress."""
    described = f"seed {seed}: {run}"
    assert run.acknowledged > 0, described
    assert (run.lost, run.duplicates, run.problems) == (0, 0, []), described


@pytest.mark.parametrize("kill", ["mid-stream", "caught-up"])
def test_qmqp_into_a_durable_route_to_a_local_stream(tmp_path: Path, kill: str) -> None:
    """QMQP K'd messages are in the route's destination stream exactly once after a kill."""
    seed = random.randrange(1 << 30)
    check(qmqp_run(tmp_path, 901, "qmqp-local", kill, MESSAGES, random.Random(seed), None), seed)


def test_qmqp_into_rabbitmq_killed_while_the_forwarder_lags(tmp_path: Path, rabbitmq: Any) -> None:
    """The broker down, the gateway acknowledging into its log, then killed: all arrive once."""
    seed = random.randrange(1 << 30)
    run = qmqp_run(
        tmp_path, 902, "qmqp-rabbitmq", "lagging", MESSAGES, random.Random(seed), rabbitmq
    )
    check(run, seed)


def test_rstream_publishing_again_after_a_kill_stores_once(tmp_path: Path) -> None:
    """A named publisher re-publishing everything after the kill: every message once."""
    seed = random.randrange(1 << 30)
    check(rstream_run(tmp_path, 903, "mid-stream", MESSAGES, random.Random(seed)), seed)
