"""The RabbitMQ Stream protocol, frame layer, both roles (docs/stream-protocol-notes.md).

Sans-IO: `StreamCodec` turns bytes into typed events and events into bytes.
The server role reads what clients send (requests, the Tune reply, Heartbeat,
Close both ways, ConsumerUpdateResponse) and writes responses and server
frames; the client role reads those and writes requests.

Notes, section 2 (PROTOCOL.adoc L23-43)::

    frame = Size:uint32  Key:uint16  Version:uint16  body      Size counts what follows it
    body  = [CorrelationId:uint32] [ResponseCode:uint16] fields...

Keys with bit 15 set are responses. Integers are big-endian; a ``string`` is
an int16 length then UTF-8 (-1 = null), ``bytes`` an int32 length (-1 =
null), an array an int32 count then its items, a map an int32 count then
(string, string) pairs. Every command's exact layout is in section 5 and the
quirks of the reference server and of rstream in sections 13 and 14; each
event class cites its section.

Layouts are data: most commands are a `_Layout` (a tuple of named fields read
and written generically), and the per-role tables map ``(key, version)`` to a
decoder. Publish, PublishConfirm, PublishError and Deliver carry the
messages and have hand-written paths: a Publish decodes to lists of ids and
of `memoryview` slices of its frame, without copying a message, and a
Deliver is written as a small prefix before the stored chunk
(`deliver_prefix`). Osiris chunks themselves are `gateway.codecs.osiris`'s
business; here they are opaque bytes.

Errors. A frame whose declared size is over the codec's frame max raises
`StreamError` with ``kind="frame-too-large"`` and ``code=14`` as soon as its
size is read, before its body is kept. A frame this role does not read (an
unknown key, or a version the reference server does not implement) or whose
body does not match its layout exactly (a field cut short, bytes left over, a
null or non-UTF-8 string, a negative count) raises ``kind="unknown-frame"``,
``code=13``. The reference server answers both, after Open, with
``Close(correlation_id=1, code, reason)``, which a server-role error carries
in ``reply``; before Open it just closes (notes, section 6). After an error
the codec is dead. Trailing bytes are tolerated in one place only: after the
offset type of a ConsumerUpdateResponse of types 0 to 3, which the reference
server ignores and rstream always sends (notes, section 5 0x001a, 14.17).
"""

from __future__ import annotations

import array
import enum
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.framing import LengthPrefixError, LengthPrefixReader

__all__ = [
    "DEFAULT_FRAME_MAX_BYTES",
    "HEARTBEAT",
    "NO_LEADER",
    "OFFSET_TYPE_NONE",
    "PRE_OPEN_FRAME_MAX_BYTES",
    "RESPONSE_BIT",
    "Broker",
    "Close",
    "CloseResponse",
    "CommandVersion",
    "ConsumerUpdate",
    "ConsumerUpdateResponse",
    "Create",
    "CreateSuperStream",
    "Credit",
    "CreditResponse",
    "DeclarePublisher",
    "Delete",
    "DeletePublisher",
    "DeleteSuperStream",
    "Deliver",
    "Event",
    "ExchangeCommandVersions",
    "ExchangeCommandVersionsResponse",
    "Heartbeat",
    "Key",
    "Metadata",
    "MetadataResponse",
    "MetadataUpdate",
    "OffsetKind",
    "OffsetSpec",
    "Open",
    "OpenResponse",
    "Partitions",
    "PartitionsResponse",
    "PeerProperties",
    "PeerPropertiesResponse",
    "Publish",
    "PublishConfirm",
    "PublishError",
    "QueryOffset",
    "QueryOffsetResponse",
    "QueryPublisherSequence",
    "QueryPublisherSequenceResponse",
    "ResolveOffsetSpec",
    "ResolveOffsetSpecResponse",
    "Response",
    "ResponseCode",
    "Role",
    "Route",
    "RouteResponse",
    "SaslAuthenticate",
    "SaslAuthenticateResponse",
    "SaslHandshake",
    "SaslHandshakeResponse",
    "StoreOffset",
    "StreamCodec",
    "StreamError",
    "StreamLocalError",
    "StreamMetadata",
    "StreamStats",
    "StreamStatsResponse",
    "Subscribe",
    "Tune",
    "Unsubscribe",
    "deliver_prefix",
    "encode",
]

DEFAULT_FRAME_MAX_BYTES: Final = 1_048_576
"""The reference server's configured frame max, 1 MiB (notes, section 3: HRL defaults)."""

PRE_OPEN_FRAME_MAX_BYTES: Final = 8192
"""The reference server's ceiling until Open succeeds (notes, 1.13 and section 6).

SASL and the handshake frames are small; 8 KiB bounds what an
unauthenticated peer can make a server buffer. The adapter sets it with
`StreamCodec.set_frame_max` and lifts it to the negotiated value after Open.
"""

RESPONSE_BIT: Final = 0x8000
"""Bit 15 of a key: set on responses (notes, section 2)."""

NO_LEADER: Final = 0xFFFF
"""A stream's leader reference when it has none (notes, section 5 0x000f, 14.7)."""

OFFSET_TYPE_NONE: Final = 0
"""ConsumerUpdateResponse only: keep the subscription's own offset spec (notes, 0x001a)."""


class Role(enum.Enum):
    """Which side of the connection a codec is on."""

    SERVER = "server"
    CLIENT = "client"


class Key(enum.IntEnum):
    """Command keys (notes, section 4); a response's key adds `RESPONSE_BIT`."""

    DECLARE_PUBLISHER = 0x0001
    PUBLISH = 0x0002
    PUBLISH_CONFIRM = 0x0003
    PUBLISH_ERROR = 0x0004
    QUERY_PUBLISHER_SEQUENCE = 0x0005
    DELETE_PUBLISHER = 0x0006
    SUBSCRIBE = 0x0007
    DELIVER = 0x0008
    CREDIT = 0x0009
    STORE_OFFSET = 0x000A
    QUERY_OFFSET = 0x000B
    UNSUBSCRIBE = 0x000C
    CREATE = 0x000D
    DELETE = 0x000E
    METADATA = 0x000F
    METADATA_UPDATE = 0x0010
    PEER_PROPERTIES = 0x0011
    SASL_HANDSHAKE = 0x0012
    SASL_AUTHENTICATE = 0x0013
    TUNE = 0x0014
    OPEN = 0x0015
    CLOSE = 0x0016
    HEARTBEAT = 0x0017
    ROUTE = 0x0018
    PARTITIONS = 0x0019
    CONSUMER_UPDATE = 0x001A
    EXCHANGE_COMMAND_VERSIONS = 0x001B
    STREAM_STATS = 0x001C
    CREATE_SUPER_STREAM = 0x001D
    DELETE_SUPER_STREAM = 0x001E
    RESOLVE_OFFSET_SPEC = 0x001F


class ResponseCode(enum.IntEnum):
    """Response codes (notes, section 3); 20 and 21 are the reference server's own."""

    OK = 1
    STREAM_DOES_NOT_EXIST = 2
    SUBSCRIPTION_ID_ALREADY_EXISTS = 3
    SUBSCRIPTION_ID_DOES_NOT_EXIST = 4
    STREAM_ALREADY_EXISTS = 5
    STREAM_NOT_AVAILABLE = 6
    SASL_MECHANISM_NOT_SUPPORTED = 7
    AUTHENTICATION_FAILURE = 8
    SASL_ERROR = 9
    SASL_CHALLENGE = 10
    SASL_AUTHENTICATION_FAILURE_LOOPBACK = 11
    VIRTUAL_HOST_ACCESS_FAILURE = 12
    UNKNOWN_FRAME = 13
    FRAME_TOO_LARGE = 14
    INTERNAL_ERROR = 15
    ACCESS_REFUSED = 16
    PRECONDITION_FAILED = 17
    PUBLISHER_DOES_NOT_EXIST = 18
    NO_OFFSET = 19
    SASL_CANNOT_CHANGE_MECHANISM = 20
    SASL_CANNOT_CHANGE_USERNAME = 21


class OffsetKind(enum.IntEnum):
    """Where a subscription starts; the value is the wire's offset type (notes, section 7)."""

    FIRST = 1
    LAST = 2
    NEXT = 3
    OFFSET = 4
    TIMESTAMP = 5


# --- values -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OffsetSpec:
    """An offset specification: a kind, and a value for OFFSET and TIMESTAMP only.

    On the wire: the kind as uint16, then a uint64 offset (OFFSET) or an int64
    timestamp in milliseconds (TIMESTAMP); FIRST, LAST and NEXT have no value
    field (notes, section 5 0x0007, 14.17).

    Raises:
        ValueError: A value where the kind has none, or none where it needs one.
    """

    kind: OffsetKind
    value: int | None = None

    def __post_init__(self) -> None:
        if (self.value is None) != (self.kind < OffsetKind.OFFSET):
            raise ValueError(f"offset kind {self.kind.name} with value {self.value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Broker:
    """A node in a MetadataResponse: its reference (list index) and advertised address."""

    reference: int
    host: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamMetadata:
    """One stream in a MetadataResponse (notes, section 5 0x000f).

    ``leader`` and ``replicas`` are broker references; for a stream that is not
    OK the reference server writes `NO_LEADER` and no replicas.
    """

    stream: str
    code: int
    leader: int
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandVersion:
    """One ExchangeCommandVersions entry: a key and the versions supported (notes, 0x001b)."""

    key: int
    min_version: int
    max_version: int


# --- events: connection ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerProperties:
    """0x0011, client to server: the client's properties (notes, section 5 0x0011)."""

    correlation_id: int
    properties: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerPropertiesResponse:
    """0x8011: the server's properties (product, version, cluster_name, ...)."""

    correlation_id: int
    code: int
    properties: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslHandshake:
    """0x0012: asks for the mechanisms; no mechanism field, whatever the DOC says (14.3)."""

    correlation_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslHandshakeResponse:
    """0x8012: the mechanisms the server offers."""

    correlation_id: int
    code: int
    mechanisms: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslAuthenticate:
    """0x0013: mechanism and SASL data (PLAIN: NUL, user name, NUL, password).

    ``data`` is None where the wire has -1, which the reference client sends
    for empty data (notes, section 5 0x0013).
    """

    correlation_id: int
    mechanism: str
    data: bytes | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslAuthenticateResponse:
    """0x8013: the frame ends after the code unless a challenge follows (14.4).

    The challenge is an int16-length string on the wire, not int32 ``bytes``;
    None means no challenge field at all (rstream fails on any extra bytes).
    """

    correlation_id: int
    code: int
    challenge: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Tune:
    """0x0014, both ways, no correlation id: frame max and heartbeat seconds (0 = none).

    The server sends it after authentication; the client echoes its own
    values. A server reads the reply with key 0x0014 (rstream) or 0x8014 and
    decodes both to this event; it is always written as 0x0014 (14.6).
    """

    frame_max: int
    heartbeat: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Open:
    """0x0015: open the virtual host."""

    correlation_id: int
    virtual_host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenResponse:
    """0x8015: ``properties`` None means the array is absent, as the server writes it when empty.

    An empty map is a present array of count 0; both are valid (14.5).
    """

    correlation_id: int
    code: int
    properties: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Close:
    """0x0016, either way: close with a code and a reason (notes, section 5 0x0016)."""

    correlation_id: int
    code: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseResponse:
    """0x8016, either way: the answer to a Close."""

    correlation_id: int
    code: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """0x0017, either way, no body; accepted in any state (notes, 14.22)."""


HEARTBEAT: Final = Heartbeat()


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """A response that is only a code (notes, section 4).

    It answers DeclarePublisher, DeletePublisher, Subscribe, Unsubscribe,
    Create, Delete, CreateSuperStream and DeleteSuperStream. ``key`` is the
    request's key (`Key.SUBSCRIBE`); the wire key adds `RESPONSE_BIT`. Close
    has its own `CloseResponse`.
    """

    key: int
    correlation_id: int
    code: int


# --- events: publishing ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclarePublisher:
    """0x0001: ``reference`` is a plain string, empty for no deduplication (14.2)."""

    correlation_id: int
    publisher_id: int
    reference: str
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Publish:
    """0x0002, no correlation id: a batch of messages (notes, section 5 0x0002).

    Decoded without a per-message copy: ``publishing_ids`` is a list of ints
    and ``messages`` a list of `memoryview` slices of the frame, one per
    entry, in order (the encoder takes bytes as well).

    Attributes:
        publisher_id: The publisher (uint8).
        publishing_ids: One uint64 per entry.
        messages: One per entry: the message body, or for a sub-batch entry
            its raw bytes from the flags byte on (the 11-byte sub-batch header
            and the batch), which is what osiris stores for it.
        version: 1, or 2 to carry filter values.
        filter_values: Version 2 only, one per entry; None where the wire
            has -1 (no filter value). None for version 1.
        sub_batches: Version 1 only: None when no entry is a sub-batch, else
            one flag per entry, True where ``messages[i]`` is a raw sub-batch
            entry.
    """

    publisher_id: int
    publishing_ids: Sequence[int]
    messages: Sequence[bytes | memoryview]
    version: int = 1
    filter_values: Sequence[str | None] | None = None
    sub_batches: Sequence[bool] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishConfirm:
    """0x0003, server to client, no correlation id: confirmed publishing ids (a list)."""

    publisher_id: int
    publishing_ids: Sequence[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishError:
    """0x0004, server to client: failed publishing ids, each with its code (parallel lists)."""

    publisher_id: int
    publishing_ids: Sequence[int]
    codes: Sequence[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryPublisherSequence:
    """0x0005: the last publishing id stored for a reference."""

    correlation_id: int
    reference: str
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryPublisherSequenceResponse:
    """0x8005: code and sequence (0 and OK for an unknown reference, 14.25)."""

    correlation_id: int
    code: int
    sequence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeletePublisher:
    """0x0006."""

    correlation_id: int
    publisher_id: int


# --- events: consuming -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe:
    """0x0007 (not 6, whatever the DOC says): subscribe from an offset spec with credit.

    ``properties`` None means the map is absent (the frame ends after the
    credit, as the reference encoder writes it when empty); rstream always
    sends it, empty or not (notes, section 5 0x0007).
    """

    correlation_id: int
    subscription_id: int
    stream: str
    offset_spec: OffsetSpec
    credit: int
    properties: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Deliver:
    """0x0008, server to client, no correlation id: one osiris chunk, as stored.

    ``chunk`` is the 48-byte chunk header and its data, opaque here (a
    `memoryview` of the frame when decoded). Version 2 adds
    ``committed_chunk_id``; it is sent only to clients that asked for it
    (notes, section 5 0x0008, 14.18). Servers write Deliver frames with
    `deliver_prefix` to avoid copying the chunk.
    """

    subscription_id: int
    chunk: bytes | memoryview
    version: int = 1
    committed_chunk_id: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    """0x0009, no correlation id: more chunks for a subscription (one credit, one Deliver).

    The credit is a uint16, as PROTOCOL.adoc says; see the layout's note on
    the reference server reading it signed (notes, 14.8).
    """

    subscription_id: int
    credit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CreditResponse:
    """0x8009, only on error, and without a correlation id: code then subscription (14.8)."""

    code: int
    subscription_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOffset:
    """0x000a, no correlation id and never answered (14.27)."""

    reference: str
    stream: str
    offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryOffset:
    """0x000b."""

    correlation_id: int
    reference: str
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryOffsetResponse:
    """0x800b: code 19 (no offset) with offset 0 when nothing was stored."""

    correlation_id: int
    code: int
    offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsubscribe:
    """0x000c."""

    correlation_id: int
    subscription_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerUpdate:
    """0x001a, server to client: a single-active consumer became active or not."""

    correlation_id: int
    subscription_id: int
    active: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerUpdateResponse:
    """0x801a, client to server: where the newly active consumer starts.

    ``offset_spec`` None is offset type 0 (keep the subscription's spec). After
    types 0 to 3 the reference server ignores whatever follows, and rstream
    sends 8 zero bytes there: those bytes are kept in ``ignored`` so the frame
    re-encodes exactly (notes, 14.17).
    """

    correlation_id: int
    code: int
    offset_spec: OffsetSpec | None
    ignored: bytes = b""


# --- events: streams and topology ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Create:
    """0x000d: create a stream with string arguments (max-length-bytes, max-age, ...)."""

    correlation_id: int
    stream: str
    arguments: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Delete:
    """0x000e: delete a stream."""

    correlation_id: int
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Metadata:
    """0x000f: ask where streams live."""

    correlation_id: int
    streams: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataResponse:
    """0x800f: brokers then per-stream metadata; no top-level code (14.7)."""

    correlation_id: int
    brokers: tuple[Broker, ...]
    streams: tuple[StreamMetadata, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataUpdate:
    """0x0010, server to client, no correlation id: a stream moved or went away."""

    code: int
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """0x0018: the partitions a routing key maps to in a super stream."""

    correlation_id: int
    routing_key: str
    super_stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteResponse:
    """0x8018: code and streams (OK and none when nothing matches)."""

    correlation_id: int
    code: int
    streams: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Partitions:
    """0x0019: a super stream's partitions."""

    correlation_id: int
    super_stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionsResponse:
    """0x8019: code and streams."""

    correlation_id: int
    code: int
    streams: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeCommandVersions:
    """0x001b: the client's supported versions; ``(8, 1, 2)`` asks for Deliver v2."""

    correlation_id: int
    versions: tuple[CommandVersion, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeCommandVersionsResponse:
    """0x801b: the server's versions, in its order (rstream indexes them, 14.19)."""

    correlation_id: int
    code: int
    versions: tuple[CommandVersion, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStats:
    """0x001c."""

    correlation_id: int
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStatsResponse:
    """0x801c: int64 statistics (committed_chunk_id, first_chunk_id, last_chunk_id)."""

    correlation_id: int
    code: int
    statistics: Mapping[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateSuperStream:
    """0x001d: a super stream with its partitions, binding keys and arguments."""

    correlation_id: int
    name: str
    partitions: tuple[str, ...]
    binding_keys: tuple[str, ...]
    arguments: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteSuperStream:
    """0x001e."""

    correlation_id: int
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolveOffsetSpec:
    """0x001f: resolve an offset spec to an offset; ``properties`` None means absent."""

    correlation_id: int
    stream: str
    offset_spec: OffsetSpec
    properties: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolveOffsetSpecResponse:
    """0x801f: code, offset type (the reference server always writes 4) and uint64 offset."""

    correlation_id: int
    code: int
    offset_type: int
    offset: int


Event = (
    PeerProperties
    | PeerPropertiesResponse
    | SaslHandshake
    | SaslHandshakeResponse
    | SaslAuthenticate
    | SaslAuthenticateResponse
    | Tune
    | Open
    | OpenResponse
    | Close
    | CloseResponse
    | Heartbeat
    | Response
    | DeclarePublisher
    | Publish
    | PublishConfirm
    | PublishError
    | QueryPublisherSequence
    | QueryPublisherSequenceResponse
    | DeletePublisher
    | Subscribe
    | Deliver
    | Credit
    | CreditResponse
    | StoreOffset
    | QueryOffset
    | QueryOffsetResponse
    | Unsubscribe
    | ConsumerUpdate
    | ConsumerUpdateResponse
    | Create
    | Delete
    | Metadata
    | MetadataResponse
    | MetadataUpdate
    | Route
    | RouteResponse
    | Partitions
    | PartitionsResponse
    | ExchangeCommandVersions
    | ExchangeCommandVersionsResponse
    | StreamStats
    | StreamStatsResponse
    | CreateSuperStream
    | DeleteSuperStream
    | ResolveOffsetSpec
    | ResolveOffsetSpecResponse
)
"""Every event of either direction; adapters ``match`` on it."""


# --- errors ------------------------------------------------------------------------------


class StreamError(RemoteProtocolError):
    """The peer sent a frame this codec refuses; the codec is dead afterwards.

    Attributes:
        code: The response code the reference server closes with:
            `ResponseCode.FRAME_TOO_LARGE` (14) for ``frame-too-large``,
            `ResponseCode.UNKNOWN_FRAME` (13) for ``unknown-frame`` and for
            ``truncated`` (the input ended inside a frame; nothing to answer).
        reply: Server role: the ``Close(1, code, reason)`` frame the
            reference server sends after Open (before Open it just closes).
        events: The events decoded before the bad frame, in order.
    """

    def __init__(
        self,
        reason: str,
        *,
        code: int,
        where: str | None = None,
        reply: bytes | None = None,
        kind: str = "unknown-frame",
        events: list[object] | None = None,
    ) -> None:
        super().__init__(reason, where=where, reply=reply, kind=kind, events=events)
        self.code = code


class StreamLocalError(LocalProtocolError):
    """We were asked to send an event this role does not send, or values the wire cannot carry."""


class _MalformedError(Exception):
    """Internal: a frame body does not match its layout; the codec turns it into `StreamError`."""

    def __init__(self, reason: str, where: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.where = where


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

    One `struct.unpack_from` and one `memoryview` slice per entry; an entry
    with bit 31 set switches to `_sub_batch_entries` for the rest.
    """
    publisher_id, count = _publish_head(frame, _ENTRY_BYTES)
    view = memoryview(frame)
    ids: list[int] = []
    messages: list[memoryview] = []
    # Locals, not globals, in the loop that runs once per message.
    add_id, add_message, unpack = ids.append, messages.append, _ENTRY.unpack_from
    sub_batch_bit, entry_bytes = _SUB_BATCH_BIT, _ENTRY_BYTES
    pos = _BODY_START
    for index in range(count):
        publishing_id, size = unpack(frame, pos)
        if size & sub_batch_bit:
            flags, pos = _sub_batch_entries(frame, view, pos, count - index, ids, messages)
            _entries_end(frame, pos)
            return Publish(
                publisher_id=publisher_id,
                publishing_ids=ids,
                messages=messages,
                sub_batches=flags,
            )
        start = pos + entry_bytes
        pos = start + size
        add_id(publishing_id)
        add_message(view[start:pos])
    # A slice past the end is silently short: one check here covers every
    # entry, since an overrun before the last makes the next unpack fail.
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
    messages: list[memoryview] = []
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


def _u64_list(frame: bytes, start: int) -> list[int]:
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


# --- tables --------------------------------------------------------------------------------

_Decoder = Callable[[bytes], Any]
_Encoder = Callable[[Any], bytes]


def _wire(key: int, version: int = 1) -> int:
    """The table key of a frame: its first four bytes, key and version, as one integer."""
    return key << 16 | version


def _read(*classes: type[Any]) -> dict[int, tuple[type[Any], _Decoder]]:
    """Table entries for layout commands read at version 1."""
    return {_wire(_LAYOUT[cls].key): (cls, _LAYOUT[cls].decode) for cls in classes}


# What each role reads: (key, version) -> (event class, decoder). Anything
# absent is an unknown frame (notes, section 2: only the versions the
# reference server implements are recognised).
_SERVER_READS: Final[dict[int, tuple[type[Any], _Decoder]]] = {
    **_read(
        DeclarePublisher,
        QueryPublisherSequence,
        DeletePublisher,
        Subscribe,
        Credit,
        StoreOffset,
        QueryOffset,
        Unsubscribe,
        Create,
        Delete,
        Metadata,
        PeerProperties,
        SaslHandshake,
        SaslAuthenticate,
        Tune,
        Open,
        Close,
        CloseResponse,
        Heartbeat,
        Route,
        Partitions,
        ExchangeCommandVersions,
        StreamStats,
        CreateSuperStream,
        DeleteSuperStream,
        ResolveOffsetSpec,
    ),
    _wire(Key.PUBLISH, 1): (Publish, _decode_publish_v1),
    _wire(Key.PUBLISH, 2): (Publish, _decode_publish_v2),
    # The client's Tune reply, with or without the response bit (14.6).
    _wire(Key.TUNE | RESPONSE_BIT): (Tune, _LAYOUT[Tune].decode),
    _wire(Key.CONSUMER_UPDATE | RESPONSE_BIT): (
        ConsumerUpdateResponse,
        _decode_consumer_update_response,
    ),
}

_CLIENT_READS: Final[dict[int, tuple[type[Any], _Decoder]]] = {
    **_read(
        Tune,
        Close,
        CloseResponse,
        Heartbeat,
        MetadataUpdate,
        ConsumerUpdate,
        QueryPublisherSequenceResponse,
        CreditResponse,
        QueryOffsetResponse,
        MetadataResponse,
        PeerPropertiesResponse,
        SaslHandshakeResponse,
        SaslAuthenticateResponse,
        OpenResponse,
        RouteResponse,
        PartitionsResponse,
        ExchangeCommandVersionsResponse,
        StreamStatsResponse,
        ResolveOffsetSpecResponse,
    ),
    **{_wire(layout.key): (Response, layout.decode) for layout in _RESPONSE_LAYOUTS.values()},
    _wire(Key.PUBLISH_CONFIRM): (PublishConfirm, _decode_publish_confirm),
    _wire(Key.PUBLISH_ERROR): (PublishError, _decode_publish_error),
    _wire(Key.DELIVER, 1): (Deliver, _decode_deliver_v1),
    _wire(Key.DELIVER, 2): (Deliver, _decode_deliver_v2),
}

_DECODERS: Final = {
    role: {wire: decode for wire, (_, decode) in table.items()}
    for role, table in ((Role.SERVER, _SERVER_READS), (Role.CLIENT, _CLIENT_READS))
}

# A role sends what the other role reads.
_SENDS: Final = {
    Role.SERVER: frozenset(cls for cls, _ in _CLIENT_READS.values()),
    Role.CLIENT: frozenset(cls for cls, _ in _SERVER_READS.values()),
}

_ENCODERS: Final[dict[type[Any], _Encoder]] = {
    **{layout.cls: layout.encode for layout in _LAYOUTS},
    Response: _encode_response,
    ConsumerUpdateResponse: _encode_consumer_update_response,
    Publish: _encode_publish,
    PublishConfirm: _encode_publish_confirm,
    PublishError: _encode_publish_error,
    Deliver: _encode_deliver,
}


def encode(event: Event) -> bytes:
    """Encode one event as its frame, size prefix included.

    Raises:
        StreamLocalError: The values cannot be carried (an integer out of its
            field's range, a string over 32,767 UTF-8 bytes, mismatched
            list lengths, a version the command does not have, a bare
            `Response` to a command that answers with more than a code).
    """
    encoder = _ENCODERS.get(type(event))
    if encoder is None:
        raise StreamLocalError(f"{event!r} is not a stream protocol event", kind="wrong-event")
    try:
        return encoder(event)
    except (struct.error, OverflowError, UnicodeEncodeError) as exc:
        raise StreamLocalError(
            f"{type(event).__name__} cannot be encoded: {exc}", kind="out-of-range"
        ) from None


def _describe(key: int) -> str:
    """A command's name and key for error reasons: ``Subscribe response (0x8007)``."""
    try:
        name = Key(key & ~RESPONSE_BIT).name
    except ValueError:
        return f"unknown key {key:#06x}"
    return f"{name}{' response' if key & RESPONSE_BIT else ''} ({key:#06x})"


def _unknown_frame(frame: bytes, role: Role) -> _MalformedError:
    """Why this role does not read ``frame`` at all."""
    if len(frame) < _KEY_VERSION_BYTES:
        return _MalformedError(f"a frame of {len(frame)} bytes has no key and version")
    key, version = _KEY_VERSION.unpack_from(frame)
    versions = sorted(wire & 0xFFFF for wire in _DECODERS[role] if wire >> 16 == key)
    if versions:
        return _MalformedError(
            f"{_describe(key)} version {version} is not supported (only {versions})"
        )
    return _MalformedError(f"a {role.value} does not read {_describe(key)}")


# --- the codec -----------------------------------------------------------------------------


class StreamCodec:
    """One side of one RabbitMQ stream connection.

    Args:
        role: SERVER reads what clients send and writes what servers send;
            CLIENT the reverse.
        frame_max: Largest frame read, in bytes after the size field, as
            Tune negotiates it; 0 means no limit. A server adapter starts at
            `PRE_OPEN_FRAME_MAX_BYTES` and raises it after Open with
            `set_frame_max`. A client should allow more than it announced:
            the reference server does not cap Deliver frames (notes, 14.34).

    Raises:
        TypeError: ``role`` is not a `Role`.
        ValueError: ``frame_max`` is negative or over 2**32 - 1.
    """

    __slots__ = ("_decoders", "_error", "_reader", "_role", "_sends")

    def __init__(self, role: Role, *, frame_max: int) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role must be a stream.Role, not {role!r}")
        self._role = role
        self._decoders = _DECODERS[role]
        self._sends = _SENDS[role]
        self._reader = LengthPrefixReader(_U32, None)
        self.set_frame_max(frame_max)
        self._error: StreamError | None = None

    @property
    def role(self) -> Role:
        """Which side this codec is on."""
        return self._role

    @property
    def frame_max(self) -> int:
        """The current limit on frames read, 0 for none."""
        return self._reader.max_length or 0

    def set_frame_max(self, frame_max: int) -> None:
        """Change the limit on frames read (0 = none) from the next frame header on.

        A frame whose size was already accepted completes under the old limit.

        Raises:
            ValueError: ``frame_max`` is negative or over 2**32 - 1.
        """
        if not 0 <= frame_max <= 0xFFFFFFFF:
            raise ValueError(f"frame max {frame_max} is not a uint32")
        self._reader.max_length = frame_max or None

    def receive_data(self, data: bytes) -> list[Event]:
        """Decode the frames that ``data`` completes.

        Returns:
            The events, in order; an empty list when more data is needed.

        Raises:
            StreamError: A frame over the limit (code 14, raised once its size
                is read), or one this role does not read or whose body is
                malformed (code 13). Events decoded before it are in its
                ``events``. The codec is dead afterwards.
        """
        if self._error is not None:
            raise self._error
        try:
            frames = self._reader.feed(data)
        except LengthPrefixError as exc:
            before = self._decode(exc.complete)
            reason = f"frame of {exc.length} bytes is over the {exc.limit}-byte frame max"
            where = f"byte {exc.offset}"
            self._fail(reason, where, ResponseCode.FRAME_TOO_LARGE, "frame-too-large", before)
        return self._decode(frames)

    def _decode(self, frames: Sequence[bytes]) -> list[Event]:
        """Decode whole frames; on a bad one, fail with the events before it."""
        out: list[Event] = []
        decoders = self._decoders
        unpack = _U32.unpack_from
        for index, frame in enumerate(frames):
            try:
                decode = decoders.get(unpack(frame)[0]) if len(frame) >= 4 else None
                if decode is None:
                    raise _unknown_frame(frame, self._role)
                out.append(decode(frame))
            except (_MalformedError, struct.error, ValueError) as exc:
                self._malformed(exc, frames, index, out)
        return out

    def _malformed(
        self, exc: Exception, frames: Sequence[bytes], index: int, before: list[Event]
    ) -> None:
        """Fail for frame ``index`` of ``frames``, naming the frame and the field."""
        frame = frames[index]
        offset = self._reader.offset - sum(_SIZE_BYTES + len(f) for f in frames[index:])
        where = f"byte {offset}"
        if len(frame) >= _KEY_VERSION_BYTES:
            key, version = _KEY_VERSION.unpack_from(frame)
            where += f": {_describe(key)} version {version}"
        if isinstance(exc, _MalformedError):
            reason = exc.reason
            if exc.where:
                where += f", field {exc.where!r}"
        else:
            reason = f"malformed frame body: {exc}"
        self._fail(reason, where, ResponseCode.UNKNOWN_FRAME, "unknown-frame", before)

    def _fail(self, reason: str, where: str, code: int, kind: str, before: list[Event]) -> None:
        """Raise `StreamError` with the events before it, and stay dead."""
        reply = None
        if self._role is Role.SERVER:
            # Notes, section 6: after Open the reference server closes with
            # this frame and waits for the answer; before Open it just closes.
            text = "frame too large" if code == ResponseCode.FRAME_TOO_LARGE else "unknown frame"
            reply = encode(Close(correlation_id=1, code=code, reason=text))
        self._error = StreamError(reason, code=code, where=where, reply=reply, kind=kind)
        raise StreamError(
            reason, code=code, where=where, reply=reply, kind=kind, events=list(before)
        )

    def end_of_input(self) -> None:
        """Report the end of the byte stream.

        Raises:
            StreamError: The stream ended inside a frame (``truncated``, code
                13), or the codec is dead after an earlier error.
        """
        if self._error is not None:
            raise self._error
        if self._reader.pending:
            where = f"byte {self._reader.offset}"
            reason = f"connection ended inside a frame ({self._reader.pending} bytes of it)"
            self._fail(reason, where, ResponseCode.UNKNOWN_FRAME, "truncated", [])

    def send(self, event: Event) -> bytes:
        """Encode an event this role sends.

        A server sends responses, Tune, Deliver, PublishConfirm, PublishError,
        MetadataUpdate, ConsumerUpdate, CreditResponse, Close, CloseResponse
        and Heartbeat; a client sends requests, Tune, Close, CloseResponse,
        Heartbeat and ConsumerUpdateResponse. Sending still works after a
        receive error, so that the adapter can write ``reply``.

        Raises:
            StreamLocalError: This role does not send it, or `encode` refuses it.
        """
        if type(event) not in self._sends:
            raise StreamLocalError(
                f"a {self._role.value} does not send {type(event).__name__}", kind="wrong-role"
            )
        return encode(event)
