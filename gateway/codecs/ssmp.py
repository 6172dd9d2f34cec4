"""SSMP, the Stupid-Simple Messaging Protocol (../shared/specs/ssmp.txt).

Sans-IO: `SSMPCodec` turns bytes into typed lines and lines into bytes, for
either role. The server role reads requests and writes responses and events;
the client role reads responses and events and writes requests.

Spec, "Message format": every message is one LF-terminated line of at most
1,024 bytes, LF included; empty messages are not allowed. Spec, "Grammar"::

    request     = "LOGIN" SP id SP id [ SP payload ] | "CLOSE" | "PING" | "PONG"
                | forwardable
    response    = code [ SP payload ]
    event       = "000" SP id SP ( forwardable | "PING" | "PONG" )
    forwardable = "SUBSCRIBE" SP id [ SP "PRESENCE" ] | "UNSUBSCRIBE" SP id
                | "UCAST" SP id SP payload | "MCAST" SP id SP payload
                | "BCAST" SP payload | compat
    compat      = verb [ SP id ] [ SP payload ]

Payloads are any bytes but LF (not necessarily UTF-8); ids are ASCII letters,
digits and ``.:@/_-+=~``. Everything stays bytes here.

Errors: a line that breaks the grammar (or the length limit) raises
`SSMPError` carrying the server's answer, ``400``; after that the codec is
dead. What the spec lets a conforming peer send but the hub must refuse
(a second LOGIN, SUBSCRIBE twice, an unknown verb) is not a codec error: it
decodes to an ordinary line and the adapter answers it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.escaping import escape_controls, quote_bytes
from gateway.codecs.framing import LineSplitter, LineTooLongError

__all__ = [
    "ANONYMOUS",
    "MAX_LINE_BYTES",
    "Bcast",
    "Close",
    "Compat",
    "Event",
    "Forwardable",
    "Line",
    "Login",
    "Mcast",
    "Ping",
    "Pong",
    "Request",
    "Response",
    "Role",
    "SSMPCodec",
    "SSMPError",
    "SSMPLocalError",
    "Subscribe",
    "Ucast",
    "Unsubscribe",
    "encode",
    "is_valid_id",
    "mcast_event",
    "mcast_head",
    "mcast_line",
    "response_line",
]

MAX_LINE_BYTES: Final = 1024
"""Spec, "Message format": at most 1,024 bytes per message, LF included."""

ANONYMOUS: Final = b"."
"""Spec, "Anonymous connections": the reserved anonymous identifier."""

EVENT_CODE: Final = b"000"

_ID: Final = re.compile(rb"[A-Za-z0-9.:@/_+=~-]+\Z")
_VERB: Final = re.compile(rb"[A-Z]+\Z")
_CODE: Final = re.compile(rb"[0-9]{3}\Z")


class Role(enum.Enum):
    """Which side of the connection a codec is on."""

    SERVER = "server"
    CLIENT = "client"


# --- lines -----------------------------------------------------------------
# Spec, "Grammar". One dataclass per production; the names are the verbs.


@dataclass(frozen=True, slots=True, kw_only=True)
class Login:
    """``LOGIN <identity> <scheme> [<credential>]`` (spec, "Login")."""

    identity: bytes
    scheme: bytes
    credential: bytes | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """``CLOSE``: the client ends the connection cleanly."""


@dataclass(frozen=True, slots=True)
class Ping:
    """``PING``, as a request or inside an event (spec, "Ping")."""


@dataclass(frozen=True, slots=True)
class Pong:
    """``PONG``, as a request or inside an event (spec, "Ping")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe:
    """``SUBSCRIBE <topic> [PRESENCE]`` (spec, "Topic subscriptions")."""

    topic: bytes
    presence: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsubscribe:
    """``UNSUBSCRIBE <topic>``."""

    topic: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Ucast:
    """``UCAST <to> <payload>`` (spec, "Unicast")."""

    to: bytes
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Mcast:
    """``MCAST <topic> <payload>`` (spec, "Multicast")."""

    topic: bytes
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Bcast:
    """``BCAST <payload>`` (spec, "Broadcast")."""

    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Compat:
    """A verb this version does not know (spec, "Forward compatibility").

    A server answers it with 501; a client that receives it in an event must
    close the connection.
    """

    verb: bytes
    id: bytes | None = None
    payload: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """``<code> [<payload>]``: the answer to a request."""

    code: int
    payload: bytes | None = None


Forwardable = Subscribe | Unsubscribe | Ucast | Mcast | Bcast | Compat
"""What a server forwards to other peers inside an event."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """``000 <source> <message>``: something forwarded by the server."""

    source: bytes
    message: Forwardable | Ping | Pong


Request = Login | Close | Ping | Pong | Forwardable
"""What a client sends."""

Line = Request | Response | Event
"""Every SSMP unit is one line; adapters ``match`` on this union."""

_Parser = Callable[[bytes, bytes], "Request"]

PING: Final = Ping()
PONG: Final = Pong()
CLOSE: Final = Close()


# --- errors ------------------------------------------------------------------


class SSMPError(RemoteProtocolError):
    """The peer broke the SSMP grammar.

    ``reply`` is the full response line a server sends before closing
    (``400 <reason>``); it is None in the client role, where the answer is to
    close without a word.
    """


class SSMPLocalError(LocalProtocolError):
    """We were asked to send a line SSMP cannot carry."""


# --- decoding ----------------------------------------------------------------


def is_valid_id(value: bytes) -> bool:
    """Whether ``value`` is a well-formed SSMP identifier (``1*ID``)."""
    return _ID.match(value) is not None


class _MalformedError(Exception):
    """Internal: a line broke the grammar; turned into `SSMPError` by the codec."""

    def __init__(self, reason: str, kind: str = "malformed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def _show(value: bytes, limit: int = 64) -> str:
    """Quote peer bytes for a reason text: ASCII, control bytes escaped, cut to ``limit``."""
    return quote_bytes(value, limit)


def _id(value: bytes, what: str) -> bytes:
    if _ID.match(value) is None:
        if not value:
            raise _MalformedError(f"missing {what}")
        raise _MalformedError(
            f"{what} {_show(value)} has characters outside the SSMP id set", "bad-id"
        )
    return value


def _no_args(verb: bytes) -> _Parser:
    simple: dict[bytes, Request] = {b"CLOSE": CLOSE, b"PING": PING, b"PONG": PONG}
    line = simple[verb]

    def parse(sep: bytes, rest: bytes) -> Request:
        if sep:
            raise _MalformedError(f"{verb.decode()} takes no arguments")
        return line

    return parse


def _parse_login(sep: bytes, rest: bytes) -> Request:
    parts = rest.split(b" ", 2)
    if not sep or len(parts) < 2:
        raise _MalformedError("LOGIN needs an identifier and a scheme")
    credential = parts[2] if len(parts) == 3 else None
    if credential == b"":
        raise _MalformedError("LOGIN credential is empty")
    return Login(
        identity=_id(parts[0], "LOGIN identifier"),
        scheme=_id(parts[1], "LOGIN scheme"),
        credential=credential,
    )


def _parse_subscribe(sep: bytes, rest: bytes) -> Request:
    topic, sep2, option = rest.partition(b" ")
    if sep2 and option != b"PRESENCE":
        raise _MalformedError(f"SUBSCRIBE option {_show(option)} is not PRESENCE")
    return Subscribe(topic=_id(topic, "SUBSCRIBE topic"), presence=bool(sep2))


def _parse_unsubscribe(sep: bytes, rest: bytes) -> Request:
    return Unsubscribe(topic=_id(rest, "UNSUBSCRIBE topic"))


def _parse_ucast(sep: bytes, rest: bytes) -> Request:
    to, _, payload = rest.partition(b" ")
    if not payload:
        raise _MalformedError("UCAST needs a recipient and a non-empty payload")
    return Ucast(to=_id(to, "UCAST recipient"), payload=payload)


def _parse_mcast(sep: bytes, rest: bytes) -> Request:
    topic, _, payload = rest.partition(b" ")
    if not payload:
        raise _MalformedError("MCAST needs a topic and a non-empty payload")
    return Mcast(topic=_id(topic, "MCAST topic"), payload=payload)


def _parse_bcast(sep: bytes, rest: bytes) -> Request:
    if not rest:
        raise _MalformedError("BCAST needs a non-empty payload")
    return Bcast(payload=rest)


def _parse_compat(verb: bytes, sep: bytes, rest: bytes) -> Compat:
    # Spec ambiguity: in ``verb [SP id] [SP payload]`` a first word that is a
    # valid id could also be the start of the payload. We read it as the id
    # when it is one (what a future verb with a target would mean), else the
    # whole rest is the payload.
    if not sep:
        return Compat(verb=verb)
    if not rest:
        raise _MalformedError(f"{_show(verb, 32)} has an empty argument")
    first, sep2, after = rest.partition(b" ")
    if _ID.match(first) is not None and (not sep2 or after):
        return Compat(verb=verb, id=first, payload=after or None)
    return Compat(verb=verb, payload=rest)


_FORWARDABLE: Final = {
    b"SUBSCRIBE": _parse_subscribe,
    b"UNSUBSCRIBE": _parse_unsubscribe,
    b"UCAST": _parse_ucast,
    b"MCAST": _parse_mcast,
    b"BCAST": _parse_bcast,
}
_REQUESTS: Final = {
    **_FORWARDABLE,
    b"LOGIN": _parse_login,
    b"CLOSE": _no_args(b"CLOSE"),
    b"PING": _no_args(b"PING"),
    b"PONG": _no_args(b"PONG"),
}
_EVENTS: Final = {
    **_FORWARDABLE,
    b"PING": _no_args(b"PING"),
    b"PONG": _no_args(b"PONG"),
}
# LOGIN and CLOSE are requests, never forwarded: inside an event they are
# malformed rather than unknown.
_NOT_IN_EVENTS: Final = frozenset({b"LOGIN", b"CLOSE"})


def _parse_request(line: bytes) -> Request:
    if not line:
        raise _MalformedError("empty message (two LFs in a row)", "empty")
    verb, sep, rest = line.partition(b" ")
    parse = _REQUESTS.get(verb)
    if parse is not None:
        return parse(sep, rest)
    if _VERB.match(verb) is None:
        raise _MalformedError(f"verb {_show(verb, 32)} is not upper-case letters", "bad-verb")
    return _parse_compat(verb, sep, rest)


MAX_KNOWN_TOPICS: Final = 1024
"""MCAST topics a server codec remembers as valid ids; past that it starts afresh."""
_new_object = object.__new__
_set_topic = Mcast.__dict__["topic"].__set__
_set_payload = Mcast.__dict__["payload"].__set__


def _requests(raw: list[bytes], topics: set[bytes], out: list[Line]) -> None:
    """Parse requests into ``out``; an MCAST to a topic in ``topics`` takes a fast path.

    A publisher sends most of its MCASTs to a few topics: once a topic has
    passed the id check (`_parse_mcast`), its MCASTs are split once and
    built without the frozen dataclass's ``__init__`` (its slots are set
    directly), which gives the same `Mcast`. Anything else, or an MCAST
    that would be malformed, goes through `_parse_request`.

    Raises:
        _MalformedError: A request is malformed; ``out`` has those before it.
    """
    parse = _parse_request
    add = out.append
    for line in raw:
        if line[:6] == b"MCAST ":
            parts = line.split(b" ", 2)
            if len(parts) == 3 and parts[2] and parts[1] in topics:
                mcast = _new_object(Mcast)
                _set_topic(mcast, parts[1])
                _set_payload(mcast, parts[2])
                add(mcast)
                continue
            request = parse(line)
            if type(request) is Mcast:
                if len(topics) >= MAX_KNOWN_TOPICS:
                    topics.clear()
                topics.add(request.topic)
            add(request)
            continue
        add(parse(line))


def _parse_incoming(line: bytes) -> Response | Event:
    if not line:
        raise _MalformedError("empty message (two LFs in a row)", "empty")
    code, sep, rest = line.partition(b" ")
    if code == EVENT_CODE:
        source, _, body = rest.partition(b" ")
        _id(source, "event source")
        if not body:
            raise _MalformedError("event without a message")
        verb, sep3, args = body.partition(b" ")
        parse = _EVENTS.get(verb)
        if parse is not None:
            return Event(source=source, message=parse(sep3, args))  # type: ignore[arg-type]
        if verb in _NOT_IN_EVENTS or _VERB.match(verb) is None:
            raise _MalformedError(f"event verb {_show(verb, 32)} cannot be forwarded", "bad-verb")
        return Event(source=source, message=_parse_compat(verb, sep3, args))
    if _CODE.match(code) is None:
        raise _MalformedError(f"{_show(code, 32)} is neither a response code nor 000", "bad-code")
    if sep and not rest:
        raise _MalformedError("response with an empty payload")
    return Response(code=int(code), payload=rest if sep else None)


# --- encoding ----------------------------------------------------------------


def _payload(value: bytes, what: str) -> bytes:
    if not value:
        raise SSMPLocalError(f"{what} must not be empty", kind="empty-payload")
    if b"\n" in value:
        raise SSMPLocalError(f"{what} contains LF, which SSMP cannot carry", kind="lf-in-payload")
    return value


def _check_id(value: bytes, what: str) -> bytes:
    if _ID.match(value) is None:
        raise SSMPLocalError(f"{what} {_show(value)} is not a valid SSMP id", kind="bad-id")
    return value


def _encode_message(message: Request) -> bytes:
    match message:
        case Mcast(topic=topic, payload=payload):
            return b"MCAST " + _check_id(topic, "topic") + b" " + _payload(payload, "payload")
        case Ucast(to=to, payload=payload):
            return b"UCAST " + _check_id(to, "recipient") + b" " + _payload(payload, "payload")
        case Bcast(payload=payload):
            return b"BCAST " + _payload(payload, "payload")
        case Subscribe(topic=topic, presence=presence):
            tail = b" PRESENCE" if presence else b""
            return b"SUBSCRIBE " + _check_id(topic, "topic") + tail
        case Unsubscribe(topic=topic):
            return b"UNSUBSCRIBE " + _check_id(topic, "topic")
        case Ping():
            return b"PING"
        case Pong():
            return b"PONG"
        case Close():
            return b"CLOSE"
        case Login(identity=identity, scheme=scheme, credential=credential):
            head = b"LOGIN " + _check_id(identity, "identity") + b" " + _check_id(scheme, "scheme")
            return head if credential is None else head + b" " + _payload(credential, "credential")
        case Compat(verb=verb, id=ident, payload=payload):
            if _VERB.match(verb) is None:
                raise SSMPLocalError(f"verb {verb!r} is not upper-case letters", kind="bad-verb")
            out = verb
            if ident is not None:
                out += b" " + _check_id(ident, "id")
            if payload is not None:
                out += b" " + _payload(payload, "payload")
            return out
    raise SSMPLocalError(f"{message!r} is not an SSMP request")  # pragma: no cover


def encode(line: Line) -> bytes:
    """Encode one line, LF included, checking the grammar and the length limit.

    Raises:
        SSMPLocalError: The line cannot be carried (bad id, LF or nothing in a
            payload, over 1,024 bytes).
    """
    match line:
        case Response(code=code, payload=payload):
            if not 0 < code < 1000:
                raise SSMPLocalError(f"response code {code} is not three digits")
            out = b"%03d" % code
            if payload is not None:
                out += b" " + _payload(payload, "response payload")
        case Event(source=source, message=message):
            if isinstance(message, Login | Close):
                raise SSMPLocalError(f"{type(message).__name__} cannot be forwarded in an event")
            out = b"000 " + _check_id(source, "event source") + b" " + _encode_message(message)
        case _:
            out = _encode_message(line)
    if len(out) >= MAX_LINE_BYTES:
        raise SSMPLocalError(
            f"line of {len(out) + 1} bytes is over SSMP's {MAX_LINE_BYTES}-byte limit",
            kind="line-too-long",
        )
    return out + b"\n"


def mcast_event(source: bytes, topic: bytes, payload: bytes) -> bytes:
    """Encode ``000 <source> MCAST <topic> <payload>`` directly (the hub's hot path).

    The same checks as `encode`, without building event objects first.

    Raises:
        SSMPLocalError: As `encode` would.
    """
    return mcast_line(mcast_head(source, topic), payload)


def mcast_head(source: bytes, topic: bytes) -> bytes:
    """``000 <source> MCAST <topic> ``: how every MCAST event from ``source`` to ``topic`` starts.

    A batch's events that share their source and topic share it (`mcast_line`).

    Raises:
        SSMPLocalError: The source or the topic is not a valid SSMP id.
    """
    if _ID.match(source) is None:
        raise SSMPLocalError(f"event source {_show(source)} is not a valid SSMP id", kind="bad-id")
    if _ID.match(topic) is None:
        raise SSMPLocalError(f"topic {_show(topic)} is not a valid SSMP id", kind="bad-id")
    return b"000 " + source + b" MCAST " + topic + b" "


def mcast_line(head: bytes, payload: bytes) -> bytes:
    """The MCAST event that starts with ``head`` (from `mcast_head`) and carries ``payload``.

    Raises:
        SSMPLocalError: The payload is empty or has an LF, or the line is too long.
    """
    _payload(payload, "payload")
    line = head + payload + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise SSMPLocalError(
            f"line of {len(line)} bytes is over SSMP's {MAX_LINE_BYTES}-byte limit",
            kind="line-too-long",
        )
    return line


def response_line(code: int, reason: str | None = None) -> bytes:
    r"""Encode a response with an optional human-readable payload.

    The reason is cut to fit the line limit, its LFs become spaces and its
    other control characters visible escapes (``\r``, ``\x1b``), so any
    text can be passed: the reply is one line a terminal shows as it is.
    """
    if not reason:
        return b"%03d\n" % code
    text = escape_controls(reason.replace("\n", " ")).encode("utf-8", "replace")
    text = text[: MAX_LINE_BYTES - 6]
    return b"%03d %s\n" % (code, text)


# --- the codec -----------------------------------------------------------------


class SSMPCodec:
    """One side of one SSMP connection.

    Args:
        role: SERVER reads requests (and insists on LOGIN first); CLIENT reads
            responses and events.
        max_line_bytes: Longest line accepted, LF included. The spec says
            1,024; a client talking to a lax server may allow more.
    """

    __slots__ = ("_error", "_logged_in", "_max_line_bytes", "_role", "_splitter", "_topics")

    def __init__(self, role: Role, *, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._role = role
        self._max_line_bytes = max_line_bytes
        self._splitter = LineSplitter(max_line_bytes)
        self._logged_in = False
        self._error: SSMPError | None = None
        self._topics: set[bytes] = set()
        """MCAST topics of this connection already checked as ids (`_requests`)."""

    @property
    def role(self) -> Role:
        """Which side this codec is on."""
        return self._role

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete line; zero exactly between lines.

        Lets the adapter time out a line that never ends.
        """
        return self._splitter.pending

    def receive_data(self, data: bytes) -> list[Line]:
        """Decode the lines that ``data`` completes.

        Returns:
            The complete lines, in order; an empty list when more data is
            needed.

        Raises:
            SSMPError: Part of the input broke the grammar. Lines decoded
                before the bad one are in its ``events``. The codec is dead
                afterwards: every later call raises again.
        """
        if self._error is not None:
            raise self._error
        try:
            raw = self._splitter.feed(data)
        except LineTooLongError as exc:
            lines = self._decode(exc.complete)
            self._fail(
                _MalformedError(
                    f"line of {exc.length}+ bytes is over the {self._max_line_bytes}-byte limit",
                    "line-too-long",
                ),
                lines,
            )
        return self._decode(raw)

    def _decode(self, raw: list[bytes]) -> list[Line]:
        out: list[Line] = []
        try:
            if self._role is Role.SERVER:
                if not self._logged_in and raw:
                    first = _parse_request(raw[0])
                    if not isinstance(first, Login):
                        raise _MalformedError("the first request must be LOGIN", "no-login")
                    self._logged_in = True
                    out.append(first)
                    raw = raw[1:]
                _requests(raw, self._topics, out)
            else:
                out.extend(map(_parse_incoming, raw))
        except _MalformedError as exc:
            # map() stopped at the bad line; what was appended is what came before.
            self._fail(exc, out)
        return out

    def _fail(self, exc: _MalformedError, before: list[Line]) -> None:
        reply = response_line(400, exc.reason) if self._role is Role.SERVER else None
        error = SSMPError(exc.reason, reply=reply, kind=exc.kind, events=list(before))
        self._error = SSMPError(exc.reason, reply=reply, kind=exc.kind)
        raise error

    def end_of_input(self) -> None:
        """Report the end of the byte stream.

        Raises:
            SSMPError: The stream ended in the middle of a line, or the codec
                is dead after an earlier error.
        """
        if self._error is not None:
            raise self._error
        if self.pending_bytes:
            self._fail(_MalformedError("connection ended inside a line", "truncated"), [])

    def send(self, line: Line) -> bytes:
        """Encode a line this role may send.

        Raises:
            SSMPLocalError: The role may not send it (a server sending a
                request, a client sending a response, a client not starting
                with LOGIN) or the line cannot be carried.
        """
        if self._role is Role.SERVER:
            if not isinstance(line, Response | Event):
                raise SSMPLocalError(f"a server cannot send {type(line).__name__}")
        else:
            if isinstance(line, Response | Event):
                raise SSMPLocalError(f"a client cannot send {type(line).__name__}")
            if not self._logged_in:
                if not isinstance(line, Login):
                    raise SSMPLocalError("the first request must be LOGIN")
                self._logged_in = True
        return encode(line)
