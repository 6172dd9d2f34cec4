"""Generic field codecs and the layouts of the commands that are plain field lists.

Most commands are a `_Layout`: named fields read and written generically.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from gateway.codecs.stream.events import (
    HEARTBEAT,
    Close,
    CloseResponse,
    ConsumerUpdate,
    ConsumerUpdateResponse,
    Create,
    CreateSuperStream,
    Credit,
    CreditResponse,
    DeclarePublisher,
    Delete,
    DeletePublisher,
    DeleteSuperStream,
    ExchangeCommandVersions,
    ExchangeCommandVersionsResponse,
    Heartbeat,
    Metadata,
    MetadataResponse,
    MetadataUpdate,
    Open,
    OpenResponse,
    Partitions,
    PartitionsResponse,
    PeerProperties,
    PeerPropertiesResponse,
    QueryOffset,
    QueryOffsetResponse,
    QueryPublisherSequence,
    QueryPublisherSequenceResponse,
    ResolveOffsetSpec,
    ResolveOffsetSpecResponse,
    Response,
    Route,
    RouteResponse,
    SaslAuthenticate,
    SaslAuthenticateResponse,
    SaslHandshake,
    SaslHandshakeResponse,
    StoreOffset,
    StreamStats,
    StreamStatsResponse,
    Subscribe,
    Tune,
    Unsubscribe,
)
from gateway.codecs.stream.values import (
    OFFSET_TYPE_NONE,
    RESPONSE_BIT,
    Broker,
    CommandVersion,
    Key,
    OffsetKind,
    OffsetSpec,
    StreamLocalError,
    StreamMetadata,
    _MalformedError,
)

__all__ = []

# --- field codecs --------------------------------------------------------------------------

_U8: Final = struct.Struct(">B")
_U16: Final = struct.Struct(">H")
_I16: Final = struct.Struct(">h")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")
_HEADER: Final = struct.Struct(">IHH")  # size, key, version
_KEY_VERSION: Final = struct.Struct(">HH")
_KEY_VERSION_BYTES: Final = 4
_SIZE_BYTES: Final = 4
_RESPONSE_HEAD: Final = struct.Struct(">IHHIH")  # size, key, version, correlation id, code
_NULL: Final = -1


class _Field:
    """How one field is read from and written to a frame body."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Return the value at ``pos`` and the position after it.

        Raises:
            struct.error: The frame ends inside the field.
            _MalformedError: The bytes are not a valid value.
        """
        raise NotImplementedError

    def write(self, value: Any, out: list[bytes]) -> None:
        """Append the encoding of ``value`` to ``out``."""
        raise NotImplementedError


class _Int(_Field):
    """A fixed-width integer."""

    __slots__ = ("_struct",)

    def __init__(self, fixed: struct.Struct) -> None:
        self._struct = fixed

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the integer."""
        return self._struct.unpack_from(frame, pos)[0], pos + self._struct.size

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write the integer; struct refuses one out of range."""
        out.append(self._struct.pack(value))


class _Bool(_Field):
    """A uint8 that must be 0 or 1 (ConsumerUpdate's ``active``)."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read 0 as False and 1 as True; anything else is malformed."""
        (byte,) = _U8.unpack_from(frame, pos)
        if byte > 1:
            raise _MalformedError(f"boolean byte is {byte}, not 0 or 1")
        return byte == 1, pos + 1

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write 1 or 0."""
        out.append(b"\x01" if value else b"\x00")


def _sized(frame: bytes, pos: int, length: int, what: str) -> int:
    """Check that ``length`` bytes follow ``pos``; return where they end."""
    stop = pos + length
    if length < 0:
        raise _MalformedError(f"{what} length {length} is negative")
    if stop > len(frame):
        raise _MalformedError(f"{what} of {length} bytes runs past the end of the frame")
    return stop


class _String(_Field):
    """int16 length then UTF-8; a null (-1) is malformed where a value is required."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read and decode the string."""
        (length,) = _I16.unpack_from(frame, pos)
        if length == _NULL:
            raise _MalformedError("null string where a value is required")
        stop = _sized(frame, pos + 2, length, "string")
        return frame[pos + 2 : stop].decode("utf-8"), stop

    def write(self, value: Any, out: list[bytes]) -> None:
        """Encode the string; struct refuses one over 32,767 bytes."""
        data = value.encode("utf-8")
        out += (_I16.pack(len(data)), data)


class _ShortBytes(_Field):
    """int16 length then opaque bytes: SaslAuthenticateResponse's challenge (14.4)."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the bytes."""
        (length,) = _I16.unpack_from(frame, pos)
        stop = _sized(frame, pos + 2, length, "challenge")
        return frame[pos + 2 : stop], stop

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write length and bytes."""
        out += (_I16.pack(len(value)), value)


class _NullableBytes(_Field):
    """int32 length then bytes; -1 is None."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the bytes, or None."""
        (length,) = _I32.unpack_from(frame, pos)
        if length == _NULL:
            return None, pos + 4
        stop = _sized(frame, pos + 4, length, "bytes")
        return frame[pos + 4 : stop], stop

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write -1 for None, else length and bytes."""
        if value is None:
            out.append(_I32.pack(_NULL))
        else:
            out += (_I32.pack(len(value)), value)


def _count(frame: bytes, pos: int) -> int:
    """Read an int32 item count at ``pos``, refusing one the frame cannot hold."""
    count: int = _I32.unpack_from(frame, pos)[0]
    # Every item takes at least two bytes, so this also bounds the loops.
    if not 0 <= count <= (len(frame) - pos - 4) // 2:
        raise _MalformedError(f"count {count} cannot be right for {len(frame) - pos - 4} bytes")
    return count


class _Array(_Field):
    """int32 count then items; a tuple."""

    __slots__ = ("_item",)

    def __init__(self, item: _Field) -> None:
        self._item = item

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the items."""
        count = _count(frame, pos)
        pos += 4
        read = self._item.read
        items = []
        for _ in range(count):
            value, pos = read(frame, pos)
            items.append(value)
        return tuple(items), pos

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write the count and the items."""
        out.append(_I32.pack(len(value)))
        write = self._item.write
        for item in value:
            write(item, out)


class _Map(_Field):
    """int32 count then key/value pairs; a dict (a repeated key keeps its last value)."""

    __slots__ = ("_key", "_value")

    def __init__(self, key: _Field, value: _Field) -> None:
        self._key = key
        self._value = value

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the pairs."""
        count = _count(frame, pos)
        pos += 4
        read_key, read_value = self._key.read, self._value.read
        result = {}
        for _ in range(count):
            key, pos = read_key(frame, pos)
            result[key], pos = read_value(frame, pos)
        return result, pos

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write the count and the pairs, in the mapping's order."""
        out.append(_I32.pack(len(value)))
        write_key, write_value = self._key.write, self._value.write
        for key, item in value.items():
            write_key(key, out)
            write_value(item, out)


class _Optional(_Field):
    """A last field that may be absent: None when the frame ends before it."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _Field) -> None:
        self._inner = inner

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the field if any bytes are left."""
        if pos == len(frame):
            return None, pos
        return self._inner.read(frame, pos)

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write nothing for None."""
        if value is not None:
            self._inner.write(value, out)


class _Offset(_Field):
    """An `OffsetSpec`: uint16 type, then uint64 (4) or int64 (5) or nothing (1-3)."""

    __slots__ = ()

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the type and its value."""
        (kind,) = _U16.unpack_from(frame, pos)
        pos += 2
        if kind == OffsetKind.OFFSET:
            return OffsetSpec(
                kind=OffsetKind.OFFSET, value=_U64.unpack_from(frame, pos)[0]
            ), pos + 8
        if kind == OffsetKind.TIMESTAMP:
            value = _I64.unpack_from(frame, pos)[0]
            return OffsetSpec(kind=OffsetKind.TIMESTAMP, value=value), pos + 8
        if OffsetKind.FIRST <= kind <= OffsetKind.NEXT:
            return OffsetSpec(kind=OffsetKind(kind)), pos
        raise _MalformedError(f"unknown offset type {kind}")

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write the type and its value."""
        out.append(_U16.pack(value.kind))
        if value.kind == OffsetKind.OFFSET:
            out.append(_U64.pack(value.value))
        elif value.kind == OffsetKind.TIMESTAMP:
            out.append(_I64.pack(value.value))


_Fields = tuple[tuple[str, _Field], ...]


def _read_fields(fields: _Fields, frame: bytes, pos: int) -> tuple[dict[str, Any], int]:
    """Read ``fields`` in order from ``pos``; errors name the field."""
    values: dict[str, Any] = {}
    name = ""
    try:
        for name, reader in fields:
            values[name], pos = reader.read(frame, pos)
    except struct.error:
        raise _MalformedError("the frame ends inside the field", name) from None
    except _MalformedError as exc:
        raise _MalformedError(exc.reason, exc.where or name) from None
    except ValueError as exc:  # UnicodeDecodeError
        raise _MalformedError(f"invalid value: {exc}", name) from None
    return values, pos


class _Record(_Field):
    """A nested record (a broker, a stream's metadata, a command version)."""

    __slots__ = ("_build", "_fields")

    def __init__(self, build: Callable[..., Any], fields: _Fields) -> None:
        self._build = build
        self._fields = fields

    def read(self, frame: bytes, pos: int) -> tuple[Any, int]:
        """Read the record's fields and build it."""
        values, pos = _read_fields(self._fields, frame, pos)
        return self._build(**values), pos

    def write(self, value: Any, out: list[bytes]) -> None:
        """Write the record's fields."""
        for name, writer in self._fields:
            writer.write(getattr(value, name), out)


_UINT8: Final = _Int(_U8)
_UINT16: Final = _Int(_U16)
_UINT32: Final = _Int(_U32)
_UINT64: Final = _Int(_U64)
_STRING: Final = _String()
_STRINGS: Final = _Array(_STRING)
_MAP: Final = _Map(_STRING, _STRING)
_CORRELATION: Final = ("correlation_id", _UINT32)
_CODE: Final = ("code", _UINT16)
_ANSWER: Final = (_CORRELATION, _CODE)  # how most responses start
_OFFSET: Final = _Offset()
_BROKER: Final = _Record(Broker, (("reference", _UINT16), ("host", _STRING), ("port", _UINT32)))
_STREAM_METADATA: Final = _Record(
    StreamMetadata,
    (("stream", _STRING), _CODE, ("leader", _UINT16), ("replicas", _Array(_UINT16))),
)
_COMMAND_VERSIONS: Final = _Array(
    _Record(CommandVersion, (("key", _UINT16), ("min_version", _UINT16), ("max_version", _UINT16)))
)


class _Layout:
    """A command whose body is a sequence of fields: its decoder and its encoder.

    Args:
        cls: The event class.
        key: The wire key (response bit included).
        fields: The body after key and version, correlation id and code included.
        build: Makes the event from the fields' values; ``cls`` by default.
    """

    __slots__ = ("build", "cls", "fields", "key")

    def __init__(
        self,
        cls: type[Any],
        key: int,
        fields: _Fields,
        build: Callable[..., Any] | None = None,
    ) -> None:
        self.cls = cls
        self.key = key
        self.fields = fields
        self.build = cls if build is None else build

    def decode(self, frame: bytes) -> Any:
        """Decode a frame (key and version already matched); nothing may follow the fields."""
        values, pos = _read_fields(self.fields, frame, _KEY_VERSION_BYTES)
        if pos != len(frame):
            raise _MalformedError(f"{len(frame) - pos} bytes follow the last field")
        return self.build(**values)

    def encode(self, event: Any) -> bytes:
        """Encode an event of this layout's class, version 1."""
        out = [b""]
        for name, writer in self.fields:
            writer.write(getattr(event, name), out)
        out[0] = _HEADER.pack(sum(map(len, out)) + _KEY_VERSION_BYTES, self.key, 1)
        return b"".join(out)


# Requests and server commands (notes, section 5). One entry per command.
_LAYOUTS: Final = (
    _Layout(
        DeclarePublisher,
        Key.DECLARE_PUBLISHER,
        (_CORRELATION, ("publisher_id", _UINT8), ("reference", _STRING), ("stream", _STRING)),
    ),
    _Layout(
        QueryPublisherSequence,
        Key.QUERY_PUBLISHER_SEQUENCE,
        (_CORRELATION, ("reference", _STRING), ("stream", _STRING)),
    ),
    _Layout(DeletePublisher, Key.DELETE_PUBLISHER, (_CORRELATION, ("publisher_id", _UINT8))),
    _Layout(
        Subscribe,
        Key.SUBSCRIBE,
        (
            _CORRELATION,
            ("subscription_id", _UINT8),
            ("stream", _STRING),
            ("offset_spec", _OFFSET),
            ("credit", _UINT16),
            ("properties", _Optional(_MAP)),
        ),
    ),
    # Spec ambiguity: PROTOCOL.adoc says Credit is uint16, the reference
    # server reads (and its client writes) int16 (notes, 14.8). We read and
    # write uint16: 0x8000-0xffff are large credits here, negative ones to the
    # reference server, and a negative credit is never written.
    _Layout(Credit, Key.CREDIT, (("subscription_id", _UINT8), ("credit", _UINT16))),
    _Layout(
        StoreOffset,
        Key.STORE_OFFSET,
        (("reference", _STRING), ("stream", _STRING), ("offset", _UINT64)),
    ),
    _Layout(
        QueryOffset, Key.QUERY_OFFSET, (_CORRELATION, ("reference", _STRING), ("stream", _STRING))
    ),
    _Layout(Unsubscribe, Key.UNSUBSCRIBE, (_CORRELATION, ("subscription_id", _UINT8))),
    _Layout(Create, Key.CREATE, (_CORRELATION, ("stream", _STRING), ("arguments", _MAP))),
    _Layout(Delete, Key.DELETE, (_CORRELATION, ("stream", _STRING))),
    _Layout(Metadata, Key.METADATA, (_CORRELATION, ("streams", _STRINGS))),
    _Layout(MetadataUpdate, Key.METADATA_UPDATE, (_CODE, ("stream", _STRING))),
    _Layout(PeerProperties, Key.PEER_PROPERTIES, (_CORRELATION, ("properties", _MAP))),
    _Layout(SaslHandshake, Key.SASL_HANDSHAKE, (_CORRELATION,)),
    _Layout(
        SaslAuthenticate,
        Key.SASL_AUTHENTICATE,
        (_CORRELATION, ("mechanism", _STRING), ("data", _NullableBytes())),
    ),
    _Layout(Tune, Key.TUNE, (("frame_max", _UINT32), ("heartbeat", _UINT32))),
    _Layout(Open, Key.OPEN, (_CORRELATION, ("virtual_host", _STRING))),
    _Layout(Close, Key.CLOSE, (_CORRELATION, _CODE, ("reason", _STRING))),
    _Layout(Heartbeat, Key.HEARTBEAT, (), build=lambda: HEARTBEAT),
    _Layout(Route, Key.ROUTE, (_CORRELATION, ("routing_key", _STRING), ("super_stream", _STRING))),
    _Layout(Partitions, Key.PARTITIONS, (_CORRELATION, ("super_stream", _STRING))),
    _Layout(
        ConsumerUpdate,
        Key.CONSUMER_UPDATE,
        (_CORRELATION, ("subscription_id", _UINT8), ("active", _Bool())),
    ),
    _Layout(
        ExchangeCommandVersions,
        Key.EXCHANGE_COMMAND_VERSIONS,
        (_CORRELATION, ("versions", _COMMAND_VERSIONS)),
    ),
    _Layout(StreamStats, Key.STREAM_STATS, (_CORRELATION, ("stream", _STRING))),
    _Layout(
        CreateSuperStream,
        Key.CREATE_SUPER_STREAM,
        (
            _CORRELATION,
            ("name", _STRING),
            ("partitions", _STRINGS),
            ("binding_keys", _STRINGS),
            ("arguments", _MAP),
        ),
    ),
    _Layout(DeleteSuperStream, Key.DELETE_SUPER_STREAM, (_CORRELATION, ("name", _STRING))),
    _Layout(
        ResolveOffsetSpec,
        Key.RESOLVE_OFFSET_SPEC,
        (
            _CORRELATION,
            ("stream", _STRING),
            ("offset_spec", _OFFSET),
            ("properties", _Optional(_MAP)),
        ),
    ),
    # Responses (the key carries RESPONSE_BIT).
    _Layout(
        QueryPublisherSequenceResponse,
        Key.QUERY_PUBLISHER_SEQUENCE | RESPONSE_BIT,
        (*_ANSWER, ("sequence", _UINT64)),
    ),
    _Layout(CreditResponse, Key.CREDIT | RESPONSE_BIT, (_CODE, ("subscription_id", _UINT8))),
    _Layout(
        QueryOffsetResponse,
        Key.QUERY_OFFSET | RESPONSE_BIT,
        (*_ANSWER, ("offset", _UINT64)),
    ),
    _Layout(
        MetadataResponse,
        Key.METADATA | RESPONSE_BIT,
        (_CORRELATION, ("brokers", _Array(_BROKER)), ("streams", _Array(_STREAM_METADATA))),
    ),
    _Layout(
        PeerPropertiesResponse,
        Key.PEER_PROPERTIES | RESPONSE_BIT,
        (*_ANSWER, ("properties", _MAP)),
    ),
    _Layout(
        SaslHandshakeResponse,
        Key.SASL_HANDSHAKE | RESPONSE_BIT,
        (*_ANSWER, ("mechanisms", _STRINGS)),
    ),
    _Layout(
        SaslAuthenticateResponse,
        Key.SASL_AUTHENTICATE | RESPONSE_BIT,
        (*_ANSWER, ("challenge", _Optional(_ShortBytes()))),
    ),
    _Layout(
        OpenResponse,
        Key.OPEN | RESPONSE_BIT,
        (*_ANSWER, ("properties", _Optional(_MAP))),
    ),
    _Layout(CloseResponse, Key.CLOSE | RESPONSE_BIT, _ANSWER),
    _Layout(RouteResponse, Key.ROUTE | RESPONSE_BIT, (*_ANSWER, ("streams", _STRINGS))),
    _Layout(
        PartitionsResponse,
        Key.PARTITIONS | RESPONSE_BIT,
        (*_ANSWER, ("streams", _STRINGS)),
    ),
    _Layout(
        ExchangeCommandVersionsResponse,
        Key.EXCHANGE_COMMAND_VERSIONS | RESPONSE_BIT,
        (*_ANSWER, ("versions", _COMMAND_VERSIONS)),
    ),
    _Layout(
        StreamStatsResponse,
        Key.STREAM_STATS | RESPONSE_BIT,
        (*_ANSWER, ("statistics", _Map(_STRING, _Int(_I64)))),
    ),
    _Layout(
        ResolveOffsetSpecResponse,
        Key.RESOLVE_OFFSET_SPEC | RESPONSE_BIT,
        (*_ANSWER, ("offset_type", _UINT16), ("offset", _UINT64)),
    ),
)
_LAYOUT: Final = {layout.cls: layout for layout in _LAYOUTS}

_CODE_ONLY_KEYS: Final = frozenset(
    {
        Key.DECLARE_PUBLISHER,
        Key.DELETE_PUBLISHER,
        Key.SUBSCRIBE,
        Key.UNSUBSCRIBE,
        Key.CREATE,
        Key.DELETE,
        Key.CREATE_SUPER_STREAM,
        Key.DELETE_SUPER_STREAM,
    }
)
"""Commands answered by a bare `Response` (notes, section 4)."""

_RESPONSE_LAYOUTS: Final = {
    key: _Layout(Response, key | RESPONSE_BIT, _ANSWER, build=partial(Response, key=key))
    for key in sorted(_CODE_ONLY_KEYS)
}


def _encode_response(event: Response) -> bytes:
    """A bare response: size 10, key with the response bit, version 1, correlation id, code."""
    if event.key not in _CODE_ONLY_KEYS:
        raise StreamLocalError(
            f"key {event.key:#06x} is not answered by a bare Response", kind="wrong-key"
        )
    return _RESPONSE_HEAD.pack(10, event.key | RESPONSE_BIT, 1, event.correlation_id, event.code)


# --- ConsumerUpdateResponse: trailing bytes tolerated after types 0-3 ---------------------


def _decode_consumer_update_response(frame: bytes) -> ConsumerUpdateResponse:
    """Notes, section 5 0x001a: after types 0 to 3 the rest is ignored (and kept)."""
    correlation_id, code, kind = struct.unpack_from(">IHH", frame, _KEY_VERSION_BYTES)
    if kind > OffsetKind.NEXT:
        # Types 4 and 5 carry their value, and nothing may follow it.
        values, pos = _read_fields((("offset_spec", _OFFSET),), frame, 10)
        if pos != len(frame):
            raise _MalformedError(f"{len(frame) - pos} bytes follow the offset")
        spec: OffsetSpec | None = values["offset_spec"]
        ignored = b""
    else:
        spec = None if kind == OFFSET_TYPE_NONE else OffsetSpec(kind=OffsetKind(kind))
        ignored = frame[12:]
    return ConsumerUpdateResponse(
        correlation_id=correlation_id, code=code, offset_spec=spec, ignored=ignored
    )


def _encode_consumer_update_response(event: ConsumerUpdateResponse) -> bytes:
    """Write the offset type (0 for None), its value for 4 and 5, then ``ignored``."""
    spec = event.offset_spec
    if event.ignored and spec is not None and spec.kind > OffsetKind.NEXT:
        raise StreamLocalError(
            "only offset types 0 to 3 may be followed by ignored bytes", kind="bad-value"
        )
    out = [b"", _U32.pack(event.correlation_id), _U16.pack(event.code)]
    if spec is None:
        out.append(_U16.pack(OFFSET_TYPE_NONE))
    else:
        _OFFSET.write(spec, out)
    out.append(event.ignored)
    out[0] = _HEADER.pack(
        sum(map(len, out)) + _KEY_VERSION_BYTES, Key.CONSUMER_UPDATE | RESPONSE_BIT, 1
    )
    return b"".join(out)
