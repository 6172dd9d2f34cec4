"""Deeply nested but otherwise well-formed inputs: the recursion bombs of each format.

A recursive decoder that does not bound its depth fails on these with a
`RecursionError` (MTL's JSON did, issue 18) or takes the interpreter's
stack with it. Each generator builds a structure around a depth drawn near
the codec's limit (one less, equal, one more) or far past it, every length
and count consistent, so that only the depth is wrong:

- `json_text`: JSON arrays and objects (MTL control bodies), brackets and
  escaped quotes inside strings included, and unbalanced bracket runs;
- `field_table`: AMQP 0-9-1 tables and arrays (DMP headers, MTL Content
  properties, AMQP 0-9-1 method tables);
- `amqp_value`: AMQP 1.0 lists, maps, arrays and described values, in
  their 8- and 32-bit forms, and chains of descriptors that are themselves
  described.

Everything here is plain `random.Random` work, fast enough for a bench loop.
"""

from __future__ import annotations

import random
import struct
from typing import Final

from gateway.codecs import amqp, fieldtable, mtl

__all__ = ["amqp_value", "depth_near", "field_table", "json_text"]

FAR_DEPTH: Final = 5000
"""A depth far past every limit, past Python's default recursion limit too."""

_U32: Final = struct.Struct(">I")
_LIST32: Final = struct.Struct(">BII")


def depth_near(rng: random.Random, limit: int) -> int:
    """A depth around ``limit``: just under, at, just over, a few times over, or far past it."""
    choice = rng.random()
    if choice < 0.6:
        return limit + rng.choice((-1, 0, 1, 2))
    if choice < 0.9:
        return rng.randint(limit, 8 * limit)
    return rng.randint(limit, FAR_DEPTH)


_JSON_LEAVES: Final = ("1", '"x"', "null", '"[{\\"]}"', "true", '"\\\\"')


def json_text(rng: random.Random, depth: int | None = None, *, broken: bool | None = None) -> bytes:
    """A JSON object whose value nests ``depth`` arrays and objects deep inside it.

    Args:
        rng: Where every choice comes from.
        depth: Levels inside the top object (near MAX_JSON_DEPTH when None).
        broken: Whether to leave the brackets unclosed (not JSON at all);
            one draw in ten when None.
    """
    if depth is None:
        depth = depth_near(rng, mtl.MAX_JSON_DEPTH)
    if broken is None:
        broken = rng.random() < 0.1
    if broken:
        return b'{"a": ' + bytes(rng.choice(b"[{") for _ in range(depth))
    opened: list[str] = []
    for _ in range(depth):
        if rng.random() < 0.5:
            opened.append("[")
        else:
            opened.append('{"' + rng.choice(("k", "[", "{", '\\"', "]")) + '": ')
    middle = rng.choice(_JSON_LEAVES)
    closing = "".join("]" if item == "[" else "}" for item in reversed(opened))
    return ('{"a": ' + "".join(opened) + middle + closing + "}").encode()


def field_table(rng: random.Random, depth: int | None = None) -> bytes:
    """A field table whose tables (``F``) and arrays (``A``) nest ``depth`` deep."""
    if depth is None:
        depth = depth_near(rng, fieldtable.MAX_DEPTH)
    value = rng.choice((b"V", b"t\x01", b"S\x00\x00\x00\x01x", b"I\x00\x00\x00\x07"))
    for _ in range(depth):
        if rng.random() < 0.5:
            pairs = b"\x01k" + value
            value = b"F" + _U32.pack(len(pairs)) + pairs
        else:
            value = b"A" + _U32.pack(len(value)) + value
    pairs = b"\x01k" + value
    return _U32.pack(len(pairs)) + pairs


_AMQP_LEAVES: Final = (b"\x40", b"\x45", b"\x41", b"\xa1\x01x", b"\x52\x07", b"\xa3\x01s")


def _amqp_compound(rng: random.Random, inner: bytes) -> bytes:
    """``inner`` wrapped in one compound value: a list, a map, an array or a described value."""
    kind = rng.randrange(5)
    small = len(inner) + 2 < 256 and rng.random() < 0.5
    if kind == 0:  # list of one element
        if small:
            return bytes((0xC0, len(inner) + 1, 1)) + inner
        return _LIST32.pack(0xD0, len(inner) + 4, 1) + inner
    if kind == 1:  # map: a symbol key, then the value
        pair = b"\xa3\x01k" + inner
        if small and len(pair) + 1 < 256:
            return bytes((0xC1, len(pair) + 1, 2)) + pair
        return _LIST32.pack(0xD1, len(pair) + 4, 2) + pair
    if kind == 2 and inner[0] == 0xD0:  # array of one list: its constructor, then its data
        return _LIST32.pack(0xF0, len(inner) + 4, 1) + inner
    if kind == 3:  # a descriptor that is itself described
        return b"\x00\x00\x53\x01\x40" + inner
    return b"\x00\x53\x01" + inner  # described value


def amqp_value(rng: random.Random, depth: int | None = None) -> bytes:
    """An AMQP 1.0 value whose compound values nest ``depth`` deep (or near MAX_DEPTH)."""
    if depth is None:
        depth = depth_near(rng, amqp.MAX_DEPTH)
    if rng.random() < 0.1:  # a chain of descriptors: 0x00 0x00 ... then the leaves
        return b"\x00" * depth + b"\x40" * (depth + 1)
    value = rng.choice(_AMQP_LEAVES)
    for _ in range(depth):
        value = _amqp_compound(rng, value)
    return value
