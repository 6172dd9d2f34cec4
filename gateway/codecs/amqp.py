"""AMQP 1.0 messages (bare and annotated) as RabbitMQ streams store them.

Sans-IO and standard library only: `decode_message` turns one stream entry
into an `AMQPMessage`, `encode_message` turns one back into bytes. The
reference is the AMQP 1.0 specification, part 1 ("Types": encodings and
type codes, section 1.6) and part 3 ("Messaging", section 3.2: message
format and sections); docs/stream-protocol-notes.md, section 12, records
what rstream writes and reads.

A message is a sequence of sections, each a described value: ``0x00``, a
descriptor (``0x53 code``, ``0x80 u64`` or a symbol such as
``amqp:data:binary``), then the section's value::

    0x70 header                 list     -> Header
    0x71 delivery-annotations   map      -> AMQPMessage.delivery_annotations
    0x72 message-annotations    map      -> AMQPMessage.message_annotations
    0x73 properties             list     -> Properties
    0x74 application-properties map      -> AMQPMessage.application_properties
    0x75 data (may repeat)      binary   -> AMQPMessage.body (bytes, concatenated)
    0x76 amqp-sequence (repeat) list     -> AMQPMessage.body (AMQPSequence)
    0x77 amqp-value             any      -> AMQPMessage.body (AMQPValue)
    0x78 footer                 map      -> AMQPMessage.footer

Values. Every primitive type of part 1 decodes to a Python value; where a
plain Python type would lose the AMQP type, a thin subclass keeps it, so
that a decoded message encodes back to the same types: `Symbol` (str),
`Char` (str), `UByte`, `UShort`, `UInt`, `ULong`, `Byte`, `Short`, `Long`
and `Timestamp` (milliseconds; all int), `Float32` (float), `Decimal32`,
`Decimal64` and `Decimal128` (raw bytes, not interpreted). The rest are
plain: null is None, boolean bool, int (smallint, int) int, double float,
binary bytes, string str, uuid `uuid.UUID`, list list, map dict, array
`Array`, described values `Described`. Encoding plain values follows
rstream's choices: int as smallint/int, then long, then ulong; float as
double; bool as ``0x56 0x01``; str as str8/str32; bytes as vbin8/vbin32;
list and map in their 8-bit forms when count and size fit.

Bounded and strict: every declared size and count is checked against the
bytes that remain in the enclosing value before anything is read (a count
may not exceed the bytes its elements need); nesting is limited to
`MAX_DEPTH`; zero-width array elements are limited by the input's size.
Strings must be UTF-8 and symbols ASCII; a map's keys must be distinct and
hashable. Sections are checked against part 3: header and properties are
lists of at most 5 and 13 fields of the spec's types (trailing fields may
be left out, as most encoders do; rstream sends all 13), annotations and
footer maps have symbol or ulong keys, application properties have string
keys and simple values (no list, map or array), a section appears at most
once and a body is data sections, amqp-sequence sections or one amqp-value.
Sections are accepted in any order: rstream writes delivery-annotations
after the body. Anything malformed raises `AMQPDecodeError` with the byte
offset and section where it was found; nothing else escapes. `encode_message`
refuses what the decoder would refuse, with `AMQPEncodeError`.

A stream entry is always whole (the stream protocol frames it), so the
decoder works on complete entries rather than incrementally.
"""

from __future__ import annotations

import operator
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, TypeVar

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_DEPTH",
    "AMQPDecodeError",
    "AMQPEncodeError",
    "AMQPMessage",
    "AMQPSequence",
    "AMQPValue",
    "Array",
    "ArrayType",
    "Body",
    "Byte",
    "Char",
    "Decimal32",
    "Decimal64",
    "Decimal128",
    "Described",
    "Float32",
    "Header",
    "Long",
    "Properties",
    "Short",
    "Symbol",
    "Timestamp",
    "UByte",
    "UInt",
    "ULong",
    "UShort",
    "Value",
    "decode_message",
    "decode_value",
    "encode_message",
    "encode_value",
    "looks_like_amqp",
]

MAX_DEPTH: Final = 32
"""Most compound values (lists, maps, arrays, described values) nested in one another.

A section counts as the first level. Real messages nest two or three deep;
the limit keeps recursion far from Python's own and bounds work per byte.
"""

# --- values ----------------------------------------------------------------------


class Symbol(str):
    """An AMQP symbol: ASCII text naming something (annotation keys, content types)."""

    __slots__ = ()


class Char(str):
    """An AMQP char: one Unicode code point, sent as UTF-32."""

    __slots__ = ()


class UByte(int):
    """An AMQP ubyte (0 to 255)."""

    __slots__ = ()


class UShort(int):
    """An AMQP ushort (0 to 65,535)."""

    __slots__ = ()


class UInt(int):
    """An AMQP uint (0 to 2**32 - 1)."""

    __slots__ = ()


class ULong(int):
    """An AMQP ulong (0 to 2**64 - 1); numeric descriptors are ulongs."""

    __slots__ = ()


class Byte(int):
    """An AMQP byte (-128 to 127)."""

    __slots__ = ()


class Short(int):
    """An AMQP short (-32,768 to 32,767)."""

    __slots__ = ()


class Long(int):
    """An AMQP long (-2**63 to 2**63 - 1)."""

    __slots__ = ()


class Timestamp(int):
    """An AMQP timestamp: milliseconds since the Unix epoch, signed 64-bit."""

    __slots__ = ()


class Float32(float):
    """An AMQP float (IEEE 754 binary32); plain floats are sent as doubles."""

    __slots__ = ()


class Decimal32(bytes):
    """An AMQP decimal32, kept as its 4 raw bytes (IEEE 754 decimal32, BID)."""

    __slots__ = ()


class Decimal64(bytes):
    """An AMQP decimal64, kept as its 8 raw bytes."""

    __slots__ = ()


class Decimal128(bytes):
    """An AMQP decimal128, kept as its 16 raw bytes."""

    __slots__ = ()


ArrayType = Literal[
    "null",
    "boolean",
    "ubyte",
    "ushort",
    "uint",
    "ulong",
    "byte",
    "short",
    "int",
    "long",
    "float",
    "double",
    "decimal32",
    "decimal64",
    "decimal128",
    "char",
    "timestamp",
    "uuid",
    "binary",
    "string",
    "symbol",
    "list",
    "map",
    "array",
]
"""The AMQP type of every element of an `Array`."""


@dataclass(frozen=True, slots=True)
class Array:
    """An AMQP array: elements of one type, sent with one shared constructor.

    Attributes:
        element_type: The elements' AMQP type; the encoder picks its
            constructor (8- or 32-bit widths as the elements require).
        items: The elements, as plain or typed Python values.
        descriptor: For an array of described values, their shared
            descriptor; the items are then the undescribed values.
    """

    element_type: ArrayType
    items: tuple[Value, ...] = ()
    descriptor: Value = None


@dataclass(frozen=True, slots=True)
class Described:
    """A described value: a descriptor (ulong or symbol) and the value it describes."""

    descriptor: Value
    value: Value


Value: TypeAlias = (
    bool
    | int
    | float
    | str
    | bytes
    | uuid.UUID
    | list["Value"]
    | dict["Value", "Value"]
    | Array
    | Described
    | None
)
"""Any AMQP value, as decoded (see the module docstring for the type mapping)."""


# --- sections --------------------------------------------------------------------

# The section records are frozen but not slotted: the decoder builds them by
# setting their ``__dict__`` in one step, several times faster than a frozen
# dataclass's ``__init__`` (one ``object.__setattr__`` per field).


@dataclass(frozen=True, kw_only=True)
class Header:
    """The header section (part 3, section 3.2.1): transport details.

    Attributes:
        durable: Whether the message must survive an intermediary's restart.
        priority: Relative priority, a ubyte.
        ttl: Time to live in milliseconds, a uint.
        first_acquirer: Whether no earlier acquirer took the message.
        delivery_count: Failed delivery attempts so far, a uint.
    """

    durable: bool | None = None
    priority: int | None = None
    ttl: int | None = None
    first_acquirer: bool | None = None
    delivery_count: int | None = None


@dataclass(frozen=True, kw_only=True)
class Properties:
    """The properties section (part 3, section 3.2.4): the 13 immutable properties.

    Attributes:
        message_id: ulong, `uuid.UUID`, binary or string.
        user_id: The producing user's identity, binary.
        to: The destination node's address.
        subject: An application subject.
        reply_to: Where replies go.
        correlation_id: Like ``message_id``: ulong, uuid, binary or string.
        content_type: A MIME type, sent as a symbol.
        content_encoding: A content coding, sent as a symbol.
        absolute_expiry_time: Expiry in milliseconds since the epoch.
        creation_time: Creation in milliseconds since the epoch.
        group_id: The group the message belongs to.
        group_sequence: Its position in the group, a uint.
        reply_to_group_id: The group replies belong to.
    """

    message_id: int | uuid.UUID | bytes | str | None = None
    user_id: bytes | None = None
    to: str | None = None
    subject: str | None = None
    reply_to: str | None = None
    correlation_id: int | uuid.UUID | bytes | str | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    absolute_expiry_time: int | None = None
    creation_time: int | None = None
    group_id: str | None = None
    group_sequence: int | None = None
    reply_to_group_id: str | None = None


@dataclass(frozen=True, slots=True)
class AMQPValue:
    """A body of one amqp-value section: any single AMQP value."""

    value: Value


@dataclass(frozen=True, slots=True)
class AMQPSequence:
    """A body of one or more amqp-sequence sections, each a list of values."""

    sections: tuple[list[Value], ...]


Body: TypeAlias = bytes | AMQPValue | AMQPSequence | None
"""A message body: bytes for data sections (concatenated), or one of the other kinds."""


@dataclass(frozen=True, kw_only=True)
class AMQPMessage:
    """One AMQP 1.0 message; None marks a section that is absent.

    Attributes:
        header: The header section.
        delivery_annotations: Annotations for the next hop (symbol or ulong keys).
        message_annotations: Annotations kept along the way (symbol or ulong keys).
        properties: The properties section.
        application_properties: Application data: string keys, simple values.
        body: Data bytes, an `AMQPValue` or an `AMQPSequence`; None when absent.
        footer: Trailing annotations such as hashes (symbol or ulong keys).
    """

    header: Header | None = None
    delivery_annotations: Mapping[Value, Value] | None = None
    message_annotations: Mapping[Value, Value] | None = None
    properties: Properties | None = None
    application_properties: Mapping[str, Value] | None = None
    body: Body = None
    footer: Mapping[Value, Value] | None = None


# --- errors ----------------------------------------------------------------------


class AMQPDecodeError(RemoteProtocolError):
    """Bytes that are not a well-formed AMQP 1.0 message (or value).

    ``where`` names the byte offset from the start of the input and, within
    a message, the section. The stream protocol prescribes no answer: the
    entry is either passed on raw or refused by the caller.
    """


class AMQPEncodeError(LocalProtocolError):
    """A value or message that AMQP 1.0 cannot carry as given."""


# --- decoding --------------------------------------------------------------------

_U16: Final = struct.Struct(">H")
_I16: Final = struct.Struct(">h")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")
_F32: Final = struct.Struct(">f")
_F64: Final = struct.Struct(">d")
_U32X2: Final = struct.Struct(">II")

_Budget: TypeAlias = list[int]
"""Zero-width array elements still allowed in this input (one cell, shared by all levels).

Elements of an array whose constructor has no width (null, true, false,
uint0, ulong0, list0) cost no input bytes; all of them together may number
no more than the input has bytes, so that output stays proportional to input.
"""

_Decoder: TypeAlias = Callable[[memoryview, int, int, int, _Budget], tuple[Value, int]]
"""Decode the value whose constructor precedes ``pos``, within ``end``, at a nesting depth."""


def _error(reason: str, pos: int, kind: str = "malformed") -> AMQPDecodeError:
    return AMQPDecodeError(reason, where=f"byte {pos}", kind=kind)


def _truncated(what: str, pos: int, need: int, end: int) -> AMQPDecodeError:
    return _error(f"{what} needs {need} bytes, {max(end - pos, 0)} remain", pos, "truncated")


def _overrun(what: str, pos: int, size: int, remain: int) -> AMQPDecodeError:
    return _error(f"{what} declares {size} bytes, {remain} remain", pos, "length-overrun")


def _constant(value: Value) -> _Decoder:
    """Build the decoder of a zero-width constant (null, true, uint0, ...)."""

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        return value, pos

    return decode


def _d_list0(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
    return [], pos


def _d_boolean(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
    if pos >= end:
        raise _truncated("boolean", pos, 1, end)
    octet = buf[pos]
    if octet > 1:
        raise _error(f"boolean octet must be 0x00 or 0x01, not 0x{octet:02x}", pos)
    return octet == 1, pos + 1


def _unpacked(packer: struct.Struct, wrap: Callable[[Any], Value], what: str) -> _Decoder:
    """Build the decoder of a fixed-width number read with ``packer``."""
    size = packer.size
    unpack = packer.unpack_from

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        stop = pos + size
        if stop > end:
            raise _truncated(what, pos, size, end)
        return wrap(unpack(buf, pos)[0]), stop

    return decode


def _raw(width: int, wrap: Callable[[bytes], Value], what: str) -> _Decoder:
    """Build the decoder of a fixed-width opaque type (decimals, uuid)."""

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        stop = pos + width
        if stop > end:
            raise _truncated(what, pos, width, end)
        return wrap(bytes(buf[pos:stop])), stop

    return decode


def _d_char(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
    if pos + 4 > end:
        raise _truncated("char", pos, 4, end)
    point: int = _U32.unpack_from(buf, pos)[0]
    if point > 0x10FFFF or 0xD800 <= point <= 0xDFFF:
        raise _error(f"char 0x{point:x} is not a Unicode scalar value", pos)
    return Char(chr(point)), pos + 4


def _signed8(octet: int) -> int:
    return octet - 256 if octet > 127 else octet


def _variable(wide: bool, kind: str) -> _Decoder:
    """Build the decoder of vbin, str or sym in its 8- or 32-bit length form."""
    width = 4 if wide else 1
    what = f"{kind}{width * 8}"

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        start = pos + width
        if start > end:
            raise _truncated(f"{what} length", pos, width, end)
        size: int = _U32.unpack_from(buf, pos)[0] if wide else buf[pos]
        stop = start + size
        if stop > end:
            raise _overrun(what, pos, size, end - start)
        raw = buf[start:stop]
        if kind == "vbin":
            return bytes(raw), stop
        try:
            if kind == "str":
                return str(raw, "utf-8"), stop
            return Symbol(str(raw, "ascii")), stop
        except UnicodeDecodeError as exc:
            raise _error(f"{what} is not {exc.encoding}", start + exc.start) from None

    return decode


def _read_items(
    buf: memoryview, p: int, stop: int, count: int, depth: int, left: _Budget
) -> tuple[list[Value], int]:
    """Decode ``count`` consecutive values (list or map elements) within ``stop``."""
    items: list[Value] = []
    append = items.append
    decoders = _DECODERS
    for _ in range(count):
        if p >= stop:
            raise _truncated("element", p, 1, stop)
        code = buf[p]
        if code == 0x40:
            append(None)
            p += 1
        elif code == 0x54 and p + 1 < stop:  # smallint
            octet = buf[p + 1]
            append(octet - 256 if octet > 127 else octet)
            p += 2
        elif code == 0xA1:  # str8, the commonest key and value: decoded in line
            start = p + 2
            if start > stop:
                raise _truncated("str8 length", p + 1, 1, stop)
            q = start + buf[p + 1]
            if q > stop:
                raise _overrun("str8", p + 1, q - start, stop - start)
            try:
                append(str(buf[start:q], "utf-8"))
            except UnicodeDecodeError as exc:
                raise _error("str8 is not utf-8", start + exc.start) from None
            p = q
        else:
            item, p = decoders[code](buf, p + 1, stop, depth, left)
            append(item)
    return items, p


def _compound_bounds(
    buf: memoryview, pos: int, end: int, wide: bool, what: str
) -> tuple[int, int, int]:
    """Read a compound's size and count; return count, first element offset, end offset."""
    if wide:
        if pos + 8 > end:
            raise _truncated(f"{what}32 size and count", pos, 8, end)
        size, count = _U32X2.unpack_from(buf, pos)
        start, stop, least = pos + 8, pos + 4 + size, 4
    else:
        if pos + 2 > end:
            raise _truncated(f"{what}8 size and count", pos, 2, end)
        size, count = buf[pos], buf[pos + 1]
        start, stop, least = pos + 2, pos + 1 + size, 1
    if size < least:
        raise _error(f"{what} size {size} cannot hold its count", pos)
    if stop > end:
        raise _overrun(what, pos, size, end - pos - least)
    return count, start, stop


def _too_deep(pos: int) -> AMQPDecodeError:
    return _error(f"values nested deeper than {MAX_DEPTH}", pos, "too-deep")


def _compound(wide: bool, what: str) -> _Decoder:
    """Build the decoder of list8/list32 (``what`` "list") or map8/map32 ("map")."""
    is_map = what == "map"

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        if depth >= MAX_DEPTH:
            raise _too_deep(pos - 1)
        if not wide and pos + 2 <= end and 1 <= buf[pos] <= end - pos - 1:
            count, p, stop = buf[pos + 1], pos + 2, pos + 1 + buf[pos]  # list8/map8 in line
        else:
            count, p, stop = _compound_bounds(buf, pos, end, wide, what)
        if count > stop - p:  # every element takes at least its constructor byte
            raise _error(f"{what} count {count} exceeds its {stop - p} bytes", pos)
        if is_map and count & 1:
            raise _error(f"map count {count} is odd", pos)
        items, p = _read_items(buf, p, stop, count, depth + 1, left)
        if p != stop:
            raise _error(f"{what} has {stop - p} bytes after its {count} elements", p)
        if not is_map:
            return items, stop
        pairs = iter(items)
        try:
            result: dict[Value, Value] = dict(zip(pairs, pairs, strict=False))
        except TypeError:
            raise _error("a map key is a list, map or other unhashable value", pos) from None
        if len(result) != count >> 1:
            raise _error("map has duplicate keys", pos)
        return result, stop

    return decode


def _array(wide: bool) -> _Decoder:
    """Build the decoder of array8 or array32, described element constructors included."""

    def decode(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
        if depth >= MAX_DEPTH:
            raise _too_deep(pos - 1)
        count, p, stop = _compound_bounds(buf, pos, end, wide, "array")
        if count == 0 and p == stop:
            # Spec ambiguity: part 1 always puts an element constructor after
            # the count, but rstream writes an empty array as size and count
            # only (e0 01 00). Both decode to an empty array of nulls.
            return Array("null"), stop
        inner = depth + 1
        descriptor: Value = None
        if p < stop and buf[p] == 0x00:
            if p + 1 >= stop:
                raise _truncated("array element descriptor", p + 1, 1, stop)
            descriptor, p = _DECODERS[buf[p + 1]](buf, p + 2, stop, inner, left)
            if p < stop and buf[p] == 0x00:
                raise _error("nested descriptors in an array constructor", p)
        if p >= stop:
            raise _truncated("array element constructor", p, 1, stop)
        code = buf[p]
        element_type = _ARRAY_TYPES.get(code)
        if element_type is None:
            raise _error(f"0x{code:02x} is not an array element constructor", p, "bad-code")
        p += 1
        if code in _ZERO_WIDTH:
            left[0] -= count
            if left[0] < 0:
                raise _error("too many zero-width array elements", pos, "too-large")
        elif count > stop - p:
            raise _error(f"array count {count} exceeds its {stop - p} bytes", pos)
        element = _DECODERS[code]
        items: list[Value] = []
        append = items.append
        for _ in range(count):
            item, p = element(buf, p, stop, inner, left)
            append(item)
        if p != stop:
            raise _error(f"array has {stop - p} bytes after its {count} elements", p)
        return Array(element_type, tuple(items), descriptor), stop

    return decode


def _d_described(
    buf: memoryview, pos: int, end: int, depth: int, left: _Budget
) -> tuple[Value, int]:
    if depth >= MAX_DEPTH:
        raise _too_deep(pos - 1)
    inner = depth + 1
    if pos >= end:
        raise _truncated("descriptor", pos, 1, end)
    descriptor, pos = _DECODERS[buf[pos]](buf, pos + 1, end, inner, left)
    if pos >= end:
        raise _truncated("described value", pos, 1, end)
    value, pos = _DECODERS[buf[pos]](buf, pos + 1, end, inner, left)
    return Described(descriptor, value), pos


def _d_unknown(buf: memoryview, pos: int, end: int, depth: int, left: _Budget) -> tuple[Value, int]:
    raise _error(f"0x{buf[pos - 1]:02x} is not an AMQP type code", pos - 1, "bad-code")


def _same(value: Value) -> Value:
    return value


_BYTE: Final = struct.Struct(">B")
_DECODERS: Final[list[_Decoder]] = [_d_unknown] * 256
_DECODERS[0x00] = _d_described
_DECODERS[0x40] = _constant(None)
_DECODERS[0x41] = _constant(True)
_DECODERS[0x42] = _constant(False)
_DECODERS[0x43] = _constant(UInt(0))
_DECODERS[0x44] = _constant(ULong(0))
_DECODERS[0x45] = _d_list0
_DECODERS[0x50] = _unpacked(_BYTE, UByte, "ubyte")
_DECODERS[0x51] = _unpacked(_BYTE, lambda octet: Byte(_signed8(octet)), "byte")
_DECODERS[0x52] = _unpacked(_BYTE, UInt, "smalluint")
_DECODERS[0x53] = _unpacked(_BYTE, ULong, "smallulong")
_DECODERS[0x54] = _unpacked(_BYTE, _signed8, "smallint")
_DECODERS[0x55] = _unpacked(_BYTE, lambda octet: Long(_signed8(octet)), "smalllong")
_DECODERS[0x56] = _d_boolean
_DECODERS[0x60] = _unpacked(_U16, UShort, "ushort")
_DECODERS[0x61] = _unpacked(_I16, Short, "short")
_DECODERS[0x70] = _unpacked(_U32, UInt, "uint")
_DECODERS[0x71] = _unpacked(_I32, _same, "int")
_DECODERS[0x72] = _unpacked(_F32, Float32, "float")
_DECODERS[0x73] = _d_char
_DECODERS[0x74] = _raw(4, Decimal32, "decimal32")
_DECODERS[0x80] = _unpacked(_U64, ULong, "ulong")
_DECODERS[0x81] = _unpacked(_I64, Long, "long")
_DECODERS[0x82] = _unpacked(_F64, _same, "double")
_DECODERS[0x83] = _unpacked(_I64, Timestamp, "timestamp")
_DECODERS[0x84] = _raw(8, Decimal64, "decimal64")
_DECODERS[0x94] = _raw(16, Decimal128, "decimal128")
_DECODERS[0x98] = _raw(16, lambda raw: uuid.UUID(bytes=raw), "uuid")
for _code, _name in ((0xA0, "vbin"), (0xA1, "str"), (0xA3, "sym")):
    _DECODERS[_code] = _variable(False, _name)
    _DECODERS[_code | 0x10] = _variable(True, _name)
_DECODERS[0xC0] = _compound(False, "list")
_DECODERS[0xD0] = _compound(True, "list")
_DECODERS[0xC1] = _compound(False, "map")
_DECODERS[0xD1] = _compound(True, "map")
_DECODERS[0xE0] = _array(False)
_DECODERS[0xF0] = _array(True)

_ARRAY_TYPES: Final[dict[int, ArrayType]] = {
    code: name  # type: ignore[misc]  # names are ArrayType literals
    for name, codes in (
        ("null", (0x40,)),
        ("boolean", (0x41, 0x42, 0x56)),
        ("ubyte", (0x50,)),
        ("ushort", (0x60,)),
        ("uint", (0x43, 0x52, 0x70)),
        ("ulong", (0x44, 0x53, 0x80)),
        ("byte", (0x51,)),
        ("short", (0x61,)),
        ("int", (0x54, 0x71)),
        ("long", (0x55, 0x81)),
        ("float", (0x72,)),
        ("double", (0x82,)),
        ("decimal32", (0x74,)),
        ("decimal64", (0x84,)),
        ("decimal128", (0x94,)),
        ("char", (0x73,)),
        ("timestamp", (0x83,)),
        ("uuid", (0x98,)),
        ("binary", (0xA0, 0xB0)),
        ("string", (0xA1, 0xB1)),
        ("symbol", (0xA3, 0xB3)),
        ("list", (0x45, 0xC0, 0xD0)),
        ("map", (0xC1, 0xD1)),
        ("array", (0xE0, 0xF0)),
    )
    for code in codes
}
"""The element type each array element constructor stands for."""

_ZERO_WIDTH: Final = frozenset({0x40, 0x41, 0x42, 0x43, 0x44, 0x45})


def _view(data: bytes | bytearray | memoryview) -> memoryview:
    """The input as a flat view of bytes, copied only when it is not contiguous."""
    view = memoryview(data)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def decode_value(data: bytes | bytearray | memoryview) -> Value:
    """Decode exactly one AMQP value.

    Raises:
        AMQPDecodeError: The bytes are not one well-formed value.
    """
    buf = _view(data)
    end = len(buf)
    if not end:
        raise _truncated("value", 0, 1, 0)
    value, pos = _DECODERS[buf[0]](buf, 1, end, 0, [end])
    if pos != end:
        raise _error(f"{end - pos} bytes after the value", pos)
    return value


# Section descriptor codes (part 3, section 3.2) and their symbolic names.
_HEADER: Final = 0x70
_DELIVERY_ANNOTATIONS: Final = 0x71
_MESSAGE_ANNOTATIONS: Final = 0x72
_PROPERTIES: Final = 0x73
_APPLICATION_PROPERTIES: Final = 0x74
_DATA: Final = 0x75
_SEQUENCE: Final = 0x76
_VALUE: Final = 0x77
_FOOTER: Final = 0x78
_SECTION_NAMES: Final = {
    _HEADER: "header",
    _DELIVERY_ANNOTATIONS: "delivery-annotations",
    _MESSAGE_ANNOTATIONS: "message-annotations",
    _PROPERTIES: "properties",
    _APPLICATION_PROPERTIES: "application-properties",
    _DATA: "data",
    _SEQUENCE: "amqp-sequence",
    _VALUE: "amqp-value",
    _FOOTER: "footer",
}
_SECTION_SYMBOLS: Final = {
    "amqp:header:list": _HEADER,
    "amqp:delivery-annotations:map": _DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": _MESSAGE_ANNOTATIONS,
    "amqp:properties:list": _PROPERTIES,
    "amqp:application-properties:map": _APPLICATION_PROPERTIES,
    "amqp:data:binary": _DATA,
    "amqp:amqp-sequence:list": _SEQUENCE,
    "amqp:amqp-value:*": _VALUE,
    "amqp:footer:map": _FOOTER,
}
_SECTION_SYMBOL_BYTES: Final = frozenset(name.encode("ascii") for name in _SECTION_SYMBOLS)

_Layout: TypeAlias = tuple[tuple[str, tuple[type, ...]], ...]
_HEADER_LAYOUT: Final[_Layout] = (
    ("durable", (bool,)),
    ("priority", (UByte,)),
    ("ttl", (UInt,)),
    ("first_acquirer", (bool,)),
    ("delivery_count", (UInt,)),
)
_ID_TYPES: Final = (str, ULong, uuid.UUID, bytes)
_PROPERTIES_LAYOUT: Final[_Layout] = (
    ("message_id", _ID_TYPES),
    ("user_id", (bytes,)),
    ("to", (str,)),
    ("subject", (str,)),
    ("reply_to", (str,)),
    ("correlation_id", _ID_TYPES),
    ("content_type", (Symbol,)),
    ("content_encoding", (Symbol,)),
    ("absolute_expiry_time", (Timestamp,)),
    ("creation_time", (Timestamp,)),
    ("group_id", (str,)),
    ("group_sequence", (UInt,)),
    ("reply_to_group_id", (str,)),
)
_ANNOTATION_KEY_TYPES: Final = (Symbol, ULong)
_NOT_SIMPLE: Final = (list, dict, Array)

_Record = TypeVar("_Record", Header, Properties)
_new = object.__new__
_set = object.__setattr__


def _record(cls: type[_Record], value: Value, layout: _Layout, section: str) -> _Record:
    """Check a composite section's list against its field types and build its record."""
    if type(value) is not list:
        raise AMQPDecodeError(f"{section} must be a list, not {_kind(value)}")
    if len(value) > len(layout):
        raise AMQPDecodeError(f"{section} has {len(value)} fields, at most {len(layout)} exist")
    attributes = _DEFAULTS[cls].copy()
    for index, item in enumerate(value):
        if item is not None:
            name, types = layout[index]
            if type(item) not in types:
                wanted = " or ".join(t.__name__ for t in types)
                raise AMQPDecodeError(f"{section} {name} must be {wanted}, not {_kind(item)}")
            attributes[name] = item
    record = _new(cls)
    _set(record, "__dict__", attributes)
    return record


_DEFAULTS: Final[dict[type, dict[str, Value]]] = {
    Header: dict.fromkeys(name for name, _ in _HEADER_LAYOUT),
    Properties: dict.fromkeys(name for name, _ in _PROPERTIES_LAYOUT),
}


def _kind(value: object) -> str:
    return type(value).__name__


def _annotations(value: Value, section: str) -> dict[Value, Value]:
    if type(value) is not dict:
        raise AMQPDecodeError(f"{section} must be a map, not {_kind(value)}")
    for key in value:
        if type(key) not in _ANNOTATION_KEY_TYPES:
            raise AMQPDecodeError(f"{section} key {key!r} is not a symbol or ulong")
    return value


def _application_properties(value: Value) -> dict[str, Value]:
    if type(value) is not dict:
        raise AMQPDecodeError(f"application-properties must be a map, not {_kind(value)}")
    for key, item in value.items():
        if type(key) is not str:
            raise AMQPDecodeError(f"application-properties key {key!r} is not a string")
        if isinstance(item, _NOT_SIMPLE):
            # Part 3, section 3.2.5: values are restricted to simple types.
            raise AMQPDecodeError(f"application property {key!r} is a {_kind(item)}")
    return value  # type: ignore[return-value]  # keys checked above


def _section_code(buf: memoryview, pos: int, end: int, left: _Budget) -> tuple[int, int]:
    """Read a section's descriptor (after its 0x00); return its code and the next offset."""
    if pos + 1 < end and buf[pos] == 0x53:
        code = buf[pos + 1]
        if code not in _SECTION_NAMES:
            raise _error(f"0x{code:02x} is not a message section", pos + 1, "bad-section")
        return code, pos + 2
    if pos >= end:
        raise _truncated("section descriptor", pos, 1, end)
    descriptor, after = _DECODERS[buf[pos]](buf, pos + 1, end, 1, left)
    if type(descriptor) is ULong and descriptor in _SECTION_NAMES:
        return descriptor, after
    if type(descriptor) is Symbol and descriptor in _SECTION_SYMBOLS:
        return _SECTION_SYMBOLS[descriptor], after
    raise _error(f"{descriptor!r} is not a message section descriptor", pos, "bad-section")


def _sections(found: dict[int, Value], body_kind: int, parts: list[Value]) -> dict[str, object]:
    """Check the sections' types and name them as `AMQPMessage` fields."""
    body: Body = None
    if body_kind == _DATA:
        body = b"".join(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type,assignment]
    elif body_kind == _SEQUENCE:
        body = AMQPSequence(tuple(parts))  # type: ignore[arg-type]  # lists, checked on entry
    elif body_kind == _VALUE:
        body = AMQPValue(parts[0])
    sections: dict[str, object] = dict(_NO_SECTIONS, body=body)
    if not found:
        return sections
    for code, value in found.items():
        if code == _PROPERTIES:
            sections["properties"] = _record(Properties, value, _PROPERTIES_LAYOUT, "properties")
        elif code == _APPLICATION_PROPERTIES:
            sections["application_properties"] = _application_properties(value)
        elif code == _HEADER:
            sections["header"] = _record(Header, value, _HEADER_LAYOUT, "header")
        else:
            sections[_FIELD_NAMES[code]] = _annotations(value, _SECTION_NAMES[code])
    return sections


_FIELD_NAMES: Final = {
    _DELIVERY_ANNOTATIONS: "delivery_annotations",
    _MESSAGE_ANNOTATIONS: "message_annotations",
    _FOOTER: "footer",
}
_NO_SECTIONS: Final = dict.fromkeys(
    (
        "header",
        "delivery_annotations",
        "message_annotations",
        "properties",
        "application_properties",
        "body",
        "footer",
    )
)


def decode_message(data: bytes | bytearray | memoryview) -> AMQPMessage:
    """Decode one AMQP 1.0 message (a stream entry) into its sections.

    Sections may come in any order (rstream writes delivery-annotations
    last), but each at most once, except data and amqp-sequence sections,
    which may repeat and are joined in order. A body mixes no kinds.

    Args:
        data: The whole entry.

    Returns:
        The message; absent sections are None.

    Raises:
        AMQPDecodeError: The bytes are not a well-formed message.
    """
    buf = _view(data)
    end = len(buf)
    if not end:
        raise _error("an empty entry holds no message sections", 0, "truncated")
    left = [end]
    found: dict[int, Value] = {}
    parts: list[Value] = []
    body_kind = pos = start = code = 0
    try:
        while pos < end:
            start, code = pos, 0
            if buf[pos] != 0x00:
                got = f"0x{buf[pos]:02x}"
                raise _error(f"a section starts with 0x00, not {got}", pos, "bad-section")
            if pos + 2 < end and buf[pos + 1] == 0x53 and 0x70 <= buf[pos + 2] <= 0x78:
                code = buf[pos + 2]
                pos += 3
            else:
                code, pos = _section_code(buf, pos + 1, end, left)
            if pos >= end:
                raise _truncated("section value", pos, 1, end)
            value, pos = _DECODERS[buf[pos]](buf, pos + 1, end, 1, left)
            if code < _DATA or code == _FOOTER:
                if code in found:
                    raise AMQPDecodeError(f"more than one {_SECTION_NAMES[code]} section")
                found[code] = value
                continue
            if body_kind and (body_kind != code or code == _VALUE):
                raise AMQPDecodeError(
                    f"{_SECTION_NAMES[code]} after {_SECTION_NAMES[body_kind]}: a body is data "
                    "sections, amqp-sequence sections or one amqp-value"
                )
            if code == _DATA and type(value) is not bytes:
                raise AMQPDecodeError(f"data must be binary, not {_kind(value)}")
            if code == _SEQUENCE and type(value) is not list:
                raise AMQPDecodeError(f"amqp-sequence must be a list, not {_kind(value)}")
            parts.append(value)
            body_kind = code
        code = 0  # checks of whole sections name their section in the reason
        message = _new(AMQPMessage)
        _set(message, "__dict__", _sections(found, body_kind, parts))
        return message
    except AMQPDecodeError as exc:
        if not code:
            raise
        inner = f"{exc.where}, " if exc.where else ""
        where = f"{inner}in the {_SECTION_NAMES[code]} section at byte {start}"
        raise AMQPDecodeError(exc.reason, where=where, kind=exc.kind) from None


def looks_like_amqp(data: bytes | bytearray | memoryview) -> bool:
    """Tell cheaply whether an entry starts like an AMQP 1.0 message.

    True when it starts with a described section descriptor: ``00 53 70``
    to ``00 53 78``, ``00 80`` and a 64-bit section code, or ``00 a3`` (or
    ``00 b3``) and a section's symbolic name. Raw entries (rstream's
    ``Producer.send(b"...")``) almost never do; the decoder decides the rest.
    """
    head = bytes(data[:40])
    if len(head) < 3 or head[0] != 0x00:
        return False
    kind = head[1]
    if kind == 0x53:
        return 0x70 <= head[2] <= 0x78
    if kind == 0x80:
        return len(head) >= 10 and head[2:9] == bytes(7) and 0x70 <= head[9] <= 0x78
    if kind == 0xA3:
        return head[3 : 3 + head[2]] in _SECTION_SYMBOL_BYTES
    if kind == 0xB3:
        size: int = _U32.unpack_from(head, 2)[0] if len(head) >= 6 else 0
        return head[6 : 6 + size] in _SECTION_SYMBOL_BYTES
    return False


# --- encoding --------------------------------------------------------------------

_Encoder: TypeAlias = Callable[[bytearray, object, int], None]

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_UINT32_MAX: Final = 2**32 - 1
_UINT64_MAX: Final = 2**64 - 1


def _range_error(value: object, kind: str, low: int, high: int) -> AMQPEncodeError:
    return AMQPEncodeError(f"{value!r} is outside the {kind} range {low}..{high}")


def _e_null(out: bytearray, value: object, depth: int) -> None:
    out.append(0x40)


def _e_bool(out: bytearray, value: object, depth: int) -> None:
    # rstream's choice: the one-octet boolean (0x56), not the 0x41/0x42 forms.
    out.append(0x56)
    out.append(1 if value else 0)


def _e_int(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, int)
    if -128 <= value <= 127:
        out.append(0x54)
        out.append(value & 0xFF)
    elif _INT32_MIN <= value <= _INT32_MAX:
        out.append(0x71)
        out += _I32.pack(value)
    elif _INT64_MIN <= value <= _INT64_MAX:
        out.append(0x81)
        out += _I64.pack(value)
    elif 0 <= value <= _UINT64_MAX:
        out.append(0x80)
        out += _U64.pack(value)
    else:
        raise _range_error(value, "int, long or ulong", _INT64_MIN, _UINT64_MAX)


def _e_uint(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, int)
    if value == 0:
        out.append(0x43)
    elif 0 < value <= 0xFF:
        out.append(0x52)
        out.append(value)
    elif 0 < value <= _UINT32_MAX:
        out.append(0x70)
        out += _U32.pack(value)
    else:
        raise _range_error(value, "uint", 0, _UINT32_MAX)


def _e_ulong(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, int)
    if value == 0:
        out.append(0x44)
    elif 0 < value <= 0xFF:
        out.append(0x53)
        out.append(value)
    elif 0 < value <= _UINT64_MAX:
        out.append(0x80)
        out += _U64.pack(value)
    else:
        raise _range_error(value, "ulong", 0, _UINT64_MAX)


def _e_long(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, int)
    if -128 <= value <= 127:
        out.append(0x55)
        out.append(value & 0xFF)
    elif _INT64_MIN <= value <= _INT64_MAX:
        out.append(0x81)
        out += _I64.pack(value)
    else:
        raise _range_error(value, "long", _INT64_MIN, _INT64_MAX)


def _packed(code: int, packer: struct.Struct, kind: str, low: int, high: int) -> _Encoder:
    """Build the encoder of a fixed-width integer type with a range check."""
    prefix = bytes((code,))

    def encode(out: bytearray, value: object, depth: int) -> None:
        assert isinstance(value, int)
        if not low <= value <= high:
            raise _range_error(value, kind, low, high)
        out += prefix
        out += packer.pack(value)

    return encode


_e_ubyte = _packed(0x50, struct.Struct(">B"), "ubyte", 0, 0xFF)
_e_byte = _packed(0x51, struct.Struct(">b"), "byte", -128, 127)
_e_ushort = _packed(0x60, _U16, "ushort", 0, 0xFFFF)
_e_short = _packed(0x61, _I16, "short", -(2**15), 2**15 - 1)
_e_timestamp = _packed(0x83, _I64, "timestamp", _INT64_MIN, _INT64_MAX)


def _e_double(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, float)
    out.append(0x82)
    out += _F64.pack(value)


def _e_float32(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, float)
    try:
        packed = _F32.pack(value)
    except (OverflowError, struct.error):
        raise AMQPEncodeError(f"{value!r} does not fit an AMQP float (binary32)") from None
    out.append(0x72)
    out += packed


def _char_bytes(value: object) -> bytes:
    if not isinstance(value, str) or len(value) != 1 or 0xD800 <= ord(value) <= 0xDFFF:
        raise AMQPEncodeError(f"a char is one Unicode scalar value, not {value!r}")
    return _U32.pack(ord(value))


def _e_char(out: bytearray, value: object, depth: int) -> None:
    out.append(0x73)
    out += _char_bytes(value)


def _decimal(code: int, width: int) -> _Encoder:
    prefix = bytes((code,))

    def encode(out: bytearray, value: object, depth: int) -> None:
        assert isinstance(value, bytes)
        if len(value) != width:
            raise AMQPEncodeError(f"a decimal{width * 8} is {width} bytes, not {len(value)}")
        out += prefix
        out += value

    return encode


def _e_uuid(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, uuid.UUID)
    out.append(0x98)
    out += value.bytes


def _put_variable(out: bytearray, code8: int, raw: bytes | bytearray | memoryview) -> None:
    """Write a binary, string or symbol body with its 8- or 32-bit length."""
    size = len(raw)
    if size <= 0xFF:
        out.append(code8)
        out.append(size)
    elif size <= _UINT32_MAX:
        out.append(code8 | 0x10)
        out += _U32.pack(size)
    else:
        raise AMQPEncodeError(f"{size} bytes do not fit a 32-bit length")
    out += raw


def _utf8(value: object) -> bytes:
    assert isinstance(value, str)
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AMQPEncodeError(f"string is not valid Unicode text: {exc.reason}") from None


def _ascii(value: object) -> bytes:
    assert isinstance(value, str)
    try:
        return value.encode("ascii")
    except UnicodeEncodeError:
        raise AMQPEncodeError(f"a symbol is ASCII text, not {value!r}") from None


def _e_binary(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, bytes | bytearray | memoryview)
    _put_variable(out, 0xA0, value)


def _e_string(out: bytearray, value: object, depth: int) -> None:
    _put_variable(out, 0xA1, _utf8(value))


def _e_symbol(out: bytearray, value: object, depth: int) -> None:
    _put_variable(out, 0xA3, _ascii(value))


def _check_depth(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise AMQPEncodeError(f"values nested deeper than {MAX_DEPTH}")
    return depth + 1


def _put_compound(out: bytearray, code8: int, count: int, payload: bytes | bytearray) -> None:
    """Write a list, map or array header in the 8-bit form when it fits, then its payload."""
    size = len(payload)
    if count <= 0xFF and size < 0xFF:
        out += bytes((code8, size + 1, count))
    elif size <= _UINT32_MAX - 4 and count <= _UINT32_MAX:
        out.append(code8 | 0x10)
        out += _U32X2.pack(size + 4, count)
    else:
        raise AMQPEncodeError(f"a compound of {size} bytes does not fit a 32-bit size")
    out += payload


def _e_list(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, Sequence)
    if not value:
        out.append(0x45)
        return
    inner = _check_depth(depth)
    payload = bytearray()
    for item in value:
        _encode(payload, item, inner)
    _put_compound(out, 0xC0, len(value), payload)


def _map_payload(
    value: Mapping[Any, Any], depth: int, key_encoder: _Encoder | None = None
) -> bytearray:
    inner = _check_depth(depth)
    payload = bytearray()
    for key, item in value.items():
        if key_encoder is None:
            _encode(payload, key, inner)
        else:
            key_encoder(payload, key, inner)
        _encode(payload, item, inner)
    return payload


def _e_map(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, Mapping)
    _put_compound(out, 0xC1, 2 * len(value), _map_payload(value, depth))


def _e_described(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, Described)
    inner = _check_depth(depth)
    out.append(0x00)
    _encode_descriptor(out, value.descriptor, inner)
    _encode(out, value.value, inner)


def _encode_descriptor(out: bytearray, descriptor: object, depth: int) -> None:
    """Write a descriptor: plain ints as ulongs and plain strings as symbols."""
    if type(descriptor) is int:
        _e_ulong(out, descriptor, depth)
    elif type(descriptor) is str:
        _e_symbol(out, descriptor, depth)
    else:
        _encode(out, descriptor, depth)


# Array elements: each AMQP type has one element writer (no constructor) and
# its constructors; fixed widths use one constructor, variable widths and
# compounds the 8-bit one when every element fits it, else the 32-bit one.


_ElementWriter: TypeAlias = Callable[[bytearray, object, int], None]


def _fixed_element(packer: struct.Struct, check: Callable[[object], object]) -> _ElementWriter:
    def write(out: bytearray, value: object, depth: int) -> None:
        checked = check(value)
        try:
            out += packer.pack(checked)
        except (struct.error, OverflowError):
            raise AMQPEncodeError(f"{value!r} does not fit its array element type") from None

    return write


def _need(*types: type) -> Callable[[object], object]:
    def check(value: object) -> object:
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise AMQPEncodeError(f"array element {value!r} is not a {types[0].__name__}")
        return value

    return check


_ARRAY_FIXED: Final[dict[str, tuple[int, _ElementWriter]]] = {
    "boolean": (0x56, _fixed_element(struct.Struct(">?"), _need(bool))),
    "ubyte": (0x50, _fixed_element(struct.Struct(">B"), _need(int))),
    "ushort": (0x60, _fixed_element(_U16, _need(int))),
    "uint": (0x70, _fixed_element(_U32, _need(int))),
    "ulong": (0x80, _fixed_element(_U64, _need(int))),
    "byte": (0x51, _fixed_element(struct.Struct(">b"), _need(int))),
    "short": (0x61, _fixed_element(_I16, _need(int))),
    "int": (0x71, _fixed_element(_I32, _need(int))),
    "long": (0x81, _fixed_element(_I64, _need(int))),
    "timestamp": (0x83, _fixed_element(_I64, _need(int))),
    "float": (0x72, _fixed_element(_F32, _need(float, int))),
    "double": (0x82, _fixed_element(_F64, _need(float, int))),
}


def _array_payload(array: Array, depth: int) -> tuple[int, bytearray]:
    """Encode an array's constructor and elements; return its count and payload."""
    inner = _check_depth(depth)
    payload = bytearray()
    if array.descriptor is not None:
        payload.append(0x00)
        _encode_descriptor(payload, array.descriptor, inner)
    items = array.items
    kind = array.element_type
    if kind in _ARRAY_FIXED:
        code, write = _ARRAY_FIXED[kind]
        payload.append(code)
        for item in items:
            write(payload, item, inner)
    elif kind == "null":
        if any(item is not None for item in items):
            raise AMQPEncodeError("an array of nulls holds only None")
        payload.append(0x40)
    elif kind in ("decimal32", "decimal64", "decimal128", "uuid", "char"):
        _fixed_raw_elements(payload, kind, items)
    elif kind in ("binary", "string", "symbol"):
        _variable_elements(payload, kind, items)
    elif kind in ("list", "map", "array"):
        _compound_elements(payload, kind, items, inner)
    else:
        raise AMQPEncodeError(f"{kind!r} is not an AMQP array element type")
    return len(items), payload


def _fixed_raw_elements(payload: bytearray, kind: str, items: tuple[Value, ...]) -> None:
    if kind == "uuid":
        payload.append(0x98)
        for item in items:
            if not isinstance(item, uuid.UUID):
                raise AMQPEncodeError(f"array element {item!r} is not a uuid.UUID")
            payload += item.bytes
    elif kind == "char":
        payload.append(0x73)
        for item in items:
            payload += _char_bytes(item)
    else:
        code, width = {"decimal32": (0x74, 4), "decimal64": (0x84, 8), "decimal128": (0x94, 16)}[
            kind
        ]
        payload.append(code)
        for item in items:
            if not isinstance(item, bytes) or len(item) != width:
                raise AMQPEncodeError(f"array element {item!r} is not {width} bytes")
            payload += item


def _variable_elements(payload: bytearray, kind: str, items: tuple[Value, ...]) -> None:
    raws: list[bytes] = []
    for item in items:
        if kind == "binary":
            if not isinstance(item, bytes):
                raise AMQPEncodeError(f"array element {item!r} is not binary")
            raws.append(item)
        elif not isinstance(item, str):
            raise AMQPEncodeError(f"array element {item!r} is not a {kind}")
        else:
            raws.append(_utf8(item) if kind == "string" else _ascii(item))
    wide = any(len(raw) > 0xFF for raw in raws)
    payload.append({"binary": 0xA0, "string": 0xA1, "symbol": 0xA3}[kind] | (0x10 if wide else 0))
    for raw in raws:
        if wide:
            if len(raw) > _UINT32_MAX:
                raise AMQPEncodeError(f"{len(raw)} bytes do not fit a 32-bit length")
            payload += _U32.pack(len(raw))
        else:
            payload.append(len(raw))
        payload += raw


def _compound_elements(payload: bytearray, kind: str, items: tuple[Value, ...], depth: int) -> None:
    parts: list[tuple[int, bytearray]] = []
    for item in items:
        if kind == "list" and isinstance(item, list | tuple):
            inner = _check_depth(depth)
            body = bytearray()
            for element in item:
                _encode(body, element, inner)
            parts.append((len(item), body))
        elif kind == "map" and isinstance(item, Mapping):
            parts.append((2 * len(item), _map_payload(item, depth)))
        elif kind == "array" and isinstance(item, Array):
            parts.append(_array_payload(item, depth))
        else:
            raise AMQPEncodeError(f"array element {item!r} is not a {kind}")
    code8 = {"list": 0xC0, "map": 0xC1, "array": 0xE0}[kind]
    wide = any(count > 0xFF or len(body) >= 0xFF for count, body in parts)
    payload.append(code8 | (0x10 if wide else 0))
    for count, body in parts:
        if wide:
            if len(body) > _UINT32_MAX - 4 or count > _UINT32_MAX:
                raise AMQPEncodeError(f"a compound of {len(body)} bytes does not fit")
            payload += _U32X2.pack(len(body) + 4, count)
        else:
            payload += bytes((len(body) + 1, count))
        payload += body


def _e_array(out: bytearray, value: object, depth: int) -> None:
    assert isinstance(value, Array)
    count, payload = _array_payload(value, depth)
    _put_compound(out, 0xE0, count, payload)


_ENCODERS: Final[dict[type, _Encoder]] = {
    type(None): _e_null,
    bool: _e_bool,
    int: _e_int,
    float: _e_double,
    str: _e_string,
    bytes: _e_binary,
    bytearray: _e_binary,
    memoryview: _e_binary,
    list: _e_list,
    tuple: _e_list,
    dict: _e_map,
    uuid.UUID: _e_uuid,
    Symbol: _e_symbol,
    Char: _e_char,
    UByte: _e_ubyte,
    UShort: _e_ushort,
    UInt: _e_uint,
    ULong: _e_ulong,
    Byte: _e_byte,
    Short: _e_short,
    Long: _e_long,
    Timestamp: _e_timestamp,
    Float32: _e_float32,
    Decimal32: _decimal(0x74, 4),
    Decimal64: _decimal(0x84, 8),
    Decimal128: _decimal(0x94, 16),
    Array: _e_array,
    Described: _e_described,
}


def _encode(out: bytearray, value: object, depth: int) -> None:
    encoder = _ENCODERS.get(type(value))
    if encoder is None:
        encoder = _encoder_for_subclass(value)
    encoder(out, value, depth)


def _encoder_for_subclass(value: object) -> _Encoder:
    for base in type(value).__mro__[1:]:
        if base in _ENCODERS and base is not object:
            return _ENCODERS[base]
    if isinstance(value, Mapping):
        return _e_map
    raise AMQPEncodeError(f"no AMQP encoding for a value of type {type(value).__name__}")


def encode_value(value: object) -> bytes:
    """Encode one AMQP value (see the module docstring for the type mapping).

    Raises:
        AMQPEncodeError: The value has no AMQP encoding, is out of range or
            nests deeper than `MAX_DEPTH`.
    """
    out = bytearray()
    _encode(out, value, 0)
    return bytes(out)


# Section prefixes: 0x00, smallulong descriptor (rstream's form).
_PREFIX: Final = {code: bytes((0x00, 0x53, code)) for code in _SECTION_NAMES}


def _e_annotation_key(out: bytearray, key: object, depth: int) -> None:
    # Annotation keys are symbols or ulongs (part 3, section 3.2.10): plain
    # strings become symbols and plain ints ulongs, as rstream writes them.
    if isinstance(key, str) and type(key) is not Char:
        _e_symbol(out, key, depth)
    elif isinstance(key, int) and not isinstance(key, bool):
        _e_ulong(out, key, depth)
    else:
        raise AMQPEncodeError(f"annotation key {key!r} is not a symbol or ulong")


def _e_section_annotations(out: bytearray, code: int, value: Mapping[Value, Value]) -> None:
    out += _PREFIX[code]
    _put_compound(out, 0xC1, 2 * len(value), _map_payload(value, 1, _e_annotation_key))


_NOT_SIMPLE_TO_SEND: Final = (*_NOT_SIMPLE, tuple, Mapping)


def _e_application_properties(out: bytearray, value: Mapping[str, Value]) -> None:
    payload = bytearray()
    append = payload.append
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            raise AMQPEncodeError(f"application-properties key {key!r} is not a string")
        raw = _utf8(key)
        if len(raw) <= 0xFF:  # str8 keys and values written in line: the common case
            append(0xA1)
            append(len(raw))
            payload += raw
        else:
            _put_variable(payload, 0xA1, raw)
        if type(item) is str:
            raw = _utf8(item)
            if len(raw) <= 0xFF:
                append(0xA1)
                append(len(raw))
                payload += raw
            else:
                _put_variable(payload, 0xA1, raw)
        elif isinstance(item, _NOT_SIMPLE_TO_SEND):
            # Part 3, section 3.2.5: values are restricted to simple types.
            raise AMQPEncodeError(f"application property {key!r} is a {_kind(item)}")
        else:
            _encode(payload, item, 2)
    out += _PREFIX[_APPLICATION_PROPERTIES]
    _put_compound(out, 0xC1, 2 * len(value), payload)


def _e_record(
    out: bytearray, code: int, values: tuple[object, ...], encoders: tuple[_Encoder, ...]
) -> None:
    """Write a composite section's list, trailing nulls dropped (part 1, section 1.4)."""
    count = len(values)
    while count and values[count - 1] is None:
        count -= 1
    out += _PREFIX[code]
    if not count:
        out.append(0x45)
        return
    payload = bytearray()
    for index in range(count):
        value = values[index]
        if value is None:
            payload.append(0x40)
        else:
            encoders[index](payload, value, 2)
    _put_compound(out, 0xC0, count, payload)


def _field(encoder: _Encoder, *types: type) -> _Encoder:
    """Wrap a field encoder with the Python types its field accepts."""
    wanted = " or ".join(t.__name__ for t in types)
    takes_bool = bool in types

    def encode(out: bytearray, value: object, depth: int) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and not takes_bool):
            raise AMQPEncodeError(f"field value {value!r} is not {wanted}")
        encoder(out, value, depth)

    return encode


def _e_message_id(out: bytearray, value: object, depth: int) -> None:
    if isinstance(value, str):
        _e_string(out, value, depth)
    elif isinstance(value, int) and not isinstance(value, bool):
        _e_ulong(out, value, depth)
    elif isinstance(value, bytes | uuid.UUID):
        _encode(out, value, depth)
    else:
        raise AMQPEncodeError(f"a message id is a ulong, uuid, binary or string, not {value!r}")


_HEADER_GETTER: Final = operator.attrgetter(*(name for name, _ in _HEADER_LAYOUT))
_HEADER_ENCODERS: Final = (
    _field(_e_bool, bool),
    _field(_e_ubyte, int),
    _field(_e_uint, int),
    _field(_e_bool, bool),
    _field(_e_uint, int),
)
_PROPERTIES_GETTER: Final = operator.attrgetter(*(name for name, _ in _PROPERTIES_LAYOUT))
_PROPERTIES_ENCODERS: Final = (
    _e_message_id,  # message-id
    _field(_e_binary, bytes),  # user-id
    _field(_e_string, str),  # to
    _field(_e_string, str),  # subject
    _field(_e_string, str),  # reply-to
    _e_message_id,  # correlation-id
    _field(_e_symbol, str),  # content-type
    _field(_e_symbol, str),  # content-encoding
    _field(_e_timestamp, int),  # absolute-expiry-time
    _field(_e_timestamp, int),  # creation-time
    _field(_e_string, str),  # group-id
    _field(_e_uint, int),  # group-sequence
    _field(_e_string, str),  # reply-to-group-id
)


def _e_body(out: bytearray, body: Body) -> None:
    if isinstance(body, bytes | bytearray | memoryview):
        out += _PREFIX[_DATA]
        _put_variable(out, 0xA0, body)
    elif isinstance(body, AMQPValue):
        out += _PREFIX[_VALUE]
        _encode(out, body.value, 1)
    elif isinstance(body, AMQPSequence):
        if not body.sections:
            raise AMQPEncodeError("an amqp-sequence body has at least one section")
        for section in body.sections:
            if not isinstance(section, list | tuple):
                raise AMQPEncodeError(f"an amqp-sequence section is a list, not {section!r}")
            out += _PREFIX[_SEQUENCE]
            _encode(out, section, 1)
    elif body is not None:
        raise AMQPEncodeError(f"a body is bytes, AMQPValue or AMQPSequence, not {body!r}")


def encode_message(message: AMQPMessage) -> bytes:
    """Encode a message, its sections in the order of part 3, section 3.2.

    Compact forms throughout, as rstream writes them: smallulong section
    descriptors; str8, vbin8, list8 and map8 when they fit; smallint,
    smallulong and uint0-style forms for small numbers; header and properties
    lists without their trailing nulls (rstream keeps all slots; both decode
    the same). A data body is one data section, even when empty.

    Raises:
        AMQPEncodeError: A section or value cannot be encoded as given.
    """
    out = bytearray()
    if message.header is not None:
        _e_record(out, _HEADER, _HEADER_GETTER(message.header), _HEADER_ENCODERS)
    if message.delivery_annotations is not None:
        _e_section_annotations(out, _DELIVERY_ANNOTATIONS, message.delivery_annotations)
    if message.message_annotations is not None:
        _e_section_annotations(out, _MESSAGE_ANNOTATIONS, message.message_annotations)
    if message.properties is not None:
        values = _PROPERTIES_GETTER(message.properties)
        _e_record(out, _PROPERTIES, values, _PROPERTIES_ENCODERS)
    if message.application_properties is not None:
        _e_application_properties(out, message.application_properties)
    _e_body(out, message.body)
    if message.footer is not None:
        _e_section_annotations(out, _FOOTER, message.footer)
    if not out:
        # An empty entry is not an AMQP message (`decode_message` refuses it).
        raise AMQPEncodeError("a message needs at least one section")
    return bytes(out)
