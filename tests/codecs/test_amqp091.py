"""Tests for `gateway.codecs.amqp091`: the frames of a DMP principal connection.

Frames written by hand from the AMQP 0-9-1 grammar (type, channel, size,
payload, 0xCE; class and method ids; short and long strings), every method
round tripped through any split, garbage that gives events or the codec's
error and nothing else, and the limits.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import amqp091
from gateway.codecs.amqp091 import METHODS, AMQPError, FrameCodec, HeartbeatFrame, Method
from tests.codec_checks import (
    assert_events_or_error,
    assert_split_error,
    assert_split_invariant,
    chunkings,
    feed,
)

# Channel.Open on channel 1: type 1, channel 1, size 5, class 20, method 10, reserved "" , end.
CHANNEL_OPEN = b"\x01\x00\x01\x00\x00\x00\x05\x00\x14\x00\x0a\x00\xce"
# Direct.Put "orders" on channel 1: class 61500 (0xF03C), method 10.
DIRECT_PUT = b"\x01\x00\x01\x00\x00\x00\x0b\xf0\x3c\x00\x0a\x06orders\xce"
HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


def test_frames_by_hand_decode() -> None:
    """Channel.Open, Direct.Put and a heartbeat, bytes from the grammar, decode in any split."""
    expected = [
        Method(channel=1, name="channel.open", arguments={"reserved_1": ""}),
        Method(channel=1, name="direct.put", arguments={"sink": "orders"}),
        HeartbeatFrame(),
    ]
    assert_split_invariant(
        FrameCodec, CHANNEL_OPEN + DIRECT_PUT + HEARTBEAT, expected, trailing=[b"\x01\x00"]
    )


def test_frames_by_hand_encode() -> None:
    """The encoder writes the same bytes as the hand-made frames."""
    assert (
        amqp091.encode_method(Method(channel=1, name="channel.open", arguments={"reserved_1": ""}))
        == CHANNEL_OPEN
    )
    assert (
        amqp091.encode_method(Method(channel=1, name="direct.put", arguments={"sink": "orders"}))
        == DIRECT_PUT
    )
    assert amqp091.encode_heartbeat() == HEARTBEAT


def test_start_ok_by_hand() -> None:
    """Connection.Start-Ok with PLAIN: table, short string, long string, short string."""
    response = b"\x00alice\x00pw"
    payload = (
        struct.pack(">HH", 10, 11)
        + b"\x00\x00\x00\x00"  # empty client-properties
        + b"\x05PLAIN"
        + struct.pack(">I", len(response))
        + response
        + b"\x05en_US"
    )
    frame = struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce"
    [method] = FrameCodec().receive_data(frame)
    assert method == Method(
        channel=0,
        name="connection.start-ok",
        arguments={
            "client_properties": {},
            "mechanism": "PLAIN",
            "response": response,
            "locale": "en_US",
        },
    )


_SHORT_TEXT = st.text(max_size=20).filter(lambda t: len(t.encode("utf-8")) <= 255)
_VALUES = {
    "octet": st.integers(0, 255),
    "short": st.integers(0, 65535),
    "long": st.integers(0, 2**32 - 1),
    "shortstr": _SHORT_TEXT,
    "longstr": st.binary(max_size=40),
    "bit": st.booleans(),
    "table": st.dictionaries(
        _SHORT_TEXT, st.integers(-(2**31), 2**31 - 1) | _SHORT_TEXT, max_size=3
    ),
}


@st.composite
def methods(draw: st.DrawFn) -> Method:
    """Any known method with arbitrary arguments of the right types."""
    name, fields = draw(st.sampled_from(sorted(METHODS.values())))
    arguments = {field: draw(_VALUES[kind]) for field, kind in fields}
    return Method(channel=draw(st.integers(0, 65535)), name=name, arguments=arguments)


@given(st.data())
def test_round_trip(data: st.DataObject) -> None:
    """Any method sequence, encoded and cut at random points, decodes to the same methods."""
    sent = data.draw(st.lists(methods(), min_size=1, max_size=4))
    wire = b"".join(amqp091.encode_method(m) for m in sent)
    chunks = data.draw(chunkings(wire))
    assert feed(FrameCodec(), chunks) == sent


@given(st.lists(st.binary(max_size=40), max_size=4))
def test_garbage_gives_events_or_our_error(chunks: list[bytes]) -> None:
    """Arbitrary bytes give frames or AMQPError, and a failed codec stays failed."""
    assert_events_or_error(FrameCodec, chunks, AMQPError, event_types=(Method, HeartbeatFrame))


def test_garbage_ids_after_a_good_frame() -> None:
    """An unknown method is 540 after the good frame before it, in any split."""
    unknown = (
        b"\x01\x00\x00\x00\x00\x00\x04\x00\x3c\x00\x28\xce"  # class 60 method 40: Basic.Publish
    )
    good = Method(channel=1, name="channel.open", arguments={"reserved_1": ""})
    errors = assert_split_error(FrameCodec, CHANNEL_OPEN + unknown, AMQPError, [good])
    assert {e.code for e in errors if isinstance(e, AMQPError)} == {540}
    with pytest.raises(AMQPError) as caught:
        FrameCodec().receive_data(unknown)
    assert (caught.value.code, caught.value.class_id, caught.value.method_id) == (540, 60, 40)


@pytest.mark.parametrize(
    ("frame", "code", "kind"),
    [
        (CHANNEL_OPEN[:-1] + b"\x00", 501, "bad-frame-end"),
        (b"\x03\x00\x01\x00\x00\x00\x00\xce", 505, "unexpected-frame"),
        (b"\x09\x00\x00\x00\x00\x00\x00\xce", 501, "bad-frame"),
        (b"\x08\x00\x01\x00\x00\x00\x00\xce", 501, "bad-frame"),
        (b"\x01\x00\x00\x00\x00\x00\x01\x00\xce", 501, "bad-frame"),
        # Direct.Put whose short string says 7 but holds 6 octets.
        (b"\x01\x00\x01\x00\x00\x00\x0b\xf0\x3c\x00\x0a\x07orders\xce", 502, "malformed"),
        # Channel.Open with an octet after its last argument.
        (b"\x01\x00\x01\x00\x00\x00\x06\x00\x14\x00\x0a\x00\x00\xce", 502, "malformed"),
        # Direct.Get whose feed name is not UTF-8.
        (b"\x01\x00\x01\x00\x00\x00\x06\xf0\x3c\x00\x14\x01\xff\xce", 502, "malformed"),
    ],
)
def test_refusals(frame: bytes, code: int, kind: str) -> None:
    """Each defect has its reply code and kind; the codec is dead after it."""
    codec = FrameCodec()
    with pytest.raises(AMQPError) as caught:
        codec.receive_data(frame)
    assert (caught.value.code, caught.value.kind) == (code, kind)
    with pytest.raises(AMQPError):
        codec.receive_data(HEARTBEAT)


def test_oversize_frame_fails_before_its_payload() -> None:
    """A declared size past frame-max fails on the 7-octet header alone."""
    codec = FrameCodec(4096)
    with pytest.raises(AMQPError) as caught:
        codec.receive_data(struct.pack(">BHI", 1, 0, 4089))
    assert caught.value.kind == "too-large"
    assert feed(FrameCodec(4096), [struct.pack(">BHI", 8, 0, 0), b"\xce"]) == [HeartbeatFrame()]


def test_encoder_refuses_what_it_cannot_carry() -> None:
    """Unknown methods, missing arguments and out-of-range values are local errors."""
    with pytest.raises(amqp091.AMQPLocalError):
        amqp091.encode_method(Method(channel=0, name="basic.publish"))
    with pytest.raises(amqp091.AMQPLocalError):
        amqp091.encode_method(Method(channel=0, name="direct.put"))
    with pytest.raises(amqp091.AMQPLocalError):
        amqp091.encode_method(
            Method(
                channel=0,
                name="connection.tune",
                arguments={"channel_max": 70000, "frame_max": 0, "heartbeat": 0},
            )
        )
    with pytest.raises(amqp091.AMQPLocalError):
        amqp091.encode_method(Method(channel=0, name="direct.put", arguments={"sink": "x" * 256}))
