"""The documentation site (docs/) builds with Sphinx, and without a single warning.

The build is the one CI runs and ``docs/conf.py`` describes: HTML, warnings
as errors, every problem reported (``--keep-going``), nothing fetched from
the network (no linkcheck). It also generates the configuration reference
from `gateway.config.reference`, so a schema whose reference is not valid
reStructuredText fails here too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"

BUILD_SECONDS = 60
"""A bound on the build (it takes a few seconds), so that a hung build fails."""


def test_the_docs_build_without_warnings(tmp_path: Path) -> None:
    """``sphinx -W --keep-going -b html docs`` succeeds; on failure its output says why."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_SECONDS,
        check=False,
    )
    assert done.returncode == 0, f"Sphinx failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "html" / "index.html").is_file()
    assert (tmp_path / "html" / "configuration-reference.html").is_file()
