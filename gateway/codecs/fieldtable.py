"""AMQP 0-9-1 field tables, as RabbitMQ writes them (DMP headers, MTL field tables).

Sans-IO and standard library only. A table is a 4-byte big-endian byte count
then ``name value`` pairs: a name is a short string (one length octet, at
most 255 bytes of UTF-8) and a value a type octet followed by its data::

    t boolean (1 octet)      b int8     B uint8     s int16    u uint16
    I int32      i uint32    l int64    L uint64    f float32  d float64
    D decimal (scale octet, int32)      S long string (uint32 length, bytes)
    A array (uint32 byte count, values) T timestamp (uint64 seconds)
    F nested table           V void (no data)       x byte array (uint32 length, bytes)

Spec ambiguity: the 0-9-1 specification and RabbitMQ disagree on a few type
letters (RabbitMQ's ``s`` is a signed 16-bit integer, ``l`` a signed 64-bit
one, and it never writes ``L``); we read every letter of both and write what
RabbitMQ writes.

Python values. Decoding: integers of every width are `int`, ``f``/``d``
`float`, ``D`` `decimal.Decimal`, ``S`` `str` (or `bytes` when not UTF-8),
``x`` `bytes`, ``T`` a timezone-aware `datetime.datetime`, ``A`` `list`,
``F`` `dict`, ``V`` None. Encoding: `bool` ``t``, `int` ``l`` (``L`` above
the int64 range), `float` ``d``, `decimal.Decimal` ``D``, `str` ``S``,
`bytes` ``x``, `datetime.datetime` ``T``, `list`/`tuple` ``A``, `Mapping`
``F``, None ``V``.

Text is what tables mostly hold (DMP's ``x-gateway-sender``, MTL's
``message-id``): a table of text names and text values is written in one
pass (`_text_table`), and a long-string value is read where its name is;
anything else goes the general way, which also says what is wrong.
"""

from __future__ import annotations

import datetime
import decimal
import struct
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_DEPTH",
    "FieldTableError",
    "FieldTableLocalError",
    "FieldValue",
    "decode_short_string",
    "decode_table",
    "encode_short_string",
    "encode_table",
]

FieldValue: TypeAlias = Any
"""bool, int, float, Decimal, str, bytes, datetime, list, dict or None (see above)."""

MAX_DEPTH: Final = 16
"""Tables and arrays nested in one another, at most (bounds recursion and work)."""

_U32: Final = struct.Struct(">I")
_OCTETS: Final = tuple(bytes((value,)) for value in range(256))
_LONG_STRING: Final = ord("S")
_SCALARS: Final[dict[int, struct.Struct]] = {
    ord("b"): struct.Struct(">b"),
    ord("B"): struct.Struct(">B"),
    ord("s"): struct.Struct(">h"),
    ord("u"): struct.Struct(">H"),
    ord("I"): struct.Struct(">i"),
    ord("i"): struct.Struct(">I"),
    ord("l"): struct.Struct(">q"),
    ord("L"): struct.Struct(">Q"),
    ord("f"): struct.Struct(">f"),
    ord("d"): struct.Struct(">d"),
}
_DECIMAL: Final = struct.Struct(">Bi")
_TIMESTAMP: Final = struct.Struct(">Q")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class FieldTableError(RemoteProtocolError):
    """A field table (or short string) from a peer that does not decode."""


class FieldTableLocalError(LocalProtocolError):
    """A value a field table cannot carry."""


def encode_short_string(text: str | bytes) -> bytes:
    """One length octet and at most 255 bytes (UTF-8 for text).

    Raises:
        FieldTableLocalError: Longer than 255 bytes.
    """
    data = text.encode("utf-8") if isinstance(text, str) else text
    if len(data) > 255:
        raise FieldTableLocalError(f"a short string holds at most 255 bytes, not {len(data)}")
    return bytes((len(data),)) + data


def decode_short_string(data: bytes | memoryview, offset: int = 0) -> tuple[bytes, int]:
    """Read a short string at ``offset``; return its bytes and the offset after it.

    Raises:
        FieldTableError: Cut short.
    """
    if offset >= len(data):
        raise FieldTableError("short string length missing", where=f"byte {offset}")
    end = offset + 1 + data[offset]
    if end > len(data):
        raise FieldTableError(
            f"short string of {data[offset]} bytes runs past the end", where=f"byte {offset}"
        )
    return bytes(data[offset + 1 : end]), end


def encode_table(table: Mapping[str, FieldValue]) -> bytes:
    """Encode a field table, its 4-byte byte count included.

    Raises:
        FieldTableLocalError: A name over 255 bytes, a value of a type no
            field carries, an integer out of 64-bit range, or nesting deeper
            than `MAX_DEPTH`.
    """
    if type(table) is dict:
        text = _text_table(table)
        if text is not None:
            return text
    out = bytearray(4)
    _put_pairs(out, table, 1)
    _U32.pack_into(out, 0, len(out) - 4)
    return bytes(out)


def decode_table(data: bytes | memoryview, offset: int = 0) -> tuple[dict[str, FieldValue], int]:
    """Decode the field table at ``offset``; return it and the offset after it.

    Raises:
        FieldTableError: Cut short, an unknown type octet, a name that is not
            UTF-8, bytes left inside the table, or nesting deeper than
            `MAX_DEPTH`.
    """
    return _table(data, offset, 1)


# --- encoding ----------------------------------------------------------------------------


def _text_table(table: dict[str, FieldValue]) -> bytes | None:
    """The table when it holds only text (names and values); None otherwise, or when it fails."""
    parts: list[bytes] = []
    try:
        for name, value in table.items():
            if type(name) is not str or type(value) is not str:
                return None
            raw_name = name.encode()
            raw = value.encode()
            parts.append(_OCTETS[len(raw_name)] + raw_name + b"S" + _U32.pack(len(raw)) + raw)
    except (IndexError, UnicodeEncodeError):  # a name over 255 bytes; text that does not encode
        return None
    pairs = b"".join(parts)
    return _U32.pack(len(pairs)) + pairs


def _put_pairs(out: bytearray, table: Mapping[str, FieldValue], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise FieldTableLocalError(f"field tables nest at most {MAX_DEPTH} deep")
    for name, value in table.items():
        if not isinstance(name, str):
            raise FieldTableLocalError(f"a field name is text, not {type(name).__name__}")
        out += encode_short_string(name)
        _put_value(out, value, depth)


def _put_value(out: bytearray, value: FieldValue, depth: int) -> None:
    if value is None:
        out += b"V"
    elif isinstance(value, bool):
        out += b"t\x01" if value else b"t\x00"
    elif isinstance(value, int):
        if _I64_MIN <= value <= _I64_MAX:
            out += b"l" + _SCALARS[ord("l")].pack(value)
        elif 0 <= value < 2**64:
            out += b"L" + _SCALARS[ord("L")].pack(value)
        else:
            raise FieldTableLocalError(f"{value} does not fit a 64-bit field")
    elif isinstance(value, float):
        out += b"d" + _SCALARS[ord("d")].pack(value)
    elif isinstance(value, decimal.Decimal):
        out += b"D" + _decimal_bytes(value)
    elif isinstance(value, str):
        encoded = value.encode("utf-8")
        out += b"S" + _U32.pack(len(encoded)) + encoded
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out += b"x" + _U32.pack(len(raw)) + raw
    elif isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise FieldTableLocalError("a timestamp needs a time zone")
        seconds = int((value - _EPOCH).total_seconds())
        if not 0 <= seconds < 2**64:
            raise FieldTableLocalError(f"timestamp {value.isoformat()} is before 1970")
        out += b"T" + _TIMESTAMP.pack(seconds)
    elif isinstance(value, Mapping):
        start = len(out) + 1
        out += b"F\0\0\0\0"
        _put_pairs(out, value, depth + 1)
        _U32.pack_into(out, start, len(out) - start - 4)
    elif isinstance(value, list | tuple):
        if depth + 1 > MAX_DEPTH:
            raise FieldTableLocalError(f"field tables nest at most {MAX_DEPTH} deep")
        start = len(out) + 1
        out += b"A\0\0\0\0"
        for item in value:
            _put_value(out, item, depth + 1)
        _U32.pack_into(out, start, len(out) - start - 4)
    else:
        raise FieldTableLocalError(f"a field table cannot carry a {type(value).__name__}")


def _decimal_bytes(value: decimal.Decimal) -> bytes:
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        raise FieldTableLocalError(f"decimal {value} is not a finite number")
    scale = max(-exponent, 0)
    unscaled = int("".join(map(str, digits)) or "0") * 10 ** max(exponent, 0)
    unscaled = -unscaled if sign else unscaled
    if scale > 255 or not -(2**31) <= unscaled < 2**31:
        raise FieldTableLocalError(f"decimal {value} does not fit a scale octet and an int32")
    return _DECIMAL.pack(scale, unscaled)


# --- decoding ----------------------------------------------------------------------------


def _need(end: int, pos: int, size: int, what: str) -> None:
    if pos + size > end:
        raise _cut_short(what, pos)


def _cut_short(what: str, pos: int) -> FieldTableError:
    return FieldTableError(f"{what} cut short", where=f"byte {pos}", kind="truncated")


def _table(
    data: bytes | memoryview, pos: int, depth: int, limit: int | None = None
) -> tuple[dict[str, FieldValue], int]:
    if depth > MAX_DEPTH:
        raise FieldTableError(f"field tables nest more than {MAX_DEPTH} deep", where=f"byte {pos}")
    limit = len(data) if limit is None else limit
    _need(limit, pos, 4, "field table length")
    (size,) = _U32.unpack_from(data, pos)
    start = pos + 4
    end = start + size
    if start + size > limit:  # formatted only when it fails: every table passes here
        raise _cut_short(f"field table of {size} bytes", start)
    table: dict[str, FieldValue] = {}
    pos = start
    while pos < end:
        stop = pos + 1 + data[pos]
        if stop > end:
            raise FieldTableError("field name runs past its table", where=f"byte {pos}")
        try:
            name = str(data[pos + 1 : stop], "utf-8")
        except UnicodeDecodeError:
            raise FieldTableError("a field name is not UTF-8", where=f"byte {stop}") from None
        pos = stop
        if pos + 5 <= end and data[pos] == _LONG_STRING:  # text, the common value: read here
            (size,) = _U32.unpack_from(data, pos + 1)
            stop = pos + 5 + size
            if stop <= end:
                raw = bytes(data[pos + 5 : stop])
                try:
                    table[name] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    table[name] = raw
                pos = stop
                continue
        table[name], pos = _value(data, pos, end, depth)
    return table, end


def _value(data: bytes | memoryview, pos: int, end: int, depth: int) -> tuple[FieldValue, int]:
    if pos >= end:
        raise FieldTableError("field value type missing", where=f"byte {pos}", kind="truncated")
    code = data[pos]
    pos += 1
    scalar = _SCALARS.get(code)
    if scalar is not None:
        if pos + scalar.size > end:
            raise _cut_short(f"{chr(code)} value", pos)
        return scalar.unpack_from(data, pos)[0], pos + scalar.size
    if code == ord("t"):
        _need(end, pos, 1, "boolean")
        return data[pos] != 0, pos + 1
    if code == ord("V"):
        return None, pos
    if code in (ord("S"), ord("x")):
        _need(end, pos, 4, "string length")
        (size,) = _U32.unpack_from(data, pos)
        if pos + 4 + size > end:
            raise _cut_short(f"string of {size} bytes", pos + 4)
        raw = bytes(data[pos + 4 : pos + 4 + size])
        if code == ord("S"):
            try:
                return raw.decode("utf-8"), pos + 4 + size
            except UnicodeDecodeError:
                return raw, pos + 4 + size
        return raw, pos + 4 + size
    if code == ord("D"):
        _need(end, pos, _DECIMAL.size, "decimal")
        scale, unscaled = _DECIMAL.unpack_from(data, pos)
        return decimal.Decimal(unscaled).scaleb(-scale), pos + _DECIMAL.size
    if code == ord("T"):
        _need(end, pos, 8, "timestamp")
        (seconds,) = _TIMESTAMP.unpack_from(data, pos)
        try:
            moment = _EPOCH + datetime.timedelta(seconds=seconds)
        except OverflowError:
            raise FieldTableError(
                f"timestamp {seconds} is out of range", where=f"byte {pos}"
            ) from None
        return moment, pos + 8
    if code == ord("F"):
        return _table(data, pos, depth + 1, end)
    if code == ord("A"):
        return _array(data, pos, depth + 1, end)
    raise FieldTableError(f"unknown field type {chr(code)!r} ({code})", where=f"byte {pos - 1}")


def _array(
    data: bytes | memoryview, pos: int, depth: int, limit: int
) -> tuple[list[FieldValue], int]:
    if depth > MAX_DEPTH:
        raise FieldTableError(f"field arrays nest more than {MAX_DEPTH} deep", where=f"byte {pos}")
    _need(limit, pos, 4, "array length")
    (size,) = _U32.unpack_from(data, pos)
    start = pos + 4
    end = start + size
    if start + size > limit:
        raise _cut_short(f"array of {size} bytes", start)
    items: list[FieldValue] = []
    pos = start
    while pos < end:
        item, pos = _value(data, pos, end, depth)
        items.append(item)
    return items, end
