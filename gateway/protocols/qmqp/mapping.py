"""QMQP to and from the canonical `Message` and `Outcome`: pure functions.

A QMQP message block carries an id, the message (RFC 822 bytes), the envelope
sender and recipients. Recipients are the message's routing addresses; the
id is kept as the message id. Text fields are decoded as UTF-8 with
``surrogateescape``, so that any bytes survive a trip through the gateway
unchanged.
"""

from __future__ import annotations

from typing import Final

from gateway.codecs import qmqp
from gateway.core.message import Message, Outcome, Status

__all__ = ["block_for", "message_from_block", "outcome_from_reply", "result_for", "text"]

_UNSAFE: Final = str.maketrans({"#": "No.", "\r": " ", "\n": " ", "\t": " "})


def text(value: bytes) -> str:
    """Decode a QMQP field losslessly."""
    return value.decode("utf-8", "surrogateescape")


def raw(value: str) -> bytes:
    """Encode a field decoded with `text` back to its bytes."""
    return value.encode("utf-8", "surrogateescape")


def message_from_block(block: qmqp.MessageBlock, timestamp: float) -> Message:
    """Map a message block to a message routed by its recipients."""
    recipients = tuple(map(text, block.recipients))
    return Message(
        body=block.message,
        address=recipients[0],
        id=text(block.id),
        sender=text(block.sender),
        recipients=recipients,
        timestamp=timestamp,
    )


def block_for(message: Message, block_id: bytes) -> qmqp.MessageBlock:
    """Map a message to the block an upstream sends.

    Recipients are the message's recipients, or its address when it has none
    (an SSMP topic routed to a mail address). The sender is empty (the null
    return path) when the message has none.
    """
    recipients = message.recipients or (message.address,)
    return qmqp.MessageBlock(
        id=block_id,
        message=message.body,
        sender=raw(message.sender or ""),
        recipients=tuple(map(raw, recipients)),
    )


def result_for(outcome: Outcome) -> tuple[bytes, bytes]:
    """Map an outcome to a reply's status (K, Z or D) and description.

    Spec, "Result String": descriptions should be readable text with no
    formatting characters but spaces, must not start with a space (reserved)
    and must not contain ``#`` outside HCMSSC codes; ours are made to fit.
    """
    status = {Status.ACCEPTED: qmqp.K, Status.RETRY: qmqp.Z, Status.REJECTED: qmqp.D}[
        outcome.status
    ]
    description = outcome.reason.translate(_UNSAFE).strip()
    return status, description.encode("utf-8", "replace")


def outcome_from_reply(reply: qmqp.ReplyBlock, upstream: str) -> Outcome:
    """Map a reply from an upstream QMQP server to an outcome."""
    description = reply.description.decode("utf-8", "replace")
    said = f"{upstream} answered {reply.status.decode('ascii')}" + (
        f": {description}" if description else ""
    )
    if reply.status == qmqp.K:
        return Outcome.accepted()
    if reply.status == qmqp.Z:
        return Outcome.retry(said, code="Z")
    return Outcome.rejected(said, code="D")
