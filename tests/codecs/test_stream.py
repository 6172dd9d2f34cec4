"""Tests for `gateway.codecs.stream`, the sans-IO RabbitMQ Stream frame codec.

The reference is docs/stream-protocol-notes.md. The five families of
STYLE.md, section 7: every byte example of the notes (sections 11 and 13:
rstream's client frames and the server responses rstream decodes), decoded in
the role that reads them and re-encoded byte for byte; the split check in
both roles; hypothesis round trips of every event type; hypothesis garbage;
and the limits (frame max before the body, unknown frames, truncated
fields). Plus the exactness rules of sections 5 and 14, the hot-path
contracts (Publish as memoryview slices, `deliver_prefix`) and ``send``'s
role checks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.codecs import stream
from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.framing import LengthPrefixError, LengthPrefixReader
from gateway.codecs.stream import (
    HEARTBEAT,
    Broker,
    Close,
    CloseResponse,
    CommandVersion,
    ConsumerUpdate,
    ConsumerUpdateResponse,
    Create,
    Credit,
    DeclarePublisher,
    Deliver,
    ExchangeCommandVersions,
    ExchangeCommandVersionsResponse,
    Key,
    Metadata,
    MetadataResponse,
    OffsetKind,
    OffsetSpec,
    Open,
    OpenResponse,
    PeerProperties,
    PeerPropertiesResponse,
    Publish,
    PublishConfirm,
    QueryOffset,
    QueryPublisherSequence,
    QueryPublisherSequenceResponse,
    Response,
    Role,
    SaslAuthenticate,
    SaslAuthenticateResponse,
    SaslHandshake,
    SaslHandshakeResponse,
    StoreOffset,
    StreamCodec,
    StreamError,
    StreamLocalError,
    StreamMetadata,
    Subscribe,
    Tune,
)
from tests.codec_checks import (
    assert_events_or_error,
    assert_split_error,
    assert_split_invariant,
    assert_truncation_reported,
    chunkings,
    feed,
)
from tests.strategies import (
    stream_client_event_strategies,
    stream_client_events,
    stream_server_event_strategies,
    stream_server_events,
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

EVENT_TYPES: tuple[type, ...] = stream.Event.__args__  # type: ignore[attr-defined]


def server(frame_max: int = 0) -> StreamCodec:
    """A fresh server-role codec (it reads what clients send); no frame limit by default."""
    return StreamCodec(Role.SERVER, frame_max=frame_max)


def client(frame_max: int = 0) -> StreamCodec:
    """A fresh client-role codec (it reads what servers send); no frame limit by default."""
    return StreamCodec(Role.CLIENT, frame_max=frame_max)


def hexes(text: str) -> bytes:
    """Bytes from the notes' hex notation: pairs of hex digits, with quoted ASCII between.

    ``00 05 "PLAIN"`` gives the bytes 0, 5 and ``PLAIN``; ``|`` separators are ignored.
    """
    out = bytearray()
    for index, part in enumerate(text.replace("|", " ").split('"')):
        out += part.encode("ascii") if index % 2 else bytes.fromhex(part)
    return bytes(out)


def frame(key: int, version: int, body: bytes) -> bytes:
    """A frame with a correct size prefix around ``key``, ``version`` and ``body``."""
    return struct.pack(">IHH", 4 + len(body), key, version) + body


def error_of(codec: StreamCodec, data: bytes) -> StreamError:
    """The error ``codec`` raises on ``data``, fed whole."""
    with pytest.raises(StreamError) as info:
        codec.receive_data(data)
    return info.value


# --- (1) the notes' byte examples, both directions -------------------------------------

# Notes, section 11: the AMQP message of the Deliver example (22 bytes), also
# used as the body of the Publish v1 example, whose 22-byte message the notes
# elide.
AMQP_22 = hexes("00 53 74 c1 07 02 a1 01 6b a1 01 76 00 53 75 a0 05 68 65 6c 6c 6f")

# Notes, section 13, "Connect" and "Client frames": what rstream sends.
CLIENT_EXAMPLES: list[tuple[str, str, stream.Event]] = [
    ("SaslHandshake", "00 00 00 08 00 12 00 01 00 00 00 02", SaslHandshake(correlation_id=2)),
    (
        "SaslAuthenticate",
        '00 00 00 1f 00 13 00 01 00 00 00 03 00 05 "PLAIN" 00 00 00 0c 00 "guest" 00 "guest"',
        SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\x00guest\x00guest"),
    ),
    (
        "Tune reply",
        "00 00 00 0c 00 14 00 01 00 10 00 00 00 00 00 3c",
        Tune(frame_max=1_048_576, heartbeat=60),
    ),
    ("Heartbeat", "00 00 00 04 00 17 00 01", HEARTBEAT),
    (
        "Open",
        "00 00 00 0b 00 15 00 01 00 00 00 04 00 01 2f",
        Open(correlation_id=4, virtual_host="/"),
    ),
    (
        "DeclarePublisher",
        "00 00 00 0f 00 01 00 01 00 00 00 05 00 00 00 00 02 73 31",
        DeclarePublisher(correlation_id=5, publisher_id=0, reference="", stream="s1"),
    ),
    (
        "QueryPublisherSequence",
        '00 00 00 11 00 05 00 01 00 00 00 06 00 03 "ref" 00 02 "s1"',
        QueryPublisherSequence(correlation_id=6, reference="ref", stream="s1"),
    ),
    (
        "Publish v1",
        "00 00 00 2b 00 02 00 01 00 | 00 00 00 01 | 00 00 00 00 00 00 00 01 | 00 00 00 16"
        + AMQP_22.hex(),
        Publish(publisher_id=0, publishing_ids=[1], messages=[AMQP_22]),
    ),
    (
        "Publish v2",
        "00 00 00 19 00 02 00 02 00 | 00 00 00 01 | 00 00 00 00 00 00 00 01 | 00 01 66"
        " | 00 00 00 01 78",
        Publish(
            publisher_id=0, publishing_ids=[1], messages=[b"x"], version=2, filter_values=["f"]
        ),
    ),
    (
        "Subscribe first",
        "00 00 00 15 00 07 00 01 00 00 00 07 00 00 02 73 31 00 01 00 0a 00 00 00 00",
        Subscribe(
            correlation_id=7,
            subscription_id=0,
            stream="s1",
            offset_spec=OffsetSpec(kind=OffsetKind.FIRST),
            credit=10,
            properties={},
        ),
    ),
    (
        "Subscribe offset",
        "00 00 00 26 00 07 00 01 00 00 00 08 00 00 02 73 31 00 04 00 00 00 00 00 00 00 2a"
        ' 00 0a 00 00 00 01 00 04 "name" 00 01 "c"',
        Subscribe(
            correlation_id=8,
            subscription_id=0,
            stream="s1",
            offset_spec=OffsetSpec(kind=OffsetKind.OFFSET, value=42),
            credit=10,
            properties={"name": "c"},
        ),
    ),
    ("Credit", "00 00 00 07 00 09 00 01 00 00 01", Credit(subscription_id=0, credit=1)),
    (
        "StoreOffset",
        '00 00 00 13 00 0a 00 01 00 01 "c" 00 02 "s1" 00 00 00 00 00 00 00 2a',
        StoreOffset(reference="c", stream="s1", offset=42),
    ),
    (
        "QueryOffset",
        '00 00 00 0f 00 0b 00 01 00 00 00 09 00 01 "c" 00 02 "s1"',
        QueryOffset(correlation_id=9, reference="c", stream="s1"),
    ),
    (
        "Metadata",
        '00 00 00 10 00 0f 00 01 00 00 00 0a 00 00 00 01 00 02 "s1"',
        Metadata(correlation_id=10, streams=("s1",)),
    ),
    (
        "Create",
        '00 00 00 28 00 0d 00 01 00 00 00 0d 00 02 "s1" 00 00 00 01 00 10 "max-length-bytes"'
        ' 00 04 "1000"',
        Create(correlation_id=13, stream="s1", arguments={"max-length-bytes": "1000"}),
    ),
    (
        "Close",
        '00 00 00 0e 00 16 00 01 00 00 00 0b 00 01 00 02 "OK"',
        Close(correlation_id=11, code=1, reason="OK"),
    ),
    (
        "ExchangeCommandVersions",
        "00 00 00 12 00 1b 00 01 00 00 00 0c 00 00 00 01 00 02 00 01 00 02",
        ExchangeCommandVersions(
            correlation_id=12, versions=(CommandVersion(key=2, min_version=1, max_version=2),)
        ),
    ),
    (
        "ConsumerUpdateResponse",
        "00 00 00 14 80 1a 00 01 00 00 00 00 00 01 00 03 00 00 00 00 00 00 00 00",
        ConsumerUpdateResponse(
            correlation_id=0,
            code=1,
            offset_spec=OffsetSpec(kind=OffsetKind.NEXT),
            ignored=bytes(8),
        ),
    ),
]

# Notes, section 5 0x001b: the reference server's list, in its order.
SERVER_VERSIONS = tuple(
    CommandVersion(key=key, min_version=1, max_version=2 if key == 2 else 1)
    for key in (1, 2, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 22, 23, 24, 25, 28, 29, 30, 31)
)

# Notes, section 13, "Server responses in the exact shapes rstream decodes".
SERVER_EXAMPLES: list[tuple[str, str, stream.Event]] = [
    (
        "PeerPropertiesResponse",
        '00 00 00 1a 80 11 00 01 00 00 00 01 00 01 00 00 00 01 00 07 "product" 00 01 "X"',
        PeerPropertiesResponse(correlation_id=1, code=1, properties={"product": "X"}),
    ),
    (
        "SaslHandshakeResponse",
        '00 00 00 15 80 12 00 01 00 00 00 02 00 01 00 00 00 01 00 05 "PLAIN"',
        SaslHandshakeResponse(correlation_id=2, code=1, mechanisms=("PLAIN",)),
    ),
    (
        "SaslAuthenticateResponse OK",
        "00 00 00 0a 80 13 00 01 00 00 00 03 00 01",
        SaslAuthenticateResponse(correlation_id=3, code=1),
    ),
    (
        "Tune",
        "00 00 00 0c 00 14 00 01 00 10 00 00 00 00 00 3c",
        Tune(frame_max=1_048_576, heartbeat=60),
    ),
    (
        "OpenResponse",
        '00 00 00 41 80 15 00 01 00 00 00 04 00 01 00 00 00 02 00 0f "advertised_host"'
        ' 00 09 "localhost" 00 0f "advertised_port" 00 04 "5552"',
        OpenResponse(
            correlation_id=4,
            code=1,
            properties={"advertised_host": "localhost", "advertised_port": "5552"},
        ),
    ),
    (
        "MetadataResponse",
        '00 00 00 2d 80 0f 00 01 00 00 00 0a | 00 00 00 01 | 00 00 00 09 "localhost" 00 00 15 b0'
        ' | 00 00 00 01 | 00 02 "s1" 00 01 00 00 00 00 00 00',
        MetadataResponse(
            correlation_id=10,
            brokers=(Broker(reference=0, host="localhost", port=5552),),
            streams=(StreamMetadata(stream="s1", code=1, leader=0, replicas=()),),
        ),
    ),
    (
        "DeclarePublisherResponse",
        "00 00 00 0a 80 01 00 01 00 00 00 05 00 01",
        Response(key=Key.DECLARE_PUBLISHER, correlation_id=5, code=1),
    ),
    (
        "QueryPublisherSequenceResponse",
        "00 00 00 12 80 05 00 01 00 00 00 06 00 01 00 00 00 00 00 00 00 00",
        QueryPublisherSequenceResponse(correlation_id=6, code=1, sequence=0),
    ),
    (
        "SubscribeResponse",
        "00 00 00 0a 80 07 00 01 00 00 00 07 00 01",
        Response(key=Key.SUBSCRIBE, correlation_id=7, code=1),
    ),
    (
        "PublishConfirm",
        "00 00 00 11 00 03 00 01 00 00 00 00 01 00 00 00 00 00 00 00 01",
        PublishConfirm(publisher_id=0, publishing_ids=[1]),
    ),
    (
        "CloseResponse",
        "00 00 00 0a 80 16 00 01 00 00 00 0b 00 01",
        CloseResponse(correlation_id=11, code=1),
    ),
    (
        "ExchangeCommandVersionsResponse",
        "00 00 00 86 80 1b 00 01 00 00 00 0c 00 01 00 00 00 14"
        + "".join(f"{v.key:04x}{v.min_version:04x}{v.max_version:04x}" for v in SERVER_VERSIONS),
        ExchangeCommandVersionsResponse(correlation_id=12, code=1, versions=SERVER_VERSIONS),
    ),
]

# Notes, section 11: Deliver v1 of a chunk with two simple entries.
DELIVER_HEADER = hexes(
    "50 00 00 02 00 00 00 02  00 00 01 8b cf e5 68 00  00 00 00 00 00 00 00 01"
    " 00 00 00 00 00 00 00 00  0b e6 9c f3  00 00 00 21  00 00 00 00  00 00 00 00"
)
DELIVER_DATA = b"\x00\x00\x00\x16" + AMQP_22 + b"\x00\x00\x00\x03raw"
DELIVER_WIRE = hexes("00 00 00 56 00 08 00 01 00") + DELIVER_HEADER + DELIVER_DATA


@pytest.mark.parametrize(
    ("text", "event"), [case[1:] for case in CLIENT_EXAMPLES], ids=[c[0] for c in CLIENT_EXAMPLES]
)
def test_client_example_read_by_server_and_written_by_client(
    text: str, event: stream.Event
) -> None:
    """Notes, section 13: each rstream client frame reads in the server role, re-encodes exactly."""
    wire = hexes(text)
    assert server().receive_data(wire) == [event]
    assert client().send(event) == wire
    assert stream.encode(event) == wire


@pytest.mark.parametrize(
    ("text", "event"), [case[1:] for case in SERVER_EXAMPLES], ids=[c[0] for c in SERVER_EXAMPLES]
)
def test_server_example_read_by_client_and_written_by_server(
    text: str, event: stream.Event
) -> None:
    """Notes, section 13: each server response reads in the client role, re-encodes exactly."""
    wire = hexes(text)
    assert client().receive_data(wire) == [event]
    assert server().send(event) == wire
    assert stream.encode(event) == wire


def test_example_sizes_match_their_contents() -> None:
    """Every example's size field counts exactly the bytes after it (the hex was copied whole)."""
    for _, text, _ in CLIENT_EXAMPLES + SERVER_EXAMPLES:
        wire = hexes(text)
        assert struct.unpack_from(">I", wire)[0] == len(wire) - 4, text
    assert len(DELIVER_HEADER) == 48
    assert len(DELIVER_DATA) == 0x21


def test_peer_properties_example_header() -> None:
    """Notes, section 13: PeerProperties starts ``00 11 00 01 00 00 00 01 00 00 00 05``.

    The notes elide the five properties (and their size field, 0x26, cannot
    hold them), so only the bytes after the size are checked, for rstream's
    five keys.
    """
    properties = {
        "connection_name": "rstream-locator",
        "product": "RabbitMQ Stream",
        "platform": "Python",
        "version": "1.0.1",
        "license": "MIT",
    }
    event = PeerProperties(correlation_id=1, properties=properties)
    wire = client().send(event)
    assert wire[4:16] == hexes("00 11 00 01 00 00 00 01 00 00 00 05")
    assert server().receive_data(wire) == [event]


def test_deliver_example_read_by_client() -> None:
    """Notes, section 11: the Deliver v1 example is subscription 0 and the chunk, untouched."""
    (event,) = client().receive_data(DELIVER_WIRE)
    assert event == Deliver(subscription_id=0, chunk=DELIVER_HEADER + DELIVER_DATA)
    assert isinstance(event, Deliver)
    assert isinstance(event.chunk, memoryview)


def test_deliver_example_written_by_server_and_by_prefix() -> None:
    """The server writes the example exactly, whole or as `deliver_prefix` plus the payload."""
    payload = DELIVER_HEADER + DELIVER_DATA
    assert server().send(Deliver(subscription_id=0, chunk=payload)) == DELIVER_WIRE
    prefix = stream.deliver_prefix(0, len(payload))
    assert prefix == DELIVER_WIRE[:9]
    assert prefix + payload == DELIVER_WIRE


def test_sub_batch_publish_example() -> None:
    """Notes, section 13, PublishSubBatching: the entry is kept raw, from its flags byte on."""
    batch = b"\x00\x00\x00\x01a\x00\x00\x00\x02bc"
    entry = struct.pack(">BHII", 0x80, 2, len(batch), len(batch)) + batch
    wire = frame(Key.PUBLISH, 1, b"\x07" + struct.pack(">IQ", 1, 9) + entry)
    (event,) = server().receive_data(wire)
    assert event == Publish(
        publisher_id=7, publishing_ids=[9], messages=[entry], sub_batches=[True]
    )
    assert client().send(event) == wire


def test_client_session_decodes_in_order() -> None:
    """The rstream frames, pipelined in one read, decode to their events in order."""
    wire = b"".join(hexes(text) for _, text, _ in CLIENT_EXAMPLES)
    assert server().receive_data(wire) == [event for _, _, event in CLIENT_EXAMPLES]


# --- (2) the split check, both roles -----------------------------------------------------

CLIENT_STREAM = b"".join(hexes(text) for _, text, _ in CLIENT_EXAMPLES)
CLIENT_EVENTS = [event for _, _, event in CLIENT_EXAMPLES]
SERVER_STREAM = b"".join(hexes(text) for _, text, _ in SERVER_EXAMPLES) + DELIVER_WIRE
SERVER_EVENTS = [event for _, _, event in SERVER_EXAMPLES] + [
    Deliver(subscription_id=0, chunk=DELIVER_HEADER + DELIVER_DATA)
]


def test_split_invariant_server_role() -> None:
    """Client frames decode the same whole, byte by byte, cut anywhere, or before a partial one."""
    assert_split_invariant(
        server,
        CLIENT_STREAM,
        CLIENT_EVENTS,
        trailing=[b"\x00", b"\x00\x00\x00\x08\x00\x12", DELIVER_WIRE[:40]],
    )


def test_split_invariant_client_role() -> None:
    """Server frames decode the same whole, byte by byte, cut anywhere, or before a partial one."""
    assert_split_invariant(
        client, SERVER_STREAM, SERVER_EVENTS, trailing=[b"\x00\x00", DELIVER_WIRE[:-1]]
    )


def test_split_error_keeps_the_events_before() -> None:
    """A bad frame after good ones fails the same way however the input is cut."""
    bad = frame(Key.OPEN, 1, b"\x00\x00\x00\x04\x00\x05/")  # the string runs past the end
    errors = assert_split_error(server, CLIENT_STREAM + bad, StreamError, CLIENT_EVENTS)
    assert {(error.kind, error.code) for error in errors} == {("unknown-frame", 13)}


def test_truncation_reported() -> None:
    """The end of input is clean between frames and refused inside one (code 13, ``truncated``)."""
    assert_truncation_reported(
        server, CLIENT_STREAM, CLIENT_STREAM[:3], StreamCodec.end_of_input, StreamError
    )
    codec = server()
    codec.receive_data(DELIVER_WIRE[:20])
    with pytest.raises(StreamError) as info:
        codec.end_of_input()
    assert (info.value.kind, info.value.code) == ("truncated", 13)


# --- (3) hypothesis round trips -----------------------------------------------------------


@FAST
@given(stream_client_events(), st.data())
def test_client_events_round_trip(event: stream.Event, data: st.DataObject) -> None:
    """Any client event, encoded and cut at random points, decodes in the server role to itself."""
    wire = client().send(event)
    assert stream.encode(event) == wire
    assert feed(server(), data.draw(chunkings(wire))) == [event]


@FAST
@given(stream_server_events(), st.data())
def test_server_events_round_trip(event: stream.Event, data: st.DataObject) -> None:
    """Any server event, encoded and cut at random points, decodes in the client role to itself."""
    wire = server().send(event)
    assert stream.encode(event) == wire
    assert feed(client(), data.draw(chunkings(wire))) == [event]


@FAST
@given(st.lists(stream_client_events(), max_size=6), st.data())
def test_client_sessions_round_trip(events: list[stream.Event], data: st.DataObject) -> None:
    """Several client frames back to back, cut anywhere, decode to the same events in order."""
    wire = b"".join(map(stream.encode, events))
    assert feed(server(), data.draw(chunkings(wire, max_cuts=12))) == events


@FAST
@given(st.lists(stream_server_events(), max_size=6), st.data())
def test_server_sessions_round_trip(events: list[stream.Event], data: st.DataObject) -> None:
    """Several server frames back to back, cut anywhere, decode to the same events in order."""
    wire = b"".join(map(stream.encode, events))
    assert feed(client(), data.draw(chunkings(wire, max_cuts=12))) == events


CLIENT_STRATEGIES = stream_client_event_strategies()
SERVER_STRATEGIES = stream_server_event_strategies()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_event_type_round_trips(data: st.DataObject) -> None:
    """Every class of both strategy tables, one of each per example, is sent and read back.

    Drawing one event of every class each time makes sure no type is left to
    the chance of a ``one_of``.
    """
    for strategies, sender, reader in (
        (CLIENT_STRATEGIES, client(), server()),
        (SERVER_STRATEGIES, server(), client()),
    ):
        for cls, strategy in strategies.items():
            event = data.draw(strategy, label=cls.__name__)
            assert reader.receive_data(sender.send(event)) == [event]


def test_strategies_cover_every_event_type() -> None:
    """The two strategy tables together name every event class of the `stream.Event` union."""
    covered = set(CLIENT_STRATEGIES) | set(SERVER_STRATEGIES)
    assert covered == set(EVENT_TYPES)


# --- (4) hypothesis garbage -------------------------------------------------------------------

READABLE = {
    Role.SERVER: [
        (key, version)
        for key in [*range(1, 32), 0x8014, 0x8016, 0x801A]
        for version in (1, 2)
        if key not in (3, 4, 8, 0x10, 0x1A)
    ],
    Role.CLIENT: [
        (key, version)
        for key in [3, 4, 8, 0x10, 0x14, 0x16, 0x17, 0x1A, *range(0x8001, 0x8020)]
        for version in (1, 2)
    ],
}


@FAST
@given(st.lists(st.binary(max_size=40), max_size=8), st.sampled_from(list(Role)))
def test_garbage_gives_events_or_stream_error(chunks: list[bytes], role: Role) -> None:
    """Arbitrary bytes give events or `StreamError`, nothing else, in either role; dead after."""
    factory = server if role is Role.SERVER else client
    assert_events_or_error(factory, chunks, StreamError, event_types=EVENT_TYPES)


@FAST
@given(st.data(), st.sampled_from(list(Role)))
def test_garbage_bodies_of_known_commands(data: st.DataObject, role: Role) -> None:
    """A well-framed key and version with an arbitrary body decodes or raises code 13 only."""
    frames = data.draw(
        st.lists(
            st.builds(
                frame,
                st.sampled_from([k for k, _ in READABLE[role]]),
                st.sampled_from([1, 2]),
                st.binary(max_size=60),
            ),
            min_size=1,
            max_size=4,
        )
    )
    factory = server if role is Role.SERVER else client
    _, error = assert_events_or_error(
        factory, [b"".join(frames)], StreamError, event_types=EVENT_TYPES
    )
    if error is not None:
        assert isinstance(error, StreamError)
        assert (error.kind, error.code) == ("unknown-frame", 13)


@FAST
@given(stream_client_events(), st.data())
def test_cut_bodies_decode_or_raise_13(event: stream.Event, data: st.DataObject) -> None:
    """A valid client frame with its body cut short (size fixed up) decodes or raises code 13."""
    wire = stream.encode(event)
    cut = data.draw(st.integers(min_value=4, max_value=len(wire) - 4))
    short = struct.pack(">I", cut) + wire[4 : 4 + cut]
    _, error = assert_events_or_error(server, [short], StreamError, event_types=EVENT_TYPES)
    if error is not None:
        assert isinstance(error, StreamError)
        assert error.code == 13


# --- (5) limits ------------------------------------------------------------------------------


def test_size_over_frame_max_fails_before_the_body() -> None:
    """A declared size over frame_max raises code 14 as soon as the 4 size bytes are in."""
    codec = server(frame_max=100)
    assert codec.receive_data(b"\x00\x00\x00") == []
    error = error_of(codec, b"\x65")  # 101: no body byte sent at all
    assert (error.kind, error.code) == ("frame-too-large", 14)
    assert error.where == "byte 0"
    assert isinstance(error, RemoteProtocolError)


def test_size_at_frame_max_is_accepted() -> None:
    """A frame of exactly frame_max bytes after its size field is read."""
    close = stream.encode(Close(correlation_id=1, code=1, reason="x" * 88))
    assert len(close) - 4 == 100
    assert server(frame_max=100).receive_data(close) == [
        Close(correlation_id=1, code=1, reason="x" * 88)
    ]
    assert error_of(server(frame_max=99), close).code == 14


def test_frame_too_large_keeps_the_events_before() -> None:
    """Frames before an oversized one are in the error's events, in order."""
    heartbeat = stream.encode(HEARTBEAT)
    error = error_of(server(frame_max=64), heartbeat * 2 + struct.pack(">I", 65))
    assert error.events == [HEARTBEAT, HEARTBEAT]
    assert error.where == "byte 16"


def test_frame_too_large_reply_is_the_reference_close() -> None:
    """A server-role error carries ``Close(1, 14, "frame too large")``; a client's, none."""
    error = error_of(server(frame_max=8), struct.pack(">I", 9))
    assert error.reply == stream.encode(Close(correlation_id=1, code=14, reason="frame too large"))
    assert error_of(client(frame_max=8), struct.pack(">I", 9)).reply is None


def test_zero_frame_max_is_unlimited() -> None:
    """frame_max 0 means no limit (notes, section 2)."""
    big = Deliver(subscription_id=1, chunk=bytes(300_000))
    assert client(frame_max=0).receive_data(stream.encode(big)) == [big]
    assert client(frame_max=0).frame_max == 0


def test_pre_open_ceiling_then_negotiated_limit() -> None:
    """The adapter's 8192-byte pre-Open ceiling refuses bigger frames; after Open it is lifted."""
    codec = server(frame_max=stream.DEFAULT_FRAME_MAX_BYTES)
    codec.set_frame_max(stream.PRE_OPEN_FRAME_MAX_BYTES)
    assert codec.frame_max == 8192
    at_limit = PeerProperties(correlation_id=1, properties={"k": "v" * 8175})
    assert len(stream.encode(at_limit)) - 4 == 8192
    assert codec.receive_data(stream.encode(at_limit)) == [at_limit]
    codec.set_frame_max(stream.DEFAULT_FRAME_MAX_BYTES)
    publish = Publish(publisher_id=0, publishing_ids=list(range(100)), messages=[bytes(100)] * 100)
    assert codec.receive_data(stream.encode(publish)) == [publish]
    over = PeerProperties(correlation_id=1, properties={"k": "v" * 8176})
    pre_open = server(frame_max=stream.PRE_OPEN_FRAME_MAX_BYTES)
    error = error_of(pre_open, stream.encode(over)[:4])
    assert (error.kind, error.code) == ("frame-too-large", 14)


def test_frame_in_flight_keeps_the_limit_it_was_accepted_under() -> None:
    """Tightening frame_max mid-frame does not reject the frame whose size was already read."""
    event = Deliver(subscription_id=0, chunk=bytes(500))
    wire = stream.encode(event)
    codec = client(frame_max=1000)
    assert codec.receive_data(wire[:200]) == []
    codec.set_frame_max(50)
    assert codec.receive_data(wire[200:]) == [event]
    assert error_of(codec, wire[:4]).code == 14


def test_frame_max_must_be_a_uint32() -> None:
    """A negative frame max or one over 2**32 - 1 is refused."""
    with pytest.raises(ValueError, match="uint32"):
        server(frame_max=-1)
    with pytest.raises(ValueError, match="uint32"):
        server().set_frame_max(2**32)


@pytest.mark.parametrize(
    ("role", "data", "reason"),
    [
        (Role.SERVER, frame(0x0020, 1, b""), "does not read unknown key 0x0020"),
        (Role.SERVER, frame(0x7FFF, 1, b""), "unknown key"),
        (Role.SERVER, frame(Key.DECLARE_PUBLISHER, 2, b""), "version 2 is not supported"),
        (Role.SERVER, frame(Key.PUBLISH, 3, b""), "version 3 is not supported (only [1, 2])"),
        (Role.SERVER, frame(Key.HEARTBEAT, 0, b""), "version 0"),
        (Role.CLIENT, frame(Key.DELIVER, 3, b"\x00"), "version 3"),
        (
            Role.SERVER,
            frame(Key.PUBLISH_CONFIRM, 1, bytes(5)),
            "server does not read PUBLISH_CONFIRM",
        ),
        (Role.SERVER, frame(Key.DELIVER, 1, b"\x00"), "server does not read DELIVER"),
        (Role.CLIENT, frame(Key.PUBLISH, 1, bytes(5)), "client does not read PUBLISH"),
        (Role.CLIENT, frame(Key.TUNE | 0x8000, 1, bytes(8)), "client does not read TUNE response"),
        (
            Role.SERVER,
            frame(0x8001, 1, bytes(6)),
            "server does not read DECLARE_PUBLISHER response",
        ),
        (Role.CLIENT, frame(0x8009, 2, bytes(3)), "version 2"),
        (Role.SERVER, b"\x00\x00\x00\x00", "frame of 0 bytes has no key"),
        (Role.CLIENT, b"\x00\x00\x00\x02\x00\x17", "frame of 2 bytes"),
    ],
)
def test_unknown_frames_are_code_13(role: Role, data: bytes, reason: str) -> None:
    """An unknown key, a version the reference server lacks, or the other role's frame: code 13."""
    codec = StreamCodec(role, frame_max=0)
    error = error_of(codec, data)
    assert (error.kind, error.code) == ("unknown-frame", 13)
    assert reason in error.reason


def test_unknown_frame_reply_and_where() -> None:
    """A server-role error carries ``Close(1, 13, "unknown frame")`` and names frame and field."""
    heartbeat = stream.encode(HEARTBEAT)
    bad = frame(Key.DECLARE_PUBLISHER, 1, b"\x00\x00\x00\x05\x00\x00\x00")  # no stream
    error = error_of(server(), heartbeat + bad)
    assert error.reply == stream.encode(Close(correlation_id=1, code=13, reason="unknown frame"))
    assert error.events == [HEARTBEAT]
    assert error.where == "byte 8: DECLARE_PUBLISHER (0x0001) version 1, field 'stream'"


@pytest.mark.parametrize(
    ("role", "key", "version", "body"),
    [
        # Fields cut short inside a complete frame.
        (Role.SERVER, Key.DECLARE_PUBLISHER, 1, b"\x00\x00\x00\x05\x00\x00\x00"),
        (Role.SERVER, Key.SASL_HANDSHAKE, 1, b"\x00\x00\x00"),
        (Role.SERVER, Key.TUNE, 1, bytes(7)),
        (Role.SERVER, Key.OPEN, 1, b"\x00\x00\x00\x04\x00\x05/"),
        (Role.SERVER, Key.SUBSCRIBE, 1, b"\x00\x00\x00\x07\x00\x00\x02s1\x00\x04\x00\x00"),
        (Role.SERVER, Key.SASL_AUTHENTICATE, 1, b"\x00\x00\x00\x03\x00\x00\x00\x00\x00\x09ab"),
        (Role.SERVER, Key.METADATA, 1, b"\x00\x00\x00\x0a\x00\x00\x00\x02\x00\x02s1"),
        (Role.SERVER, Key.CREDIT, 1, b"\x00\x00"),
        (Role.SERVER, Key.PUBLISH, 1, b"\x00\x00\x00\x00\x02" + bytes(8) + b"\x00\x00\x00\x00"),
        (Role.SERVER, Key.PUBLISH, 1, b"\x00\x00\x00\x00\x01" + bytes(8) + b"\x00\x00\x00\x05ab"),
        (Role.SERVER, Key.PUBLISH, 2, b"\x00\x00\x00\x00\x01" + bytes(8) + b"\x00\x05ab"),
        (Role.SERVER, Key.PUBLISH, 1, b"\x00\x00\x00\x00\x01" + bytes(8) + b"\x80\x00\x01"),
        (Role.CLIENT, Key.PUBLISH_CONFIRM, 1, b"\x00\x00\x00\x00\x02" + bytes(8)),
        (Role.CLIENT, Key.PUBLISH_ERROR, 1, b"\x00\x00\x00\x00\x01" + bytes(9)),
        (Role.CLIENT, Key.DELIVER, 1, b""),
        (Role.CLIENT, Key.DELIVER, 2, b"\x00" + bytes(7)),
        (Role.CLIENT, 0x800F, 1, b"\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00"),
        (Role.CLIENT, 0x8015, 1, b"\x00\x00\x00\x04\x00\x01\x00\x00\x00\x01\x00\x01k"),
        # Bytes left over after a complete body.
        (Role.SERVER, Key.OPEN, 1, b"\x00\x00\x00\x04\x00\x01/\x00"),
        (Role.SERVER, Key.HEARTBEAT, 1, b"\x00"),
        (Role.SERVER, Key.SUBSCRIBE, 1, b"\x00\x00\x00\x07\x00\x00\x02s1\x00\x01\x00\x0a\x00"),
        (Role.SERVER, Key.PUBLISH, 1, b"\x00\x00\x00\x00\x00\x00"),
        (Role.CLIENT, 0x8013, 1, b"\x00\x00\x00\x03\x00\x01\x00\x00\x00"),
        (Role.CLIENT, 0x8001, 1, b"\x00\x00\x00\x05\x00\x01\x00"),
        (Role.CLIENT, Key.PUBLISH_CONFIRM, 1, b"\x00\x00\x00\x00\x00\x00"),
        (Role.SERVER, 0x801A, 1, b"\x00\x00\x00\x00\x00\x01\x00\x04" + bytes(9)),
        # Values no field may hold.
        (Role.SERVER, Key.OPEN, 1, b"\x00\x00\x00\x04\xff\xff"),  # null string
        (Role.SERVER, Key.OPEN, 1, b"\x00\x00\x00\x04\x00\x01\xff"),  # not UTF-8
        (Role.SERVER, Key.METADATA, 1, b"\x00\x00\x00\x0a\xff\xff\xff\xff"),  # count -1
        (Role.SERVER, Key.SUBSCRIBE, 1, b"\x00\x00\x00\x07\x00\x00\x02s1\x00\x06\x00\x0a"),
        (Role.SERVER, Key.SUBSCRIBE, 1, b"\x00\x00\x00\x07\x00\x00\x02s1\x00\x00\x00\x0a"),
        (Role.SERVER, Key.SASL_AUTHENTICATE, 1, b"\x00\x00\x00\x03\x00\x00\xff\xff\xff\xfe"),
        (
            Role.SERVER,
            Key.PUBLISH,
            2,
            b"\x00\x00\x00\x00\x01" + bytes(8) + b"\xff\xff\x80\x00\x00\x00",
        ),
        (
            Role.SERVER,
            Key.PUBLISH,
            2,
            b"\x00\x00\x00\x00\x01" + bytes(8) + b"\xff\xfe\x00\x00\x00\x00",
        ),
        (Role.SERVER, 0x801A, 1, b"\x00\x00\x00\x00\x00\x01\x00\x06" + bytes(8)),
        (Role.CLIENT, Key.CONSUMER_UPDATE, 1, b"\x00\x00\x00\x01\x00\x02"),
        (Role.SERVER, Key.PEER_PROPERTIES, 1, b"\x00\x00\x00\x01\x7f\xff\xff\xff"),
    ],
)
def test_malformed_bodies_are_code_13(role: Role, key: int, version: int, body: bytes) -> None:
    """Truncated fields, trailing bytes and impossible values inside a complete frame: code 13."""
    error = error_of(StreamCodec(role, frame_max=0), frame(key, version, body))
    assert (error.kind, error.code) == ("unknown-frame", 13)
    assert error.events == []


def test_codec_is_dead_after_an_error() -> None:
    """After a StreamError every receive_data and end_of_input raises it again."""
    codec = server()
    first = error_of(codec, frame(0x0020, 1, b""))
    for call in (lambda: codec.receive_data(stream.encode(HEARTBEAT)), codec.end_of_input):
        with pytest.raises(StreamError) as info:
            call()
        assert info.value.reason == first.reason
        assert info.value.events == []


def test_send_still_works_after_a_receive_error() -> None:
    """The adapter can still write the error's reply, or anything else, after the codec died."""
    codec = server(frame_max=10)
    error = error_of(codec, struct.pack(">I", 11))
    assert error.reply is not None
    assert codec.send(Close(correlation_id=1, code=14, reason="frame too large")) == error.reply


# --- exactness rules (notes, sections 5 and 14) -------------------------------------------------


def test_tune_reply_with_the_response_bit_is_accepted() -> None:
    """Notes, 14.6: a server reads the client's Tune reply as 0x0014 or 0x8014, both as `Tune`."""
    body = struct.pack(">II", 4096, 30)
    tune = Tune(frame_max=4096, heartbeat=30)
    assert server().receive_data(frame(0x8014, 1, body)) == [tune]
    assert server().receive_data(frame(0x0014, 1, body)) == [tune]
    assert client().send(tune) == frame(0x0014, 1, body)


def test_sasl_authenticate_response_challenge_is_an_int16_string() -> None:
    """Notes, 14.4: a challenge follows the code as int16 length and bytes; none means nothing."""
    with_challenge = SaslAuthenticateResponse(correlation_id=3, code=10, challenge=b"nonce")
    wire = stream.encode(with_challenge)
    assert wire == frame(0x8013, 1, b"\x00\x00\x00\x03\x00\x0a\x00\x05nonce")
    assert client().receive_data(wire) == [with_challenge]
    empty = SaslAuthenticateResponse(correlation_id=3, code=10, challenge=b"")
    assert client().receive_data(stream.encode(empty)) == [empty]


def test_sasl_authenticate_null_data() -> None:
    """Notes, 0x0013: SaslData of -1 decodes to None and encodes back to -1."""
    wire = frame(Key.SASL_AUTHENTICATE, 1, b"\x00\x00\x00\x03\x00\x05PLAIN\xff\xff\xff\xff")
    event = SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=None)
    assert server().receive_data(wire) == [event]
    assert stream.encode(event) == wire


def test_open_response_without_properties() -> None:
    """Notes, 14.5: an OpenResponse may end after its code (None) or carry an empty map ({})."""
    bare = frame(0x8015, 1, b"\x00\x00\x00\x04\x00\x0c")
    assert client().receive_data(bare) == [OpenResponse(correlation_id=4, code=12)]
    assert stream.encode(OpenResponse(correlation_id=4, code=12)) == bare
    empty = frame(0x8015, 1, b"\x00\x00\x00\x04\x00\x01\x00\x00\x00\x00")
    assert client().receive_data(empty) == [OpenResponse(correlation_id=4, code=1, properties={})]


def test_subscribe_properties_may_be_absent() -> None:
    """Notes, 0x0007: a Subscribe may end after its credit; that is ``properties=None``."""
    body = b"\x00\x00\x00\x07\x01\x00\x02s1\x00\x05" + struct.pack(">q", -1) + b"\x00\x02"
    event = Subscribe(
        correlation_id=7,
        subscription_id=1,
        stream="s1",
        offset_spec=OffsetSpec(kind=OffsetKind.TIMESTAMP, value=-1),
        credit=2,
    )
    assert server().receive_data(frame(Key.SUBSCRIBE, 1, body)) == [event]
    assert stream.encode(event) == frame(Key.SUBSCRIBE, 1, body)


def test_metadata_response_has_no_top_level_code() -> None:
    """Notes, 14.7: brokers right after the correlation id; a missing stream has leader 0xFFFF."""
    event = MetadataResponse(
        correlation_id=1,
        brokers=(),
        streams=(StreamMetadata(stream="gone", code=2, leader=stream.NO_LEADER, replicas=()),),
    )
    body = (
        b"\x00\x00\x00\x01" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x01\x00\x04gone\x00\x02\xff\xff"
    )
    assert stream.encode(event) == frame(0x800F, 1, body + b"\x00\x00\x00\x00")


def test_credit_response_has_no_correlation_id() -> None:
    """Notes, 14.8: 0x8009 is code then subscription id, nothing else."""
    event = stream.CreditResponse(code=4, subscription_id=9)
    assert stream.encode(event) == frame(0x8009, 1, b"\x00\x04\x09")
    assert client().receive_data(frame(0x8009, 1, b"\x00\x04\x09")) == [event]


def test_credit_is_read_unsigned() -> None:
    """Spec ambiguity, our side: Credit is uint16 as PROTOCOL.adoc says, so 0xffff is 65535."""
    assert server().receive_data(frame(Key.CREDIT, 1, b"\x01\xff\xff")) == [
        Credit(subscription_id=1, credit=65535)
    ]


def test_negative_credit_is_not_sent() -> None:
    """Spec ambiguity, the reference's side: it reads int16 credit; we never write a negative."""
    with pytest.raises(StreamLocalError):
        client().send(Credit(subscription_id=1, credit=-1))


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_consumer_update_response_ignores_bytes_after_types_0_to_3(kind: int) -> None:
    """Notes, 14.17: after offset types 0 to 3 the server ignores what follows; it is kept raw."""
    body = b"\x00\x00\x00\x02\x00\x01" + struct.pack(">H", kind) + b"anything"
    (event,) = server().receive_data(frame(0x801A, 1, body))
    assert isinstance(event, ConsumerUpdateResponse)
    assert event.ignored == b"anything"
    assert event.offset_spec == (None if kind == 0 else OffsetSpec(kind=OffsetKind(kind)))
    assert stream.encode(event) == frame(0x801A, 1, body)


def test_consumer_update_response_with_an_offset() -> None:
    """Offset types 4 and 5 carry their 8-byte value and nothing after it."""
    event = ConsumerUpdateResponse(
        correlation_id=2, code=1, offset_spec=OffsetSpec(kind=OffsetKind.OFFSET, value=7)
    )
    wire = frame(0x801A, 1, b"\x00\x00\x00\x02\x00\x01\x00\x04" + struct.pack(">Q", 7))
    assert stream.encode(event) == wire
    assert server().receive_data(wire) == [event]
    with pytest.raises(StreamLocalError):
        stream.encode(ConsumerUpdateResponse(**{**_fields(event), "ignored": b"x"}))


def _fields(event: ConsumerUpdateResponse) -> dict[str, object]:
    """An event's fields as keyword arguments."""
    return {name: getattr(event, name) for name in event.__dataclass_fields__}


def test_consumer_update_active_flag() -> None:
    """Notes, 0x001a: the server's request carries subscription id and active 0 or 1."""
    event = ConsumerUpdate(correlation_id=0, subscription_id=3, active=True)
    wire = frame(Key.CONSUMER_UPDATE, 1, b"\x00\x00\x00\x00\x03\x01")
    assert server().send(event) == wire
    assert client().receive_data(wire) == [event]


# --- the hot paths ---------------------------------------------------------------------------


def test_publish_messages_are_slices_of_the_frame() -> None:
    """Publish decodes to memoryview slices sharing one buffer: no message is copied.

    Except entries all of one small size, which are copied out by one
    compiled struct (tests/codecs/test_stream_fastpath.py).
    """
    messages = [bytes([n]) * (100 + n) for n in range(50)]
    event = Publish(publisher_id=3, publishing_ids=list(range(1, 51)), messages=messages)
    (decoded,) = server().receive_data(stream.encode(event))
    assert isinstance(decoded, Publish)
    assert decoded == event
    assert isinstance(decoded.publishing_ids, list)
    assert all(isinstance(m, memoryview) for m in decoded.messages)
    assert len({id(m.obj) for m in decoded.messages if isinstance(m, memoryview)}) == 1
    assert decoded.filter_values is None
    assert decoded.sub_batches is None


def test_publish_mixes_simple_and_sub_batch_entries() -> None:
    """A v1 frame may mix entries; flags say which messages are raw sub-batch entries."""
    batch = b"\x00\x00\x00\x02hi"
    entry = struct.pack(">BHII", 0x90, 1, 6, len(batch)) + batch
    event = Publish(
        publisher_id=1,
        publishing_ids=[1, 2, 3],
        messages=[b"a", entry, b"bc"],
        sub_batches=[False, True, False],
    )
    wire = stream.encode(event)
    assert wire[9 + 4 + 8 + 4 + 1 + 8 :][:1] == b"\x90"
    assert server().receive_data(wire) == [event]


def test_publish_v2_null_filter_value() -> None:
    """Notes, 14.21: a v2 filter length of -1 is None (no filter value); rstream never sends it."""
    body = b"\x02\x00\x00\x00\x01" + struct.pack(">Q", 5) + b"\xff\xff\x00\x00\x00\x01z"
    event = Publish(
        publisher_id=2, publishing_ids=[5], messages=[b"z"], version=2, filter_values=[None]
    )
    assert server().receive_data(frame(Key.PUBLISH, 2, body)) == [event]
    assert stream.encode(event) == frame(Key.PUBLISH, 2, body)


def test_publish_confirm_of_a_thousand_ids() -> None:
    """A 1,000-id PublishConfirm is 9 + 8,000 bytes after its size and decodes to a list."""
    ids = list(range(10**12, 10**12 + 1000))
    wire = server().send(PublishConfirm(publisher_id=9, publishing_ids=ids))
    assert len(wire) == 4 + 9 + 8000
    assert wire[13:21] == struct.pack(">Q", 10**12)
    (event,) = client().receive_data(wire)
    assert isinstance(event, PublishConfirm)
    assert event.publishing_ids == ids
    assert isinstance(event.publishing_ids, list)


def test_publish_error_pairs() -> None:
    """Notes, 0x0004: each failed id is followed by its code."""
    event = stream.PublishError(publisher_id=1, publishing_ids=[7, 8], codes=[18, 18])
    wire = frame(Key.PUBLISH_ERROR, 1, b"\x01\x00\x00\x00\x02" + struct.pack(">QHQH", 7, 18, 8, 18))
    assert server().send(event) == wire
    assert client().receive_data(wire) == [event]


def test_deliver_prefix_v2() -> None:
    """Version 2 adds the committed chunk id; the size counts the 13 bytes and the payload."""
    prefix = stream.deliver_prefix(4, 100, version=2, committed_chunk_id=77)
    assert prefix == struct.pack(">IHHBQ", 113, 8, 2, 4, 77)
    event = Deliver(subscription_id=4, chunk=bytes(100), version=2, committed_chunk_id=77)
    assert server().send(event) == prefix + bytes(100)
    assert client().receive_data(prefix + bytes(100)) == [event]


@pytest.mark.parametrize(
    ("version", "committed", "payload", "sub"),
    [(1, 5, 10, 0), (2, None, 10, 0), (3, None, 10, 0), (1, None, 2**32, 0), (1, None, 1, 256)],
)
def test_deliver_prefix_refuses(
    version: int, committed: int | None, payload: int, sub: int
) -> None:
    """A committed id with v1, none with v2, another version or values out of range: refused."""
    with pytest.raises(StreamLocalError):
        stream.deliver_prefix(sub, payload, version=version, committed_chunk_id=committed)


# --- send: roles and values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "event"),
    [
        (Role.SERVER, Publish(publisher_id=0, publishing_ids=[], messages=[])),
        (Role.SERVER, SaslHandshake(correlation_id=1)),
        (Role.SERVER, ConsumerUpdateResponse(correlation_id=1, code=1, offset_spec=None)),
        (Role.CLIENT, Deliver(subscription_id=0, chunk=b"")),
        (Role.CLIENT, Response(key=Key.SUBSCRIBE, correlation_id=1, code=1)),
        (Role.CLIENT, ConsumerUpdate(correlation_id=1, subscription_id=1, active=False)),
    ],
)
def test_send_refuses_the_other_roles_events(role: Role, event: stream.Event) -> None:
    """A server sends no requests and a client no responses to its own requests."""
    with pytest.raises(StreamLocalError) as info:
        StreamCodec(role, frame_max=0).send(event)
    assert info.value.kind == "wrong-role"
    assert isinstance(info.value, LocalProtocolError)


@pytest.mark.parametrize(
    "event",
    [
        Response(key=Key.CLOSE, correlation_id=1, code=1),
        Response(key=Key.METADATA, correlation_id=1, code=1),
        Tune(frame_max=2**32, heartbeat=0),
        DeclarePublisher(correlation_id=1, publisher_id=256, reference="", stream="s"),
        Open(correlation_id=-1, virtual_host="/"),
        Open(correlation_id=1, virtual_host="x" * 32768),
        Open(correlation_id=1, virtual_host="\ud800"),
        PublishConfirm(publisher_id=0, publishing_ids=[-1]),
        PublishConfirm(publisher_id=0, publishing_ids=[2**64]),
        Publish(publisher_id=0, publishing_ids=[1, 2], messages=[b""]),
        Publish(publisher_id=0, publishing_ids=[1], messages=[b""], filter_values=["f"]),
        Publish(publisher_id=0, publishing_ids=[1], messages=[b""], version=2),
        Publish(publisher_id=0, publishing_ids=[1], messages=[b""], version=3),
        Publish(
            publisher_id=0,
            publishing_ids=[1],
            messages=[b""],
            version=2,
            filter_values=[None],
            sub_batches=[False],
        ),
        Publish(publisher_id=0, publishing_ids=[1], messages=[b"short"], sub_batches=[True]),
        Publish(publisher_id=0, publishing_ids=[1], messages=[b"a"], sub_batches=[True, False]),
        stream.PublishError(publisher_id=0, publishing_ids=[1], codes=[]),
        Deliver(subscription_id=0, chunk=b"", version=2),
    ],
)
def test_encode_refuses_what_the_wire_cannot_carry(event: stream.Event) -> None:
    """Out-of-range integers, bad strings, mismatched lists and versions: StreamLocalError."""
    with pytest.raises(StreamLocalError):
        stream.encode(event)


def test_encode_refuses_a_non_event() -> None:
    """Something that is not a stream event cannot be encoded."""
    with pytest.raises(StreamLocalError, match="not a stream protocol event"):
        stream.encode(object())  # type: ignore[arg-type]


def test_offset_spec_value_matches_its_kind() -> None:
    """OFFSET and TIMESTAMP need a value; FIRST, LAST and NEXT take none."""
    with pytest.raises(ValueError, match="FIRST"):
        OffsetSpec(kind=OffsetKind.FIRST, value=0)
    with pytest.raises(ValueError, match="OFFSET"):
        OffsetSpec(kind=OffsetKind.OFFSET)


def test_role_must_be_a_stream_role() -> None:
    """The codec refuses a role that is not `stream.Role`."""
    with pytest.raises(TypeError):
        StreamCodec("server", frame_max=0)  # type: ignore[arg-type]


def test_codec_reports_its_role() -> None:
    """``role`` is what the codec was built with."""
    assert server().role is Role.SERVER
    assert client().role is Role.CLIENT


# --- the framing helper as other protocols would use it ------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "limit"), [(">H", 10), ("<I", None), (">B", 3)], ids=["u16", "u32le", "u8"]
)
def test_length_prefix_reader_other_widths(fmt: str, limit: int | None) -> None:
    """The shared reader splits any fixed-width prefix, one byte at a time or whole."""
    prefix = struct.Struct(fmt)
    payloads = [b"", b"abc", b"\x00\x01"]
    data = b"".join(prefix.pack(len(p)) + p for p in payloads)
    make: Callable[[], LengthPrefixReader] = lambda: LengthPrefixReader(prefix, limit)  # noqa: E731
    whole = make().feed(data)
    reader = make()
    one_by_one = [item for i in range(len(data)) for item in reader.feed(data[i : i + 1])]
    assert whole == one_by_one == payloads
    assert reader.pending == 0
    assert reader.offset == len(data)


def test_length_prefix_reader_negative_length() -> None:
    """A signed prefix declaring a negative length is a ``bad-length`` error; the reader is dead."""
    reader = LengthPrefixReader(struct.Struct(">h"), None)
    with pytest.raises(LengthPrefixError) as info:
        reader.feed(b"\x00\x01x\xff\xff")
    assert (info.value.kind, info.value.offset, info.value.complete) == ("bad-length", 3, [b"x"])
    with pytest.raises(LengthPrefixError):
        reader.feed(b"")
    with pytest.raises(ValueError, match="negative"):
        LengthPrefixReader(struct.Struct(">I"), -1)
