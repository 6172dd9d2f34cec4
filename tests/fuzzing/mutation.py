"""A fast seeded mutator: valid encodings made slightly wrong in the ways parsers trip on.

`mutate` applies one to four operations to one byte string (or, for a
multipart input, to one of its frames or to the list of frames):

- truncation, and deleting, duplicating or inserting a range of bytes;
- a flipped bit, a byte set to anything or to a value parsers treat apart
  (0x00, 0x7f, 0x80, 0xff, ``:``, ``,``, LF, space, a digit);
- an oversized length: one, two, four or eight bytes overwritten with a
  big-endian boundary value (all ones, the sign bit, the signed maximum,
  the input's own length plus or minus one);
- a decimal length (netstrings, SSMP codes, QMQP pending counts) replaced
  by a huge, zero, signed or zero-padded number;
- a slice of another valid input spliced in (a real field where another
  was expected), or the whole input repeated;
- for multipart inputs, a frame dropped, duplicated, emptied, added or two
  swapped.

Inputs never grow past `MAX_INPUT_BYTES`. Everything draws from the
`random.Random` given, so a seed reproduces an input exactly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Final

from tests.fuzzing.samples import Input

__all__ = ["INTERESTING_BYTES", "MAX_INPUT_BYTES", "garbage", "mutate", "mutate_bytes"]

MAX_INPUT_BYTES: Final = 1 << 16
"""Largest input a mutation makes: enough for every limit the targets are built with."""

INTERESTING_BYTES: Final = b'\x00\x01\x7f\x80\xff:,\n\r 09{}[]"\\'
"""Byte values that parsers treat apart: bounds, signs, delimiters, digits, JSON syntax."""

_DIGITS: Final = re.compile(rb"[0-9]+")
_NUMBERS: Final = (b"99999999999", b"4294967296", b"0", b"00", b"-1", b"+1", b"1" * 30, b"")


def _boundary(rng: random.Random, width: int, size: int) -> bytes:
    """A big-endian value ``width`` bytes wide that a length check must refuse or survive."""
    top = (1 << (8 * width)) - 1
    value = rng.choice(
        (top, top >> 1, (top >> 1) + 1, 0, 1, size + 1, max(size - 1, 0), rng.randrange(top + 1))
    )
    return (value & top).to_bytes(width, "big")


def _truncate(rng: random.Random, data: bytearray, donor: bytes) -> None:
    del data[rng.randrange(len(data) + 1) :]


def _flip(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _set_byte(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if data:
        data[rng.randrange(len(data))] = (
            rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256)
        )


def _insert(rng: random.Random, data: bytearray, donor: bytes) -> None:
    where = rng.randrange(len(data) + 1)
    count = rng.choice((1, 1, 2, 4, 8, 32))
    if rng.random() < 0.5:
        data[where:where] = bytes(rng.choice(INTERESTING_BYTES) for _ in range(count))
    else:
        data[where:where] = rng.randbytes(count)


def _delete(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if data:
        start = rng.randrange(len(data))
        del data[start : start + rng.choice((1, 1, 2, 4, 16, 256))]


def _duplicate(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if data:
        start = rng.randrange(len(data))
        piece = data[start : start + rng.choice((1, 4, 16, 256))]
        where = rng.randrange(len(data) + 1)
        data[where:where] = piece * rng.choice((1, 2, 16))


def _oversize(rng: random.Random, data: bytearray, donor: bytes) -> None:
    width = rng.choice((1, 2, 4, 4, 4, 8))
    if len(data) < width:
        data += bytes(width - len(data))
    where = rng.randrange(len(data) - width + 1)
    # Lengths sit early in most frames: favour the first bytes.
    if rng.random() < 0.5:
        where = min(where, rng.randrange(min(len(data) - width, 16) + 1))
    data[where : where + width] = _boundary(rng, width, len(data))


def _renumber(rng: random.Random, data: bytearray, donor: bytes) -> None:
    runs = list(_DIGITS.finditer(data))
    if not runs:
        _insert(rng, data, donor)
        return
    run = rng.choice(runs)
    number = rng.choice(_NUMBERS)
    if rng.random() < 0.3:
        number = b"0" * rng.randrange(1, 4) + run.group()
    data[run.start() : run.end()] = number


def _splice(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if not donor:
        return
    start = rng.randrange(len(donor))
    piece = donor[start : start + rng.randrange(1, 64)]
    where = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        data[where : where + len(piece)] = piece
    else:
        data[where:where] = piece


def _repeat(rng: random.Random, data: bytearray, donor: bytes) -> None:
    data *= rng.choice((2, 3, 8))


_Operation = Callable[[random.Random, bytearray, bytes], None]
_OPERATIONS: Final[tuple[_Operation, ...]] = (
    _truncate,
    _truncate,
    _flip,
    _flip,
    _set_byte,
    _set_byte,
    _set_byte,
    _insert,
    _insert,
    _delete,
    _delete,
    _duplicate,
    _oversize,
    _oversize,
    _oversize,
    _renumber,
    _splice,
    _splice,
    _repeat,
)


def mutate_bytes(rng: random.Random, data: bytes, donor: bytes = b"") -> bytes:
    """``data`` changed by one to four operations (see the module docstring).

    Args:
        rng: Where every choice comes from.
        data: The bytes to change (left as they are).
        donor: Another valid input, for splices.
    """
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        rng.choice(_OPERATIONS)(rng, out, donor)
        if len(out) > MAX_INPUT_BYTES:
            del out[MAX_INPUT_BYTES:]
    return bytes(out)


def _mutate_frames(rng: random.Random, frames: list[bytes], donor: Input) -> None:
    choice = rng.randrange(6)
    if choice == 0 and frames:
        del frames[rng.randrange(len(frames))]
    elif choice == 1 and frames:
        frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
    elif choice == 2 and frames:
        frames[rng.randrange(len(frames))] = b""
    elif choice == 3:
        frames.insert(rng.randrange(len(frames) + 1), rng.choice((*donor, b"", rng.randbytes(8))))
    elif len(frames) > 1:
        first, second = rng.sample(range(len(frames)), 2)
        frames[first], frames[second] = frames[second], frames[first]


def mutate(rng: random.Random, sample: Input, donor: Input = ()) -> Input:
    """A mutation of ``sample``: its bytes, or for a multipart input its frames too.

    Args:
        rng: Where every choice comes from.
        sample: A valid input.
        donor: Another valid input of the same target, for splices.

    Returns:
        An input with as many parts as ``sample`` for a single-part input;
        a multipart input may gain or lose frames.
    """
    donor_bytes = rng.choice(donor) if donor else b""
    if len(sample) == 1:
        return (mutate_bytes(rng, sample[0], donor_bytes),)
    frames = list(sample)
    if not frames or rng.random() < 0.2:
        _mutate_frames(rng, frames, donor)
    if frames:
        index = rng.randrange(len(frames))
        frames[index] = mutate_bytes(rng, frames[index], donor_bytes)
    return tuple(frames)


def garbage(rng: random.Random, *, parts: int = 1, max_bytes: int = 256) -> Input:
    """Random bytes: ``parts`` strings (a random count up to four when ``parts`` is 0)."""
    count = parts or rng.randrange(5)
    return tuple(rng.randbytes(rng.randrange(max_bytes + 1)) for _ in range(count))
