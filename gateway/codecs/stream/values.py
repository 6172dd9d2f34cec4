"""Constants, enums, value records and errors of the RabbitMQ Stream codec."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEFAULT_FRAME_MAX_BYTES",
    "ENTRY_OVERHEAD_BYTES",
    "NO_LEADER",
    "OFFSET_TYPE_NONE",
    "PRE_OPEN_FRAME_MAX_BYTES",
    "PUBLISH_OVERHEAD_BYTES",
    "REJECTING_CODES",
    "RESPONSE_BIT",
    "Broker",
    "CommandVersion",
    "Key",
    "OffsetKind",
    "OffsetSpec",
    "ResponseCode",
    "Role",
    "StreamError",
    "StreamLocalError",
    "StreamMetadata",
]

DEFAULT_FRAME_MAX_BYTES: Final = 1_048_576
"""The reference server's configured frame max, 1 MiB (notes, section 3: HRL defaults)."""

PUBLISH_OVERHEAD_BYTES: Final = 13
"""Size, key, version, publisher id and count of a Publish frame (notes, section 5 0x0002)."""

ENTRY_OVERHEAD_BYTES: Final = 12
"""Publishing id and length of each entry in a Publish frame."""

REJECTING_CODES: Final = frozenset({2, 16, 17})
"""PublishError codes no retry fixes: stream missing, access refused, precondition
failed. Every other code (not available, internal error, publisher unknown after a
broker restart...) is worth retrying."""

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
