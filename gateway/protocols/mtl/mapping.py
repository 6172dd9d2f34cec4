"""MTL Content to and from the canonical `Message`: pure functions, no sockets.

In: the resource is the address, the body the body; properties with text
values become headers, except ``message-id`` (the id) and
``x-gateway-sender`` (the sender). Out: the message's text headers, its id
as ``message-id`` and its sender as ``x-gateway-sender``.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from gateway.codecs import mtl
from gateway.codecs.fieldtable import FieldValue
from gateway.core.message import Message, Outcome

__all__ = ["content_properties", "message_from_content", "settle"]


def message_from_content(
    resource: str, properties: dict[str, FieldValue], body: bytes, timestamp: float
) -> Message:
    """The message a Content carries."""
    headers = {key: value for key, value in properties.items() if isinstance(value, str)}
    message_id = headers.pop("message-id", None)
    sender = headers.pop("x-gateway-sender", None)
    if message_id:
        return Message(
            body=body,
            address=resource,
            id=message_id,
            sender=sender,
            headers=headers,
            timestamp=timestamp,
        )
    return Message(body=body, address=resource, sender=sender, headers=headers, timestamp=timestamp)


def content_properties(message: Message) -> dict[str, FieldValue]:
    """The properties of the Content that carries a message."""
    properties: dict[str, FieldValue] = {
        key: value for key, value in message.headers.items() if isinstance(value, str)
    }
    properties["message-id"] = message.id
    if message.sender:
        properties["x-gateway-sender"] = message.sender
    return properties


def settle(
    unconfirmed: dict[int, Deferred[Outcome]], command: mtl.Confirm | mtl.Reject, who: str
) -> None:
    """Answer the contents a Confirm or Reject covers; invalid ones are ignored (the spec).

    Confirm is accepted, Reject rejected, Reject with recycle retry later;
    ``multiple`` covers every unconfirmed sequence up to the one given.
    """
    if command.multiple:
        sequences = sorted(s for s in unconfirmed if s <= command.sequence)
    else:
        sequences = [command.sequence] if command.sequence in unconfirmed else []
    for sequence in sequences:
        waiting = unconfirmed.pop(sequence)
        if isinstance(command, mtl.Confirm):
            waiting.callback(Outcome.accepted())
        elif command.recycle:
            waiting.callback(Outcome.retry(f"{who} asked to recycle it"))
        else:
            waiting.callback(Outcome.rejected(f"{who} rejected it"))
