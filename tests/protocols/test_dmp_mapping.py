"""Tests for `gateway.protocols.dmp.mapping`: DMP envelopes to and from messages, no transport.

The behaviour checked is the module's docstring: a sink's address and
headers in, a feed's envelope properties out, and a round trip through the
codec that keeps what a message is.
"""

from __future__ import annotations

import string
from collections.abc import Callable

import attrs
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import dmp
from gateway.core.message import Message
from gateway.protocols.dmp.mapping import (
    APP_ID,
    RECIPIENTS_HEADER,
    SENDER_HEADER,
    encode_message,
    envelope_from_message,
    message_from_envelope,
    messages_from_bodies,
)

ARRIVAL = 1_700_000_000.25


def test_a_bare_envelope_is_a_message_on_the_sink() -> None:
    """No routing key, no properties: the sink's name, the body, a fresh id, the arrival time."""
    message = message_from_envelope(dmp.Envelope(body=b"hello"), "orders", ARRIVAL)
    assert (message.address, message.body, message.timestamp) == ("orders", b"hello", ARRIVAL)
    assert message.sender is None and message.recipients == ()
    assert dict(message.headers) == {}
    assert message.id  # generated
    again = message_from_envelope(dmp.Envelope(body=b"hello"), "orders", ARRIVAL)
    assert again.id != message.id


@given(st.lists(st.binary(max_size=20), max_size=5), st.sampled_from(["orders", "s"]))
def test_a_run_of_bodies_is_its_bare_envelopes_messages(bodies: list[bytes], sink: str) -> None:
    """Property: each body's message is its bare envelope's but for its fresh id; ids differ."""
    made = messages_from_bodies(bodies, sink, ARRIVAL)
    assert len(made) == len(bodies)
    for message, body in zip(made, bodies, strict=True):
        alone = message_from_envelope(dmp.Envelope(body=body), sink, ARRIVAL)
        assert message == attrs.evolve(alone, id=message.id)
    assert len({message.id for message in made}) == len(made)


def test_routing_key_exchange_and_properties_become_address_and_headers() -> None:
    """``S.K`` as the address; message-id, timestamp, sender; the rest as ``dmp.*`` headers."""
    envelope = dmp.Envelope(
        exchange="amq.direct",
        routing_key="eu.fr",
        properties=dmp.BasicProperties(
            message_id="m-7",
            timestamp=1_600_000_000,
            content_type="text/plain",
            correlation_id="c-1",
            app_id="shop",
            headers={
                SENDER_HEADER: "app@example.org",
                RECIPIENTS_HEADER: ["a@example.org", "b@example.org"],
                "text": "v",
                "raw": b"\xffbytes",
                "count": 3,
                "nothing": None,
            },
        ),
        body=b"order",
    )
    message = message_from_envelope(envelope, "orders", ARRIVAL)
    assert message.address == "orders.eu.fr"
    assert (message.id, message.timestamp, message.sender) == (
        "m-7",
        1_600_000_000.0,
        "app@example.org",
    )
    assert dict(message.headers) == {
        RECIPIENTS_HEADER: "a@example.org,b@example.org",
        "text": "v",
        "raw": "\ufffdbytes",
        "count": "3",
        "dmp.content-type": "text/plain",
        "dmp.correlation-id": "c-1",
        "dmp.app-id": "shop",
        "dmp.exchange": "amq.direct",
        "dmp.routing-key": "eu.fr",
    }


def test_an_empty_sender_header_is_no_sender() -> None:
    """``x-gateway-sender`` empty means the null sender."""
    envelope = dmp.Envelope(properties=dmp.BasicProperties(headers={SENDER_HEADER: ""}))
    assert message_from_envelope(envelope, "s", ARRIVAL).sender is None


def test_a_bare_message_gets_id_timestamp_and_app_id_only() -> None:
    """A message without sender, recipients or headers: message-id, timestamp, app-id, no table."""
    message = Message(id="m-1", address="alerts", body=b"x", timestamp=ARRIVAL)
    envelope = envelope_from_message(message, "feed")
    assert (envelope.exchange, envelope.routing_key, envelope.body) == ("feed", "alerts", b"x")
    assert envelope.properties == dmp.BasicProperties(
        message_id="m-1", timestamp=int(ARRIVAL), app_id=APP_ID
    )


def test_headers_go_back_to_their_properties_and_the_table() -> None:
    """``dmp.*`` text properties return to their places; other text headers join the table."""
    message = Message(
        id="m-2",
        address="alerts",
        body=b"x",
        sender="a@b",
        headers={
            "dmp.content-type": "text/plain",
            "dmp.app-id": "shop",
            "dmp.exchange": "amq.direct",
            "dmp.routing-key": "eu",
            RECIPIENTS_HEADER: "c@d,,e@f",
            "k": "v",
            "n": 4,
        },
    )
    properties = envelope_from_message(message).properties
    assert properties.content_type == "text/plain"
    assert properties.app_id == "shop"
    assert properties.timestamp is None
    assert properties.headers == {SENDER_HEADER: "a@b", RECIPIENTS_HEADER: ["c@d", "e@f"], "k": "v"}


def test_recipients_win_over_a_recipients_header() -> None:
    """A message with recipients sends them, not a stale ``x-gateway-recipients`` header."""
    message = Message(
        address="alerts", body=b"", recipients=("x@y",), headers={RECIPIENTS_HEADER: "old@z"}
    )
    assert envelope_from_message(message).properties.headers == {RECIPIENTS_HEADER: ["x@y"]}


_text = st.text(alphabet=string.ascii_letters + string.digits + "-_@.", min_size=1, max_size=20)
_header_names = _text.filter(lambda name: not name.startswith(("dmp.", "x-gateway-")))


@given(
    message_id=_text,
    body=st.binary(max_size=200),
    sender=st.none() | _text,
    key=st.none() | _text,
    headers=st.dictionaries(_header_names, _text, max_size=4),
    content_type=st.none() | _text,
    timestamp=st.integers(1, 2**40),
)
def test_a_message_survives_a_trip_through_a_feed_and_a_sink(
    message_id: str,
    body: bytes,
    sender: str | None,
    key: str | None,
    headers: dict[str, str],
    content_type: str | None,
    timestamp: int,
) -> None:
    """Property: written to a feed as bytes and read back by a sink, a message keeps itself.

    Its id, body, sender, time, text headers and ``dmp.*`` text properties
    come back; its address is the sink's with the routing key appended.
    """
    all_headers = dict(headers)
    if content_type is not None:
        all_headers["dmp.content-type"] = content_type
    message = Message(
        id=message_id,
        address=key or "",
        body=body,
        sender=sender,
        headers=all_headers,
        timestamp=float(timestamp),
    )
    data = dmp.encode_envelope(envelope_from_message(message))
    [envelope] = _reader().receive_data(data)
    assert isinstance(envelope, dmp.Envelope)
    back = message_from_envelope(envelope, "sink", ARRIVAL)
    assert (back.id, back.body, back.sender, back.timestamp) == (
        message_id,
        body,
        sender,
        float(timestamp),
    )
    assert back.address == (f"sink.{key}" if key else "sink")
    expected = {**all_headers, "dmp.app-id": APP_ID}
    if key:
        expected["dmp.routing-key"] = key
    assert dict(back.headers) == expected


def _reader() -> dmp.DMPCodec:
    """A client codec past its dialog, reading envelopes."""
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    codec.receive_data(
        dmp.encode_response(dmp.Response(200, "DMP/0.1"))
        + dmp.encode_response(dmp.Response(200, "Ready"))
    )
    return codec


_any_text = st.text(max_size=12) | st.text(min_size=250, max_size=270)
_header_keys = st.sampled_from(
    [
        "dmp.content-type",
        "dmp.app-id",
        "dmp.user-id",
        "dmp.exchange",
        "dmp.routing-key",
        RECIPIENTS_HEADER,
        SENDER_HEADER,
        "k",
    ]
) | st.text(max_size=8)
_messages = st.builds(
    Message,
    body=st.binary(max_size=50),
    address=_any_text,
    id=_any_text,
    sender=st.none() | _any_text,
    recipients=st.lists(_any_text, max_size=2).map(tuple),
    headers=st.dictionaries(_header_keys, _any_text | st.integers() | st.booleans(), max_size=4),
    timestamp=st.sampled_from([0.0, ARRIVAL]) | st.floats(0, 2**40),
)


def _outcome(make: Callable[[], bytes]) -> tuple[str, object]:
    """Bytes, or the error's type and message."""
    try:
        return "bytes", make()
    except dmp.DMPLocalError as exc:
        return "DMPLocalError", exc.reason


@given(_messages, st.sampled_from(["", "feed", "é" * 200]))
def test_encode_message_writes_the_envelope_of_envelope_from_message(
    message: Message, exchange: str
) -> None:
    """Property: any message, the bytes (or the refusal) of its envelope, built or not."""
    assert _outcome(lambda: encode_message(message, exchange)) == _outcome(
        lambda: dmp.encode_envelope(envelope_from_message(message, exchange))
    )


@given(st.sampled_from(["", "k", "eu.fr"]), st.binary(max_size=20))
def test_a_bare_envelope_maps_as_one_with_empty_properties(routing_key: str, body: bytes) -> None:
    """The shortcut for NO_PROPERTIES gives what the full mapping gives for empty properties."""
    bare = dmp.Envelope(routing_key=routing_key, body=body)
    assert bare.properties is dmp.NO_PROPERTIES
    empty = dmp.Envelope(routing_key=routing_key, properties=dmp.BasicProperties(), body=body)
    assert empty.properties is not dmp.NO_PROPERTIES
    fast = message_from_envelope(bare, "sink", ARRIVAL)
    full = message_from_envelope(empty, "sink", ARRIVAL)
    assert attrs.evolve(fast, id=full.id) == full
