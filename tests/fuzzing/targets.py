"""The fuzz targets: every codec's decoders, their typed errors and their valid inputs.

A `FuzzTarget` names one decoding entry point of one of the ten codecs
(``gateway/codecs``: amqp, amqp091, dmp, fieldtable, framing, mtl, osiris,
qmqp, ssmp, stream); a codec with several (both roles, or several helpers)
has one target each, named ``codec/what``. `decode` runs a fresh decoder
over an input and returns what it decoded; the only exceptions allowed out
of it are the target's typed ``errors``. For a byte-stream target the input
may come in any number of chunks (`split` is True: any cutting must decode
the same); otherwise the input's parts are frames (MTL) or one whole unit.

`outcome` runs a target and turns its result into comparable data (the
events, with the events decoded before an error, and the error's type);
`fuzz_input` draws one input the way the fuzzers do: a mutated valid input
mostly, random bytes or a deep nesting sometimes.
"""

from __future__ import annotations

import dataclasses
import math
import random
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Final

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from gateway.codecs import amqp, amqp091, dmp, fieldtable, framing, mtl, osiris, qmqp, ssmp
from gateway.codecs import stream as sp
from tests.fuzzing import nesting, samples
from tests.fuzzing.mutation import garbage, mutate
from tests.fuzzing.samples import Input

__all__ = [
    "CODECS",
    "TARGETS",
    "FuzzTarget",
    "Outcome",
    "canonical",
    "decodes",
    "draw_pool",
    "fuzz_input",
    "outcome",
    "split_points",
    "target",
]

Events = list[object]
Decode = Callable[[Sequence[bytes], Events], None]
"""Runs a fresh decoder over an input's parts, adding what it decodes to the list given."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FuzzTarget:
    """One decoding entry point of a codec.

    Attributes:
        name: ``codec/what`` (``ssmp/server``), or the codec's name alone.
        codec: Which of the ten codecs it belongs to.
        errors: The typed errors it may raise; anything else is a bug.
        decode: Runs a fresh decoder over the input's parts, adding what it
            decodes to a list (so that what came before an error is kept).
        samples: Valid inputs.
        split: Whether the parts are chunks of one byte stream (any split
            decodes the same) rather than frames or one whole unit.
        frames: Whether the parts are the frames of a multipart message.
        nested: Makes a deeply nested input, for the formats that nest.
        fix: Repairs a checksum after a mutation (some of the time), so that
            mutations reach what the checksum guards.
    """

    name: str
    codec: str
    errors: tuple[type[Exception], ...]
    decode: Decode
    samples: Callable[[], st.SearchStrategy[Input]]
    split: bool = False
    frames: bool = False
    nested: Callable[[random.Random], Input] | None = None
    fix: Callable[[random.Random, Input], Input] | None = None


# --- decoders ------------------------------------------------------------------------------------


def _stream_decoder(make: Callable[[], Any]) -> Decode:
    """Feed every chunk to one fresh codec made by ``make``."""

    def decode(chunks: Sequence[bytes], events: Events) -> None:
        receive = make().receive_data
        for chunk in chunks:
            events.extend(receive(chunk))

    return decode


def _feeder(make: Callable[[], Any]) -> Decode:
    """Like `_stream_decoder`, for the framing helpers' ``feed``."""

    def decode(chunks: Sequence[bytes], events: Events) -> None:
        feed = make().feed
        for chunk in chunks:
            events.extend(feed(chunk))

    return decode


def _whole(function: Callable[[bytes], object]) -> Decode:
    def decode(parts: Sequence[bytes], events: Events) -> None:
        events.append(function(b"".join(parts)))

    return decode


def _mtl_data(frames: Sequence[bytes], events: Events) -> None:
    events.append(mtl.decode_data(list(frames)))


def _mtl_control(frames: Sequence[bytes], events: Events) -> None:
    events += (mtl.parse_request(list(frames)), mtl.parse_reply(list(frames)))


def _osiris_chunk(data: bytes) -> object:
    """What the log and the stream server do with a chunk: check it, read it, deliver it."""
    header = osiris.validate_chunk(data)
    start = header.data_start
    body = memoryview(data)[start : start + header.data_length]
    trailer = data[start + header.data_length : start + header.data_length + header.trailer_length]
    if header.chunk_type == osiris.TRACKING_DELTA:
        read: object = osiris.decode_tracking(body)
    elif header.chunk_type == osiris.TRACKING_SNAPSHOT:
        read = osiris.decode_tracking_snapshot(body)
    else:
        read = [bytes(record) for record in osiris.iter_entries(body)]
    return (header, read, osiris.decode_tracking(trailer), osiris.delivery_payload(data))


def _osiris_index(data: bytes) -> object:
    """An index file read as the log reads it, then record by record (a cut last one too)."""
    records = list(osiris.iter_index_records(data))
    size = osiris.INDEX_RECORD_BYTES
    each = [
        osiris.unpack_index_record(data, at)
        for at in range(osiris.FILE_HEADER_BYTES, len(data), size)
    ]
    return records, each


def _dmp_server() -> dmp.DMPCodec:
    return dmp.DMPCodec(dmp.Role.SERVER, max_envelope_bytes=4096)


# --- fixes and nestings --------------------------------------------------------------------------

_CRC_AT: Final = 32
"""Offset of the CRC in an osiris chunk header (notes 10.3)."""


def _fix_chunk_crc(rng: random.Random, sample: Input) -> Input:
    """Most of the time, give a mutated chunk the CRC of its (mutated) data."""
    data = bytearray(sample[0])
    if rng.random() < 0.25 or len(data) < osiris.HEADER_BYTES:
        return sample
    try:
        header = osiris.ChunkHeader.unpack(bytes(data[: osiris.HEADER_BYTES]))
    except osiris.OsirisError:
        return sample
    start = header.data_start
    struct.pack_into(">I", data, _CRC_AT, zlib.crc32(data[start : start + header.data_length]))
    return (bytes(data),)


def _nested_table(rng: random.Random) -> Input:
    return (nesting.field_table(rng),)


def _nested_amqp_value(rng: random.Random) -> Input:
    return (nesting.amqp_value(rng),)


def _nested_amqp_message(rng: random.Random) -> Input:
    section = rng.choice((b"\x00\x53\x77", b"\x00\x53\x71", b"\x00\x53\x76\xd0"))
    value = nesting.amqp_value(rng)
    if section.endswith(b"\xd0"):  # amqp-sequence: a list32 around the nested value
        section = section[:-1] + struct.pack(">BII", 0xD0, len(value) + 4, 1)
    return (section + value,)


def _nested_json(rng: random.Random) -> Input:
    command = rng.choice((b"Connection.Open", b"connection.profile", b"200", b"202"))
    return (command, nesting.json_text(rng))


def _nested_content(rng: random.Random) -> Input:
    header = struct.pack(">BQB", mtl.CONTENT, rng.randrange(2**64), 1) + b"r"
    return (header + nesting.field_table(rng), rng.randbytes(rng.randrange(8)))


_HEADERS_FLAG: Final = 0x2000
"""The Basic properties flag of ``headers`` (bit 13)."""


def _nested_envelope(rng: random.Random) -> bytes:
    content = b"\x00\x00" + struct.pack(">H", _HEADERS_FLAG) + nesting.field_table(rng)
    content += b"\x00" + (1).to_bytes(3, "big") + b"x"
    return struct.pack(">I", len(content)) + content


def _nested_dmp_server(rng: random.Random) -> Input:
    lease = fieldtable.encode_short_string(samples.DMP_LEASE)
    return (dmp.PROTOCOL_HEADER + lease + _nested_envelope(rng),)


def _nested_dmp_client(rng: random.Random) -> Input:
    ok = dmp.encode_response(dmp.Response(200, "DMP/0.1"))
    return (ok + ok + _nested_envelope(rng),)


def _nested_start_ok(rng: random.Random) -> Input:
    payload = (
        struct.pack(">HH", 10, 11)
        + nesting.field_table(rng)
        + b"\x05PLAIN"
        + struct.pack(">I", 2)
        + b"\x00a"
        + b"\x05en_US"
    )
    return (struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce",)


# --- the targets ---------------------------------------------------------------------------------


def _target(
    name: str,
    errors: tuple[type[Exception], ...],
    decode: Decode,
    samples_of: Callable[[], st.SearchStrategy[Input]],
    **options: Any,
) -> FuzzTarget:
    return FuzzTarget(
        name=name,
        codec=name.partition("/")[0],
        errors=errors,
        decode=decode,
        samples=samples_of,
        **options,
    )


TARGETS: Final[tuple[FuzzTarget, ...]] = (
    _target(
        "amqp/message",
        (amqp.AMQPDecodeError,),
        _whole(amqp.decode_message),
        samples.amqp_messages,
        nested=_nested_amqp_message,
    ),
    _target(
        "amqp/value",
        (amqp.AMQPDecodeError,),
        _whole(amqp.decode_value),
        samples.amqp_values,
        nested=_nested_amqp_value,
    ),
    _target(
        "amqp091",
        (amqp091.AMQPError,),
        _stream_decoder(lambda: amqp091.FrameCodec(frame_max=4096)),
        samples.amqp091_frames,
        split=True,
        nested=_nested_start_ok,
    ),
    _target(
        "dmp/server",
        (dmp.DMPError,),
        _stream_decoder(_dmp_server),
        samples.dmp_server_sessions,
        split=True,
        nested=_nested_dmp_server,
    ),
    _target(
        "dmp/client",
        (dmp.DMPError,),
        _stream_decoder(lambda: dmp.DMPCodec(dmp.Role.CLIENT, max_envelope_bytes=4096)),
        samples.dmp_client_sessions,
        split=True,
        nested=_nested_dmp_client,
    ),
    _target(
        "fieldtable",
        (fieldtable.FieldTableError,),
        _whole(fieldtable.decode_table),
        samples.field_tables,
        nested=_nested_table,
    ),
    _target(
        "framing/lines",
        (framing.LineTooLongError,),
        _feeder(lambda: framing.LineSplitter(64)),
        samples.line_streams,
        split=True,
    ),
    _target(
        "framing/netstrings",
        (framing.NetstringError,),
        _feeder(lambda: framing.NetstringReader(64, 8)),
        samples.netstring_streams,
        split=True,
    ),
    _target(
        "framing/netstring-block",
        (framing.NetstringError,),
        _whole(framing.split_netstrings),
        samples.netstring_streams,
    ),
    _target(
        "framing/prefix",
        (framing.LengthPrefixError,),
        _feeder(lambda: framing.LengthPrefixReader(struct.Struct(">I"), 256)),
        samples.prefixed_streams,
        split=True,
    ),
    _target(
        "mtl/data",
        (mtl.MTLError,),
        _mtl_data,
        samples.mtl_data_commands,
        frames=True,
        nested=_nested_content,
    ),
    _target(
        "mtl/control",
        (),
        _mtl_control,
        samples.mtl_control_messages,
        frames=True,
        nested=_nested_json,
    ),
    _target(
        "osiris/chunk",
        (osiris.OsirisError,),
        _whole(_osiris_chunk),
        samples.osiris_chunks,
        fix=_fix_chunk_crc,
    ),
    _target(
        "osiris/index",
        (osiris.OsirisError,),
        _whole(_osiris_index),
        samples.osiris_index_files,
    ),
    _target(
        "qmqp/server",
        (qmqp.QMQPError,),
        _stream_decoder(lambda: qmqp.QMQPCodec(qmqp.Role.SERVER, max_message_bytes=1024)),
        samples.qmqp_client_streams,
        split=True,
    ),
    _target(
        "qmqp/client",
        (qmqp.QMQPError,),
        _stream_decoder(lambda: qmqp.QMQPCodec(qmqp.Role.CLIENT, max_message_bytes=1024)),
        samples.qmqp_server_streams,
        split=True,
    ),
    _target(
        "ssmp/server",
        (ssmp.SSMPError,),
        _stream_decoder(lambda: ssmp.SSMPCodec(ssmp.Role.SERVER)),
        samples.ssmp_client_streams,
        split=True,
    ),
    _target(
        "ssmp/client",
        (ssmp.SSMPError,),
        _stream_decoder(lambda: ssmp.SSMPCodec(ssmp.Role.CLIENT)),
        samples.ssmp_server_streams,
        split=True,
    ),
    _target(
        "stream/server",
        (sp.StreamError,),
        _stream_decoder(lambda: sp.StreamCodec(sp.Role.SERVER, frame_max=65536)),
        samples.stream_client_streams,
        split=True,
    ),
    _target(
        "stream/client",
        (sp.StreamError,),
        _stream_decoder(lambda: sp.StreamCodec(sp.Role.CLIENT, frame_max=65536)),
        samples.stream_server_streams,
        split=True,
    ),
)
"""Every target, sorted by name."""

CODECS: Final = tuple(sorted({item.codec for item in TARGETS}))
"""The ten codecs the targets cover."""


def target(name: str) -> FuzzTarget:
    """The target called ``name``."""
    for item in TARGETS:
        if item.name == name:
            return item
    raise KeyError(name)


# --- outcomes -----------------------------------------------------------------------------------

Outcome = tuple[list[object], str | None]
"""The events decoded (before an error too) and the typed error's class name, or None."""


def canonical(value: object) -> object:
    """``value`` made comparable: memoryviews as bytes, NaN as a string, dataclasses as tuples."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    if isinstance(value, dict):
        return [(canonical(key), canonical(item)) for key, item in value.items()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            [canonical(getattr(value, field.name)) for field in dataclasses.fields(value)],
        )
    return value


def outcome(fuzz_target: FuzzTarget, parts: Sequence[bytes]) -> Outcome:
    """Decode ``parts``; the events and the typed error, in comparable form.

    Any exception other than the target's typed errors propagates: that is
    what the fuzzers look for.
    """
    events: Events = []
    try:
        fuzz_target.decode(parts, events)
    except fuzz_target.errors as exc:
        # The events of the failing call: the codecs' ``events``, the framing helpers' ``complete``.
        before = getattr(exc, "events", None)
        events.extend(getattr(exc, "complete", ()) if before is None else before)
        return canonical(events), type(exc).__name__  # type: ignore[return-value]
    return canonical(events), None  # type: ignore[return-value]


def decodes(fuzz_target: FuzzTarget, parts: Sequence[bytes]) -> bool:
    """Whether ``parts`` decode (True) or raise a typed error (False): `outcome`, only faster.

    Any other exception propagates.
    """
    try:
        fuzz_target.decode(parts, [])
    except fuzz_target.errors:
        return False
    return True


def split_points(rng: random.Random, size: int) -> list[int]:
    """One to four cut points in ``[0, size]``, sorted (a one-byte cut now and then)."""
    if size and rng.random() < 0.02:
        return list(range(size + 1))
    return sorted(rng.randrange(size + 1) for _ in range(rng.randint(1, 4)))


# --- drawing inputs ------------------------------------------------------------------------------


def draw_pool(fuzz_target: FuzzTarget, count: int, seed_value: int = 0) -> list[Input]:
    """``count`` valid inputs of ``fuzz_target``, drawn by hypothesis with a fixed seed.

    Hypothesis runs outside any test here, only to generate: no shrinking,
    no database, no deadline.
    """
    pool: list[Input] = []

    @seed(seed_value)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzz_target.samples())
    def collect(value: Input) -> None:
        pool.append(value)

    collect()
    return pool


def fuzz_input(fuzz_target: FuzzTarget, rng: random.Random, pool: Sequence[Input]) -> Input:
    """One fuzz input: mostly a mutated valid input, sometimes garbage, a nesting or a valid one."""
    choice = rng.random()
    if choice < 0.05 or not pool:
        return garbage(rng, parts=0 if fuzz_target.frames else 1)
    if choice < 0.12 and fuzz_target.nested is not None:
        made = fuzz_target.nested(rng)
        return mutate(rng, made) if rng.random() < 0.3 else made
    sample = rng.choice(pool)
    if choice < 0.15:
        return sample
    made = mutate(rng, sample, rng.choice(pool))
    if fuzz_target.fix is not None:
        made = fuzz_target.fix(rng, made)
    return made
