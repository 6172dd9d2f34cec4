"""DMP, the AMQP Direct Message Protocol (../shared/specs/dmp.txt), both roles.

Sans-IO: `DMPCodec` turns bytes into events and events into bytes. A DMP
connection starts with a dialog (spec, "Integration with AMQP")::

    C: "AMQP" 10 1 0 1              protocol header: id 10, instance 1, version 0.1
    S: "200 OK DMP/0.1"             short string
    C: lease                        short string
    S: "200 OK Ready to write to "somesink""   (or an error code, then close)

A short string is one length octet and up to 255 bytes. A response is a
3-digit code, a space, an indicator (``OK``, ``BAD-LEASE``...) and an
optional space and text. After the dialog, messages flow one way (to a
sink, or from a feed) as envelopes (spec, "Message envelope and format")::

    size:u32          bytes that follow, up to the end of the body
    exchange          short string
    routing key       short string
    flags:u16 props   AMQP 0-9-1 Basic content header property flags and list
    options:u8        bit 1 mandatory, bit 0 immediate
    length:u24 body   the content body

Spec ambiguity: the spec draws the body length as ``[nnn]`` and says the
envelope is "12 octets plus content header fields"; 4 + 1 + 1 + 2 + 1 + 3 =
12 makes the body length three octets (OpenAMQ wrote three as well), so a
body holds at most 16 MiB - 1. The size counts everything after itself:
exchange, routing key, flags, properties, options, body length and body.

A size of zero is a null message, a heartbeat (spec, "Heartbeating"); the
codec reports it as `Heartbeat` and adapters ignore it.

Errors raise `DMPError` with the response the server should send (the
dialog still running) or none (messages flowing: the adapter closes). The
codec is dead afterwards.

Fast paths (issue 15: the codec was most of a DMP bridge's cost per
message). A read's envelopes are decoded in one pass over the buffer, from
a memoryview (the body is the only copy), the consumed bytes dropped once;
a bare envelope (no names, no properties) by one fixed-layout unpack, one
with names or properties by `_decode_plain`; either gives way, on anything
it does not expect, to `decode_envelope`, the general decoder, which says
what is wrong. Encoding works the same way round: `encode_envelope` and
`encode_envelope_fields` (the properties a gateway sets, without building
`BasicProperties` and `Envelope`) write the properties that are set with
precompiled structs and leave anything they cannot write to the general
encoder, which raises the error. So the fast paths decide nothing: the
bytes, events and errors are the general code's (tests compare them).
"""

from __future__ import annotations

import enum
import operator
import re
import struct
from dataclasses import dataclass
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
    "DEFAULT_MAX_ENVELOPE_BYTES",
    "HEARTBEAT_BYTES",
    "MAX_BODY_BYTES",
    "NO_PROPERTIES",
    "PROTOCOL_HEADER",
    "REASONS",
    "BasicProperties",
    "Bodies",
    "DMPCodec",
    "DMPError",
    "DMPLocalError",
    "Envelope",
    "Event",
    "Heartbeat",
    "Lease",
    "ProtocolHeader",
    "Response",
    "Role",
    "decode_envelope",
    "encode_envelope",
    "encode_envelope_fields",
    "encode_response",
]

PROTOCOL_HEADER: Final = b"AMQP" + bytes((10, 1, 0, 1))
"""``AMQP``, protocol id 10, instance 1, version 0.1 (spec, the dialog)."""

REASONS: Final = {
    200: "OK",
    402: "BAD-LEASE",
    403: "NO-ACCESS",
    404: "NOT-FOUND",
    502: "SYNTAX-ERROR",
    503: "INVALID",
    530: "NOT-ALLOWED",
    540: "NOT-IMPLEMENTED",
    541: "INTERNAL-ERROR",
}
"""The response codes and their indicators (spec, "Response codes")."""

MAX_BODY_BYTES: Final = 2**24 - 1
"""A body length is three octets."""
DEFAULT_MAX_ENVELOPE_BYTES: Final = 1024 * 1024
"""Largest envelope (its size field's value) a codec accepts unless told otherwise."""

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_U64: Final = struct.Struct(">Q")
_OCTET: Final = struct.Struct(">B")
_BARE: Final = struct.Struct(">IHHI")
"""The first 12 octets of an envelope: size, both name lengths (a bare envelope's are 0),
property flags, and the options octet with the 3-octet body length after it."""
_OCTETS: Final = tuple(bytes((value,)) for value in range(256))
_RESPONSE: Final = re.compile(rb"\A([0-9]{3}) ([A-Z-]+)(?: (.*))?\Z", re.DOTALL)


class Role(enum.Enum):
    """Which end of a DMP connection a codec is."""

    SERVER = "server"
    CLIENT = "client"


# --- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProtocolHeader:
    """The client's protocol header (server role reads it; client role sends it)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease the client presents (a short string)."""

    lease: str


@dataclass(frozen=True, slots=True)
class Response:
    """A server response: code, indicator (``REASONS[code]`` by default) and text."""

    code: int
    text: str = ""
    indicator: str = ""

    @property
    def ok(self) -> bool:
        """Whether the code is 200."""
        return self.code == 200


@dataclass(frozen=True, slots=True, kw_only=True)
class BasicProperties:
    """The AMQP 0-9-1 Basic content header properties (None: absent)."""

    content_type: str | None = None
    content_encoding: str | None = None
    headers: dict[str, FieldValue] | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: int | None = None
    type: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    cluster_id: str | None = None


NO_PROPERTIES: Final = BasicProperties()
"""No property set: what a bare envelope decodes to, this very object (``is`` tells)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """One DMP message."""

    exchange: str = ""
    routing_key: str = ""
    properties: BasicProperties = NO_PROPERTIES
    mandatory: bool = False
    immediate: bool = False
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A null message (four zero octets)."""


@dataclass(frozen=True, slots=True)
class Bodies:
    """A run of bare envelopes read one after another: their bodies, in order.

    Bare: no exchange, no routing key, no properties, no options; each is
    ``Envelope(body=body)``. Only a codec made with ``bodies=True`` reports
    them so (a sink takes nothing else from them, and is spared an object
    per message); any other envelope, and a null message, ends the run.
    """

    bodies: list[bytes]


Event = ProtocolHeader | Lease | Response | Envelope | Heartbeat | Bodies
HEARTBEAT_BYTES: Final = b"\0\0\0\0"


class DMPError(RemoteProtocolError):
    """The peer broke the protocol; ``response`` is what a server answers (None: close)."""

    def __init__(
        self, reason: str, *, response: Response | None = None, kind: str = "malformed"
    ) -> None:
        super().__init__(
            reason,
            reply=encode_response(response) if response is not None else None,
            kind=kind,
        )
        self.response = response


class DMPLocalError(LocalProtocolError):
    """A value DMP cannot carry."""


# --- properties ---------------------------------------------------------------------------

# (attribute, kind): flag bits from 15 down, in list order (AMQP 0-9-1, class basic).
_PROPERTIES: Final = (
    ("content_type", "shortstr"),
    ("content_encoding", "shortstr"),
    ("headers", "table"),
    ("delivery_mode", "octet"),
    ("priority", "octet"),
    ("correlation_id", "shortstr"),
    ("reply_to", "shortstr"),
    ("expiration", "shortstr"),
    ("message_id", "shortstr"),
    ("timestamp", "timestamp"),
    ("type", "shortstr"),
    ("user_id", "shortstr"),
    ("app_id", "shortstr"),
    ("cluster_id", "shortstr"),
)

_PROPERTY_NAMES: Final = tuple(name for name, _kind in _PROPERTIES)
_FLAG_OF: Final = {name: 1 << (15 - index) for index, name in enumerate(_PROPERTY_NAMES)}
_all_properties: Final = operator.attrgetter(*_PROPERTY_NAMES)


def _encode_properties(properties: BasicProperties) -> bytes:
    flags = 0
    parts: list[bytes] = []
    for index, (name, kind) in enumerate(_PROPERTIES):
        value = getattr(properties, name)
        if value is None:
            continue
        flags |= 1 << (15 - index)
        if kind == "shortstr":
            parts.append(encode_short_string(value))
        elif kind == "octet":
            if not 0 <= value <= 255:
                raise DMPLocalError(f"{name} is an octet, not {value}")
            parts.append(bytes((value,)))
        elif kind == "timestamp":
            if not 0 <= value < 2**64:
                raise DMPLocalError(f"timestamp {value} does not fit 64 bits")
            parts.append(_U64.pack(value))
        else:
            parts.append(encode_table(value))
    return _U16.pack(flags) + b"".join(parts)


def _decode_properties(data: bytes, pos: int, end: int) -> tuple[BasicProperties, int]:
    if pos + 2 > end:
        raise _syntax("property flags cut short")
    (flags,) = _U16.unpack_from(data, pos)
    pos += 2
    if not flags:
        return NO_PROPERTIES, pos  # the common bare envelope: no per-field loop
    if flags & 1:
        raise _syntax("property flags continue into a second word, which Basic never uses")
    if flags & 0b11:
        raise _syntax(f"unknown property flag bits {flags & 0b11:#x}")
    values: dict[str, object] = {}
    for index, (name, kind) in enumerate(_PROPERTIES):
        if not flags & (1 << (15 - index)):
            continue
        if kind == "shortstr":
            if pos >= end or pos + 1 + data[pos] > end:
                raise _syntax(f"property {name} cut short")
            raw = data[pos + 1 : pos + 1 + data[pos]]
            pos += 1 + data[pos]
            values[name] = _text(raw, name)
        elif kind == "octet":
            if pos >= end:
                raise _syntax(f"property {name} cut short")
            values[name] = data[pos]
            pos += 1
        elif kind == "timestamp":
            if pos + 8 > end:
                raise _syntax(f"property {name} cut short")
            values[name] = _U64.unpack_from(data, pos)[0]
            pos += 8
        else:
            try:
                values[name], pos = decode_table(memoryview(data)[:end], pos)
            except FieldTableError as exc:
                raise _syntax(f"headers table: {exc}") from None
    return BasicProperties(**values), pos  # type: ignore[arg-type]


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _syntax(f"{what} is not UTF-8") from None


def _syntax(reason: str) -> DMPError:
    return DMPError(reason, kind="malformed")


# --- encoding ------------------------------------------------------------------------------


def encode_response(response: Response) -> bytes:
    """A response as the short string the server writes."""
    indicator = response.indicator or REASONS.get(response.code, "ERROR")
    text = f"{response.code:03d} {indicator}"
    if response.text:
        text += f" {response.text}"
    data = text.encode("utf-8")
    if len(data) > 255:  # cut the explanation, never the code
        data = data[:255]
    return bytes((len(data),)) + data


def encode_envelope(envelope: Envelope) -> bytes:
    """One envelope with its size in front.

    Raises:
        DMPLocalError: A name over 255 bytes, a body over 16 MiB - 1, or a
            property that cannot be carried.
    """
    body = envelope.body
    length = len(body)
    properties = envelope.properties
    if length <= MAX_BODY_BYTES:
        try:
            exchange = envelope.exchange.encode()
            routing_key = envelope.routing_key.encode()
            head = (
                _OCTETS[len(exchange)]
                + exchange
                + _OCTETS[len(routing_key)]
                + routing_key
                + (b"\0\0" if properties is NO_PROPERTIES else _put_properties(properties))
            )
            options = (envelope.mandatory << 1) | envelope.immediate
            tail = _U32.pack(options << 24 | length)
            return b"".join((_U32.pack(len(head) + 4 + length), head, tail, body))
        except _GIVE_WAY:
            pass
    return _encode_envelope_general(envelope)


def encode_envelope_fields(
    exchange: str,
    routing_key: str,
    *,
    body: bytes,
    message_id: str | None = None,
    timestamp: int | None = None,
    headers: dict[str, FieldValue] | None = None,
    app_id: str | None = None,
) -> bytes:
    """The envelope of these fields, as `encode_envelope` writes it, without building one.

    The bytes of ``encode_envelope(Envelope(exchange=exchange,
    routing_key=routing_key, properties=BasicProperties(message_id=...,
    timestamp=..., headers=..., app_id=...), body=body))``: what a gateway
    sets on the envelopes it writes, minus two frozen dataclasses a message.

    Raises:
        DMPLocalError: As `encode_envelope`.
    """
    length = len(body)
    if length <= MAX_BODY_BYTES:
        try:
            exchange_bytes = exchange.encode()
            key = routing_key.encode()
            if (
                headers is None
                and message_id is not None
                and timestamp is not None
                and app_id is not None
            ):
                # What a gateway's feed writes for a message without sender or headers.
                raw_id = message_id.encode()
                raw_app = app_id.encode()
                head = b"".join(
                    (
                        _OCTETS[len(exchange_bytes)],
                        exchange_bytes,
                        _OCTETS[len(key)],
                        key,
                        _ID_TIME_APP,
                        _OCTETS[len(raw_id)],
                        raw_id,
                        _U64.pack(timestamp),
                        _OCTETS[len(raw_app)],
                        raw_app,
                    )
                )
                return b"".join((_U32.pack(len(head) + 4 + length), head, _U32.pack(length), body))
            head = _OCTETS[len(exchange_bytes)] + exchange_bytes + _OCTETS[len(key)] + key
            # Basic's property list order: headers, message-id, timestamp, app-id.
            flags = 0
            values = b""
            if headers is not None:
                flags = _HEADERS_FLAG
                values = encode_table(headers)
            if message_id is not None:
                flags |= _MESSAGE_ID_FLAG
                raw = message_id.encode()
                values += _OCTETS[len(raw)] + raw
            if timestamp is not None:
                flags |= _TIMESTAMP_FLAG
                values += _U64.pack(timestamp)
            if app_id is not None:
                flags |= _APP_ID_FLAG
                raw = app_id.encode()
                values += _OCTETS[len(raw)] + raw
            head += _U16.pack(flags) + values
            return b"".join((_U32.pack(len(head) + 4 + length), head, _U32.pack(length), body))
        except _GIVE_WAY:
            pass
    return _encode_envelope_general(
        Envelope(
            exchange=exchange,
            routing_key=routing_key,
            properties=BasicProperties(
                message_id=message_id, timestamp=timestamp, headers=headers, app_id=app_id
            ),
            body=body,
        )
    )


_GIVE_WAY: Final = (
    IndexError,  # a short string over 255 bytes (no octet for its length)
    struct.error,  # a value out of its field's range
    LocalProtocolError,  # a headers table that cannot be carried
    ValueError,  # text that does not encode
    TypeError,
    AttributeError,  # a value of another type than the field's
)
"""What makes a fast encoder give way to `_encode_envelope_general`, which says why."""
_HEADERS_FLAG: Final = _FLAG_OF["headers"]
_MESSAGE_ID_FLAG: Final = _FLAG_OF["message_id"]
_TIMESTAMP_FLAG: Final = _FLAG_OF["timestamp"]
_APP_ID_FLAG: Final = _FLAG_OF["app_id"]
_ID_TIME_APP: Final = _U16.pack(_MESSAGE_ID_FLAG | _TIMESTAMP_FLAG | _APP_ID_FLAG)


def _put_short_string(text: str) -> bytes:
    data = text.encode()
    return _OCTETS[len(data)] + data


# How each property is written (any error: give way), in Basic's order.
_PUTS: Final = tuple(
    {
        "shortstr": _put_short_string,
        "octet": _OCTET.pack,
        "timestamp": _U64.pack,
        "table": encode_table,
    }[kind]
    for _name, kind in _PROPERTIES
)
_FLAGS: Final = tuple(_FLAG_OF[name] for name in _PROPERTY_NAMES)


def _put_properties(properties: BasicProperties) -> bytes:
    """Flags and the properties that are set (may raise any of `_GIVE_WAY`)."""
    flags = 0
    parts = [b""]
    for index, value in enumerate(_all_properties(properties)):
        if value is not None:
            flags |= _FLAGS[index]
            parts.append(_PUTS[index](value))
    parts[0] = _U16.pack(flags)
    return b"".join(parts)


def _encode_envelope_general(envelope: Envelope) -> bytes:
    """`encode_envelope` field by field: the reference, and what says why one cannot be sent."""
    body = envelope.body
    if len(body) > MAX_BODY_BYTES:
        raise DMPLocalError(f"a DMP body holds at most {MAX_BODY_BYTES} bytes, not {len(body)}")
    try:
        head = (
            encode_short_string(envelope.exchange)
            + encode_short_string(envelope.routing_key)
            + _encode_properties(envelope.properties)
        )
    except FieldTableLocalError as exc:
        raise DMPLocalError(exc.reason) from None
    options = (envelope.mandatory << 1) | envelope.immediate
    size = len(head) + 4 + len(body)
    return b"".join((_U32.pack(size), head, bytes((options,)), len(body).to_bytes(3, "big"), body))


def decode_envelope(data: bytes) -> Envelope:
    """Decode one envelope's content (what follows its size field).

    Raises:
        DMPError: Fields that do not add up to the size, or bad values.
    """
    end = len(data)
    pos = 0
    names: list[str] = []
    for what in ("exchange", "routing key"):
        if pos >= end or pos + 1 + data[pos] > end:
            raise _syntax(f"{what} cut short")
        names.append(_text(data[pos + 1 : pos + 1 + data[pos]], what))
        pos += 1 + data[pos]
    properties, pos = _decode_properties(data, pos, end)
    if pos + 4 > end:
        raise _syntax("options and body length cut short")
    options = data[pos]
    if options & ~0b11:
        raise _syntax(f"unknown option bits {options:#04x}")
    length = int.from_bytes(data[pos + 1 : pos + 4], "big")
    pos += 4
    if pos + length != end:
        raise _syntax(f"the body length says {length} bytes but the size leaves {end - pos}")
    return Envelope(
        exchange=names[0],
        routing_key=names[1],
        properties=properties,
        mandatory=bool(options & 0b10),
        immediate=bool(options & 0b01),
        body=data[pos:end],
    )


# --- fast decoding ----------------------------------------------------------------------

_new: Final = object.__new__
# A frozen dataclass's __init__ sets each field with object.__setattr__; the
# decoders set the slots directly, every field given: the same object, made
# at half the cost (a test checks these are all of the fields).
_ENVELOPE_FIELDS: Final = (
    "exchange",
    "routing_key",
    "properties",
    "mandatory",
    "immediate",
    "body",
)
_set_exchange, _set_routing_key, _set_properties, _set_mandatory, _set_immediate, _set_body = (
    Envelope.__dict__[name].__set__ for name in _ENVELOPE_FIELDS
)
_PROPERTY_SETTERS: Final = tuple(BasicProperties.__dict__[name].__set__ for name in _PROPERTY_NAMES)
_KINDS: Final = tuple(kind for _name, kind in _PROPERTIES)
_OPTIONS: Final = ((False, False), (False, True), (True, False), (True, True))
"""(mandatory, immediate) by the options octet."""
_HEARTBEAT: Final = Heartbeat()
_PRESENT: Final[dict[int, tuple[tuple[int, str], ...]]] = {}
"""Property flags to the (index, kind) of each property they say is present."""


def _new_envelope(
    exchange: str,
    routing_key: str,
    properties: BasicProperties,
    mandatory: bool,
    immediate: bool,
    body: bytes,
) -> Envelope:
    """``Envelope(exchange=exchange, ...)``, made through the slots."""
    envelope: Envelope = _new(Envelope)
    _set_exchange(envelope, exchange)
    _set_routing_key(envelope, routing_key)
    _set_properties(envelope, properties)
    _set_mandatory(envelope, mandatory)
    _set_immediate(envelope, immediate)
    _set_body(envelope, body)
    return envelope


def _decode_plain(data: memoryview, start: int, end: int) -> Envelope | None:
    """The envelope in ``data[start:end]`` if it is well-formed, else None.

    Reads what `decode_envelope` reads, from the buffer itself; anything it
    does not accept is left to `decode_envelope` to accept or refuse.
    """
    size = data[start]
    pos = start + 1 + size
    if pos >= end:
        return None
    try:
        exchange = str(data[start + 1 : pos], "utf-8") if size else ""
        size = data[pos]
        stop = pos + 1 + size
        if stop + 6 > end:  # the flags, the options and the body length
            return None
        routing_key = str(data[pos + 1 : stop], "utf-8") if size else ""
    except UnicodeDecodeError:
        return None
    flags = data[stop] << 8 | data[stop + 1]
    pos = stop + 2
    properties = NO_PROPERTIES
    if flags:
        if flags & 0b11:
            return None
        decoded = _plain_properties(data, start, pos, end, flags)
        if decoded is None:
            return None
        properties, pos = decoded
        if pos + 4 > end:
            return None
    (tail,) = _U32.unpack_from(data, pos)
    if tail >= 0x4000000 or pos + 4 + (tail & 0xFFFFFF) != end:  # unknown option bits
        return None
    mandatory, immediate = _OPTIONS[tail >> 24]
    return _new_envelope(
        exchange, routing_key, properties, mandatory, immediate, bytes(data[pos + 4 : end])
    )


def _plain_properties(
    data: memoryview, start: int, pos: int, end: int, flags: int
) -> tuple[BasicProperties, int] | None:
    values: list[object] = [None] * len(_PROPERTIES)
    present = _PRESENT.get(flags)
    if present is None:  # at most 2**14 flag words: bounded
        present = _PRESENT[flags] = tuple(
            (index, kind) for index, kind in enumerate(_KINDS) if flags & _FLAGS[index]
        )
    for index, kind in present:
        if kind == "shortstr":
            if pos >= end:
                return None
            stop = pos + 1 + data[pos]
            if stop > end:
                return None
            try:
                values[index] = str(data[pos + 1 : stop], "utf-8")
            except UnicodeDecodeError:
                return None
            pos = stop
        elif kind == "octet":
            if pos >= end:
                return None
            values[index] = data[pos]
            pos += 1
        elif kind == "timestamp":
            if pos + 8 > end:
                return None
            values[index] = _U64.unpack_from(data, pos)[0]
            pos += 8
        else:
            try:  # offsets within the envelope, as decode_envelope's
                values[index], pos = decode_table(data[start:end], pos - start)
            except FieldTableError:
                return None
            pos += start
    properties: BasicProperties = _new(BasicProperties)
    for setter, value in zip(_PROPERTY_SETTERS, values, strict=False):  # as long, both
        setter(properties, value)
    return properties, pos


# --- the codec ---------------------------------------------------------------------------


class DMPCodec:
    """One end of one DMP connection.

    Args:
        role: `Role.SERVER` reads the header, the lease, then envelopes;
            `Role.CLIENT` reads two responses, then envelopes.
        max_envelope_bytes: Largest envelope size accepted.
        bodies: Report runs of bare envelopes as `Bodies`.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES,
        bodies: bool = False,
    ) -> None:
        self.role = role
        self.max_envelope_bytes = max_envelope_bytes
        self._bodies = bodies
        self._buffer = bytearray()
        self._stage = 0  # server: 0 header, 1 lease, 2 envelopes; client: 0, 1 responses, 2
        self._dead = False

    @property
    def flowing(self) -> bool:
        """Whether the dialog is over and envelopes flow."""
        return self._stage == 2

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete header, lease or envelope; zero exactly between them.

        Lets the adapter time out a frame that never completes.
        """
        return len(self._buffer)

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes; return the events they complete.

        Raises:
            DMPError: The peer broke the protocol; the codec is dead.
        """
        if self._dead:
            raise DMPError("the connection already failed", kind="dead")
        events: list[Event] = []
        try:
            if self._stage < 2 or self._buffer:
                self._buffer += data
                while self._stage < 2:
                    event = self._dialog()
                    if event is None:
                        return events
                    events.append(event)
                self._envelopes(events, self._buffer)
            else:  # nothing held: read the envelopes from the bytes as they came
                self._envelopes(events, data)
        except DMPError as exc:
            self._dead = True
            exc.events = list(events)
            raise
        return events

    def _dialog(self) -> Event | None:
        buffer = self._buffer
        if self._stage == 0 and self.role is Role.SERVER:
            if len(buffer) < len(PROTOCOL_HEADER):
                if not PROTOCOL_HEADER.startswith(bytes(buffer)):
                    raise self._bad_header()
                return None
            if bytes(buffer[: len(PROTOCOL_HEADER)]) != PROTOCOL_HEADER:
                raise self._bad_header()
            del buffer[: len(PROTOCOL_HEADER)]
            self._stage = 1
            return ProtocolHeader()
        if not buffer or len(buffer) < 1 + buffer[0]:
            return None
        raw = bytes(buffer[1 : 1 + buffer[0]])
        del buffer[: 1 + len(raw)]
        self._stage += 1
        if self.role is Role.SERVER:
            return Lease(self._lease(raw))
        return self._response(raw)

    def _envelopes(self, events: list[Event], source: bytes | bytearray) -> None:
        """Decode every whole envelope in ``source`` (the buffer, or a read's bytes).

        What is read is dropped from the buffer once, at the end; what is
        left of a read's bytes is kept in the buffer.
        """
        have = len(source)
        limit = self.max_envelope_bytes
        pos = 0
        add = events.append
        head = _BARE.unpack_from
        view = memoryview(source)
        held = type(source) is bytearray  # its slices are bytearrays: bodies copied from the view
        bodies = self._bodies
        run: list[bytes] | None = None  # the bodies of the run of bare envelopes being read
        try:
            while True:
                left = have - pos
                if left >= 12:
                    size, names, flags, tail = head(source, pos)
                elif left >= 4:  # a heartbeat, or too short to be whole and bare
                    (size,) = _U32.unpack_from(source, pos)
                    names = flags = tail = 1
                else:
                    break
                if not size:
                    add(_HEARTBEAT)
                    run = None
                    pos += 4
                    continue
                if size > limit:
                    raise DMPError(
                        f"envelope of {size} bytes, over the limit of {limit}", kind="too-large"
                    )
                end = pos + 4 + size
                if end > have:
                    break
                # Bare: no names, no properties, known options, the body to the end.
                if not names and not flags and tail < 0x4000000 and tail & 0xFFFFFF == size - 8:
                    body: bytes = (
                        bytes(view[pos + 12 : end]) if held else source[pos + 12 : end]  # type: ignore[assignment]
                    )
                    if bodies and tail < 0x1000000:  # no options either
                        if run is None:
                            run = []
                            add(Bodies(run))
                        run.append(body)
                    else:
                        mandatory, immediate = _OPTIONS[tail >> 24]
                        add(_new_envelope("", "", NO_PROPERTIES, mandatory, immediate, body))
                        run = None
                else:
                    envelope = _decode_plain(view, pos + 4, end)
                    if envelope is None:  # the general decoder says what is wrong
                        envelope = decode_envelope(bytes(view[pos + 4 : end]))
                    add(envelope)
                    run = None
                pos = end
        finally:
            view.release()
        if held:
            if pos:
                del self._buffer[:pos]
        elif pos < have:
            self._buffer += source[pos:] if pos else source

    def _bad_header(self) -> DMPError:
        return DMPError(
            "not a DMP protocol header (want AMQP 10 1 0 1)",
            response=Response(503, "expected the DMP protocol header AMQP 10.1.0.1"),
            kind="bad-header",
        )

    def _lease(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DMPError(
                "lease is not UTF-8",
                response=Response(502, "the lease is not UTF-8 text"),
                kind="malformed",
            ) from None

    def _response(self, raw: bytes) -> Response:
        match = _RESPONSE.match(raw)
        if match is None:
            raise DMPError(f"not a DMP response: {raw[:60]!r}", kind="malformed")
        code, indicator, text = match.groups()
        return Response(
            int(code), (text or b"").decode("utf-8", "replace"), indicator.decode("ascii")
        )

    def send(self, event: Event) -> bytes:
        """Encode an event this role sends.

        Raises:
            DMPLocalError: This role does not send it, or it cannot be carried.
        """
        if isinstance(event, Envelope):
            return encode_envelope(event)
        if isinstance(event, Heartbeat):
            return HEARTBEAT_BYTES
        if self.role is Role.SERVER and isinstance(event, Response):
            return encode_response(event)
        if self.role is Role.CLIENT and isinstance(event, ProtocolHeader):
            return PROTOCOL_HEADER
        if self.role is Role.CLIENT and isinstance(event, Lease):
            try:
                return encode_short_string(event.lease)
            except FieldTableLocalError as exc:
                raise DMPLocalError(exc.reason) from None
        raise DMPLocalError(f"the {self.role.value} does not send {type(event).__name__}")
