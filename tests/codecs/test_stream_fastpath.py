"""Differential tests: the stream and osiris fast paths against their general code."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import osiris
from gateway.codecs.stream import fastpath

_ENTRY = struct.Struct(">QI")
_SUB_BATCH_HEAD = struct.Struct(">BHII")


@st.composite
def _publish_v1_frames(draw: st.DrawFn) -> bytes:
    """Publish v1 frames (key and version first, no size): valid, mixed, or damaged."""
    entries = draw(
        st.lists(
            st.tuples(
                st.integers(0, 2**64 - 1), st.binary(max_size=40), st.booleans(), st.booleans()
            ),
            max_size=12,
        )
    )
    body = bytearray()
    for publishing_id, message, raw, use_sub_batch in entries:
        if raw and use_sub_batch:
            head = _SUB_BATCH_HEAD.pack(0x80, 1, len(message), len(message))
            body += struct.pack(">Q", publishing_id) + head + message
        else:
            body += _ENTRY.pack(publishing_id, len(message)) + message
    count = len(entries) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    frame = bytearray(struct.pack(">HHBI", 2, 1, draw(st.integers(0, 255)), max(count, 0)))
    frame += body
    damage = draw(st.sampled_from(["none", "none", "cut", "extra", "flip"]))
    if damage == "cut" and len(frame) > 9:
        del frame[draw(st.integers(9, len(frame) - 1)) :]
    elif damage == "extra":
        frame += draw(st.binary(min_size=1, max_size=8))
    elif damage == "flip" and len(frame) > 9:
        frame[draw(st.integers(9, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(frame)


@st.composite
def _uniform_publish_v1_frames(draw: st.DrawFn) -> bytes:
    """Frames whose entries mostly share one size: one may differ, the frame may be damaged."""
    size = draw(st.integers(0, 9))
    count = draw(st.integers(1, 12))
    sizes = [size] * count
    if draw(st.booleans()):
        sizes[draw(st.integers(0, count - 1))] = draw(st.integers(0, 9)) | draw(
            st.sampled_from([0, 0, 0x80000000])
        )
    body = bytearray()
    for n in sizes:
        body += _ENTRY.pack(draw(st.integers(0, 2**64 - 1)), n)
        body += draw(st.binary(min_size=n & 0xFF, max_size=n & 0xFF))
    frame = bytearray(struct.pack(">HHBI", 2, 1, 7, count)) + body
    damage = draw(st.sampled_from(["none", "none", "cut", "extra", "flip"]))
    if damage == "cut":
        del frame[draw(st.integers(9, len(frame) - 1)) :]
    elif damage == "extra":
        frame += draw(st.binary(min_size=1, max_size=30))
    elif damage == "flip":
        frame[draw(st.integers(9, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(frame)


def _outcome(decode: object, frame: bytes) -> object:
    """What a decoder makes of a frame: the event, or the error's type and text."""
    assert callable(decode)
    try:
        return decode(frame)
    except Exception as exc:  # compared, whatever it is
        return (type(exc), str(exc))


@given(_publish_v1_frames() | _uniform_publish_v1_frames())
def test_publish_v1_fast_path_matches_the_general_code(frame: bytes) -> None:
    """Any v1 Publish frame decodes, or fails, exactly as the general decoder has it."""
    assert _outcome(fastpath._decode_publish_v1, frame) == _outcome(
        fastpath._decode_publish_v1_general, frame
    )


def _entries_one_by_one(messages: list[bytes]) -> bytes:
    """Simple osiris entries written one at a time: u32 size, then the body."""
    return b"".join(struct.pack(">I", len(m)) + m for m in messages)


@given(
    st.lists(st.binary(max_size=6), max_size=40)
    | st.integers(1, 40).flatmap(lambda n: st.lists(st.binary(min_size=3, max_size=3), min_size=n))
)
def test_encode_entries_matches_one_entry_at_a_time(messages: list[bytes]) -> None:
    """Batches of repeated sizes (the cached prefixes) or of many sizes encode the same."""
    assert osiris.encode_entries(messages) == _entries_one_by_one(messages)


@given(st.lists(st.binary(max_size=20), min_size=1, max_size=5), st.binary(max_size=3))
def test_delivery_payload_of_a_whole_chunk_is_the_read_itself(
    messages: list[bytes], before: bytes
) -> None:
    """A read holding exactly one bloomless chunk is sent as it is; any other read is cut."""
    chunk = osiris.encode_chunk(messages, first_offset=0, timestamp_ms=0)
    assert osiris.delivery_payload(chunk) is chunk
    cut = osiris.delivery_payload(before + chunk + b"next", len(before))
    assert cut == chunk
    assert osiris.delivery_payload(bytearray(chunk)) == chunk


def test_uniform_publish_v1_reads_ids_and_views() -> None:
    """Entries of one size decode without the loop: ids in order.

    Small bodies are copied out by one struct, large ones are views of the frame.
    """
    ids = [1, 2**64 - 1, 0x0102030405060708]
    for size, copied in [(3, True), (fastpath._COPY_MAX_BYTES, True), (1025, False)]:
        messages = [bytes([n]) * size for n in range(3)]
        frame = struct.pack(">HHBI", 2, 1, 4, 3) + b"".join(
            _ENTRY.pack(i, size) + m for i, m in zip(ids, messages, strict=True)
        )
        event = fastpath._decode_publish_v1(frame)
        assert event.publishing_ids == ids
        assert [bytes(m) for m in event.messages] == messages
        if copied:
            assert all(type(m) is bytes for m in event.messages)
        else:
            assert all(isinstance(m, memoryview) and m.obj is frame for m in event.messages)
        assert event == fastpath._decode_publish_v1_general(frame)


@given(
    st.sampled_from([0, 1, 100, fastpath._COPY_MAX_BYTES, fastpath._COPY_MAX_BYTES + 1]),
    st.integers(1, 200),
    st.randoms(use_true_random=False),
)
def test_uniform_blocks_match_the_general_code(size: int, count: int, rng: object) -> None:
    """Any count (blocks of 64, 32, ... 1) and sizes either side of the copy limit."""
    import random

    assert isinstance(rng, random.Random)
    ids = [rng.getrandbits(64) for _ in range(count)]
    frame = struct.pack(">HHBI", 2, 1, 9, count) + b"".join(
        _ENTRY.pack(i, size) + rng.randbytes(size) for i in ids
    )
    event = fastpath._decode_publish_v1(frame)
    assert type(event.messages) is osiris.FrozenEntries
    assert event == fastpath._decode_publish_v1_general(frame)
    assert event.publishing_ids == ids


def _v1_frame(messages: list[bytes]) -> bytes:
    body = b"".join(_ENTRY.pack(i, len(m)) + m for i, m in enumerate(messages))
    return struct.pack(">HHBI", 2, 1, 4, len(messages)) + body


def _v2_frame(messages: list[bytes]) -> bytes:
    body = b"".join(struct.pack(">QhI", i, -1, len(m)) + m for i, m in enumerate(messages))
    return struct.pack(">HHBI", 2, 2, 4, len(messages)) + body


def test_publish_entries_of_a_bytes_frame_are_frozen() -> None:
    """Each fast path hands the views of a ``bytes`` frame over as FrozenEntries."""
    uniform = _v1_frame([b"abc", b"def"])
    mixed = _v1_frame([b"abc", b"de"])
    for frame, decode in [
        (uniform, fastpath._decode_publish_v1),
        (mixed, fastpath._decode_publish_v1),
        (_v2_frame([b"abc", b"de"]), fastpath._decode_publish_v2),
    ]:
        messages = decode(frame).messages
        assert type(messages) is osiris.FrozenEntries
        assert [bytes(m) for m in messages] in ([b"abc", b"def"], [b"abc", b"de"])


@given(_publish_v1_frames() | _uniform_publish_v1_frames())
def test_frozen_entries_are_views_of_the_bytes_frame_only(frame: bytes) -> None:
    """FrozenEntries hold nothing but bytes and views of a ``bytes`` frame.

    A frame in a buffer that may change decodes to a plain list (the log
    copies that one's views).
    """
    for buffer in (frame, bytearray(frame)):
        try:
            messages = fastpath._decode_publish_v1(buffer).messages  # type: ignore[arg-type]
        except Exception:  # malformed: compared with the general code above
            continue
        if type(messages) is osiris.FrozenEntries:
            assert type(buffer) is bytes
            assert all(
                type(m) is bytes or (isinstance(m, memoryview) and m.obj is buffer)
                for m in messages
            )
