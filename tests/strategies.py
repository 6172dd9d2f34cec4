"""Hypothesis strategies for protocol values, shared by codec and router tests.

SSMP (../shared/specs/ssmp.txt, "Grammar"): every strategy yields values that
`gateway.codecs.ssmp.encode` accepts and that decode back to themselves, so
one line is one canonical wire form. Strategies that produce a line take a
``budget``: the most bytes its encoding may take before the LF (1,023 by
default, the spec's 1,024-byte limit less the LF).

QMQP streaming (../shared/specs/qmqp-streaming.txt): every strategy yields
blocks that `gateway.codecs.qmqp.encode` accepts and that decode back to
themselves. Fields are arbitrary bytes (netstrings carry anything), mixed
with mail-like values so that examples stay readable.

RabbitMQ stream (docs/stream-protocol-notes.md, section 5): every strategy
yields events that `gateway.codecs.stream.encode` accepts and that decode back
to equal events: arrays as tuples, Publish and PublishConfirm ids and
messages as lists, maps as dicts, optional fields both absent and present.
`stream_client_events` is what a client sends (a server-role codec reads it),
`stream_server_events` what a server sends.
"""

from __future__ import annotations

import string
import struct

from hypothesis import strategies as st

from gateway.codecs import qmqp, ssmp, stream

__all__ = [
    "SSMP_ID_ALPHABET",
    "SSMP_KNOWN_VERBS",
    "SSMP_MAX_CONTENT_BYTES",
    "qmqp_addresses",
    "qmqp_auth_blocks",
    "qmqp_auth_reply_blocks",
    "qmqp_client_blocks",
    "qmqp_client_sessions",
    "qmqp_ids",
    "qmqp_message_blocks",
    "qmqp_messages",
    "qmqp_reply_blocks",
    "qmqp_server_blocks",
    "qmqp_server_sessions",
    "ssmp_bcasts",
    "ssmp_client_lines",
    "ssmp_compats",
    "ssmp_events",
    "ssmp_forwardables",
    "ssmp_ids",
    "ssmp_lines",
    "ssmp_logins",
    "ssmp_mcasts",
    "ssmp_payloads",
    "ssmp_requests",
    "ssmp_responses",
    "ssmp_server_lines",
    "ssmp_sessions",
    "ssmp_subscribes",
    "ssmp_ucasts",
    "ssmp_unknown_verbs",
    "ssmp_unsubscribes",
    "stream_client_event_strategies",
    "stream_client_events",
    "stream_deliver_events",
    "stream_maps",
    "stream_offset_specs",
    "stream_publish_events",
    "stream_server_event_strategies",
    "stream_server_events",
    "stream_strings",
    "stream_sub_batch_entries",
]

SSMP_MAX_CONTENT_BYTES = ssmp.MAX_LINE_BYTES - 1
"""Longest encoded line before its LF: 1,023 bytes."""

SSMP_ID_ALPHABET = (string.ascii_letters + string.digits + ".:@/_-+=~").encode("ascii")
"""The spec's ``ID`` characters: letters, digits and ``.:@/_-+=~``."""

SSMP_KNOWN_VERBS = frozenset(
    {
        b"LOGIN",
        b"CLOSE",
        b"PING",
        b"PONG",
        b"SUBSCRIBE",
        b"UNSUBSCRIBE",
        b"UCAST",
        b"MCAST",
        b"BCAST",
    }
)
"""Verbs with their own production; a `ssmp.Compat` line never uses them."""

_ID_CHARS = st.sampled_from([bytes([c]) for c in SSMP_ID_ALPHABET])
_SCHEMES = st.sampled_from([b"cert", b"secret", b"open"])


def ssmp_ids(*, max_size: int = 24, anonymous: bool = True) -> st.SearchStrategy[bytes]:
    """Valid identifiers (``1*ID``): peers, topics, schemes, event sources.

    Args:
        max_size: Most characters.
        anonymous: Whether to include the reserved ``.`` (about one draw in
            four), which hubs treat apart; drawn ids may still be ``.`` rarely.
    """
    drawn = st.lists(_ID_CHARS, min_size=1, max_size=max_size).map(b"".join)
    if not anonymous:
        return drawn.filter(lambda ident: ident != ssmp.ANONYMOUS)
    return st.one_of(drawn, drawn, drawn, st.just(ssmp.ANONYMOUS))


def ssmp_payloads(*, max_size: int = SSMP_MAX_CONTENT_BYTES) -> st.SearchStrategy[bytes]:
    r"""Payloads: one to ``max_size`` bytes of anything but LF.

    Mixes short arbitrary bytes (``\x00``, ``\r``, ``\xff``, spaces
    included), space-heavy text, and long runs up to exactly ``max_size`` so
    the line limit is reached.

    Args:
        max_size: Most bytes; at least 1.
    """
    if max_size < 1:
        raise ValueError("a payload needs at least one byte")
    short = st.binary(min_size=1, max_size=min(max_size, 48)).filter(lambda b: b"\n" not in b)
    spaced = (
        st.lists(
            st.sampled_from([b" ", b"\x00", b"\r", b"\xff", b"a", b"\xc3\xa9"]),
            min_size=1,
            max_size=16,
        )
        .map(b"".join)
        .filter(lambda b: len(b) <= max_size)
    )
    unit = st.binary(min_size=1, max_size=4).filter(lambda b: b"\n" not in b)
    size = st.one_of(st.just(max_size), st.integers(min_value=1, max_value=max_size))
    long = st.builds(lambda u, n: (u * n)[:n], unit, size)
    return st.one_of(short, spaced, long)


def _remaining(budget: int, *parts: bytes) -> int:
    """Payload bytes left once ``parts`` and one separator after each are spent."""
    return budget - sum(len(part) + 1 for part in parts)


def ssmp_unknown_verbs() -> st.SearchStrategy[bytes]:
    """Verbs (``1*UPALPHA``) that SSMP 1.0 does not define."""
    return (
        st.text(alphabet=string.ascii_uppercase, min_size=1, max_size=12)
        .map(lambda text: text.encode("ascii"))
        .filter(lambda verb: verb not in SSMP_KNOWN_VERBS)
    )


def _compat_payload_is_canonical(payload: bytes) -> bool:
    """Whether ``verb SP payload`` decodes with no id.

    Spec ambiguity (see ssmp._parse_compat): a first word that is an id is
    read as the id, so payload-only lines exist only when it is not.
    """
    first, sep, after = payload.partition(b" ")
    return not (ssmp.is_valid_id(first) and (not sep or after))


@st.composite
def ssmp_compats(draw: st.DrawFn, *, budget: int = SSMP_MAX_CONTENT_BYTES) -> ssmp.Compat:
    """`ssmp.Compat` lines, each in the one shape that decodes back to it."""
    verb = draw(ssmp_unknown_verbs())
    shape = draw(st.sampled_from(["verb", "id", "id+payload", "payload"]))
    if shape == "verb":
        return ssmp.Compat(verb=verb)
    if shape == "payload":
        payload = draw(
            ssmp_payloads(max_size=_remaining(budget, verb)).filter(_compat_payload_is_canonical)
        )
        return ssmp.Compat(verb=verb, payload=payload)
    ident = draw(ssmp_ids())
    if shape == "id":
        return ssmp.Compat(verb=verb, id=ident)
    payload = draw(ssmp_payloads(max_size=_remaining(budget, verb, ident)))
    return ssmp.Compat(verb=verb, id=ident, payload=payload)


@st.composite
def ssmp_logins(draw: st.DrawFn, *, budget: int = SSMP_MAX_CONTENT_BYTES) -> ssmp.Login:
    """``LOGIN <id> <scheme> [<credential>]`` requests."""
    identity = draw(ssmp_ids())
    scheme = draw(st.one_of(_SCHEMES, ssmp_ids()))
    credential = draw(
        st.none() | ssmp_payloads(max_size=_remaining(budget, b"LOGIN", identity, scheme))
    )
    return ssmp.Login(identity=identity, scheme=scheme, credential=credential)


def ssmp_subscribes() -> st.SearchStrategy[ssmp.Subscribe]:
    """``SUBSCRIBE <topic> [PRESENCE]``."""
    return st.builds(ssmp.Subscribe, topic=ssmp_ids(), presence=st.booleans())


def ssmp_unsubscribes() -> st.SearchStrategy[ssmp.Unsubscribe]:
    """``UNSUBSCRIBE <topic>``."""
    return st.builds(ssmp.Unsubscribe, topic=ssmp_ids())


@st.composite
def ssmp_ucasts(draw: st.DrawFn, *, budget: int = SSMP_MAX_CONTENT_BYTES) -> ssmp.Ucast:
    """``UCAST <to> <payload>``."""
    to = draw(ssmp_ids())
    payload = draw(ssmp_payloads(max_size=_remaining(budget, b"UCAST", to)))
    return ssmp.Ucast(to=to, payload=payload)


@st.composite
def ssmp_mcasts(draw: st.DrawFn, *, budget: int = SSMP_MAX_CONTENT_BYTES) -> ssmp.Mcast:
    """``MCAST <topic> <payload>``."""
    topic = draw(ssmp_ids())
    payload = draw(ssmp_payloads(max_size=_remaining(budget, b"MCAST", topic)))
    return ssmp.Mcast(topic=topic, payload=payload)


def ssmp_bcasts(*, budget: int = SSMP_MAX_CONTENT_BYTES) -> st.SearchStrategy[ssmp.Bcast]:
    """``BCAST <payload>``."""
    return st.builds(ssmp.Bcast, payload=ssmp_payloads(max_size=_remaining(budget, b"BCAST")))


def ssmp_forwardables(
    *, budget: int = SSMP_MAX_CONTENT_BYTES
) -> st.SearchStrategy[ssmp.Forwardable]:
    """Every forwardable message: SUBSCRIBE, UNSUBSCRIBE, UCAST, MCAST, BCAST, compat."""
    return st.one_of(
        ssmp_subscribes(),
        ssmp_unsubscribes(),
        ssmp_ucasts(budget=budget),
        ssmp_mcasts(budget=budget),
        ssmp_bcasts(budget=budget),
        ssmp_compats(budget=budget),
    )


def ssmp_requests(
    *, budget: int = SSMP_MAX_CONTENT_BYTES, login: bool = True
) -> st.SearchStrategy[ssmp.Request]:
    """Every request a client sends: LOGIN, CLOSE, PING, PONG and the forwardables.

    Args:
        budget: Most encoded bytes before the LF.
        login: Whether LOGIN is among them (a server reads it only first,
            or answers 405 later).
    """
    simple: st.SearchStrategy[ssmp.Request] = st.sampled_from(
        [ssmp.Close(), ssmp.Ping(), ssmp.Pong()]
    )
    others: st.SearchStrategy[ssmp.Request] = st.one_of(simple, ssmp_forwardables(budget=budget))
    return st.one_of(ssmp_logins(budget=budget), others) if login else others


def ssmp_responses(*, budget: int = SSMP_MAX_CONTENT_BYTES) -> st.SearchStrategy[ssmp.Response]:
    """``<code> [<payload>]`` with codes 001 to 999 (000 marks an event)."""
    common = st.sampled_from([200, 400, 401, 404, 405, 409, 501])
    code = st.one_of(common, st.integers(min_value=1, max_value=999))
    payload = st.none() | ssmp_payloads(max_size=budget - 4)
    return st.builds(ssmp.Response, code=code, payload=payload)


@st.composite
def ssmp_events(draw: st.DrawFn, *, budget: int = SSMP_MAX_CONTENT_BYTES) -> ssmp.Event:
    """``000 <source> <message>``: each forwardable, PING or PONG."""
    source = draw(ssmp_ids())
    left = _remaining(budget, b"000", source)
    beats: st.SearchStrategy[ssmp.Ping | ssmp.Pong] = st.sampled_from([ssmp.Ping(), ssmp.Pong()])
    message = draw(st.one_of(beats, ssmp_forwardables(budget=left)))
    return ssmp.Event(source=source, message=message)


def ssmp_server_lines(
    *, budget: int = SSMP_MAX_CONTENT_BYTES
) -> st.SearchStrategy[ssmp.Response | ssmp.Event]:
    """What a server sends and a client-role codec decodes: responses and events."""
    return st.one_of(ssmp_responses(budget=budget), ssmp_events(budget=budget))


def ssmp_client_lines(*, budget: int = SSMP_MAX_CONTENT_BYTES) -> st.SearchStrategy[ssmp.Request]:
    """What a client sends and a server-role codec decodes: every request."""
    return ssmp_requests(budget=budget)


def ssmp_lines(*, budget: int = SSMP_MAX_CONTENT_BYTES) -> st.SearchStrategy[ssmp.Line]:
    """Any SSMP line, of either direction."""
    return st.one_of(ssmp_client_lines(budget=budget), ssmp_server_lines(budget=budget))


def ssmp_sessions(*, max_requests: int = 8) -> st.SearchStrategy[list[ssmp.Request]]:
    """A client's requests in a legal order: LOGIN first, then any requests.

    Later requests may include LOGIN too, which a server decodes and answers
    with 405.
    """
    rest = st.lists(ssmp_requests(), max_size=max_requests)
    return st.builds(lambda first, more: [first, *more], ssmp_logins(), rest)


# --- QMQP streaming ------------------------------------------------------------


def qmqp_ids() -> st.SearchStrategy[bytes]:
    """Message identifiers: ``msg<n>`` like the spec's, or any bytes (empty included)."""
    numbered = st.integers(min_value=0, max_value=10**9).map(lambda n: b"msg%d" % n)
    return st.one_of(numbered, st.binary(max_size=24))


def qmqp_addresses() -> st.SearchStrategy[bytes]:
    """Envelope addresses: mail-like, empty (the null sender) or any bytes."""
    local = st.text(alphabet=string.ascii_lowercase + string.digits + ".-", min_size=1, max_size=12)
    domain = st.sampled_from(["example.com", "example.org", "drh.net"])
    mail = st.builds(lambda user, host: f"{user}@{host}".encode("ascii"), local, domain)
    return st.one_of(mail, st.just(b""), st.binary(max_size=40))


def qmqp_messages(*, max_size: int = 2048) -> st.SearchStrategy[bytes]:
    r"""Message texts: any bytes (``:``, ``,``, digits, ``\x00`` included), mail-like, or long.

    Args:
        max_size: Most bytes.
    """
    mail = st.builds(
        lambda subject, body: b"From: a@example.com\nSubject: %b\n\n%b\n" % (subject, body),
        st.binary(max_size=20).map(lambda b: b.replace(b"\n", b" ")),
        st.binary(max_size=200),
    ).filter(lambda m: len(m) <= max_size)
    framing_like = st.lists(
        st.sampled_from([b"1:", b"0:,", b":", b",", b"12", b"D", b"M", b"\n"]), max_size=20
    ).map(b"".join)
    long = st.builds(
        lambda unit, n: (unit * n)[:n],
        st.binary(min_size=1, max_size=8),
        st.integers(min_value=0, max_value=max_size),
    )
    return st.one_of(st.binary(max_size=64), mail, framing_like, long).filter(
        lambda m: len(m) <= max_size
    )


def qmqp_message_blocks(
    *, max_recipients: int = 5, max_message_bytes: int = 2048
) -> st.SearchStrategy[qmqp.MessageBlock]:
    """`qmqp.MessageBlock` with one to ``max_recipients`` recipients."""
    return st.builds(
        qmqp.MessageBlock,
        id=qmqp_ids(),
        message=qmqp_messages(max_size=max_message_bytes),
        sender=qmqp_addresses(),
        recipients=st.lists(qmqp_addresses(), min_size=1, max_size=max_recipients).map(tuple),
    )


def qmqp_auth_blocks() -> st.SearchStrategy[qmqp.AuthBlock]:
    """`qmqp.AuthBlock` with any username and password."""
    text = st.one_of(st.binary(max_size=32), st.just(b"myusername"), st.just(b"the_password"))
    return st.builds(qmqp.AuthBlock, username=text, password=text)


def qmqp_reply_blocks() -> st.SearchStrategy[qmqp.ReplyBlock]:
    """`qmqp.ReplyBlock`: K, Z or D, any description, any pending count."""
    description = st.one_of(
        st.just(b""), st.just(b"ok"), st.binary(max_size=80), st.text(max_size=40).map(str.encode)
    )
    most = 10**qmqp.MAX_PENDING_DIGITS - 1
    pending = st.one_of(
        st.integers(min_value=0, max_value=1000), st.integers(min_value=0, max_value=most)
    )
    return st.builds(
        qmqp.ReplyBlock,
        id=qmqp_ids(),
        status=st.sampled_from([qmqp.K, qmqp.Z, qmqp.D]),
        description=description,
        pending=pending,
    )


def qmqp_auth_reply_blocks() -> st.SearchStrategy[qmqp.AuthReplyBlock]:
    """`qmqp.AuthReplyBlock`, success or failure."""
    return st.builds(qmqp.AuthReplyBlock, success=st.booleans())


def qmqp_client_blocks() -> st.SearchStrategy[qmqp.MessageBlock | qmqp.AuthBlock]:
    """What a client sends before its done block: mostly messages, sometimes auth."""
    return st.one_of(qmqp_message_blocks(), qmqp_message_blocks(), qmqp_auth_blocks())


def qmqp_server_blocks() -> st.SearchStrategy[qmqp.ReplyBlock | qmqp.AuthReplyBlock]:
    """What a server sends before its done block: mostly replies, sometimes an auth reply."""
    return st.one_of(qmqp_reply_blocks(), qmqp_reply_blocks(), qmqp_auth_reply_blocks())


def qmqp_client_sessions(*, max_blocks: int = 8) -> st.SearchStrategy[list[qmqp.ClientBlock]]:
    """A client's blocks in a legal order: any blocks, then (usually) the done block."""
    return st.builds(
        lambda blocks, done: [*blocks, qmqp.DONE] if done else blocks,
        st.lists(qmqp_client_blocks(), max_size=max_blocks),
        st.booleans(),
    )


def qmqp_server_sessions(*, max_blocks: int = 8) -> st.SearchStrategy[list[qmqp.ServerBlock]]:
    """A server's blocks in a legal order: any replies, then (usually) the done block."""
    return st.builds(
        lambda blocks, done: [*blocks, qmqp.DONE] if done else blocks,
        st.lists(qmqp_server_blocks(), max_size=max_blocks),
        st.booleans(),
    )


# --- RabbitMQ stream -------------------------------------------------------------

_U8 = st.integers(min_value=0, max_value=0xFF)
_U16 = st.integers(min_value=0, max_value=0xFFFF)
_U32 = st.integers(min_value=0, max_value=0xFFFFFFFF)
_U64 = st.integers(min_value=0, max_value=2**64 - 1)
_I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_CORRELATION_IDS = st.one_of(st.integers(min_value=0, max_value=20), _U32)
_CODES = st.one_of(st.sampled_from(list(stream.ResponseCode)), _U16)
_NAME_CHARS = string.ascii_letters + string.digits + "-_.:"


def stream_strings(*, max_size: int = 16) -> st.SearchStrategy[str]:
    """Protocol strings: names like rstream's, empty, or any text (multi-byte UTF-8 included).

    Args:
        max_size: Most characters (each at most 4 UTF-8 bytes, far below the
            32,767-byte limit of an int16 length).
    """
    names = st.text(alphabet=_NAME_CHARS, max_size=max_size)
    return st.one_of(names, st.sampled_from(["s1", "", "PLAIN", "/"]), st.text(max_size=max_size))


def stream_maps(
    values: st.SearchStrategy[str] | None = None, *, max_size: int = 4
) -> st.SearchStrategy[dict[str, str]]:
    """Properties and arguments: string keys to string values, empty included."""
    return st.dictionaries(stream_strings(), values or stream_strings(), max_size=max_size)


def _optional_maps() -> st.SearchStrategy[dict[str, str] | None]:
    """A map that may be absent from the frame (None) or present, empty or not."""
    return st.one_of(st.none(), stream_maps())


def _string_tuples(*, max_size: int = 4) -> st.SearchStrategy[tuple[str, ...]]:
    """Arrays of strings, as the codec decodes them: tuples."""
    return st.lists(stream_strings(), max_size=max_size).map(tuple)


def stream_offset_specs() -> st.SearchStrategy[stream.OffsetSpec]:
    """Every offset kind: first, last, next, any uint64 offset, any int64 timestamp."""
    kinds = st.sampled_from(
        [stream.OffsetKind.FIRST, stream.OffsetKind.LAST, stream.OffsetKind.NEXT]
    )
    return st.one_of(
        kinds.map(lambda kind: stream.OffsetSpec(kind=kind)),
        _U64.map(lambda value: stream.OffsetSpec(kind=stream.OffsetKind.OFFSET, value=value)),
        _I64.map(lambda value: stream.OffsetSpec(kind=stream.OffsetKind.TIMESTAMP, value=value)),
    )


@st.composite
def stream_sub_batch_entries(draw: st.DrawFn) -> bytes:
    """A raw v1 sub-batch entry: flags (bit 7 set), records, uncompressed size, size, batch.

    The codec reads only the flags bit and the size; the other header values
    are arbitrary here, as the server validates them itself.
    """
    flags = 0x80 | draw(st.integers(min_value=0, max_value=0x7F))
    batch = draw(st.binary(max_size=48))
    header = struct.pack(">BHII", flags, draw(_U16), draw(_U32), len(batch))
    return header + batch


@st.composite
def stream_publish_events(draw: st.DrawFn, *, max_messages: int = 8) -> stream.Publish:
    """Publish frames: v1 with or without sub-batch entries, or v2 with filter values."""
    count = draw(st.integers(min_value=0, max_value=max_messages))
    ids = draw(st.lists(_U64, min_size=count, max_size=count))
    publisher_id = draw(_U8)
    if draw(st.booleans()):
        filters = draw(st.lists(st.none() | stream_strings(), min_size=count, max_size=count))
        return stream.Publish(
            publisher_id=publisher_id,
            publishing_ids=ids,
            messages=draw(st.lists(st.binary(max_size=64), min_size=count, max_size=count)),
            version=2,
            filter_values=filters,
        )
    flags = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    messages = [
        draw(stream_sub_batch_entries() if flag else st.binary(max_size=64)) for flag in flags
    ]
    return stream.Publish(
        publisher_id=publisher_id,
        publishing_ids=ids,
        messages=messages,
        sub_batches=flags if any(flags) else None,
    )


def stream_deliver_events() -> st.SearchStrategy[stream.Deliver]:
    """Deliver v1 and v2 with opaque chunks (osiris parses them, not the frame codec)."""
    chunks = st.binary(max_size=160)
    v1 = st.builds(stream.Deliver, subscription_id=_U8, chunk=chunks)
    v2 = st.builds(
        stream.Deliver,
        subscription_id=_U8,
        chunk=chunks,
        version=st.just(2),
        committed_chunk_id=_U64,
    )
    return st.one_of(v1, v2)


def _consumer_update_responses() -> st.SearchStrategy[stream.ConsumerUpdateResponse]:
    """Type 0 (None) or 1-3 with any ignored bytes after them; types 4 and 5 without."""
    ignorable = st.one_of(st.none(), stream_offset_specs().filter(lambda s: s.value is None))
    loose = st.builds(
        stream.ConsumerUpdateResponse,
        correlation_id=_CORRELATION_IDS,
        code=_CODES,
        offset_spec=ignorable,
        ignored=st.one_of(st.just(b""), st.just(bytes(8)), st.binary(max_size=12)),
    )
    strict = st.builds(
        stream.ConsumerUpdateResponse,
        correlation_id=_CORRELATION_IDS,
        code=_CODES,
        offset_spec=stream_offset_specs().filter(lambda s: s.value is not None),
    )
    return st.one_of(loose, strict)


def _command_versions() -> st.SearchStrategy[tuple[stream.CommandVersion, ...]]:
    """ExchangeCommandVersions entries: known keys mostly, any uint16 values."""
    keys = st.one_of(st.sampled_from(list(stream.Key)), _U16)
    entry = st.builds(stream.CommandVersion, key=keys, min_version=_U16, max_version=_U16)
    return st.lists(entry, max_size=6).map(tuple)


def _metadata_responses() -> st.SearchStrategy[stream.MetadataResponse]:
    """Brokers and per-stream metadata, leaders included and absent (`stream.NO_LEADER`)."""
    broker = st.builds(stream.Broker, reference=_U16, host=stream_strings(), port=_U32)
    metadata = st.builds(
        stream.StreamMetadata,
        stream=stream_strings(),
        code=_CODES,
        leader=st.one_of(st.just(stream.NO_LEADER), _U16),
        replicas=st.lists(_U16, max_size=4).map(tuple),
    )
    return st.builds(
        stream.MetadataResponse,
        correlation_id=_CORRELATION_IDS,
        brokers=st.lists(broker, max_size=3).map(tuple),
        streams=st.lists(metadata, max_size=3).map(tuple),
    )


def stream_client_event_strategies() -> dict[type, st.SearchStrategy[stream.Event]]:
    """One strategy per event class a client sends, keyed by the class."""
    corr = _CORRELATION_IDS
    text = stream_strings()
    return {
        stream.PeerProperties: st.builds(
            stream.PeerProperties, correlation_id=corr, properties=stream_maps()
        ),
        stream.SaslHandshake: st.builds(stream.SaslHandshake, correlation_id=corr),
        stream.SaslAuthenticate: st.builds(
            stream.SaslAuthenticate,
            correlation_id=corr,
            mechanism=text,
            data=st.one_of(st.none(), st.just(b"\x00guest\x00guest"), st.binary(max_size=40)),
        ),
        stream.Tune: st.builds(stream.Tune, frame_max=_U32, heartbeat=_U32),
        stream.Open: st.builds(stream.Open, correlation_id=corr, virtual_host=text),
        stream.Close: st.builds(stream.Close, correlation_id=corr, code=_CODES, reason=text),
        stream.CloseResponse: st.builds(stream.CloseResponse, correlation_id=corr, code=_CODES),
        stream.Heartbeat: st.just(stream.HEARTBEAT),
        stream.DeclarePublisher: st.builds(
            stream.DeclarePublisher,
            correlation_id=corr,
            publisher_id=_U8,
            reference=text,
            stream=text,
        ),
        stream.Publish: stream_publish_events(),
        stream.QueryPublisherSequence: st.builds(
            stream.QueryPublisherSequence, correlation_id=corr, reference=text, stream=text
        ),
        stream.DeletePublisher: st.builds(
            stream.DeletePublisher, correlation_id=corr, publisher_id=_U8
        ),
        stream.Subscribe: st.builds(
            stream.Subscribe,
            correlation_id=corr,
            subscription_id=_U8,
            stream=text,
            offset_spec=stream_offset_specs(),
            credit=_U16,
            properties=_optional_maps(),
        ),
        stream.Credit: st.builds(stream.Credit, subscription_id=_U8, credit=_U16),
        stream.StoreOffset: st.builds(stream.StoreOffset, reference=text, stream=text, offset=_U64),
        stream.QueryOffset: st.builds(
            stream.QueryOffset, correlation_id=corr, reference=text, stream=text
        ),
        stream.Unsubscribe: st.builds(stream.Unsubscribe, correlation_id=corr, subscription_id=_U8),
        stream.Create: st.builds(
            stream.Create, correlation_id=corr, stream=text, arguments=stream_maps()
        ),
        stream.Delete: st.builds(stream.Delete, correlation_id=corr, stream=text),
        stream.Metadata: st.builds(stream.Metadata, correlation_id=corr, streams=_string_tuples()),
        stream.Route: st.builds(
            stream.Route, correlation_id=corr, routing_key=text, super_stream=text
        ),
        stream.Partitions: st.builds(stream.Partitions, correlation_id=corr, super_stream=text),
        stream.ConsumerUpdateResponse: _consumer_update_responses(),
        stream.ExchangeCommandVersions: st.builds(
            stream.ExchangeCommandVersions, correlation_id=corr, versions=_command_versions()
        ),
        stream.StreamStats: st.builds(stream.StreamStats, correlation_id=corr, stream=text),
        stream.CreateSuperStream: st.builds(
            stream.CreateSuperStream,
            correlation_id=corr,
            name=text,
            partitions=_string_tuples(),
            binding_keys=_string_tuples(),
            arguments=stream_maps(),
        ),
        stream.DeleteSuperStream: st.builds(
            stream.DeleteSuperStream, correlation_id=corr, name=text
        ),
        stream.ResolveOffsetSpec: st.builds(
            stream.ResolveOffsetSpec,
            correlation_id=corr,
            stream=text,
            offset_spec=stream_offset_specs(),
            properties=_optional_maps(),
        ),
    }


def stream_server_event_strategies() -> dict[type, st.SearchStrategy[stream.Event]]:
    """One strategy per event class a server sends, keyed by the class."""
    corr = _CORRELATION_IDS
    text = stream_strings()
    ids = st.lists(_U64, max_size=12)
    return {
        stream.Response: st.builds(
            stream.Response,
            key=st.sampled_from(
                [
                    stream.Key.DECLARE_PUBLISHER,
                    stream.Key.DELETE_PUBLISHER,
                    stream.Key.SUBSCRIBE,
                    stream.Key.UNSUBSCRIBE,
                    stream.Key.CREATE,
                    stream.Key.DELETE,
                    stream.Key.CREATE_SUPER_STREAM,
                    stream.Key.DELETE_SUPER_STREAM,
                ]
            ),
            correlation_id=corr,
            code=_CODES,
        ),
        stream.PeerPropertiesResponse: st.builds(
            stream.PeerPropertiesResponse,
            correlation_id=corr,
            code=_CODES,
            properties=stream_maps(),
        ),
        stream.SaslHandshakeResponse: st.builds(
            stream.SaslHandshakeResponse,
            correlation_id=corr,
            code=_CODES,
            mechanisms=_string_tuples(),
        ),
        stream.SaslAuthenticateResponse: st.builds(
            stream.SaslAuthenticateResponse,
            correlation_id=corr,
            code=_CODES,
            challenge=st.one_of(st.none(), st.binary(max_size=40)),
        ),
        stream.Tune: st.builds(stream.Tune, frame_max=_U32, heartbeat=_U32),
        stream.OpenResponse: st.builds(
            stream.OpenResponse, correlation_id=corr, code=_CODES, properties=_optional_maps()
        ),
        stream.Close: st.builds(stream.Close, correlation_id=corr, code=_CODES, reason=text),
        stream.CloseResponse: st.builds(stream.CloseResponse, correlation_id=corr, code=_CODES),
        stream.Heartbeat: st.just(stream.HEARTBEAT),
        stream.PublishConfirm: st.builds(
            stream.PublishConfirm, publisher_id=_U8, publishing_ids=ids
        ),
        stream.PublishError: st.lists(st.tuples(_U64, _CODES), max_size=8).flatmap(
            lambda pairs: st.builds(
                stream.PublishError,
                publisher_id=_U8,
                publishing_ids=st.just([pair[0] for pair in pairs]),
                codes=st.just([pair[1] for pair in pairs]),
            )
        ),
        stream.QueryPublisherSequenceResponse: st.builds(
            stream.QueryPublisherSequenceResponse, correlation_id=corr, code=_CODES, sequence=_U64
        ),
        stream.Deliver: stream_deliver_events(),
        stream.CreditResponse: st.builds(stream.CreditResponse, code=_CODES, subscription_id=_U8),
        stream.QueryOffsetResponse: st.builds(
            stream.QueryOffsetResponse, correlation_id=corr, code=_CODES, offset=_U64
        ),
        stream.MetadataResponse: _metadata_responses(),
        stream.MetadataUpdate: st.builds(stream.MetadataUpdate, code=_CODES, stream=text),
        stream.RouteResponse: st.builds(
            stream.RouteResponse, correlation_id=corr, code=_CODES, streams=_string_tuples()
        ),
        stream.PartitionsResponse: st.builds(
            stream.PartitionsResponse, correlation_id=corr, code=_CODES, streams=_string_tuples()
        ),
        stream.ConsumerUpdate: st.builds(
            stream.ConsumerUpdate, correlation_id=corr, subscription_id=_U8, active=st.booleans()
        ),
        stream.ExchangeCommandVersionsResponse: st.builds(
            stream.ExchangeCommandVersionsResponse,
            correlation_id=corr,
            code=_CODES,
            versions=_command_versions(),
        ),
        stream.StreamStatsResponse: st.builds(
            stream.StreamStatsResponse,
            correlation_id=corr,
            code=_CODES,
            statistics=st.dictionaries(stream_strings(), _I64, max_size=4),
        ),
        stream.ResolveOffsetSpecResponse: st.builds(
            stream.ResolveOffsetSpecResponse,
            correlation_id=corr,
            code=_CODES,
            offset_type=st.one_of(st.just(int(stream.OffsetKind.OFFSET)), _U16),
            offset=_U64,
        ),
    }


def stream_client_events() -> st.SearchStrategy[stream.Event]:
    """Any event a client sends (and a server-role codec reads)."""
    return st.one_of(*stream_client_event_strategies().values())


def stream_server_events() -> st.SearchStrategy[stream.Event]:
    """Any event a server sends (and a client-role codec reads)."""
    return st.one_of(*stream_server_event_strategies().values())
