"""Tests for `gateway.protocols.mtl.mapping`: MTL Content to and from messages, no transport.

The shortcuts for the common case (a Content without properties in, a
message without headers out) give what the full mapping gives.
"""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.message import Message
from gateway.protocols.mtl.mapping import content_properties, message_from_content

ARRIVAL = 1_700_000_000.5


@given(st.text(max_size=10), st.binary(max_size=20), st.integers() | st.binary(max_size=3))
def test_a_content_without_properties_maps_as_one_without_text_properties(
    resource: str, body: bytes, other: int | bytes
) -> None:
    """No properties: the resource, the body, the arrival time, a fresh id, nothing else.

    The same message as a Content whose only property is not text (which
    the full mapping leaves out), but for the generated id.
    """
    bare = message_from_content(resource, {}, body, ARRIVAL)
    assert (bare.address, bare.body, bare.timestamp) == (resource, body, ARRIVAL)
    assert bare.sender is None and dict(bare.headers) == {} and bare.id
    full = message_from_content(resource, {"n": other}, body, ARRIVAL)
    assert attrs.evolve(bare, id=full.id) == full


@given(st.text(max_size=10), st.none() | st.text(min_size=1, max_size=10), st.integers())
def test_a_message_without_headers_gets_its_id_and_sender_only(
    message_id: str, sender: str | None, other: int
) -> None:
    """No headers: ``message-id`` (and ``x-gateway-sender``), as for non-text headers only."""
    bare = Message(id=message_id, address="r", body=b"", sender=sender)
    expected = {"message-id": message_id}
    if sender:
        expected["x-gateway-sender"] = sender
    assert content_properties(bare) == expected
    assert content_properties(attrs.evolve(bare, headers={"n": other})) == expected
