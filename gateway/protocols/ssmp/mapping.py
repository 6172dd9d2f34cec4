"""SSMP to and from the canonical `Message`: pure functions, no transport.

What SSMP carries of a message: the topic (its address), the payload (its
body) and the sender's peer id. Headers, recipients and message ids have no
place on the SSMP wire and are dropped on the way out; on the way in, the
verb is kept in the ``ssmp.verb`` header.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from gateway.codecs import ssmp
from gateway.core.message import Message, Outcome

__all__ = ["VERB_HEADER", "event_line", "mcast_request", "message_from_mcast"]

VERB_HEADER: Final = "ssmp.verb"
_MCAST_HEADERS: Final = MappingProxyType({VERB_HEADER: "MCAST"})
"""Shared by every MCAST message: read-only, so `Message` keeps it without a copy."""


def message_from_mcast(sender: bytes, topic: bytes, payload: bytes, timestamp: float) -> Message:
    """Map an MCAST (request or event) to a message on its topic."""
    return Message(
        body=payload,
        address=topic.decode("ascii"),
        sender=sender.decode("ascii"),
        headers=_MCAST_HEADERS,
        timestamp=timestamp,
    )


def _carriable(message: Message, address: str | None = None) -> tuple[bytes, bytes] | Outcome:
    address = message.address if address is None else address
    topic = address.encode("ascii", "replace")
    if not ssmp.is_valid_id(topic):
        return Outcome.rejected(
            f"address {address!r} is not a valid SSMP topic (letters, digits and .:@/_-+=~ only)"
        )
    body = message.body
    if not body:
        return Outcome.rejected("SSMP cannot carry an empty message body")
    if b"\n" in body:
        return Outcome.rejected("SSMP cannot carry a message body containing LF")
    return topic, body


def mcast_request(message: Message) -> bytes | Outcome:
    """Encode a message as an ``MCAST`` request line, or say why it cannot be."""
    carriable = _carriable(message)
    if isinstance(carriable, Outcome):
        return carriable
    topic, body = carriable
    try:
        return ssmp.encode(ssmp.Mcast(topic=topic, payload=body))
    except ssmp.SSMPLocalError as exc:
        return Outcome.rejected(f"cannot send over SSMP: {exc.reason}")


def event_line(message: Message, topic: str) -> tuple[bytes, bytes] | Outcome:
    """Encode a message as the ``000 <sender> MCAST <topic>`` event a hub forwards.

    The sender shown is the message's sender when it is a valid SSMP id (a
    peer on another hub keeps its name across a bridge), else the anonymous
    ``.``.

    Returns:
        The topic and the encoded event line, or why it cannot be carried.
    """
    encoded_topic = topic.encode("ascii", "replace")
    sender = (message.sender or ".").encode("ascii", "replace")
    if not ssmp.is_valid_id(sender):
        sender = ssmp.ANONYMOUS
    try:
        return encoded_topic, ssmp.mcast_event(sender, encoded_topic, message.body)
    except ssmp.SSMPLocalError as exc:
        if exc.kind == "bad-id":
            return Outcome.rejected(
                f"address {topic!r} is not a valid SSMP topic (letters, digits and .:@/_-+=~ only)"
            )
        if exc.kind == "lf-in-payload":
            return Outcome.rejected("SSMP cannot carry a message body containing LF")
        if exc.kind == "empty-payload":
            return Outcome.rejected("SSMP cannot carry an empty message body")
        return Outcome.rejected(f"cannot deliver over SSMP: {exc.reason}")
