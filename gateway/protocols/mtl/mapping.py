"""MTL Content to and from the canonical `Message`, and the confirmations of a sent batch.

No sockets here. In: the resource is the address, the body the body;
properties with text values become headers, except ``message-id`` (the id)
and ``x-gateway-sender`` (the sender). Out: the message's text headers, its
id as ``message-id`` and its sender as ``x-gateway-sender``.

A batch delivered to an MTL peer is a `PendingBatch`: one `Answers` for the
whole batch, filled in by each Content's Confirm or Reject (spec, "Data
Flow": Confirm is accepted, Reject rejected, Reject with recycle retry
later), with no Deferred or timer per message; a copy whose reader turned
out to be gone is withdrawn rather than answered.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from types import MappingProxyType
from typing import Final, TypeAlias

from twisted.internet.defer import Deferred

from gateway.codecs import mtl
from gateway.codecs.fieldtable import FieldValue
from gateway.core.batch import Answers
from gateway.core.message import HeaderValue, Message, Outcome, worst

__all__ = [
    "Copy",
    "PendingBatch",
    "Unconfirmed",
    "content_properties",
    "give_back",
    "message_from_content",
    "settle",
    "settle_confirm",
]

_ACCEPTED = Outcome.accepted()
_NO_HEADERS: Final[MappingProxyType[str, HeaderValue]] = MappingProxyType({})
"""The headers of a Content without properties (read-only, shared)."""


def message_from_content(
    resource: str, properties: dict[str, FieldValue], body: bytes, timestamp: float
) -> Message:
    """The message a Content carries."""
    if not properties:  # the common case: nothing to sort (an empty table decodes to {})
        return Message.arrived(body, resource, None, _NO_HEADERS, timestamp)
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
    properties: dict[str, FieldValue]
    if message.headers:
        properties = {
            key: value for key, value in message.headers.items() if isinstance(value, str)
        }
        properties["message-id"] = message.id
    else:  # the common case: the id alone (a text table, written in one pass)
        properties = {"message-id": message.id}
    if message.sender:
        properties["x-gateway-sender"] = message.sender
    return properties


class PendingBatch:
    """A batch sent as Contents, its outcomes gathered in one `Answers`.

    A message sent to several readers (``copies``) answers the worst of
    their answers once all of them have. When the router cancels the batch
    (its deadline), `Answers` answers what it knows and the Contents still
    unconfirmed are forgotten, so that a late Confirm finds nothing.

    Args:
        count: Messages in the batch.
    """

    __slots__ = ("_copies", "_known", "_sent", "answers")

    def __init__(self, count: int) -> None:
        self.answers = Answers(count, self._cancelled)
        self._copies: dict[int, int] = {}
        self._known: dict[int, Outcome] = {}
        self._sent: Sequence[Copy] = ()

    @property
    def deferred(self) -> Deferred[list[Outcome]]:
        """Fires with one outcome per message, in order."""
        return self.answers.deferred

    def copies(self, index: int, count: int) -> None:
        """Message ``index`` goes out ``count`` times (once per reader)."""
        if count > 1:
            self._copies[index] = count

    def settle(self, index: int, outcome: Outcome) -> None:
        """One copy of message ``index`` has its outcome."""
        copies = self._copies
        if copies and index in copies:
            known = self._known.get(index)
            if known is not None:
                outcome = worst((known, outcome))
            left = copies[index] - 1
            if left:
                copies[index] = left
                self._known[index] = outcome
                return
            del copies[index]
            self._known.pop(index, None)
        self.answers.settle(index, outcome)

    def withdraw(self, index: int, outcome: Outcome) -> None:
        """One copy of message ``index`` will never be answered: its reader is gone.

        The message answers the worst of its other copies' answers, as if
        that reader had never been among its readers; ``outcome`` when it
        had no other.
        """
        copies = self._copies
        if copies and index in copies:
            left = copies[index] - 1
            if left:
                copies[index] = left
                return
            del copies[index]
            known = self._known.pop(index, None)
            if known is not None:
                outcome = known
        self.answers.settle(index, outcome)

    def sent(
        self,
        copies: Sequence[Copy],
        failed: Sequence[int],
        not_taken: Outcome,
        elsewhere: Container[int] = (),
    ) -> None:
        """The Contents went out: wait for the confirmations they need.

        Args:
            copies: Each Content sent: the unconfirmed Contents of its peer
                when the peer confirms (None when it does not: written is
                accepted), its sequence and the index of its message.
            failed: The positions in ``copies`` ZeroMQ did not take.
            not_taken: Their outcome.
            elsewhere: Positions in ``copies`` the caller answers itself
                (`settle`, `withdraw`): nothing is done for them here.
        """
        refused = set(failed)
        several = self._copies  # a message with one copy is answered by its answer alone
        answers = self.answers
        for position, (unconfirmed, sequence, index) in enumerate(copies):
            if elsewhere and position in elsewhere:
                continue
            if refused and position in refused:
                self.settle(index, not_taken)
            elif unconfirmed is None:
                self.settle(index, _ACCEPTED)
            else:
                unconfirmed[sequence] = (self if several and index in several else answers, index)
        self._sent = copies

    def _cancelled(self, _answers: Answers) -> None:
        for unconfirmed, sequence, _index in self._sent:
            if unconfirmed is not None:
                entry = unconfirmed.get(sequence)
                if entry is not None and (entry[0] is self or entry[0] is self.answers):
                    del unconfirmed[sequence]
        self._sent = ()


Unconfirmed: TypeAlias = dict[int, tuple[PendingBatch | Answers, int]]
"""A peer's Contents waiting for Confirm or Reject: sequence to (batch, index).

The batch's `Answers` itself for a message sent once (one call less per
Confirm), the `PendingBatch` for one sent to several readers.
"""

Copy: TypeAlias = tuple[Unconfirmed | None, int, int]
"""One Content sent: its peer's `Unconfirmed` (None: no confirmations), sequence, index."""


def settle(unconfirmed: Unconfirmed, command: mtl.Confirm | mtl.Reject, who: str) -> None:
    """Answer the contents a Confirm or Reject covers; invalid ones are ignored (the spec).

    Confirm is accepted, Reject rejected, Reject with recycle retry later;
    ``multiple`` covers every unconfirmed sequence up to the one given.
    """
    if isinstance(command, mtl.Confirm):
        settle_confirm(unconfirmed, command.sequence, command.multiple)
        return
    if command.recycle:
        outcome = Outcome.retry(f"{who} asked to recycle it")
    else:
        outcome = Outcome.rejected(f"{who} rejected it")
    if not command.multiple:
        entry = unconfirmed.pop(command.sequence, None)
        if entry is not None:
            entry[0].settle(entry[1], outcome)
        return
    for sequence in sorted(s for s in unconfirmed if s <= command.sequence):
        batch, index = unconfirmed.pop(sequence)
        batch.settle(index, outcome)


def settle_confirm(unconfirmed: Unconfirmed, sequence: int, multiple: bool) -> None:
    """Accept the contents a Confirm covers (`settle` of ``Confirm(sequence, multiple)``)."""
    if not multiple:
        entry = unconfirmed.pop(sequence, None)
        if entry is not None:
            entry[0].settle(entry[1], _ACCEPTED)
        return
    for covered in sorted(s for s in unconfirmed if s <= sequence):
        batch, index = unconfirmed.pop(covered)
        batch.settle(index, _ACCEPTED)


def give_back(unconfirmed: Unconfirmed, outcome: Outcome) -> None:
    """Answer every unconfirmed Content with ``outcome`` (its peer went away) and forget them."""
    waiting = list(unconfirmed.values())
    unconfirmed.clear()
    for batch, index in waiting:
        batch.settle(index, outcome)
