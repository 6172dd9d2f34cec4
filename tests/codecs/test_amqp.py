"""Tests for `gateway.codecs.amqp`, AMQP 1.0 messages as RabbitMQ streams store them.

The byte examples are those of docs/stream-protocol-notes.md, section 12
(produced by rstream's encoder), decoded and re-encoded; then every
primitive type code of AMQP 1.0 part 1, arrays and described values, the
section rules of part 3, every refusal (truncation, oversize lengths, bad
codes, nesting), hypothesis round trips and garbage, and interoperation
with rstream, a client we did not write, both ways. Entries are whole (the
stream protocol frames them), so there is no split check: the truncation
tests cover every cut of a message instead.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.codecs.amqp import (
    MAX_DEPTH,
    AMQPDecodeError,
    AMQPEncodeError,
    AMQPMessage,
    AMQPSequence,
    AMQPValue,
    Array,
    ArrayType,
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
    decode_message,
    decode_value,
    encode_message,
    encode_value,
    looks_like_amqp,
)
from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError

try:
    import rstream
except ImportError:  # pragma: no cover - the interop tests say why they skip
    rstream = None

needs_rstream = pytest.mark.skipif(
    rstream is None,
    reason="rstream is not installed (pip install rstream): the interop tests need "
    "an AMQP encoder and decoder we did not write",
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def h(text: str) -> bytes:
    """Bytes from a hex dump with spaces, as the notes write them."""
    return bytes.fromhex(text)


def canonical(data: bytes) -> bytes:
    """Decode and re-encode a message: our encoding of what the bytes say."""
    return encode_message(decode_message(data))


# --- the notes' byte examples (section 12) --------------------------------------------

HELLO = h("00 53 75 a0 05 68 65 6c 6c 6f")
X_BODY = h("00 53 75 a0 01 78")

# (name, rstream's bytes from the notes, the message they decode to, our
# bytes when our encoder chooses differently, else None)
NOTES_EXAMPLES: list[tuple[str, bytes, AMQPMessage, bytes | None]] = [
    ("body only", HELLO, AMQPMessage(body=b"hello"), None),
    (
        "body and application properties",
        h("00 53 74 c1 0c 04 a1 01 6b a1 01 76 a1 01 6e 54 01") + HELLO,
        AMQPMessage(application_properties={"k": "v", "n": 1}, body=b"hello"),
        None,
    ),
    (
        "string message id, application properties and body",
        h("00 53 73 c0 13 0d a1 04 69 64 2d 31 40 40 40 40 40 40 40 40 40 40 40 40")
        + h("00 53 74 c1 07 02 a1 01 6b a1 01 76")
        + HELLO,
        AMQPMessage(
            properties=Properties(message_id="id-1"),
            application_properties={"k": "v"},
            body=b"hello",
        ),
        h("00 53 73 c0 07 01 a1 04 69 64 2d 31") + h("00 53 74 c1 07 02 a1 01 6b a1 01 76") + HELLO,
    ),
    (
        "ulong message id and body",
        h("00 53 73 c0 0f 0d 53 07 40 40 40 40 40 40 40 40 40 40 40 40  00 53 75 a0 02 68 69"),
        AMQPMessage(properties=Properties(message_id=7), body=b"hi"),
        h("00 53 73 c0 03 01 53 07  00 53 75 a0 02 68 69"),
    ),
    (
        "amqp-value string",
        h("00 53 77 a1 05 68 65 6c 6c 6f"),
        AMQPMessage(body=AMQPValue("hello")),
        None,
    ),
    (
        "durable header, message annotations and body",
        h("00 53 70 c0 07 05 56 01 40 40 40 40")
        + h("00 53 72 c1 0b 02 a3 05 78 2d 6f 70 74 a1 01 61")
        + X_BODY,
        AMQPMessage(header=Header(durable=True), message_annotations={"x-opt": "a"}, body=b"x"),
        h("00 53 70 c0 03 01 56 01")
        + h("00 53 72 c1 0b 02 a3 05 78 2d 6f 70 74 a1 01 61")
        + X_BODY,
    ),
    (
        "300-byte body",
        h("00 53 75 b0 00 00 01 2c") + b"x" * 300,
        AMQPMessage(body=b"x" * 300),
        None,
    ),
    (
        "application properties of several types",
        h("00 53 74 c1 2f 0a a1 01 62 56 01 a1 01 6c 81 00 00 01 00 00 00 00 00")
        + h(
            "a1 01 66 82 3f f8 00 00 00 00 00 00 a1 03 6e 65 67 54 fb a1 03 62 69 67 71 00 00 03 e8"
        )
        + X_BODY,
        AMQPMessage(
            application_properties={"b": True, "l": 2**40, "f": 1.5, "neg": -5, "big": 1000},
            body=b"x",
        ),
        None,
    ),
    (
        "binary message id, content type and creation time",
        h("00 53 73 c0 24 0d a0 02 01 02 40 40 40 40 40 a3 0a 74 65 78 74 2f 70 6c 61 69 6e 40 40")
        + h("83 00 00 01 8b cf e5 68 00 40 40 40")
        + X_BODY,
        AMQPMessage(
            properties=Properties(
                message_id=b"\x01\x02", content_type="text/plain", creation_time=1700000000000
            ),
            body=b"x",
        ),
        h("00 53 73 c0 21 0a a0 02 01 02 40 40 40 40 40 a3 0a 74 65 78 74 2f 70 6c 61 69 6e 40 40")
        + h("83 00 00 01 8b cf e5 68 00")
        + X_BODY,
    ),
]


@pytest.mark.parametrize(
    ("rstream_bytes", "expected"),
    [(data, message) for _, data, message, _ in NOTES_EXAMPLES],
    ids=[name for name, *_ in NOTES_EXAMPLES],
)
def test_notes_examples_decode(rstream_bytes: bytes, expected: AMQPMessage) -> None:
    """Every message of the notes, as rstream writes it, decodes to the values it carries.

    From bytes, a bytearray, a memoryview and a non-contiguous memoryview alike.
    """
    assert looks_like_amqp(rstream_bytes)
    assert decode_message(rstream_bytes) == expected
    assert decode_message(memoryview(rstream_bytes)) == expected
    assert decode_message(bytearray(rstream_bytes)) == expected
    strided = bytearray(2 * len(rstream_bytes))
    strided[::2] = rstream_bytes
    assert decode_message(memoryview(strided)[::2]) == expected


@pytest.mark.parametrize(
    ("rstream_bytes", "expected", "ours"),
    [(data, message, ours or data) for _, data, message, ours in NOTES_EXAMPLES],
    ids=[name for name, *_ in NOTES_EXAMPLES],
)
def test_notes_examples_encode(rstream_bytes: bytes, expected: AMQPMessage, ours: bytes) -> None:
    """Our encoder writes rstream's bytes, except that header and properties lose trailing nulls.

    The compact list decodes to the same message as rstream's 13-slot (or
    5-slot) list, so both decode paths are checked.
    """
    assert encode_message(expected) == ours
    assert canonical(rstream_bytes) == ours
    assert decode_message(ours) == expected


def test_notes_examples_keep_types() -> None:
    """Decoded values carry their AMQP types: ulong id, symbol content type, timestamp, long."""
    seven = decode_message(NOTES_EXAMPLES[3][1]).properties
    assert seven is not None
    assert type(seven.message_id) is ULong
    typed = decode_message(NOTES_EXAMPLES[8][1]).properties
    assert typed is not None
    assert type(typed.content_type) is Symbol
    assert type(typed.creation_time) is Timestamp
    props = decode_message(NOTES_EXAMPLES[7][1]).application_properties
    assert props is not None
    assert [type(props[key]) for key in ("b", "l", "f", "neg", "big")] == [
        bool,
        Long,
        float,
        int,
        int,
    ]


# --- primitive types (part 1, section 1.6) ---------------------------------------------

# (wire bytes, decoded value, its Python type, our encoding when it differs)
PRIMITIVES: list[tuple[str, Value, type, str | None]] = [
    ("40", None, type(None), None),
    ("41", True, bool, "56 01"),
    ("42", False, bool, "56 00"),
    ("56 01", True, bool, None),
    ("56 00", False, bool, None),
    ("43", 0, UInt, None),
    ("44", 0, ULong, None),
    ("45", [], list, None),
    ("50 ff", 255, UByte, None),
    ("51 80", -128, Byte, None),
    ("52 07", 7, UInt, None),
    ("53 07", 7, ULong, None),
    ("54 fb", -5, int, None),
    ("55 fb", -5, Long, None),
    ("60 ff fe", 65534, UShort, None),
    ("61 80 00", -32768, Short, None),
    ("70 00 00 01 00", 256, UInt, None),
    ("70 00 00 00 05", 5, UInt, "52 05"),
    ("70 00 00 00 00", 0, UInt, "43"),
    ("71 ff ff ff 00", -256, int, None),
    ("71 00 00 00 05", 5, int, "54 05"),
    ("72 3f c0 00 00", 1.5, Float32, None),
    ("73 00 01 f6 00", "\U0001f600", Char, None),
    ("74 22 50 00 01", b"\x22\x50\x00\x01", Decimal32, None),
    ("80 00 00 00 01 00 00 00 00", 2**32, ULong, None),
    ("80 ff ff ff ff ff ff ff ff", 2**64 - 1, ULong, None),
    ("80 00 00 00 00 00 00 00 05", 5, ULong, "53 05"),
    ("81 ff ff ff ff ff ff ff ff", -1, Long, "55 ff"),
    ("81 80 00 00 00 00 00 00 00", -(2**63), Long, None),
    ("82 3f f8 00 00 00 00 00 00", 1.5, float, None),
    ("83 00 00 01 8b cf e5 68 00", 1700000000000, Timestamp, None),
    ("83 ff ff ff ff ff ff ff ff", -1, Timestamp, None),
    ("84 01 02 03 04 05 06 07 08", bytes(range(1, 9)), Decimal64, None),
    ("94 " + "01 " * 16, b"\x01" * 16, Decimal128, None),
    (
        "98 12 34 56 78 12 34 56 78 12 34 56 78 12 34 56 78",
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        uuid.UUID,
        None,
    ),
    ("a0 03 61 62 63", b"abc", bytes, None),
    ("a0 00", b"", bytes, None),
    ("b0 00 00 00 03 61 62 63", b"abc", bytes, "a0 03 61 62 63"),
    ("a1 02 c3 a9", "\u00e9", str, None),
    ("b1 00 00 00 02 c3 a9", "\u00e9", str, "a1 02 c3 a9"),
    ("a3 03 66 6f 6f", "foo", Symbol, None),
    ("b3 00 00 00 03 66 6f 6f", "foo", Symbol, "a3 03 66 6f 6f"),
    ("c0 03 02 40 41", [None, True], list, "c0 04 02 40 56 01"),
    ("c0 01 00", [], list, "45"),
    ("d0 00 00 00 06 00 00 00 01 54 01", [1], list, "c0 03 01 54 01"),
    ("c1 05 02 a3 01 6b 40", {"k": None}, dict, None),
    ("c1 01 00", {}, dict, None),
    ("d1 00 00 00 09 00 00 00 02 a1 01 6b 54 01", {"k": 1}, dict, "c1 06 02 a1 01 6b 54 01"),
    ("00 53 01 a1 01 78", Described(1, "x"), Described, None),
    ("00 a3 03 66 6f 6f 40", Described("foo", None), Described, None),
]


@pytest.mark.parametrize(
    ("wire", "value", "python_type", "ours"), PRIMITIVES, ids=[p[0][:20] for p in PRIMITIVES]
)
def test_primitive_types(wire: str, value: Value, python_type: type, ours: str | None) -> None:
    """Each type code decodes to its value and Python type, and encodes to the compact form."""
    decoded = decode_value(h(wire))
    assert decoded == value
    assert type(decoded) is python_type
    assert encode_value(decoded) == h(ours or wire)
    assert decode_value(h(ours or wire)) == value


def test_described_descriptors_keep_their_types() -> None:
    """A numeric descriptor decodes as a ulong, a symbolic one as a symbol."""
    numeric = decode_value(h("00 53 01 a1 01 78"))
    assert isinstance(numeric, Described)
    assert type(numeric.descriptor) is ULong
    symbolic = decode_value(h("00 a3 03 66 6f 6f 40"))
    assert isinstance(symbolic, Described)
    assert type(symbolic.descriptor) is Symbol
    assert decode_value(h("00 00 53 01 54 02 40")) == Described(Described(1, 2), None)


def test_described_descriptor_plain_values_encode_as_ulong_and_symbol() -> None:
    """A plain int descriptor is sent as a ulong and a plain string as a symbol."""
    assert encode_value(Described(0x75, b"")) == h("00 53 75 a0 00")
    assert (
        encode_value(Described("amqp:data:binary", b"")) == b"\x00\xa3\x10amqp:data:binary\xa0\x00"
    )
    assert encode_value(Described(2**40, None)) == h("00 80 00 00 01 00 00 00 00 00 40")


def test_plain_integers_take_the_smallest_signed_form() -> None:
    """Plain ints are smallint, int, long, then ulong, as rstream writes them."""
    assert encode_value(127) == h("54 7f")
    assert encode_value(-128) == h("54 80")
    assert encode_value(128) == h("71 00 00 00 80")
    assert encode_value(2**31) == h("81 00 00 00 00 80 00 00 00")
    assert encode_value(2**63) == h("80 80 00 00 00 00 00 00 00")
    assert encode_value(Long(5)) == h("55 05")
    assert encode_value(UInt(2**32 - 1)) == h("70 ff ff ff ff")


def test_other_python_values_encode() -> None:
    """Tuples are lists, bytearrays and memoryviews binaries, any mapping a map."""
    assert encode_value((1, "a")) == h("c0 06 02 54 01 a1 01 61")
    assert encode_value(bytearray(b"ab")) == h("a0 02 61 62")
    assert encode_value(memoryview(b"ab")) == h("a0 02 61 62")

    class Text(str):
        """A str subclass the encoder does not know by name."""

    assert encode_value(Text("a")) == h("a1 01 61")
    from types import MappingProxyType

    assert encode_value(MappingProxyType({"a": 1})) == h("c1 06 02 a1 01 61 54 01")


def test_long_variable_values_use_32_bit_lengths() -> None:
    """Strings, binaries and symbols past 255 bytes switch to the 32-bit forms."""
    assert encode_value("x" * 256)[:5] == h("b1 00 00 01 00")
    assert encode_value(b"x" * 255)[:2] == h("a0 ff")
    assert encode_value(Symbol("x" * 256))[:5] == h("b3 00 00 01 00")
    for value in ("x" * 256, b"x" * 70000, Symbol("s" * 300)):
        assert decode_value(encode_value(value)) == value


def test_compounds_switch_to_32_bit_forms_when_they_must() -> None:
    """A list or map whose payload reaches 255 bytes or 256 elements is sent in its 32-bit form."""
    assert encode_value([None] * 254)[:3] == h("c0 ff fe")
    assert encode_value([None] * 255)[:1] == h("d0")
    assert encode_value([None] * 256)[:9] == h("d0 00 00 01 04 00 00 01 00")
    big = {str(i): i for i in range(200)}
    assert encode_value(big)[:1] == h("d1")
    assert decode_value(encode_value(big)) == big


def test_typed_values_round_trip_their_encoding() -> None:
    """Decoding keeps the AMQP type, so that re-encoding writes the same bytes."""
    for value in (UByte(1), UShort(2), UInt(3), ULong(4), Byte(-1), Short(-2), Long(-3)):
        data = encode_value(value)
        assert encode_value(decode_value(data)) == data
        assert type(decode_value(data)) is type(value)


# --- arrays ------------------------------------------------------------------------------

ARRAYS: list[tuple[str, Array, str | None]] = [
    (
        "e0 05 03 54 01 02 03",
        Array("int", (1, 2, 3)),
        "e0 0e 03 71 00 00 00 01 00 00 00 02 00 00 00 03",
    ),
    (
        "f0 00 00 00 09 00 00 00 02 a1 01 61 01 62",
        Array("string", ("a", "b")),
        "e0 06 02 a1 01 61 01 62",
    ),
    ("e0 06 02 a3 01 61 01 62", Array("symbol", (Symbol("a"), Symbol("b"))), None),
    ("e0 04 02 56 01 00", Array("boolean", (True, False)), None),
    ("e0 02 03 41", Array("boolean", (True, True, True)), "e0 05 03 56 01 01 01"),
    ("e0 02 02 40", Array("null", (None, None)), None),
    ("e0 02 02 43", Array("uint", (0, 0)), "e0 0a 02 70 00 00 00 00 00 00 00 00"),
    ("e0 02 02 45", Array("list", ([], [])), "e0 06 02 c0 01 00 01 00"),
    ("e0 04 02 52 01 02", Array("uint", (1, 2)), "e0 0a 02 70 00 00 00 01 00 00 00 02"),
    ("e0 04 02 50 01 02", Array("ubyte", (1, 2)), None),
    ("e0 02 00 a1", Array("string"), None),
    ("e0 01 00", Array("null"), "e0 02 00 40"),
    (
        "e0 12 02 83 00 00 00 00 00 00 00 01 ff ff ff ff ff ff ff ff",
        Array("timestamp", (Timestamp(1), Timestamp(-1))),
        None,
    ),
    (
        "e0 08 02 c0 02 01 40 02 01 41",
        Array("list", ([None], [True])),
        "e0 09 02 c0 02 01 40 03 01 56 01",
    ),
    (
        "e0 08 02 e0 02 00 40 02 00 a1",
        Array("array", (Array("null"), Array("string"))),
        None,
    ),
    ("e0 08 01 c1 05 02 a1 01 6b 40", Array("map", ({"k": None},)), None),
    (
        "e0 0a 02 00 a3 01 64 a1 01 61 01 62",
        Array("string", ("a", "b"), descriptor=Symbol("d")),
        None,
    ),
    (
        "e0 07 02 00 53 07 54 01 02",
        Array("int", (1, 2), descriptor=7),
        "e0 0d 02 00 53 07 71 00 00 00 01 00 00 00 02",
    ),
]


@pytest.mark.parametrize(("wire", "array", "ours"), ARRAYS, ids=[a[0][:24] for a in ARRAYS])
def test_arrays(wire: str, array: Array, ours: str | None) -> None:
    """Arrays decode with their element type (and shared descriptor) and re-encode.

    Described element constructors (``00 descriptor constructor``) give the
    array a descriptor. rstream's empty array without an element
    constructor (``e0 01 00``) decodes to an empty array of nulls.
    """
    decoded = decode_value(h(wire))
    assert decoded == array
    assert encode_value(decoded) == h(ours or wire)
    assert decode_value(encode_value(array)) == array


def test_array_elements_keep_their_types() -> None:
    """Elements of a uint array decode as `UInt`, of a symbol array as `Symbol`."""
    uints = decode_value(h("e0 04 02 52 01 02"))
    assert isinstance(uints, Array)
    assert {type(item) for item in uints.items} == {UInt}
    symbols = decode_value(h("e0 06 02 a3 01 61 01 62"))
    assert isinstance(symbols, Array)
    assert {type(item) for item in symbols.items} == {Symbol}


def test_array_variable_elements_widen_together() -> None:
    """One element longer than 255 bytes moves every element to the 32-bit form."""
    array = Array("binary", (b"a", b"x" * 300))
    data = encode_value(array)
    assert data[:1] == h("f0")
    assert data[9] == 0xB0
    assert decode_value(data) == array


def test_array_element_types_encode() -> None:
    """Every element type round-trips through an array."""
    arrays = [
        Array("ushort", (1, 65535)),
        Array("ulong", (0, 2**64 - 1)),
        Array("byte", (-128, 127)),
        Array("short", (-1, 2)),
        Array("long", (-(2**63), 5)),
        Array("float", (1.5, -2.0)),
        Array("double", (0.1, 2)),
        Array("decimal32", (b"abcd",)),
        Array("decimal64", (b"abcdefgh",)),
        Array("decimal128", (b"a" * 16,)),
        Array("char", ("a", "\u00e9")),
        Array("uuid", (uuid.UUID(int=1),)),
        Array("map", ({}, {"k": [1]})),
        Array("list", ([1, [2]],)),
    ]
    for array in arrays:
        assert decode_value(encode_value(array)) == array


# --- sections (part 3, section 3.2) ----------------------------------------------------


def test_all_sections_round_trip() -> None:
    """A message with every section decodes to the same message, sections in spec order."""
    message = AMQPMessage(
        header=Header(durable=True, priority=4, ttl=1000, first_acquirer=False, delivery_count=2),
        delivery_annotations={"x-opt-d": 1},
        message_annotations={"x-opt-m": "a", 7: None},
        properties=Properties(
            message_id=uuid.UUID(int=5),
            user_id=b"guest",
            to="/queues/a",
            subject="s",
            reply_to="r",
            correlation_id=2**40,
            content_type="text/plain",
            content_encoding="gzip",
            absolute_expiry_time=1,
            creation_time=2,
            group_id="g",
            group_sequence=3,
            reply_to_group_id="rg",
        ),
        application_properties={"k": "v"},
        body=b"payload",
        footer={"x-hash": b"\x00"},
    )
    data = encode_message(message)
    assert decode_message(data) == message
    one_by_one = [
        encode_message(AMQPMessage(header=message.header)),
        encode_message(AMQPMessage(delivery_annotations=message.delivery_annotations)),
        encode_message(AMQPMessage(message_annotations=message.message_annotations)),
        encode_message(AMQPMessage(properties=message.properties)),
        encode_message(AMQPMessage(application_properties=message.application_properties)),
        encode_message(AMQPMessage(body=message.body)),
        encode_message(AMQPMessage(footer=message.footer)),
    ]
    assert data == b"".join(one_by_one)
    assert [part[2] for part in one_by_one] == [0x70, 0x71, 0x72, 0x73, 0x74, 0x75, 0x78]


def test_sections_in_any_order() -> None:
    """Sections are accepted out of order: rstream writes delivery-annotations last."""
    data = X_BODY + h("00 53 71 c1 05 02 a3 01 61 40")
    assert decode_message(data) == AMQPMessage(delivery_annotations={"a": None}, body=b"x")


def test_data_sections_are_joined() -> None:
    """Several data sections make one body, in order."""
    data = h("00 53 75 a0 02 61 62 00 53 75 a0 00 00 53 75 a0 01 63")
    assert decode_message(data).body == b"abc"


def test_sequence_sections_are_kept_in_order() -> None:
    """amqp-sequence sections make an `AMQPSequence` of lists."""
    data = h("00 53 76 c0 03 01 54 01 00 53 76 45")
    assert decode_message(data) == AMQPMessage(body=AMQPSequence(([1], [])))
    assert encode_message(AMQPMessage(body=AMQPSequence(([1], [])))) == data


def test_value_body_of_any_type() -> None:
    """An amqp-value may be any value: null, binary, a map."""
    for value in (None, b"raw", {"a": [1, 2]}, Described(1, 2)):
        message = AMQPMessage(body=AMQPValue(value))
        assert decode_message(encode_message(message)) == message


def test_section_descriptors_in_all_forms() -> None:
    """A section's descriptor may be a smallulong, a ulong or a symbol (part 1, section 1.5)."""
    expected = AMQPMessage(body=b"x")
    assert decode_message(h("00 80 00 00 00 00 00 00 00 75 a0 01 78")) == expected
    assert decode_message(b"\x00\xa3\x10amqp:data:binary\xa0\x01x") == expected
    assert decode_message(b"\x00\xb3\x00\x00\x00\x10amqp:data:binary\xa0\x01x") == expected
    assert decode_message(b"\x00\xa3\x11amqp:amqp-value:*\x40") == AMQPMessage(body=AMQPValue(None))


def test_empty_sections_are_kept() -> None:
    """Present but empty sections stay present: an empty map, properties with no fields."""
    message = AMQPMessage(
        header=Header(), properties=Properties(), application_properties={}, body=b""
    )
    data = encode_message(message)
    assert data == h("00 53 70 45 00 53 73 45 00 53 74 c1 01 00 00 53 75 a0 00")
    assert decode_message(data) == message


def test_message_without_body() -> None:
    """A message with no body section decodes with body None (rstream drops empty bodies)."""
    data = h("00 53 73 c0 03 01 53 01")
    assert decode_message(data) == AMQPMessage(properties=Properties(message_id=1))
    assert encode_message(AMQPMessage(properties=Properties(message_id=1))) == data


# --- refusals --------------------------------------------------------------------------

MALFORMED: list[tuple[str, str, str]] = [
    ("", "truncated", "empty"),
    ("00", "truncated", "section descriptor"),
    ("00 53", "truncated", "smallulong"),
    ("00 53 75", "truncated", "section value"),
    ("00 53 75 a0 05 68 65", "length-overrun", "vbin8 declares 5 bytes, 2 remain"),
    ("00 53 75 b0 ff ff ff ff 00", "length-overrun", "declares 4294967295 bytes"),
    ("00 53 77 d0 ff ff ff ff 00 00 00 01 40", "length-overrun", "list declares"),
    ("00 53 77 d1 ff ff ff ff 00 00 00 02 40 40", "length-overrun", "map declares"),
    ("00 53 77 f0 ff ff ff ff 00 00 00 02 40", "length-overrun", "array declares"),
    ("00 53 77 d0 00 00 00 05 ff ff ff ff 40", "malformed", "count 4294967295 exceeds"),
    ("00 53 77 c0 00 00", "malformed", "cannot hold its count"),
    ("00 53 77 d0 00 00 00 02 00 00 00 00", "malformed", "cannot hold its count"),
    ("00 53 77 c0 04 01 40 40 40", "malformed", "2 bytes after its 1 elements"),
    ("00 53 77 c0 03 02 a1 00", "truncated", "element needs 1 bytes"),
    ("00 53 77 c0 03 02 40 a1", "truncated", "str8 length"),
    ("00 53 77 57", "bad-code", "0x57 is not an AMQP type code"),
    ("00 53 77 ff", "bad-code", "0xff is not an AMQP type code"),
    ("00 53 77 c1 03 01 54 01", "malformed", "map count 1 is odd"),
    ("00 53 77 c1 07 04 54 01 40 54 01 40", "malformed", "duplicate keys"),
    ("00 53 77 c1 03 02 45 40", "malformed", "unhashable"),
    ("00 53 77 56 02", "malformed", "boolean octet"),
    ("00 53 77 73 00 00 d8 00", "malformed", "not a Unicode scalar value"),
    ("00 53 77 73 00 11 00 00", "malformed", "not a Unicode scalar value"),
    ("00 53 77 a1 01 ff", "malformed", "not utf-8"),
    ("00 53 77 c0 04 01 a1 01 ff", "malformed", "not utf-8"),
    ("00 53 77 a3 01 80", "malformed", "not ascii"),
    ("00 53 77 72 00 00", "truncated", "float needs 4 bytes"),
    ("00 53 77 98 00", "truncated", "uuid needs 16 bytes"),
    ("00 53 77 e0 02 01 57", "bad-code", "not an array element constructor"),
    ("00 53 77 e0 02 01 00", "truncated", "array element descriptor"),
    ("00 53 77 e0 03 09 54 01", "malformed", "array count 9 exceeds"),
    ("00 53 77 e0 05 01 54 01 02 03", "malformed", "after its 1 elements"),
    ("00 53 77 e0 08 01 00 53 01 00 53 02 54 01", "malformed", "nested descriptors"),
    ("00 53 77 f0 00 00 00 05 ff ff ff ff 40", "too-large", "zero-width"),
    ("00 53 77 00", "truncated", "descriptor"),
    ("00 53 77 00 53 01", "truncated", "described value"),
    ("00 53 79 40", "bad-section", "0x79 is not a message section"),
    ("01 53 75 a0 00", "bad-section", "starts with 0x00"),
    ("00 53 75 a0 00 40", "bad-section", "starts with 0x00"),
    ("00 a3 03 66 6f 6f 40", "bad-section", "not a message section descriptor"),
    ("00 80 00 00 00 01 00 00 00 75 40", "bad-section", "not a message section descriptor"),
    ("00 54 75 40", "bad-section", "not a message section descriptor"),
    ("00 53 70 c0 03 01 54 01", "malformed", "header durable must be bool"),
    ("00 53 70 c0 07 06 40 40 40 40 40 40", "malformed", "header has 6 fields"),
    ("00 53 70 c1 01 00", "malformed", "header must be a list"),
    ("00 53 73 c0 03 01 54 07", "malformed", "message_id must be"),
    ("00 53 73 c0 04 02 40 a1 00", "malformed", "user_id must be bytes"),
    ("00 53 73 c0 05 03 40 40 a3 00", "malformed", "to must be str"),
    ("00 53 73 c0 09 07 40 40 40 40 40 40 a1 00", "malformed", "content_type must be Symbol"),
    ("00 53 73 40", "malformed", "properties must be a list"),
    ("00 53 74 c1 04 02 54 01 40", "malformed", "key 1 is not a string"),
    ("00 53 74 c1 05 02 a3 01 6b 40", "malformed", "key 'k' is not a string"),
    ("00 53 74 c1 05 02 a1 01 6b 45", "malformed", "application property 'k' is a list"),
    ("00 53 74 40", "malformed", "application-properties must be a map"),
    ("00 53 72 c1 05 02 a1 01 6b 40", "malformed", "key 'k' is not a symbol or ulong"),
    ("00 53 78 45", "malformed", "footer must be a map"),
    ("00 53 70 45 00 53 70 45", "malformed", "more than one header"),
    ("00 53 75 a0 00 00 53 77 40", "malformed", "amqp-value after data"),
    ("00 53 77 40 00 53 77 40", "malformed", "amqp-value after amqp-value"),
    ("00 53 76 45 00 53 75 a0 00", "malformed", "data after amqp-sequence"),
    ("00 53 75 a1 00", "malformed", "data must be binary"),
    ("00 53 76 40", "malformed", "amqp-sequence must be a list"),
]


@pytest.mark.parametrize(("wire", "kind", "reason"), MALFORMED, ids=[m[0][:30] for m in MALFORMED])
def test_malformed_messages_are_refused(wire: str, kind: str, reason: str) -> None:
    """Malformed input raises `AMQPDecodeError` with its kind and a reason saying what."""
    with pytest.raises(AMQPDecodeError) as caught:
        decode_message(h(wire))
    assert caught.value.kind == kind
    assert reason.lower() in caught.value.reason.lower()
    assert isinstance(caught.value, RemoteProtocolError)


def test_errors_say_where() -> None:
    """An error names the byte offset and the section it was found in."""
    with pytest.raises(AMQPDecodeError) as caught:
        decode_message(HELLO + h("00 53 74 c1 04 02 a1 05 6b"))
    assert caught.value.where == "byte 17, in the application-properties section at byte 10"
    assert "(at byte 17" in str(caught.value)
    with pytest.raises(AMQPDecodeError) as caught:
        decode_message(h("00 53 73 c0 03 01 54 07"))
    assert caught.value.where is None
    assert caught.value.reason.startswith("properties message_id")


def test_oversize_lengths_fail_before_reading() -> None:
    """A 4 GiB declared length fails at once, whatever the input's size."""
    data = h("00 53 75 b0 ff ff ff ff") + b"x" * 100
    with pytest.raises(AMQPDecodeError, match="declares 4294967295 bytes, 100 remain"):
        decode_message(data)


def test_element_sizes_are_bounded_by_their_container() -> None:
    """An element may not run past the end of the list that holds it, even within the input."""
    data = h("00 53 77 c0 03 01 a1 05 68 65 6c 6c 6f")
    with pytest.raises(AMQPDecodeError, match="str8 declares 5 bytes, 0 remain"):
        decode_message(data)


def nested_lists(depth: int) -> bytes:
    """``depth`` list32s nested in one another around a null."""
    data = h("40")
    for _ in range(depth):
        data = h("d0") + (len(data) + 4).to_bytes(4, "big") + (1).to_bytes(4, "big") + data
    return data


def test_nesting_is_limited() -> None:
    """Values nest at most `MAX_DEPTH` deep (a section counts as one level) both ways."""
    assert decode_message(h("00 53 77") + nested_lists(MAX_DEPTH - 1)).body is not None
    with pytest.raises(AMQPDecodeError) as caught:
        decode_message(h("00 53 77") + nested_lists(MAX_DEPTH))
    assert caught.value.kind == "too-deep"
    assert decode_value(nested_lists(MAX_DEPTH)) is not None
    with pytest.raises(AMQPDecodeError):
        decode_value(nested_lists(MAX_DEPTH + 1))
    with pytest.raises(AMQPDecodeError):
        decode_value(nested_lists(1000))

    value: Value = None
    for _ in range(MAX_DEPTH - 1):
        value = [value]
    encode_message(AMQPMessage(body=AMQPValue(value)))
    with pytest.raises(AMQPEncodeError, match="nested deeper"):
        encode_message(AMQPMessage(body=AMQPValue([value])))


def test_described_and_map_nesting_count_too() -> None:
    """Described values and maps are levels of nesting as lists are."""
    data = h("00 53 01") * 40 + h("40")
    with pytest.raises(AMQPDecodeError, match="nested deeper"):
        decode_value(data)
    looped: list[Value] = []
    looped.append(looped)
    with pytest.raises(AMQPEncodeError, match="nested deeper"):
        encode_value(looped)


def test_zero_width_elements_are_bounded_by_the_input() -> None:
    """Arrays of zero-width elements may hold, in all, as many elements as the input has bytes.

    Nulls, booleans true and false, uint0, ulong0 and list0 take no bytes as
    array elements; the bound keeps what a decoder builds proportional to
    what it was given.
    """
    assert decode_value(h("e0 02 04 40")) == Array("null", (None,) * 4)
    with pytest.raises(AMQPDecodeError, match="zero-width"):
        decode_value(h("e0 02 05 40"))
    decode_value(h("c0 09 02") + h("e0 02 06 40") + h("e0 02 05 40"))
    with pytest.raises(AMQPDecodeError, match="zero-width"):
        decode_value(h("c0 09 02") + h("e0 02 06 40") + h("e0 02 06 40"))


def test_every_cut_of_a_message_is_refused_or_a_shorter_message() -> None:
    """A truncated entry fails with `AMQPDecodeError` unless it ends between sections."""
    message = NOTES_EXAMPLES[8][1] + h("00 53 74 c1 05 02 a1 01 6b 40")
    properties_end = len(NOTES_EXAMPLES[8][1]) - len(X_BODY)
    boundaries = {0, properties_end, properties_end + len(X_BODY), len(message)}
    for cut in range(len(message)):
        if cut in boundaries and cut:
            decode_message(message[:cut])
            continue
        with pytest.raises(AMQPDecodeError):
            decode_message(message[:cut])


def test_trailing_bytes_after_a_value() -> None:
    """`decode_value` takes exactly one value."""
    with pytest.raises(AMQPDecodeError, match="1 bytes after the value"):
        decode_value(h("40 40"))
    with pytest.raises(AMQPDecodeError, match="needs 1 bytes"):
        decode_value(b"")


# --- encoder refusals -----------------------------------------------------------------

UNENCODABLE: list[object] = [
    2**64,
    -(2**63) - 1,
    UByte(256),
    Byte(128),
    UShort(-1),
    Short(40000),
    UInt(2**32),
    UInt(-1),
    ULong(-1),
    ULong(2**64),
    Long(2**63),
    Timestamp(2**63),
    Char("ab"),
    Char("\ud800"),
    Decimal32(b"abc"),
    Decimal128(b"abc"),
    Float32(1e300),
    Symbol("\u00e9"),
    "\ud800",
    object(),
    {1, 2},
    Array("uint", ("x",)),
    Array("uint", (-1,)),
    Array("boolean", (1,)),
    Array("null", (1,)),
    Array("string", (b"x",)),
    Array("symbol", ("\u00e9",)),
    Array("binary", ("x",)),
    Array("uuid", ("x",)),
    Array("char", ("ab",)),
    Array("char", (1,)),
    Array("decimal64", (b"x",)),
    Array("list", ("x",)),
    Array("nope", ()),  # type: ignore[arg-type]
    Described(-1, None),
]


@pytest.mark.parametrize("value", UNENCODABLE, ids=[repr(v)[:30] for v in UNENCODABLE])
def test_unencodable_values_are_refused(value: object) -> None:
    """Values out of range or without an AMQP encoding raise `AMQPEncodeError`."""
    with pytest.raises(AMQPEncodeError) as caught:
        encode_value(value)
    assert isinstance(caught.value, LocalProtocolError)


UNSENDABLE: list[AMQPMessage] = [
    AMQPMessage(application_properties={"k": [1]}),
    AMQPMessage(application_properties={"k": {"a": 1}}),
    AMQPMessage(application_properties={"k": (1,)}),
    AMQPMessage(application_properties={"k": Array("int", (1,))}),
    AMQPMessage(application_properties={1: "v"}),  # type: ignore[dict-item]
    AMQPMessage(application_properties={"\ud800": "v"}),
    AMQPMessage(message_annotations={1.5: "x"}),
    AMQPMessage(message_annotations={True: "x"}),
    AMQPMessage(footer={Char("c"): "x"}),
    AMQPMessage(delivery_annotations={-1: "x"}),
    AMQPMessage(properties=Properties(message_id=-1)),
    AMQPMessage(properties=Properties(message_id=1.5)),  # type: ignore[arg-type]
    AMQPMessage(properties=Properties(message_id=True)),
    AMQPMessage(properties=Properties(to=5)),  # type: ignore[arg-type]
    AMQPMessage(properties=Properties(content_type="t\u00e9xt")),
    AMQPMessage(properties=Properties(creation_time=1.5)),  # type: ignore[arg-type]
    AMQPMessage(properties=Properties(group_sequence=2**32)),
    AMQPMessage(header=Header(durable=1)),  # type: ignore[arg-type]
    AMQPMessage(header=Header(priority=True)),
    AMQPMessage(header=Header(priority=300)),
    AMQPMessage(body="text"),  # type: ignore[arg-type]
    AMQPMessage(body=AMQPSequence(("x",))),  # type: ignore[arg-type]
    AMQPMessage(body=AMQPSequence(())),
    AMQPMessage(properties=Properties(), body=AMQPSequence(())),
    AMQPMessage(),
]


@pytest.mark.parametrize("message", UNSENDABLE, ids=[repr(m)[:60] for m in UNSENDABLE])
def test_unsendable_messages_are_refused(message: AMQPMessage) -> None:
    """Sections the decoder would refuse are refused by the encoder too."""
    with pytest.raises(AMQPEncodeError):
        encode_message(message)


# --- looks_like_amqp -----------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        *(bytes((0x00, 0x53, code)) for code in range(0x70, 0x79)),
        h("00 80 00 00 00 00 00 00 00 75"),
        b"\x00\xa3\x10amqp:data:binary",
        b"\x00\xa3\x1famqp:application-properties:map",
        b"\x00\xb3\x00\x00\x00\x0famqp:footer:map",
    ],
)
def test_looks_like_amqp(data: bytes) -> None:
    """Entries starting with a section descriptor in any of its forms look like AMQP."""
    assert looks_like_amqp(data)
    assert looks_like_amqp(memoryview(data + b"rest"))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\x00\x53",
        b"hello",
        h("00 53 6f"),
        h("00 53 79"),
        h("00 53 00"),
        h("00 80 00 00 00 01 00 00 00 75"),
        h("00 80 00 00"),
        b"\x00\xa3\x03foo",
        b"\x00\xb3\x00\x00",
        h("01 53 75"),
    ],
)
def test_raw_entries_do_not_look_like_amqp(data: bytes) -> None:
    """Raw bytes, partial descriptors and non-section descriptors do not look like AMQP."""
    assert not looks_like_amqp(data)


# --- hypothesis: round trips and garbage ---------------------------------------------

ascii_text = st.text(alphabet=st.characters(max_codepoint=127), max_size=20)
symbols = ascii_text.map(Symbol)
int64 = st.integers(-(2**63), 2**63 - 1)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
finite = st.floats(allow_nan=False)
float32 = st.floats(width=32, allow_nan=False).map(Float32)
chars = st.characters(exclude_categories=["Cs"]).map(Char)

scalars: st.SearchStrategy[Value] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    finite,
    st.text(max_size=20),
    st.binary(max_size=20),
    st.uuids(),
    symbols,
    chars,
    st.integers(0, 255).map(UByte),
    st.integers(0, 65535).map(UShort),
    uint32.map(UInt),
    uint64.map(ULong),
    st.integers(-128, 127).map(Byte),
    st.integers(-(2**15), 2**15 - 1).map(Short),
    int64.map(Long),
    int64.map(Timestamp),
    float32,
    st.binary(min_size=4, max_size=4).map(Decimal32),
    st.binary(min_size=8, max_size=8).map(Decimal64),
    st.binary(min_size=16, max_size=16).map(Decimal128),
)
descriptors = st.one_of(uint64.map(ULong), symbols)

ARRAY_ELEMENTS: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "ubyte": st.integers(0, 255),
    "ushort": st.integers(0, 65535),
    "uint": uint32,
    "ulong": uint64,
    "byte": st.integers(-128, 127),
    "short": st.integers(-(2**15), 2**15 - 1),
    "int": st.integers(-(2**31), 2**31 - 1),
    "long": int64,
    "float": float32,
    "double": finite,
    "decimal32": st.binary(min_size=4, max_size=4),
    "decimal64": st.binary(min_size=8, max_size=8),
    "decimal128": st.binary(min_size=16, max_size=16),
    "char": chars,
    "timestamp": int64,
    "uuid": st.uuids(),
    "binary": st.binary(max_size=300),
    "string": st.text(max_size=10),
    "symbol": symbols,
    "list": st.lists(scalars, max_size=3),
    "map": st.dictionaries(scalars, scalars, max_size=3),
}


@st.composite
def arrays(draw: st.DrawFn, children: st.SearchStrategy[Value] | None = None) -> Array:
    """Any array: an element type, elements of it, maybe a shared descriptor."""
    element_type = draw(st.sampled_from([*ARRAY_ELEMENTS, "array"]))
    if element_type == "array":
        items = tuple(draw(st.lists(arrays(), max_size=3)))
    else:
        items = tuple(draw(st.lists(ARRAY_ELEMENTS[element_type], max_size=4)))
    descriptor = draw(st.none() | descriptors)
    return Array(element_type, items, descriptor)  # type: ignore[arg-type]


values: st.SearchStrategy[Value] = st.recursive(
    scalars | arrays(),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(scalars, children, max_size=4),
        st.builds(Described, descriptors, children),
    ),
    max_leaves=12,
)
simple_values = scalars | st.builds(Described, descriptors, scalars)
annotations = st.dictionaries(st.one_of(symbols, uint64), values, max_size=3)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The strategy's values or None."""
    return st.none() | strategy


headers = st.builds(
    Header,
    durable=optional(st.booleans()),
    priority=optional(st.integers(0, 255)),
    ttl=optional(uint32),
    first_acquirer=optional(st.booleans()),
    delivery_count=optional(uint32),
)
message_ids = st.one_of(uint64, st.uuids(), st.binary(max_size=20), st.text(max_size=20))
properties = st.builds(
    Properties,
    message_id=optional(message_ids),
    user_id=optional(st.binary(max_size=10)),
    to=optional(st.text(max_size=10)),
    subject=optional(st.text(max_size=10)),
    reply_to=optional(st.text(max_size=10)),
    correlation_id=optional(message_ids),
    content_type=optional(ascii_text),
    content_encoding=optional(ascii_text),
    absolute_expiry_time=optional(int64),
    creation_time=optional(int64),
    group_id=optional(st.text(max_size=10)),
    group_sequence=optional(uint32),
    reply_to_group_id=optional(st.text(max_size=10)),
)
bodies = st.one_of(
    st.none(),
    st.binary(max_size=400),
    st.builds(AMQPValue, values),
    st.lists(st.lists(values, max_size=3), min_size=1, max_size=3).map(
        lambda sections: AMQPSequence(tuple(sections))
    ),
)


def has_a_section(message: AMQPMessage) -> bool:
    """Whether a message has any section: an empty entry is no message."""
    return any(
        section is not None
        for section in (
            message.header,
            message.delivery_annotations,
            message.message_annotations,
            message.properties,
            message.application_properties,
            message.body,
            message.footer,
        )
    )


messages = st.builds(
    AMQPMessage,
    header=optional(headers),
    delivery_annotations=optional(annotations),
    message_annotations=optional(annotations),
    properties=optional(properties),
    application_properties=optional(
        st.dictionaries(st.text(max_size=10), simple_values, max_size=5)
    ),
    body=bodies,
    footer=optional(annotations),
).filter(has_a_section)


@FAST
@given(messages)
def test_messages_round_trip(message: AMQPMessage) -> None:
    """Any message encodes, decodes to an equal message, and re-encodes to the same bytes.

    The second encoding proves the AMQP types survive the trip too (a uint
    stays a uint, a symbol a symbol), not only the values.
    """
    data = encode_message(message)
    decoded = decode_message(data)
    assert decoded == message
    assert encode_message(decoded) == data


@FAST
@given(
    st.dictionaries(st.text(max_size=300), simple_values, max_size=30), st.binary(max_size=70000)
)
def test_application_properties_and_bodies_round_trip(
    application_properties: dict[str, Value], body: bytes
) -> None:
    """Arbitrary application properties and data bodies, long ones included, round-trip."""
    message = AMQPMessage(application_properties=application_properties, body=body)
    assert decode_message(encode_message(message)) == message


@FAST
@given(values)
def test_values_round_trip(value: Value) -> None:
    """Any value encodes, decodes to an equal value and re-encodes to the same bytes."""
    data = encode_value(value)
    decoded = decode_value(data)
    assert decoded == value
    assert encode_value(decoded) == data


@FAST
@given(st.binary(max_size=200))
def test_garbage_gives_a_message_or_our_error(data: bytes) -> None:
    """Arbitrary bytes give an `AMQPMessage` or `AMQPDecodeError`, nothing else."""
    with contextlib.suppress(AMQPDecodeError):
        assert isinstance(decode_message(data), AMQPMessage)
    with contextlib.suppress(AMQPDecodeError):
        decode_value(data)


@FAST
@given(
    st.sampled_from([bytes((0x00, 0x53, code)) for code in range(0x70, 0x79)]),
    st.binary(max_size=200),
)
def test_garbage_section_values_give_a_message_or_our_error(head: bytes, data: bytes) -> None:
    """Arbitrary bytes after a valid section descriptor give a message or our error."""
    with contextlib.suppress(AMQPDecodeError):
        assert isinstance(decode_message(head + data), AMQPMessage)


@FAST
@given(messages, st.data())
def test_damaged_messages_give_a_message_or_our_error(
    message: AMQPMessage, data: st.DataObject
) -> None:
    """A valid encoding with bytes changed, cut or inserted gives a message or our error."""
    encoded = bytearray(encode_message(message))
    assume(encoded)
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(encoded) - 1))
        action = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if action == "set":
            encoded[where] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del encoded[where:]
            if not encoded:
                break
        else:
            encoded[where:where] = data.draw(st.binary(min_size=1, max_size=4))
    with contextlib.suppress(AMQPDecodeError):
        assert isinstance(decode_message(bytes(encoded)), AMQPMessage)


# --- interop with rstream (a client we did not write) ---------------------------------


def rstream_text(value: Any) -> Any:
    """What rstream's decoder returns for a value we sent: strings come back as bytes."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict):
        return {rstream_text(k): rstream_text(v) for k, v in value.items()}
    return value


rstream_values = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300),
    st.booleans(),
    int64,
    finite,
    st.none(),
)
rstream_ids = st.one_of(
    st.text(min_size=1, max_size=40), uint64, st.binary(min_size=1, max_size=16)
)


@needs_rstream
def test_notes_examples_are_what_rstream_writes() -> None:
    """The rstream encoder writes the notes' bytes, so the examples above are its own."""
    assert rstream is not None
    write = rstream.AMQPMessage
    assert bytes(write(body=b"hello")) == NOTES_EXAMPLES[0][1]
    assert (
        bytes(write(body=b"hello", application_properties={"k": "v", "n": 1}))
        == (NOTES_EXAMPLES[1][1])
    )
    props = rstream.Properties(message_id="id-1")
    assert (
        bytes(write(body=b"hello", properties=props, application_properties={"k": "v"}))
        == (NOTES_EXAMPLES[2][1])
    )
    assert (
        bytes(write(body=b"hi", properties=rstream.Properties(message_id=7)))
        == (NOTES_EXAMPLES[3][1])
    )
    assert bytes(write(value="hello")) == NOTES_EXAMPLES[4][1]
    header = rstream.Header(durable=True)
    assert (
        bytes(write(body=b"x", header=header, message_annotations={"x-opt": "a"}))
        == (NOTES_EXAMPLES[5][1])
    )
    assert bytes(write(body=b"x" * 300)) == NOTES_EXAMPLES[6][1]
    several = {"b": True, "l": 2**40, "f": 1.5, "neg": -5, "big": 1000}
    assert bytes(write(body=b"x", application_properties=several)) == NOTES_EXAMPLES[7][1]
    typed = rstream.Properties(
        message_id=b"\x01\x02", content_type="text/plain", creation_time=1700000000000
    )
    assert bytes(write(body=b"x", properties=typed)) == NOTES_EXAMPLES[8][1]


@needs_rstream
@FAST
@given(
    st.binary(max_size=400),
    st.dictionaries(st.text(max_size=20), rstream_values, max_size=8),
    rstream_ids,
)
def test_rstream_messages_decode(
    body: bytes, application_properties: dict[str, Any], message_id: Any
) -> None:
    """Messages encoded by rstream (body, application properties, message id) decode with ours."""
    assert rstream is not None
    sent = rstream.AMQPMessage(
        body=body,
        application_properties=application_properties,
        properties=rstream.Properties(message_id=message_id),
    )
    decoded = decode_message(bytes(sent))
    assert decoded.body == (body or None)  # rstream leaves an empty body out
    assert decoded.application_properties == (application_properties or None)
    assert decoded.properties == Properties(message_id=message_id)


@needs_rstream
def test_rstream_sections_decode() -> None:
    """The header, annotations, properties, value and sequence bodies of rstream decode."""
    assert rstream is not None
    sent = rstream.AMQPMessage(
        header=rstream.Header(
            durable=True, priority=5, ttl=300, first_acquirer=False, delivery_count=1
        ),
        delivery_annotations={"x-opt-d": 1},
        message_annotations={"x-opt-m": "m", 7: b"u"},
        properties=rstream.Properties(
            message_id=uuid.UUID(int=9),
            user_id=b"guest",
            to="to",
            subject="subject",
            reply_to="reply",
            correlation_id="corr",
            content_type="text/plain",
            content_encoding="identity",
            absolute_expiry_time=2,
            creation_time=1,
            group_id="g",
            group_sequence=4,
            reply_to_group_id="rg",
        ),
        value={"k": [1, "two"]},
        footer={"x-f": 1.5},
    )
    decoded = decode_message(bytes(sent))
    assert decoded == AMQPMessage(
        header=Header(durable=True, priority=5, ttl=300, first_acquirer=False, delivery_count=1),
        delivery_annotations={"x-opt-d": 1},
        message_annotations={"x-opt-m": "m", 7: b"u"},
        properties=Properties(
            message_id=uuid.UUID(int=9),
            user_id=b"guest",
            to="to",
            subject="subject",
            reply_to="reply",
            correlation_id="corr",
            content_type="text/plain",
            content_encoding="identity",
            absolute_expiry_time=2,
            creation_time=1,
            group_id="g",
            group_sequence=4,
            reply_to_group_id="rg",
        ),
        body=AMQPValue({"k": [1, "two"]}),
        footer={"x-f": 1.5},
    )
    sequence = decode_message(bytes(rstream.AMQPMessage(sequence=[[1, 2], ["a"]])))
    assert sequence.body == AMQPSequence(([1, 2], ["a"]))


@needs_rstream
@FAST
@given(
    st.binary(min_size=1, max_size=400),
    st.dictionaries(st.text(min_size=1, max_size=20), rstream_values, max_size=8),
    rstream_ids,
)
def test_our_messages_decode_with_rstream(
    body: bytes, application_properties: dict[str, Any], message_id: Any
) -> None:
    """Our messages decode with rstream's `amqp_decoder` (which returns strings as bytes)."""
    assert rstream is not None
    data = encode_message(
        AMQPMessage(
            properties=Properties(message_id=message_id, subject="s", creation_time=5),
            application_properties=application_properties,
            body=body,
        )
    )
    received = rstream.amqp_decoder(data)
    assert received.body == body
    assert received.application_properties == rstream_text(application_properties)
    assert received.properties.message_id == rstream_text(message_id)
    assert received.properties.subject == b"s"
    assert received.properties.creation_time == 5


@needs_rstream
def test_our_sections_decode_with_rstream() -> None:
    """The rstream decoder reads our compact header and properties, annotations and values."""
    assert rstream is not None
    data = encode_message(
        AMQPMessage(
            header=Header(durable=True, priority=5),
            message_annotations={"x-opt-m": 1},
            properties=Properties(content_type="text/plain", group_sequence=0),
            body=AMQPValue(["a", 1, None, True, 2**40, 1.5, uuid.UUID(int=3)]),
        )
    )
    received = rstream.amqp_decoder(data)
    assert received.header.durable is True
    assert received.header.priority == 5
    assert received.message_annotations == {b"x-opt-m": 1}
    assert received.properties.content_type == b"text/plain"
    assert received.properties.group_sequence == 0
    assert received.value == [b"a", 1, None, True, 2**40, 1.5, uuid.UUID(int=3)]


def test_strategies_cover_every_array_type() -> None:
    """The round-trip strategies draw every array element type the encoder knows."""
    assert set(ARRAY_ELEMENTS) | {"array"} == set(ArrayType.__args__)  # type: ignore[attr-defined]
