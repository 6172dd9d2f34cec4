"""Tests for `gateway.codecs.dmp`: the DMP dialog and envelopes.

The dialog lines of the spec byte for byte, envelopes written by hand from the
spec's layout (with the 3-octet body length of the spec ambiguity), every
way of splitting the input, hypothesis round trips of envelopes with
arbitrary properties, and refusals with the response a server sends.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import dmp
from tests.codec_checks import assert_split_invariant

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
