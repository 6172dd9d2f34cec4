"""Tests for `gateway.codecs.ssmp`, the sans-IO SSMP codec (../shared/specs/ssmp.txt).

The five families of STYLE.md, section 7: the spec's byte examples in both
directions, the split check, hypothesis round trips, hypothesis garbage and
the 1,024-byte limit; plus every grammar rule, the server's LOGIN-first rule
and the role checks of ``send``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.codecs import ssmp
from gateway.codecs.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gateway.codecs.ssmp import (
    Bcast,
    Close,
    Compat,
    Event,
    Login,
    Mcast,
    Ping,
    Pong,
    Response,
    Role,
    SSMPCodec,
    SSMPError,
    SSMPLocalError,
    Subscribe,
    Ucast,
    Unsubscribe,
)
from tests.codec_checks import (
    assert_events_or_error,
    assert_split_error,
    assert_split_invariant,
    assert_truncation_reported,
    chunkings,
    feed,
)
from tests.strategies import (
    ssmp_events,
    ssmp_forwardables,
    ssmp_lines,
    ssmp_payloads,
    ssmp_requests,
    ssmp_server_lines,
    ssmp_sessions,
)

LOGIN_BYTES = b"LOGIN alice open\n"
LOGIN = Login(identity=b"alice", scheme=b"open")
LIMIT = ssmp.MAX_LINE_BYTES
LINE_TYPES = (
    Login,
    Close,
    Ping,
    Pong,
    Subscribe,
    Unsubscribe,
    Ucast,
    Mcast,
    Bcast,
    Compat,
    Response,
    Event,
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def server() -> SSMPCodec:
    """A fresh server-role codec: it reads requests."""
    return SSMPCodec(Role.SERVER)


def client() -> SSMPCodec:
    """A fresh client-role codec: it reads responses and events."""
    return SSMPCodec(Role.CLIENT)


def logged_in_server() -> SSMPCodec:
    """A server-role codec that has already read a LOGIN."""
    codec = server()
    assert codec.receive_data(LOGIN_BYTES) == [LOGIN]
    return codec


def logged_in_client() -> SSMPCodec:
    """A client-role codec that has already sent its LOGIN."""
    codec = client()
    codec.send(LOGIN)
    return codec


def request_error(data: bytes) -> SSMPError:
    """The error a logged-in server raises on ``data``."""
    with pytest.raises(SSMPError) as info:
        logged_in_server().receive_data(data)
    return info.value


def incoming_error(data: bytes) -> SSMPError:
    """The error a client raises on ``data``."""
    with pytest.raises(SSMPError) as info:
        client().receive_data(data)
    return info.value


# --- (1) the spec's examples, verbatim, both directions -------------------------

# Spec sections "Login", "Ping", "Topic subscriptions", "Messages", "Closing
# connections", with concrete ids for the placeholders.
SPEC_REQUESTS: list[tuple[bytes, ssmp.Request]] = [
    (b"LOGIN alice cert\n", Login(identity=b"alice", scheme=b"cert")),
    (
        b"LOGIN alice secret s3cr3t\n",
        Login(identity=b"alice", scheme=b"secret", credential=b"s3cr3t"),
    ),
    (b"LOGIN . open\n", Login(identity=b".", scheme=b"open")),
    (
        b"LOGIN host.example/worker-1 cert\n",
        Login(identity=b"host.example/worker-1", scheme=b"cert"),
    ),
    (b"PING\n", Ping()),
    (b"PONG\n", Pong()),
    (b"SUBSCRIBE news\n", Subscribe(topic=b"news")),
    (b"SUBSCRIBE news PRESENCE\n", Subscribe(topic=b"news", presence=True)),
    (b"UNSUBSCRIBE news\n", Unsubscribe(topic=b"news")),
    (b"UCAST bob hello\n", Ucast(to=b"bob", payload=b"hello")),
    (b"MCAST news hello world\n", Mcast(topic=b"news", payload=b"hello world")),
    (b"BCAST hello\n", Bcast(payload=b"hello")),
    (b"CLOSE\n", Close()),
]

SPEC_SERVER_LINES: list[tuple[bytes, Response | Event]] = [
    (b"000 . PONG\n", Event(source=b".", message=Pong())),
    (b"000 . PING\n", Event(source=b".", message=Ping())),
    (b"000 alice SUBSCRIBE news\n", Event(source=b"alice", message=Subscribe(topic=b"news"))),
    (
        b"000 alice SUBSCRIBE news PRESENCE\n",
        Event(source=b"alice", message=Subscribe(topic=b"news", presence=True)),
    ),
    (b"000 alice UNSUBSCRIBE news\n", Event(source=b"alice", message=Unsubscribe(topic=b"news"))),
    (
        b"000 alice UCAST bob hello\n",
        Event(source=b"alice", message=Ucast(to=b"bob", payload=b"hello")),
    ),
    (
        b"000 alice MCAST news hello world\n",
        Event(source=b"alice", message=Mcast(topic=b"news", payload=b"hello world")),
    ),
    (b"000 alice BCAST hello\n", Event(source=b"alice", message=Bcast(payload=b"hello"))),
    (b"200\n", Response(code=200)),
    (b"400\n", Response(code=400)),
    (b"401 secret cert\n", Response(code=401, payload=b"secret cert")),
    (b"404\n", Response(code=404)),
    (b"405\n", Response(code=405)),
    (b"409\n", Response(code=409)),
    (b"501\n", Response(code=501)),
]


@pytest.mark.parametrize(("wire", "line"), SPEC_REQUESTS)
def test_spec_request_decoded_by_server(wire: bytes, line: ssmp.Request) -> None:
    """Each request example of the spec decodes in the server role (after LOGIN if not one)."""
    if isinstance(line, Login):
        assert server().receive_data(wire) == [line]
    else:
        assert logged_in_server().receive_data(wire) == [line]


@pytest.mark.parametrize(("wire", "line"), SPEC_REQUESTS)
def test_spec_request_encoded_by_client(wire: bytes, line: ssmp.Request) -> None:
    """Each request example is what `encode` and a client's ``send`` produce, byte for byte."""
    assert ssmp.encode(line) == wire
    codec = client() if isinstance(line, Login) else logged_in_client()
    assert codec.send(line) == wire


@pytest.mark.parametrize(("wire", "line"), SPEC_SERVER_LINES)
def test_spec_server_line_decoded_by_client(wire: bytes, line: Response | Event) -> None:
    """Each response and event example of the spec decodes in the client role."""
    assert client().receive_data(wire) == [line]


@pytest.mark.parametrize(("wire", "line"), SPEC_SERVER_LINES)
def test_spec_server_line_encoded_by_server(wire: bytes, line: Response | Event) -> None:
    """Each response and event example is what a server's ``send`` produces, byte for byte."""
    assert ssmp.encode(line) == wire
    assert server().send(line) == wire


def test_spec_client_initiated_ping() -> None:
    """Spec, "Client-initiated": ``PING`` goes up, ``000 . PONG`` comes back."""
    up, down = logged_in_client(), logged_in_server()
    assert down.receive_data(up.send(Ping())) == [Ping()]
    pong = Event(source=ssmp.ANONYMOUS, message=Pong())
    assert up.receive_data(down.send(pong)) == [pong]


def test_spec_server_initiated_ping() -> None:
    """Spec, "Server-initiated": ``000 . PING`` comes down, ``PONG`` goes up."""
    up, down = logged_in_client(), logged_in_server()
    ping = Event(source=ssmp.ANONYMOUS, message=Ping())
    assert up.receive_data(down.send(ping)) == [ping]
    assert down.receive_data(up.send(Pong())) == [Pong()]


def test_spec_login_failure_lists_schemes() -> None:
    """Spec, "Login": a 401 carries the space-separated supported schemes as its payload."""
    assert ssmp.response_line(401, "secret cert") == b"401 secret cert\n"
    assert client().receive_data(b"401 secret cert\n") == [
        Response(code=401, payload=b"secret cert")
    ]


# --- grammar: requests (server role) ------------------------------------------------

VALID_REQUESTS: list[tuple[bytes, ssmp.Request]] = [
    (
        b"LOGIN alice secret pass word \x00\n",
        Login(identity=b"alice", scheme=b"secret", credential=b"pass word \x00"),
    ),
    (b"LOGIN alice secret  x\n", Login(identity=b"alice", scheme=b"secret", credential=b" x")),
    (b"SUBSCRIBE aZ09.:@/_-+=~\n", Subscribe(topic=b"aZ09.:@/_-+=~")),
    (b"MCAST news \x00\r\xff x \n", Mcast(topic=b"news", payload=b"\x00\r\xff x ")),
    (b"MCAST news  \n", Mcast(topic=b"news", payload=b" ")),
    (b"UCAST bob  leading space\n", Ucast(to=b"bob", payload=b" leading space")),
    (b"UCAST bob \xc3\xa9t\xc3\xa9\n", Ucast(to=b"bob", payload=b"\xc3\xa9t\xc3\xa9")),
    (b"BCAST  \n", Bcast(payload=b" ")),
    (b"BCAST a\rb\n", Bcast(payload=b"a\rb")),
    (b"FOO\n", Compat(verb=b"FOO")),
    (b"FOO bar\n", Compat(verb=b"FOO", id=b"bar")),
    (b"FOO bar baz qux\n", Compat(verb=b"FOO", id=b"bar", payload=b"baz qux")),
    (b"FOO b#r\n", Compat(verb=b"FOO", payload=b"b#r")),
    (b"FOO b#r baz\n", Compat(verb=b"FOO", payload=b"b#r baz")),
    (b"FOO  x\n", Compat(verb=b"FOO", payload=b" x")),
    (b"LOGOUT\n", Compat(verb=b"LOGOUT")),
]


@pytest.mark.parametrize(("wire", "line"), VALID_REQUESTS)
def test_valid_request(wire: bytes, line: ssmp.Request) -> None:
    """Grammar edge cases that are legal requests decode, and encode back to the same bytes."""
    assert logged_in_server().receive_data(wire) == [line]
    assert ssmp.encode(line) == wire


def test_compat_ambiguity_first_word_is_an_id() -> None:
    """Spec ambiguity, one side: ``FOO bar baz`` reads ``bar`` as the id, not payload."""
    assert logged_in_server().receive_data(b"FOO bar baz\n") == [
        Compat(verb=b"FOO", id=b"bar", payload=b"baz")
    ]


def test_compat_ambiguity_first_word_is_not_an_id() -> None:
    """Spec ambiguity, other side: when no id can start the rest, the rest is all payload.

    ``FOO bar `` (a trailing space) leaves an empty payload after ``bar``, so
    ``bar `` is the payload.
    """
    assert logged_in_server().receive_data(b"FOO bar \n") == [Compat(verb=b"FOO", payload=b"bar ")]
    assert logged_in_server().receive_data(b"FOO b!r\n") == [Compat(verb=b"FOO", payload=b"b!r")]


BAD_REQUESTS: list[tuple[bytes, str]] = [
    # empty messages (spec, "Message format")
    (b"\n", "empty"),
    # LOGIN: missing or extra pieces, bad ids
    (b"LOGIN\n", "malformed"),
    (b"LOGIN \n", "malformed"),
    (b"LOGIN alice\n", "malformed"),
    (b"LOGIN alice \n", "malformed"),
    (b"LOGIN alice open \n", "malformed"),
    (b"LOGIN  alice open\n", "malformed"),
    (b"LOGIN al!ce open\n", "bad-id"),
    (b"LOGIN alice op#n\n", "bad-id"),
    # no-argument requests with arguments
    (b"CLOSE now\n", "malformed"),
    (b"CLOSE \n", "malformed"),
    (b"PING x\n", "malformed"),
    (b"PING \n", "malformed"),
    (b"PONG x\n", "malformed"),
    # SUBSCRIBE
    (b"SUBSCRIBE\n", "malformed"),
    (b"SUBSCRIBE \n", "malformed"),
    (b"SUBSCRIBE news \n", "malformed"),
    (b"SUBSCRIBE news presence\n", "malformed"),
    (b"SUBSCRIBE news NOW\n", "malformed"),
    (b"SUBSCRIBE news PRESENCE extra\n", "malformed"),
    (b"SUBSCRIBE ne#ws\n", "bad-id"),
    # UNSUBSCRIBE
    (b"UNSUBSCRIBE\n", "malformed"),
    (b"UNSUBSCRIBE \n", "malformed"),
    (b"UNSUBSCRIBE news extra\n", "bad-id"),
    # UCAST, MCAST, BCAST: missing target, empty payload
    (b"UCAST\n", "malformed"),
    (b"UCAST bob\n", "malformed"),
    (b"UCAST bob \n", "malformed"),
    (b"UCAST  hello\n", "malformed"),
    (b"UCAST b*b hello\n", "bad-id"),
    (b"MCAST\n", "malformed"),
    (b"MCAST news\n", "malformed"),
    (b"MCAST t \n", "malformed"),
    (b"MCAST n\xffws hello\n", "bad-id"),
    (b"BCAST\n", "malformed"),
    (b"BCAST \n", "malformed"),
    # verbs: lower case, digits, missing, CR before LF
    (b"ping\n", "bad-verb"),
    (b"Ping\n", "bad-verb"),
    (b"mcast news hello\n", "bad-verb"),
    (b"F00 x\n", "bad-verb"),
    (b" PING\n", "bad-verb"),
    (b"PING\r\n", "bad-verb"),
    (b"\xff\n", "bad-verb"),
    # compat with an empty argument
    (b"FOO \n", "malformed"),
    # a server line is not a request
    (b"000 . PONG\n", "bad-verb"),
    (b"200\n", "bad-verb"),
]


@pytest.mark.parametrize(("wire", "kind"), BAD_REQUESTS)
def test_bad_request(wire: bytes, kind: str) -> None:
    """A request that breaks the grammar raises `SSMPError` with a 400 reply and a kind."""
    error = request_error(wire)
    assert error.kind == kind
    assert error.reply is not None
    assert error.reply.startswith(b"400 ")
    assert error.reply.endswith(b"\n")
    assert error.reply.count(b"\n") == 1
    assert error.events == []
    assert isinstance(error, RemoteProtocolError)


def test_bad_request_reply_is_a_decodable_response() -> None:
    """The 400 reply is one valid response line whose payload says what went wrong."""
    error = request_error(b"SUBSCRIBE news presence\n")
    assert error.reply is not None
    [reply] = client().receive_data(error.reply)
    assert isinstance(reply, Response)
    assert reply.code == 400
    assert reply.payload is not None
    assert b"PRESENCE" in reply.payload


def _controls(data: bytes) -> set[int]:
    """The control bytes in ``data`` (C0 and DEL), LF aside."""
    return {byte for byte in data if (byte < 0x20 and byte != 0x0A) or byte == 0x7F}


@pytest.mark.parametrize(
    "wire",
    [
        b"\x1b[2J\x1b[31mroot\r hello\n",  # a verb that clears the screen and ends in CR
        b"SUBSCRIBE news\x07\x00\n",  # a topic with BEL and NUL
        b"SUBSCRIBE news \x1b[0m\n",  # an option
        b"PING\r\n",
    ],
)
def test_bad_request_reason_escapes_the_peers_control_bytes(wire: bytes) -> None:
    """The reason quotes the peer's bytes with visible escapes: the 400 line is clean."""
    error = request_error(wire)
    assert error.reply is not None
    assert not _controls(error.reply)
    assert error.reply.count(b"\n") == 1 and error.reply.endswith(b"\n")
    assert not any(ord(char) < 0x20 or ord(char) == 0x7F for char in error.reason)
    assert "\\x" in error.reason or "\\r" in error.reason


def test_a_hostile_verb_is_quoted_escaped() -> None:
    r"""``ESC[2J ESC[31m root CR`` as a verb: the reason and the reply show ``\x1b`` and ``\r``."""
    error = request_error(b"\x1b[2J\x1b[31mroot\r\n")
    assert error.reason == "verb '\\x1b[2J\\x1b[31mroot\\r' is not upper-case letters"
    assert error.reply == b"400 verb '\\x1b[2J\\x1b[31mroot\\r' is not upper-case letters\n"


def test_a_hostile_response_code_is_quoted_escaped() -> None:
    """Client role: a server line with control bytes in its code is reported escaped."""
    error = incoming_error(b"2\x1b0\n")
    assert error.reason == "'2\\x1b0' is neither a response code nor 000"


# --- grammar: responses and events (client role) ---------------------------------------

VALID_SERVER_LINES: list[tuple[bytes, Response | Event]] = [
    (b"001\n", Response(code=1)),
    (b"999 x\n", Response(code=999, payload=b"x")),
    (b"200 \x00\xff\r\n", Response(code=200, payload=b"\x00\xff\r")),
    (b"200  \n", Response(code=200, payload=b" ")),
    (b"000 . FOO\n", Event(source=b".", message=Compat(verb=b"FOO"))),
    (
        b"000 alice NEWVERB topic some payload\n",
        Event(
            source=b"alice", message=Compat(verb=b"NEWVERB", id=b"topic", payload=b"some payload")
        ),
    ),
    (
        b"000 alice NEWVERB t#pic\n",
        Event(source=b"alice", message=Compat(verb=b"NEWVERB", payload=b"t#pic")),
    ),
    (
        b"000 alice MCAST news \x00 \xff\r\n",
        Event(source=b"alice", message=Mcast(topic=b"news", payload=b"\x00 \xff\r")),
    ),
    (
        b"000 a.b:c@d/e_f-g+h=i~j UCAST bob  \n",
        Event(source=b"a.b:c@d/e_f-g+h=i~j", message=Ucast(to=b"bob", payload=b" ")),
    ),
]


@pytest.mark.parametrize(("wire", "line"), VALID_SERVER_LINES)
def test_valid_server_line(wire: bytes, line: Response | Event) -> None:
    """Grammar edge cases that are legal responses or events decode and encode back."""
    assert client().receive_data(wire) == [line]
    assert ssmp.encode(line) == wire


def test_unknown_event_verb_is_compat() -> None:
    """Spec, "Forward compatibility": an unknown event verb decodes to a compat message.

    The client adapter closes the connection on it; the codec only names it.
    """
    [event] = client().receive_data(b"000 hub REKEY now\n")
    assert event == Event(source=b"hub", message=Compat(verb=b"REKEY", id=b"now"))


BAD_SERVER_LINES: list[tuple[bytes, str]] = [
    (b"\n", "empty"),
    (b"20\n", "bad-code"),
    (b"2000\n", "bad-code"),
    (b"20a\n", "bad-code"),
    (b"OK\n", "bad-code"),
    (b"PING\n", "bad-code"),
    (b" 200\n", "bad-code"),
    (b"200 \n", "malformed"),
    (b"000\n", "malformed"),
    (b"000 \n", "malformed"),
    (b"000 .\n", "malformed"),
    (b"000 . \n", "malformed"),
    (b"000 .  PONG\n", "bad-verb"),
    (b"000 b@d! PING\n", "bad-id"),
    (b"000 . LOGIN alice open\n", "bad-verb"),
    (b"000 . CLOSE\n", "bad-verb"),
    (b"000 . ping\n", "bad-verb"),
    (b"000 . PING x\n", "malformed"),
    (b"000 . PONG \n", "malformed"),
    (b"000 . MCAST news\n", "malformed"),
    (b"000 . MCAST news \n", "malformed"),
    (b"000 . UCAST bob\n", "malformed"),
    (b"000 . BCAST\n", "malformed"),
    (b"000 . SUBSCRIBE news presence\n", "malformed"),
    (b"000 . UNSUBSCRIBE\n", "malformed"),
    (b"000 . FOO \n", "malformed"),
    (b"000 . PONG\r\n", "bad-verb"),
]


@pytest.mark.parametrize(("wire", "kind"), BAD_SERVER_LINES)
def test_bad_server_line(wire: bytes, kind: str) -> None:
    """A response or event that breaks the grammar raises `SSMPError` with no reply.

    A client answers a broken server by closing, without a word.
    """
    error = incoming_error(wire)
    assert error.kind == kind
    assert error.reply is None
    assert error.events == []


# --- the server role: LOGIN first ---------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "kind"),
    [
        (b"PING\n", "no-login"),
        (b"SUBSCRIBE news\n", "no-login"),
        (b"CLOSE\n", "no-login"),
        (b"FOO bar\n", "no-login"),
        (b"\n", "empty"),
        (b"login alice open\n", "bad-verb"),
        (b"LOGIN alice\n", "malformed"),
    ],
)
def test_first_request_must_be_login(wire: bytes, kind: str) -> None:
    """Spec, "Login": a first request other than a valid LOGIN is answered 400."""
    with pytest.raises(SSMPError) as info:
        server().receive_data(wire + b"PING\n")
    assert info.value.kind == kind
    assert info.value.reply is not None
    assert info.value.reply.startswith(b"400")
    assert info.value.events == []


def test_first_request_checked_however_cut() -> None:
    """The LOGIN-first rule holds whatever the cut, including a first line split in two."""
    errors = assert_split_error(server, b"PING\nLOGIN alice open\n", SSMPError, [])
    assert all(exc.kind == "no-login" for exc in errors)  # type: ignore[attr-defined]


def test_later_login_decodes() -> None:
    """A second LOGIN is not a codec error: it decodes, and the adapter answers 405."""
    assert server().receive_data(LOGIN_BYTES + b"PING\nLOGIN bob cert\n") == [
        LOGIN,
        Ping(),
        Login(identity=b"bob", scheme=b"cert"),
    ]


def test_lines_before_a_bad_line_are_in_the_error() -> None:
    """Lines decoded before a bad one come in the error's ``events``, in order, for any cut."""
    data = LOGIN_BYTES + b"PING\nMCAST news hi\nping\nPONG\n"
    expected = [LOGIN, Ping(), Mcast(topic=b"news", payload=b"hi")]
    assert_split_error(server, data, SSMPError, expected)


def test_lines_from_earlier_calls_are_not_repeated() -> None:
    """Only the failing call's lines are in ``events``; earlier calls already returned theirs."""
    codec = server()
    assert codec.receive_data(LOGIN_BYTES + b"PI") == [LOGIN]
    with pytest.raises(SSMPError) as info:
        codec.receive_data(b"NG\nBCAST\n")
    assert info.value.events == [Ping()]


def test_client_lines_before_a_bad_line_are_in_the_error() -> None:
    """In the client role too, the lines before a bad one are carried by the error."""
    data = b"200\n000 . PING\n000 . LOGIN a b\n200\n"
    expected = [Response(code=200), Event(source=b".", message=Ping())]
    assert_split_error(client, data, SSMPError, expected)


@pytest.mark.parametrize("make", [server, client])
def test_dead_after_error(make: Callable[[], SSMPCodec]) -> None:
    """After an error every call raises again, without events, and nothing more is decoded."""
    codec = make()
    with pytest.raises(SSMPError) as first:
        codec.receive_data(b"\n")
    for data in [b"", LOGIN_BYTES, b"200\n"]:
        with pytest.raises(SSMPError) as again:
            codec.receive_data(data)
        assert again.value.events == []
        assert again.value.kind == first.value.kind
        assert again.value.reply == first.value.reply
    with pytest.raises(SSMPError):
        codec.end_of_input()


def test_error_family() -> None:
    """`SSMPError` and `SSMPLocalError` belong to the project's one error family."""
    assert issubclass(SSMPError, RemoteProtocolError)
    assert issubclass(SSMPLocalError, LocalProtocolError)
    assert issubclass(SSMPError, ProtocolError)
    assert issubclass(SSMPLocalError, ProtocolError)


# --- end of input -----------------------------------------------------------------


@pytest.mark.parametrize("make", [server, client])
def test_end_of_input_between_lines(make: Callable[[], SSMPCodec]) -> None:
    """Ending on a line boundary (or before any byte) is clean."""
    data = LOGIN_BYTES if make is server else b"200\n"
    assert_truncation_reported(make, data, b"PIN", SSMPCodec.end_of_input, SSMPError)
    assert_truncation_reported(make, b"", b"L", SSMPCodec.end_of_input, SSMPError)


def test_end_of_input_inside_a_line() -> None:
    """Ending inside a line raises a ``truncated`` error; the server's reply is 400."""
    codec = server()
    codec.receive_data(LOGIN_BYTES + b"MCAST news half")
    with pytest.raises(SSMPError) as info:
        codec.end_of_input()
    assert info.value.kind == "truncated"
    assert info.value.reply is not None
    assert info.value.reply.startswith(b"400")
    with pytest.raises(SSMPError):
        codec.receive_data(b"\n")


# --- the 1,024-byte limit -----------------------------------------------------------


def _mcast_of(total: int) -> bytes:
    """An MCAST line of exactly ``total`` bytes, LF included."""
    head = b"MCAST news "
    return head + b"p" * (total - len(head) - 1) + b"\n"


def _response_of(total: int) -> bytes:
    """A 200 response of exactly ``total`` bytes, LF included."""
    return b"200 " + b"r" * (total - 5) + b"\n"


def test_line_of_exactly_the_limit_is_accepted() -> None:
    """Spec, "Message format": a line of 1,024 bytes, LF included, is accepted, both roles."""
    [line] = logged_in_server().receive_data(_mcast_of(LIMIT))
    assert isinstance(line, Mcast)
    assert ssmp.encode(line) == _mcast_of(LIMIT)
    [response] = client().receive_data(_response_of(LIMIT))
    assert ssmp.encode(response) == _response_of(LIMIT)


def test_line_over_the_limit_is_refused() -> None:
    """A line of 1,025 bytes is refused in both roles, however it is cut."""
    errors = assert_split_error(server, LOGIN_BYTES + _mcast_of(LIMIT + 1), SSMPError, [LOGIN])
    for exc in errors:
        assert isinstance(exc, SSMPError)
        assert exc.kind == "line-too-long"
        assert exc.reply is not None
        assert exc.reply.startswith(b"400")
    errors = assert_split_error(
        client, b"200\n" + _response_of(LIMIT + 1), SSMPError, [Response(code=200)]
    )
    assert all(isinstance(exc, SSMPError) and exc.kind == "line-too-long" for exc in errors)


@pytest.mark.parametrize("make", [logged_in_server, client])
def test_refused_before_the_lf_arrives(make: Callable[[], SSMPCodec]) -> None:
    """(5) A line is refused once 1,024 bytes are buffered without an LF, not when the LF comes."""
    codec = make()
    assert codec.receive_data(b"MCAST news " + b"p" * (LIMIT - 13)) == []
    assert codec.receive_data(b"p") == []  # 1,023 bytes: the LF may still fit
    with pytest.raises(SSMPError) as info:
        codec.receive_data(b"p")  # 1,024 bytes and no LF: cannot fit any more
    assert info.value.kind == "line-too-long"


@FAST
@given(data=st.data())
def test_oversize_line_fails_before_its_end(data: st.DataObject) -> None:
    """(5) Fed in any cuts, an oversize line fails with its 1,024th byte, never earlier or later.

    Its LF is never needed.
    """
    prefix = (b"MCAST news " + b"p" * LIMIT)[:LIMIT]
    codec = logged_in_server()
    offset = 0
    for chunk in data.draw(chunkings(prefix)):
        offset += len(chunk)
        if offset < LIMIT:
            assert codec.receive_data(chunk) == []
        else:
            with pytest.raises(SSMPError) as info:
                codec.receive_data(chunk)
            assert info.value.kind == "line-too-long"
            return
    raise AssertionError("the 1,024th byte was never fed")  # pragma: no cover


def test_lax_limit() -> None:
    """A codec built with a larger ``max_line_bytes`` accepts longer lines, up to that limit."""
    codec = SSMPCodec(Role.CLIENT, max_line_bytes=2048)
    assert codec.receive_data(_response_of(2048)) == [Response(code=200, payload=b"r" * 2043)]
    with pytest.raises(SSMPError) as info:
        codec.receive_data(_response_of(2049))
    assert "2048" in info.value.reason


def test_limit_reason_names_the_codec_limit() -> None:
    """The reason for an oversize line states the limit this codec enforces."""
    with pytest.raises(SSMPError) as info:
        SSMPCodec(Role.CLIENT, max_line_bytes=16).receive_data(b"200 " + b"x" * 20)
    assert "16-byte limit" in info.value.reason


def test_encode_at_the_limit() -> None:
    """`encode` produces a 1,024-byte line and refuses one of 1,025 bytes."""
    assert ssmp.encode(Mcast(topic=b"news", payload=b"p" * (LIMIT - 12))) == _mcast_of(LIMIT)
    with pytest.raises(SSMPLocalError) as info:
        ssmp.encode(Mcast(topic=b"news", payload=b"p" * (LIMIT - 11)))
    assert info.value.kind == "line-too-long"
    with pytest.raises(SSMPLocalError):
        ssmp.encode(Response(code=200, payload=b"r" * LIMIT))


def test_response_line_fits_the_limit() -> None:
    """`response_line` cuts a long reason, drops LFs, escapes controls: any text, one clean line."""
    wire = ssmp.response_line(400, "x" * 5000)
    assert len(wire) <= LIMIT
    assert client().receive_data(wire) == [Response(code=400, payload=wire[4:-1])]
    assert ssmp.response_line(400, "two\nlines") == b"400 two lines\n"
    assert ssmp.response_line(400, "cr\r esc\x1b nel\x85") == b"400 cr\\r esc\\x1b nel\\x85\n"
    assert ssmp.response_line(200) == b"200\n"
    assert ssmp.response_line(200, "") == b"200\n"


# --- encode and send ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (Subscribe(topic=b"bad topic"), "bad-id"),
        (Subscribe(topic=b""), "bad-id"),
        (Unsubscribe(topic=b"n\xffws"), "bad-id"),
        (Ucast(to=b"b*b", payload=b"hi"), "bad-id"),
        (Login(identity=b"al ice", scheme=b"open"), "bad-id"),
        (Login(identity=b"alice", scheme=b""), "bad-id"),
        (Event(source=b"", message=Ping()), "bad-id"),
        (Event(source=b"a b", message=Ping()), "bad-id"),
        (Compat(verb=b"FOO", id=b"x y"), "bad-id"),
        (Mcast(topic=b"news", payload=b""), "empty-payload"),
        (Bcast(payload=b""), "empty-payload"),
        (Response(code=200, payload=b""), "empty-payload"),
        (Login(identity=b"alice", scheme=b"secret", credential=b""), "empty-payload"),
        (Compat(verb=b"FOO", payload=b""), "empty-payload"),
        (Mcast(topic=b"news", payload=b"two\nlines"), "lf-in-payload"),
        (Ucast(to=b"bob", payload=b"\n"), "lf-in-payload"),
        (Response(code=401, payload=b"a\nb"), "lf-in-payload"),
        (Compat(verb=b"foo"), "bad-verb"),
        (Compat(verb=b""), "bad-verb"),
        (Response(code=0), "malformed"),
        (Response(code=1000), "malformed"),
        (Event(source=b".", message=Login(identity=b"a", scheme=b"open")), "malformed"),  # type: ignore[arg-type]
        (Event(source=b".", message=Close()), "malformed"),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses(line: ssmp.Line, kind: str) -> None:
    """`encode` refuses lines SSMP cannot carry with `SSMPLocalError` naming the problem."""
    with pytest.raises(SSMPLocalError) as info:
        ssmp.encode(line)
    assert info.value.kind == kind


@pytest.mark.parametrize(
    "line",
    [
        LOGIN,
        Close(),
        Ping(),
        Pong(),
        Subscribe(topic=b"t"),
        Mcast(topic=b"t", payload=b"p"),
        Compat(verb=b"FOO"),
    ],
)
def test_server_cannot_send_requests(line: ssmp.Request) -> None:
    """A server sends only responses and events; a request is refused."""
    with pytest.raises(SSMPLocalError):
        server().send(line)


@pytest.mark.parametrize("line", [Response(code=200), Event(source=b".", message=Pong())])
def test_client_cannot_send_server_lines(line: ssmp.Line) -> None:
    """A client sends only requests; responses and events are refused, before or after LOGIN."""
    with pytest.raises(SSMPLocalError):
        client().send(line)
    with pytest.raises(SSMPLocalError):
        logged_in_client().send(line)


@pytest.mark.parametrize("line", [Ping(), Close(), Subscribe(topic=b"t"), Compat(verb=b"FOO")])
def test_client_must_send_login_first(line: ssmp.Request) -> None:
    """Spec, "Login": a client's first request must be LOGIN; a refused one changes nothing."""
    codec = client()
    with pytest.raises(SSMPLocalError):
        codec.send(line)
    with pytest.raises(SSMPLocalError):
        codec.send(line)
    assert codec.send(LOGIN) == LOGIN_BYTES
    assert codec.send(line) == ssmp.encode(line)


def test_roles() -> None:
    """Each codec reports its role."""
    assert server().role is Role.SERVER
    assert client().role is Role.CLIENT


# --- (2) the split check, both roles ---------------------------------------------------

SESSION = b"".join(wire for wire, _ in SPEC_REQUESTS[:1] + SPEC_REQUESTS[4:]) + b"".join(
    wire for wire, _ in VALID_REQUESTS
)
SESSION_LINES = [line for _, line in SPEC_REQUESTS[:1] + SPEC_REQUESTS[4:]] + [
    line for _, line in VALID_REQUESTS
]


def test_split_server_session() -> None:
    """(2) A whole client session decodes the same whole, byte by byte, cut anywhere, with tails."""
    assert_split_invariant(
        server, SESSION, SESSION_LINES, trailing=[b"P", b"MCAST news part", b"LOGIN x"]
    )


def test_split_server_login_only() -> None:
    """(2) A lone LOGIN, with or without a next partial request, decodes the same however cut."""
    assert_split_invariant(server, LOGIN_BYTES, [LOGIN], trailing=[b"PIN", b"\r"])


def test_split_client_stream() -> None:
    """(2) Responses and events interleaved decode the same however they are cut."""
    data = b"".join(wire for wire, _ in SPEC_SERVER_LINES + VALID_SERVER_LINES)
    expected = [line for _, line in SPEC_SERVER_LINES + VALID_SERVER_LINES]
    assert_split_invariant(client, data, expected, trailing=[b"0", b"000 . PO", b"200 partial"])


def test_split_long_lines() -> None:
    """(2) Lines at the limit, next to short ones, survive every cut in both roles."""
    data = LOGIN_BYTES + _mcast_of(LIMIT) + b"PING\n" + _mcast_of(LIMIT)
    mcast = Mcast(topic=b"news", payload=b"p" * (LIMIT - 12))
    assert_split_invariant(
        server, data, [LOGIN, mcast, Ping(), mcast], trailing=[_mcast_of(LIMIT)[:-1]]
    )
    data = _response_of(LIMIT) + b"200\n"
    expected = [Response(code=200, payload=b"r" * (LIMIT - 5)), Response(code=200)]
    assert_split_invariant(client, data, expected, trailing=[_response_of(LIMIT)[:-1]])


# --- (3) hypothesis round trips --------------------------------------------------------


@FAST
@given(line=ssmp_requests(), data=st.data())
def test_round_trip_request(line: ssmp.Request, data: st.DataObject) -> None:
    """(3) Any request, encoded and cut at random points, decodes to itself in the server role."""
    wire = ssmp.encode(line)
    assert len(wire) <= LIMIT
    chunks = data.draw(chunkings(LOGIN_BYTES + wire))
    assert feed(server(), chunks) == [LOGIN, line]


@FAST
@given(line=ssmp_server_lines(), data=st.data())
def test_round_trip_server_line(line: Response | Event, data: st.DataObject) -> None:
    """(3) Any response or event, encoded and cut at random points, decodes to itself."""
    wire = ssmp.encode(line)
    assert len(wire) <= LIMIT
    assert feed(client(), data.draw(chunkings(wire))) == [line]


@FAST
@given(session=ssmp_sessions(), data=st.data())
def test_round_trip_session(session: list[ssmp.Request], data: st.DataObject) -> None:
    """(3) A client's requests, sent by a client codec, concatenated and cut, arrive intact."""
    sender = client()
    wire = b"".join(sender.send(line) for line in session)
    assert feed(server(), data.draw(chunkings(wire, max_cuts=16))) == session


@FAST
@given(lines=st.lists(ssmp_server_lines(), max_size=8), data=st.data())
def test_round_trip_server_stream(lines: list[Response | Event], data: st.DataObject) -> None:
    """(3) Many responses and events from a server codec, concatenated and cut, arrive intact."""
    sender = server()
    wire = b"".join(sender.send(line) for line in lines)
    assert feed(client(), data.draw(chunkings(wire, max_cuts=16))) == lines


@FAST
@given(line=ssmp_lines())
def test_encode_round_trip_is_canonical(line: ssmp.Line) -> None:
    """(3) Any line encodes to one LF-ended line within the limit, and decodes to an equal line."""
    wire = ssmp.encode(line)
    assert wire.endswith(b"\n")
    assert wire.count(b"\n") == 1
    assert len(wire) <= LIMIT
    decoder = client() if isinstance(line, Response | Event) else logged_in_server()
    decoded = decoder.receive_data(wire)
    assert decoded == [line]
    assert [ssmp.encode(each) for each in decoded] == [wire]


@FAST
@given(message=st.one_of(ssmp_forwardables(), st.just(Ping()), st.just(Pong())))
def test_events_carry_every_forwardable(message: ssmp.Forwardable | Ping | Pong) -> None:
    """(3) Every forwardable message (and PING, PONG) fits in an event, up to the line limit."""
    event = Event(source=b"hub", message=message)
    try:
        wire = ssmp.encode(event)
    except SSMPLocalError as exc:
        # A request-sized payload may not fit once ``000 hub `` is added.
        assert exc.kind == "line-too-long"
        return
    assert client().receive_data(wire) == [event]


@FAST
@given(event=ssmp_events())
def test_round_trip_event(event: Event) -> None:
    """(3) Any event, decoded by a client, is the event the server sent."""
    assert client().receive_data(server().send(event)) == [event]


@FAST
@given(payload=ssmp_payloads())
def test_payload_strategy_is_valid(payload: bytes) -> None:
    """The payload strategy gives 1 to 1,023 bytes without an LF."""
    assert 1 <= len(payload) <= LIMIT - 1
    assert b"\n" not in payload


# --- (4) hypothesis garbage ---------------------------------------------------------------

_GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.lists(st.binary(max_size=30), max_size=12).map(b"\n".join),
    st.lists(
        st.one_of(
            st.sampled_from(
                [b"LOGIN", b"000", b"200", b"MCAST", b"SUBSCRIBE", b"PRESENCE", b"PING", b"."]
            ),
            st.binary(max_size=6),
            st.just(b" "),
            st.just(b"\n"),
        ),
        max_size=40,
    ).map(b"".join),
    st.binary(min_size=1000, max_size=2100).map(lambda b: b.replace(b"\n", b"")),
)


@settings(max_examples=300, deadline=None)
@given(role=st.sampled_from(Role), garbage=_GARBAGE, data=st.data())
def test_garbage_gives_lines_or_ssmp_error(role: Role, garbage: bytes, data: st.DataObject) -> None:
    """(4) Arbitrary bytes, cut anywhere, give SSMP lines or `SSMPError`, nothing else, both roles.

    Every line decoded re-encodes to the exact bytes it came from: decoding
    never loses or invents anything. Only the server's error carries a reply.

    (Roles are drawn rather than parametrized: pytest-twisted's call wrapper
    breaks on parametrized hypothesis tests.)
    """
    make = server if role is Role.SERVER else client
    prefix = LOGIN_BYTES if make is server and data.draw(st.booleans()) else b""
    stream = prefix + garbage
    lines, error = assert_events_or_error(
        make, data.draw(chunkings(stream)), SSMPError, event_types=LINE_TYPES
    )
    consumed = b"".join(ssmp.encode(line) for line in lines)  # type: ignore[arg-type]
    assert stream.startswith(consumed)
    if error is None:
        assert stream.rfind(b"\n") == len(consumed) - 1
    else:
        assert isinstance(error, SSMPError)
        assert (error.reply is not None) == (make is server)


@FAST
@given(lines=st.lists(ssmp_server_lines(budget=200), min_size=1, max_size=6), data=st.data())
def test_mutated_stream_gives_lines_or_ssmp_error(
    lines: list[Response | Event], data: st.DataObject
) -> None:
    """(4) Valid server lines with bytes flipped give lines or `SSMPError` in both roles."""
    wire = bytearray(b"".join(ssmp.encode(line) for line in lines))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        index = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
        wire[index] = data.draw(st.sampled_from([0x0A, 0x20, 0x00, 0x41, 0x61, 0xFF]))
    for make in (server, client):
        assert_events_or_error(
            make, data.draw(chunkings(bytes(wire))), SSMPError, event_types=LINE_TYPES
        )


# --- the MCAST fast path against the general parser ------------------------------------

_MCAST_LINES = st.builds(
    lambda topic, gap, payload: b"MCAST " + topic + gap + payload,
    st.sampled_from([b"news"] * 4 + [b"a.b", b"x@y", b"", b"bad topic", b"b\xe9d", b"n\x00"]),
    st.sampled_from([b" "] * 4 + [b"", b"  "]),
    st.binary(max_size=12).filter(lambda payload: b"\n" not in payload)
    | st.sampled_from([b"", b" ", b"a b c"]),
)


@settings(max_examples=400)
@given(st.lists(_MCAST_LINES | ssmp_requests().map(lambda r: ssmp.encode(r)[:-1]), max_size=20))
def test_mcast_fast_path_parses_as_the_general_parser(lines: list[bytes]) -> None:
    """A server codec decodes a read of requests as `_parse_request` does, one at a time.

    MCASTs to topics it has seen take the fast path; the events are equal,
    and a malformed line fails with the same reason after the same events.
    """
    codec = SSMPCodec(Role.SERVER)
    assert codec.receive_data(b"LOGIN alice open\n") == [
        ssmp.Login(identity=b"alice", scheme=b"open", credential=None)
    ]
    expected: list[ssmp.Line] = []
    reason = None
    for line in lines:
        try:
            expected.append(ssmp._parse_request(line))
        except ssmp._MalformedError as exc:
            reason = exc.reason
            break
    for half in (lines[: len(lines) // 2], lines[len(lines) // 2 :]):  # topics seen carry over
        if not half:
            continue
        try:
            got = codec.receive_data(b"".join(line + b"\n" for line in half))
        except SSMPError as exc:
            assert exc.reason == reason
            got = list(exc.events)
            assert got == expected[: len(got)]
            return
        assert got == expected[: len(got)]
        expected = expected[len(got) :]
    assert reason is None
    assert expected == []


def test_mcast_event_bytes_and_refusals() -> None:
    """The hub's direct MCAST event, byte for byte, and each refusal by its kind."""
    assert ssmp.mcast_event(b"alice", b"news", b"3 apples") == b"000 alice MCAST news 3 apples\n"
    head = ssmp.mcast_head(b".", b"news")
    assert head == b"000 . MCAST news "
    assert ssmp.mcast_line(head, b"x") == b"000 . MCAST news x\n"
    for source, topic, payload, kind in [
        (b"bad id", b"news", b"x", "bad-id"),
        (b"alice", b"bad topic", b"x", "bad-id"),
        (b"alice", b"news", b"", "empty-payload"),
        (b"alice", b"news", b"two\nlines", "lf-in-payload"),
        (b"alice", b"news", b"p" * LIMIT, "line-too-long"),
    ]:
        with pytest.raises(ssmp.SSMPLocalError) as caught:
            ssmp.mcast_event(source, topic, payload)
        assert caught.value.kind == kind


_IDS = st.sampled_from([b"alice", b"news", b".", b"a@b.example", b"", b"bad id", b"x" * 1020])


@given(
    source=_IDS,
    topic=_IDS,
    payload=st.sampled_from([b"hello", b"", b"two\nlines", b"p" * 1000, b"q" * 1100]),
)
def test_mcast_event_is_encode(source: bytes, topic: bytes, payload: bytes) -> None:
    """The hub's direct MCAST event (`mcast_head` then `mcast_line`) is `encode`'s, refusals too."""
    event = Event(source=source, message=ssmp.Mcast(topic=topic, payload=payload))
    try:
        expected: bytes | str = ssmp.encode(event)
    except ssmp.SSMPLocalError as exc:
        expected = exc.kind
    try:
        got: bytes | str = ssmp.mcast_event(source, topic, payload)
    except ssmp.SSMPLocalError as exc:
        got = exc.kind
    assert got == expected
