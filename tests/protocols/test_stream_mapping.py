"""Tests for `gateway.protocols.stream.mapping`: stream entries to and from `Message`.

The behaviour checked is the module docstring's mapping: round trips keep
body, id, sender, recipients, headers and timestamp; raw entries pass
through; entries written by rstream (a client we did not write) map to the
expected messages, and rstream reads ours.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.codecs import osiris
from gateway.codecs.amqp import (
    AMQPMessage,
    AMQPSequence,
    AMQPValue,
    Char,
    Decimal32,
    Described,
    Float32,
    Properties,
    Symbol,
    Timestamp,
    UInt,
    Value,
    decode_message,
    encode_message,
    encode_value,
)
from gateway.core.internal import HOPS_HEADER
from gateway.core.message import Message, Origin
from gateway.protocols.stream import mapping
from gateway.protocols.stream.mapping import (
    ORIGIN_HEADER,
    RECIPIENTS_HEADER,
    SENDER_HEADER,
    TIMESTAMP_HEADER,
    durable_entry,
    entry_from_message,
    message_from_entry,
)

try:
    import rstream
except ImportError:  # pragma: no cover - the interop tests say why they skip
    rstream = None

needs_rstream = pytest.mark.skipif(
    rstream is None,
    reason="rstream is not installed (pip install rstream): the interop tests need "
    "messages written and read by a client we did not write",
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The gateway's own application properties (hypothesis draws the code's string constants too).
RESERVED = {SENDER_HEADER, RECIPIENTS_HEADER, TIMESTAMP_HEADER, ORIGIN_HEADER, HOPS_HEADER}

header_values = st.one_of(
    st.text(max_size=30),
    st.binary(max_size=30),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
)
messages = st.builds(
    Message,
    body=st.binary(max_size=300),
    address=st.text(max_size=20),
    id=st.text(max_size=30),
    sender=st.none() | st.text(max_size=20),
    recipients=st.lists(st.text(max_size=20), max_size=4).map(tuple),
    headers=st.dictionaries(
        st.text(max_size=20).filter(lambda key: key not in RESERVED), header_values, max_size=6
    ),
    timestamp=st.floats(allow_nan=False, allow_infinity=False).filter(bool),
)


def entry_of(message: AMQPMessage) -> bytes:
    """An entry as a foreign AMQP client would store it."""
    return encode_message(message)


# --- round trips ---------------------------------------------------------------------


@FAST
@given(messages, st.floats(0, 2e9))
def test_round_trip(message: Message, stored_at: float) -> None:
    """Message to entry and back keeps body, id, sender, recipients, headers and timestamp."""
    entry = entry_from_message(message)
    back = message_from_entry(entry, stream=message.address, timestamp=stored_at, offset=7)
    assert back == message
    assert {type(value) for value in back.headers.values()} <= {str, bytes, bool, int, float}
    for key, value in message.headers.items():
        assert type(back.headers[key]) is type(value)


@FAST
@given(messages)
def test_entries_are_amqp_messages_with_the_documented_sections(message: Message) -> None:
    """An entry carries the id, the address as ``to``, the creation time and one data section."""
    decoded = decode_message(entry_from_message(message))
    assert decoded.body == message.body
    assert decoded.properties is not None
    assert decoded.properties.message_id == message.id
    assert decoded.properties.to == message.address
    assert decoded.properties.subject is None
    milliseconds = message.timestamp * 1000
    in_range = -(2**63) <= milliseconds < 2**63
    assert decoded.properties.creation_time == (round(milliseconds) if in_range else None)
    assert decoded.application_properties is not None
    assert decoded.application_properties[TIMESTAMP_HEADER] == message.timestamp


def test_entry_bytes() -> None:
    """A small message is stored as exactly these bytes (properties, timestamp, data)."""
    message = Message(body=b"hi", address="orders", id="m-1", timestamp=1700000000.5)
    assert entry_from_message(message) == bytes.fromhex(
        "00 53 73 c0 1e 0a a1 03 6d 2d 31 40 a1 06 6f 72 64 65 72 73"
        " 40 40 40 40 40 40 83 00 00 01 8b cf e5 69 f4"
        " 00 53 74 c1 1f 02 a1 13 78 2d 67 61 74 65 77 61 79 2d 74 69 6d 65 73 74 61 6d 70"
        " 82 41 d9 54 fc 40 20 00 00"
        " 00 53 75 a0 02 68 69"
    )


def test_unset_fields_are_left_out() -> None:
    """Without headers, sender, recipients or timestamp there are no application properties."""
    entry = entry_from_message(Message(body=b"", address="a", id="x"))
    assert entry == bytes.fromhex("00 53 73 c0 08 03 a1 01 78 40 a1 01 61 00 53 75 a0 00")
    back = message_from_entry(entry, stream="a", timestamp=12.5)
    assert back == Message(body=b"", address="a", id="x", timestamp=12.5)


def test_unset_timestamp_becomes_the_entry_timestamp() -> None:
    """A message without a timestamp (0) takes the entry's timestamp on the way back."""
    message = Message(body=b"x", address="s", id="i", sender="a", recipients=("b",))
    decoded = decode_message(entry_from_message(message))
    assert decoded.properties is not None
    assert decoded.properties.creation_time is None
    assert decoded.application_properties == {SENDER_HEADER: "a", RECIPIENTS_HEADER: "b"}
    assert message_from_entry(entry_from_message(message), stream="s", timestamp=99.0) == (
        Message(body=b"x", address="s", id="i", sender="a", recipients=("b",), timestamp=99.0)
    )


def test_recipients_with_commas_and_percent_signs() -> None:
    """Recipients are comma-joined with ``%`` and ``,`` escaped, and split back exactly."""
    message = Message(
        body=b"",
        address="s",
        id="i",
        recipients=('"a,b"@example.com', "50%", "%2C", ""),
        timestamp=1.0,
    )
    decoded = decode_message(entry_from_message(message))
    assert decoded.application_properties is not None
    assert decoded.application_properties[RECIPIENTS_HEADER] == ('"a%2Cb"@example.com,50%25,%252C,')
    assert message_from_entry(entry_from_message(message), stream="s", timestamp=1.0) == message


def test_reserved_header_names_give_way_to_the_message_fields() -> None:
    """Headers named like the gateway fields are replaced by the message's own fields."""
    message = Message(
        body=b"",
        address="s",
        id="i",
        sender="real",
        headers={SENDER_HEADER: "fake", RECIPIENTS_HEADER: "fake", TIMESTAMP_HEADER: 5.0},
        timestamp=3.0,
    )
    back = message_from_entry(entry_from_message(message), stream="s", timestamp=0.0)
    assert back == Message(body=b"", address="s", id="i", sender="real", timestamp=3.0)


def test_surrogate_escaped_text_round_trips_as_binary() -> None:
    """Ids, senders and recipients decoded from bytes with surrogate escapes survive exactly."""
    message = Message(
        body=b"",
        address="s",
        id="id-\udcff",
        sender="\udc80@example.com",
        recipients=("x\udce9@example.com",),
        timestamp=1.0,
    )
    entry = entry_from_message(message)
    decoded = decode_message(entry)
    assert decoded.properties is not None
    assert decoded.properties.message_id == b"id-\xff"
    assert message_from_entry(entry, stream="s", timestamp=1.0) == message


def test_what_amqp_cannot_carry_is_adapted() -> None:
    """Huge integers become text; invalid Unicode becomes bytes or loses its lone surrogates."""
    message = Message(
        body=b"b",
        address="s\ud800",
        id="i",
        headers={"big": 2**70, "small": -(2**63) - 1, "bad": "\ud800", "\ud800key": 1},
        timestamp=math.inf,
    )
    entry = entry_from_message(message)
    decoded = decode_message(entry)
    assert decoded.properties is not None
    assert decoded.properties.to == "s?"
    assert decoded.properties.creation_time is None
    assert decoded.application_properties == {
        "big": str(2**70),
        "small": str(-(2**63) - 1),
        "bad": b"\xed\xa0\x80",
        "?key": 1,
        TIMESTAMP_HEADER: math.inf,
    }


def test_header_values_of_other_types_are_carried_as_text() -> None:
    """A header value of a type the core does not define is stored as its text."""
    headers: dict[str, Any] = {"u": uuid.UUID(int=1), "n": None}
    message = Message(body=b"", address="s", id="i", headers=headers)
    decoded = decode_message(entry_from_message(message))
    assert decoded.application_properties == {"u": uuid.UUID(int=1), "n": "None"}
    back = message_from_entry(entry_from_message(message), stream="s", timestamp=1.0)
    assert back.headers == {"u": str(uuid.UUID(int=1)), "n": "None"}


# --- entries to messages -------------------------------------------------------------


@pytest.mark.parametrize("entry", [b"hello", b"", b"\x00", b"\x00\x53", b"\x00\x53\x6f raw"])
def test_raw_entries_pass_through(entry: bytes) -> None:
    """An entry that is not AMQP is the body, with no headers and the entry's timestamp."""
    message = message_from_entry(memoryview(entry), stream="logs", timestamp=17.5, offset=42)
    assert message == Message(body=entry, address="logs", id="logs:42", timestamp=17.5)
    assert type(message.body) is bytes


def test_entries_that_look_like_amqp_but_are_not_pass_through() -> None:
    """An entry that starts like a section but does not decode is passed on raw."""
    entry = b"\x00\x53\x75\xa0\x05ab"
    assert message_from_entry(entry, stream="s", timestamp=1.0, offset=3) == Message(
        body=entry, address="s", id="s:3", timestamp=1.0
    )


@pytest.mark.parametrize(
    ("entry", "address"),
    [
        (entry_from_message(Message(body=b"", address="elsewhere", id="i")), "elsewhere"),
        (entry_of(AMQPMessage(properties=Properties(to="queue"), body=b"")), "queue"),
        (entry_of(AMQPMessage(properties=Properties(subject="s"), body=b"")), "durable"),
        (entry_of(AMQPMessage(body=b"")), "durable"),
        (b"raw", "durable"),
    ],
)
def test_address_from_to(entry: bytes, address: str) -> None:
    """With ``address_from_to`` the address is the properties' ``to``, else the stream's name."""
    message = message_from_entry(entry, stream="durable", timestamp=1.0, address_from_to=True)
    assert message.address == address
    assert message_from_entry(entry, stream="durable", timestamp=1.0).address == "durable"


@FAST
@given(messages)
def test_round_trip_through_a_durable_stream(message: Message) -> None:
    """Stored in a stream of another name, a message keeps its address with ``address_from_to``."""
    entry = entry_from_message(message)
    back = message_from_entry(entry, stream="", timestamp=0.0, offset=1, address_from_to=True)
    assert back == message


def test_ids_without_offset_are_fresh() -> None:
    """Without a message-id or an offset, each entry gets a new id."""
    first = message_from_entry(b"x", stream="s", timestamp=1.0)
    second = message_from_entry(entry_of(AMQPMessage(body=b"x")), stream="s", timestamp=1.0)
    assert first.id != second.id
    third = message_from_entry(entry_of(AMQPMessage(body=b"x")), stream="s", timestamp=1, offset=9)
    assert third.id == "s:9"


@pytest.mark.parametrize(
    ("message_id", "expected"),
    [
        ("id-1", "id-1"),
        (7, "7"),
        (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"),
        (b"\x01a", "\x01a"),
        (b"\xff", "\udcff"),
        ("", ""),
    ],
)
def test_message_ids(message_id: Any, expected: str) -> None:
    """Each kind of message-id becomes a string id."""
    entry = entry_of(AMQPMessage(properties=Properties(message_id=message_id), body=b""))
    assert message_from_entry(entry, stream="s", timestamp=1.0).id == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"data", b"data"),
        (None, b""),
        (AMQPValue("h\u00e9llo"), "h\u00e9llo".encode()),
        (AMQPValue(b"bin"), b"bin"),
        (AMQPValue(None), b"\x40"),
        (AMQPValue({"a": 1}), encode_value({"a": 1})),
        (AMQPValue(Symbol("s")), b"s"),
        (AMQPSequence(([1], ["a"])), encode_value([1]) + encode_value(["a"])),
    ],
)
def test_bodies(body: Any, expected: bytes) -> None:
    """Data is the body; an amqp-value string is UTF-8; other values are their AMQP encoding."""
    entry = entry_of(AMQPMessage(properties=Properties(message_id="i"), body=body))
    assert message_from_entry(entry, stream="s", timestamp=1.0).body == expected


def test_typed_application_properties_become_plain_header_values() -> None:
    """AMQP's typed values map to plain Python header values; others to text; nulls are dropped."""
    described = Described(1, "x")
    entry = entry_of(
        AMQPMessage(
            application_properties={
                "ts": Timestamp(5),
                "sym": Symbol("s"),
                "u": UInt(3),
                "f32": Float32(1.5),
                "uuid": uuid.UUID(int=2),
                "dec": Decimal32(b"abcd"),
                "char": Char("c"),
                "described": described,
                "null": None,
            },
            body=b"",
        )
    )
    headers = message_from_entry(entry, stream="s", timestamp=1.0).headers
    assert dict(headers) == {
        "ts": 5,
        "sym": "s",
        "u": 3,
        "f32": 1.5,
        "uuid": str(uuid.UUID(int=2)),
        "dec": b"abcd",
        "char": "c",
        "described": str(described),
    }
    assert [type(value) for value in headers.values()] == [
        int, str, int, float, str, bytes, str, str,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1700000000.25, 1700000000.25),
        (17, 17.0),
        (Timestamp(1500), 1.5),
        ("soon", 9.0),
        (True, 9.0),
        (None, 9.0),
    ],
)
def test_gateway_timestamp_forms(value: Value, expected: float) -> None:
    """The gateway timestamp may be seconds or an AMQP timestamp; anything else is ignored."""
    entry = entry_of(AMQPMessage(application_properties={TIMESTAMP_HEADER: value}, body=b""))
    message = message_from_entry(entry, stream="s", timestamp=9.0)
    assert message.timestamp == expected
    assert message.headers == {}


def test_gateway_sender_and_recipients_forms() -> None:
    """Sender and recipients may be strings or binaries; escapes are read in either case."""
    entry = entry_of(
        AMQPMessage(
            application_properties={SENDER_HEADER: b"\xffa", RECIPIENTS_HEADER: "a%2cb,c%25"},
            body=b"",
        )
    )
    message = message_from_entry(entry, stream="s", timestamp=1.0)
    assert message.sender == "\udcffa"
    assert message.recipients == ("a,b", "c%")


# --- interop with rstream ----------------------------------------------------------------


@needs_rstream
def test_rstream_messages_map_to_messages() -> None:
    """A message published with rstream's `AMQPMessage` maps to the expected message."""
    assert rstream is not None
    sent = rstream.AMQPMessage(
        body=b"payload",
        application_properties={
            "k": "v",
            "n": 1,
            "big": 2**40,
            "f": 1.5,
            "b": True,
            "raw": b"\x00",
            "none": None,
            SENDER_HEADER: "alice",
            RECIPIENTS_HEADER: "bob,carol",
            TIMESTAMP_HEADER: 1700000000.5,
        },
        properties=rstream.Properties(message_id="id-1", subject="ignored", to="ignored"),
    )
    assert message_from_entry(bytes(sent), stream="orders", timestamp=5.0, offset=1) == Message(
        body=b"payload",
        address="orders",
        id="id-1",
        sender="alice",
        recipients=("bob", "carol"),
        headers={"k": "v", "n": 1, "big": 2**40, "f": 1.5, "b": True, "raw": b"\x00"},
        timestamp=1700000000.5,
    )


@needs_rstream
@pytest.mark.parametrize(
    ("kwargs", "body", "message_id"),
    [
        ({"body": b"x", "properties": "7"}, b"x", "7"),
        ({"value": "h\u00e9"}, "h\u00e9".encode(), "s:3"),
        ({"value": b"bin"}, b"bin", "s:3"),
        ({"body": b""}, b"", "s:3"),
        ({"sequence": [[1, "a"]]}, encode_value([1, "a"]), "s:3"),
    ],
)
def test_rstream_bodies_and_ids(kwargs: dict[str, Any], body: bytes, message_id: str) -> None:
    """The data, value and sequence bodies and ulong ids of rstream map as documented."""
    assert rstream is not None
    if kwargs.get("properties") == "7":
        kwargs = {**kwargs, "properties": rstream.Properties(message_id=7)}
    message = message_from_entry(
        bytes(rstream.AMQPMessage(**kwargs)), stream="s", timestamp=2.0, offset=3
    )
    assert message.body == body
    assert message.id == message_id


@needs_rstream
@FAST
@given(messages)
def test_rstream_reads_our_entries(message: Message) -> None:
    """The rstream `amqp_decoder` reads our entries: body, id, address, gateway fields, headers."""
    assert rstream is not None
    received = rstream.amqp_decoder(entry_from_message(message))
    assert received.body == message.body
    assert received.properties.message_id == message.id.encode()
    assert received.properties.to == message.address.encode()
    properties = received.application_properties
    assert properties[TIMESTAMP_HEADER.encode()] == message.timestamp
    if message.sender is not None:
        assert properties[SENDER_HEADER.encode()] == message.sender.encode()
    for key, value in message.headers.items():
        assert properties[key.encode()] == (value.encode() if isinstance(value, str) else value)


_ASCII = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)


@given(
    message_id=_ASCII.filter(bool),
    address=_ASCII.filter(bool),
    sender=st.none() | _ASCII,
    recipients=st.lists(_ASCII, max_size=3).map(tuple),
    headers=st.dictionaries(
        _ASCII | st.just(HOPS_HEADER),
        _ASCII | st.integers(-200, 200) | st.booleans(),
        max_size=4,
    ),
    body=st.binary(max_size=600),
    timestamp=st.sampled_from([0.0, 1700000000.123, 1.5]),
    hops=st.none() | st.integers(0, 200),
)
@settings(max_examples=300)
def test_direct_encoder_writes_what_the_general_one_writes(
    message_id: str,
    address: str,
    sender: str | None,
    recipients: tuple[str, ...],
    headers: dict[str, object],
    body: bytes,
    timestamp: float,
    hops: int | None,
) -> None:
    """The fast ASCII path and the general encoder give entries that decode the same.

    With a hop count too, which replaces the message's own header of that name.
    """
    message = Message(
        body=body,
        address=address,
        id=message_id,
        sender=sender,
        recipients=recipients,
        headers=headers,  # type: ignore[arg-type]
        timestamp=timestamp,
    )
    assert decode_message(entry_from_message(message, hops)) == decode_message(
        mapping._general_entry(message, hops)
    )
    decoded = message_from_entry(entry_from_message(message, hops), stream="s", timestamp=0.0)
    assert decoded == message_from_entry(
        mapping._general_entry(message, hops), stream="s", timestamp=0.0
    )
    if hops is not None:
        assert decoded.headers[HOPS_HEADER] == hops


def test_a_hop_count_keeps_the_fast_path() -> None:
    """A hop count, and small integer headers, are written by the direct encoder."""
    message = Message(
        body=b"b", address="echo", id="m", headers={"k": "v", "n": -3, HOPS_HEADER: 4}
    )
    fast = mapping._ascii_entry(message, 5)
    assert fast is not None
    assert message_from_entry(fast, stream="echo", timestamp=0.0).headers == {
        "k": "v",
        "n": -3,
        HOPS_HEADER: 5,
    }
    assert mapping._ascii_entry(message, 500) is None  # past a smallint: the general encoder
    assert (
        message_from_entry(entry_from_message(message, 500), stream="e", timestamp=0.0).headers[
            HOPS_HEADER
        ]
        == 500
    )


_SHARED_HEADERS = (
    {},
    {"ssmp.verb": "MCAST"},
    {"n": 1},
    {"n": True},  # equal to {"n": 1}, written otherwise
    {"k": "é"},  # not ASCII: the general encoder
)


@st.composite
def _runs(draw: st.DrawFn) -> list[tuple[Message, int | None]]:
    """Messages (with hop counts), each the one before with a new id and body.

    At most one other field changes from one to the next: runs that share an
    entry's middle, and every way one ends.
    """
    shared = [Message(body=b"", address="a", headers=h).headers for h in _SHARED_HEADERS]
    pools: dict[str, st.SearchStrategy[Any]] = {
        "address": st.sampled_from(["a", "stream.b", "x" * 250, "é"]),
        "sender": st.sampled_from([None, "alice", "bob", "ö"]),
        "recipients": st.sampled_from([(), ("a@b",), ("a,b", "c%d")]),
        "headers": st.sampled_from(shared) | st.sampled_from(_SHARED_HEADERS),
        "timestamp": st.sampled_from([0.0, -0.0, 1.5, 1700000000.25, 1e300, float("nan")])
        | st.floats(),
        "hops": st.sampled_from([None, 0, 1, 2, 127, 128]),
    }
    fields = {name: draw(pool) for name, pool in pools.items()}
    run = []
    for _ in range(draw(st.integers(min_value=1, max_value=12))):
        changed = draw(st.none() | st.sampled_from(sorted(pools)))
        if changed is not None:
            fields[changed] = draw(pools[changed])
        message_id = draw(st.sampled_from(["1", "gw-2", "i" * 240, "ü"]) | _ASCII.filter(bool))
        message = Message(
            body=draw(st.binary(max_size=300)),
            address=fields["address"],
            id=message_id,
            sender=fields["sender"],
            recipients=fields["recipients"],
            headers=fields["headers"],
            timestamp=fields["timestamp"],
        )
        run.append((message, fields["hops"]))
    return run


@given(_runs())
@settings(max_examples=300)
def test_entry_encoder_writes_entry_from_message_bytes(
    run: list[tuple[Message, int | None]],
) -> None:
    """One `EntryEncoder` over a run writes each entry as `entry_from_message` does.

    Byte for byte: with what it kept of the message before, or without.
    """
    encoder = mapping.EntryEncoder()
    for message, hops in run:
        assert encoder.entry(message, hops) == entry_from_message(message, hops)


def test_entry_encoder_rewrites_only_the_time_of_a_paced_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages alike but for their id, body and time: the kept middle is restamped.

    The encoder works its parts out once (`_ascii_tail`); each entry is
    still `entry_from_message`'s, byte for byte, and so is the entry after a
    time that cannot be a creation-time (zero, NaN, too large).
    """
    headers = Message(body=b"", address="a", headers={"ssmp.verb": "MCAST"}).headers
    times = [1700000000.0 + index / 10_000 for index in range(20)]
    times += [0.0, 1700000001.5, float("nan"), 1700000002.5, 1e300, 1700000003.5]
    run = [
        Message(
            body=b"m%d" % index,
            address="bench",
            id=f"gw-{index}",
            sender="peer",
            headers=headers,
            timestamp=timestamp,
        )
        for index, timestamp in enumerate(times)
    ]
    expected = [entry_from_message(message) for message in run]
    worked_out: list[float] = []
    general = mapping._ascii_tail

    def noted(message: Message, hops: int | None) -> object:
        worked_out.append(message.timestamp)
        return general(message, hops)

    monkeypatch.setattr(mapping, "_ascii_tail", noted)
    encoder = mapping.EntryEncoder()
    assert [encoder.entry(message) for message in run] == expected
    # Once for the run, then for each time without a creation-time and the one after it.
    assert len(worked_out) == 1 + 2 * 3


@given(_runs(), st.lists(st.booleans(), max_size=12))
@settings(max_examples=200)
def test_durable_entries_write_durable_entry_bytes(
    run: list[tuple[Message, int | None]], read: list[bool]
) -> None:
    """`mapping.durable_entries` of a batch is `durable_entry` of each message, byte for byte.

    Messages that a consumer read (with an origin) among them or not. They
    are frozen entries (the log keeps them without asking each): all bytes.
    """
    batch = [
        attrs.evolve(message, origin=Origin("reader@stream", index))
        if index < len(read) and read[index]
        else message
        for index, (message, _hops) in enumerate(run)
    ]
    entries = mapping.durable_entries(batch)
    assert entries == [durable_entry(message) for message in batch]
    assert type(entries) is osiris.FrozenEntries
    assert all(type(entry) is bytes for entry in entries)
