"""Tests for `gateway.codecs.qmqp`, the sans-IO QMQP streaming codec.

The spec is ../shared/specs/qmqp-streaming.txt. The five families of
STYLE.md, section 7: the spec's byte examples in both directions (taken from
its hex dumps, since its prose had addresses scrubbed), the split check,
hypothesis round trips, hypothesis garbage and the size limits; plus every
`InvalidBlock` and `QMQPError` rule and the role checks of ``send``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.codecs import qmqp
from gateway.codecs.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gateway.codecs.framing import MAX_LENGTH_DIGITS, encode_netstring, encode_netstrings
from gateway.codecs.qmqp import (
    DONE,
    AuthBlock,
    AuthReplyBlock,
    DoneBlock,
    InvalidBlock,
    MessageBlock,
    QMQPCodec,
    QMQPError,
    QMQPLocalError,
    ReplyBlock,
    Role,
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
    qmqp_client_blocks,
    qmqp_client_sessions,
    qmqp_ids,
    qmqp_message_blocks,
    qmqp_server_blocks,
    qmqp_server_sessions,
)

BLOCK_TYPES = (MessageBlock, AuthBlock, DoneBlock, ReplyBlock, AuthReplyBlock, InvalidBlock)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def server(max_message_bytes: int = qmqp.DEFAULT_MAX_MESSAGE_BYTES) -> QMQPCodec:
    """A fresh server-role codec: it reads message, auth and done blocks."""
    return QMQPCodec(Role.SERVER, max_message_bytes=max_message_bytes)


def client(max_message_bytes: int = qmqp.DEFAULT_MAX_MESSAGE_BYTES) -> QMQPCodec:
    """A fresh client-role codec: it reads replies."""
    return QMQPCodec(Role.CLIENT, max_message_bytes=max_message_bytes)


def small_server() -> QMQPCodec:
    """A server keeping blocks of at most 64 bytes."""
    return server(64)


def server_error(data: bytes, make: Callable[[], QMQPCodec] = server) -> QMQPError:
    """The error a server raises on ``data``, with no block decoded before it."""
    with pytest.raises(QMQPError) as info:
        make().receive_data(data)
    assert info.value.events == []
    return info.value


def client_error(data: bytes, make: Callable[[], QMQPCodec] = client) -> QMQPError:
    """The error a client raises on ``data``, with no block decoded before it."""
    with pytest.raises(QMQPError) as info:
        make().receive_data(data)
    assert info.value.events == []
    return info.value


# --- (1) the spec's examples, verbatim from its hex dumps, both directions ----------

# Spec, "Sample Session", "Data sent by client": hex dump, 0x102 bytes.
CLIENT_SESSION = bytes.fromhex(
    """
    31 32 32 3a 31 3a 4d 2c  34 3a 6d 73 67 31 2c 37
    32 3a 46 72 6f 6d 3a 20  72 6f 6f 74 40 64 72 68
    2e 6e 65 74 0a 54 6f 3a  20 64 68 61 72 72 69 73
    40 64 72 68 2e 6e 65 74  0a 73 75 62 6a 65 63 74
    3a 20 68 69 0a 0a 74 68  69 73 20 69 73 20 74 68
    65 20 6d 65 73 73 61 67  65 0a 2c 31 32 3a 72 6f
    6f 74 40 64 72 68 2e 6e  65 74 2c 31 35 3a 64 68
    61 72 72 69 73 40 64 72  68 2e 6e 65 74 2c 2c 31
    32 32 3a 31 3a 4d 2c 34  3a 6d 73 67 32 2c 37 32
    3a 46 72 6f 6d 3a 20 72  6f 6f 74 40 64 72 68 2e
    6e 65 74 0a 54 6f 3a 20  64 68 61 72 72 69 73 40
    64 72 68 2e 6e 65 74 0a  73 75 62 6a 65 63 74 3a
    20 68 69 0a 0a 74 68 69  73 20 69 73 20 74 68 65
    20 6d 65 73 73 61 67 65  0a 2c 31 32 3a 72 6f 6f
    74 40 64 72 68 2e 6e 65  74 2c 31 35 3a 64 68 61
    72 72 69 73 40 64 72 68  2e 6e 65 74 2c 2c 31 3a
    44 2c
    """
)

# Spec, "Sample Session", "Data sent by server": hex dump, 0x32 bytes.
SERVER_SESSION = bytes.fromhex(
    """
    31 39 3a 31 3a 52 2c 34  3a 6d 73 67 31 2c 31 3a
    4b 2c 31 3a 31 2c 2c 31  39 3a 31 3a 52 2c 34 3a
    6d 73 67 32 2c 31 3a 4b  2c 31 3a 30 2c 2c 31 3a
    44 2c
    """
)

# Spec, "Authentication": the request (0x26 bytes) and the reply (0x0b bytes).
AUTH_REQUEST = bytes.fromhex(
    """
    33 34 3a 31 3a 41 2c 31  30 3a 6d 79 75 73 65 72
    6e 61 6d 65 2c 31 32 3a  74 68 65 5f 70 61 73 73
    77 6f 72 64 2c 2c
    """
)
AUTH_REPLY = bytes.fromhex("38 3a 31 3a 41 2c 31 3a  30 2c 2c")

SAMPLE_TEXT = b"From: root@drh.net\nTo: dharris@drh.net\nsubject: hi\n\nthis is the message\n"
MSG1 = MessageBlock(
    id=b"msg1", message=SAMPLE_TEXT, sender=b"root@drh.net", recipients=(b"dharris@drh.net",)
)
MSG2 = MessageBlock(
    id=b"msg2", message=SAMPLE_TEXT, sender=b"root@drh.net", recipients=(b"dharris@drh.net",)
)
CLIENT_BLOCKS: list[qmqp.Block] = [MSG1, MSG2, DONE]
SERVER_BLOCKS: list[qmqp.Block] = [
    ReplyBlock(id=b"msg1", status=qmqp.K, description=b"", pending=1),
    ReplyBlock(id=b"msg2", status=qmqp.K, description=b"", pending=0),
    DONE,
]
AUTH = AuthBlock(username=b"myusername", password=b"the_password")
MSG1_WIRE = CLIENT_SESSION[:127]


def test_spec_dumps_are_the_sizes_the_spec_gives() -> None:
    """The hex dumps were copied whole: 0x102, 0x32, 0x26 and 0x0b bytes, as the spec says."""
    assert (len(CLIENT_SESSION), len(SERVER_SESSION)) == (0x102, 0x32)
    assert (len(AUTH_REQUEST), len(AUTH_REPLY)) == (0x26, 0x0B)
    assert SERVER_SESSION == b"19:1:R,4:msg1,1:K,1:1,,19:1:R,4:msg2,1:K,1:0,,1:D,"
    assert AUTH_REQUEST == b"34:1:A,10:myusername,12:the_password,,"
    assert AUTH_REPLY == b"8:1:A,1:0,,"
    assert MSG1_WIRE.startswith(b"122:1:M,4:msg1,72:") and MSG1_WIRE.endswith(b",,")


def test_spec_client_session_decoded_by_server() -> None:
    """Spec, "Sample Session": the client's bytes are msg1, msg2 and the done block."""
    codec = server()
    assert codec.receive_data(CLIENT_SESSION) == CLIENT_BLOCKS
    assert codec.peer_done


def test_spec_client_session_encoded_by_client() -> None:
    """A client sending msg1, msg2 and the done block writes the spec's bytes exactly."""
    sender = client()
    assert b"".join(sender.send(block) for block in CLIENT_BLOCKS) == CLIENT_SESSION
    assert b"".join(map(qmqp.encode, CLIENT_BLOCKS)) == CLIENT_SESSION


def test_spec_server_session_decoded_by_client() -> None:
    """Spec, "Sample Session": the server's bytes are two K replies (pending 1, 0) and done."""
    codec = client()
    assert codec.receive_data(SERVER_SESSION) == SERVER_BLOCKS
    assert codec.peer_done


def test_spec_server_session_encoded_by_server() -> None:
    """A server sending those replies and its done block writes the spec's bytes exactly."""
    sender = server()
    assert b"".join(sender.send(block) for block in SERVER_BLOCKS) == SERVER_SESSION
    assert b"".join(map(qmqp.encode, SERVER_BLOCKS)) == SERVER_SESSION


def test_spec_auth_request_both_ways() -> None:
    """Spec, "Authentication": the request decodes in the server role and encodes back exactly."""
    assert server().receive_data(AUTH_REQUEST) == [AUTH]
    assert client().send(AUTH) == AUTH_REQUEST


def test_spec_auth_reply_example_reads_as_failure() -> None:
    """Spec ambiguity, one side: ``8:1:A,1:0,,`` (labelled "success") is a failure for us.

    The prose says 1 is success and 0 failure; we follow the prose, so the
    example decodes to ``success=False`` and a failure encodes to it.
    """
    assert client().receive_data(AUTH_REPLY) == [AuthReplyBlock(success=False)]
    assert server().send(AuthReplyBlock(success=False)) == AUTH_REPLY


def test_auth_reply_one_is_success() -> None:
    """Spec ambiguity, other side: ``8:1:A,1:1,,`` is success, both ways."""
    assert client().receive_data(b"8:1:A,1:1,,") == [AuthReplyBlock(success=True)]
    assert server().send(AuthReplyBlock(success=True)) == b"8:1:A,1:1,,"


def test_php_sample_without_the_outer_netstring_is_refused() -> None:
    """The spec's PHP sample forgets the outer netstring; the prose and the dump have it.

    We follow the prose and the dump: a block sent the PHP way
    (``1:M,4:msg1,...`` bare) cannot be framed, and the server gives up.
    """
    bare = b"1:M,4:msg1,72:" + SAMPLE_TEXT + b",12:root@drh.net,15:dharris@drh.net,"
    error = server_error(bare)
    assert error.kind == "bad-framing"


def test_pair_session() -> None:
    """A client codec and a server codec carry a whole session both ways."""
    up, down = client(), server()
    requests: list[qmqp.ClientBlock] = [AUTH, MSG1, MSG2, DONE]
    wire = b"".join(up.send(block) for block in requests)
    assert down.receive_data(wire) == requests
    replies: list[qmqp.ServerBlock] = [
        AuthReplyBlock(success=True),
        ReplyBlock(id=b"msg2", status=qmqp.Z, description=b"try later", pending=1),
        ReplyBlock(id=b"msg1", status=qmqp.D, description=b"no such user", pending=0),
        DONE,
    ]
    assert up.receive_data(b"".join(down.send(block) for block in replies)) == replies


# --- (2) the split check ------------------------------------------------------------


def test_split_client_session() -> None:
    """(2) The spec's client bytes decode the same whole, byte by byte, cut anywhere, with tails."""
    assert_split_invariant(
        server, AUTH_REQUEST + CLIENT_SESSION, [AUTH, *CLIENT_BLOCKS], trailing=[b"1", b"122:1:M,"]
    )
    assert_split_invariant(server, MSG1_WIRE, [MSG1], trailing=[b"1", b"1:D", MSG1_WIRE[:-1]])


def test_split_server_session() -> None:
    """(2) The spec's server bytes decode the same however they are cut."""
    assert_split_invariant(client, SERVER_SESSION, SERVER_BLOCKS, trailing=[b"1", b"19:1:R,"])
    data = AUTH_REPLY + SERVER_SESSION[:-4]
    expected = [AuthReplyBlock(success=False), *SERVER_BLOCKS[:-1]]
    assert_split_invariant(client, data, expected, trailing=[b"19:1:R,4:msg3", b"1:"])


def test_split_invalid_blocks() -> None:
    """(2) Refused blocks decode to the same `InvalidBlock` events however the stream is cut."""
    data = (
        encode_netstrings([b"M", b"a", b"text", b"from"])
        + MSG1_WIRE
        + encode_netstrings([b"X", b"b"])
        + encode_netstring(b"1:M,1:c,9:short")
        + qmqp.DONE_BYTES
        + MSG1_WIRE
    )
    expected = [
        InvalidBlock(id=b"a", reason="message block has no recipient", kind="no-recipient"),
        MSG1,
        InvalidBlock(id=b"b", reason="unknown block type 'X'", kind="unknown-type"),
        InvalidBlock(
            id=b"c",
            reason="message block framing is broken after the id: netstring of 9 bytes runs"
            " past the end of the data (at byte 8 of the block)",
            kind="bad-framing",
        ),
        DONE,
        InvalidBlock(id=b"msg1", reason="block after the done block", kind="after-done"),
    ]
    assert_split_invariant(server, data, expected, trailing=[b"5:1:M", b"9"])


def test_split_oversized_blocks() -> None:
    """(2) Oversized blocks are skipped to the same `InvalidBlock` however the stream is cut."""
    big = encode_netstrings([b"M", b"big", b"x" * 100, b"s", b"r"])
    small = encode_netstrings([b"M", b"ok", b"hi", b"s", b"r"])
    expected = [
        InvalidBlock(
            id=b"big",
            reason=f"block of {len(big) - 5} bytes is over the 64-byte limit",
            kind="too-large",
        ),
        MessageBlock(id=b"ok", message=b"hi", sender=b"s", recipients=(b"r",)),
    ]
    assert_split_invariant(small_server, big + small, expected, trailing=[big[:-1], b"65:"])


# --- (3) hypothesis round trips ---------------------------------------------------------


@FAST
@given(session=qmqp_client_sessions(), data=st.data())
def test_round_trip_client_session(session: list[qmqp.ClientBlock], data: st.DataObject) -> None:
    """(3) Any client blocks, sent by a client codec and cut at random, reach a server intact."""
    sender = client()
    wire = b"".join(sender.send(block) for block in session)
    assert feed(server(), data.draw(chunkings(wire, max_cuts=16))) == session


@FAST
@given(session=qmqp_server_sessions(), data=st.data())
def test_round_trip_server_session(session: list[qmqp.ServerBlock], data: st.DataObject) -> None:
    """(3) Any server blocks, sent by a server codec and cut at random, reach a client intact."""
    sender = server()
    wire = b"".join(sender.send(block) for block in session)
    assert feed(client(), data.draw(chunkings(wire, max_cuts=16))) == session


@FAST
@given(block=st.one_of(qmqp_client_blocks(), st.just(DONE)), data=st.data())
def test_round_trip_client_block(
    block: MessageBlock | AuthBlock | DoneBlock, data: st.DataObject
) -> None:
    """(3) Any client block decodes to itself and re-encodes to the same bytes, however cut."""
    wire = qmqp.encode(block)
    decoded = feed(server(), data.draw(chunkings(wire)))
    assert decoded == [block]
    assert qmqp.encode(block) == wire


@FAST
@given(block=st.one_of(qmqp_server_blocks(), st.just(DONE)), data=st.data())
def test_round_trip_server_block(
    block: ReplyBlock | AuthReplyBlock | DoneBlock, data: st.DataObject
) -> None:
    """(3) Any reply decodes to itself in the client role, however cut."""
    assert feed(client(), data.draw(chunkings(qmqp.encode(block)))) == [block]


@FAST
@given(
    ident=qmqp_ids(),
    kind=st.binary(max_size=3).filter(lambda kind: kind not in (b"M", b"A")),
    rest=st.lists(st.binary(max_size=8), max_size=3),
)
def test_unknown_types_are_refused_by_id(ident: bytes, kind: bytes, rest: list[bytes]) -> None:
    """(3) A block of any other type with an id decodes to ``unknown-type`` with that id."""
    [block] = server().receive_data(encode_netstrings([kind, ident, *rest]))
    assert isinstance(block, InvalidBlock)
    assert (block.id, block.kind) == (ident, "unknown-type")


# --- (4) hypothesis garbage ------------------------------------------------------------

_PIECES = st.sampled_from(
    [b"1:M,", b"1:A,", b"1:R,", b"1:D,", b"4:msg1,", b"1:K,", b"1:0,", b"0:,", b":", b",", b"1"]
)
_GARBAGE = st.one_of(
    st.binary(max_size=200),
    st.lists(st.one_of(_PIECES, st.binary(max_size=4)), max_size=30).map(b"".join),
    st.lists(
        st.lists(st.one_of(_PIECES, st.binary(max_size=6)), max_size=8).map(
            lambda parts: encode_netstring(b"".join(parts))
        ),
        max_size=6,
    ).map(b"".join),
)


@settings(max_examples=300, deadline=None)
@given(role=st.sampled_from(Role), garbage=_GARBAGE, data=st.data())
def test_garbage_gives_blocks_or_qmqp_error(
    role: Role, garbage: bytes, data: st.DataObject
) -> None:
    """(4) Arbitrary bytes, cut anywhere, give blocks or `QMQPError`, nothing else, both roles.

    A server never decodes a reply and a client never an `InvalidBlock`.
    (Roles are drawn rather than parametrized: pytest-twisted's call wrapper
    breaks on parametrized hypothesis tests.)
    """
    make = server if role is Role.SERVER else client
    blocks, _ = assert_events_or_error(
        make, data.draw(chunkings(garbage)), QMQPError, event_types=BLOCK_TYPES
    )
    if role is Role.SERVER:
        assert not any(isinstance(block, ReplyBlock | AuthReplyBlock) for block in blocks)
    else:
        assert not any(
            isinstance(block, MessageBlock | AuthBlock | InvalidBlock) for block in blocks
        )


@FAST
@given(session=qmqp_client_sessions(max_blocks=4), data=st.data())
def test_mutated_stream_gives_blocks_or_qmqp_error(
    session: list[qmqp.ClientBlock], data: st.DataObject
) -> None:
    """(4) A valid client stream with bytes flipped gives blocks or `QMQPError`, both roles.

    In the server role, when nothing was refused, the blocks decoded
    re-encode to the exact bytes they came from.
    """
    wire = bytearray(b"".join(map(qmqp.encode, session)) or b"0:,")
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        index = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
        wire[index] = data.draw(st.sampled_from(b"0123:,MADRKZ\x00\xff"))
    stream = bytes(wire)
    blocks, _ = assert_events_or_error(
        server, data.draw(chunkings(stream)), QMQPError, event_types=BLOCK_TYPES
    )
    if not any(isinstance(block, InvalidBlock) for block in blocks):
        consumed = b"".join(qmqp.encode(block) for block in blocks)  # type: ignore[arg-type]
        assert stream.startswith(consumed)
    assert_events_or_error(client, data.draw(chunkings(stream)), QMQPError, event_types=BLOCK_TYPES)


# --- (5) limits -----------------------------------------------------------------------


def test_oversized_message_skipped_as_it_streams() -> None:
    """(5) A 10 MB block over a 1 MiB limit is skipped in 64 KB chunks and refused by id.

    Nothing comes out until its comma has been checked; the block after it
    decodes normally.
    """
    limit = 1 << 20
    big = encode_netstrings([b"M", b"huge", b"x" * 10_000_000, b"s", b"r"])
    codec = server(limit)
    blocks: list[qmqp.Block] = []
    chunk = 64 * 1024
    for start in range(0, len(big), chunk):
        blocks += codec.receive_data(big[start : start + chunk])
        assert blocks == [] or start + chunk >= len(big)
    blocks += codec.receive_data(MSG1_WIRE)
    assert blocks == [
        InvalidBlock(
            id=b"huge",
            reason=f"block of {len(big) - 10} bytes is over the {limit}-byte limit",
            kind="too-large",
        ),
        MSG1,
    ]


def test_block_at_the_limit_is_kept() -> None:
    """A block whose declared length equals the limit is decoded; one byte more is refused."""
    content = b"".join(map(encode_netstring, [b"M", b"id", b"x" * 40, b"s", b"r"]))
    limit = len(content)
    [block] = server(limit).receive_data(encode_netstring(content))
    assert isinstance(block, MessageBlock)
    [refused] = server(limit - 1).receive_data(encode_netstring(content))
    assert isinstance(refused, InvalidBlock)
    assert refused.kind == "too-large"


def test_oversized_reply_refused_before_its_colon() -> None:
    """(5) A client refuses a reply longer than its limit as soon as the digits show it."""
    codec = client(1000)
    assert codec.receive_data(b"100") == []
    with pytest.raises(QMQPError) as info:
        codec.receive_data(b"1")
    assert info.value.kind == "too-large"
    assert "1000-byte limit" in info.value.reason
    errors = assert_split_error(
        lambda: client(20), SERVER_SESSION[:23] + b"21:", QMQPError, [SERVER_BLOCKS[0]]
    )
    assert all(isinstance(exc, QMQPError) and exc.kind == "too-large" for exc in errors)


@pytest.mark.parametrize("make", [server, client])
def test_hundred_digit_length_fails_at_once(make: Callable[[], QMQPCodec]) -> None:
    """(5) A 100-digit block length fails in the call that brings it, in both roles."""
    with pytest.raises(QMQPError) as info:
        make().receive_data(b"1" * 100)
    assert info.value.kind == "length-too-long"
    assert info.value.where == f"byte {MAX_LENGTH_DIGITS}"


def test_eleventh_digit_fails_without_the_colon() -> None:
    """(5) Ten digits may still be a length; the eleventh fails before any ``:`` arrives."""
    codec = server()
    assert codec.receive_data(b"1" * MAX_LENGTH_DIGITS) == []
    with pytest.raises(QMQPError) as info:
        codec.receive_data(b"1")
    assert info.value.kind == "length-too-long"


def test_client_refuses_a_long_length_sooner() -> None:
    """(5) A client fails as soon as the digits pass its limit: 9 digits over 32 MiB."""
    codec = client()
    assert codec.receive_data(b"1" * 8) == []
    with pytest.raises(QMQPError) as info:
        codec.receive_data(b"1")
    assert info.value.kind == "too-large"


def test_oversized_auth_block_is_an_error() -> None:
    """An auth block over the limit cannot be refused by id: `QMQPError` ``too-large``."""
    data = encode_netstrings([b"A", b"user", b"p" * 100])
    assert server_error(data, small_server).kind == "too-large"


def test_oversized_block_without_a_readable_id_is_an_error() -> None:
    """An oversized block whose first bytes show no type and id is `QMQPError` ``too-large``."""
    assert server_error(encode_netstring(b"x" * 100), small_server).kind == "too-large"
    long_id = encode_netstrings([b"M", b"i" * 5000, b"m", b"s", b"r"])
    [block] = server().receive_data(long_id)
    assert isinstance(block, MessageBlock)
    error = server_error(long_id, lambda: server(4096))
    assert error.kind == "too-large"


def test_oversized_block_after_done() -> None:
    """An oversized block after the done block is refused as ``after-done``."""
    big = encode_netstrings([b"M", b"late", b"x" * 100, b"s", b"r"])
    assert small_server().receive_data(qmqp.DONE_BYTES + big) == [
        DONE,
        InvalidBlock(id=b"late", reason="block after the done block", kind="after-done"),
    ]


# --- InvalidBlock: identified, refused with D, the stream goes on ----------------------

INVALID_BLOCKS: list[tuple[bytes, InvalidBlock]] = [
    (
        encode_netstrings([b"M", b"id1", b"text", b"from@example.com"]),
        InvalidBlock(id=b"id1", reason="message block has no recipient", kind="no-recipient"),
    ),
    (
        encode_netstrings([b"M", b"id1", b"text"]),
        InvalidBlock(
            id=b"id1", reason="message block lacks a sender and a recipient", kind="missing-fields"
        ),
    ),
    (
        encode_netstrings([b"M", b"id1"]),
        InvalidBlock(
            id=b"id1",
            reason="message block lacks a message, a sender and a recipient",
            kind="missing-fields",
        ),
    ),
    (
        encode_netstring(b"1:M,3:id1,4:text,"),
        InvalidBlock(
            id=b"id1", reason="message block lacks a sender and a recipient", kind="missing-fields"
        ),
    ),
    (
        encode_netstring(b"1:M,3:id1,5:ab"),
        InvalidBlock(
            id=b"id1",
            reason="message block framing is broken after the id: netstring of 5 bytes runs"
            " past the end of the data (at byte 10 of the block)",
            kind="bad-framing",
        ),
    ),
    (
        encode_netstring(b"1:M,3:id1,4:text;"),
        InvalidBlock(
            id=b"id1",
            reason="message block framing is broken after the id: expected ',' after the"
            " netstring payload, got ';' (at byte 16 of the block)",
            kind="bad-framing",
        ),
    ),
    (
        encode_netstring(b"1:M,3:id1,04:text,"),
        InvalidBlock(
            id=b"id1",
            reason="message block framing is broken after the id: netstring length has a"
            " leading zero (at byte 10 of the block)",
            kind="bad-framing",
        ),
    ),
    (
        encode_netstrings([b"X", b"id2", b"more"]),
        InvalidBlock(id=b"id2", reason="unknown block type 'X'", kind="unknown-type"),
    ),
    (
        encode_netstrings([b"R", b"id3", b"K", b"0"]),
        InvalidBlock(id=b"id3", reason="unknown block type 'R'", kind="unknown-type"),
    ),
    (
        encode_netstrings([b"", b"id4"]),
        InvalidBlock(id=b"id4", reason="unknown block type ''", kind="unknown-type"),
    ),
    (
        encode_netstrings([b"MM", b"id5", b"m", b"s", b"r"]),
        InvalidBlock(id=b"id5", reason="unknown block type 'MM'", kind="unknown-type"),
    ),
    (
        encode_netstring(b"1:#,3:id6,9:broken"),
        InvalidBlock(id=b"id6", reason="unknown block type '#'", kind="unknown-type"),
    ),
]


@pytest.mark.parametrize(("wire", "block"), INVALID_BLOCKS)
def test_invalid_block(wire: bytes, block: InvalidBlock) -> None:
    """A block with a type and an id that cannot be accepted decodes to `InvalidBlock`.

    The reason is readable, the stream goes on (the next block decodes),
    and the refusal is a D reply carrying the reason.
    """
    assert server().receive_data(wire + MSG1_WIRE) == [block, MSG1]
    reply = block.refusal(pending=3)
    assert reply == ReplyBlock(
        id=block.id,
        status=qmqp.D,
        description=block.reason.encode().replace(b"#", b"\\x23"),
        pending=3,
    )
    assert client().receive_data(server().send(reply)) == [reply]


def test_refusal_escapes_hash() -> None:
    """Spec, "Result String": ``#`` is reserved for HCMSSC codes, so a refusal escapes it."""
    [block] = server().receive_data(encode_netstrings([b"#", b"id"]))
    assert isinstance(block, InvalidBlock)
    assert "'#'" in block.reason
    assert b"#" not in block.refusal(0).description


def test_reason_quotes_peer_bytes_safely() -> None:
    """Peer bytes in a reason are escaped and cut: no control characters reach a description."""
    kind = b"\n\x00\xff" + b"z" * 100
    [block] = server().receive_data(encode_netstrings([kind, b"id"]))
    assert isinstance(block, InvalidBlock)
    assert block.reason.isprintable()
    assert block.reason.endswith("...")
    assert block.refusal(0).description.isascii()


@pytest.mark.parametrize(
    "late",
    [MSG1_WIRE, encode_netstrings([b"X", b"id9"]), encode_netstrings([b"M", b"id9"])],
)
def test_identifiable_block_after_done(late: bytes) -> None:
    """Spec, "QMQP Streaming Session Overview": nothing follows the done block.

    A block with an id after it is refused as ``after-done``, whatever else
    is wrong with it.
    """
    [done, block] = server().receive_data(qmqp.DONE_BYTES + late)
    assert done == DONE
    assert isinstance(block, InvalidBlock)
    assert block.kind == "after-done"
    assert block.reason == "block after the done block"


# --- QMQPError: the server role ------------------------------------------------------

SERVER_ERRORS: list[tuple[bytes, str]] = [
    (b"x", "bad-length"),
    (b":", "bad-length"),
    (b"-5:", "bad-length"),
    (b"01:", "leading-zero"),
    (b"4a", "missing-colon"),
    (b"1:Dx", "missing-comma"),
    (b"3:1:D,", "bad-framing"),
    (b"12345678901", "length-too-long"),
    (b"0:,", "empty-block"),
    (b"3:abc,", "bad-framing"),
    (encode_netstring(b"1:M"), "bad-framing"),
    (encode_netstring(b"1:M,3:id"), "bad-framing"),
    (encode_netstring(b"1:M,03:id1,"), "bad-framing"),
    (encode_netstring(b"1:M,"), "no-id"),
    (encode_netstring(b"1:X,"), "unknown-type"),
    (encode_netstring(b"0:,"), "unknown-type"),
    (encode_netstring(b"1:D,"), "unknown-type"),
    (encode_netstrings([b"A"]), "bad-auth"),
    (encode_netstrings([b"A", b"user"]), "bad-auth"),
    (encode_netstrings([b"A", b"user", b"pass", b"extra"]), "bad-auth"),
    (encode_netstring(b"1:A,4:user,3:pa"), "bad-framing"),
    (qmqp.DONE_BYTES + qmqp.DONE_BYTES, "after-done"),
    (qmqp.DONE_BYTES + AUTH_REQUEST, "after-done"),
    (qmqp.DONE_BYTES + b"0:,", "empty-block"),
]


@pytest.mark.parametrize(("wire", "kind"), SERVER_ERRORS)
def test_server_error(wire: bytes, kind: str) -> None:
    """What a server cannot identify or resynchronise raises `QMQPError` with a reason and kind.

    Bad outer framing, an empty block, inner framing broken before the id,
    an unknown type or an M without an id, an auth block of the wrong shape,
    a second done block or an auth block after it.
    """
    with pytest.raises(QMQPError) as info:
        server().receive_data(wire)
    assert info.value.kind == kind
    assert info.value.reason
    assert info.value.reply is None
    assert all(event == DONE for event in info.value.events)


def test_framing_error_says_where() -> None:
    """A framing error names the stream offset, counted across calls."""
    codec = server()
    assert codec.receive_data(MSG1_WIRE) == [MSG1]
    with pytest.raises(QMQPError) as info:
        codec.receive_data(b"1:Dx")
    assert info.value.where == f"byte {len(MSG1_WIRE) + 3}"
    assert "framing" in info.value.reason


def test_blocks_before_an_error_are_in_it() -> None:
    """Blocks decoded before a bad one come in the error's ``events``, in order, for any cut."""
    refused = encode_netstrings([b"M", b"x", b"m", b"s"])
    data = AUTH_REQUEST + MSG1_WIRE + refused + b"0:," + MSG1_WIRE
    [invalid] = server().receive_data(refused)
    assert_split_error(server, data, QMQPError, [AUTH, MSG1, invalid])
    assert_split_error(server, MSG1_WIRE + b"6:1:M,3:,", QMQPError, [MSG1])
    assert_split_error(client, SERVER_SESSION[:23] + b"3:1:R,", QMQPError, [SERVER_BLOCKS[0]])


def test_blocks_from_earlier_calls_are_not_repeated() -> None:
    """Only the failing call's blocks are in ``events``; earlier calls returned theirs."""
    codec = server()
    assert codec.receive_data(MSG1_WIRE + MSG1_WIRE[:2]) == [MSG1]
    with pytest.raises(QMQPError) as info:
        codec.receive_data(MSG1_WIRE[2:] + b"0:,")
    assert info.value.events == [MSG1]


# --- QMQPError: the client role -------------------------------------------------------

CLIENT_ERRORS: list[tuple[bytes, str]] = [
    (b"x", "bad-length"),
    (b"01:", "leading-zero"),
    (b"1;", "missing-colon"),
    (b"1:Dx", "missing-comma"),
    (b"0:,", "empty-block"),
    (b"3:abc,", "bad-framing"),
    (encode_netstring(b"1:R,4:msg1,1:K,1:1"), "bad-framing"),
    (encode_netstrings([b"R", b"msg1", b"K"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b"1", b"x"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"", b"1"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"Kok", b""]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"X", b"1"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"k", b"1"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b"-1"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b" 1"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b"1.5"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b"1_0"]), "bad-reply"),
    (encode_netstrings([b"R", b"msg1", b"K", b"1" * 21]), "bad-reply"),
    (encode_netstrings([b"A"]), "bad-auth-reply"),
    (encode_netstrings([b"A", b"2"]), "bad-auth-reply"),
    (encode_netstrings([b"A", b""]), "bad-auth-reply"),
    (encode_netstrings([b"A", b"yes"]), "bad-auth-reply"),
    (encode_netstrings([b"A", b"1", b"1"]), "bad-auth-reply"),
    (encode_netstrings([b"M", b"msg1", b"m", b"s", b"r"]), "unknown-type"),
    (encode_netstrings([b"X"]), "unknown-type"),
    (qmqp.DONE_BYTES + qmqp.DONE_BYTES, "after-done"),
    (qmqp.DONE_BYTES + SERVER_SESSION[:23], "after-done"),
]


@pytest.mark.parametrize(("wire", "kind"), CLIENT_ERRORS)
def test_client_error(wire: bytes, kind: str) -> None:
    """In the client role every malformed reply raises `QMQPError`, with a reason and kind."""
    with pytest.raises(QMQPError) as info:
        client().receive_data(wire)
    assert info.value.kind == kind
    assert info.value.reason
    assert all(event == DONE for event in info.value.events)


def test_pending_count_may_have_leading_zeros() -> None:
    """A pending count is decimal: ``007`` is 7 (accepted, though we never send it)."""
    wire = encode_netstrings([b"R", b"msg1", b"Zbusy", b"007"])
    assert client().receive_data(wire) == [
        ReplyBlock(id=b"msg1", status=qmqp.Z, description=b"busy", pending=7)
    ]


def test_description_is_any_bytes() -> None:
    """Spec, "Result String": the client must be ready for arbitrary description bytes."""
    description = bytes(range(256)) + b" #,:"
    reply = ReplyBlock(id=b"m", status=qmqp.D, description=description, pending=12345678901234)
    assert client().receive_data(qmqp.encode(reply)) == [reply]


@given(
    ident=st.binary(max_size=40),
    status=st.sampled_from([qmqp.K, qmqp.Z, qmqp.D]),
    description=st.binary(max_size=300),
    pending=st.integers(min_value=0, max_value=10**qmqp.MAX_PENDING_DIGITS - 1),
)
def test_encode_reply_is_the_general_netstring_encoding(
    ident: bytes, status: bytes, description: bytes, pending: int
) -> None:
    """The reply fast path writes what the general netstring encoder writes, and it decodes back."""
    wire = qmqp.encode_reply(ident, status, description, pending)
    assert wire == encode_netstrings([b"R", ident, status + description, b"%d" % pending])
    reply = ReplyBlock(id=ident, status=status, description=description, pending=pending)
    assert qmqp.encode(reply) == wire
    assert client().receive_data(wire) == [reply]


# --- dead after error, end of input, error family ---------------------------------------


@pytest.mark.parametrize("make", [server, client])
def test_dead_after_error(make: Callable[[], QMQPCodec]) -> None:
    """After an error every call raises again, without events, and nothing more is decoded."""
    codec = make()
    with pytest.raises(QMQPError) as first:
        codec.receive_data(b"0:,")
    for data in [b"", qmqp.DONE_BYTES, MSG1_WIRE]:
        with pytest.raises(QMQPError) as again:
            codec.receive_data(data)
        assert again.value.events == []
        assert again.value.kind == first.value.kind
    with pytest.raises(QMQPError):
        codec.end_of_input()


@pytest.mark.parametrize("make", [server, client])
def test_end_of_input_between_blocks(make: Callable[[], QMQPCodec]) -> None:
    """Ending between blocks (or before any) is clean; inside one it is reported."""
    data = CLIENT_SESSION[:-4] if make is server else SERVER_SESSION[:-4]
    for partial in [b"1", b"12:", b"19:1:R,4:ms"]:
        assert_truncation_reported(make, data, partial, QMQPCodec.end_of_input, QMQPError)
    assert_truncation_reported(make, b"", b"1:D", QMQPCodec.end_of_input, QMQPError)


def test_end_of_input_inside_a_skipped_block() -> None:
    """Ending inside an oversized block being skipped is truncation too."""
    codec = small_server()
    assert codec.receive_data(b"100:") == []
    with pytest.raises(QMQPError) as info:
        codec.end_of_input()
    assert info.value.kind == "truncated"
    with pytest.raises(QMQPError):
        codec.receive_data(b"")


def test_error_family() -> None:
    """`QMQPError` and `QMQPLocalError` belong to the project's one error family."""
    assert issubclass(QMQPError, RemoteProtocolError)
    assert issubclass(QMQPLocalError, LocalProtocolError)
    assert issubclass(QMQPError, ProtocolError)


def test_roles_and_done_state() -> None:
    """Each codec reports its role and whether the peer's done block has arrived."""
    codec = server()
    assert codec.role is Role.SERVER
    assert client().role is Role.CLIENT
    assert not codec.peer_done
    codec.receive_data(MSG1_WIRE)
    assert not codec.peer_done
    codec.receive_data(qmqp.DONE_BYTES)
    assert codec.peer_done


# --- encode and send ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "kind"),
    [
        (MessageBlock(id=b"m", message=b"x", sender=b"s", recipients=()), "no-recipient"),
        (ReplyBlock(id=b"m", status=b"X", description=b"", pending=0), "bad-status"),
        (ReplyBlock(id=b"m", status=b"", description=b"", pending=0), "bad-status"),
        (ReplyBlock(id=b"m", status=b"KZ", description=b"", pending=0), "bad-status"),
        (ReplyBlock(id=b"m", status=b"k", description=b"", pending=0), "bad-status"),
        (ReplyBlock(id=b"m", status=qmqp.K, description=b"", pending=-1), "bad-pending"),
        (ReplyBlock(id=b"m", status=qmqp.K, description=b"", pending=10**20), "bad-pending"),
        (InvalidBlock(id=b"m", reason="r", kind="no-recipient"), "wrong-block"),
    ],
)
def test_encode_refuses(block: qmqp.Block, kind: str) -> None:
    """`encode` refuses blocks QMQP cannot carry with `QMQPLocalError` naming the problem."""
    with pytest.raises(QMQPLocalError) as info:
        qmqp.encode(block)
    assert info.value.kind == kind


def test_send_refuses_what_encode_refuses() -> None:
    """``send`` applies the same checks: no recipient-less message, no bad status or count."""
    with pytest.raises(QMQPLocalError) as info:
        client().send(MessageBlock(id=b"m", message=b"x", sender=b"s", recipients=()))
    assert info.value.kind == "no-recipient"
    with pytest.raises(QMQPLocalError) as info:
        server().send(ReplyBlock(id=b"m", status=b"Q", description=b"", pending=0))
    assert info.value.kind == "bad-status"
    with pytest.raises(QMQPLocalError) as info:
        server().send(ReplyBlock(id=b"m", status=qmqp.Z, description=b"", pending=-3))
    assert info.value.kind == "bad-pending"


@pytest.mark.parametrize(
    "block",
    [
        ReplyBlock(id=b"m", status=qmqp.K, description=b"", pending=0),
        AuthReplyBlock(success=True),
        InvalidBlock(id=b"m", reason="r", kind="unknown-type"),
    ],
)
def test_client_cannot_send_server_blocks(block: qmqp.Block) -> None:
    """A client sends only message, auth and done blocks."""
    with pytest.raises(QMQPLocalError) as info:
        client().send(block)
    assert info.value.kind == "wrong-role"


@pytest.mark.parametrize("block", [MSG1, AUTH, InvalidBlock(id=b"m", reason="r", kind="x")])
def test_server_cannot_send_client_blocks(block: qmqp.Block) -> None:
    """A server sends only reply, auth reply and done blocks."""
    with pytest.raises(QMQPLocalError) as info:
        server().send(block)
    assert info.value.kind == "wrong-role"


@pytest.mark.parametrize(
    ("make", "block"),
    [
        (client, MSG1),
        (client, DONE),
        (server, ReplyBlock(id=b"m", status=qmqp.K, description=b"", pending=0)),
        (server, DONE),
    ],
)
def test_nothing_after_own_done(make: Callable[[], QMQPCodec], block: qmqp.Block) -> None:
    """Spec, "QMQP Streaming Session Overview": a side sends nothing after its done block."""
    codec = make()
    assert codec.send(DONE) == qmqp.DONE_BYTES
    with pytest.raises(QMQPLocalError) as info:
        codec.send(block)
    assert info.value.kind == "after-done"


def test_refused_send_changes_nothing() -> None:
    """A refused ``send`` leaves the codec usable: the done block can still follow."""
    codec = client()
    with pytest.raises(QMQPLocalError):
        codec.send(MessageBlock(id=b"m", message=b"x", sender=b"s", recipients=()))
    assert codec.send(DONE) == qmqp.DONE_BYTES


@FAST
@given(block=qmqp_message_blocks())
def test_message_block_encoding(block: MessageBlock) -> None:
    """A message block is the netstring of ``M``, id, message, sender and each recipient."""
    fields = [b"M", block.id, block.message, block.sender, *block.recipients]
    assert qmqp.encode(block) == encode_netstring(b"".join(map(encode_netstring, fields)))


def test_role_must_be_a_qmqp_role() -> None:
    """Another codec's role enum is refused at construction rather than read as a client."""
    with pytest.raises(TypeError):
        QMQPCodec("server")  # type: ignore[arg-type]
