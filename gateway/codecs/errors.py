"""The one error family every codec raises.

A `RemoteProtocolError` means the peer broke its spec; it carries the answer
the spec prescribes (a reply code and whether to close) so that the adapter
only has to write it. A `LocalProtocolError` means we were asked to send
something the spec does not allow: a bug or a message that cannot be carried,
never the peer's fault.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ProtocolError(Exception):
    """Base of every codec error.

    Attributes:
        reason: What is wrong, in words a person can act on.
        where: Where it happened: a field name or a byte offset, if known.
        reply: The spec's answer to send before closing, if it prescribes one.
        kind: A short stable name for metrics (``line-too-long``, ...).
    """

    def __init__(
        self,
        reason: str,
        *,
        where: str | None = None,
        reply: bytes | None = None,
        kind: str = "malformed",
    ) -> None:
        super().__init__(reason if where is None else f"{reason} (at {where})")
        self.reason = reason
        self.where = where
        self.reply = reply
        self.kind = kind


class RemoteProtocolError(ProtocolError):
    """The peer sent something its spec forbids.

    Stream codecs decode many events from one chunk of input; when a later
    part of the chunk is bad, the events completed before it are carried in
    ``events`` so that the adapter handles them, in order, before the error.
    """

    def __init__(
        self,
        reason: str,
        *,
        where: str | None = None,
        reply: bytes | None = None,
        kind: str = "malformed",
        events: list[object] | None = None,
    ) -> None:
        super().__init__(reason, where=where, reply=reply, kind=kind)
        self.events: list[object] = events if events is not None else []


class LocalProtocolError(ProtocolError):
    """We were asked to send something the spec forbids."""
