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

from gateway.codecs.stream.codec import (
    StreamCodec,
    encode,
)
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
    Deliver,
    Event,
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
    Publish,
    PublishConfirm,
    PublishError,
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
from gateway.codecs.stream.fastpath import (
    deliver_prefix,
)
from gateway.codecs.stream.values import (
    DEFAULT_FRAME_MAX_BYTES,
    ENTRY_OVERHEAD_BYTES,
    NO_LEADER,
    OFFSET_TYPE_NONE,
    PRE_OPEN_FRAME_MAX_BYTES,
    PUBLISH_OVERHEAD_BYTES,
    REJECTING_CODES,
    RESPONSE_BIT,
    Broker,
    CommandVersion,
    Key,
    OffsetKind,
    OffsetSpec,
    ResponseCode,
    Role,
    StreamError,
    StreamLocalError,
    StreamMetadata,
)

__all__ = [
    "DEFAULT_FRAME_MAX_BYTES",
    "ENTRY_OVERHEAD_BYTES",
    "HEARTBEAT",
    "NO_LEADER",
    "OFFSET_TYPE_NONE",
    "PRE_OPEN_FRAME_MAX_BYTES",
    "PUBLISH_OVERHEAD_BYTES",
    "REJECTING_CODES",
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
