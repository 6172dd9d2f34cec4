"""Decoding AMQP 1.0 values and messages (part 1, section 1.6; part 3, section 3.2)."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable
from typing import Any, Final, TypeAlias, TypeVar

from gateway.codecs.amqp.values import (
    _ANNOTATION_KEY_TYPES,
    _APPLICATION_PROPERTIES,
    _DATA,
    _DELIVERY_ANNOTATIONS,
    _F32,
    _F64,
    _FOOTER,
    _HEADER,
    _HEADER_LAYOUT,
    _I16,
    _I32,
    _I64,
    _MESSAGE_ANNOTATIONS,
    _NOT_SIMPLE,
    _PROPERTIES,
    _PROPERTIES_LAYOUT,
    _SECTION_NAMES,
    _SECTION_SYMBOL_BYTES,
    _SECTION_SYMBOLS,
    _SEQUENCE,
    _U16,
    _U32,
    _U32X2,
    _U64,
    _VALUE,
    MAX_DEPTH,
    AMQPDecodeError,
    AMQPMessage,
    AMQPSequence,
    AMQPValue,
    Array,
    ArrayType,
    Body,
    Byte,
    Char,
    Decimal32,
    Decimal64,
    Decimal128,
    Described,
    Float32,
    Header,
    Long,
    Properties,
    Short,
    Symbol,
    Timestamp,
    UByte,
    UInt,
    ULong,
    UShort,
    Value,
    _kind,
    _Layout,
)

__all__ = ["decode_message", "decode_value", "looks_like_amqp"]

# --- decoding --------------------------------------------------------------------

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
