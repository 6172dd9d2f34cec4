"""Tests for `gateway.codecs.osiris`, the osiris on-disk layout.

The layout is docs/stream-protocol-notes.md, sections 10 and 11: the worked
Deliver example verbatim, hypothesis round trips for headers, chunks, entries,
tracking data and index records, arbitrary bytes giving records or
`OsirisError`, and every error `validate_chunk` reports.
"""

from __future__ import annotations

import contextlib
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import osiris
from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.osiris import (
    ChunkHeader,
    IndexRecord,
    OsirisError,
    OsirisLocalError,
)

# Notes section 11, verbatim: a Deliver v1 frame for sub 0 carrying chunk 0.
WORKED_DELIVER = bytes.fromhex(
    """
    00 00 00 56
    00 08 00 01 00
    50 00 00 02 00 00 00 02
    00 00 01 8b cf e5 68 00
    00 00 00 00 00 00 00 01
    00 00 00 00 00 00 00 00
    0b e6 9c f3
    00 00 00 21
    00 00 00 00
    00 00 00 00
    00 00 00 16  00 53 74 c1 07 02 a1 01 6b a1 01 76 00 53 75 a0 05 68 65 6c 6c 6f
    00 00 00 03  72 61 77
    """
)
WORKED_AMQP = bytes.fromhex("005374c10702a1016ba10176005375a00568656c6c6f")
WORKED_TIMESTAMP_MS = 1700000000000

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
references = st.text(max_size=40).filter(lambda text: len(text.encode()) <= 255)
messages = st.lists(st.binary(max_size=300), max_size=40)

headers = st.builds(
    ChunkHeader,
    chunk_type=st.sampled_from([osiris.USER, osiris.TRACKING_DELTA, osiris.TRACKING_SNAPSHOT]),
    num_entries=u16,
    num_records=u32,
    timestamp=i64,
    epoch=u64,
    first_offset=u64,
    crc=u32,
    data_length=u32,
    trailer_length=u32,
    bloom_size=u8,
)


def header_with(**changes: int) -> ChunkHeader:
    """A valid user chunk header with some fields replaced."""
    fields = {
        "chunk_type": osiris.USER,
        "num_entries": 0,
        "num_records": 0,
        "timestamp": 0,
        "epoch": 1,
        "first_offset": 0,
        "crc": 0,
        "data_length": 0,
        "trailer_length": 0,
        "bloom_size": 0,
    }
    fields.update(changes)
    return ChunkHeader(**fields)


class TestHeader:
    @given(headers)
    def test_round_trip(self, header: ChunkHeader) -> None:
        """Any header packs to 48 bytes starting 0x50 and unpacks to itself."""
        packed = header.pack()
        assert len(packed) == osiris.HEADER_BYTES
        assert packed[0] == osiris.MAGIC_VERSION
        assert packed[45:48] == b"\x00\x00\x00"
        assert ChunkHeader.unpack(packed) == header

    @given(headers, st.binary(max_size=20))
    def test_unpack_at_offset(self, header: ChunkHeader, prefix: bytes) -> None:
        """``unpack`` reads the header at the given offset of a larger buffer."""
        assert ChunkHeader.unpack(prefix + header.pack() + b"tail", len(prefix)) == header

    def test_size(self) -> None:
        """``size`` is header, bloom, data and trailer; ``next_offset`` adds the records."""
        header = header_with(bloom_size=16, data_length=100, trailer_length=7, num_records=5)
        assert header.size == 48 + 16 + 100 + 7
        assert header.data_start == 64
        assert header_with(first_offset=10, num_records=5).next_offset == 15

    def test_field_out_of_range(self) -> None:
        """A field wider than its slot is a local error, not a struct error."""
        with pytest.raises(OsirisLocalError):
            header_with(num_entries=70000).pack()
        assert issubclass(OsirisLocalError, LocalProtocolError)

    def test_short_and_bad_magic(self) -> None:
        """Fewer than 48 bytes, or a first byte other than 0x50, are refused."""
        with pytest.raises(OsirisError) as short:
            ChunkHeader.unpack(bytes(47))
        assert short.value.kind == "short-header"
        with pytest.raises(OsirisError) as magic:
            ChunkHeader.unpack(b"\x51" + header_with().pack()[1:])
        assert magic.value.kind == "bad-magic"
        assert issubclass(OsirisError, RemoteProtocolError)


class TestWorkedExample:
    def test_deliver_payload_bytes(self) -> None:
        """The notes' section 11 chunk encodes to exactly the frame's header and data."""
        chunk = osiris.encode_chunk(
            [WORKED_AMQP, b"raw"], first_offset=0, timestamp_ms=WORKED_TIMESTAMP_MS, epoch=1
        )
        size, key, version, subscription = struct.unpack_from(">IHHB", WORKED_DELIVER)
        assert (size, key, version, subscription) == (86, 0x0008, 1, 0)
        assert chunk == WORKED_DELIVER[9:]
        assert size == 5 + len(chunk)
        assert osiris.delivery_payload(chunk) == chunk

    def test_decode(self) -> None:
        """The worked chunk validates (CRC 0x0be69cf3) and yields its two messages."""
        payload = WORKED_DELIVER[9:]
        header = osiris.validate_chunk(payload)
        assert header == header_with(
            num_entries=2,
            num_records=2,
            timestamp=WORKED_TIMESTAMP_MS,
            crc=0x0BE69CF3,
            data_length=33,
        )
        data = payload[header.data_start :]
        assert [bytes(m) for m in osiris.iter_entries(data)] == [WORKED_AMQP, b"raw"]


class TestChunks:
    @given(messages, u64, i64, st.binary(max_size=50))
    def test_round_trip(self, bodies: list[bytes], first: int, ts: int, trailer: bytes) -> None:
        """Any messages encode to a valid chunk whose entries are those messages."""
        chunk = osiris.encode_chunk(bodies, first_offset=first, timestamp_ms=ts, trailer=trailer)
        header = osiris.validate_chunk(chunk)
        assert header.size == len(chunk)
        assert (header.num_entries, header.num_records) == (len(bodies), len(bodies))
        assert (header.first_offset, header.timestamp, header.epoch) == (first, ts, 1)
        assert header.trailer_length == len(trailer)
        assert chunk.endswith(trailer)
        data = chunk[48 : 48 + header.data_length]
        assert header.crc == zlib.crc32(data)
        assert [bytes(m) for m in osiris.iter_entries(data)] == bodies

    def test_memoryviews(self) -> None:
        """Memoryview messages encode like their bytes."""
        body = b"0123456789"
        views = [memoryview(body)[2:5], memoryview(body)]
        assert osiris.encode_chunk(views, first_offset=3, timestamp_ms=1) == osiris.encode_chunk(
            [b"234", body], first_offset=3, timestamp_ms=1
        )

    def test_payload_leaves_out_bloom_and_trailer(self) -> None:
        """A Deliver payload is the stored header (sizes unchanged) plus the data only."""
        data = osiris.encode_entries([b"a", b"bc"])
        header = header_with(
            num_entries=2,
            num_records=2,
            crc=zlib.crc32(data),
            data_length=len(data),
            trailer_length=3,
            bloom_size=16,
        )
        stored = header.pack() + b"\xff" * 16 + data + b"trl"
        assert osiris.validate_chunk(b"xx" + stored, 2) == header
        assert osiris.delivery_payload(b"xx" + stored + b"next", 2) == header.pack() + data
        with pytest.raises(OsirisError):
            osiris.delivery_payload(stored[:-5])

    def test_limits(self) -> None:
        """More than 65,535 entries, or an unknown type, cannot be encoded."""
        too_many = [b""] * (osiris.MAX_ENTRIES_PER_CHUNK + 1)
        with pytest.raises(OsirisLocalError):
            osiris.encode_chunk(too_many, first_offset=0, timestamp_ms=0)
        with pytest.raises(OsirisLocalError):
            osiris.encode_chunk([b"x"], first_offset=0, timestamp_ms=0, chunk_type=7)
        with pytest.raises(OsirisLocalError):
            osiris.encode_chunk([b"x"], first_offset=-1, timestamp_ms=0)
        assert osiris.encode_entries([]) == b""

    def test_tracking_chunk(self) -> None:
        """A tracking chunk is one simple entry holding the tracking data."""
        body = osiris.encode_tracking({}, {"consumer": 42})
        chunk = osiris.encode_chunk(
            [body], first_offset=9, timestamp_ms=5, chunk_type=osiris.TRACKING_DELTA
        )
        header = osiris.validate_chunk(chunk)
        assert (header.chunk_type, header.num_entries, header.num_records) == (1, 1, 1)
        (entry,) = osiris.iter_entries(chunk[48:])
        assert osiris.decode_tracking(entry) == ({}, {"consumer": 42})


class TestValidate:
    chunk = osiris.encode_chunk([b"hello", b"world"], first_offset=7, timestamp_ms=1)

    def test_valid(self) -> None:
        """A good chunk returns its header, also at an offset with bytes after it."""
        assert osiris.validate_chunk(b"pad" + self.chunk + b"more", 3).first_offset == 7

    @pytest.mark.parametrize(
        ("mutate", "kind"),
        [
            (lambda c: c[:47], "short-header"),
            (lambda c: b"\x00" + c[1:], "bad-magic"),
            (lambda c: c[:1] + b"\x09" + c[2:], "bad-type"),
            (lambda c: c[:-1], "truncated-chunk"),
            (lambda c: c[:-2] + bytes([c[-2] ^ 0x01]) + c[-1:], "bad-crc"),
            (lambda c: c[:32] + b"\x00\x00\x00\x00" + c[36:], "bad-crc"),
        ],
        ids=["short", "magic", "type", "cut", "flipped-data", "crc-field"],
    )
    def test_errors(self, mutate: object, kind: str) -> None:
        """Each kind of damage raises `OsirisError` naming it and the byte offset."""
        assert callable(mutate)
        with pytest.raises(OsirisError) as caught:
            osiris.validate_chunk(mutate(self.chunk))
        assert caught.value.kind == kind
        assert caught.value.where == "byte 0"


class TestEntries:
    def test_sub_batch_uncompressed(self) -> None:
        """A 0x80 sub-batch yields its records, between simple entries."""
        entry = osiris.encode_sub_batch([b"one", b"", b"three"])
        assert entry[0] == 0x80
        count, uncompressed, length = struct.unpack_from(">HII", entry, 1)
        assert (count, uncompressed, length) == (3, 3 * 4 + 8, 20)
        data = osiris.encode_entries([b"first"]) + entry + osiris.encode_entries([b"last"])
        assert [bytes(m) for m in osiris.iter_entries(data)] == [
            b"first",
            b"one",
            b"",
            b"three",
            b"last",
        ]

    def test_sub_batch_gzip(self) -> None:
        """A 0x90 sub-batch is gzip; it inflates to its declared size and splits."""
        records = [b"x" * 1000, b"y" * 10]
        entry = osiris.encode_sub_batch(records, compression=osiris.COMPRESSION_GZIP)
        assert entry[0] == 0x90
        assert len(entry) < 100
        assert [bytes(m) for m in osiris.iter_entries(entry)] == records

    @given(st.lists(st.lists(st.binary(max_size=50), max_size=5), max_size=5), st.booleans())
    def test_sub_batch_round_trip(self, batches: list[list[bytes]], gzip: bool) -> None:
        """Any sub-batches, compressed or not, yield their records in order."""
        compression = osiris.COMPRESSION_GZIP if gzip else osiris.COMPRESSION_NONE
        data = b"".join(osiris.encode_sub_batch(b, compression=compression) for b in batches)
        flat = [record for batch in batches for record in batch]
        assert [bytes(m) for m in osiris.iter_entries(data)] == flat

    @given(st.binary(max_size=200))
    def test_garbage(self, data: bytes) -> None:
        """Arbitrary bytes yield records or raise `OsirisError`, nothing else."""
        try:
            for record in osiris.iter_entries(data):
                assert isinstance(record, bytes | memoryview)
        except OsirisError:
            pass

    @pytest.mark.parametrize(
        ("data", "kind"),
        [
            (b"\x00\x00\x00", "short-entry"),
            (b"\x00\x00\x00\x05abc", "short-entry"),
            (b"\x80\x00\x01\x00\x00", "short-entry"),
            (b"\x80\x00\x01\x00\x00\x00\x04\x00\x00\x00\x09abc", "short-entry"),
            (b"\xa0\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00", "bad-compression"),
            (b"\x80\x00\x02\x00\x00\x00\x05\x00\x00\x00\x05\x00\x00\x00\x01x", "short-entry"),
            (b"\x80\x00\x01\x00\x00\x00\x06\x00\x00\x00\x06\x00\x00\x00\x01xy", "trailing-bytes"),
            (b"\x90\x00\x00\x00\x00\x00\x00\x00\x00\x00\x03abc", "bad-compression"),
        ],
        ids=[
            "cut-length",
            "cut-body",
            "cut-sub-batch-header",
            "cut-sub-batch-body",
            "compression-2",
            "too-few-records",
            "trailing-bytes",
            "not-gzip",
        ],
    )
    def test_errors(self, data: bytes, kind: str) -> None:
        """Malformed entries raise `OsirisError` with the kind of damage."""
        with pytest.raises(OsirisError) as caught:
            list(osiris.iter_entries(data))
        assert caught.value.kind == kind

    def test_gzip_size_mismatch_and_limit(self) -> None:
        """A gzip body must inflate to its declared size, which must be within the limit."""
        entry = bytearray(osiris.encode_sub_batch([b"abc"], compression=osiris.COMPRESSION_GZIP))
        struct.pack_into(">I", entry, 3, 6)
        with pytest.raises(OsirisError, match="declared"):
            list(osiris.iter_entries(bytes(entry)))
        good = osiris.encode_sub_batch([b"abc" * 100], compression=osiris.COMPRESSION_GZIP)
        with pytest.raises(OsirisError) as caught:
            list(osiris.iter_entries(good, max_uncompressed_bytes=100))
        assert caught.value.kind == "too-large"

    def test_sub_batch_encode_limits(self) -> None:
        """Unknown compressions and too many records cannot be encoded."""
        with pytest.raises(OsirisLocalError):
            osiris.encode_sub_batch([b"x"], compression=3)
        with pytest.raises(OsirisLocalError):
            osiris.encode_sub_batch([b""] * 65536)


class TestTracking:
    @given(st.dictionaries(references, u64, max_size=8), st.dictionaries(references, u64))
    def test_delta_round_trip(self, sequences: dict[str, int], offsets: dict[str, int]) -> None:
        """Delta entries decode to the sequences and offsets they encode."""
        data = osiris.encode_tracking(sequences, offsets)
        assert osiris.decode_tracking(data) == (sequences, offsets)

    @given(
        st.dictionaries(references, st.tuples(u64, u64), max_size=8),
        st.dictionaries(references, u64, max_size=8),
    )
    def test_snapshot_round_trip(
        self, sequences: dict[str, tuple[int, int]], offsets: dict[str, int]
    ) -> None:
        """Snapshot entries decode to the sequences (with chunk ids) and offsets."""
        data = osiris.encode_tracking_snapshot(sequences, offsets)
        assert osiris.decode_tracking_snapshot(data) == (sequences, offsets)

    def test_delta_bytes(self) -> None:
        """A delta entry is type u8, id length u8, id, u64 value (notes 10.6)."""
        assert osiris.encode_tracking({"p": 5}, {"c": 258}) == (
            b"\x00\x01p" + (5).to_bytes(8, "big") + b"\x01\x01c" + (258).to_bytes(8, "big")
        )

    def test_snapshot_bytes(self) -> None:
        """A snapshot sequence entry carries the chunk id before the sequence."""
        assert osiris.encode_tracking_snapshot({"p": (7, 5)}, {}) == (
            b"\x00\x01p" + (7).to_bytes(8, "big") + (5).to_bytes(8, "big")
        )

    def test_timestamps_ignored(self) -> None:
        """Type-2 (timestamp) entries are read and left out of the result."""
        data = b"\x02\x01t" + (123).to_bytes(8, "big") + osiris.encode_tracking({}, {"c": 1})
        assert osiris.decode_tracking(data) == ({}, {"c": 1})
        assert osiris.decode_tracking_snapshot(data) == ({}, {"c": 1})

    def test_long_id(self) -> None:
        """Ids longer than 255 bytes cannot be encoded; 255 can."""
        assert osiris.decode_tracking(osiris.encode_tracking({"é" * 127 + "x": 1}, {}))
        with pytest.raises(OsirisLocalError):
            osiris.encode_tracking({"x" * 256: 1}, {})
        with pytest.raises(OsirisLocalError):
            osiris.encode_tracking_snapshot({}, {"é" * 128: 1})
        with pytest.raises(OsirisLocalError):
            osiris.encode_tracking({"x": -1}, {})

    @pytest.mark.parametrize(
        "data",
        [b"\x00", b"\x03\x01x" + bytes(8), b"\x00\x05abc" + bytes(8), b"\x01\x01\xff" + bytes(8)],
        ids=["cut-head", "unknown-type", "cut-value", "not-utf8"],
    )
    def test_errors(self, data: bytes) -> None:
        """Cut entries, unknown types and non-UTF-8 ids raise `OsirisError`."""
        with pytest.raises(OsirisError):
            osiris.decode_tracking(data)

    @given(st.binary(max_size=100))
    def test_garbage(self, data: bytes) -> None:
        """Arbitrary bytes decode or raise `OsirisError`, in both forms."""
        for decode in (osiris.decode_tracking, osiris.decode_tracking_snapshot):
            with contextlib.suppress(OsirisError):
                decode(data)


class TestIndex:
    records = st.builds(
        IndexRecord,
        chunk_id=u64,
        timestamp=i64,
        epoch=u64,
        position=u32,
        chunk_type=u8,
    ).filter(lambda r: r.pack() != bytes(29))

    @given(records)
    def test_round_trip(self, record: IndexRecord) -> None:
        """A record packs to 29 bytes and unpacks to itself."""
        packed = record.pack()
        assert len(packed) == osiris.INDEX_RECORD_BYTES
        assert osiris.unpack_index_record(packed) == record

    def test_layout(self) -> None:
        """Chunk id, timestamp, epoch, position u32, type u8 (notes 10.2)."""
        packed = osiris.pack_index_record(1, 2, 3, 4, 5)
        assert packed == struct.pack(">QqQIB", 1, 2, 3, 4, 5)
        with pytest.raises(OsirisLocalError):
            osiris.pack_index_record(0, 0, 0, 2**32, 0)

    def test_zero_record_ends(self) -> None:
        """An all-zero record is the end; a cut record is not yielded."""
        one = osiris.pack_index_record(0, 10, 1, 8, 0)
        two = osiris.pack_index_record(3, 11, 1, 70, 0)
        assert osiris.unpack_index_record(bytes(29)) is None
        file = osiris.INDEX_HEADER + one + two + two[:10]
        assert [r.chunk_id for r in osiris.iter_index_records(file)] == [0, 3]
        file = osiris.INDEX_HEADER + one + bytes(29) + two
        assert [r.chunk_id for r in osiris.iter_index_records(file)] == [0]
        with pytest.raises(OsirisError):
            osiris.unpack_index_record(one[:28])

    def test_file_names(self) -> None:
        """Segment and index files are named by their 20-digit first chunk id."""
        assert osiris.SEGMENT_HEADER == b"OSIL\x00\x00\x00\x01"
        assert osiris.INDEX_HEADER == b"OSII\x00\x00\x00\x01"
        assert osiris.segment_file_name(42) == "00000000000000000042.segment"
        assert osiris.index_file_name(0) == "00000000000000000000.index"
        assert osiris.parse_file_stem("00000000000000000042") == 42
        assert osiris.parse_file_stem("42") is None
        assert osiris.parse_file_stem("0000000000000000004x") is None
