"""Stream entries to and from the canonical `Message`: pure functions.

A stream stores whatever bytes a publisher sent: an AMQP 1.0 message (Java,
.NET and Go clients, rstream's ``AMQPMessage``, RabbitMQ's own AMQP to
stream conversion) or raw bytes (rstream's ``Producer.send(b"...")``). See
docs/stream-protocol-notes.md, section 12, and `gateway.codecs.amqp`.

Entry to message (`message_from_entry`):

=========================== ===================================================
Message field               taken from
=========================== ===================================================
``address``                 the stream's name: the stream is where the
                            message is now; with ``address_from_to`` (entries
                            of the gateway's own durable-route streams), the
                            properties' ``to`` when it is set
``body``                    data sections, joined; an amqp-value string as
                            UTF-8, an amqp-value binary as is, any other
                            amqp-value (or amqp-sequence sections, joined) as
                            its AMQP encoding; no body section: empty
``id``                      properties.message-id: a string as is, a ulong in
                            decimal, a uuid in its canonical form, a binary
                            as UTF-8 (undecodable bytes as surrogate escapes);
                            without one ``<stream>:<offset>`` when the offset
                            is known, so that a redelivered entry keeps its
                            id, else a fresh id
``sender``                  application property ``x-gateway-sender``
``recipients``              application property ``x-gateway-recipients``:
                            comma-separated, each with ``%`` and ``,``
                            escaped as ``%25`` and ``%2C``
``timestamp``               application property ``x-gateway-timestamp``
                            (seconds, a double; an AMQP timestamp counts as
                            milliseconds), else the entry's (chunk) timestamp
``headers``                 the other application properties: strings,
                            binaries, booleans, integers and floats as they
                            are (AMQP's typed variants as the plain Python
                            type: a timestamp as its milliseconds, a symbol
                            as a string), a null dropped, anything else (a
                            uuid, a described value) as its text
=========================== ===================================================

An entry that does not start like an AMQP message
(`gateway.codecs.amqp.looks_like_amqp`), or that starts like one but does
not decode, is raw: its bytes are the body, with no headers, the id as
above and the entry's timestamp. Header, annotations, footer and the other
properties are not carried into the message.

Message to entry (`entry_from_message`) writes an AMQP message that any
stream client reads natively:

- properties: message-id = ``id`` (a string; a binary when the id holds
  surrogate escapes, as ids decoded from bytes do), to = ``address`` (AMQP's
  field for the address a message is bound for), creation-time =
  ``timestamp`` in milliseconds when it is set (not 0);
- application properties: the headers, then ``x-gateway-sender`` when
  there is a sender, ``x-gateway-recipients`` when there are recipients and
  ``x-gateway-timestamp`` when the timestamp is set; headers with these
  three names are replaced by the message's own fields;
- one data section with the body, even when it is empty.

The entries of a durable route's stream also keep the message's `Origin`
(where a consumer read it; ``origin=True``): application property
``x-gateway-origin``, ``<offset> <reader>``, read back only with
``address_from_to`` (as their entries are read), else an ordinary header.

A route that writes a message into a stream counts the write as one hop
(`gateway.core.internal`): it passes ``hops``, which is written as the
``x-gateway-hops`` application property (a small integer) in place of the
header of that name.

The way back restores body, id, sender, recipients, headers and timestamp
exactly (the timestamp travels as a double, so no precision is lost; an
unset timestamp, 0, comes back as the entry's own).
`entry_from_message` never fails: what AMQP cannot carry is adapted (an
integer outside the 64-bit ranges becomes its decimal text; a string that
is not valid Unicode, with lone surrogates, becomes its surrogate-escaped
UTF-8 bytes, or, as a key or address, has them replaced by ``?``).
"""

from __future__ import annotations

import re
import struct
import uuid
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from gateway.codecs.amqp import (
    AMQPDecodeError,
    AMQPMessage,
    AMQPSequence,
    AMQPValue,
    Body,
    Properties,
    Timestamp,
    Value,
    decode_message,
    encode_message,
    encode_value,
    looks_like_amqp,
)
from gateway.codecs.osiris import FrozenEntries
from gateway.core.internal import HOPS_HEADER
from gateway.core.message import HeaderValue, Message, Origin, new_message_id

__all__ = [
    "ORIGIN_HEADER",
    "RECIPIENTS_HEADER",
    "SENDER_HEADER",
    "TIMESTAMP_HEADER",
    "EntryEncoder",
    "durable_entries",
    "durable_entry",
    "entry_from_message",
    "message_from_entry",
]

SENDER_HEADER: Final = "x-gateway-sender"
"""The application property that carries `Message.sender`."""

RECIPIENTS_HEADER: Final = "x-gateway-recipients"
"""The application property that carries `Message.recipients`, comma-separated."""

TIMESTAMP_HEADER: Final = "x-gateway-timestamp"
"""The application property that carries `Message.timestamp`, in seconds."""

ORIGIN_HEADER: Final = "x-gateway-origin"
"""The application property that keeps `Message.origin` in a durable route's entries:
``<offset> <reader>``."""

_RESERVED: Final = frozenset({SENDER_HEADER, RECIPIENTS_HEADER, TIMESTAMP_HEADER})
_ESCAPES: Final = {"%": "%25", ",": "%2C"}
_ESCAPED: Final = re.compile(r"[%,]")
_UNESCAPED: Final = re.compile(r"%(25|2C)", re.IGNORECASE)
_LONG_MIN: Final = -(2**63)
_ULONG_MAX: Final = 2**64 - 1


# --- entry to message ---------------------------------------------------------------


def message_from_entry(
    entry: bytes | memoryview,
    *,
    stream: str,
    timestamp: float,
    offset: int | None = None,
    address_from_to: bool = False,
    origin: Origin | None = None,
) -> Message:
    """Map a stream entry to a message bound for the stream's name.

    Args:
        entry: The entry's bytes: an AMQP 1.0 message or raw bytes.
        stream: The stream's name, the message's address.
        timestamp: When the entry was stored (its chunk's timestamp), in
            seconds; the message's timestamp unless the entry carries one.
        offset: The entry's offset, if known: the id of an entry without
            a message-id is ``<stream>:<offset>``.
        address_from_to: Take the address from the properties' ``to``, when
            set, instead of the stream's name: for streams that keep
            messages bound elsewhere (durable routes), written by
            `entry_from_message`; and the origin (``x-gateway-origin``)
            that `entry_from_message` kept with ``origin=True``.
        origin: Where a consumer read the entry, if it did (`Origin`).

    Returns:
        The message (see the module docstring for the mapping).
    """
    if looks_like_amqp(entry):
        try:
            decoded = decode_message(entry)
        except AMQPDecodeError:
            pass  # raw bytes that happen to start like a section
        else:
            address = stream
            if address_from_to and decoded.properties is not None:
                to = decoded.properties.to
                address = stream if to is None else to
            return _from_amqp(
                decoded, address, timestamp, _fallback_id(stream, offset), origin, address_from_to
            )
    return Message(
        body=bytes(entry),
        address=stream,
        id=_fallback_id(stream, offset),
        timestamp=timestamp,
        origin=origin,
    )


def _fallback_id(stream: str, offset: int | None) -> str:
    return new_message_id() if offset is None else f"{stream}:{offset}"


def _from_amqp(
    decoded: AMQPMessage,
    address: str,
    timestamp: float,
    fallback_id: str,
    origin: Origin | None,
    kept_origin: bool,
) -> Message:
    message_id = decoded.properties.message_id if decoded.properties is not None else None
    headers: dict[str, HeaderValue] = {}
    sender: str | None = None
    recipients: tuple[str, ...] = ()
    for key, value in (decoded.application_properties or {}).items():
        if key in _RESERVED:
            if key == SENDER_HEADER:
                sender = _text(value)
            elif key == RECIPIENTS_HEADER:
                recipients = _split_recipients(_text(value))
            else:
                timestamp = _seconds(value, timestamp)
        elif value is not None:
            headers[key] = _header_value(value)
    if kept_origin:
        kept = headers.pop(ORIGIN_HEADER, None)
        if isinstance(kept, str):
            origin = _origin(kept) or origin
    return Message(
        body=_body_bytes(decoded.body),
        address=address,
        id=fallback_id if message_id is None else _text(message_id),
        sender=sender,
        recipients=recipients,
        headers=headers,
        timestamp=timestamp,
        origin=origin,
    )


def _origin(text: str) -> Origin | None:
    """An origin as ``x-gateway-origin`` keeps it (``<offset> <reader>``), if it is one."""
    offset, _, reader = text.partition(" ")
    if not reader or not offset.isdigit():
        return None
    return Origin(reader, int(offset))


def _text(value: Value) -> str:
    """A value as text: strings as is, binaries decoded losslessly, the rest as text."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return str(value)


def _split_recipients(joined: str) -> tuple[str, ...]:
    if "%" not in joined:
        return tuple(joined.split(","))
    return tuple(
        _UNESCAPED.sub(lambda match: "%" if match[1] == "25" else ",", item)
        for item in joined.split(",")
    )


def _seconds(value: Value, default: float) -> float:
    if isinstance(value, Timestamp):
        return value / 1000
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default  # not a time: the entry's own timestamp stands


def _header_value(value: Value) -> HeaderValue:
    """Map an application property value to a header value (plain Python types)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, bytes):
        return bytes(value)
    return str(value)


def _body_bytes(body: Body) -> bytes:
    if isinstance(body, bytes):
        return body
    if body is None:
        return b""
    if isinstance(body, AMQPValue):
        value = body.value
        if isinstance(value, str):
            return value.encode("utf-8")
        if type(value) is bytes:
            return value
        return encode_value(value)
    if isinstance(body, AMQPSequence):
        return b"".join(encode_value(section) for section in body.sections)
    raise AssertionError(f"unknown body {body!r}")  # pragma: no cover - Body is exhaustive


# --- message to entry ---------------------------------------------------------------


def entry_from_message(message: Message, hops: int | None = None, origin: bool = False) -> bytes:
    """Map a message to the AMQP 1.0 entry a stream stores.

    Messages whose texts are all short ASCII strings and whose other
    header values are small integers (the usual case) are written by a
    direct encoder; the others go through
    `gateway.codecs.amqp.encode_message`. Both write the same sections.

    Args:
        message: The message.
        hops: Written as the ``x-gateway-hops`` header instead of the
            message's own, if given (a route's write into a stream).
        origin: Keep the message's origin, if it has one, as
            ``x-gateway-origin`` (a durable route's entries: where their
            consumer read them).

    Returns:
        The entry's bytes (see the module docstring for the mapping).
    """
    if origin and message.origin is not None:
        kept = f"{message.origin.offset} {message.origin.reader}"
        headers = {key: value for key, value in message.headers.items() if key != ORIGIN_HEADER}
        headers[ORIGIN_HEADER] = kept
        message = attrs.evolve(message, headers=headers)
    fast = _ascii_entry(message, hops)
    return fast if fast is not None else _general_entry(message, hops)


def durable_entry(message: Message) -> bytes:
    """The entry a durable route commits: `entry_from_message`, keeping the origin."""
    return entry_from_message(message, origin=True)


def durable_entries(messages: Sequence[Message]) -> FrozenEntries:
    """The entries a durable route commits for a batch: `durable_entry` of each.

    A batch (one read) usually shares all but its messages' ids and bodies:
    an `EntryEncoder` writes what they share once. Messages with an origin
    (what a consumer read) are written one by one. All are ``bytes``: the
    log keeps them without asking each (`FrozenEntries`).
    """
    encoder = EntryEncoder()
    return FrozenEntries(
        [
            encoder.entry(message) if message.origin is None else durable_entry(message)
            for message in messages
        ]
    )


_NULL: Final = b"\x40"
_I64: Final = struct.Struct(">q")
_F64: Final = struct.Struct(">d")
_U32: Final = struct.Struct(">I")
_PROPERTIES: Final = b"\x00\x53\x73"
_APPLICATION_PROPERTIES: Final = b"\x00\x53\x74"
_SMALL_COMPOUND: Final = struct.Struct(">3sBBB")
"""Descriptor, list8/map8 code, size, count."""
_LARGE_COMPOUND: Final = struct.Struct(">3sBII")
"""Descriptor, list32/map32 code, size, count."""
_STR8_HEADS: Final = tuple(b"\xa1" + bytes((length,)) for length in range(256))
"""``str8`` constructor and length byte, by length."""
_DATA8_HEADS: Final = tuple(b"\x00\x53\x75\xa0" + bytes((length,)) for length in range(256))
"""A data section with a ``vbin8`` body, by length."""
_DATA32_HEAD: Final = b"\x00\x53\x75\xb0"
_CREATION_TIME: Final = _NULL * 6 + b"\x83"
"""The properties between ``to`` and creation-time (all null), then a timestamp's code."""
_CREATION_TIME_BYTES: Final = len(_CREATION_TIME) + 8


def _key(name: str) -> bytes:
    return _STR8_HEADS[len(name)] + name.encode("ascii")


_SENDER_KEY: Final = _key(SENDER_HEADER)
_RECIPIENTS_KEY: Final = _key(RECIPIENTS_HEADER)
_TIMESTAMP_PAIR: Final = _key(TIMESTAMP_HEADER) + b"\x82"
"""The timestamp header's key and a double's code."""
_TIMESTAMP_PAIR_BYTES: Final = len(_TIMESTAMP_PAIR) + 8
_SMALL_INTS: Final = tuple(b"\x54" + bytes((value & 0xFF,)) for value in range(-128, 128))
"""An AMQP ``smallint`` by its value plus 128 (the general encoder's choice for these)."""
_HOPS_KEY: Final = _key(HOPS_HEADER)


def _compound_head(section: bytes, short: int, long: int, size: int, count: int) -> bytes:
    """A described list or map's head, its 8-bit form when it fits, for ``size`` bytes of items."""
    if size + 1 < 256 and count < 256:
        return _SMALL_COMPOUND.pack(section, short, size + 1, count)
    return _LARGE_COMPOUND.pack(section, long, size + 4, count)


def _short_ascii(text: str) -> bool:
    """Whether ``text`` fits a ``str8`` as ASCII (else the general encoder writes it)."""
    return len(text) < 256 and text.isascii()


def _ascii_entry(message: Message, hops: int | None = None) -> bytes | None:
    """The entry of a message whose texts are all short ASCII strings, else None.

    Header values may also be small integers (a hop count).
    """
    message_id = message.id
    if not (len(message_id) < 256 and message_id.isascii()):
        return None
    tail = _ascii_tail(message, hops)
    if tail is None:
        return None
    middle, size, count, _stamp_at = tail
    body = message.body
    return b"".join((
        _compound_head(_PROPERTIES, 0xC0, 0xD0, size + len(message_id), count),
        _STR8_HEADS[len(message_id)], message_id.encode("ascii"), middle,
        _DATA8_HEADS[len(body)] if len(body) < 256 else _DATA32_HEAD + _U32.pack(len(body)),
        body,
    ))  # fmt: skip


def _ascii_tail(message: Message, hops: int | None) -> tuple[bytes, int, int, int] | None:
    """What follows a direct entry's message-id up to its body, if its texts are short ASCII.

    That is the rest of the properties (user-id, to, creation-time) and the
    application properties: all that a message's address, headers, sender,
    recipients, timestamp and hop count decide, and nothing that its id or
    body do. One list of pieces and one join: an ASCII text's size is its
    length, so the compounds' sizes are added up as the pieces are listed.

    Returns:
        The bytes; the properties' size without the message-id's text (the
        id's length is added to it); the properties' count; where in the
        bytes the creation-time's 8 bytes are (-1: none; then the
        timestamp's 8 bytes end them). None when a text is not short ASCII
        or a header value is not such a text or a small integer.
    """
    address = message.address
    if not (len(address) < 256 and address.isascii()):
        return None
    heads = _STR8_HEADS
    timestamp = message.timestamp
    milliseconds = _milliseconds(timestamp) if timestamp else None
    # Properties: message-id, user-id (null), to[, six nulls, creation-time].
    parts = [_NULL, heads[len(address)], address.encode("ascii")]
    properties_size = len(address) + 5
    count = 3
    stamp_at = -1
    if milliseconds is not None:
        stamp_at = sum(map(len, parts)) + len(_CREATION_TIME)
        parts += (_CREATION_TIME, _I64.pack(milliseconds))
        properties_size += _CREATION_TIME_BYTES
        count = 10
    # Application properties: the headers, then sender, recipients and timestamp.
    head_at = len(parts)
    parts.append(b"")
    size = pairs = 0
    for key, value in message.headers.items():
        if key in _RESERVED or (hops is not None and key == HOPS_HEADER):
            continue
        if not _short_ascii(key):
            return None
        if type(value) is str and _short_ascii(value):
            text = value.encode("ascii")
            parts += (heads[len(key)], key.encode("ascii"), heads[len(value)], text)
            size += len(key) + len(value) + 4
        elif type(value) is int and -128 <= value < 128:  # a hop count
            parts += (heads[len(key)], key.encode("ascii"), _SMALL_INTS[value + 128])
            size += len(key) + 4
        else:
            return None
        pairs += 1
    if hops is not None:
        if not 0 <= hops < 128:
            return None
        parts += (_HOPS_KEY, _SMALL_INTS[hops + 128])
        size += len(_HOPS_KEY) + 2
        pairs += 1
    sender = message.sender
    if sender is not None:
        if len(sender) > 255 or not sender.isascii():
            return None
        parts += (_SENDER_KEY, heads[len(sender)], sender.encode("ascii"))
        size += len(_SENDER_KEY) + 2 + len(sender)
        pairs += 1
    if message.recipients:
        joined = _join(message.recipients)
        if not _short_ascii(joined):
            return None
        parts += (_RECIPIENTS_KEY, heads[len(joined)], joined.encode("ascii"))
        size += len(_RECIPIENTS_KEY) + 2 + len(joined)
        pairs += 1
    if timestamp:
        parts += (_TIMESTAMP_PAIR, _F64.pack(float(timestamp)))
        size += _TIMESTAMP_PAIR_BYTES
        pairs += 1
    if pairs:
        parts[head_at] = _compound_head(_APPLICATION_PROPERTIES, 0xC1, 0xD1, size, 2 * pairs)
    return b"".join(parts), properties_size, count, stamp_at


class EntryEncoder:
    """Writes the entries of a run of messages, once for what they share.

    The messages of one read usually share their address, headers (the
    same mapping), sender, recipients and timestamp: everything of an entry
    but its message-id and body (`_ascii_tail`). The encoder keeps that part
    of the last message it wrote and reuses it while those fields stay the
    same; each entry is then one join of six pieces. Entries are exactly
    `entry_from_message`'s.
    """

    __slots__ = (
        "_address",
        "_count",
        "_headers",
        "_heads",
        "_hops",
        "_middle",
        "_recipients",
        "_sender",
        "_size",
        "_stamp_at",
        "_timestamp",
    )

    def __init__(self) -> None:
        self._address: str | None = None
        self._headers: object = None
        self._sender: str | None = None
        self._recipients: tuple[str, ...] = ()
        self._timestamp = 0.0
        self._hops: int | None = None
        self._middle: bytes | None = None
        """What follows the message-id up to the body; None: the general encoder's."""
        self._size = 0
        self._count = 0
        self._stamp_at = -1
        """Where the middle's creation-time is (its timestamp ends it); -1: it has none."""
        self._heads: dict[int, bytes] = {}
        """The bytes before the message-id's text (the properties' head, the id's
        ``str8`` head), by the id's length: ids keep their length for long runs."""

    def entry(self, message: Message, hops: int | None = None) -> bytes:
        """The entry of ``message`` (`entry_from_message` with ``hops``)."""
        if (
            message.headers is not self._headers  # identity: True == 1, but not on the wire
            or message.address != self._address
            or message.sender != self._sender
            or hops != self._hops
            or message.recipients != self._recipients
            # Last: only the time changed (a paced sender's reads), written in place.
            or (message.timestamp != self._timestamp and not self._restamp(message.timestamp))
        ):
            self._remember(message, hops)
        message_id = message.id
        head = self._heads.get(len(message_id))
        if head is None or not message_id.isascii():
            return self._first(message, hops)
        body = message.body
        return b"".join((
            head, message_id.encode("ascii"), self._middle,  # type: ignore[arg-type]
            _DATA8_HEADS[len(body)] if len(body) < 256 else _DATA32_HEAD + _U32.pack(len(body)),
            body,
        ))  # fmt: skip

    def _restamp(self, timestamp: float) -> bool:
        """Write another timestamp into the kept middle, if only its 16 bytes change.

        At a paced rate each read is a message of its own, with a time of its
        own, and everything else the same: the middle's creation-time and
        timestamp are rewritten in place (their sizes, so the heads, stay).

        Returns:
            False when the middle has no timestamp, or ``timestamp`` is zero or
            does not fit a creation-time: then it is worked out again.
        """
        middle, at = self._middle, self._stamp_at
        milliseconds = _milliseconds(timestamp)  # None for zero too
        if middle is None or at < 0 or milliseconds is None:
            return False
        self._middle = b"".join((
            middle[:at], _I64.pack(milliseconds), middle[at + 8 : -8], _F64.pack(float(timestamp)),
        ))  # fmt: skip
        self._timestamp = timestamp
        return True

    def _remember(self, message: Message, hops: int | None) -> None:
        """Keep what ``message``'s entry shares with those of its run."""
        self._headers = message.headers
        self._address = message.address
        self._timestamp = message.timestamp
        self._sender = message.sender
        self._hops = hops
        self._recipients = message.recipients
        self._heads = {}
        tail = _ascii_tail(message, hops)
        if tail is None:
            self._middle = None
            return
        self._middle, properties_size, count, self._stamp_at = tail
        self._size = properties_size
        self._count = count

    def _first(self, message: Message, hops: int | None) -> bytes:
        """The entry of a message whose id's length is new in its run, or not short ASCII."""
        message_id = message.id
        middle = self._middle
        if middle is None or len(message_id) > 255 or not message_id.isascii():
            return _general_entry(message, hops)
        head = self._heads[len(message_id)] = (
            _compound_head(_PROPERTIES, 0xC0, 0xD0, self._size + len(message_id), self._count)
            + _STR8_HEADS[len(message_id)]
        )
        body = message.body
        return b"".join((
            head, message_id.encode("ascii"), middle,
            _DATA8_HEADS[len(body)] if len(body) < 256 else _DATA32_HEAD + _U32.pack(len(body)),
            body,
        ))  # fmt: skip


def _general_entry(message: Message, hops: int | None = None) -> bytes:
    """The entry of any message, through the general AMQP encoder."""
    properties = Properties(
        message_id=_wire_text(message.id),
        to=_valid_text(message.address),
        creation_time=_milliseconds(message.timestamp),
    )
    application_properties: dict[str, Value] = {}
    for key, value in message.headers.items():
        if key not in _RESERVED and (hops is None or key != HOPS_HEADER):
            application_properties[_valid_text(key)] = _wire_value(value)
    if hops is not None:
        application_properties[HOPS_HEADER] = hops
    if message.sender is not None:
        application_properties[SENDER_HEADER] = _wire_text(message.sender)
    if message.recipients:
        application_properties[RECIPIENTS_HEADER] = _wire_text(_join(message.recipients))
    if message.timestamp:
        application_properties[TIMESTAMP_HEADER] = float(message.timestamp)
    return encode_message(
        AMQPMessage(
            properties=properties,
            application_properties=application_properties or None,
            body=message.body,
        )
    )


def _join(recipients: Iterable[str]) -> str:
    return ",".join(
        _ESCAPED.sub(lambda match: _ESCAPES[match[0]], item) if "%" in item or "," in item else item
        for item in recipients
    )


def _milliseconds(seconds: float) -> int | None:
    """A timestamp in whole milliseconds for creation-time, if it is set and fits."""
    milliseconds = seconds * 1000
    if not milliseconds or not _LONG_MIN <= milliseconds < -_LONG_MIN:  # NaN fails too
        return None
    return round(milliseconds)


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _wire_text(text: str) -> str | bytes:
    """Text as an AMQP string, or as its escaped bytes when it is not valid Unicode.

    Strings decoded from bytes with ``surrogateescape`` (QMQP ids and
    envelopes) go as binaries and decode back to the same string.
    """
    if _encodable(text):
        return text
    return text.encode("utf-8", "surrogateescape" if _escapable(text) else "surrogatepass")


def _escapable(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def _valid_text(text: str) -> str:
    """Text that must stay a string (keys, subject): lone surrogates become ``?``."""
    return text if _encodable(text) else text.encode("utf-8", "replace").decode("utf-8")


def _wire_value(value: object) -> Value:
    """A header value as AMQP can carry it (see the module docstring)."""
    if isinstance(value, bool | float):
        return value
    if isinstance(value, str):
        return _wire_text(value)
    if isinstance(value, int):
        return value if _LONG_MIN <= value <= _ULONG_MAX else str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, uuid.UUID):
        return value
    return _valid_text(str(value))
