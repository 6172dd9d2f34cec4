"""Sphinx configuration of the msggateway documentation (docs/).

Build it from the checkout (``tests/test_docs.py`` does, with warnings as
errors)::

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

Sphinx built-ins only, the default theme (alabaster), nothing from the network.
The configuration reference (``configuration-reference.rst``) is generated at
each build from the schema ``msggateway check-config`` validates against,
`gateway.config.reference.render_reference`; the file is not kept in git.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

REFERENCE_PAGE = DOCS / "configuration-reference.rst"
"""Where the generated configuration reference goes (git-ignored)."""

project = "msggateway"
author = "the msggateway authors"
copyright = "the msggateway authors"
extensions: list[str] = []
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
html_theme = "alabaster"
html_title = "msggateway"
html_static_path: list[str] = []
highlight_language = "none"
nitpicky = True
# The stream protocol notes stay Markdown (code cites them by that path):
# they are no Sphinx source, and pages link them as a download.
source_suffix = {".rst": "restructuredtext"}


def write_reference(app: Any) -> None:
    """Write the configuration reference page from the schema, if it changed.

    Written to a temporary file and renamed, so that two builds at once never
    read half a page; left alone when the text is the same, so that an
    incremental build does not read it again.
    """
    from gateway.config.reference import render_reference

    text = render_reference()
    if REFERENCE_PAGE.exists() and REFERENCE_PAGE.read_text("utf-8") == text:
        return
    fd, temporary = tempfile.mkstemp(dir=DOCS, prefix=".configuration-reference.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, REFERENCE_PAGE)
    except BaseException:
        os.unlink(temporary)
        raise


def setup(app: Any) -> dict[str, Any]:
    """Generate the configuration reference before Sphinx reads the sources."""
    app.connect("builder-inited", write_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
