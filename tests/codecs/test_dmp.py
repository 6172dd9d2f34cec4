"""Tests for `gateway.codecs.dmp`: the DMP dialog and envelopes.

The dialog lines of the spec byte for byte, envelopes written by hand from the
spec's layout (with the 3-octet body length of the spec ambiguity), every
way of splitting the input, hypothesis round trips of envelopes with
arbitrary properties, and refusals with the response a server sends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import dmp
from tests.codec_checks import assert_split_invariant, split_at

SPEC_OK = b"\x0e200 OK DMP/0.1"
READY = b'#200 OK Ready to write to "somesink"'  # 35 = 0x23 = "#"


def server() -> dmp.DMPCodec:
    """A fresh server-role codec."""
    return dmp.DMPCodec(dmp.Role.SERVER)


def client() -> dmp.DMPCodec:
    """A fresh client-role codec."""
    return dmp.DMPCodec(dmp.Role.CLIENT)


def test_the_spec_dialog_server_side() -> None:
    """C: AMQP 10.1.0.1 then the lease; S: 200 OK DMP/0.1, 200 OK Ready to write."""
    assert dmp.PROTOCOL_HEADER == b"AMQP\x0a\x01\x00\x01"
    assert dmp.encode_response(dmp.Response(200, "DMP/0.1")) == SPEC_OK
    assert dmp.encode_response(dmp.Response(200, 'Ready to write to "somesink"')) == READY
    assert_split_invariant(
        server,
        dmp.PROTOCOL_HEADER + b"\x05lease",
        [dmp.ProtocolHeader(), dmp.Lease("lease")],
        trailing=[b"\x00\x00"],
    )


def test_the_spec_dialog_client_side() -> None:
    """The client writes the header and the lease, and reads both responses."""
    codec = client()
    assert codec.send(dmp.ProtocolHeader()) == dmp.PROTOCOL_HEADER
    assert codec.send(dmp.Lease("lease")) == b"\x05lease"
    assert_split_invariant(
        client,
        SPEC_OK + READY,
        [
            dmp.Response(200, "DMP/0.1", "OK"),
            dmp.Response(200, 'Ready to write to "somesink"', "OK"),
        ],
    )


@pytest.mark.parametrize("code", sorted(dmp.REASONS))
def test_every_response_code(code: int) -> None:
    """Each code of the spec is written with its indicator and read back."""
    line = dmp.encode_response(dmp.Response(code, "why"))
    assert line[1:] == f"{code} {dmp.REASONS[code]} why".encode()
    codec = client()
    assert codec.receive_data(line) == [dmp.Response(code, "why", dmp.REASONS[code])]


ENVELOPE = (
    b"\x00\x00\x00\x1b"  # 27 bytes follow
    b"\x02ex"  # exchange
    b"\x03key"  # routing key
    b"\x90\x00"  # flags: content-type (bit 15), delivery-mode (bit 12)
    b"\x0atext/plain"
    b"\x02"  # delivery mode 2
    b"\x02"  # options: mandatory
    b"\x00\x00\x02hi"  # body length 2 (three octets), body
)


def test_an_envelope_by_hand() -> None:
    """Size, two short strings, flags and properties, options, 3-octet body length."""
    envelope = dmp.Envelope(
        exchange="ex",
        routing_key="key",
        properties=dmp.BasicProperties(content_type="text/plain", delivery_mode=2),
        mandatory=True,
        body=b"hi",
    )
    assert dmp.encode_envelope(envelope) == ENVELOPE
    codec = server()
    codec.receive_data(dmp.PROTOCOL_HEADER + b"\x01L")
    assert codec.flowing
    assert_split_invariant(
        lambda: _flowing(server()),
        ENVELOPE + dmp.HEARTBEAT_BYTES + ENVELOPE,
        [envelope, dmp.Heartbeat(), envelope],
        trailing=[b"\x00", ENVELOPE[:10]],
    )


def _flowing(codec: dmp.DMPCodec) -> dmp.DMPCodec:
    codec.receive_data(dmp.PROTOCOL_HEADER + b"\x01L")
    return codec


texts = st.text(max_size=20)
header_values = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | texts | st.binary(max_size=8)
)
properties = st.builds(
    dmp.BasicProperties,
    content_type=st.none() | texts,
    content_encoding=st.none() | texts,
    headers=st.none()
    | st.dictionaries(
        texts,
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | texts
        | st.binary(max_size=8),
        max_size=4,
    ),
    delivery_mode=st.none() | st.integers(0, 255),
    priority=st.none() | st.integers(0, 255),
    correlation_id=st.none() | texts,
    reply_to=st.none() | texts,
    expiration=st.none() | texts,
    message_id=st.none() | texts,
    timestamp=st.none() | st.integers(0, 2**64 - 1),
    type=st.none() | texts,
    user_id=st.none() | texts,
    app_id=st.none() | texts,
    cluster_id=st.none() | texts,
)
envelopes = st.builds(
    dmp.Envelope,
    exchange=texts,
    routing_key=texts,
    properties=properties,
    mandatory=st.booleans(),
    immediate=st.booleans(),
    body=st.binary(max_size=300),
)


@given(st.lists(envelopes, min_size=1, max_size=4), st.data())
def test_envelope_round_trip(items: list[dmp.Envelope], data: st.DataObject) -> None:
    """Envelopes with arbitrary properties come back equal, however the bytes are cut."""
    wire = b"".join(map(dmp.encode_envelope, items))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    codec = _flowing(client() if data.draw(st.booleans()) else server())
    if codec.role is dmp.Role.CLIENT:
        codec = client()
        codec.receive_data(SPEC_OK + READY)
    got: list[object] = []
    start = 0
    for cut in [*cuts, len(wire)]:
        got += codec.receive_data(wire[start:cut])
        start = cut
    assert got == items


@given(st.binary(max_size=80))
def test_garbage_after_the_header_raises_only_dmp_errors(data: bytes) -> None:
    """Anything after the dialog decodes or raises DMPError."""
    codec = _flowing(server())
    with contextlib.suppress(dmp.DMPError):
        codec.receive_data(data)


def test_refusals() -> None:
    """Wrong header: 503 to send; oversized envelope, bad lengths, bad flags: errors to close on."""
    with pytest.raises(dmp.DMPError) as caught:
        server().receive_data(b"HTTP/1.1")
    assert caught.value.response is not None and caught.value.response.code == 503
    codec = dmp.DMPCodec(dmp.Role.SERVER, max_envelope_bytes=100)
    _flowing(codec)
    with pytest.raises(dmp.DMPError, match="over the limit") as caught:
        codec.receive_data(b"\x00\x00\x01\x00")
    assert caught.value.kind == "too-large"
    bad_length = ENVELOPE[:-5] + b"\x00\x00\x09hi"
    with pytest.raises(dmp.DMPError, match="body length says 9"):
        _flowing(server()).receive_data(bad_length)
    continued = ENVELOPE.replace(b"\x90\x00", b"\x90\x01")
    with pytest.raises(dmp.DMPError, match="second word"):
        _flowing(server()).receive_data(continued)
    codec = _flowing(server())
    with pytest.raises(dmp.DMPError):
        codec.receive_data(continued)
    with pytest.raises(dmp.DMPError, match="already failed"):
        codec.receive_data(ENVELOPE)


def test_what_cannot_be_sent() -> None:
    """Bodies over 16 MiB - 1, long names, octets out of range; a role sends only its own."""
    with pytest.raises(dmp.DMPLocalError, match="at most"):
        dmp.encode_envelope(dmp.Envelope(body=bytes(dmp.MAX_BODY_BYTES + 1)))
    with pytest.raises(dmp.DMPLocalError):
        dmp.encode_envelope(dmp.Envelope(exchange="e" * 256))
    with pytest.raises(dmp.DMPLocalError, match="octet"):
        dmp.encode_envelope(dmp.Envelope(properties=dmp.BasicProperties(priority=300)))
    with pytest.raises(dmp.DMPLocalError):
        server().send(dmp.Lease("x"))
    with pytest.raises(dmp.DMPLocalError):
        client().send(dmp.Response(200))


def test_spec_ambiguity_a_four_octet_body_length_is_refused() -> None:
    """The other reading of ``[nnn]``: a peer writing a 4-octet body length is refused, clearly.

    Its envelope's size counts the extra octet, so the 3-octet reading sees a
    body length that disagrees with the size and says so, instead of
    delivering a body with a stray leading zero.
    """
    body = b"hello"
    rest = b"\x00\x00" + b"\x00\x00" + b"\x00" + len(body).to_bytes(4, "big") + body
    wire = len(rest).to_bytes(4, "big") + rest
    with pytest.raises(dmp.DMPError, match="body length says 0 bytes but the size leaves 6"):
        _flowing(server()).receive_data(wire)
    # The same message with the 3-octet length is one byte shorter and accepted.
    ours = dmp.encode_envelope(dmp.Envelope(body=body))
    assert len(ours) == len(wire) - 1
    assert _flowing(server()).receive_data(ours) == [dmp.Envelope(body=body)]


# --- the fast paths against the general code ---------------------------------------------
#
# The fast encoders and decoders decide nothing: what they do not expect they
# leave to the general code (`_encode_envelope_general`, `decode_envelope`),
# which writes the same bytes, gives the same events or says what is wrong.


def _outcome(make: Callable[[], bytes]) -> tuple[str, object]:
    """Bytes, or the error's type and message: what an encoder gave."""
    try:
        return "bytes", make()
    except Exception as exc:  # the very point: whatever it raises, compared
        return type(exc).__name__, str(exc)


@given(envelopes)
def test_the_fast_encoder_writes_what_the_general_one_writes(envelope: dmp.Envelope) -> None:
    """Property: any valid envelope, encode_envelope writes the field-by-field encoder's bytes."""
    assert dmp.encode_envelope(envelope) == dmp._encode_envelope_general(envelope)


@given(
    texts,
    texts,
    st.none() | texts,
    st.none() | st.integers(0, 2**64 - 1),
    properties.map(lambda p: p.headers),
    st.none() | texts,
    st.binary(max_size=300),
)
def test_the_fields_encoder_writes_the_envelope_it_stands_for(
    exchange: str,
    routing_key: str,
    message_id: str | None,
    timestamp: int | None,
    headers: dict[str, object] | None,
    app_id: str | None,
    body: bytes,
) -> None:
    """Property: encode_envelope_fields writes the bytes of the Envelope of those fields."""
    envelope = dmp.Envelope(
        exchange=exchange,
        routing_key=routing_key,
        properties=dmp.BasicProperties(
            message_id=message_id, timestamp=timestamp, headers=headers, app_id=app_id
        ),
        body=body,
    )
    fields = dmp.encode_envelope_fields(
        exchange,
        routing_key,
        body=body,
        message_id=message_id,
        timestamp=timestamp,
        headers=headers,
        app_id=app_id,
    )
    assert fields == dmp._encode_envelope_general(envelope)


# Values of every type a field might be given, in and out of range.
_odd_texts = st.text(max_size=3) | st.text(min_size=250, max_size=300) | st.binary(max_size=3)
_odd_numbers = (
    st.integers(-3, 3)
    | st.integers(250, 300)
    | st.integers(2**64 - 2, 2**64 + 1)
    | st.floats(0, 2)
    | st.booleans()
)
_odd_tables = st.dictionaries(
    st.text(max_size=3) | st.integers(),
    st.text(max_size=3) | st.integers(-(2**65), 2**65) | st.builds(object),
    max_size=2,
)
_KIND_VALUES = {"table": _odd_tables, "octet": _odd_numbers, "timestamp": _odd_numbers}
_odd_properties = st.fixed_dictionaries(
    {},
    optional={
        name: st.none() | _KIND_VALUES.get(kind, _odd_texts) for name, kind in dmp._PROPERTIES
    },
)


@given(_odd_texts, _odd_texts, _odd_properties, _odd_numbers, _odd_numbers, st.binary(max_size=5))
def test_the_fast_encoders_refuse_what_the_general_one_refuses(
    exchange: Any,
    routing_key: Any,
    values: dict[str, Any],
    mandatory: Any,
    immediate: Any,
    body: bytes,
) -> None:
    """Property: with any values, in range or not, both fast encoders end as the general one.

    The same bytes, or the same error (DMPLocalError with the same reason for
    what DMP cannot carry).
    """
    envelope = dmp.Envelope(
        exchange=exchange,
        routing_key=routing_key,
        properties=dmp.BasicProperties(**values),
        mandatory=mandatory,
        immediate=immediate,
        body=body,
    )
    general = _outcome(lambda: dmp._encode_envelope_general(envelope))
    assert _outcome(lambda: dmp.encode_envelope(envelope)) == general
    used = {name: values.get(name) for name in ("message_id", "timestamp", "headers", "app_id")}
    general = _outcome(
        lambda: dmp._encode_envelope_general(
            dmp.Envelope(
                exchange=exchange,
                routing_key=routing_key,
                properties=dmp.BasicProperties(**used),
                body=body,
            )
        )
    )
    assert _outcome(
        lambda: dmp.encode_envelope_fields(exchange, routing_key, body=body, **used)
    ) == (general)


def test_a_body_over_the_limit_is_refused_by_every_encoder() -> None:
    """16 MiB - 1 is the most a 3-octet body length says, whichever encoder writes it."""
    body = bytes(dmp.MAX_BODY_BYTES + 1)
    with pytest.raises(dmp.DMPLocalError, match="at most 16777215 bytes, not 16777216"):
        dmp.encode_envelope_fields("", "", body=body, message_id="m")
    with pytest.raises(dmp.DMPLocalError, match="at most 16777215 bytes, not 16777216"):
        dmp.encode_envelope(dmp.Envelope(body=body))
    assert len(dmp.encode_envelope(dmp.Envelope(body=body[1:]))) == 4 + 8 + dmp.MAX_BODY_BYTES


_LIMIT = 400


def _reference_events(wire: bytes) -> tuple[list[object], dmp.DMPError | None]:
    """What the general decoder makes of a flowing stream: envelope by envelope, from copies."""
    events: list[object] = []
    pos = 0
    while len(wire) - pos >= 4:
        size = int.from_bytes(wire[pos : pos + 4], "big")
        if size == 0:
            events.append(dmp.Heartbeat())
            pos += 4
            continue
        if size > _LIMIT:
            return events, dmp.DMPError(
                f"envelope of {size} bytes, over the limit of {_LIMIT}", kind="too-large"
            )
        if len(wire) - pos - 4 < size:
            break
        try:
            events.append(dmp.decode_envelope(wire[pos + 4 : pos + 4 + size]))
        except dmp.DMPError as exc:
            return events, exc
        pos += 4 + size
    return events, None


def _mutated(wire: bytes, data: st.DataObject) -> bytes:
    """The wire with a few octets changed (lengths, flags, text, anything)."""
    changed = bytearray(wire)
    for _ in range(data.draw(st.integers(0, 3))):
        if changed:
            changed[data.draw(st.integers(0, len(changed) - 1))] = data.draw(st.integers(0, 255))
    return bytes(changed)


@given(st.lists(envelopes, max_size=4), st.data())
def test_decoding_gives_the_general_decoders_events_and_errors(
    items: list[dmp.Envelope], data: st.DataObject
) -> None:
    """Property: valid, mutated or garbage input, cut anywhere: the general decoder's outcome.

    The same events in the same order, and where the general decoder refuses
    an envelope, the same DMPError (reason, place, kind) after the same events.
    """
    wire = b"".join(map(dmp.encode_envelope, items))
    shape = data.draw(st.sampled_from(["valid", "mutated", "garbage"]))
    if shape == "mutated":
        wire = _mutated(wire, data)
    elif shape == "garbage":
        wire = data.draw(st.binary(max_size=120))
    expected, error = _reference_events(wire)
    codec = _flowing(dmp.DMPCodec(dmp.Role.SERVER, max_envelope_bytes=_LIMIT))
    got: list[object] = []
    raised: dmp.DMPError | None = None
    try:
        for chunk in split_at(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=5))):
            got += codec.receive_data(chunk)
    except dmp.DMPError as exc:
        got += exc.events
        raised = exc
    if error is None:
        assert raised is None
        assert got == expected
    else:
        assert raised is not None
        assert got[: len(expected)] == expected and len(got) == len(expected)
        assert (raised.reason, raised.where, raised.kind) == (error.reason, error.where, error.kind)


def _unrolled(events: list[object]) -> list[object]:
    """The events with each `dmp.Bodies` run written out as the bare envelopes it stands for."""
    out: list[object] = []
    for event in events:
        if isinstance(event, dmp.Bodies):
            assert event.bodies, "a run is never empty"
            out += [dmp.Envelope(body=body) for body in event.bodies]
        else:
            out.append(event)
    return out


_bare = st.builds(dmp.Envelope, body=st.binary(max_size=40))
_units = st.lists(
    st.one_of(envelopes, _bare, _bare, st.builds(dmp.Envelope, mandatory=st.just(True))),
    max_size=8,
)


@given(_units, st.data())
def test_runs_of_bare_envelopes_are_the_envelopes_they_stand_for(
    items: list[dmp.Envelope], data: st.DataObject
) -> None:
    """Property: with ``bodies=True``, the same events (runs of bare ones as `Bodies`), any cuts.

    Valid, mutated or garbage input, with null messages among the
    envelopes: written out, the events are those of a codec without
    ``bodies``, the error the same; no run is empty, and within one read no
    two runs follow each other.
    """
    parts = [dmp.encode_envelope(item) for item in items]
    for _ in range(data.draw(st.integers(0, 2))):
        parts.insert(data.draw(st.integers(0, len(parts))), dmp.HEARTBEAT_BYTES)
    wire = b"".join(parts)
    shape = data.draw(st.sampled_from(["valid", "valid", "mutated", "garbage"]))
    if shape == "mutated":
        wire = _mutated(wire, data)
    elif shape == "garbage":
        wire = data.draw(st.binary(max_size=120))
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=5))
    results = []
    for bodies in (False, True):
        codec = _flowing(dmp.DMPCodec(dmp.Role.SERVER, max_envelope_bytes=_LIMIT, bodies=bodies))
        got: list[object] = []
        raised = None
        try:
            for chunk in split_at(wire, cuts):
                read = codec.receive_data(chunk)
                assert not any(  # within one read, a run goes on until something else comes
                    isinstance(a, dmp.Bodies) and isinstance(b, dmp.Bodies)
                    for a, b in itertools.pairwise(read)
                )
                got += read
        except dmp.DMPError as exc:
            got += exc.events
            raised = (exc.reason, exc.where, exc.kind)
        results.append((got, raised))
    (plain, plain_error), (runs, runs_error) = results
    assert _unrolled(runs) == plain
    assert runs_error == plain_error


def test_a_read_of_bare_envelopes_is_one_run() -> None:
    """A read of bare envelopes (a heartbeat among them) gives one `Bodies` per run."""
    bare = dmp.encode_envelope(dmp.Envelope(body=b"b"))
    codec = _flowing(dmp.DMPCodec(dmp.Role.SERVER, bodies=True))
    wire = bare * 3 + dmp.HEARTBEAT_BYTES + bare
    assert codec.receive_data(wire) == [
        dmp.Bodies([b"b", b"b", b"b"]),
        dmp.Heartbeat(),
        dmp.Bodies([b"b"]),
    ]
    [run] = codec.receive_data(bare * 2)
    assert isinstance(run, dmp.Bodies) and all(type(body) is bytes for body in run.bodies)


@given(envelopes, st.data())
def test_the_plain_decoder_decodes_or_leaves_it_to_the_general_one(
    envelope: dmp.Envelope, data: st.DataObject
) -> None:
    """Property: on any envelope content, _decode_plain gives decode_envelope's event or None.

    None (not decoded) is allowed only where the general decoder refuses the
    content; a valid envelope is always decoded by the fast path itself.
    """
    content = dmp.encode_envelope(envelope)[4:]
    assert dmp._decode_plain(memoryview(content), 0, len(content)) == envelope
    content = _mutated(content, data)
    if not content:
        return
    plain = dmp._decode_plain(memoryview(content), 0, len(content))
    try:
        general: object = dmp.decode_envelope(content)
    except dmp.DMPError:
        general = None
    assert plain == general


def test_a_bare_envelope_decodes_to_the_no_properties_singleton() -> None:
    """No flags set: the properties are NO_PROPERTIES itself, as an Envelope's default is."""
    assert dmp.Envelope().properties is dmp.NO_PROPERTIES
    assert dmp.BasicProperties() == dmp.NO_PROPERTIES
    wire = dmp.encode_envelope(dmp.Envelope(routing_key="k", mandatory=True, body=b"b"))
    wire += dmp.encode_envelope(dmp.Envelope(immediate=True, body=b"bare"))
    first, second = _flowing(server()).receive_data(wire)
    assert isinstance(first, dmp.Envelope) and isinstance(second, dmp.Envelope)
    assert first.properties is dmp.NO_PROPERTIES and second.properties is dmp.NO_PROPERTIES
    assert second == dmp.Envelope(immediate=True, body=b"bare")
    assert type(second.body) is bytes


def test_envelopes_made_through_the_slots_are_the_dataclasses() -> None:
    """The decoders' constructors set every field there is: equal to the dataclass's own."""
    assert tuple(field.name for field in dataclasses.fields(dmp.Envelope)) == dmp._ENVELOPE_FIELDS
    assert (
        tuple(field.name for field in dataclasses.fields(dmp.BasicProperties))
        == dmp._PROPERTY_NAMES
    )
    properties = dmp.BasicProperties(message_id="m", priority=3)
    made = dmp._new_envelope("e", "k", properties, True, False, b"body")
    assert made == dmp.Envelope(
        exchange="e", routing_key="k", properties=properties, mandatory=True, body=b"body"
    )
    assert repr(made) == repr(
        dmp.Envelope(
            exchange="e", routing_key="k", properties=properties, mandatory=True, body=b"body"
        )
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.body = b"other"  # type: ignore[misc]


def test_a_read_keeps_only_the_partial_envelope() -> None:
    """Whole envelopes are dropped from the buffer once per read; a partial one stays for later."""
    wire = dmp.encode_envelope(dmp.Envelope(body=b"one")) * 3
    codec = _flowing(server())
    assert len(codec.receive_data(wire + wire[:5])) == 3
    assert bytes(codec._buffer) == wire[:5]
    assert codec.receive_data(wire[5:15]) == [dmp.Envelope(body=b"one")]
    assert not codec._buffer
