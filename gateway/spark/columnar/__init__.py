r"""Stream entries to Arrow columns, without a Python object per message.

The data source (`gateway.spark.source`) reads the log as `RecordBlock` s
(`gateway.spark.logfiles.read_blocks`): the records of consecutive chunks as
start and end positions in one copy of their bytes. `message_batch` turns a
block into the record batch of ``kind = messages`` rows, computing only the
columns asked for:

* ``stream``, ``offset``, ``chunk_timestamp``, ``publisher`` and ``route``
  come from the chunk headers and the stream's name: no entry is looked at.
* The other columns need each entry's layout, which
  `gateway.spark.columnar.layout` finds with numpy over the whole block at
  once (an array operation per field, for all entries): which bytes are the
  message-id, the properties' ``to``, each application property's key and
  value, and the body. Strings and binaries are then sliced out of the
  block's buffer by Arrow, a column at a time (`_ranges`), and strings are
  checked for UTF-8 as the decoder would check them. Raw entries (not AMQP)
  need no parsing: the whole entry is the body.
* Entries the fast path does not take (a header or annotations section, an
  amqp-value body, a binary or uuid message-id, a double header, a key
  appearing twice, malformed bytes) are decoded one by one by
  `message_from_entry`, the stream listener's own mapping, and their values
  are put in place among the others.

`reference_batch` decodes every entry through `message_from_entry`: the
row-by-row path that `message_batch` must agree with exactly
(``tests/spark/test_columnar.py`` checks it with hypothesis).

Strings that are not valid Unicode (an id or sender given as bytes that are
not UTF-8) cannot be Arrow strings: their undecodable bytes read as
backslash escapes (``\xNN``), on both paths. A timestamp that is not a
finite number of microseconds within 64 bits reads as null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from gateway.core.internal import ROUTE_STREAM_PREFIX
from gateway.core.message import Message
from gateway.protocols.stream.mapping import message_from_entry
from gateway.spark.columnar.layout import (
    BOOLEAN,
    DOUBLE,
    IS_INTEGER,
    IS_STRING,
    MAX_FAST_PAIRS,
    NULL,
    RESERVED_RECIPIENTS,
    RESERVED_SENDER,
    RESERVED_TIMESTAMP,
    TIMESTAMP,
    TRUE,
    Parsed,
    Views,
    classify_pairs,
    parse,
)
from gateway.spark.logfiles import RecordBlock

__all__ = [
    "MAX_FAST_PAIRS",
    "MESSAGE_COLUMNS",
    "PARSED_COLUMNS",
    "TIMESTAMP_TYPE",
    "message_batch",
    "reference_batch",
]

TIMESTAMP_TYPE: Final = pa.timestamp("us", tz="UTC")
"""Spark's TIMESTAMP as a Python data source hands it over."""

_STRINGS: Final = pa.list_(pa.string())
_HEADERS: Final = pa.map_(pa.string(), pa.string())

MESSAGE_COLUMNS: Final = (
    ("stream", pa.string()),
    ("offset", pa.int64()),
    ("chunk_timestamp", TIMESTAMP_TYPE),
    ("publisher", pa.string()),
    ("message_id", pa.string()),
    ("route", pa.string()),
    ("address", pa.string()),
    ("sender", pa.string()),
    ("recipients", _STRINGS),
    ("timestamp", TIMESTAMP_TYPE),
    ("headers", _HEADERS),
    ("body", pa.binary()),
    ("size", pa.int32()),
)
"""The columns of ``kind = messages`` rows and their Arrow types (`gateway.spark.source`)."""

PARSED_COLUMNS: Final = frozenset(
    {"message_id", "address", "sender", "recipients", "timestamp", "headers", "body", "size"}
)
"""Columns that need the entries parsed; the others come from chunk headers."""

_TYPES: Final = dict(MESSAGE_COLUMNS)
_I64 = npt.NDArray[np.int64]
_Bool = npt.NDArray[np.bool_]


def message_batch(
    block: RecordBlock, stream: str, columns: Sequence[str], *, address_from_to: bool | None = None
) -> pa.RecordBatch:
    """The ``kind = messages`` rows of a block, with only ``columns``, in that order.

    Args:
        block: The records.
        stream: Their stream's name.
        columns: Names from `MESSAGE_COLUMNS`.
        address_from_to: Take addresses from the properties' ``to`` (default:
            for a durable route's stream, as `message_from_entry` says).
    """
    context = _Block(block, stream, _from_to(stream, address_from_to))
    arrays = [context.column(name) for name in columns]
    return pa.RecordBatch.from_arrays(arrays, schema=_schema(columns))


def reference_batch(
    block: RecordBlock, stream: str, columns: Sequence[str], *, address_from_to: bool | None = None
) -> pa.RecordBatch:
    """The same rows as `message_batch`, each entry decoded by `message_from_entry`."""
    context = _Block(block, stream, _from_to(stream, address_from_to))
    values = context.row_values(np.arange(block.count, dtype=np.int64), columns)
    arrays = [values[name] if name in values else context.column(name) for name in columns]
    return pa.RecordBatch.from_arrays(arrays, schema=_schema(columns))


def _from_to(stream: str, address_from_to: bool | None) -> bool:
    return stream.startswith(ROUTE_STREAM_PREFIX) if address_from_to is None else address_from_to


def _schema(columns: Sequence[str]) -> pa.Schema:
    return pa.schema([(name, _TYPES[name]) for name in columns])


class _Texts:
    """Strings of the fast entries, sliced out and checked: one column per kind.

    ``rows`` gives each string's entry (ascending); for properties, ``cells``
    its (pair row, column) in `Pairs`.
    """

    def __init__(self, array: pa.Array, rows: _I64, cells: tuple[_I64, _I64] | None = None):
        self.array = array
        self.rows = rows
        self.cells = cells

    def keep(self, slow: _Bool) -> _Texts:
        """Only the strings of entries that stayed fast."""
        kept = ~slow[self.rows]
        if kept.all():
            return self
        cells = None if self.cells is None else (self.cells[0][kept], self.cells[1][kept])
        return _Texts(self.array.filter(pa.array(kept)), self.rows[kept], cells)


class _Block:
    """One block being turned into columns; parsed on first need."""

    def __init__(self, block: RecordBlock, stream: str, address_from_to: bool) -> None:
        self.block = block
        self.stream = stream
        self.from_to = address_from_to
        self.count = block.count
        counts = np.array([c.count for c in block.chunks], np.int64)
        self.chunk_of = np.repeat(np.arange(len(block.chunks)), counts)
        firsts = np.array([c.first_offset for c in block.chunks], np.int64)
        bases = np.cumsum(counts) - counts
        self.offsets = np.arange(self.count, dtype=np.int64) + np.repeat(firsts - bases, counts)
        self.chunk_ms = np.repeat(np.array([c.timestamp for c in block.chunks], np.int64), counts)
        self._data = pa.py_buffer(block.buffer)
        self._ready = False
        self._parsed: Parsed
        self._views: Views
        self._fast: _I64
        self._texts: dict[str, _Texts] = {}

    def column(self, name: str) -> pa.Array:
        """One column of the batch."""
        count = self.count
        if name == "stream":
            return pa.repeat(pa.scalar(self.stream, pa.string()), count)
        if name == "offset":
            return pa.array(self.offsets, pa.int64())
        if name == "chunk_timestamp":
            return pa.array(self.chunk_ms * 1000, pa.int64()).cast(TIMESTAMP_TYPE)
        if name == "publisher":
            chunks = self.block.chunks
            publishers = [c.publishers[0] if len(c.publishers) == 1 else None for c in chunks]
            return pa.array(publishers, pa.string()).take(pa.array(self.chunk_of))
        if name == "route":
            route = self.stream[len(ROUTE_STREAM_PREFIX) :]
            if not self.stream.startswith(ROUTE_STREAM_PREFIX):
                return pa.nulls(count, pa.string())
            return pa.repeat(pa.scalar(route, pa.string()), count)
        self._prepare()
        slow = np.flatnonzero(self._parsed.slow)
        fast = self._fast_column(name)
        if not slow.size:
            return fast
        rows = self.row_values(slow, [name])[name]
        order = np.empty(self.count, np.int64)
        order[self._fast] = np.arange(self._fast.size)
        order[slow] = self._fast.size + np.arange(slow.size)
        return pa.concat_arrays([fast, rows]).take(pa.array(order))

    # --- the fast path --------------------------------------------------------------

    def _prepare(self) -> None:
        """Parse, check the strings, and settle which entries are fast."""
        if self._ready:
            return
        block = self.block
        self._views = Views(block.buffer)
        starts = np.asarray(block.starts, np.int64)
        ends = np.asarray(block.ends, np.int64)
        self._parsed = parsed = parse(self._views, starts, ends)
        classify_pairs(self._views, parsed)
        texts = self._texts
        fast = ~parsed.slow
        for name, first, last in (
            ("id", parsed.id_start, parsed.id_end),
            ("to", parsed.to_start, parsed.to_end),
        ):
            rows = np.flatnonzero(fast & (first >= 0))
            texts[name] = _Texts(self._ranges(first[rows], last[rows], pa.string()), rows)
        for number, (rows, first, last) in enumerate(parsed.strings):
            keep = fast[rows]
            rows = rows[keep]
            array = self._ranges(first[keep], last[keep], pa.string())
            texts[f"other-{number}"] = _Texts(array, rows)
        pairs = parsed.pairs
        if pairs is not None:
            present = (pairs.key_start >= 0) & fast[pairs.rows][:, None]
            for name, where, first, last in (
                ("keys", present & (pairs.reserved == 0), pairs.key_start, pairs.key_end),
                (
                    "values",
                    present & IS_STRING[np.maximum(pairs.code, 0)],
                    pairs.value_start,
                    pairs.value_end,
                ),
            ):
                row, column = np.nonzero(where)
                array = self._ranges(first[row, column], last[row, column], pa.string())
                texts[name] = _Texts(array, pairs.rows[row], (row, column))
        for kind in texts.values():
            _check_utf8(kind, parsed.slow)
        for rows, first, last in parsed.symbols:
            for entry, start, end in zip(rows.tolist(), first.tolist(), last.tolist(), strict=True):
                if not bytes(block.buffer[start:end]).isascii():
                    parsed.slow[entry] = True
        for name in list(texts):
            texts[name] = texts[name].keep(parsed.slow)
        self._fast = np.flatnonzero(~parsed.slow)
        self._ready = True

    def _ranges(self, starts: _I64, ends: _I64, kind: pa.DataType) -> pa.Array:
        return _ranges(self._data, starts, ends, kind)

    def _fast_column(self, name: str) -> pa.Array:
        parsed, rows = self._parsed, self._fast
        if name in ("body", "size"):
            starts, ends = parsed.body_start[rows], parsed.body_end[rows]
            if name == "size":
                return pa.array((ends - starts).astype(np.int32), pa.int32())
            return self._ranges(starts, ends, pa.binary())
        if name == "message_id":
            ids = self._per_row(self._texts["id"])
            if ids.null_count == 0:
                return ids
            offsets = pc.cast(pa.array(self.offsets[rows], pa.int64()), pa.string())
            return pc.coalesce(ids, pc.binary_join_element_wise(self.stream + ":", offsets, ""))
        if name == "address":
            stream = pa.repeat(pa.scalar(self.stream, pa.string()), rows.size)
            if not self.from_to:
                return stream
            return pc.coalesce(self._per_row(self._texts["to"]), stream)
        if name == "sender":
            return self._reserved(RESERVED_SENDER)
        if name == "recipients":
            return _recipients(self._reserved(RESERVED_RECIPIENTS))
        if name == "timestamp":
            return self._timestamps()
        if name == "headers":
            return self._headers()
        raise KeyError(name)

    def _per_row(self, texts: _Texts, elements: _I64 | None = None) -> pa.Array:
        """Strings aligned with the fast entries, null where an entry has none.

        ``elements`` picks which strings of ``texts`` (default: all), ascending by entry.
        """
        rows = texts.rows if elements is None else texts.rows[elements]
        if rows.size == self._fast.size and elements is None:
            return texts.array
        index = np.full(self._fast.size, -1, np.int64)
        picked = np.arange(texts.rows.size) if elements is None else elements
        index[np.searchsorted(self._fast, rows)] = picked
        return texts.array.take(pa.array(index, mask=index < 0))

    def _reserved(self, which: int) -> pa.Array:
        """The string values of one reserved property, aligned with the fast entries."""
        texts = self._texts.get("values")
        pairs = self._parsed.pairs
        if texts is None or pairs is None or texts.cells is None:
            return pa.nulls(self._fast.size, pa.string())
        row, column = texts.cells
        elements = np.flatnonzero(pairs.reserved[row, column] == which)
        return self._per_row(texts, elements)

    def _timestamps(self) -> pa.Array:
        rows = self._fast
        seconds = self.chunk_ms[rows] / 1000.0
        pairs = self._parsed.pairs
        if pairs is not None:
            cell = (pairs.reserved == RESERVED_TIMESTAMP) & ~self._parsed.slow[pairs.rows][:, None]
            row, column = np.nonzero(cell)
            at = np.searchsorted(rows, pairs.rows[row])
            code = pairs.code[row, column]
            double = code == DOUBLE
            seconds[at[double]] = self._views.f64[pairs.value_start[row, column][double]]
            stamp = code == TIMESTAMP
            whole = IS_INTEGER[code] & ~stamp
            integers = pairs.integers[row, column]
            seconds[at[stamp]] = integers[stamp] / 1000.0
            seconds[at[whole]] = integers[whole].astype(np.float64)
        return _micros(seconds)

    def _headers(self) -> pa.Array:
        rows = self._fast
        pairs = self._parsed.pairs
        offsets = np.zeros(rows.size + 1, np.int32)
        if pairs is None or "keys" not in self._texts:
            empty = pa.array([], pa.string())
            return pa.MapArray.from_arrays(pa.array(offsets), empty, empty, type=_HEADERS)
        keys, values = self._texts["keys"], self._texts["values"]
        assert keys.cells is not None and values.cells is not None
        row, column = keys.cells
        code = pairs.code[row, column]
        header = code != NULL
        counts = np.bincount(np.searchsorted(rows, keys.rows[header]), minlength=rows.size).astype(
            np.int32
        )
        np.cumsum(counts, out=offsets[1:])
        names = keys.array if header.all() else keys.array.filter(pa.array(header))
        row, column, code = row[header], column[header], code[header]
        is_string = IS_STRING[code]
        is_integer = IS_INTEGER[code]
        booleans = ~(is_string | is_integer)
        parts = []
        if is_string.any():
            # The header's value among all string values: same cells, in the same order.
            index = np.full(pairs.code.shape, -1, np.int64)
            index[values.cells] = np.arange(values.rows.size)
            picked = index[row[is_string], column[is_string]]
            parts.append(values.array.take(pa.array(picked)))
        if is_integer.any():
            integers = pairs.integers[row[is_integer], column[is_integer]]
            parts.append(pc.cast(pa.array(integers, pa.int64()), pa.string()))
        if booleans.any():
            starts = pairs.value_start[row[booleans], column[booleans]]
            kinds = code[booleans]
            truth = (kinds == TRUE) | ((kinds == BOOLEAN) & (self._views.u8[starts] == 1))
            parts.append(pc.if_else(pa.array(truth), "true", "false"))
        items = pa.concat_arrays(parts) if parts else pa.array([], pa.string())
        if len(parts) > 1:
            order = np.empty(code.size, np.int64)
            base = 0
            for kind in (is_string, is_integer, booleans):
                taken = int(kind.sum())
                order[kind] = base + np.arange(taken)
                base += taken
            items = items.take(pa.array(order))
        return pa.MapArray.from_arrays(pa.array(offsets), names, items, type=_HEADERS)

    # --- row by row -----------------------------------------------------------------

    def row_values(self, rows: _I64, columns: Sequence[str]) -> dict[str, pa.Array]:
        """Columns of the given rows, each entry decoded by `message_from_entry`."""
        wanted = [name for name in columns if name in PARSED_COLUMNS]
        values: dict[str, list[Any]] = {name: [] for name in wanted}
        block = self.block
        for row in rows.tolist():
            entry = bytes(block.buffer[int(block.starts[row]) : int(block.ends[row])])
            message = message_from_entry(
                entry,
                stream=self.stream,
                timestamp=int(self.chunk_ms[row]) / 1000,
                offset=int(self.offsets[row]),
                address_from_to=self.from_to,
            )
            for name in wanted:
                values[name].append(_row_value(message, name))
        return {name: pa.array(values[name], _TYPES[name]) for name in wanted}


def _check_utf8(texts: _Texts, slow: _Bool) -> None:
    """Mark the entries of strings that are not UTF-8 (the decoder refuses them)."""
    try:
        texts.array.validate(full=True)
    except pa.ArrowInvalid:
        raw = texts.array.view(pa.binary()).to_pylist()
        for row, value in zip(texts.rows.tolist(), raw, strict=True):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                slow[row] = True


def _row_value(message: Message, name: str) -> Any:
    if name == "message_id":
        return _arrow_text(message.id)
    if name == "address":
        return _arrow_text(message.address)
    if name == "sender":
        return None if message.sender is None else _arrow_text(message.sender)
    if name == "recipients":
        return [_arrow_text(r) for r in message.recipients]
    if name == "timestamp":
        return _row_micros(message.timestamp)
    if name == "headers":
        return [(_arrow_text(key), _header_text(value)) for key, value in message.headers.items()]
    if name == "body":
        return message.body
    if name == "size":
        return len(message.body)
    raise KeyError(name)


def _arrow_text(text: str) -> str:
    """Text an Arrow string can hold: undecodable bytes (surrogates) as backslash escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "backslashreplace")
    return text


def _header_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _arrow_text(value)
    return str(value)


def _row_micros(seconds: float) -> int | None:
    micros = seconds * 1_000_000
    if micros != micros or micros in (float("inf"), float("-inf")):
        return None
    whole = round(micros)
    return whole if -(2**63) <= whole < 2**63 else None


def _micros(seconds: npt.NDArray[np.float64]) -> pa.Array:
    """Seconds as a timestamp column, rounded as `_row_micros` rounds them."""
    with np.errstate(over="ignore", invalid="ignore"):
        micros = np.rint(seconds * 1e6)
    valid = np.isfinite(micros) & (micros >= -(2.0**63)) & (micros < 2.0**63)
    whole = np.where(valid, micros, 0).astype(np.int64)
    mask = None if valid.all() else ~valid
    return pa.array(whole, pa.int64(), mask=mask).cast(TIMESTAMP_TYPE)


def _ranges(data: pa.Buffer, starts: _I64, ends: _I64, kind: pa.DataType) -> pa.Array:
    """The byte ranges of ``data`` as one string or binary column, copied out by Arrow.

    The ranges ascend without overlapping, so that they and the gaps between
    them make a valid array over ``data``; taking every other element copies
    out the ranges alone, in one pass.
    """
    count = starts.size
    if not count:
        return pa.array([], kind)
    offsets = np.empty(2 * count + 1, np.int32)
    offsets[0 : 2 * count : 2] = starts
    offsets[1 : 2 * count : 2] = ends
    offsets[2 * count] = ends[-1]
    spans = pa.Array.from_buffers(kind, 2 * count, [None, pa.py_buffer(offsets), data])
    return spans.take(pa.array(np.arange(0, 2 * count, 2, dtype=np.int64)))


def _recipients(joined: pa.Array) -> pa.Array:
    """``x-gateway-recipients`` values split as `gateway.protocols.stream.mapping` splits them."""
    count = len(joined)
    texts = joined.drop_null() if joined.null_count else joined
    if len(texts) and pc.any(pc.match_substring(texts, ",")).as_py():
        split = pc.split_pattern(texts, ",")
        items = split.flatten()
        lengths = pc.list_value_length(split).to_numpy(zero_copy_only=False)
    else:
        items = texts
        lengths = np.ones(len(texts), np.int64)
    if len(items) and pc.any(pc.match_substring(items, "%")).as_py():
        # `_UNESCAPED`: %2C (either case) then %25; neither can make the other.
        for escaped, plain in (("%2C", ","), ("%2c", ","), ("%25", "%")):
            items = pc.replace_substring(items, escaped, plain)
    per_row = np.zeros(count, np.int64)
    if joined.null_count:
        per_row[np.asarray(joined.is_valid())] = lengths
    else:
        per_row[:] = lengths
    offsets = np.zeros(count + 1, np.int32)
    np.cumsum(per_row, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), items, type=_STRINGS)
