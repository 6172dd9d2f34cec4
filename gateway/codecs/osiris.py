"""The osiris on-disk log layout: chunks, entries, tracking data and index records.

RabbitMQ streams keep each stream as an osiris log; this module is that layout,
defined once, and shared by the embedded log (`gateway.core.log`), the stream
server's Deliver frames and the Spark reader. Standard library only, no I/O:
functions turn values into bytes and bytes (any buffer) into values.

docs/stream-protocol-notes.md, section 10 (from osiris_log.erl):

- 10.1 files: per stream ``NNNNNNNNNNNNNNNNNNNN.segment`` and ``.index`` (20-digit
  first chunk id), headed by ``b"OSIL"`` / ``b"OSII"`` and a u32 version 1.
- 10.2 index record, 29 bytes: chunk id u64, timestamp i64, epoch u64, file
  position u32, chunk type u8; an all-zero record marks the end.
- 10.3 chunk header, 48 bytes, big-endian::

      magic:4 version:4 (0x50) | type u8 | entries u16 | records u32 |
      timestamp i64 | epoch u64 | chunk id u64 | crc u32 | data length u32 |
      trailer length u32 | bloom size u8 | 3 reserved bytes

  followed by the bloom filter, the data entries and the trailer. The CRC-32
  (zlib's) covers the data entries only.
- 10.4 entries: simple (u32 length with the top bit clear, then the body) or
  sub-batch (a byte with the top bit set and a 3-bit compression, then records
  u16, uncompressed length u32, length u32, body).
- 10.6 tracking entries: the trailer of user chunks and the body of tracking
  chunks; delta (type u8, id length u8, id, u64 value) and snapshot forms.
- Section 11: a Deliver frame carries the header as stored, then the data
  entries only (`delivery_payload`).

Chunk ids are record offsets: the next chunk's id is this one's plus its
record count, and a tracking chunk takes one offset (section 7).
"""

from __future__ import annotations

import mmap
import re
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Self, cast

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "COMPRESSION_GZIP",
    "COMPRESSION_NONE",
    "FILE_HEADER_BYTES",
    "HEADER_BYTES",
    "INDEX_HEADER",
    "INDEX_RECORD_BYTES",
    "MAGIC_VERSION",
    "MAX_ENTRIES_PER_CHUNK",
    "MAX_ENTRY_BYTES",
    "MAX_TRACKING_ID_BYTES",
    "MAX_UNCOMPRESSED_BYTES",
    "SEGMENT_HEADER",
    "SUB_BATCH_HEADER_BYTES",
    "TRACKING_DELTA",
    "TRACKING_OFFSET",
    "TRACKING_SEQUENCE",
    "TRACKING_SNAPSHOT",
    "TRACKING_TIMESTAMP",
    "USER",
    "Buffer",
    "ChunkHeader",
    "FrozenEntries",
    "IndexRecord",
    "OsirisError",
    "OsirisLocalError",
    "SubBatch",
    "decode_tracking",
    "decode_tracking_snapshot",
    "delivery_payload",
    "encode_chunk",
    "encode_entries",
    "encode_mixed_entries",
    "encode_sub_batch",
    "encode_tracking",
    "encode_tracking_snapshot",
    "entry_bytes",
    "file_stem",
    "frame_chunk",
    "index_file_name",
    "iter_entries",
    "iter_index_records",
    "pack_index_record",
    "parse_file_stem",
    "segment_file_name",
    "unpack_index_record",
    "validate_chunk",
]

# Spec ambiguity: osiris.hrl's comment says "Ver = 0x1" but its code writes
# version 0 and readers match the byte exactly, so 0x50 it is (notes, pitfall 11).
MAGIC_VERSION: Final = 0x50
"""First header byte: magic 5, version 0 (notes 10.3 and pitfall 11)."""

USER: Final = 0
"""Chunk type of user data (``CHNK_USER``)."""
TRACKING_DELTA: Final = 1
"""Chunk type of a tracking delta: one simple entry of delta tracking entries."""
TRACKING_SNAPSHOT: Final = 2
"""Chunk type of a tracking snapshot, written first in every rolled segment."""
_CHUNK_TYPES: Final = frozenset({USER, TRACKING_DELTA, TRACKING_SNAPSHOT})

HEADER_BYTES: Final = 48
"""Size of a chunk header (notes 10.3)."""
FILE_HEADER_BYTES: Final = 8
"""Size of the segment and index file headers (notes 10.1)."""
SEGMENT_HEADER: Final = b"OSIL" + (1).to_bytes(4, "big")
"""Segment file header: magic ``OSIL`` and version 1."""
INDEX_HEADER: Final = b"OSII" + (1).to_bytes(4, "big")
"""Index file header: magic ``OSII`` and version 1."""
INDEX_RECORD_BYTES: Final = 29
"""Size of one index record (notes 10.2)."""

MAX_ENTRIES_PER_CHUNK: Final = 65535
"""The header's entry count is a u16."""
MAX_ENTRY_BYTES: Final = 0x7FFFFFFF
"""A simple entry's length is 31 bits: the top bit marks a sub-batch."""
MAX_TRACKING_ID_BYTES: Final = 255
"""Tracking ids (references) carry a u8 length."""
MAX_UNCOMPRESSED_BYTES: Final = 64 * 1024 * 1024
"""Default cap on a gzip sub-batch's declared uncompressed size: 64 MiB, so a
hostile length field cannot make `iter_entries` allocate gigabytes."""

SUB_BATCH_HEADER_BYTES: Final = 11
"""Flag byte, records u16, uncompressed length u32, length u32 (notes 10.4)."""
COMPRESSION_NONE: Final = 0
"""Sub-batch body stored as u32-length-prefixed records."""
COMPRESSION_GZIP: Final = 1
"""Sub-batch body gzip-compressed (the stream protocol's compression type 1)."""

TRACKING_SEQUENCE: Final = 0
"""Tracking entry type: a publisher reference's last publishing id."""
TRACKING_OFFSET: Final = 1
"""Tracking entry type: a consumer reference's stored offset."""
TRACKING_TIMESTAMP: Final = 2
"""Tracking entry type: a timestamp (osiris only; read and ignored here)."""

# Spec ambiguity: the stream protocol document calls the CRC an int32; osiris
# stores zlib's unsigned value and clients compare it unsigned (pitfall 10).
# Its "Reserved = 4 bytes" is really the bloom size u8 and 3 bytes (pitfall 11).
_HEADER: Final = struct.Struct(">BBHIqQQIIIB3x")
_INDEX_RECORD: Final = struct.Struct(">QqQIB")
_U32: Final = struct.Struct(">I")
_U64: Final = struct.Struct(">Q")
_SUB_BATCH: Final = struct.Struct(">BHII")
_TRACKING_HEAD: Final = struct.Struct(">BB")
_SNAPSHOT_SEQUENCE: Final = struct.Struct(">QQ")
_ZERO_RECORD: Final = bytes(INDEX_RECORD_BYTES)
_STEM: Final = re.compile(r"\A[0-9]{20}\Z")
_U64_MAX: Final = 2**64 - 1
_U32_MAX: Final = 2**32 - 1

Buffer = bytes | bytearray | memoryview | mmap.mmap
"""What the decoding functions read: any byte buffer, a mapped segment file included."""


class OsirisError(RemoteProtocolError):
    """Malformed osiris data: a chunk, entry, tracking entry or index record.

    ``kind`` is a short stable name (``short-header``, ``bad-magic``,
    ``truncated-chunk``, ``bad-crc``, ...) and ``where`` the byte offset.
    """


class OsirisLocalError(LocalProtocolError):
    """A value that the osiris layout cannot carry (too long, too many, out of range)."""


@dataclass(frozen=True, slots=True)
class SubBatch:
    """A sub-batch entry as a chunk stores it (notes 10.4), kept whole.

    Attributes:
        entry: Its bytes from the flags byte on: the 11-byte sub-batch header
            and the (maybe compressed) records section.
        records: Records it holds, from its header: the offsets it takes.
        compression: Its compression type, from its header.
    """

    entry: bytes | memoryview
    records: int
    compression: int

    @classmethod
    def parse(cls, entry: bytes | memoryview) -> SubBatch:
        """Read a raw sub-batch entry's header; the records are not looked at.

        Raises:
            OsirisError: Not a sub-batch, a header cut short, or a length that
                disagrees with the entry's size.
        """
        if len(entry) < SUB_BATCH_HEADER_BYTES or not entry[0] & 0x80:
            raise OsirisError("not a sub-batch entry", kind="short-entry")
        flags, count, _uncompressed, length = _SUB_BATCH.unpack_from(entry, 0)
        if SUB_BATCH_HEADER_BYTES + length != len(entry):
            raise OsirisError(
                f"sub-batch declares {length} bytes and holds"
                f" {len(entry) - SUB_BATCH_HEADER_BYTES}",
                kind="short-entry",
            )
        return cls(entry, count, (flags >> 4) & 0x07)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkHeader:
    """The 48-byte chunk header (notes 10.3).

    Attributes:
        chunk_type: `USER`, `TRACKING_DELTA` or `TRACKING_SNAPSHOT`.
        num_entries: Simple plus sub-batch entries in the data section.
        num_records: Records: one per simple entry, a sub-batch's count for each.
        timestamp: Write time, milliseconds since the epoch.
        epoch: The writer's epoch (1 for a single node).
        first_offset: The chunk id: offset of the chunk's first record.
        crc: CRC-32 of the data section, unsigned.
        data_length: Bytes of data entries.
        trailer_length: Bytes of tracking entries after the data.
        bloom_size: Bytes of bloom filter between the header and the data.
    """

    chunk_type: int
    num_entries: int
    num_records: int
    timestamp: int
    epoch: int
    first_offset: int
    crc: int
    data_length: int
    trailer_length: int
    bloom_size: int

    @property
    def size(self) -> int:
        """Bytes the whole chunk takes on disk: header, bloom, data and trailer."""
        return HEADER_BYTES + self.bloom_size + self.data_length + self.trailer_length

    @property
    def data_start(self) -> int:
        """Offset of the data section from the start of the chunk."""
        return HEADER_BYTES + self.bloom_size

    @property
    def next_offset(self) -> int:
        """The id of the chunk that follows this one."""
        return self.first_offset + self.num_records

    def pack(self) -> bytes:
        """Encode the header.

        Raises:
            OsirisLocalError: A field does not fit its width.
        """
        try:
            return _HEADER.pack(
                MAGIC_VERSION,
                self.chunk_type,
                self.num_entries,
                self.num_records,
                self.timestamp,
                self.epoch,
                self.first_offset,
                self.crc,
                self.data_length,
                self.trailer_length,
                self.bloom_size,
            )
        except struct.error as exc:
            raise OsirisLocalError(f"chunk header field out of range: {exc}") from None

    @classmethod
    def unpack(cls, buf: Buffer, offset: int = 0) -> Self:
        """Decode the header at ``offset``; only the magic byte is checked.

        Raises:
            OsirisError: Fewer than 48 bytes, or not a chunk (magic/version byte).
        """
        if len(buf) - offset < HEADER_BYTES:
            raise OsirisError(
                f"chunk header needs {HEADER_BYTES} bytes, {max(len(buf) - offset, 0)} left",
                where=f"byte {offset}",
                kind="short-header",
            )
        fields = _HEADER.unpack_from(buf, offset)
        if fields[0] != MAGIC_VERSION:
            raise OsirisError(
                f"magic/version byte is 0x{fields[0]:02x}, not 0x{MAGIC_VERSION:02x}",
                where=f"byte {offset}",
                kind="bad-magic",
            )
        return cls(
            chunk_type=fields[1],
            num_entries=fields[2],
            num_records=fields[3],
            timestamp=fields[4],
            epoch=fields[5],
            first_offset=fields[6],
            crc=fields[7],
            data_length=fields[8],
            trailer_length=fields[9],
            bloom_size=fields[10],
        )


class FrozenEntries(list[bytes | memoryview]):
    """Entries that cannot change under whoever keeps them: ``bytes``, or views into ``bytes``.

    A decoder that slices a message frame held as ``bytes`` hands its entries
    over as this list: the log then keeps them as they are (they can be
    written later, by its writer thread) without asking each entry what it
    is and what it views (`gateway.core.log.stream.StreamLog.append`).
    Nothing else distinguishes it from a list; only such entries may go in.
    """

    __slots__ = ()


def encode_entries(messages: Sequence[bytes | memoryview]) -> bytes:
    """Encode messages as simple entries: u32 length (top bit clear), body.

    One join over precomputed length prefixes; no per-byte work. Entries
    of one size are joined with their prefix as the separator, with no
    list of parts at all.

    Raises:
        OsirisLocalError: A message is 2 GiB or longer.
    """
    count = len(messages)
    if not count:
        return b""
    sizes = set(map(len, messages))
    if max(sizes) > MAX_ENTRY_BYTES:
        raise OsirisLocalError(f"an entry holds at most {MAX_ENTRY_BYTES} bytes")
    if len(sizes) == 1:
        prefix = _U32.pack(sizes.pop())
        return prefix.join([b"", *messages])
    lengths = list(map(len, messages))
    parts: list[bytes | memoryview] = [b""] * (2 * count)
    if len(sizes) * 4 <= count:
        # A batch repeats a few sizes: a dict lookup per entry costs less
        # than a pack (measured about 40 ns less for 1,000 entries).
        prefixes = {size: _U32.pack(size) for size in sizes}
        parts[0::2] = map(prefixes.__getitem__, lengths)
    else:
        parts[0::2] = map(_U32.pack, lengths)
    parts[1::2] = messages
    return b"".join(parts)


def encode_mixed_entries(entries: Sequence[bytes | memoryview | SubBatch]) -> bytes:
    """Encode simple entries and whole sub-batch entries, in order.

    Raises:
        OsirisLocalError: A simple entry is 2 GiB or longer.
    """
    parts: list[bytes | memoryview] = []
    for entry in entries:
        if isinstance(entry, SubBatch):
            parts.append(entry.entry)
            continue
        if len(entry) > MAX_ENTRY_BYTES:
            raise OsirisLocalError(f"an entry holds at most {MAX_ENTRY_BYTES} bytes")
        parts.append(_U32.pack(len(entry)))
        parts.append(entry)
    return b"".join(parts)


def entry_bytes(entry: bytes | memoryview | SubBatch) -> int:
    """Bytes an entry takes in a chunk's data section."""
    return len(entry.entry) if isinstance(entry, SubBatch) else 4 + len(entry)


def frame_chunk(
    data: bytes,
    *,
    num_entries: int,
    num_records: int,
    first_offset: int,
    timestamp_ms: int,
    epoch: int = 1,
    chunk_type: int = USER,
    trailer: bytes = b"",
) -> bytes:
    """Put a header (with the CRC of ``data``) in front of encoded entries and a trailer.

    Raises:
        OsirisLocalError: Unknown chunk type, too many entries, or a field out of range.
    """
    if chunk_type not in _CHUNK_TYPES:
        raise OsirisLocalError(f"unknown chunk type {chunk_type}")
    if num_entries > MAX_ENTRIES_PER_CHUNK:
        raise OsirisLocalError(f"a chunk holds at most {MAX_ENTRIES_PER_CHUNK} entries")
    header = ChunkHeader(
        chunk_type=chunk_type,
        num_entries=num_entries,
        num_records=num_records,
        timestamp=timestamp_ms,
        epoch=epoch,
        first_offset=first_offset,
        crc=zlib.crc32(data),
        data_length=len(data),
        trailer_length=len(trailer),
        bloom_size=0,
    )
    return b"".join((header.pack(), data, trailer))


def encode_chunk(
    messages: Sequence[bytes | memoryview] | Sequence[bytes | memoryview | SubBatch],
    *,
    first_offset: int,
    timestamp_ms: int,
    epoch: int = 1,
    chunk_type: int = USER,
    trailer: bytes = b"",
    records: int | None = None,
) -> bytes:
    """Encode one chunk of entries, with no bloom filter.

    Args:
        messages: The entry bodies, in order (byte buffers), and with
            ``records`` given, whole `SubBatch` entries among them.
        first_offset: The chunk id.
        timestamp_ms: Write time in milliseconds.
        epoch: Writer epoch.
        chunk_type: `USER`, or a tracking type whose one message is the tracking data.
        trailer: Tracking entries (`encode_tracking`) to store after the data.
        records: The records the entries hold, when some are sub-batches
            (None: every entry is a simple one, one record each).

    Returns:
        Header, data and trailer, ready to append to a segment.

    Raises:
        OsirisLocalError: More than 65,535 messages, a message too long, a bad field.
    """
    count = len(messages)
    if count > MAX_ENTRIES_PER_CHUNK:
        raise OsirisLocalError(f"a chunk holds at most {MAX_ENTRIES_PER_CHUNK} entries")
    if records is None:
        data = encode_entries(cast("Sequence[bytes | memoryview]", messages))
    else:
        data = encode_mixed_entries(messages)
    return frame_chunk(
        data,
        num_entries=count,
        num_records=count if records is None else records,
        first_offset=first_offset,
        timestamp_ms=timestamp_ms,
        epoch=epoch,
        chunk_type=chunk_type,
        trailer=trailer,
    )


def validate_chunk(buf: Buffer, offset: int = 0) -> ChunkHeader:
    """Check the chunk at ``offset``: magic, type, lengths within ``buf``, CRC.

    Returns:
        The chunk's header.

    Raises:
        OsirisError: What is wrong (``kind`` names it) and at which byte.
    """
    header = ChunkHeader.unpack(buf, offset)
    if header.chunk_type not in _CHUNK_TYPES:
        raise OsirisError(
            f"unknown chunk type {header.chunk_type}", where=f"byte {offset}", kind="bad-type"
        )
    available = len(buf) - offset
    if header.size > available:
        raise OsirisError(
            f"chunk needs {header.size} bytes, {available} left",
            where=f"byte {offset}",
            kind="truncated-chunk",
        )
    start = offset + header.data_start
    with memoryview(buf) as view:
        crc = zlib.crc32(view[start : start + header.data_length])
    if crc != header.crc:
        raise OsirisError(
            f"CRC of the data is 0x{crc:08x}, header says 0x{header.crc:08x}",
            where=f"byte {offset}",
            kind="bad-crc",
        )
    return header


def delivery_payload(buf: Buffer, offset: int = 0) -> bytes:
    """Return what a Deliver frame carries for the chunk at ``offset`` (notes 10.7, 11).

    The 48-byte header exactly as stored (its trailer and bloom sizes
    unchanged), then the data entries only: no bloom, no trailer.

    Raises:
        OsirisError: Not a chunk, or the chunk is cut short.
    """
    header = ChunkHeader.unpack(buf, offset)
    end = offset + header.data_start + header.data_length
    if end > len(buf):
        raise OsirisError(
            f"chunk data ends at byte {end}, buffer holds {len(buf)}",
            where=f"byte {offset}",
            kind="truncated-chunk",
        )
    if header.bloom_size == 0 and offset == 0 and end == len(buf) and type(buf) is bytes:
        return buf  # a read of this one chunk: nothing to cut, nothing to copy
    with memoryview(buf) as view:
        if header.bloom_size == 0:
            return bytes(view[offset:end])
        start = offset + header.data_start
        return b"".join((view[offset : offset + HEADER_BYTES], view[start:end]))


def encode_sub_batch(
    records: Sequence[bytes | memoryview], *, compression: int = COMPRESSION_NONE
) -> bytes:
    """Encode one sub-batch entry (notes 10.4): records as u32-length-prefixed bodies.

    Args:
        records: The records, in order (at most 65,535).
        compression: `COMPRESSION_NONE` or `COMPRESSION_GZIP`.

    Raises:
        OsirisLocalError: Too many records, an unknown compression, or too long.
    """
    if len(records) > MAX_ENTRIES_PER_CHUNK:
        raise OsirisLocalError(f"a sub-batch holds at most {MAX_ENTRIES_PER_CHUNK} records")
    lengths = list(map(len, records))
    if lengths and max(lengths) > _U32_MAX:
        raise OsirisLocalError("a sub-batch record holds at most 4 GiB")
    parts: list[bytes | memoryview] = [b""] * (2 * len(records))
    parts[0::2] = map(_U32.pack, lengths)
    parts[1::2] = records
    plain = b"".join(parts)
    if compression == COMPRESSION_NONE:
        body = plain
    elif compression == COMPRESSION_GZIP:
        packer = zlib.compressobj(wbits=31)
        body = packer.compress(plain) + packer.flush()
    else:
        raise OsirisLocalError(f"unsupported sub-batch compression {compression}")
    if len(body) > _U32_MAX or len(plain) > _U32_MAX:
        raise OsirisLocalError("a sub-batch holds at most 4 GiB")
    head = _SUB_BATCH.pack(0x80 | (compression << 4), len(records), len(plain), len(body))
    return head + body


def iter_entries(
    data: Buffer, *, max_uncompressed_bytes: int = MAX_UNCOMPRESSED_BYTES
) -> Iterator[bytes | memoryview]:
    """Yield every record of a chunk's data section, in order.

    Simple entries yield their body; sub-batch entries yield each record
    (uncompressed bodies as views of ``data``, gzip bodies from the inflated
    copy). Errors surface when the iteration reaches them.

    Args:
        data: The data section (``data_length`` bytes after header and bloom).
        max_uncompressed_bytes: Largest declared size of a gzip sub-batch accepted.

    Raises:
        OsirisError: A cut entry, lengths that disagree, an unknown compression,
            or a sub-batch that does not inflate to its declared size.
    """
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    while pos < end:
        if view[pos] & 0x80 == 0:
            if end - pos < 4:
                raise OsirisError("entry length cut short", where=f"byte {pos}", kind="short-entry")
            (length,) = _U32.unpack_from(view, pos)
            start = pos + 4
            pos = start + length
            if pos > end:
                raise OsirisError(
                    f"entry of {length} bytes runs past the data",
                    where=f"byte {start - 4}",
                    kind="short-entry",
                )
            yield view[start:pos]
            continue
        if end - pos < SUB_BATCH_HEADER_BYTES:
            raise OsirisError("sub-batch header cut short", where=f"byte {pos}", kind="short-entry")
        flags, count, uncompressed, length = _SUB_BATCH.unpack_from(view, pos)
        start = pos + SUB_BATCH_HEADER_BYTES
        if start + length > end:
            raise OsirisError(
                f"sub-batch of {length} bytes runs past the data",
                where=f"byte {pos}",
                kind="short-entry",
            )
        body = view[start : start + length]
        records = _sub_batch_records(
            body, (flags >> 4) & 0x07, uncompressed, max_uncompressed_bytes, pos
        )
        yield from _split_records(records, count, pos)
        pos = start + length


def _sub_batch_records(
    body: memoryview, compression: int, uncompressed: int, limit: int, where: int
) -> memoryview:
    """Return a sub-batch's records section, inflated if need be."""
    if compression == COMPRESSION_NONE:
        return body
    if compression != COMPRESSION_GZIP:
        raise OsirisError(
            f"unsupported sub-batch compression {compression}",
            where=f"byte {where}",
            kind="bad-compression",
        )
    if uncompressed > limit:
        raise OsirisError(
            f"sub-batch declares {uncompressed} uncompressed bytes, limit {limit}",
            where=f"byte {where}",
            kind="too-large",
        )
    inflater = zlib.decompressobj(wbits=31)
    try:
        plain = inflater.decompress(body, uncompressed + 1)
    except zlib.error as exc:
        raise OsirisError(
            f"sub-batch does not inflate: {exc}", where=f"byte {where}", kind="bad-compression"
        ) from None
    if len(plain) != uncompressed or not inflater.eof:
        raise OsirisError(
            f"sub-batch inflates to other than its declared {uncompressed} bytes",
            where=f"byte {where}",
            kind="bad-compression",
        )
    return memoryview(plain)


def _split_records(records: memoryview, count: int, where: int) -> Iterator[memoryview]:
    """Split a sub-batch records section into exactly ``count`` records."""
    end = len(records)
    pos = 0
    for _ in range(count):
        if end - pos < 4:
            raise OsirisError(
                f"sub-batch holds fewer than its {count} records",
                where=f"byte {where}",
                kind="short-entry",
            )
        (length,) = _U32.unpack_from(records, pos)
        start = pos + 4
        pos = start + length
        if pos > end:
            raise OsirisError(
                "sub-batch record runs past its body", where=f"byte {where}", kind="short-entry"
            )
        yield records[start:pos]
    if pos != end:
        raise OsirisError(
            f"sub-batch has {end - pos} bytes after its {count} records",
            where=f"byte {where}",
            kind="trailing-bytes",
        )


def _tracking_id(reference: str) -> bytes:
    """Encode a tracking id, refusing what a u8 length cannot carry."""
    encoded = reference.encode("utf-8")
    if len(encoded) > MAX_TRACKING_ID_BYTES:
        raise OsirisLocalError(
            f"tracking id of {len(encoded)} bytes; at most {MAX_TRACKING_ID_BYTES}"
        )
    return encoded


def _u64(value: int, what: str) -> bytes:
    """Encode an unsigned 64-bit tracking value."""
    if not 0 <= value <= _U64_MAX:
        raise OsirisLocalError(f"{what} {value} is not a u64")
    return _U64.pack(value)


def encode_tracking(sequences: Mapping[str, int], offsets: Mapping[str, int]) -> bytes:
    """Encode delta tracking entries: sequences (type 0), then offsets (type 1).

    Used as a user chunk's trailer and as the body of a `TRACKING_DELTA` chunk.

    Raises:
        OsirisLocalError: An id longer than 255 bytes or a value outside u64.
    """
    parts: list[bytes] = []
    for kind, values in ((TRACKING_SEQUENCE, sequences), (TRACKING_OFFSET, offsets)):
        for reference, value in values.items():
            encoded = _tracking_id(reference)
            parts += (_TRACKING_HEAD.pack(kind, len(encoded)), encoded, _u64(value, "value"))
    return b"".join(parts)


def encode_tracking_snapshot(
    sequences: Mapping[str, tuple[int, int]], offsets: Mapping[str, int]
) -> bytes:
    """Encode snapshot tracking entries, the body of a `TRACKING_SNAPSHOT` chunk.

    Args:
        sequences: Reference to (chunk id holding its last id, last publishing id).
        offsets: Reference to stored offset.

    Raises:
        OsirisLocalError: An id longer than 255 bytes or a value outside u64.
    """
    parts: list[bytes] = []
    for reference, (chunk_id, sequence) in sequences.items():
        encoded = _tracking_id(reference)
        _u64(chunk_id, "chunk id")
        _u64(sequence, "sequence")
        parts += (
            _TRACKING_HEAD.pack(TRACKING_SEQUENCE, len(encoded)),
            encoded,
            _SNAPSHOT_SEQUENCE.pack(chunk_id, sequence),
        )
    for reference, offset in offsets.items():
        encoded = _tracking_id(reference)
        parts += (
            _TRACKING_HEAD.pack(TRACKING_OFFSET, len(encoded)),
            encoded,
            _u64(offset, "offset"),
        )
    return b"".join(parts)


def _iter_tracking(data: Buffer, snapshot: bool) -> Iterator[tuple[int, str, int, int]]:
    """Yield (type, id, chunk id or 0, value) for each tracking entry."""
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    while pos < end:
        if end - pos < 2:
            raise OsirisError("tracking entry cut short", where=f"byte {pos}", kind="bad-tracking")
        kind, id_length = _TRACKING_HEAD.unpack_from(view, pos)
        if kind not in (TRACKING_SEQUENCE, TRACKING_OFFSET, TRACKING_TIMESTAMP):
            raise OsirisError(
                f"unknown tracking entry type {kind}", where=f"byte {pos}", kind="bad-tracking"
            )
        value_bytes = 16 if snapshot and kind == TRACKING_SEQUENCE else 8
        start = pos + 2
        stop = start + id_length
        if stop + value_bytes > end:
            raise OsirisError("tracking entry cut short", where=f"byte {pos}", kind="bad-tracking")
        try:
            reference = str(view[start:stop], "utf-8")
        except UnicodeDecodeError:
            raise OsirisError(
                "tracking id is not UTF-8", where=f"byte {start}", kind="bad-tracking"
            ) from None
        if value_bytes == 16:
            chunk_id, value = _SNAPSHOT_SEQUENCE.unpack_from(view, stop)
        else:
            chunk_id, (value,) = 0, _U64.unpack_from(view, stop)
        yield kind, reference, chunk_id, value
        pos = stop + value_bytes


def decode_tracking(data: Buffer) -> tuple[dict[str, int], dict[str, int]]:
    """Decode delta tracking entries into (sequences, offsets).

    Timestamp entries (type 2) are read and ignored: the stream protocol does
    not expose them. A later entry for the same id wins.

    Raises:
        OsirisError: A cut or unknown entry, or an id that is not UTF-8.
    """
    sequences: dict[str, int] = {}
    offsets: dict[str, int] = {}
    for kind, reference, _chunk_id, value in _iter_tracking(data, snapshot=False):
        if kind == TRACKING_SEQUENCE:
            sequences[reference] = value
        elif kind == TRACKING_OFFSET:
            offsets[reference] = value
    return sequences, offsets


def decode_tracking_snapshot(
    data: Buffer,
) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Decode snapshot tracking entries into (sequences, offsets).

    Returns:
        Reference to (chunk id, last publishing id), and reference to offset.

    Raises:
        OsirisError: A cut or unknown entry, or an id that is not UTF-8.
    """
    sequences: dict[str, tuple[int, int]] = {}
    offsets: dict[str, int] = {}
    for kind, reference, chunk_id, value in _iter_tracking(data, snapshot=True):
        if kind == TRACKING_SEQUENCE:
            sequences[reference] = (chunk_id, value)
        elif kind == TRACKING_OFFSET:
            offsets[reference] = value
    return sequences, offsets


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexRecord:
    """One 29-byte index record (notes 10.2).

    Attributes:
        chunk_id: The chunk's id (first offset).
        timestamp: The chunk's timestamp in milliseconds.
        epoch: The chunk's epoch.
        position: Byte position of the chunk header in the segment file.
        chunk_type: The chunk's type.
    """

    chunk_id: int
    timestamp: int
    epoch: int
    position: int
    chunk_type: int

    def pack(self) -> bytes:
        """Encode the record."""
        return pack_index_record(
            self.chunk_id, self.timestamp, self.epoch, self.position, self.chunk_type
        )


def pack_index_record(
    chunk_id: int, timestamp: int, epoch: int, position: int, chunk_type: int
) -> bytes:
    """Encode one index record.

    Raises:
        OsirisLocalError: A field out of range (a position past 4 GiB, say).
    """
    try:
        return _INDEX_RECORD.pack(chunk_id, timestamp, epoch, position, chunk_type)
    except struct.error as exc:
        raise OsirisLocalError(f"index record field out of range: {exc}") from None


def unpack_index_record(buf: Buffer, offset: int = 0) -> IndexRecord | None:
    """Decode the index record at ``offset``; None for an all-zero (end) record.

    Raises:
        OsirisError: Fewer than 29 bytes left.
    """
    if len(buf) - offset < INDEX_RECORD_BYTES:
        raise OsirisError("index record cut short", where=f"byte {offset}", kind="short-record")
    chunk_id, timestamp, epoch, position, chunk_type = _INDEX_RECORD.unpack_from(buf, offset)
    if not (chunk_id or timestamp or epoch or position or chunk_type):
        return None
    return IndexRecord(
        chunk_id=chunk_id,
        timestamp=timestamp,
        epoch=epoch,
        position=position,
        chunk_type=chunk_type,
    )


def iter_index_records(buf: Buffer, offset: int = FILE_HEADER_BYTES) -> Iterator[IndexRecord]:
    """Yield the records of an index file's contents, stopping at a zero or cut record.

    Args:
        buf: The index file's bytes.
        offset: Where the records start (after the 8-byte file header).
    """
    whole = offset + (len(buf) - offset) // INDEX_RECORD_BYTES * INDEX_RECORD_BYTES
    for start in range(offset, whole, INDEX_RECORD_BYTES):
        record = unpack_index_record(buf, start)
        if record is None:
            return
        yield record


def file_stem(first_chunk_id: int) -> str:
    """The 20-digit zero-padded name shared by a segment and its index."""
    return f"{first_chunk_id:020d}"


def segment_file_name(first_chunk_id: int) -> str:
    """The segment file name for a segment starting at ``first_chunk_id``."""
    return file_stem(first_chunk_id) + ".segment"


def index_file_name(first_chunk_id: int) -> str:
    """The index file name for a segment starting at ``first_chunk_id``."""
    return file_stem(first_chunk_id) + ".index"


def parse_file_stem(stem: str) -> int | None:
    """The first chunk id a 20-digit file stem names, or None if it is not one."""
    return int(stem) if _STEM.match(stem) else None
