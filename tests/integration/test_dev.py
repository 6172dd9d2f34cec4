"""``./dev run`` sets up only what the gateway needs; ``./dev help`` speaks to its user.

The run is on a copy of the files ``pip install -e .`` reads (this
checkout's, as they are now), so that its ``.venv`` is fresh: creating it
and installing the gateway's dependencies takes 10 to 30 s (from the package
index, or pip's cache).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SECONDS = 600
PROJECT_FILES = ("dev", "pyproject.toml", "setup.cfg", "README.rst", "gateway", "twisted")
TEST_ONLY = ("pyspark", "pyarrow", "matplotlib", "mypy", "ruff", "sphinx", "pytest", "rstream")
"""Packages of ``msggateway[test]`` that running the gateway does not need."""


def test_dev_run_installs_the_runtime_dependencies_only(tmp_path: Path) -> None:
    """``./dev run --help`` in a fresh copy runs the plugin, with none of the test packages."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in PROJECT_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, checkout / name)
    done = subprocess.run(
        ["./dev", "run", "--help"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=INSTALL_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--config=" in done.stdout  # twistd msggateway's own help
    python = str(checkout / ".venv" / "bin" / "python")
    for name in TEST_ONLY:
        found = subprocess.run(
            [python, "-c", f"import importlib.util as u; print(u.find_spec({name!r}) is None)"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert found.stdout.strip() == "True", f"./dev run installed {name}"


def test_dev_help_names_the_commands_not_the_script_internals() -> None:
    """``./dev help`` lists run, test, setup and bench; no function names of the script."""
    done = subprocess.run(
        [str(ROOT / "dev"), "help"], capture_output=True, text=True, timeout=10, check=True
    )
    assert done.stdout.startswith("Usage: ./dev COMMAND")
    for command in ("run", "test", "setup", "bench"):
        assert f"\n  {command} " in done.stdout
    assert "ensure_" not in done.stdout and "below" not in done.stdout
    unknown = subprocess.run(
        [str(ROOT / "dev"), "nonsense"], capture_output=True, text=True, timeout=10, check=False
    )
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("dev: unknown command: nonsense")
