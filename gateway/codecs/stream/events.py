"""The events of the RabbitMQ Stream protocol: one frozen dataclass per command.

Each class cites its section of docs/stream-protocol-notes.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.codecs.stream.values import (
    Broker,
    CommandVersion,
    OffsetSpec,
    StreamMetadata,
)

__all__ = [
    "HEARTBEAT",
    "Close",
    "CloseResponse",
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
    "Metadata",
    "MetadataResponse",
    "MetadataUpdate",
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
    "Route",
    "RouteResponse",
    "SaslAuthenticate",
    "SaslAuthenticateResponse",
    "SaslHandshake",
    "SaslHandshakeResponse",
    "StoreOffset",
    "StreamStats",
    "StreamStatsResponse",
    "Subscribe",
    "Tune",
    "Unsubscribe",
]

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
    entry, in order (the encoder takes bytes as well). Entries all of one
    small size are the exception: copied out as ``bytes`` by one compiled
    struct, which costs less than a view each.

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
