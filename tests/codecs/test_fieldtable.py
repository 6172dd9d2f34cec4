"""Tests for `gateway.codecs.fieldtable`: AMQP 0-9-1 field tables.

Bytes written by hand from the 0-9-1 grammar and RabbitMQ's type letters,
every type decoded, hypothesis round trips of arbitrary nested tables, and
garbage and truncations that must raise the codec's error and nothing else.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs.fieldtable import (
    MAX_DEPTH,
    FieldTableError,
    FieldTableLocalError,
    decode_short_string,
    decode_table,
    encode_short_string,
    encode_table,
)

EXAMPLE = (
    b"\x00\x00\x00\x29"  # 41 bytes of pairs
    b"\x04name"
    b"S\x00\x00\x00\x03abc"
    b"\x02ok"
    b"t\x01"
    b"\x01n"
    b"l\xff\xff\xff\xff\xff\xff\xff\xfe"
    b"\x03sub"
    b"F\x00\x00\x00\x03"
    b"\x01v"
    b"V"
)


def test_a_table_by_hand() -> None:
    """A long string, a boolean, a signed 64-bit integer and a nested table with a void."""
    assert len(EXAMPLE) == 4 + 0x29
    table, end = decode_table(EXAMPLE)
    assert table == {"name": "abc", "ok": True, "n": -2, "sub": {"v": None}}
    assert end == len(EXAMPLE)
    assert encode_table(table) == EXAMPLE


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b"b\xff", -1),
        (b"B\xff", 255),
        (b"s\x80\x00", -32768),
        (b"u\xff\xff", 65535),
        (b"I\xff\xff\xff\xff", -1),
        (b"i\xff\xff\xff\xff", 2**32 - 1),
        (b"L\xff\xff\xff\xff\xff\xff\xff\xff", 2**64 - 1),
        (b"f\x3f\x80\x00\x00", 1.0),
        (b"d\x3f\xf0\x00\x00\x00\x00\x00\x00", 1.0),
        (b"D\x02\x00\x00\x04\xd2", decimal.Decimal("12.34")),
        (b"x\x00\x00\x00\x02\x00\xff", b"\x00\xff"),
        (b"S\x00\x00\x00\x01\xff", b"\xff"),  # not UTF-8: kept as bytes
        (
            b"T\x00\x00\x00\x00\x00\x00\x00\x3c",
            datetime.datetime(1970, 1, 1, 0, 1, tzinfo=datetime.UTC),
        ),
        (b"A\x00\x00\x00\x04t\x00t\x01", [False, True]),
    ],
)
def test_every_type_letter(data: bytes, value: object) -> None:
    """Each type octet of 0-9-1 and RabbitMQ decodes to its Python value."""
    pairs = b"\x01k" + data
    table, _ = decode_table(len(pairs).to_bytes(4, "big") + pairs)
    assert table == {"k": value}


def test_offset_and_what_follows() -> None:
    """Decoding starts at an offset and reports where the table ends."""
    data = b"junk" + encode_table({"a": 1}) + b"after"
    table, end = decode_table(data, 4)
    assert table == {"a": 1} and data[end:] == b"after"


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.decimals(
        allow_nan=False, allow_infinity=False, places=2, min_value=-(10**6), max_value=10**6
    )
    | st.datetimes(min_value=datetime.datetime(1970, 1, 1), timezones=st.just(datetime.UTC)).map(
        lambda moment: moment.replace(microsecond=0)
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=12), values, max_size=6))
def test_round_trip(table: dict[str, object]) -> None:
    """Whatever is encoded decodes to the same values, and re-encodes to the same bytes."""
    data = encode_table(table)
    decoded, end = decode_table(data)
    assert end == len(data)
    assert decoded == table
    assert encode_table(decoded) == data


@given(st.binary(max_size=64))
def test_garbage_raises_only_the_codec_error(data: bytes) -> None:
    """Arbitrary bytes decode or raise FieldTableError, nothing else."""
    with contextlib.suppress(FieldTableError):
        decode_table(data)


def test_every_truncation_is_refused() -> None:
    """Each proper prefix of a table fails as cut short."""
    for cut in range(len(EXAMPLE)):
        with pytest.raises(FieldTableError):
            decode_table(EXAMPLE[:cut])


def test_refusals() -> None:
    """Unknown types, names running out of their table, deep nesting; unencodable values."""
    with pytest.raises(FieldTableError, match="unknown field type"):
        decode_table(b"\x00\x00\x00\x03\x01kZ")
    with pytest.raises(FieldTableError, match="runs past"):
        decode_table(b"\x00\x00\x00\x02\x05ab" + b"cdeS")
    deep: dict[str, object] = {}
    for _ in range(MAX_DEPTH):
        deep = {"d": deep}
    with pytest.raises(FieldTableLocalError, match="nest"):
        encode_table(deep)
    with pytest.raises(FieldTableLocalError, match="cannot carry a set"):
        encode_table({"s": {1}})
    with pytest.raises(FieldTableLocalError, match="255"):
        encode_table({"n" * 256: 1})
    with pytest.raises(FieldTableLocalError, match="64-bit"):
        encode_table({"big": 2**64})


def test_short_strings() -> None:
    """One length octet; at most 255 bytes."""
    assert encode_short_string("héllo") == b"\x06h\xc3\xa9llo"
    assert decode_short_string(b"\x03abcX") == (b"abc", 4)
    with pytest.raises(FieldTableError):
        decode_short_string(b"\x05ab")
