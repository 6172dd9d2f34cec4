"""SSMP to and from the canonical `Message`: pure functions, no transport.

What SSMP carries of a message: where it goes (its address), the payload
(its body) and the sender's peer id. Headers, recipients and message ids
have no place on the SSMP wire and are dropped on the way out; on the way
in, the verb is kept in the ``ssmp.verb`` header.

Addresses. An MCAST's address is its topic. UCAST and BCAST have address
forms of their own, which no topic can collide with because ``!`` is not an
SSMP id character (spec, "Grammar"), and which route patterns match like any
other address (``.`` separates words):

* ``!ucast.<peer id>``: a UCAST to that peer (``!ucast.#`` matches every
  peer id, dots and ``@`` included; ``{1}`` is the id);
* ``!bcast``: a BCAST.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from gateway.codecs import ssmp
from gateway.core.message import Message, Outcome

__all__ = [
    "BCAST_ADDRESS",
    "UCAST_PREFIX",
    "VERB_HEADER",
    "EventLines",
    "bcast_event",
    "event_line",
    "mcast_message",
    "message_from_bcast",
    "message_from_mcast",
    "message_from_ucast",
    "outcome_from_response",
    "request_line",
    "ucast_address",
    "ucast_event",
    "ucast_peer",
]

VERB_HEADER: Final = "ssmp.verb"
UCAST_PREFIX: Final = "!ucast."
"""``!ucast.<peer id>`` is the address of a UCAST to that peer."""
BCAST_ADDRESS: Final = "!bcast"
"""The address of a BCAST."""

_MCAST_HEADERS: Final = MappingProxyType({VERB_HEADER: "MCAST"})
"""Shared by every MCAST message: read-only, so `Message` keeps it without a copy."""
_UCAST_HEADERS: Final = MappingProxyType({VERB_HEADER: "UCAST"})
_BCAST_HEADERS: Final = MappingProxyType({VERB_HEADER: "BCAST"})
_UCAST_PREFIX_LENGTH: Final = len(UCAST_PREFIX)
_ACCEPTED: Final = Outcome.accepted()
_BAD_TOPIC: Final = "is not a valid SSMP topic (letters, digits and .:@/_-+=~ only)"
_BAD_PEER: Final = "does not name a valid SSMP peer id (letters, digits and .:@/_-+=~ only)"


def ucast_address(peer: bytes) -> str:
    """The address of a UCAST to ``peer``."""
    return UCAST_PREFIX + peer.decode("ascii")


def ucast_peer(address: str) -> str | None:
    """The peer id of a UCAST address, or None if ``address`` is not one."""
    if address.startswith(UCAST_PREFIX):
        return address[_UCAST_PREFIX_LENGTH:]
    return None


def message_from_mcast(sender: bytes, topic: bytes, payload: bytes, timestamp: float) -> Message:
    """Map an MCAST (request or event) to a message on its topic."""
    return mcast_message(sender.decode("ascii"), topic.decode("ascii"), payload, timestamp)


def mcast_message(sender: str, topic: str, payload: bytes, timestamp: float) -> Message:
    """`message_from_mcast` with the sender and topic decoded already (the hub's hot path)."""
    return Message.arrived(payload, topic, sender, _MCAST_HEADERS, timestamp)


def message_from_ucast(sender: bytes, to: bytes, payload: bytes, timestamp: float) -> Message:
    """Map a UCAST (request or event) to a message on ``!ucast.<to>``."""
    return Message(
        body=payload,
        address=ucast_address(to),
        sender=sender.decode("ascii"),
        headers=_UCAST_HEADERS,
        timestamp=timestamp,
    )


def message_from_bcast(sender: bytes, payload: bytes, timestamp: float) -> Message:
    """Map a BCAST (request or event) to a message on ``!bcast``."""
    return Message(
        body=payload,
        address=BCAST_ADDRESS,
        sender=sender.decode("ascii"),
        headers=_BCAST_HEADERS,
        timestamp=timestamp,
    )


def request_line(message: Message) -> bytes | Outcome:
    """Encode a message as the request that sends it, or say why it cannot be.

    ``!ucast.<peer>`` becomes ``UCAST <peer> <body>``, ``!bcast`` becomes
    ``BCAST <body>`` and any other address ``MCAST <address> <body>``.
    """
    address = message.address
    body = message.body
    request: ssmp.Request
    peer = ucast_peer(address)
    if peer is not None:
        request = ssmp.Ucast(to=peer.encode("ascii", "replace"), payload=body)
    elif address == BCAST_ADDRESS:
        request = ssmp.Bcast(payload=body)
    else:
        request = ssmp.Mcast(topic=address.encode("ascii", "replace"), payload=body)
    try:
        return ssmp.encode(request)
    except ssmp.SSMPLocalError as exc:
        return _refusal(exc, address, "cannot send over SSMP")


def outcome_from_response(upstream: str, response: ssmp.Response) -> Outcome:
    """Map a server's response to a request to that request's outcome.

    ``200`` is accepted; any other code is rejected, carrying the code and
    the server's text (SSMP has no code for "try again later").
    """
    if response.code == 200:
        return _ACCEPTED
    text = (response.payload or b"").decode("utf-8", "replace")
    return Outcome.rejected(
        f"{upstream} answered {response.code} {text}".rstrip(), code=str(response.code)
    )


def _refusal(exc: ssmp.SSMPLocalError, address: str, doing: str) -> Outcome:
    if exc.kind == "bad-id":
        if address.startswith(UCAST_PREFIX):
            return Outcome.rejected(f"address {address!r} {_BAD_PEER}")
        return Outcome.rejected(f"address {address!r} {_BAD_TOPIC}")
    if exc.kind == "lf-in-payload":
        return Outcome.rejected("SSMP cannot carry a message body containing LF")
    if exc.kind == "empty-payload":
        return Outcome.rejected("SSMP cannot carry an empty message body")
    return Outcome.rejected(f"{doing}: {exc.reason}")


def _sender(message: Message) -> bytes:
    sender = (message.sender or ".").encode("ascii", "replace")
    return sender if ssmp.is_valid_id(sender) else ssmp.ANONYMOUS


def event_line(message: Message, topic: str) -> tuple[bytes, bytes] | Outcome:
    """Encode a message as the ``000 <sender> MCAST <topic>`` event a hub forwards.

    The sender shown is the message's sender when it is a valid SSMP id (a
    peer on another hub keeps its name across a bridge), else the anonymous
    ``.``.

    Returns:
        The topic and the encoded event line, or why it cannot be carried.
    """
    encoded_topic = topic.encode("ascii", "replace")
    try:
        return encoded_topic, ssmp.mcast_event(_sender(message), encoded_topic, message.body)
    except ssmp.SSMPLocalError as exc:
        return _refusal(exc, topic, "cannot deliver over SSMP")


class EventLines:
    """`event_line` for a batch's messages: the event's head made once per sender and topic.

    A batch's messages mostly share both (one route, one address), and
    checking and encoding them cost more than the rest of the line.
    """

    __slots__ = ("_head", "_sender", "_topic")

    def __init__(self) -> None:
        self._sender: str | None = None
        self._topic: str | None = None
        self._head: tuple[bytes, bytes] | Outcome = (b"", b"")  # made by the first `line`
        """The encoded topic and the events' head, or why that topic cannot be carried."""

    def line(self, message: Message, topic: str) -> tuple[bytes, bytes] | Outcome:
        """`event_line`: the topic and the encoded event line, or why it cannot be carried."""
        if topic != self._topic or message.sender != self._sender:
            self._sender, self._topic = message.sender, topic
            encoded_topic = topic.encode("ascii", "replace")
            try:
                self._head = encoded_topic, ssmp.mcast_head(_sender(message), encoded_topic)
            except ssmp.SSMPLocalError as exc:
                self._head = _refusal(exc, topic, "cannot deliver over SSMP")
        head = self._head
        if isinstance(head, Outcome):
            return head
        try:
            return head[0], ssmp.mcast_line(head[1], message.body)
        except ssmp.SSMPLocalError as exc:
            return _refusal(exc, topic, "cannot deliver over SSMP")


def ucast_event(message: Message, peer: str) -> tuple[bytes, bytes] | Outcome:
    """Encode a message as the ``000 <sender> UCAST <peer>`` event a hub forwards.

    Returns:
        The peer id and the encoded event line, or why it cannot be carried.
    """
    encoded_peer = peer.encode("ascii", "replace")
    event = ssmp.Event(
        source=_sender(message), message=ssmp.Ucast(to=encoded_peer, payload=message.body)
    )
    try:
        return encoded_peer, ssmp.encode(event)
    except ssmp.SSMPLocalError as exc:
        return _refusal(exc, UCAST_PREFIX + peer, "cannot deliver over SSMP")


def bcast_event(message: Message) -> tuple[bytes, bytes] | Outcome:
    """Encode a message as the ``000 <sender> BCAST`` event a hub forwards.

    Returns:
        The sender shown and the encoded event line, or why it cannot be carried.
    """
    sender = _sender(message)
    try:
        return sender, ssmp.encode(
            ssmp.Event(source=sender, message=ssmp.Bcast(payload=message.body))
        )
    except ssmp.SSMPLocalError as exc:
        return _refusal(exc, BCAST_ADDRESS, "cannot deliver over SSMP")
