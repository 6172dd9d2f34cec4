"""The ``[fleet]`` table: this process as one node of a fleet (DESIGN.md, "Scale").

Only ``node`` for now. A gateway without the table is a single node whose id
is generated once and kept in its data dir (`gateway.fleet.node`); `node_id`
gives the id a configuration stands for, reading or writing that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from gateway.config.base import ConfigError, ConfigProblem, Section, TableSchema, optional_string
from gateway.fleet.node import NODE_ID_FILE, NodeIdError, load_node_id, node_id_problem

__all__ = ["FLEET", "FleetConfig", "node_id", "read_fleet"]

NODE: Final = optional_string(
    "node",
    doc="This process's node id, part of every publisher reference it uses, so that two"
    " processes never share one: ASCII letters, digits, '-', '_' and '.', at most 64"
    " characters. Each process of a fleet needs its own.",
    shown=f"generated once (``gw-`` and 8 random characters), kept in data_dir/{NODE_ID_FILE}",
)

FLEET: Final = TableSchema(
    "Fleet",
    "[fleet]",
    (NODE,),
    doc="This process as one node of several that act as one gateway. Without the table the"
    " gateway is a single node with a generated id.",
)


@attrs.frozen
class FleetConfig:
    """The ``[fleet]`` table.

    Attributes:
        node: The configured node id, or None: the one kept in the data dir.
    """

    node: str | None = None


def read_fleet(section: Section) -> FleetConfig:
    """The ``[fleet]`` table; a node id that could not be used is a problem."""
    node = section.read(NODE)
    if node is not None:
        problem = node_id_problem(node)
        if problem is not None:
            section.problem(NODE, problem)
            node = None
    section.done()
    return FleetConfig(node=node)


def node_id(fleet: FleetConfig, data_dir: Path) -> str:
    """The node id: ``[fleet] node``, else the one kept in ``data_dir`` (made the first time).

    Raises:
        ConfigError: The kept id cannot be read or written, or is not one;
            the problem names the file.
    """
    try:
        return load_node_id(data_dir, fleet.node)
    except NodeIdError as exc:
        raise ConfigError([ConfigProblem(str(exc.file), "-", exc.reason)]) from None
