"""DMP envelopes to and from the canonical `Message`: pure functions, no transport.

In: a message written to sink ``S`` with routing key ``K`` has the address
``S.K`` (``S`` when ``K`` is empty), so routes match ``S`` or ``S.#``; its
body is the envelope's body; ``message-id`` and ``timestamp`` become its id
and time; the headers table's ``x-gateway-sender`` its envelope sender;
``x-gateway-recipients`` (an array, or a comma-separated string) is kept
as the header of that name, comma-separated, not as recipients (recipients
would make routes match them instead of the sink); other header values, the
exchange, the routing key and the other Basic properties become headers
(``dmp.*``).

Out: the routing key is the message's address; ``message-id``, ``timestamp``
(seconds) and ``app-id`` (``msggateway``) are set; the headers table holds
``x-gateway-sender``, ``x-gateway-recipients`` (an array: the message's
recipients, or its ``x-gateway-recipients`` header) and its other text
headers; ``dmp.*`` headers of a message that came from DMP go back
to their properties. `encode_message` writes that envelope without building
it (`dmp.encode_envelope_fields`) unless a header sets a property other
than ``app-id``; `message_from_envelope` tells a bare envelope by its
properties being `dmp.NO_PROPERTIES` and skips the rest, and
`messages_from_bodies` makes a run of bare ones (`dmp.Bodies`) at once.
"""

from __future__ import annotations

import operator
from typing import Final

from gateway.codecs import dmp
from gateway.codecs.fieldtable import FieldValue
from gateway.core.message import HeaderValue, Message

__all__ = [
    "APP_ID",
    "RECIPIENTS_HEADER",
    "SENDER_HEADER",
    "encode_message",
    "envelope_from_message",
    "message_from_envelope",
    "messages_from_bodies",
]

SENDER_HEADER: Final = "x-gateway-sender"
RECIPIENTS_HEADER: Final = "x-gateway-recipients"
_TEXT_PROPERTIES: Final = ("content_type", "content_encoding", "correlation_id", "reply_to",
                           "expiration", "type", "user_id", "app_id")  # fmt: skip
_HEADER_OF: Final = {name: "dmp." + name.replace("_", "-") for name in _TEXT_PROPERTIES}
_PROPERTY_OF: Final = {header: name for name, header in _HEADER_OF.items()}
_TEXT_HEADERS: Final = tuple(_HEADER_OF.values())
_text_properties: Final = operator.attrgetter(*_TEXT_PROPERTIES)
"""All the text properties of a `dmp.BasicProperties` in one call (the hot path's)."""
_NO_TEXT: Final = (None,) * len(_TEXT_PROPERTIES)
APP_ID: Final = "msggateway"


def message_from_envelope(envelope: dmp.Envelope, sink: str, timestamp: float) -> Message:
    """The message a sink received (``timestamp``: arrival, if the envelope has none)."""
    properties = envelope.properties
    routing_key = envelope.routing_key
    if properties is dmp.NO_PROPERTIES and not envelope.exchange:  # bare: the common case
        if routing_key:
            return Message(
                body=envelope.body,
                address=f"{sink}.{routing_key}",
                headers={"dmp.routing-key": routing_key},
                timestamp=timestamp,
            )
        return Message(body=envelope.body, address=sink, timestamp=timestamp)
    headers: dict[str, HeaderValue] = {}
    sender: str | None = None
    table = properties.headers
    if table:
        for key, value in table.items():
            if key == SENDER_HEADER and isinstance(value, str):
                sender = value or None
            elif key == RECIPIENTS_HEADER and isinstance(value, list):
                headers[key] = ",".join(str(item) for item in value)
            elif isinstance(value, str):
                headers[key] = value
            elif isinstance(value, bytes):
                headers[key] = value.decode("utf-8", "replace")
            elif value is not None:
                headers[key] = str(value)
    texts = _text_properties(properties)
    if texts != _NO_TEXT:
        for header, value in zip(_TEXT_HEADERS, texts, strict=True):
            if value is not None:
                headers[header] = value
    if envelope.exchange:
        headers["dmp.exchange"] = envelope.exchange
    if routing_key:
        headers["dmp.routing-key"] = routing_key
        address = f"{sink}.{routing_key}"
    else:
        address = sink
    if properties.timestamp:
        timestamp = float(properties.timestamp)
    if properties.message_id:
        return Message(
            body=envelope.body,
            address=address,
            id=properties.message_id,
            sender=sender,
            headers=headers,
            timestamp=timestamp,
        )
    return Message(
        body=envelope.body, address=address, sender=sender, headers=headers, timestamp=timestamp
    )


def messages_from_bodies(bodies: list[bytes], sink: str, timestamp: float) -> list[Message]:
    """The messages of a run of bare envelopes (`dmp.Bodies`), as `message_from_envelope` would."""
    return [Message(body=body, address=sink, timestamp=timestamp) for body in bodies]


def _table_and_properties(message: Message) -> tuple[dict[str, FieldValue], dict[str, str]]:
    """The headers table of a message's envelope, and the properties its headers set."""
    table: dict[str, FieldValue] = {}
    if message.sender:
        table[SENDER_HEADER] = message.sender
    if message.recipients:
        table[RECIPIENTS_HEADER] = list(message.recipients)
    values: dict[str, str] = {}
    for key, value in message.headers.items():
        if key == RECIPIENTS_HEADER:
            if not message.recipients and isinstance(value, str):
                table[key] = [part for part in value.split(",") if part]
        elif key in _PROPERTY_OF:
            values[_PROPERTY_OF[key]] = str(value)
        elif not key.startswith("dmp.") and isinstance(value, str):
            table[key] = value
    return table, values


def envelope_from_message(message: Message, exchange: str = "") -> dmp.Envelope:
    """The envelope a feed reader or a remote sink gets for a message."""
    table, values = _table_and_properties(message)
    values.setdefault("app_id", APP_ID)
    properties = dmp.BasicProperties(
        message_id=message.id[:255],
        timestamp=int(message.timestamp) if message.timestamp else None,
        headers=table or None,
        **values,  # type: ignore[arg-type]
    )
    return dmp.Envelope(
        exchange=exchange,
        routing_key=message.address[:255],
        properties=properties,
        body=message.body,
    )


def encode_message(message: Message, exchange: str = "") -> bytes:
    """``dmp.encode_envelope(envelope_from_message(message, exchange))``, the envelope unbuilt.

    Raises:
        dmp.DMPLocalError: DMP cannot carry the message.
    """
    if message.headers or message.sender or message.recipients:
        table, values = _table_and_properties(message)
        app_id = values.pop("app_id", APP_ID)
        if values:  # a property the fields encoder does not take: the envelope, then
            return dmp.encode_envelope(envelope_from_message(message, exchange))
        headers = table or None
    else:  # the common case: nothing to sort
        app_id = APP_ID
        headers = None
    return dmp.encode_envelope_fields(
        exchange,
        message.address[:255],
        body=message.body,
        message_id=message.id[:255],
        timestamp=int(message.timestamp) if message.timestamp else None,
        headers=headers,
        app_id=app_id,
    )
