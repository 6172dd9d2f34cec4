"""MTL, the Message Transport Layer (../shared/specs/mtl.txt): control and data frames.

Sans-IO: ZeroMQ delivers whole multipart messages, so the codec works on
lists of frames (the ROUTER identity frame already taken off).

Control flow (REQ to ROUTER): a request is two frames, the command name
(case-insensitive, ``Connection.Open`` ...) and a JSON object; a reply is a
three-digit status and a JSON object. `parse_request` returns None for an
ill-formed request (wrong frame count, not JSON, not an object), which the
spec says to drop silently.

Data flow (DEALER to ROUTER): every command is two frames, a header (one
command-type byte and its fields) and a body::

    0x01 Lease     sequence:u64  lease:shortstr                body unused
    0x02 Response  sequence:u64                                body "200", "403"...
    0x03 Summon    sequence:u64  resource:shortstr             body unused
    0x04 Dismiss   sequence:u64  resource:shortstr             body unused
    0x05 Content   sequence:u64  resource:shortstr  properties:table   body content
    0x06 Confirm   sequence:u64  multiple:bool                 body unused
    0x07 Reject    sequence:u64  multiple:bool  recycle:bool   body unused
    0x08 Ping                                                  body unused
    0x09 Pong                                                  body unused

Spec, "Field Encodings": integers are 64-bit unsigned big-endian, short
strings one length octet and up to 255 bytes, booleans one octet 0 or 1.
Spec ambiguity: the field table is "to be defined"; we use the AMQP 0-9-1
field table (`gateway.codecs.fieldtable`), as DMP's headers do. The spec
lists a "shortint" (16-bit unsigned, network order) that no command uses;
`encode_shortint` and `decode_shortint` carry it for profiles that will.

`decode_data` raises `MTLError` for an ill-formed data command (wrong frame
count, unknown type, fields cut short or left over, a boolean other than 0
or 1); the spec says to drop those silently.

Fast paths (issue 15: the codec was 40% of a routed confirm=full flow's
cost). `decode_data` dispatches on the command-type byte to a decoder that
unpacks the command's fixed layout with one precompiled struct (Confirm and
Reject are nothing else; Content with an empty properties table is its
head, the resource and four zero octets); `encode_data` dispatches on
``type(command)`` the same way. Each gives way, on anything it does not
expect, to the general code (`_decode_data_general`, `_encode_data_general`,
field by field), which gives the command or says what is wrong: the fast
paths decide nothing (tests compare them).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

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
    "CONFIRM",
    "CONTENT",
    "DISMISS",
    "LEASE",
    "PING",
    "PONG",
    "REJECT",
    "RESPONSE",
    "SUMMON",
    "Confirm",
    "Content",
    "ControlRequest",
    "DataCommand",
    "Dismiss",
    "Lease",
    "MTLError",
    "MTLLocalError",
    "Ping",
    "Pong",
    "Reject",
    "Response",
    "Summon",
    "confirm_fields",
    "content_fields",
    "content_header_with_id",
    "decode_boolean",
    "decode_data",
    "decode_integer",
    "decode_shortint",
    "encode_boolean",
    "encode_content",
    "encode_content_with_id",
    "encode_data",
    "encode_integer",
    "encode_shortint",
    "parse_reply",
    "parse_request",
    "reply",
    "request",
]

LEASE: Final = 0x01
RESPONSE: Final = 0x02
SUMMON: Final = 0x03
DISMISS: Final = 0x04
CONTENT: Final = 0x05
CONFIRM: Final = 0x06
REJECT: Final = 0x07
PING: Final = 0x08
PONG: Final = 0x09

_U64: Final = struct.Struct(">Q")
_U16: Final = struct.Struct(">H")
_HEAD: Final = struct.Struct(">BQ")
"""Type and sequence: a Response's header."""
_NAMED: Final = struct.Struct(">BQB")
"""Type, sequence and a short string's length: Lease, Summon, Dismiss, Content."""
_CONFIRM: Final = struct.Struct(">BQB")
"""Type, sequence, multiple: a Confirm's header."""
_REJECT: Final = struct.Struct(">BQBB")
"""Type, sequence, multiple, recycle: a Reject's header."""
_EMPTY_TABLE: Final = b"\0\0\0\0"
_U32: Final = struct.Struct(">I")
_ID_FIELD: Final = b"\x0amessage-idS"
"""A field table's ``message-id`` entry up to its text value's length."""


class MTLError(RemoteProtocolError):
    """An ill-formed command from a peer (to be dropped)."""


class MTLLocalError(LocalProtocolError):
    """A command that cannot be encoded."""


# --- control flow --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A well-formed control request: the command name in lower case and its JSON body."""

    command: str
    body: dict[str, Any]


MAX_JSON_DEPTH: Final = 32
"""Nesting of arrays and objects a control body may have. No MTL command nests
more than two levels; a deeper body is ill-formed here, as the parser would
otherwise recurse as deep as the peer likes (RecursionError past ~1,000)."""
_JSON_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET: Final = re.compile(rb"[\[\]{}]")


def json_depth_within(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the arrays and objects of a JSON text nest at most ``limit`` deep.

    Cheap for ordinary bodies: only a text with more than ``limit`` opening
    brackets in all is scanned (strings first removed, as their brackets do
    not nest).
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return True
    depth = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b"", data)):
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def parse_request(frames: list[bytes]) -> ControlRequest | None:
    """A control request, or None when it is ill-formed (the spec: drop it silently).

    Spec, "Error handling": ill-formed requests are those with the wrong
    number of frames or a body that is not valid JSON; a body nesting deeper
    than `MAX_JSON_DEPTH` counts as ill-formed too.
    """
    if len(frames) != 2 or not json_depth_within(frames[1]):
        return None
    try:
        command = frames[0].decode("utf-8")
        body = json.loads(frames[1])
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    return ControlRequest(command.lower(), body)


def reply(status: int, body: dict[str, Any]) -> list[bytes]:
    """A control reply: the three-digit status and the JSON body."""
    return [b"%03d" % status, json.dumps(body).encode("utf-8")]


def request(command: str, body: dict[str, Any]) -> list[bytes]:
    """A control request: the command name and the JSON body."""
    return [command.encode("utf-8"), json.dumps(body).encode("utf-8")]


def parse_reply(frames: list[bytes]) -> tuple[int, dict[str, Any]] | None:
    """A control reply's status and body, or None when it is ill-formed."""
    parsed = parse_request(frames)
    if parsed is None or len(parsed.command) != 3 or not parsed.command.isdigit():
        return None
    return int(parsed.command), parsed.body


# --- data flow -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """0x01: open a data flow with the lease from a 202 reply."""

    sequence: int
    lease: str


@dataclass(frozen=True, slots=True)
class Response:
    """0x02: the answer to a Lease, Summon or Dismiss (``code`` such as 200)."""

    sequence: int
    code: int


@dataclass(frozen=True, slots=True)
class Summon:
    """0x03: start receiving content from a resource."""

    sequence: int
    resource: str


@dataclass(frozen=True, slots=True)
class Dismiss:
    """0x04: stop receiving content from a resource."""

    sequence: int
    resource: str


@dataclass(frozen=True, slots=True)
class Content:
    """0x05: content to or from a resource."""

    sequence: int
    resource: str
    properties: dict[str, FieldValue] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Confirm:
    """0x06: content received safely (up to and including ``sequence`` if multiple)."""

    sequence: int
    multiple: bool = False


@dataclass(frozen=True, slots=True)
class Reject:
    """0x07: content refused; ``recycle`` asks for it to be sent again later."""

    sequence: int
    multiple: bool = False
    recycle: bool = False


@dataclass(frozen=True, slots=True)
class Ping:
    """0x08: are you there?"""


@dataclass(frozen=True, slots=True)
class Pong:
    """0x09: yes."""


DataCommand = Lease | Response | Summon | Dismiss | Content | Confirm | Reject | Ping | Pong


class _Reader:
    def __init__(self, header: bytes) -> None:
        self.data = header
        self.pos = 1

    def integer(self) -> int:
        if self.pos + 8 > len(self.data):
            raise MTLError("integer field cut short", where=f"byte {self.pos}")
        (value,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        return int(value)

    def short_string(self) -> str:
        if self.pos >= len(self.data) or self.pos + 1 + self.data[self.pos] > len(self.data):
            raise MTLError("short string cut short", where=f"byte {self.pos}")
        raw = self.data[self.pos + 1 : self.pos + 1 + self.data[self.pos]]
        self.pos += 1 + len(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MTLError("short string is not UTF-8", where=f"byte {self.pos}") from None

    def boolean(self) -> bool:
        if self.pos >= len(self.data) or self.data[self.pos] not in (0, 1):
            raise MTLError("boolean must be one octet, 0 or 1", where=f"byte {self.pos}")
        self.pos += 1
        return self.data[self.pos - 1] == 1

    def table(self) -> dict[str, FieldValue]:
        try:
            value, self.pos = decode_table(self.data, self.pos)
        except FieldTableError as exc:
            raise MTLError(f"properties: {exc.reason}", where=exc.where) from None
        return value

    def end(self) -> None:
        if self.pos != len(self.data):
            raise MTLError(f"{len(self.data) - self.pos} bytes after the fields")


def decode_data(frames: list[bytes]) -> DataCommand:
    """Decode one data command (header and body frames).

    Raises:
        MTLError: Ill-formed.
    """
    if len(frames) == 2:
        header, body = frames
        if header:
            decode = _DECODERS.get(header[0])
            if decode is not None:
                command = decode(header, body)
                if command is not None:
                    return command
    return _decode_data_general(frames)


def encode_content(
    sequence: int, resource: str, properties: dict[str, FieldValue], body: bytes
) -> list[bytes]:
    """``encode_data(Content(sequence, resource, properties, body))``, the Content unbuilt.

    What a listener writes to its readers, minus a frozen dataclass a copy.

    Raises:
        MTLLocalError: As `encode_data`.
    """
    try:
        raw = resource.encode()
        table = (
            _EMPTY_TABLE
            if type(properties) is dict and not properties
            else encode_table(properties)
        )
        return [_NAMED.pack(CONTENT, sequence, len(raw)) + raw + table, body]
    except _GIVE_WAY:
        pass
    return _encode_data_general(Content(sequence, resource, properties, body))


def encode_content_with_id(
    sequence: int, resource: str, message_id: str, body: bytes
) -> list[bytes]:
    """``encode_content(sequence, resource, {"message-id": message_id}, body)``, the table unbuilt.

    What a listener writes to its readers for a message with an id and no
    other properties, the common case: the table is one text entry.

    Raises:
        MTLLocalError: As `encode_content`.
    """
    return [content_header_with_id(sequence, resource, message_id), body]


def content_header_with_id(sequence: int, resource: str, message_id: str) -> bytes:
    """The header frame of `encode_content_with_id` (whatever the body).

    Raises:
        MTLLocalError: As `encode_content`.
    """
    try:
        raw = resource.encode()
        value = message_id.encode()
        named, size = len(raw), len(value)
        layout = _WITH_ID.get((named, size))
        if layout is None:
            layout = _with_id_layout(named, size)
        # After the resource, the table: its size, then the entry's name, type octet, length, value.
        return layout.pack(CONTENT, sequence, named, raw, size + 16, _ID_FIELD, size, value)
    except _GIVE_WAY:
        pass
    return _encode_data_general(Content(sequence, resource, {"message-id": message_id}, b""))[0]


_WITH_ID: Final[dict[tuple[int, int], struct.Struct]] = {}
"""`content_header_with_id`'s layouts, by the lengths of resource and id."""


def _with_id_layout(resource: int, message_id: int) -> struct.Struct:
    """The header of a Content whose table is its id alone, for these lengths, as one struct."""
    if len(_WITH_ID) >= 256:  # ids of one length each, a few resources: rarely many
        _WITH_ID.clear()
    layout = _WITH_ID[resource, message_id] = struct.Struct(
        f">BQB{resource}sI{len(_ID_FIELD)}sI{message_id}s"
    )
    return layout


def confirm_fields(header: bytes) -> tuple[int, bool] | None:
    """The sequence and ``multiple`` of a well-formed Confirm's header frame; None if it is not one.

    For a command of two frames whose header this reads,
    ``decode_data([header, body])`` is ``Confirm(sequence, multiple)``
    whatever the body (spec, "Content Confirmation": the body is unused):
    a reader's Confirms, one per Content, without the command built.
    """
    if len(header) != _CONFIRM.size or header[0] != CONFIRM:
        return None
    _kind, sequence, multiple = _CONFIRM.unpack(header)
    if multiple > 1:
        return None
    return sequence, multiple == 1


def encode_data(command: DataCommand) -> list[bytes]:
    """The two frames of a data command.

    Raises:
        MTLLocalError: A name over 255 bytes, an integer out of range, or
            properties a field table cannot carry.
    """
    encode = _ENCODERS.get(type(command))
    if encode is not None:
        try:
            return encode(command)
        except _GIVE_WAY:
            pass
    return _encode_data_general(command)


# --- fast paths: one struct per layout; None (or an error) leaves it to the general code ----

_new: Final = object.__new__
# A frozen dataclass's __init__ sets each field with object.__setattr__;
# Contents are made through the slots, every field given (half the cost).
_CONTENT_FIELDS: Final = ("sequence", "resource", "properties", "body")
_set_sequence, _set_resource, _set_properties, _set_body = (
    Content.__dict__[name].__set__ for name in _CONTENT_FIELDS
)
_BOOLEANS: Final = (False, True)


def _new_content(
    sequence: int, resource: str, properties: dict[str, FieldValue], body: bytes
) -> Content:
    """``Content(sequence, resource, properties, body)``, made through the slots."""
    content: Content = _new(Content)
    _set_sequence(content, sequence)
    _set_resource(content, resource)
    _set_properties(content, properties)
    _set_body(content, body)
    return content


def content_fields(header: bytes) -> tuple[int, str, dict[str, FieldValue]] | None:
    """The sequence, resource and properties of a Content's header frame; None if not read here.

    For a command of two frames whose header this reads,
    ``decode_data([header, body])`` is ``Content(sequence, resource,
    properties, body)``: a writer's Contents without the command built.
    None for any other header, and for a Content it leaves to the general
    decoder (which then decodes it, or says why it is ill-formed).
    """
    if len(header) < 14 or header[0] != CONTENT:  # type, sequence, resource and table lengths
        return None
    _kind, sequence, size = _NAMED.unpack_from(header)
    stop = 10 + size
    try:
        resource = header[10:stop].decode() if size else ""
    except UnicodeDecodeError:
        return None
    if len(header) == stop + 4 and header[stop:] == _EMPTY_TABLE:
        return sequence, resource, {}
    if len(header) < stop + 4:
        return None
    try:
        properties, end = decode_table(header, stop)
    except FieldTableError:
        return None
    if end != len(header):
        return None
    return sequence, resource, properties


def _fast_content(header: bytes, body: bytes) -> Content | None:
    fields = content_fields(header)
    return None if fields is None else _new_content(*fields, body)


_set_confirm_sequence, _set_confirm_multiple = (
    Confirm.__dict__[name].__set__ for name in ("sequence", "multiple")
)


def _fast_confirm(header: bytes, body: bytes) -> Confirm | None:
    if len(header) != _CONFIRM.size:
        return None
    _kind, sequence, multiple = _CONFIRM.unpack(header)
    if multiple > 1:
        return None
    confirm: Confirm = _new(Confirm)  # through the slots, as Contents are
    _set_confirm_sequence(confirm, sequence)
    _set_confirm_multiple(confirm, _BOOLEANS[multiple])
    return confirm


def _fast_reject(header: bytes, body: bytes) -> Reject | None:
    if len(header) != _REJECT.size:
        return None
    _kind, sequence, multiple, recycle = _REJECT.unpack(header)
    if multiple > 1 or recycle > 1:
        return None
    return Reject(sequence, _BOOLEANS[multiple], _BOOLEANS[recycle])


def _named(header: bytes) -> tuple[int, str] | None:
    """The sequence and the short string of a header that holds just those."""
    if len(header) < _NAMED.size or len(header) != _NAMED.size + header[9]:
        return None
    try:
        return _NAMED.unpack_from(header)[1], header[_NAMED.size :].decode()
    except UnicodeDecodeError:
        return None


def _fast_lease(header: bytes, body: bytes) -> Lease | None:
    named = _named(header)
    return None if named is None else Lease(*named)


def _fast_summon(header: bytes, body: bytes) -> Summon | None:
    named = _named(header)
    return None if named is None else Summon(*named)


def _fast_dismiss(header: bytes, body: bytes) -> Dismiss | None:
    named = _named(header)
    return None if named is None else Dismiss(*named)


def _fast_response(header: bytes, body: bytes) -> Response | None:
    if len(header) != _HEAD.size or len(body) != 3 or not body.isdigit():
        return None
    return Response(_HEAD.unpack(header)[1], int(body))


_PING: Final = Ping()
_PONG: Final = Pong()


def _fast_ping(header: bytes, body: bytes) -> Ping | None:
    return _PING if len(header) == 1 else None


def _fast_pong(header: bytes, body: bytes) -> Pong | None:
    return _PONG if len(header) == 1 else None


_DECODERS: Final[dict[int, Callable[[bytes, bytes], DataCommand | None]]] = {
    LEASE: _fast_lease,
    RESPONSE: _fast_response,
    SUMMON: _fast_summon,
    DISMISS: _fast_dismiss,
    CONTENT: _fast_content,
    CONFIRM: _fast_confirm,
    REJECT: _fast_reject,
    PING: _fast_ping,
    PONG: _fast_pong,
}


def _put_content(command: Content) -> list[bytes]:
    resource = command.resource.encode()
    properties = command.properties
    table = (
        _EMPTY_TABLE if type(properties) is dict and not properties else encode_table(properties)
    )
    return [_NAMED.pack(CONTENT, command.sequence, len(resource)) + resource + table, command.body]


def _put_confirm(command: Confirm) -> list[bytes]:
    return [_CONFIRM.pack(CONFIRM, command.sequence, command.multiple), b""]


def _put_reject(command: Reject) -> list[bytes]:
    return [_REJECT.pack(REJECT, command.sequence, command.multiple, command.recycle), b""]


def _put_named(kind: int, sequence: int, name: str) -> list[bytes]:
    raw = name.encode()
    return [_NAMED.pack(kind, sequence, len(raw)) + raw, b""]


def _put_lease(command: Lease) -> list[bytes]:
    return _put_named(LEASE, command.sequence, command.lease)


def _put_summon(command: Summon) -> list[bytes]:
    return _put_named(SUMMON, command.sequence, command.resource)


def _put_dismiss(command: Dismiss) -> list[bytes]:
    return _put_named(DISMISS, command.sequence, command.resource)


def _put_response(command: Response) -> list[bytes]:
    return [_HEAD.pack(RESPONSE, command.sequence), b"%03d" % command.code]


def _put_ping(command: Ping) -> list[bytes]:
    return [bytes((PING,)), b""]


def _put_pong(command: Pong) -> list[bytes]:
    return [bytes((PONG,)), b""]


_ENCODERS: Final[dict[type, Callable[[Any], list[bytes]]]] = {
    Content: _put_content,
    Confirm: _put_confirm,
    Reject: _put_reject,
    Lease: _put_lease,
    Summon: _put_summon,
    Dismiss: _put_dismiss,
    Response: _put_response,
    Ping: _put_ping,
    Pong: _put_pong,
}
_GIVE_WAY: Final = (
    struct.error,  # an integer out of range, a short string over 255 bytes
    LocalProtocolError,  # properties a field table cannot carry
    ValueError,  # text that does not encode
    TypeError,
    AttributeError,  # a value of another type than the field's
)
"""What makes a fast encoder give way to `_encode_data_general`, which says why."""


def _decode_data_general(frames: list[bytes]) -> DataCommand:
    """`decode_data` field by field: the reference, and what says why a command is ill-formed."""
    if len(frames) != 2:
        raise MTLError(f"a data command has 2 frames, not {len(frames)}")
    header, body = frames
    if not header:
        raise MTLError("empty header frame")
    kind = header[0]
    read = _Reader(header)
    command: DataCommand
    if kind == LEASE:
        command = Lease(read.integer(), read.short_string())
    elif kind == RESPONSE:
        sequence = read.integer()
        if len(body) != 3 or not body.isdigit():
            raise MTLError(f"a response code is three digits, not {body[:10]!r}")
        command = Response(sequence, int(body))
    elif kind == SUMMON:
        command = Summon(read.integer(), read.short_string())
    elif kind == DISMISS:
        command = Dismiss(read.integer(), read.short_string())
    elif kind == CONTENT:
        command = Content(read.integer(), read.short_string(), read.table(), body)
    elif kind == CONFIRM:
        command = Confirm(read.integer(), read.boolean())
    elif kind == REJECT:
        command = Reject(read.integer(), read.boolean(), read.boolean())
    elif kind == PING:
        command = Ping()
    elif kind == PONG:
        command = Pong()
    else:
        raise MTLError(f"unknown data command type {kind:#04x}")
    read.end()
    return command


def _encode_data_general(command: DataCommand) -> list[bytes]:
    """`encode_data` field by field: the reference, and what says why one cannot be sent."""
    try:
        if isinstance(command, Lease):
            return [
                bytes((LEASE,)) + _int(command.sequence) + encode_short_string(command.lease),
                b"",
            ]
        if isinstance(command, Response):
            return [bytes((RESPONSE,)) + _int(command.sequence), b"%03d" % command.code]
        if isinstance(command, Summon | Dismiss):
            kind = SUMMON if isinstance(command, Summon) else DISMISS
            return [
                bytes((kind,)) + _int(command.sequence) + encode_short_string(command.resource),
                b"",
            ]
        if isinstance(command, Content):
            header = (
                bytes((CONTENT,))
                + _int(command.sequence)
                + encode_short_string(command.resource)
                + encode_table(command.properties)
            )
            return [header, command.body]
        if isinstance(command, Confirm):
            return [bytes((CONFIRM,)) + _int(command.sequence) + bytes((command.multiple,)), b""]
        if isinstance(command, Reject):
            flags = bytes((command.multiple, command.recycle))
            return [bytes((REJECT,)) + _int(command.sequence) + flags, b""]
        if isinstance(command, Ping):
            return [bytes((PING,)), b""]
        return [bytes((PONG,)), b""]
    except FieldTableLocalError as exc:
        raise MTLLocalError(exc.reason) from None


def _int(value: int) -> bytes:
    if not 0 <= value < 2**64:
        raise MTLLocalError(f"{value} does not fit a 64-bit unsigned integer")
    return _U64.pack(value)


# --- field encodings (spec, "Field Encodings") ---------------------------------------------


def encode_integer(value: int) -> bytes:
    """An Integer: eight bytes, unsigned, network order.

    Raises:
        MTLLocalError: Out of range.
    """
    return _int(value)


def decode_integer(data: bytes, offset: int = 0) -> tuple[int, int]:
    """An Integer at ``offset``, and the offset after it.

    Raises:
        MTLError: Cut short.
    """
    if offset + 8 > len(data):
        raise MTLError("integer field cut short", where=f"byte {offset}")
    return int(_U64.unpack_from(data, offset)[0]), offset + 8


def encode_shortint(value: int) -> bytes:
    """A Shortint: two bytes, unsigned, network order.

    Raises:
        MTLLocalError: Out of range.
    """
    if not 0 <= value < 2**16:
        raise MTLLocalError(f"{value} does not fit a 16-bit unsigned shortint")
    return _U16.pack(value)


def decode_shortint(data: bytes, offset: int = 0) -> tuple[int, int]:
    """A Shortint at ``offset``, and the offset after it.

    Raises:
        MTLError: Cut short.
    """
    if offset + 2 > len(data):
        raise MTLError("shortint field cut short", where=f"byte {offset}")
    return int(_U16.unpack_from(data, offset)[0]), offset + 2


def encode_boolean(value: bool) -> bytes:
    """A Boolean: one byte, 0 or 1."""
    return b"\x01" if value else b"\x00"


def decode_boolean(data: bytes, offset: int = 0) -> tuple[bool, int]:
    """A Boolean at ``offset``, and the offset after it.

    Raises:
        MTLError: Missing, or a byte other than 0 or 1.
    """
    if offset >= len(data) or data[offset] not in (0, 1):
        raise MTLError("boolean must be one octet, 0 or 1", where=f"byte {offset}")
    return data[offset] == 1, offset + 1
