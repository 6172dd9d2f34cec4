"""Fixtures for the Spark tests: one local[2] session, logs written by the gateway's LogStore.

PySpark and Java are installed by ``./dev test`` (``msggateway[spark]`` and
``ensure_java``). Without them the tests are skipped with the reason on a
developer's machine and fail under ``CI=true``, where a skip would hide
that they never ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Spark cannot run here: {reason}")
    pytest.skip(f"Spark cannot run here: {reason}")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[2] Spark session with the msggateway data source registered."""
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        _unavailable(f"{exc} (./dev test installs msggateway[spark])")
    if shutil.which("java") is None:
        _unavailable("no java on PATH (./dev test installs openjdk-17-jre-headless)")
    from gateway.spark.jobs import spark_session

    session = spark_session("local[2]", app="msggateway tests")
    yield session
    session.stop()


def make_log(directory: Path, spec: dict[str, Any]) -> Path:
    """Write a log as `tests.spark.logmaker` describes, in a child process; return it."""
    subprocess.run(
        [sys.executable, "-m", "tests.spark.logmaker", str(directory), json.dumps(spec)],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    return directory
