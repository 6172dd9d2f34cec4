"""AMQP 1.0 values, message sections and errors: the types both directions share."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

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


_U16: Final = struct.Struct(">H")
_I16: Final = struct.Struct(">h")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")
_F32: Final = struct.Struct(">f")
_F64: Final = struct.Struct(">d")
_U32X2: Final = struct.Struct(">II")
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


def _kind(value: object) -> str:
    return type(value).__name__
