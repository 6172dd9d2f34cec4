"""What a release carries besides the code: its licence and its changelog."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gateway import __version__

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_licence_pyproject_names() -> None:
    """LICENSE holds the MIT licence's text, which pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "MIT"}
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) ")
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def test_the_changelog_has_a_section_for_this_version() -> None:
    """CHANGELOG.rst has a section titled with the package's version, underlined to its length."""
    text = (ROOT / "CHANGELOG.rst").read_text()
    found = re.search(rf"(?m)^({re.escape(__version__)}\b.*)\n(=+)$", text)
    assert found is not None, f"no section for {__version__}"
    assert len(found.group(2)) == len(found.group(1))
