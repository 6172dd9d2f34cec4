"""The hot paths: Publish, PublishConfirm, PublishError and Deliver.

A Publish decodes to lists of ids and of `memoryview` slices of its frame
without copying a message (an `osiris.FrozenEntries` when the frame is
``bytes``: the log keeps them without asking each); a Deliver is written
as a small prefix before the stored chunk (`deliver_prefix`).
"""

from __future__ import annotations

import array
import functools
import struct
import sys
from collections.abc import Sequence
from typing import Final

from gateway.codecs.osiris import FrozenEntries
from gateway.codecs.stream.events import (
    Deliver,
    Publish,
    PublishConfirm,
    PublishError,
)
from gateway.codecs.stream.fields import (
    _KEY_VERSION_BYTES,
    _NULL,
    _U8,
    _U32,
    _U64,
)
from gateway.codecs.stream.values import (
    Key,
    StreamLocalError,
    _MalformedError,
)

__all__ = ["deliver_prefix"]

# --- the hot paths: Publish, PublishConfirm, PublishError, Deliver -------------------------

_PUBLISH_HEAD: Final = struct.Struct(">BI")  # publisher id, entry count
_PUBLISH_FRAME_HEAD: Final = struct.Struct(">IHHBI")
_ENTRY: Final = struct.Struct(">QI")  # publishing id, size (bit 31 set: a sub-batch)
_ENTRY_V2: Final = struct.Struct(">Qh")  # publishing id, filter value length
_SUB_BATCH: Final = struct.Struct(">BHII")  # flags, records, uncompressed size, size
_ID_CODE: Final = struct.Struct(">QH")
_DELIVER_V1: Final = struct.Struct(">IHHB")
_DELIVER_V2: Final = struct.Struct(">IHHBQ")
_SUB_BATCH_BIT: Final = 0x80000000
_SUB_BATCH_FLAG: Final = 0x80
_BODY_START: Final = 9  # key, version, publisher id, count
_ENTRY_BYTES: Final = 12
_ENTRY_V2_MIN_BYTES: Final = 14
_SUB_BATCH_HEADER_BYTES: Final = 11
_MAX_MESSAGE_BYTES: Final = 0x7FFFFFFF  # 31 bits: the top bit marks a sub-batch
_BIG_ENDIAN: Final = sys.byteorder == "big"


def _publish_head(frame: bytes, min_entry_bytes: int) -> tuple[int, int]:
    """Publisher id and entry count, refusing a count the frame cannot hold."""
    publisher_id, count = _PUBLISH_HEAD.unpack_from(frame, _KEY_VERSION_BYTES)
    room = len(frame) - _BODY_START
    if count > room // min_entry_bytes:
        raise _MalformedError(f"{count} entries cannot fit in {room} bytes", "count")
    return publisher_id, count


def _entries_end(frame: bytes, pos: int) -> None:
    """Check that the entries end exactly where the frame does."""
    if pos > len(frame):
        raise _MalformedError("the last entry runs past the end of the frame", "messages")
    if pos < len(frame):
        raise _MalformedError(f"{len(frame) - pos} bytes follow the last entry", "messages")


def _decode_publish_v1(frame: bytes) -> Publish:
    """Notes, section 5 0x0002 v1: ``(id:u64, 0:1 size:31, message)*`` or sub-batch entries.

    Entries that all have one size (fixed-size records) take
    `_decode_uniform_publish_v1`. Otherwise one `struct.unpack_from` and one
    `memoryview` slice per entry, and no test of bit 31 in that loop: a
    sub-batch's size has it set, so the entries then overrun the frame, and
    `_decode_publish_v1_general` reads the frame again, sub-batches and
    errors included.
    """
    publisher_id, count = _publish_head(frame, _ENTRY_BYTES)
    if count and type(frame) is bytes:
        # The count fits the frame, so the first entry's head is there.
        stride = _ENTRY_BYTES + _U32.unpack_from(frame, _BODY_START + 8)[0]
        if len(frame) - _BODY_START == count * stride and _same_sizes(frame, stride, count):
            return _decode_uniform_publish_v1(frame, publisher_id, count, stride)
    view = memoryview(frame)
    ids: list[int] = []
    messages: list[bytes | memoryview] = FrozenEntries() if type(frame) is bytes else []
    # Locals, not globals, in the loop that runs once per message.
    add_id, add_message, unpack = ids.append, messages.append, _ENTRY.unpack_from
    entry_bytes = _ENTRY_BYTES
    pos = _BODY_START
    try:
        for _ in range(count):
            publishing_id, size = unpack(frame, pos)
            start = pos + entry_bytes
            pos = start + size
            add_id(publishing_id)
            add_message(view[start:pos])
    except struct.error:
        return _decode_publish_v1_general(frame)
    # A slice past the end is silently short: one check here covers every
    # entry, since an overrun before the last makes the next unpack fail.
    if pos != len(frame):
        return _decode_publish_v1_general(frame)
    return Publish(publisher_id=publisher_id, publishing_ids=ids, messages=messages)


def _same_sizes(frame: bytes, stride: int, count: int) -> bool:
    """Whether each of the ``count`` entries, ``stride`` bytes apart, has the first one's size.

    Four strided slices compare each byte of the size fields at once, in C.
    """
    at = _BODY_START + 8
    return all(frame[i::stride] == frame[i : i + 1] * count for i in range(at, at + 4))


def _decode_uniform_publish_v1(frame: bytes, publisher_id: int, count: int, stride: int) -> Publish:
    """A v1 Publish whose entries all have one size (checked): no loop over the entries.

    Small entries (`_COPY_MAX_BYTES`) are read by a compiled `struct` for
    blocks of up to `_UNIFORM_BLOCK` entries, ids and bodies together, the
    bodies as ``bytes`` copies: about 45 ns a message against 155 for a
    view each (100-byte messages, 200 a frame). Larger ones are one view
    each, the ids gathered by eight strided copies and read as one array.
    """
    size = stride - _ENTRY_BYTES
    if size <= _COPY_MAX_BYTES:
        ids: list[int] = []
        bodies = FrozenEntries()
        pos, left, block = _BODY_START, count, _UNIFORM_BLOCK
        while left:
            while block > left:
                block //= 2
            fields = _uniform_struct(size, block).unpack_from(frame, pos)
            ids += fields[0::2]
            bodies += fields[1::2]
            pos += block * stride
            left -= block
        return Publish(publisher_id=publisher_id, publishing_ids=ids, messages=bodies)
    ids_be = bytearray(8 * count)
    for i in range(8):
        ids_be[i::8] = frame[_BODY_START + i :: stride]
    view = memoryview(frame)
    first = _BODY_START + _ENTRY_BYTES
    messages = FrozenEntries(
        [view[at : at + size] for at in range(first, first + count * stride, stride)]
    )
    return Publish(
        publisher_id=publisher_id, publishing_ids=_u64_list(ids_be, 0), messages=messages
    )


_COPY_MAX_BYTES: Final = 1024
"""Uniform entries up to this size are copied out by `struct` (faster than a view each)."""
_UNIFORM_BLOCK: Final = 64
"""The most entries one `_uniform_struct` reads; a frame takes blocks of 64, 32, ... 1."""


@functools.lru_cache(maxsize=1024)
def _uniform_struct(size: int, block: int) -> struct.Struct:
    """The format of ``block`` entries of ``size`` bytes: (id, body) each, the size skipped."""
    return struct.Struct(">" + f"Q4x{size}s" * block)


def _decode_publish_v1_general(frame: bytes) -> Publish:
    """`_decode_publish_v1` for any frame: sub-batch entries, and the errors said exactly."""
    publisher_id, count = _publish_head(frame, _ENTRY_BYTES)
    view = memoryview(frame)
    ids: list[int] = []
    messages: list[memoryview] = []
    pos = _BODY_START
    for index in range(count):
        publishing_id, size = _ENTRY.unpack_from(frame, pos)
        if size & _SUB_BATCH_BIT:
            flags, pos = _sub_batch_entries(frame, view, pos, count - index, ids, messages)
            _entries_end(frame, pos)
            return Publish(
                publisher_id=publisher_id,
                publishing_ids=ids,
                messages=messages,
                sub_batches=flags,
            )
        start = pos + _ENTRY_BYTES
        pos = start + size
        ids.append(publishing_id)
        messages.append(view[start:pos])
    _entries_end(frame, pos)
    return Publish(publisher_id=publisher_id, publishing_ids=ids, messages=messages)


def _sub_batch_entries(
    frame: bytes,
    view: memoryview,
    pos: int,
    left: int,
    ids: list[int],
    messages: list[memoryview],
) -> tuple[list[bool], int]:
    """Read the ``left`` remaining v1 entries, simple or sub-batch; return flags and end.

    A sub-batch entry is ``flags:u8 records:u16 uncompressed:u32 size:u32
    batch``; it is kept raw, flags byte first, as osiris stores it.
    """
    flags = [False] * len(ids)
    for _ in range(left):
        publishing_id, size = _ENTRY.unpack_from(frame, pos)
        if size & _SUB_BATCH_BIT:
            start = pos + 8
            size = _SUB_BATCH.unpack_from(frame, start)[3]
            pos = start + _SUB_BATCH_HEADER_BYTES + size
            flags.append(True)
        else:
            start = pos + _ENTRY_BYTES
            pos = start + size
            flags.append(False)
        ids.append(publishing_id)
        messages.append(view[start:pos])
    return flags, pos


def _decode_publish_v2(frame: bytes) -> Publish:
    """Notes, section 5 0x0002 v2: ``(id:u64, filter:string, 0:1 size:31, message)*``.

    A filter length of -1 is no filter value. Version 2 has no sub-batch
    entries (the reference server does not support them, 14.21): a set top
    bit is malformed.
    """
    publisher_id, count = _publish_head(frame, _ENTRY_V2_MIN_BYTES)
    view = memoryview(frame)
    ids: list[int] = []
    filters: list[str | None] = []
    messages: list[bytes | memoryview] = FrozenEntries() if type(frame) is bytes else []
    pos = _BODY_START
    for _ in range(count):
        publishing_id, length = _ENTRY_V2.unpack_from(frame, pos)
        pos += 10
        if length >= 0:
            filters.append(frame[pos : pos + length].decode("utf-8"))
            pos += length
        elif length == _NULL:
            filters.append(None)
        else:
            raise _MalformedError(f"filter value length {length} is negative", "filter_values")
        (size,) = _U32.unpack_from(frame, pos)
        if size & _SUB_BATCH_BIT:
            raise _MalformedError("version 2 entries cannot be sub-batches", "messages")
        start = pos + 4
        pos = start + size
        ids.append(publishing_id)
        messages.append(view[start:pos])
    _entries_end(frame, pos)
    return Publish(
        publisher_id=publisher_id,
        publishing_ids=ids,
        messages=messages,
        version=2,
        filter_values=filters,
    )


def _encode_publish(event: Publish) -> bytes:
    """Write a Publish, v1 or v2, joining the messages once."""
    ids, messages = event.publishing_ids, event.messages
    if len(ids) != len(messages):
        raise StreamLocalError(
            f"{len(ids)} publishing ids for {len(messages)} messages", kind="bad-value"
        )
    out: list[bytes | memoryview] = [b""]
    if event.version == 1:
        if event.filter_values is not None:
            raise StreamLocalError("filter values need Publish version 2", kind="bad-value")
        if event.sub_batches is None:
            pack = _ENTRY.pack
            for publishing_id, message in zip(ids, messages, strict=True):
                out += (pack(publishing_id, len(message)), message)
        else:
            _write_mixed_entries(event, event.sub_batches, out)
    elif event.version == 2:
        _write_v2_entries(event, out)
    else:
        raise StreamLocalError(f"Publish has no version {event.version}", kind="bad-version")
    size = sum(map(len, out)) + _BODY_START
    if size > _MAX_MESSAGE_BYTES:
        # Rare: only then can a message be too long for 31 bits.
        for message in messages:
            if len(message) > _MAX_MESSAGE_BYTES:
                raise StreamLocalError("a message is over 2**31 - 1 bytes", kind="too-large")
    out[0] = _PUBLISH_FRAME_HEAD.pack(
        size, Key.PUBLISH, event.version, event.publisher_id, len(ids)
    )
    return b"".join(out)


def _write_mixed_entries(
    event: Publish, flags: Sequence[bool], out: list[bytes | memoryview]
) -> None:
    """Version 1 entries with sub-batches: those are written raw after their id."""
    if len(flags) != len(event.messages):
        raise StreamLocalError(
            f"{len(flags)} sub-batch flags for {len(event.messages)} messages", kind="bad-value"
        )
    for publishing_id, message, raw in zip(
        event.publishing_ids, event.messages, flags, strict=True
    ):
        if not raw:
            out += (_ENTRY.pack(publishing_id, len(message)), message)
            continue
        if (
            len(message) < _SUB_BATCH_HEADER_BYTES
            or not message[0] & _SUB_BATCH_FLAG
            or _SUB_BATCH.unpack_from(message)[3] != len(message) - _SUB_BATCH_HEADER_BYTES
        ):
            raise StreamLocalError(
                "a sub-batch entry needs its 11-byte header (flags with bit 7 set,"
                " records, uncompressed size, size of the rest)",
                kind="bad-value",
            )
        out += (_U64.pack(publishing_id), message)


def _write_v2_entries(event: Publish, out: list[bytes | memoryview]) -> None:
    """Version 2 entries: id, filter value (-1 for None), size, message."""
    filters = event.filter_values
    if filters is None or len(filters) != len(event.messages):
        raise StreamLocalError("Publish version 2 needs one filter value per message")
    if event.sub_batches is not None:
        raise StreamLocalError("Publish version 2 cannot carry sub-batches", kind="bad-value")
    for publishing_id, message, value in zip(
        event.publishing_ids, event.messages, filters, strict=True
    ):
        if value is None:
            out.append(_ENTRY_V2.pack(publishing_id, _NULL))
        else:
            data = value.encode("utf-8")
            out += (_ENTRY_V2.pack(publishing_id, len(data)), data)
        out += (_U32.pack(len(message)), message)


def _u64_list(frame: bytes | bytearray, start: int) -> list[int]:
    """The big-endian uint64s from ``start`` to the end, as a list (one C pass)."""
    values = array.array("Q")
    values.frombytes(frame[start:])
    if not _BIG_ENDIAN:
        values.byteswap()
    return values.tolist()


def _u64_bytes(values: Sequence[int]) -> bytes:
    """``values`` as big-endian uint64s (one C pass); OverflowError when out of range."""
    packed = array.array("Q", values)
    if not _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _decode_publish_confirm(frame: bytes) -> PublishConfirm:
    """Notes, section 5 0x0003: publisher id, count, then count uint64s and nothing else."""
    publisher_id, count = _PUBLISH_HEAD.unpack_from(frame, _KEY_VERSION_BYTES)
    if len(frame) != _BODY_START + 8 * count:
        raise _MalformedError(f"{count} publishing ids do not fill {len(frame)} bytes", "count")
    return PublishConfirm(publisher_id=publisher_id, publishing_ids=_u64_list(frame, _BODY_START))


def _encode_publish_confirm(event: PublishConfirm) -> bytes:
    """A 9-byte head and the ids packed by `array` (cheapest way measured for 1,000 ids)."""
    ids = event.publishing_ids
    body = _u64_bytes(ids)
    head = _PUBLISH_FRAME_HEAD.pack(
        _BODY_START + len(body), Key.PUBLISH_CONFIRM, 1, event.publisher_id, len(ids)
    )
    return head + body


def _decode_publish_error(frame: bytes) -> PublishError:
    """Notes, section 5 0x0004: publisher id, count, then (id:u64, code:u16) pairs."""
    publisher_id, count = _PUBLISH_HEAD.unpack_from(frame, _KEY_VERSION_BYTES)
    if len(frame) != _BODY_START + 10 * count:
        raise _MalformedError(f"{count} errors do not fill {len(frame)} bytes", "count")
    ids: list[int] = []
    codes: list[int] = []
    for publishing_id, code in _ID_CODE.iter_unpack(memoryview(frame)[_BODY_START:]):
        ids.append(publishing_id)
        codes.append(code)
    return PublishError(publisher_id=publisher_id, publishing_ids=ids, codes=codes)


def _encode_publish_error(event: PublishError) -> bytes:
    """Head, then one (id, code) pair per failed id."""
    ids, codes = event.publishing_ids, event.codes
    if len(ids) != len(codes):
        raise StreamLocalError(
            f"{len(ids)} publishing ids for {len(codes)} codes", kind="bad-value"
        )
    body = b"".join(map(_ID_CODE.pack, ids, codes))
    head = _PUBLISH_FRAME_HEAD.pack(
        _BODY_START + len(body), Key.PUBLISH_ERROR, 1, event.publisher_id, len(ids)
    )
    return head + body


def deliver_prefix(
    subscription_id: int,
    payload_length: int,
    version: int = 1,
    committed_chunk_id: int | None = None,
) -> bytes:
    """The bytes of a Deliver frame before its chunk: size, key, version, subscription id.

    Write ``[prefix, payload]`` with ``writeSequence``: the stored chunk (its
    48-byte header and its data, notes section 11) is never copied. Version
    2 adds the committed chunk id (notes, section 5 0x0008).

    Args:
        subscription_id: The subscription (uint8).
        payload_length: Bytes of the chunk that follow the prefix.
        version: 1, or 2 for clients that asked for it.
        committed_chunk_id: Version 2 only, and required there.

    Returns:
        10 bytes (version 1) or 18 (version 2).

    Raises:
        StreamLocalError: A committed chunk id with version 1 or none with
            version 2, another version, or a value out of range.
    """
    try:
        if version == 1 and committed_chunk_id is None:
            return _DELIVER_V1.pack(5 + payload_length, Key.DELIVER, 1, subscription_id)
        if version == 2 and committed_chunk_id is not None:
            return _DELIVER_V2.pack(
                13 + payload_length, Key.DELIVER, 2, subscription_id, committed_chunk_id
            )
    except struct.error as exc:
        raise StreamLocalError(f"Deliver cannot carry that: {exc}", kind="out-of-range") from None
    raise StreamLocalError(
        "Deliver version 1 has no committed chunk id and version 2 needs one; no other version",
        kind="bad-version",
    )


def _encode_deliver(event: Deliver) -> bytes:
    """The prefix and the chunk, joined (servers use `deliver_prefix` and skip the copy)."""
    chunk = event.chunk
    prefix = deliver_prefix(
        event.subscription_id, len(chunk), event.version, event.committed_chunk_id
    )
    return b"".join((prefix, chunk))


def _decode_deliver_v1(frame: bytes) -> Deliver:
    """Notes, section 5 0x0008 v1: subscription id, then the chunk to the end."""
    (subscription_id,) = _U8.unpack_from(frame, _KEY_VERSION_BYTES)
    return Deliver(subscription_id=subscription_id, chunk=memoryview(frame)[5:])


def _decode_deliver_v2(frame: bytes) -> Deliver:
    """Version 2: subscription id, committed chunk id, then the chunk."""
    subscription_id, committed = struct.unpack_from(">BQ", frame, _KEY_VERSION_BYTES)
    return Deliver(
        subscription_id=subscription_id,
        chunk=memoryview(frame)[13:],
        version=2,
        committed_chunk_id=committed,
    )
