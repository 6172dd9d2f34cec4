"""Where the fields of every entry of a block are: numpy over all entries at once.

`parse` reads a block's entries as AMQP 1.0 messages (part 3, section 3.2;
type codes from part 1, section 1.6; docs/stream-protocol-notes.md, section
12) the way `gateway.codecs.amqp.decode_message` would, one array operation
per field for all entries together, and records positions: the message-id's
and the properties' ``to`` string, each application property's key and
value, and the body. Entries it cannot vouch for are marked ``slow``, to be
decoded one by one by the stream listener's own mapping.

Accepted (else slow): sections properties, application-properties and one
data, each at most once, in any order, with the ``0x00 0x53 code``
descriptor; a properties list of at most 13 fields of the types the decoder
allows, its message-id a string or null; an application-properties map of
at most `MAX_FAST_PAIRS` pairs with str8/str32 keys and values that are
null, booleans, whole numbers, timestamps, doubles or strings; a data
section of vbin8/vbin32. Every size, count and boundary is checked as the
decoder checks it. What needs the bytes themselves (UTF-8 of strings, ASCII
of symbols, keys being distinct) is checked afterwards, by
`gateway.spark.columnar` and `classify_pairs`.

Entries that do not start like an AMQP message (`looks_like_amqp`) are
``raw``: their bytes are the body. Those with another descriptor form are
slow: the decoder decides.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gateway.protocols.stream.mapping import RECIPIENTS_HEADER, SENDER_HEADER, TIMESTAMP_HEADER

__all__ = [
    "BOOLEAN",
    "DOUBLE",
    "IS_BOOLEAN",
    "IS_INTEGER",
    "IS_STRING",
    "MAX_FAST_PAIRS",
    "NULL",
    "RESERVED_RECIPIENTS",
    "RESERVED_SENDER",
    "RESERVED_TIMESTAMP",
    "TIMESTAMP",
    "TRUE",
    "Pairs",
    "Parsed",
    "Views",
    "classify_pairs",
    "parse",
]

MAX_FAST_PAIRS: Final = 32
"""Most application properties an entry may have for the fast path (more: row by row)."""

I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]
U64 = npt.NDArray[np.uint64]

NULL: Final = 0x40
TRUE: Final = 0x41
BOOLEAN: Final = 0x56
DOUBLE: Final = 0x82
TIMESTAMP: Final = 0x83
_FALSE = 0x42
_ULONG = 0x80
_VBIN8, _STR8, _SYM8, _VBIN32, _STR32, _SYM32 = 0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xB3
_LIST0, _LIST8, _LIST32, _MAP8, _MAP32 = 0x45, 0xC0, 0xD0, 0xC1, 0xD1
_PROPERTIES, _APPLICATION_PROPERTIES, _DATA = 0x73, 0x74, 0x75

RESERVED_SENDER: Final = 1
RESERVED_RECIPIENTS: Final = 2
RESERVED_TIMESTAMP: Final = 3


def _table(*codes: int) -> Bool:
    table = np.zeros(256, np.bool_)
    table[list(codes)] = True
    return table


# How far each value reaches: data starts _HEAD bytes after the constructor
# (a length of 1 or 4 bytes for variable-width types) and is _WIDTH bytes,
# or as long as that length says.
_HEAD: Final = np.zeros(256, np.int64)
_WIDTH: Final = np.zeros(256, np.int64)
for _codes, _width in (
    ((0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56), 1),
    ((0x60, 0x61), 2),
    ((0x70, 0x71, 0x72, 0x73, 0x74), 4),
    ((0x80, 0x81, 0x82, 0x83, 0x84), 8),
    ((0x94, 0x98), 16),
):
    _WIDTH[list(_codes)] = _width
_SHORT: Final = _table(_VBIN8, _STR8, _SYM8)
_WIDE: Final = _table(_VBIN32, _STR32, _SYM32)
_HEAD[_SHORT] = 1
_HEAD[_WIDE] = 4

_STRING = (NULL, _STR8, _STR32)
_PROPERTY_CODES: Final = np.stack(
    [
        _table(*_STRING),  # message-id: other id types row by row
        _table(NULL, _VBIN8, _VBIN32),  # user-id
        _table(*_STRING),  # to
        _table(*_STRING),  # subject
        _table(*_STRING),  # reply-to
        _table(*_STRING, _VBIN8, _VBIN32, 0x53, _ULONG, 0x44, 0x98),  # correlation-id
        _table(NULL, _SYM8, _SYM32),  # content-type
        _table(NULL, _SYM8, _SYM32),  # content-encoding
        _table(NULL, TIMESTAMP),  # absolute-expiry-time
        _table(NULL, TIMESTAMP),  # creation-time
        _table(*_STRING),  # group-id
        _table(NULL, 0x70, 0x52, 0x43),  # group-sequence
        _table(*_STRING),  # reply-to-group-id
    ]
)
"""The codes taken for each properties field: the decoder's types (`_PROPERTIES_LAYOUT`)."""
_INTEGERS = (0x43, 0x44, 0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x60, 0x61, 0x70, 0x71)
IS_INTEGER: Final = _table(*_INTEGERS, _ULONG, 0x81, TIMESTAMP)
IS_BOOLEAN: Final = _table(TRUE, _FALSE, BOOLEAN)
IS_STRING: Final = _table(_STR8, _STR32)
_IS_SYMBOL: Final = _table(_SYM8, _SYM32)
_KEY_CODES: Final = IS_STRING
_VALUE_CODES: Final = _table(NULL, DOUBLE, *np.flatnonzero(IS_INTEGER | IS_BOOLEAN | IS_STRING))

_NULLS8: Final = np.uint64(0x4040404040404040)
_NULLS6_TIME: Final = np.uint64(0x40404040404083)
"""Six null fields then a timestamp's code, as the top 7 bytes of a u64."""
_NULLS7: Final = np.uint64(0x40404040404040)
_FP_MIX: Final = np.uint64(0x9E3779B97F4A7C15)


class Views:
    """A buffer as unsigned bytes and big-endian numbers of each width, at any position."""

    def __init__(self, buffer: bytearray | mmap.mmap) -> None:
        size = len(buffer)
        self.u8 = np.frombuffer(buffer, np.uint8)
        self.i8 = self.u8.view(np.int8)

        def at(kind: str, width: int) -> npt.NDArray[Any]:
            return np.ndarray((size - width + 1,), kind, buffer, 0, (1,))

        self.u16 = at(">u2", 2)
        self.i16 = at(">i2", 2)
        self.u32 = at(">u4", 4)
        self.i32 = at(">i4", 4)
        self.u64 = at(">u8", 8)
        self.i64 = at(">i8", 8)
        self.f64 = at(">f8", 8)


@dataclass
class Pairs:
    """Application properties: a row per entry with some, a column per pair.

    Attributes:
        rows: The entries (block indexes), ascending.
        key_start: Where each key starts; -1 where the entry has no such pair.
        key_end: Where each key ends.
        code: The value's type code.
        value_start: Where the value's data starts.
        value_end: Where it ends.
        reserved: `RESERVED_SENDER`, `RESERVED_RECIPIENTS`,
            `RESERVED_TIMESTAMP` or 0 (a header), by `classify_pairs`.
        integers: Whole-number values as int64 (`classify_pairs`).
    """

    rows: I64
    key_start: I64
    key_end: I64
    code: I64
    value_start: I64
    value_end: I64
    reserved: I64 = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    integers: I64 = field(default_factory=lambda: np.zeros((0, 0), np.int64))


@dataclass
class Parsed:
    """Where each field of each entry is (-1: absent), and which entries are not fast.

    Attributes:
        slow: Entries to decode one by one.
        raw: Entries that are not AMQP: the body is all of it.
        id_start: The message-id string's start.
        id_end: Its end.
        to_start: The properties' ``to`` string's start.
        to_end: Its end.
        body_start: The body's start.
        body_end: Its end.
        strings: (entries, starts, ends) of other strings to check for UTF-8.
        symbols: (entries, starts, ends) of symbols to check for ASCII.
        pairs: The application properties, if any entry has some.
    """

    slow: Bool
    raw: Bool
    id_start: I64
    id_end: I64
    to_start: I64
    to_end: I64
    body_start: I64
    body_end: I64
    strings: list[tuple[I64, I64, I64]] = field(default_factory=list)
    symbols: list[tuple[I64, I64, I64]] = field(default_factory=list)
    pairs: Pairs | None = None


def parse(views: Views, starts: I64, ends: I64) -> Parsed:
    """Find the fields of every entry; mark those the fast path cannot take."""
    u8 = views.u8
    count = starts.size
    length = ends - starts
    first, second, third = u8.take(starts), u8.take(starts + 1), u8.take(starts + 2)
    described = (length >= 3) & (first == 0)
    standard = described & (second == 0x53) & (third >= 0x70) & (third <= 0x78)
    # Other descriptor forms (`looks_like_amqp`): the decoder decides, row by row.
    other = described & ((second == 0x80) | (second == 0xA3) | (second == 0xB3))
    parsed = Parsed(
        slow=other,
        raw=~(standard | other),
        id_start=np.full(count, -1, np.int64),
        id_end=np.full(count, -1, np.int64),
        to_start=np.full(count, -1, np.int64),
        to_end=np.full(count, -1, np.int64),
        body_start=np.where(standard, ends, starts),
        body_end=ends.copy(),
    )
    live = np.flatnonzero(standard)
    position = starts[live]
    seen = np.zeros(live.size, np.int64)
    found: list[Pairs] = []
    for _ in range(4):
        end = ends[live]
        more = position < end
        if not more.all():
            live, position, seen, end = live[more], position[more], seen[more], end[more]
        if not live.size:
            break
        ok = (position + 3 < end) & (u8.take(position) == 0) & (u8.take(position + 1) == 0x53)
        code = u8.take(position + 2)
        bit = np.select(
            [code == _PROPERTIES, code == _APPLICATION_PROPERTIES, code == _DATA], [1, 2, 4], 0
        )
        ok &= (bit != 0) & ((seen & bit) == 0)
        value_at = np.where(ok, position + 3, 0)
        after = np.zeros(live.size, np.int64)
        for which, handler in ((1, _properties), (2, _application_properties), (4, _data)):
            mine = ok & (bit == which)
            if not mine.any():
                continue
            whole = bool(mine.all())
            rows = live if whole else live[mine]
            section_end, good = handler(
                views,
                parsed,
                rows,
                value_at if whole else value_at[mine],
                end if whole else end[mine],
                found,
            )
            if whole:
                after, ok = section_end, good
            else:
                after[mine] = section_end
                ok[np.flatnonzero(mine)[~good]] = False
        if not ok.all():
            parsed.slow[live[~ok]] = True
            live, after, seen, bit = live[ok], after[ok], seen[ok], bit[ok]
        position, seen = after, seen | bit
    parsed.slow[live[position < ends[live]]] = True  # sections left over
    parsed.pairs = _merge(found)
    return parsed


def _item(views: Views, at: I64) -> tuple[I64, I64, I64]:
    """The value whose constructor is at ``at``: (code, data start, data end).

    Codes come back as machine integers, ready to index the tables with.
    """
    code = views.u8.take(at).astype(np.intp)
    start = at + 1 + _HEAD.take(code)
    end = start + _WIDTH.take(code)
    short = _SHORT.take(code)
    if short.any():
        end += np.where(short, views.u8.take(at + 1), 0)
    wide = _WIDE.take(code)
    if wide.any():
        end += np.where(wide, views.u32[np.where(wide, at + 1, 0)], 0).astype(np.int64)
    return code, start, end


def _str8_or_item(views: Views, at: I64) -> tuple[I64, I64, I64]:
    """`_item`, with the commonest case (every value a str8) in three operations."""
    code = views.u8.take(at).astype(np.intp)
    if (code == _STR8).all():
        start = at + 2
        return code, start, start + views.u8.take(at + 1)
    return _item(views, at)


def _booleans_ok(views: Views, code: I64, start: I64) -> Bool:
    """A boolean's octet is 0 or 1 (`_d_boolean`); True for every other value."""
    boolean = code == BOOLEAN
    if not boolean.any():
        return np.ones(code.size, np.bool_)
    result: Bool = ~boolean | (views.u8.take(np.where(boolean, start, 0)) <= 1)
    return result


def _compound(views: Views, at: I64, end: I64, short: int, wide: int) -> tuple[Bool, I64, I64, I64]:
    """A list or map at ``at``: (well-formed bounds, item count, first item, stop)."""
    u8 = views.u8
    code = u8.take(at)
    is_short = code == short
    if is_short.all():
        ok = at + 3 <= end
        size = u8.take(at + 1).astype(np.int64)
        items = u8.take(at + 2).astype(np.int64)
        first = at + 3
        stop = at + 2 + size
        ok &= (size >= 1) & (stop <= end) & (items <= stop - first)
        return ok, items, first, stop
    is_wide = code == wide
    ok = (is_short & (at + 3 <= end)) | (is_wide & (at + 9 <= end))
    safe = np.where(ok, at, 0)
    size = np.where(is_short, u8.take(safe + 1), views.u32[safe + 1]).astype(np.int64)
    items = np.where(is_short, u8.take(safe + 2), views.u32[safe + 5]).astype(np.int64)
    first = np.where(is_short, at + 3, at + 9)
    stop = np.where(is_short, at + 2 + size, at + 5 + size)
    ok &= np.where(is_short, size >= 1, size >= 4) & (stop <= end) & (items <= stop - first)
    return ok, items, first, stop


def _properties(
    views: Views, parsed: Parsed, rows: I64, at: I64, end: I64, found: list[Pairs]
) -> tuple[I64, Bool]:
    """The properties list (at most 13 fields, of their types).

    Message-id, a null user-id and ``to`` are read field by field; what
    follows is compared with the tails encoders write (nothing; six nulls
    and a creation-time or a null; rstream's thirteen fields). Other lists
    are walked field by field.
    """
    u8 = views.u8
    ok, items, first, stop = _compound(views, at, end, _LIST8, _LIST32)
    empty = u8.take(at) == _LIST0
    if empty.any():
        ok |= empty
        items = np.where(empty, 0, items)
        stop = np.where(empty, at + 1, stop)
        first = np.where(empty, stop, first)
    ok &= items <= len(_PROPERTY_CODES)
    position = np.where(ok, first, 0)
    code, id_start, id_end = _str8_or_item(views, position)
    quick = ok & (items >= 3) & _PROPERTY_CODES[0].take(code) & (id_end < stop)
    is_id = IS_STRING.take(code)
    position = np.where(quick, id_end, 0)
    quick &= u8.take(position) == NULL  # user-id
    code, to_start, to_end = _str8_or_item(views, position + 1)
    quick &= _PROPERTY_CODES[2].take(code) & (to_end <= stop)
    is_to = IS_STRING.take(code)
    tail = np.where(quick, to_end, 0)
    left = stop - tail
    head = views.u64[tail]
    quick &= (
        ((items == 3) & (left == 0))
        | ((items == 10) & (left == 15) & ((head >> np.uint64(8)) == _NULLS6_TIME))
        | ((items == 10) & (left == 7) & ((head >> np.uint64(8)) == _NULLS7))
        | ((items == 13) & (left == 10) & (head == _NULLS8) & (views.u16[tail + 8] == 0x4040))
        | (
            (items == 13)
            & (left == 18)
            & ((head >> np.uint64(8)) == _NULLS6_TIME)
            & ((views.u32[tail + 15] >> np.uint32(8)) == 0x404040)
        )
    )
    take = quick & is_id
    parsed.id_start[rows[take]] = id_start[take]
    parsed.id_end[rows[take]] = id_end[take]
    take = quick & is_to
    parsed.to_start[rows[take]] = to_start[take]
    parsed.to_end[rows[take]] = to_end[take]
    walk = ok & ~quick
    if walk.any():
        picked = np.flatnonzero(walk)
        ok[picked] = _walk_properties(
            views, parsed, rows[picked], first[picked], stop[picked], items[picked]
        )
    return stop, ok


def _walk_properties(
    views: Views, parsed: Parsed, rows: I64, first: I64, stop: I64, items: I64
) -> Bool:
    """The properties field by field, for lists the quick comparison does not take."""
    ok = np.ones(rows.size, np.bool_)
    position = first.copy()
    for number in range(int(items.max(initial=0))):
        act = np.flatnonzero(ok & (items > number))
        if not act.size:
            break
        code, start, end = _item(views, position[act])
        good = _PROPERTY_CODES[number].take(code) & (end <= stop[act])
        good &= _booleans_ok(views, code, start)
        ok[act[~good]] = False
        act, code, start, end = act[good], code[good], start[good], end[good]
        position[act] = end
        text = IS_STRING.take(code)
        if number in (0, 2):
            which = rows[act[text]]
            (parsed.id_start if number == 0 else parsed.to_start)[which] = start[text]
            (parsed.id_end if number == 0 else parsed.to_end)[which] = end[text]
        elif text.any():
            parsed.strings.append((rows[act[text]], start[text], end[text]))
        symbol = _IS_SYMBOL.take(code)
        if symbol.any():
            parsed.symbols.append((rows[act[symbol]], start[symbol], end[symbol]))
    ok &= position == stop
    bad = rows[~ok]
    parsed.id_start[bad] = parsed.to_start[bad] = -1
    return ok


def _application_properties(
    views: Views, parsed: Parsed, rows: I64, at: I64, end: I64, found: list[Pairs]
) -> tuple[I64, Bool]:
    """The application-properties map: string keys, simple values."""
    ok, items, first, stop = _compound(views, at, end, _MAP8, _MAP32)
    ok &= (items % 2 == 0) & (items <= 2 * MAX_FAST_PAIRS)
    count = np.where(ok, items // 2, 0)
    width = int(count.max(initial=0))
    shape = (rows.size, width)
    key_start = np.full(shape, -1, np.int64)
    key_end = np.full(shape, -1, np.int64)
    codes = np.full(shape, -1, np.int64)
    value_start = np.full(shape, -1, np.int64)
    value_end = np.full(shape, -1, np.int64)
    position = np.where(ok, first, 0)
    for number in range(width):
        active = ok & (count > number)
        every = bool(active.all())
        act: Any = slice(None) if every else np.flatnonzero(active)
        at_key = position if every else position[act]
        limit = stop if every else stop[act]
        code, k_start, k_end = _str8_or_item(views, at_key)
        good = _KEY_CODES.take(code) & (k_end < limit)
        code, v_start, v_end = _item(views, np.where(good, k_end, 0))
        good &= _VALUE_CODES.take(code) & (v_end <= limit) & _booleans_ok(views, code, v_start)
        key_start[act, number] = np.where(good, k_start, -1)
        key_end[act, number] = k_end
        codes[act, number] = code
        value_start[act, number] = v_start
        value_end[act, number] = v_end
        if every:
            ok &= good
            position = np.where(good, v_end, 0)
        else:
            ok[act[~good]] = False
            position[act] = np.where(good, v_end, 0)
    ok &= position == stop
    keep = np.flatnonzero(ok & (count > 0))
    if keep.size == rows.size:
        found.append(Pairs(rows, key_start, key_end, codes, value_start, value_end))
    elif keep.size:
        found.append(
            Pairs(
                rows=rows[keep],
                key_start=key_start[keep],
                key_end=key_end[keep],
                code=codes[keep],
                value_start=value_start[keep],
                value_end=value_end[keep],
            )
        )
    return stop, ok


def _data(
    views: Views, parsed: Parsed, rows: I64, at: I64, end: I64, found: list[Pairs]
) -> tuple[I64, Bool]:
    """One data section: a binary, the body."""
    code, start, stop = _item(views, at)
    ok = ((code == _VBIN8) | (code == _VBIN32)) & (stop <= end)
    parsed.body_start[rows] = np.where(ok, start, end)
    parsed.body_end[rows] = np.where(ok, stop, end)
    return stop, ok


def _merge(found: list[Pairs]) -> Pairs | None:
    """One `Pairs` for every entry with application properties, in entry order."""
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    width = max(p.key_start.shape[1] for p in found)
    rows = np.concatenate([p.rows for p in found])
    order = np.argsort(rows, kind="stable")

    def stacked(name: str) -> I64:
        parts = []
        for p in found:
            values = getattr(p, name)
            parts.append(np.pad(values, ((0, 0), (0, width - values.shape[1])), constant_values=-1))
        return np.concatenate(parts)[order]

    return Pairs(
        rows=rows[order],
        key_start=stacked("key_start"),
        key_end=stacked("key_end"),
        code=stacked("code"),
        value_start=stacked("value_start"),
        value_end=stacked("value_end"),
    )


# --- keys ---------------------------------------------------------------------------


def _words(key: bytes) -> tuple[tuple[int, np.uint64], ...]:
    """A key as big-endian 8-byte words at offsets 0, 8, ... and a last one ending at its end."""
    offsets = sorted({*range(0, len(key) - 7, 8), len(key) - 8})
    return tuple((at, np.uint64(int.from_bytes(key[at : at + 8], "big"))) for at in offsets)


_RESERVED_KEYS: Final = tuple(
    (number, len(name), _words(name.encode()))
    for number, name in (
        (RESERVED_SENDER, SENDER_HEADER),
        (RESERVED_RECIPIENTS, RECIPIENTS_HEADER),
        (RESERVED_TIMESTAMP, TIMESTAMP_HEADER),
    )
)
"""The reserved keys (all at least 8 bytes) as their length and words."""

_GROUPS: Final = (
    ((0x50, 0x52, 0x53), "u8"),
    ((0x51, 0x54, 0x55), "i8"),
    ((0x60,), "u16"),
    ((0x61,), "i16"),
    ((0x70,), "u32"),
    ((0x71,), "i32"),
    ((0x81, TIMESTAMP), "i64"),
)
"""Whole-number codes by the width and sign of their data (uint0/ulong0 are 0)."""


def classify_pairs(views: Views, parsed: Parsed) -> None:
    """Name the reserved properties; send entries the fast path cannot map row by row.

    An entry goes slow when a key appears twice (the decoder refuses the
    map: the entry then reads as raw), when a sender or recipients value is
    not a string, a header's value is a double (its text is Python's own)
    or a ulong past 2**63, or a timestamp in milliseconds is too large to
    become seconds exactly.
    """
    pairs = parsed.pairs
    if pairs is None:
        return
    present2 = pairs.key_start >= 0
    width = present2.shape[1]
    cells = np.flatnonzero(present2)  # row-major: (row, column) order
    row = cells // width
    start = pairs.key_start.ravel().take(cells)
    length = pairs.key_end.ravel().take(cells) - start
    code = pairs.code.ravel().take(cells)
    reserved = np.zeros(row.size, np.int64)
    for number, size, words in _RESERVED_KEYS:
        candidates = np.flatnonzero(length == size)
        if not candidates.size:
            continue
        at = start[candidates]
        hit = np.ones(candidates.size, np.bool_)
        for offset, word in words:
            hit &= views.u64[at + offset] == word
        reserved[candidates[hit]] = number
    integer = np.flatnonzero(IS_INTEGER.take(code))
    values = np.zeros(row.size, np.int64)
    bad_cells = np.zeros(row.size, np.bool_)
    if integer.size:
        values[integer], bad_cells[integer] = _integers(
            views, code[integer], pairs.value_start.ravel().take(cells[integer])
        )
    is_string = IS_STRING.take(code)
    text = (reserved == RESERVED_SENDER) | (reserved == RESERVED_RECIPIENTS)
    bad_cells |= text & ~is_string
    bad_cells |= (reserved == 0) & (code == DOUBLE)
    bad_cells |= (reserved == RESERVED_TIMESTAMP) & (code == TIMESTAMP) & (np.abs(values) >= 2**53)
    bad = np.zeros(pairs.rows.size, np.bool_)
    bad[row[bad_cells]] = True
    bad |= _duplicates(views, pairs, present2)
    parsed.slow[pairs.rows[bad]] = True
    pairs.reserved = np.zeros(present2.shape, np.int64)
    pairs.reserved.ravel()[cells] = reserved
    pairs.integers = np.zeros(present2.shape, np.int64)
    pairs.integers.ravel()[cells] = values


def _duplicates(views: Views, pairs: Pairs, present: Bool) -> Bool:
    """Rows of `Pairs` where a key appears twice.

    Only keys of equal length can be equal: rows with two such are compared
    by a digest of the key (equal keys, equal digests; a collision between
    unequal ones only sends a row the slow way).
    """
    columns = present.shape[1]
    suspect = np.zeros(present.shape[0], np.bool_)
    if columns < 2:
        return suspect
    lengths = np.where(present, pairs.key_end - pairs.key_start, -1)
    for one in range(columns):
        for other in range(one + 1, columns):
            suspect |= (lengths[:, one] == lengths[:, other]) & (lengths[:, one] >= 0)
    rows = np.flatnonzero(suspect)
    if not rows.size:
        return suspect
    here = present[rows]
    first, middle, last = _key_parts(
        views, np.where(here, pairs.key_start[rows], 0), np.where(here, lengths[rows], 0)
    )
    digest: U64 = np.multiply(first, _FP_MIX)
    digest ^= (middle + lengths[rows].astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
    digest ^= (last ^ np.uint64(0x94D049BB133111EB)) * np.uint64(0xD6E8FEB86659FD93)
    spare = np.uint64(2**64 - 1) - np.arange(columns, dtype=np.uint64)
    ordered = np.sort(np.where(here, digest, spare), axis=1)
    suspect[rows] = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    return suspect


def _key_parts(views: Views, starts: I64, lengths: I64) -> tuple[U64, U64, U64]:
    """Bytes 0-8, 8-12 and the last 8 of each key, zero past its end."""
    first = _leading(views, starts, np.minimum(lengths, 8))
    middle = _leading(views, starts + 8, np.clip(lengths - 8, 0, 4))
    last = np.where(lengths > 12, views.u64[np.maximum(starts + lengths - 8, starts)], 0)
    return first, middle, last.astype(np.uint64)


def _leading(views: Views, starts: I64, counts: I64) -> U64:
    """The first ``counts`` (0 to 8) bytes at each start, as a big-endian number."""
    value = views.u64[starts].astype(np.uint64)
    shift = (8 - counts) * 8
    return np.where(counts > 0, value >> np.minimum(shift, 63).astype(np.uint64), 0).astype(
        np.uint64
    )


def _integers(views: Views, code: I64, start: I64) -> tuple[I64, Bool]:
    """Whole-number values as int64, and where they do not fit (ulongs past 2**63)."""
    result = np.zeros(code.size, np.int64)
    big = np.zeros(code.size, np.bool_)
    for codes, width in _GROUPS:
        where = np.isin(code, codes)
        if where.any():
            result[where] = getattr(views, width)[start[where]]
    where = code == _ULONG
    if where.any():
        unsigned = views.u64[start[where]].astype(np.uint64)
        big[where] = unsigned >= np.uint64(2**63)
        result[where] = unsigned.astype(np.int64)
    return result, big
