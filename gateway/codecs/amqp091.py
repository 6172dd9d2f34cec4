"""The few AMQP 0-9-1 frames and methods a DMP principal connection needs (sans-IO).

DMP connections are "forked off a principle protocol connection" (spec
../shared/specs/dmp.txt, "Operations"): a client authenticates over AMQP
0-9-1, asks for a sink with Direct.Put or a feed with Direct.Get (class
61500, spec appendix) and gets a lease in Put-Ok / Get-Ok, which it presents
on a new DMP connection. This module frames that conversation.

Wire format (AMQP 0-9-1, section 4.2): a protocol header ``AMQP 0 0 9 1``
from the client, then frames ``type:u8 channel:u16 size:u32 payload 0xCE``.
Method frames (type 1) carry ``class:u16 method:u16`` and the method's
arguments; heartbeat frames (type 8) are empty. Content frames (2, 3) have no
use here and are refused.

Only the methods of `METHODS` are known: connection start/start-ok,
tune/tune-ok, open/open-ok, close/close-ok; channel open/open-ok,
close/close-ok; direct put/put-ok, get/get-ok. Anything else is reported as
unknown (the server answers 540 NOT_IMPLEMENTED).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.fieldtable import (
    FieldTableError,
    FieldTableLocalError,
    FieldValue,
    decode_table,
    encode_short_string,
    encode_table,
)

__all__ = [
    "DEFAULT_FRAME_MAX",
    "FRAME_END",
    "METHODS",
    "PROTOCOL_HEADER",
    "AMQPError",
    "AMQPLocalError",
    "Event",
    "FrameCodec",
    "HeartbeatFrame",
    "Method",
    "encode_heartbeat",
    "encode_method",
]

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
"""The AMQP 0-9-1 protocol header (section 4.2.2)."""
FRAME_END: Final = 0xCE
DEFAULT_FRAME_MAX: Final = 131072
"""Largest frame (payload plus the 8 octets around it) accepted before Tune settles it."""
MIN_FRAME_MAX: Final = 4096
"""AMQP 0-9-1: frame-max is at least 4096 octets."""

# Reply codes (AMQP 0-9-1 constants) used by the adapter.
FRAME_ERROR: Final = 501
SYNTAX_ERROR: Final = 502
COMMAND_INVALID: Final = 503
UNEXPECTED_FRAME: Final = 505
NOT_IMPLEMENTED: Final = 540

_FRAME_HEAD: Final = struct.Struct(">BHI")
_METHOD_HEAD: Final = struct.Struct(">HH")
_OCTET: Final = struct.Struct(">B")
_SHORT: Final = struct.Struct(">H")
_LONG: Final = struct.Struct(">I")
_LONGLONG: Final = struct.Struct(">Q")

METHODS: Final[dict[tuple[int, int], tuple[str, tuple[tuple[str, str], ...]]]] = {
    (10, 10): (
        "connection.start",
        (
            ("version_major", "octet"),
            ("version_minor", "octet"),
            ("server_properties", "table"),
            ("mechanisms", "longstr"),
            ("locales", "longstr"),
        ),
    ),
    (10, 11): (
        "connection.start-ok",
        (
            ("client_properties", "table"),
            ("mechanism", "shortstr"),
            ("response", "longstr"),
            ("locale", "shortstr"),
        ),
    ),
    (10, 30): (
        "connection.tune",
        (("channel_max", "short"), ("frame_max", "long"), ("heartbeat", "short")),
    ),
    (10, 31): (
        "connection.tune-ok",
        (("channel_max", "short"), ("frame_max", "long"), ("heartbeat", "short")),
    ),
    (10, 40): (
        "connection.open",
        (("virtual_host", "shortstr"), ("reserved_1", "shortstr"), ("reserved_2", "bit")),
    ),
    (10, 41): ("connection.open-ok", (("reserved_1", "shortstr"),)),
    (10, 50): (
        "connection.close",
        (
            ("reply_code", "short"),
            ("reply_text", "shortstr"),
            ("class_id", "short"),
            ("method_id", "short"),
        ),
    ),
    (10, 51): ("connection.close-ok", ()),
    (20, 10): ("channel.open", (("reserved_1", "shortstr"),)),
    (20, 11): ("channel.open-ok", (("reserved_1", "longstr"),)),
    (20, 40): (
        "channel.close",
        (
            ("reply_code", "short"),
            ("reply_text", "shortstr"),
            ("class_id", "short"),
            ("method_id", "short"),
        ),
    ),
    (20, 41): ("channel.close-ok", ()),
    (61500, 10): ("direct.put", (("sink", "shortstr"),)),
    (61500, 11): ("direct.put-ok", (("lease", "shortstr"),)),
    (61500, 20): ("direct.get", (("feed", "shortstr"),)),
    (61500, 21): ("direct.get-ok", (("lease", "shortstr"),)),
}
"""(class id, method id) to the method's name and its arguments (name, AMQP type)."""

_BY_NAME: Final = {name: (ids, fields) for ids, (name, fields) in METHODS.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Method:
    """One method frame.

    Attributes:
        channel: The frame's channel (0 for the connection class).
        name: ``class.method`` as in `METHODS` (``direct.put``...).
        arguments: Argument name to value: ``str`` for short strings (UTF-8),
            ``bytes`` for long strings, ``int`` for octet/short/long,
            ``bool`` for bits, ``dict`` for field tables.
    """

    channel: int
    name: str
    arguments: Mapping[str, FieldValue] = field(default_factory=dict)

    @property
    def ids(self) -> tuple[int, int]:
        """The (class id, method id) pair."""
        return _BY_NAME[self.name][0]


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatFrame:
    """A heartbeat frame (type 8, channel 0, no payload)."""


Event = Method | HeartbeatFrame


class AMQPError(RemoteProtocolError):
    """The peer broke AMQP 0-9-1; ``code`` is the reply code of the Connection.Close to send.

    Attributes:
        code: 501 frame error, 502 syntax error, 505 unexpected frame, 540 not implemented.
        class_id: The class of the offending method, when known (else 0).
        method_id: Its method id, when known (else 0).
    """

    def __init__(
        self, reason: str, *, code: int, kind: str, class_id: int = 0, method_id: int = 0
    ) -> None:
        super().__init__(reason, kind=kind)
        self.code = code
        self.class_id = class_id
        self.method_id = method_id


class AMQPLocalError(LocalProtocolError):
    """A method or value AMQP 0-9-1 cannot carry."""


# --- encoding ----------------------------------------------------------------------------------


def encode_method(method: Method) -> bytes:
    """The method as one frame.

    Raises:
        AMQPLocalError: Unknown method, missing argument or a value out of range.
    """
    known = _BY_NAME.get(method.name)
    if known is None:
        raise AMQPLocalError(f"unknown method {method.name!r}")
    (class_id, method_id), fields = known
    parts = [_METHOD_HEAD.pack(class_id, method_id)]
    for name, kind in fields:
        if name not in method.arguments:
            raise AMQPLocalError(f"{method.name} needs {name}")
        parts.append(_encode_value(method.name, name, kind, method.arguments[name]))
    payload = b"".join(parts)
    return _FRAME_HEAD.pack(1, method.channel, len(payload)) + payload + b"\xce"


def encode_heartbeat() -> bytes:
    """A heartbeat frame."""
    return _FRAME_HEAD.pack(8, 0, 0) + b"\xce"


def _encode_value(method: str, name: str, kind: str, value: FieldValue) -> bytes:
    try:
        if kind == "shortstr":
            return encode_short_string(value)
        if kind == "longstr":
            raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
            return _LONG.pack(len(raw)) + raw
        if kind == "table":
            return encode_table(value)
        if kind == "bit":
            return _OCTET.pack(1 if value else 0)
        packer = {"octet": _OCTET, "short": _SHORT, "long": _LONG, "longlong": _LONGLONG}[kind]
        return packer.pack(value)
    except (struct.error, FieldTableLocalError, TypeError, ValueError) as exc:
        raise AMQPLocalError(f"{method} {name}: {exc}") from None


# --- decoding ----------------------------------------------------------------------------------


class FrameCodec:
    """Decodes the frames a peer sends after the protocol header.

    Incremental: any split of the input gives the same events. A frame whose
    declared size passes ``frame_max`` fails before its payload is buffered.

    Args:
        frame_max: Largest frame accepted, header and end octet included.
    """

    def __init__(self, frame_max: int = DEFAULT_FRAME_MAX) -> None:
        self.frame_max = frame_max
        self._buffer = bytearray()
        self._dead = False

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete frame; zero exactly between frames.

        Lets the adapter time out a frame that never completes.
        """
        return len(self._buffer)

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes; return the events they complete.

        Raises:
            AMQPError: The peer broke the protocol (events before it are in
                its ``events``); the codec is dead afterwards.
        """
        if self._dead:
            raise AMQPError("the connection already failed", code=FRAME_ERROR, kind="dead")
        buffer = self._buffer
        buffer += data
        events: list[Event] = []
        pos = 0
        try:
            while len(buffer) - pos >= _FRAME_HEAD.size:
                frame_type, channel, size = _FRAME_HEAD.unpack_from(buffer, pos)
                if size + 8 > self.frame_max:
                    raise AMQPError(
                        f"frame of {size + 8} octets passes frame-max {self.frame_max}",
                        code=FRAME_ERROR,
                        kind="too-large",
                    )
                end = pos + _FRAME_HEAD.size + size
                if len(buffer) <= end:
                    break
                if buffer[end] != FRAME_END:
                    raise AMQPError(
                        f"frame end octet is {buffer[end]:#04x}, not 0xce",
                        code=FRAME_ERROR,
                        kind="bad-frame-end",
                    )
                # Principal frames are few and small: one copy keeps the buffer resizable.
                payload = bytes(buffer[pos + _FRAME_HEAD.size : end])
                events.append(_decode_frame(frame_type, channel, payload))
                pos = end + 1
        except AMQPError as exc:
            self._dead = True
            exc.events = list(events)
            raise
        del buffer[:pos]
        return events


def _decode_frame(frame_type: int, channel: int, payload: bytes) -> Event:
    if frame_type == 8:
        if channel != 0 or len(payload):
            raise AMQPError(
                "a heartbeat frame must be empty, on channel 0", code=FRAME_ERROR, kind="bad-frame"
            )
        return HeartbeatFrame()
    if frame_type in (2, 3):
        raise AMQPError(
            "content frames have no place on a DMP principal connection",
            code=UNEXPECTED_FRAME,
            kind="unexpected-frame",
        )
    if frame_type != 1:
        raise AMQPError(f"unknown frame type {frame_type}", code=FRAME_ERROR, kind="bad-frame")
    if len(payload) < _METHOD_HEAD.size:
        raise AMQPError("method frame shorter than its ids", code=FRAME_ERROR, kind="bad-frame")
    class_id, method_id = _METHOD_HEAD.unpack_from(payload)
    known = METHODS.get((class_id, method_id))
    if known is None:
        raise AMQPError(
            f"method {class_id}.{method_id} is not implemented",
            code=NOT_IMPLEMENTED,
            kind="not-implemented",
            class_id=class_id,
            method_id=method_id,
        )
    name, fields = known
    arguments: dict[str, FieldValue] = {}
    pos, end = _METHOD_HEAD.size, len(payload)
    try:
        for argument, kind in fields:
            arguments[argument], pos = _decode_value(payload, pos, end, kind)
    except (struct.error, IndexError, FieldTableError, UnicodeDecodeError) as exc:
        raise AMQPError(
            f"{name}: argument {argument} is malformed or cut short ({exc})",
            code=SYNTAX_ERROR,
            kind="malformed",
            class_id=class_id,
            method_id=method_id,
        ) from None
    if pos != end:
        raise AMQPError(
            f"{name}: {end - pos} octets after its last argument",
            code=SYNTAX_ERROR,
            kind="malformed",
            class_id=class_id,
            method_id=method_id,
        )
    return Method(channel=channel, name=name, arguments=arguments)


def _decode_value(data: bytes, pos: int, end: int, kind: str) -> tuple[FieldValue, int]:
    if kind == "shortstr":
        size = data[pos]
        if pos + 1 + size > end:
            raise IndexError("short string cut short")
        return data[pos + 1 : pos + 1 + size].decode("utf-8"), pos + 1 + size
    if kind == "longstr":
        (size,) = _LONG.unpack_from(data, pos)
        if pos + 4 + size > end:
            raise IndexError("long string cut short")
        return data[pos + 4 : pos + 4 + size], pos + 4 + size
    if kind == "table":
        return decode_table(data, pos)
    if kind == "bit":
        return bool(data[pos] & 1), pos + 1
    unpacker = {"octet": _OCTET, "short": _SHORT, "long": _LONG, "longlong": _LONGLONG}[kind]
    return unpacker.unpack_from(data, pos)[0], pos + unpacker.size
