"""The columnar decoder against the row-by-row path: the same rows for any entries (no Spark)."""

from __future__ import annotations

import struct
from array import array

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.codecs.amqp import AMQPMessage, Properties, encode_message
from gateway.core.message import Message
from gateway.protocols.stream.mapping import (
    RECIPIENTS_HEADER,
    SENDER_HEADER,
    TIMESTAMP_HEADER,
    entry_from_message,
)
from gateway.spark.columnar import MESSAGE_COLUMNS, message_batch, reference_batch
from gateway.spark.columnar.layout import Views, classify_pairs, parse
from gateway.spark.logfiles import BLOCK_PADDING_BYTES, BlockChunk, RecordBlock
from tests.codecs.test_amqp import messages as amqp_messages
from tests.protocols.test_stream_mapping import messages as gateway_messages
from tests.spark.logmaker import message as logmaker_message

COLUMNS = [name for name, _ in MESSAGE_COLUMNS]
DIFFERENTIAL = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
ROUTE = "msggateway.route.r"


def block_of(entries: list[bytes], *, chunk: int = 3, gap: bytes = b"\x50hdr") -> RecordBlock:
    """A block of ``entries``: chunks of ``chunk`` entries, with bytes between chunks."""
    buffer = bytearray()
    starts: array[int] = array("q")
    ends: array[int] = array("q")
    chunks = []
    offset = 40
    for first in range(0, len(entries), chunk):
        part = entries[first : first + chunk]
        buffer += gap
        for entry in part:
            buffer += struct.pack(">I", len(entry))
            starts.append(len(buffer))
            buffer += entry
            ends.append(len(buffer))
        publishers = ("pub",) if first // chunk % 2 else ()
        chunks.append(BlockChunk(offset, len(part), 1_700_000_000_000 + first, publishers))
        offset += len(part) + 1  # a tracking chunk between: offsets skip one
    buffer += bytes(BLOCK_PADDING_BYTES)
    return RecordBlock(
        buffer=buffer,
        starts=np.array(starts, np.int64),
        ends=np.array(ends, np.int64),
        chunks=tuple(chunks),
    )


def assert_same(entries: list[bytes], stream: str = "orders", columns: list[str] = COLUMNS) -> None:
    """The columnar path gives exactly the row-by-row path's rows."""
    block = block_of(entries)
    fast = message_batch(block, stream, columns)
    reference = reference_batch(block, stream, columns)
    assert fast.schema == reference.schema
    for name in columns:
        assert plain(fast.column(name)) == plain(reference.column(name)), name
        assert fast.column(name).equals(reference.column(name)), name


def plain(column: pa.Array) -> list[object]:
    """A column's values; timestamps as microseconds (Python's dates end at year 9999)."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    return column.to_pylist()


def slow_rows(entries: list[bytes]) -> list[int]:
    """The entries the fast path hands to the row-by-row path."""
    block = block_of(entries)
    views = Views(block.buffer)
    parsed = parse(views, block.starts, block.ends)
    classify_pairs(views, parsed)
    return np.flatnonzero(parsed.slow).tolist()


def rstream_entry(
    message_id: str, body: bytes, properties: dict[str, str], created: int | None
) -> bytes:
    """An entry as rstream's ``AMQPMessage`` writes it: all 13 properties fields (notes 12)."""
    raw_id = message_id.encode()
    fields = b"\xa1" + bytes([len(raw_id)]) + raw_id + b"\x40" * 8
    fields += b"\x40" if created is None else b"\x83" + struct.pack(">q", created)
    fields += b"\x40" * 3
    section = b"\x00\x53\x73\xc0" + bytes([len(fields) + 1, 13]) + fields
    pairs = b"".join(
        b"\xa1" + bytes([len(k)]) + k.encode() + b"\xa1" + bytes([len(v)]) + v.encode()
        for k, v in properties.items()
    )
    section += b"\x00\x53\x74\xc1" + bytes([len(pairs) + 1, 2 * len(properties)]) + pairs
    return section + b"\x00\x53\x75\xa0" + bytes([len(body)]) + body


ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24)
escaped_text = st.binary(max_size=12).map(lambda raw: raw.decode("utf-8", "surrogateescape"))
odd_keys = st.sampled_from(
    [SENDER_HEADER, RECIPIENTS_HEADER, TIMESTAMP_HEADER, "x-gateway-sendeR", "n", "", "é" * 11]
)
header_values = st.one_of(
    ascii_text,
    st.text(max_size=10),
    st.binary(max_size=8),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
)
common_messages = st.builds(
    Message,
    body=st.binary(max_size=300),
    address=ascii_text,
    id=ascii_text | escaped_text,
    sender=st.none() | ascii_text | escaped_text,
    recipients=st.lists(ascii_text | st.sampled_from(["a,b", "%2C", "x%25y", "%"]), max_size=3).map(
        tuple
    ),
    headers=st.dictionaries(ascii_text | odd_keys, header_values, max_size=5),
    timestamp=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1e300]),
)
rstream_entries = st.builds(
    rstream_entry,
    ascii_text,
    st.binary(max_size=200),
    st.dictionaries(ascii_text, ascii_text, max_size=3),
    st.none() | st.integers(-(2**63), 2**63 - 1),
)
well_formed = st.one_of(
    common_messages.map(entry_from_message),
    gateway_messages.map(entry_from_message),
    amqp_messages.map(encode_message),
    rstream_entries,
    st.binary(max_size=40),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A well-formed entry with a byte changed, bytes cut off, or bytes put in."""
    entry = bytearray(draw(well_formed))
    how = draw(st.sampled_from(["flip", "cut", "insert"]))
    at = draw(st.integers(0, max(len(entry) - 1, 0)))
    if how == "flip" and entry:
        entry[at] = draw(st.integers(0, 255))
    elif how == "cut":
        del entry[at:]
    else:
        entry[at:at] = draw(st.binary(min_size=1, max_size=3))
    return bytes(entry)


entries = st.lists(well_formed | mutated(), min_size=1, max_size=12)


@DIFFERENTIAL
@given(entries, st.sampled_from(["orders", ROUTE]))
@example([entry_from_message(logmaker_message("orders", 7, 1.7e9))], "orders")
@example([b"\x00\x53\x74\xc1\x05\x02\xa1\x01\xff\x40"], "orders")  # a key that is not UTF-8
@example([b"\x00\x53\x74\xc1\x09\x04\xa1\x01k\x40\xa1\x01k\x40"], "orders")  # a key twice
def test_same_rows_as_the_row_by_row_path(batch: list[bytes], stream: str) -> None:
    """Any entries, well-formed or not: the columnar rows are the row-by-row rows."""
    assert_same(batch, stream)


@DIFFERENTIAL
@given(
    st.lists(well_formed, min_size=1, max_size=6),
    st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=5, unique=True),
)
def test_same_rows_for_some_columns(batch: list[bytes], columns: list[str]) -> None:
    """A scan of some columns, in any order, gives those columns of the same rows."""
    assert_same(batch, "orders", columns)


def test_common_shapes_take_the_fast_path() -> None:
    """The gateway's own entries, rstream's and raw ones are decoded without the slow path."""
    ours = [entry_from_message(logmaker_message("orders", i, 1.7e9)) for i in (0, 7, 300, 10**6)]
    plain = entry_from_message(Message(body=b"x", address="a", id="i"))
    rstream = [
        rstream_entry("id-1", b"hello", {"k": "v"}, None),
        rstream_entry("id-2", b"", {}, 1_700_000_000_000),
    ]
    raw = [b"plain body", b"", b"\x00"]
    batch = [*ours, plain, *rstream, *raw]
    assert slow_rows(batch) == []
    assert_same(batch)


def test_what_the_fast_path_leaves_to_the_mapping() -> None:
    """Foreign shapes go row by row: an amqp-value body, a ulong id, a double header."""
    value = encode_message(AMQPMessage(body=None, properties=Properties(message_id=7)))
    double = entry_from_message(Message(body=b"", address="a", id="i", headers={"f": 1.5}))
    batch = [value, double, b"raw"]
    assert slow_rows(batch) == [0, 1]
    assert_same(batch)


def test_strings_that_are_not_unicode_read_as_escapes() -> None:
    """An id and sender given as undecodable bytes read as backslash escapes."""
    message = Message(body=b"", address="a", id=b"i\xff".decode("utf-8", "surrogateescape"))
    batch = message_batch(block_of([entry_from_message(message)]), "s", ["message_id"])
    assert batch.column("message_id").to_pylist() == ["i\\xff"]


def test_timestamps_that_do_not_fit_are_null() -> None:
    """A timestamp that is not finite, or past 64 bits of microseconds, reads as null."""
    stamps = [float("nan"), float("inf"), 1e300, 1.5]
    block = block_of(
        [entry_from_message(Message(body=b"", address="a", id="i", timestamp=t)) for t in stamps]
    )
    values = message_batch(block, "s", ["timestamp"]).column("timestamp").cast(pa.int64())
    assert values.to_pylist() == [None, None, None, 1_500_000]


def test_chunk_columns_need_no_parsing() -> None:
    """Stream, offset, chunk time, publisher and route come from the chunks."""
    block = block_of([b"a", b"b", b"c", b"d"], chunk=2)
    batch = message_batch(block, ROUTE, ["stream", "offset", "publisher", "route"])
    assert batch.to_pylist() == [
        {"stream": ROUTE, "offset": o, "publisher": p, "route": "r"}
        for o, p in ((40, None), (41, None), (43, "pub"), (44, "pub"))
    ]


@pytest.mark.parametrize("columns", [COLUMNS, ["body", "size"], ["headers"], ["offset"]])
def test_an_empty_block(columns: list[str]) -> None:
    """A block without records gives an empty batch of the columns asked for."""
    empty = np.zeros(0, np.int64)
    block = RecordBlock(buffer=bytearray(BLOCK_PADDING_BYTES), starts=empty, ends=empty, chunks=())
    batch = message_batch(block, "s", columns)
    assert batch.num_rows == 0 and batch.schema.names == columns
