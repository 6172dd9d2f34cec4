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

from gateway.codecs.amqp.decoding import (
    decode_message,
    decode_value,
    looks_like_amqp,
)
from gateway.codecs.amqp.encoding import (
    encode_message,
    encode_value,
)
from gateway.codecs.amqp.values import (
    MAX_DEPTH,
    AMQPDecodeError,
    AMQPEncodeError,
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
)

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
