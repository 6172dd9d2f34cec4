"""Encoding AMQP 1.0 values and messages: what `decoding` reads, written back."""

from __future__ import annotations

import operator
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

from gateway.codecs.amqp.values import (
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
    _SEQUENCE,
    _U16,
    _U32,
    _U32X2,
    _U64,
    _VALUE,
    MAX_DEPTH,
    AMQPEncodeError,
    AMQPMessage,
    AMQPSequence,
    AMQPValue,
    Array,
    Body,
    Byte,
    Char,
    Decimal32,
    Decimal64,
    Decimal128,
    Described,
    Float32,
    Long,
    Short,
    Symbol,
    Timestamp,
    UByte,
    UInt,
    ULong,
    UShort,
    Value,
    _kind,
)

__all__ = ["encode_message", "encode_value"]

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
