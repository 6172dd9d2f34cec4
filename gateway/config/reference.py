"""The configuration reference, rendered as reStructuredText from the declared keys.

The reference is made from the same `Key` declarations that `Section`
reads and ``msggateway check-config`` validates against, so it lists every
key there is, with its type, default and meaning. The docs build calls
`render_reference`; ``python -m gateway.config.reference >
docs/configuration-reference.rst`` writes it out. Rendering has no side
effects and gives the same text every time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any, Final, TextIO

import attrs

from gateway.config import listeners, upstreams
from gateway.config.base import Key, Kind, TableSchema
from gateway.config.fleet import FLEET
from gateway.config.gateway import ADMIN, GATEWAY, LOG
from gateway.config.loader import MAIN
from gateway.config.routes import ROUTE
from gateway.config.secrets import FLEET_SECRETS, SECRETS

__all__ = ["PARTS", "Part", "declared_schemas", "main", "render_reference"]


@attrs.frozen
class Part:
    """A chapter of the reference: a file, or one kind of table of the main file.

    Attributes:
        title: Its heading.
        doc: A paragraph under the heading.
        schemas: Its tables, in order.
    """

    title: str
    doc: str
    schemas: tuple[TableSchema, ...]


def _with_children(schema: TableSchema) -> tuple[TableSchema, ...]:
    """A schema, then the schemas of the tables its keys hold, depth first."""
    found = [schema]
    for key in schema.keys:
        if key.kind in (Kind.TABLE, Kind.TABLES) and key.schema is not None:
            found.extend(_with_children(key.schema))
    return tuple(found)


PARTS: Final = (
    Part(
        "Main file",
        "The main file's top level holds these tables and nothing else.",
        (MAIN, GATEWAY, LOG, ADMIN, FLEET),
    ),
    Part(
        "Listeners",
        "A listener has the keys under *Every listener*, and those of its protocol.",
        tuple(
            schema
            for top in (
                listeners.LISTENER,
                *(schema for schema, _ in listeners.PROTOCOLS.values()),
            )
            for schema in _with_children(top)
        ),
    ),
    Part(
        "Upstreams",
        "An upstream has the keys under *Every upstream*, and those of its protocol.",
        tuple(
            schema
            for top in (upstreams.UPSTREAM, *(s for s, _ in upstreams.PROTOCOLS.values()))
            for schema in _with_children(top)
        ),
    ),
    Part("Routes", "", (ROUTE,)),
    Part("Secrets", "", (SECRETS, FLEET_SECRETS)),
)
"""The reference's chapters, in order."""


def declared_schemas() -> Iterator[TableSchema]:
    """Every declared table schema, each once, in the reference's order."""
    seen: set[int] = set()
    for part in PARTS:
        for top in part.schemas:
            for schema in _with_children(top):
                if id(schema) not in seen:
                    seen.add(id(schema))
                    yield schema


_INTRO: Final = """\
.. This file is generated from gateway/config/ by
   ``python -m gateway.config.reference``; edit the key declarations there.

=======================
Configuration reference
=======================

Every key the gateway reads, generated from the declarations that
``msggateway check-config`` validates against. A key left out takes its
default; a key that is not listed here is reported as unknown. Relative
paths are relative to the main file.
"""


def render_reference() -> str:
    """The whole configuration reference, as reStructuredText."""
    lines = [_INTRO]
    for part in PARTS:
        lines += ["", _heading(part.title, "="), ""]
        if part.doc:
            lines += [part.doc, ""]
        for schema in part.schemas:
            lines += _render_schema(schema)
    return "\n".join(lines).rstrip("\n") + "\n"


def _heading(title: str, underline: str) -> str:
    return f"{title}\n{underline * len(title)}"


def _render_schema(schema: TableSchema) -> list[str]:
    lines = [_heading(schema.title, "-"), "", f"``{schema.path}``", ""]
    if schema.doc:
        lines += [schema.doc, ""]
    lines += [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 22 18 20 40",
        "",
        "   * - Key",
        "     - Type",
        "     - Default",
        "     - Description",
    ]
    for key in schema.keys:
        lines += [
            f"   * - ``{key.name}``",
            f"     - {_type(key)}",
            f"     - {_default(key)}",
            f"     - {key.doc}",
        ]
    return [*lines, ""]


def _type(key: Key[Any]) -> str:
    match key.kind:
        case Kind.INTEGER:
            text = f"integer ≥ {int(key.minimum)}"
        case Kind.NUMBER:
            text = f"number ≥ {key.minimum:g}"
        case Kind.POSITIVE:
            text = "number > 0"
        case Kind.CHOICE:
            text = "one of " + ", ".join(f"``{choice}``" for choice in sorted(key.choices))
        case _:
            text = key.kind.value
    return text


def _default(key: Key[Any]) -> str:
    if key.required:
        return "*required*"
    if key.shown is not None:
        return key.shown
    value = key.default
    if key.kind in (Kind.TABLE, Kind.TABLES, Kind.STRING_MAP, Kind.STRING_MAPS):
        return "empty"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"``{str(value).lower()}``"
    if isinstance(value, int):
        return f"``{value}``" + _bytes_suffix(key.name, value)
    if isinstance(value, float):
        return f"``{value:g}``"
    if isinstance(value, tuple):
        return f"``[{', '.join(json.dumps(item) for item in value)}]``"
    return f"``{json.dumps(value)}``"


def _bytes_suffix(name: str, value: int) -> str:
    """`` (4 MiB)`` for a byte count that is a whole number of KiB, MiB or GiB."""
    if not name.endswith(("_bytes", "frame_max")) or value < 1024:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value % size == 0:
            return f" ({value // size} {unit})"
    return ""


def main(out: TextIO | None = None) -> None:
    """Write the reference to ``out`` (standard output)."""
    (out or sys.stdout).write(render_reference())


if __name__ == "__main__":
    main()
