"""Valid encodings of every codec's input, as hypothesis strategies: the fuzzers' seeds.

Each strategy yields an `Input`: a tuple of byte strings. For a byte-stream
codec (SSMP, QMQP, DMP, the stream protocol, AMQP 0-9-1 frames and the
framing helpers) it holds one string, a whole session that a fresh codec of
the reading role decodes without error; for MTL it holds the frames of one
multipart message; for the whole-unit decoders (AMQP 1.0 messages and
values, field tables, osiris chunks and index files) one complete unit.

SSMP, QMQP and stream sessions come from `tests.strategies`; the others are
built here from the codecs' own encoders, small enough that a fuzzer mutates
a few hundred bytes at a time.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any, TypeAlias

from hypothesis import strategies as st

from gateway.codecs import amqp, amqp091, dmp, fieldtable, framing, mtl, osiris, qmqp, ssmp
from gateway.codecs import stream as sp
from tests.strategies import (
    qmqp_client_sessions,
    qmqp_server_sessions,
    ssmp_server_lines,
    ssmp_sessions,
    stream_client_events,
    stream_server_events,
)

__all__ = [
    "DMP_LEASE",
    "Input",
    "amqp091_frames",
    "amqp_messages",
    "amqp_values",
    "dmp_client_sessions",
    "dmp_server_sessions",
    "field_tables",
    "field_values",
    "json_bodies",
    "line_streams",
    "mtl_control_messages",
    "mtl_data_commands",
    "netstring_streams",
    "osiris_chunks",
    "osiris_index_files",
    "prefixed_streams",
    "qmqp_client_streams",
    "qmqp_server_streams",
    "ssmp_client_streams",
    "ssmp_server_streams",
    "stream_client_streams",
    "stream_server_streams",
]

Input: TypeAlias = tuple[bytes, ...]
"""One fuzz input: one byte string (a stream or a unit), or the frames of an MTL message."""

DMP_LEASE = "lease-w"
"""The lease text that sessions use about half the time (the fuzz gateway's sink lease)."""

_U8 = st.integers(0, 0xFF)
_U16 = st.integers(0, 0xFFFF)
_U32 = st.integers(0, 0xFFFFFFFF)
_U64 = st.integers(0, 2**64 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)
_SHORT_TEXT = st.text(max_size=12)
"""Text that fits a short string (12 characters are at most 48 UTF-8 bytes)."""


def _one(data: bytes) -> Input:
    return (data,)


# --- byte streams from tests.strategies ------------------------------------------------------


def ssmp_client_streams() -> st.SearchStrategy[Input]:
    """What a client sends: LOGIN first, then any requests (a server-role codec reads it)."""
    return ssmp_sessions(max_requests=6).map(lambda lines: _one(b"".join(map(ssmp.encode, lines))))


def ssmp_server_streams() -> st.SearchStrategy[Input]:
    """What a server sends: responses and events (a client-role codec reads it)."""
    return st.lists(ssmp_server_lines(budget=300), min_size=1, max_size=6).map(
        lambda lines: _one(b"".join(map(ssmp.encode, lines)))
    )


def qmqp_client_streams() -> st.SearchStrategy[Input]:
    """A QMQP client's blocks, then usually its done block."""
    return qmqp_client_sessions(max_blocks=4).map(
        lambda blocks: _one(b"".join(map(qmqp.encode, blocks)))
    )


def qmqp_server_streams() -> st.SearchStrategy[Input]:
    """A QMQP server's replies, then usually its done block."""
    return qmqp_server_sessions(max_blocks=4).map(
        lambda blocks: _one(b"".join(map(qmqp.encode, blocks)))
    )


def stream_client_streams() -> st.SearchStrategy[Input]:
    """Frames a stream client sends (a server-role codec reads them)."""
    return st.lists(stream_client_events(), min_size=1, max_size=4).map(
        lambda events: _one(b"".join(map(sp.encode, events)))
    )


def stream_server_streams() -> st.SearchStrategy[Input]:
    """Frames a stream server sends (a client-role codec reads them)."""
    return st.lists(stream_server_events(), min_size=1, max_size=4).map(
        lambda events: _one(b"".join(map(sp.encode, events)))
    )


# --- field tables (also inside DMP properties, MTL Content and AMQP 0-9-1 tables) -------------


def field_values() -> st.SearchStrategy[Any]:
    """Values a field table carries: every scalar type, nested arrays and tables."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | _SHORT_TEXT
        | st.binary(max_size=16)
        | st.decimals(
            allow_nan=False, allow_infinity=False, places=2, min_value=-999, max_value=999
        )
        | st.datetimes(
            min_value=datetime.datetime(1970, 1, 1), timezones=st.just(datetime.UTC)
        ).map(lambda moment: moment.replace(microsecond=0))
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(_SHORT_TEXT, children, max_size=3)
        ),
        max_leaves=8,
    )


def field_tables() -> st.SearchStrategy[Input]:
    """Encoded field tables."""
    return st.dictionaries(_SHORT_TEXT, field_values(), max_size=5).map(
        lambda table: _one(fieldtable.encode_table(table))
    )


# --- DMP ----------------------------------------------------------------------------------------


def _optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


def _dmp_envelopes() -> st.SearchStrategy[dmp.Envelope]:
    properties = st.builds(
        dmp.BasicProperties,
        content_type=_optional(_SHORT_TEXT),
        headers=_optional(st.dictionaries(_SHORT_TEXT, field_values(), max_size=3)),
        delivery_mode=_optional(_U8),
        priority=_optional(_U8),
        correlation_id=_optional(_SHORT_TEXT),
        message_id=_optional(_SHORT_TEXT),
        timestamp=_optional(_U64),
        app_id=_optional(_SHORT_TEXT),
    )
    return st.builds(
        dmp.Envelope,
        exchange=_SHORT_TEXT,
        routing_key=_SHORT_TEXT,
        properties=st.just(dmp.NO_PROPERTIES) | properties,
        mandatory=st.booleans(),
        immediate=st.booleans(),
        body=st.binary(max_size=200),
    )


def _dmp_flow() -> st.SearchStrategy[bytes]:
    """Envelopes and heartbeats as they flow after the dialog."""
    item = _dmp_envelopes().map(dmp.encode_envelope) | st.just(dmp.HEARTBEAT_BYTES)
    return st.lists(item, max_size=4).map(b"".join)


def dmp_server_sessions() -> st.SearchStrategy[Input]:
    """What a DMP client sends: the protocol header, a lease, then envelopes."""
    lease = st.just(DMP_LEASE) | _SHORT_TEXT
    return st.builds(
        lambda text, flow: _one(dmp.PROTOCOL_HEADER + fieldtable.encode_short_string(text) + flow),
        lease,
        _dmp_flow(),
    )


def dmp_client_sessions() -> st.SearchStrategy[Input]:
    """What a DMP server sends: two responses, then envelopes."""
    response = st.builds(dmp.Response, code=st.sampled_from([200, 402, 403, 503]), text=_SHORT_TEXT)
    return st.builds(
        lambda first, second, flow: _one(
            dmp.encode_response(first) + dmp.encode_response(second) + flow
        ),
        response,
        response,
        _dmp_flow(),
    )


# --- AMQP 0-9-1 frames ---------------------------------------------------------------------------

_SHORT_STRING = _SHORT_TEXT
_AMQP091_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "octet": _U8,
    "short": _U16,
    "long": _U32,
    "shortstr": _SHORT_STRING,
    "longstr": st.binary(max_size=40),
    "bit": st.booleans(),
    "table": st.dictionaries(_SHORT_TEXT, field_values(), max_size=3),
}


@st.composite
def _amqp091_methods(draw: st.DrawFn) -> amqp091.Method:
    name, fields = draw(st.sampled_from(sorted(amqp091.METHODS.values())))
    arguments = {field: draw(_AMQP091_VALUES[kind]) for field, kind in fields}
    return amqp091.Method(channel=draw(_U16), name=name, arguments=arguments)


def amqp091_frames() -> st.SearchStrategy[Input]:
    """Method and heartbeat frames of a DMP principal connection."""
    frame = _amqp091_methods().map(amqp091.encode_method) | st.just(amqp091.encode_heartbeat())
    return st.lists(frame, min_size=1, max_size=4).map(lambda frames: _one(b"".join(frames)))


# --- framing helpers -----------------------------------------------------------------------------


def line_streams() -> st.SearchStrategy[Input]:
    """LF-terminated lines, short and long (a splitter capped at 64 bytes refuses some)."""
    line = st.binary(max_size=70).map(lambda raw: raw.replace(b"\n", b" "))
    return st.lists(line, min_size=1, max_size=6).map(
        lambda lines: _one(b"".join(item + b"\n" for item in lines))
    )


def netstring_streams() -> st.SearchStrategy[Input]:
    """Netstrings, some over a 64-byte limit (skipped as oversized by a reader)."""
    return st.lists(st.binary(max_size=100), min_size=1, max_size=6).map(
        lambda parts: _one(framing.encode_netstrings(parts))
    )


def prefixed_streams() -> st.SearchStrategy[Input]:
    """uint32-length-prefixed payloads, some over a 256-byte limit."""
    return st.lists(st.binary(max_size=300), min_size=1, max_size=5).map(
        lambda parts: _one(b"".join(struct.pack(">I", len(part)) + part for part in parts))
    )


# --- MTL -----------------------------------------------------------------------------------------

_NAMES = st.text(max_size=20).filter(lambda text: len(text.encode()) <= 255)


def mtl_data_commands() -> st.SearchStrategy[Input]:
    """The two frames of any data command."""
    table = st.dictionaries(_SHORT_TEXT, field_values(), max_size=3)
    commands = st.one_of(
        st.builds(mtl.Lease, _U64, _NAMES),
        st.builds(mtl.Response, _U64, st.integers(100, 599)),
        st.builds(mtl.Summon, _U64, _NAMES),
        st.builds(mtl.Dismiss, _U64, _NAMES),
        st.builds(mtl.Content, _U64, _NAMES, table, st.binary(max_size=64)),
        st.builds(mtl.Confirm, _U64, st.booleans()),
        st.builds(mtl.Reject, _U64, st.booleans(), st.booleans()),
        st.just(mtl.Ping()),
        st.just(mtl.Pong()),
    )
    return commands.map(lambda command: tuple(mtl.encode_data(command)))


def json_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects like control bodies: nested a few levels, brackets inside strings."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(-(10**12), 10**12)
        | st.text(alphabet='[]{}\\"ab ', max_size=8)
    )
    values = st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=20,
    )
    return st.dictionaries(st.text(max_size=12), values, max_size=4)


def mtl_control_messages() -> st.SearchStrategy[Input]:
    """Control requests (command name and JSON body) and replies (status and body)."""
    names = st.sampled_from(
        [
            "Connection.Open",
            "connection.authorize",
            "Connection.Profile",
            "Connection.Reader",
            "Connection.Writer",
            "Connection.Close",
        ]
    )
    requests = st.builds(mtl.request, names, json_bodies())
    replies = st.builds(
        mtl.reply, st.sampled_from([200, 201, 202, 400, 401, 402, 501]), json_bodies()
    )
    return (requests | replies).map(tuple)


# --- AMQP 1.0 ------------------------------------------------------------------------------------

_SYMBOLS = st.text(alphabet=st.characters(max_codepoint=127), max_size=12).map(amqp.Symbol)
_AMQP_SCALARS: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=16),
    st.uuids(),
    _SYMBOLS,
    _U8.map(amqp.UByte),
    _U16.map(amqp.UShort),
    _U32.map(amqp.UInt),
    _U64.map(amqp.ULong),
    st.integers(-128, 127).map(amqp.Byte),
    st.integers(-(2**15), 2**15 - 1).map(amqp.Short),
    _I64.map(amqp.Long),
    _I64.map(amqp.Timestamp),
    st.binary(min_size=4, max_size=4).map(amqp.Decimal32),
)
_DESCRIPTORS = _U64.map(amqp.ULong) | _SYMBOLS
_ARRAYS = st.one_of(
    st.lists(_U32, max_size=4).map(lambda items: amqp.Array("uint", tuple(items))),
    st.lists(st.text(max_size=6), max_size=4).map(lambda items: amqp.Array("string", tuple(items))),
    st.lists(_SYMBOLS, max_size=4).map(lambda items: amqp.Array("symbol", tuple(items))),
    st.lists(st.binary(max_size=6), max_size=3).map(
        lambda items: amqp.Array("binary", tuple(items))
    ),
)


def _amqp_value_objects() -> st.SearchStrategy[Any]:
    return st.recursive(
        _AMQP_SCALARS | _ARRAYS,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(_AMQP_SCALARS, children, max_size=3),
            st.builds(amqp.Described, _DESCRIPTORS, children),
        ),
        max_leaves=10,
    )


def amqp_values() -> st.SearchStrategy[Input]:
    """Encoded AMQP 1.0 values: scalars, arrays, lists, maps and described values."""
    return _amqp_value_objects().map(lambda value: _one(amqp.encode_value(value)))


def amqp_messages() -> st.SearchStrategy[Input]:
    """Encoded AMQP 1.0 messages with some of every section."""
    annotations = _optional(st.dictionaries(_SYMBOLS, _amqp_value_objects(), max_size=2))
    header = st.builds(
        amqp.Header, durable=_optional(st.booleans()), priority=_optional(_U8), ttl=_optional(_U32)
    )
    message_ids = st.one_of(_U64, st.uuids(), st.binary(max_size=12), st.text(max_size=12))
    properties = st.builds(
        amqp.Properties,
        message_id=_optional(message_ids),
        to=_optional(st.text(max_size=10)),
        subject=_optional(st.text(max_size=10)),
        correlation_id=_optional(message_ids),
        content_type=_optional(_SYMBOLS.map(str)),
        creation_time=_optional(_I64),
        group_sequence=_optional(_U32),
    )
    bodies = st.one_of(
        st.binary(min_size=1, max_size=200),
        st.builds(amqp.AMQPValue, _amqp_value_objects()),
        st.lists(st.lists(_amqp_value_objects(), max_size=2), min_size=1, max_size=2).map(
            lambda sections: amqp.AMQPSequence(tuple(sections))
        ),
    )
    simple = _AMQP_SCALARS.filter(lambda value: not isinstance(value, list | dict))
    message = st.builds(
        amqp.AMQPMessage,
        header=_optional(header),
        delivery_annotations=annotations,
        message_annotations=annotations,
        properties=_optional(properties),
        application_properties=_optional(st.dictionaries(st.text(max_size=8), simple, max_size=3)),
        body=bodies,
        footer=annotations,
    )
    return message.map(lambda value: _one(amqp.encode_message(value)))


# --- osiris ---------------------------------------------------------------------------------------

_REFERENCES = st.text(max_size=12)


@st.composite
def osiris_chunks(draw: st.DrawFn) -> Input:
    """Whole chunks: user (simple and sub-batch entries, a tracking trailer) and tracking."""
    kind = draw(
        st.sampled_from([osiris.USER, osiris.USER, osiris.TRACKING_DELTA, osiris.TRACKING_SNAPSHOT])
    )
    first = draw(_U64.filter(lambda value: value < 2**63))
    stamp = draw(_I64)
    if kind == osiris.TRACKING_DELTA:
        body = osiris.encode_tracking(
            draw(st.dictionaries(_REFERENCES, _U64, max_size=3)),
            draw(st.dictionaries(_REFERENCES, _U64, max_size=3)),
        )
        return _one(
            osiris.encode_chunk([body], first_offset=first, timestamp_ms=stamp, chunk_type=kind)
        )
    if kind == osiris.TRACKING_SNAPSHOT:
        body = osiris.encode_tracking_snapshot(
            draw(st.dictionaries(_REFERENCES, st.tuples(_U64, _U64), max_size=3)),
            draw(st.dictionaries(_REFERENCES, _U64, max_size=3)),
        )
        return _one(
            osiris.encode_chunk([body], first_offset=first, timestamp_ms=stamp, chunk_type=kind)
        )
    records = 0
    entries: list[bytes | osiris.SubBatch] = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            entries.append(draw(st.binary(max_size=60)))
            records += 1
            continue
        batch = draw(st.lists(st.binary(max_size=30), max_size=4))
        compression = draw(st.sampled_from([osiris.COMPRESSION_NONE, osiris.COMPRESSION_GZIP]))
        entries.append(
            osiris.SubBatch.parse(osiris.encode_sub_batch(batch, compression=compression))
        )
        records += len(batch)
    trailer = draw(
        st.just(b"")
        | st.builds(
            osiris.encode_tracking,
            st.dictionaries(_REFERENCES, _U64, max_size=2),
            st.dictionaries(_REFERENCES, _U64, max_size=2),
        )
    )
    return _one(
        osiris.encode_chunk(
            entries, first_offset=first, timestamp_ms=stamp, trailer=trailer, records=records
        )
    )


def osiris_index_files() -> st.SearchStrategy[Input]:
    """Index files: the file header, then records."""
    record = st.builds(
        osiris.pack_index_record,
        _U64.filter(lambda value: value > 0),
        _I64,
        _U64,
        _U32,
        st.sampled_from([osiris.USER, osiris.TRACKING_DELTA, osiris.TRACKING_SNAPSHOT]),
    )
    return st.lists(record, max_size=5).map(
        lambda records: _one(osiris.INDEX_HEADER + b"".join(records))
    )
