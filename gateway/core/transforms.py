r"""Body transforms a route may apply, for protocols that carry different things.

SSMP payloads are one line; QMQP carries whole RFC 822 messages; streams and
DMP carry any bytes. A route's ``body`` key picks how a message's body is
translated on its way (pure functions, no I/O):

``unchanged``
    The default.
``escape-lf``
    One line: ``\`` becomes ``\\`` and LF becomes ``\n`` (reversible
    with ``unescape-lf``).
``unescape-lf``
    The reverse of ``escape-lf``.
``base64``
    Standard base64, one line (reversible with ``unbase64``).
``unbase64``
    The reverse; a body that is not base64 is rejected.
``subject``
    The RFC 822 Subject of a mail (decoded, one line), e.g. mail to a chat
    topic.
``rfc822``
    A minimal RFC 822 message around the body: ``From`` (the sender),
    ``To`` (the recipients or address), ``Subject`` (the source address),
    ``Message-ID``, then the body; e.g. a topic's messages as mail.
"""

from __future__ import annotations

import base64
import binascii
import email.header
import email.utils
from collections.abc import Callable
from typing import Final

from gateway.core.message import Message

__all__ = ["ENVELOPE_TRANSFORMS", "TRANSFORMS", "TransformError", "transform"]


class TransformError(ValueError):
    """The body cannot be transformed; the reason says why (a rejection)."""


def _escape_lf(message: Message, source_address: str) -> bytes:
    return message.body.replace(b"\\", b"\\\\").replace(b"\n", b"\\n")


def _unescape_lf(message: Message, source_address: str) -> bytes:
    parts = message.body.split(b"\\\\")
    return b"\\".join(part.replace(b"\\n", b"\n") for part in parts)


def _base64(message: Message, source_address: str) -> bytes:
    return base64.b64encode(message.body)


def _unbase64(message: Message, source_address: str) -> bytes:
    try:
        return base64.b64decode(message.body, validate=True)
    except binascii.Error as exc:
        raise TransformError(f"body is not base64: {exc}") from None


def _subject_value(headers: bytes) -> bytes | None:
    r"""The first Subject field's value in a header block, continuation lines and all.

    What ``^subject:[ \t]*(.*(?:\r?\n[ \t].*)*)`` (case-insensitive,
    multiline) finds, by finds on the lowered block instead of the regular
    expression: the field's name at the start of a line, then its line and
    every following line that starts with a space or a tab.
    """
    lowered = headers.lower()
    if lowered.startswith(b"subject:"):
        start = 8
    else:
        start = lowered.find(b"\nsubject:")
        if start == -1:
            return None
        start += 9
    end = headers.find(b"\n", start)
    while end != -1 and headers[end + 1 : end + 2] in (b" ", b"\t"):
        end = headers.find(b"\n", end + 1)
    return headers[start:] if end == -1 else headers[start:end]


def _subject(message: Message, source_address: str) -> bytes:
    # Only the header block is looked at: up to the first empty line.
    body = message.body
    end = body.find(b"\n\n")
    # A CRLF blank line counts only before the LF one: look no further.
    crlf_end = body.find(b"\r\n\r\n", 0, len(body) if end == -1 else end + 3)
    if crlf_end != -1 and (end == -1 or crlf_end < end):
        end = crlf_end
    value = _subject_value(body if end == -1 else body[: end + 1])
    raw = b"" if value is None else b" ".join(value.split())  # unfolds continuation lines
    if not raw:
        raise TransformError("the message has no Subject to carry")
    if b"=?" in raw:  # RFC 2047 encoded words
        text = str(
            email.header.make_header(email.header.decode_header(raw.decode("ascii", "replace")))
        )
        return " ".join(text.split()).encode("utf-8")
    return raw


def _rfc822(message: Message, source_address: str) -> bytes:
    sender = message.sender or "msggateway"
    recipients = ", ".join(message.recipients or (message.address,))
    headers = [
        f"From: {sender}",
        f"To: {recipients}",
        f"Subject: {source_address}",
        f"Date: {email.utils.formatdate(message.timestamp or None, usegmt=True)}",
        f"Message-ID: <{message.id}@msggateway>",
        "MIME-Version: 1.0",
        "Content-Type: text/plain; charset=utf-8",
    ]
    body = message.body if message.body.endswith(b"\n") else message.body + b"\n"
    return ("\n".join(headers) + "\n\n").encode("utf-8", "replace") + body


TRANSFORMS: Final[dict[str, Callable[[Message, str], bytes] | None]] = {
    "unchanged": None,
    "escape-lf": _escape_lf,
    "unescape-lf": _unescape_lf,
    "base64": _base64,
    "unbase64": _unbase64,
    "subject": _subject,
    "rfc822": _rfc822,
}
"""Every transform by name; ``unchanged`` is None (nothing to do)."""

ENVELOPE_TRANSFORMS: Final = frozenset({"rfc822"})
"""Transforms that read the envelope (sender, recipients) as the destination sees it."""


def transform(name: str, message: Message, source_address: str) -> bytes:
    """Apply the named transform to a message (already translated by its route).

    Args:
        name: A key of `TRANSFORMS`.
        message: The message as its destination will see it.
        source_address: The address it arrived on (``rfc822`` uses it as Subject).

    Raises:
        TransformError: The body cannot be transformed.
    """
    function = TRANSFORMS[name]
    return message.body if function is None else function(message, source_address)
