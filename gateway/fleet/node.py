"""A gateway process's node id: configured, or generated once and kept in its data dir.

Two processes must never publish under the same publisher reference:
RabbitMQ keeps one last publishing id per reference and stream, and drops
as a duplicate any message whose id is not above it, while each process
numbers its ids on its own. So the node id goes into every publisher
reference a process uses (`node_reference`).

Without ``[fleet] node`` the id is generated the first time (``gw-`` and
eight random base32 characters: 40 bits) and written to
``<data_dir>/node-id``, so that it stays the same across restarts and
upgrades, and goes with the data dir when it is restored from a backup.
The file is created without ever replacing one that is there: when two
starts race, both end up with the id that was written first.

Standard library only: the configuration (`gateway.config.fleet`) validates a
configured id with `node_id_problem`.
"""

from __future__ import annotations

import base64
import re
import secrets
from pathlib import Path
from typing import Final

from gateway.files import write_once

__all__ = [
    "MAX_NODE_ID_CHARS",
    "MAX_REFERENCE_PREFIX_BYTES",
    "NODE_ID_FILE",
    "NodeIdError",
    "generate_node_id",
    "load_node_id",
    "node_id_problem",
    "node_reference",
]

NODE_ID_FILE: Final = "node-id"
"""The file in the data dir that keeps a generated node id."""

MAX_NODE_ID_CHARS: Final = 64
"""A node id's longest length: it is appended to publisher references (`node_reference`),
which the stream protocol carries as short strings of at most 255 bytes."""
MAX_REFERENCE_PREFIX_BYTES: Final = 255 - 1 - MAX_NODE_ID_CHARS
"""The longest reference a node id is appended to (a configured ``publisher_reference``)."""

_NODE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_RANDOM_BYTES: Final = 5
"""40 random bits: eight base32 characters; two of a thousand nodes share an id with a
chance of about one in two million."""
_FILE_MODE: Final = 0o644


class NodeIdError(Exception):
    """The node id file cannot be read, holds no valid id, or cannot be written.

    Attributes:
        file: The file.
        reason: What is wrong, and what to do about it.
    """

    def __init__(self, file: Path, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


def node_id_problem(node: str) -> str | None:
    """What is wrong with a node id, or None when it is a valid one."""
    if not node:
        return "must not be empty"
    if len(node) > MAX_NODE_ID_CHARS:
        return f"must be at most {MAX_NODE_ID_CHARS} characters, not {len(node)}"
    if _NODE_ID.match(node) is None:
        return (
            f"must be ASCII letters, digits, '-', '_' and '.', starting with a letter or"
            f" a digit, not {node!r}"
        )
    return None


def generate_node_id() -> str:
    """A new random node id: ``gw-`` and eight lower-case base32 characters."""
    return "gw-" + base64.b32encode(secrets.token_bytes(_RANDOM_BYTES)).decode("ascii").lower()


def node_reference(reference: str, node: str) -> str:
    """A publisher reference made this node's own: ``<reference>.<node>``."""
    return f"{reference}.{node}"


def load_node_id(data_dir: Path, configured: str | None = None) -> str:
    """This process's node id: ``configured`` if given, else the one kept in ``data_dir``.

    A data dir without one gets a new id (`generate_node_id`), written to
    `NODE_ID_FILE` (mode 0644) before it is returned; the data dir is
    created if needed. ``configured`` must already be valid (the
    configuration checks it); the kept file is then neither read nor changed.

    Raises:
        NodeIdError: The file cannot be read or written, or holds no valid id.
    """
    if configured is not None:
        return configured
    path = data_dir / NODE_ID_FILE
    node = _read(path)
    if node is None:
        _create(path, generate_node_id())
        node = _read(path)
        if node is None:
            raise NodeIdError(path, "was written, then not found: is the data dir shared?")
    return node


def _read(path: Path) -> str | None:
    """The id kept in ``path``; None when there is no such file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise NodeIdError(path, f"cannot read: {exc.strerror}") from None
    problem: str | None
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        problem = "must be ASCII text"
    else:
        problem = node_id_problem(text)
        if problem is None:
            return text
    # Replacing it would give this process new publisher references without
    # anyone knowing why: the operator decides.
    raise NodeIdError(
        path,
        f"not a node id: it {problem}; put this node's id in it, or set [fleet] node"
        " (a new id gives the node new publisher references)",
    )


def _create(path: Path, node: str) -> None:
    """Write ``node`` to ``path`` unless a file is there already (`write_once`)."""
    try:
        write_once(path, f"{node}\n", _FILE_MODE)
    except OSError as exc:
        raise NodeIdError(path, f"cannot write a new node id: {exc.strerror}") from None
