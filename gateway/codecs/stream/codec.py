"""The per-role tables, `encode` and the sans-IO `StreamCodec`."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

from gateway.codecs.framing import LengthPrefixError, LengthPrefixReader
from gateway.codecs.stream.events import (
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
    _decode_deliver_v1,
    _decode_deliver_v2,
    _decode_publish_confirm,
    _decode_publish_error,
    _decode_publish_v1,
    _decode_publish_v2,
    _encode_deliver,
    _encode_publish,
    _encode_publish_confirm,
    _encode_publish_error,
)
from gateway.codecs.stream.fields import (
    _KEY_VERSION,
    _KEY_VERSION_BYTES,
    _LAYOUT,
    _LAYOUTS,
    _RESPONSE_LAYOUTS,
    _SIZE_BYTES,
    _U32,
    _decode_consumer_update_response,
    _encode_consumer_update_response,
    _encode_response,
)
from gateway.codecs.stream.values import (
    RESPONSE_BIT,
    Key,
    ResponseCode,
    Role,
    StreamError,
    StreamLocalError,
    _MalformedError,
)

__all__ = ["StreamCodec", "encode"]

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

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete frame; zero exactly between frames.

        Lets the adapter time out a frame that never completes.
        """
        return self._reader.pending

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
