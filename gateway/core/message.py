"""The canonical message and the outcome of delivering it.

Every protocol maps its own envelope to a `Message` on the way in and from one
on the way out; routes carry `Outcome` values back to the sender's adapter,
which turns them into the protocol's own acknowledgement (see DESIGN.md,
"Outcomes travel back").
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final, NamedTuple

import attrs

__all__ = [
    "HeaderValue",
    "Message",
    "Origin",
    "Outcome",
    "Status",
    "new_message_id",
    "worst",
]

HeaderValue = str | bytes | int | float | bool
"""What a header may hold: the common ground of AMQP properties and the rest."""

_EMPTY_HEADERS: Final[Mapping[str, HeaderValue]] = MappingProxyType({})
_new_object = object.__new__

# Message ids are unique per process run without the cost of uuid4 per message:
# a random per-process prefix plus a counter.
_ID_PREFIX: Final = os.urandom(6).hex()
_id_counter = itertools.count(1)


def new_message_id() -> str:
    """Return a fresh message id, unique within and across gateway runs."""
    return f"{_ID_PREFIX}-{next(_id_counter)}"


def _freeze_headers(value: Mapping[str, HeaderValue]) -> Mapping[str, HeaderValue]:
    if type(value) is MappingProxyType:  # shared read-only headers: the hot paths' case
        return value
    if not value:
        return _EMPTY_HEADERS
    return MappingProxyType(dict(value))


class Origin(NamedTuple):
    """Where a consumer read a message: a position that reading again finds again.

    A consuming upstream reads a stream from a stored offset; whoever reads
    it next (the same process after a reconnection, or another node of the
    fleet after a takeover) reads the same message at the same offset. Routes
    deliver such a message to a destination that stores each id once
    (`gateway.core.interfaces.IDeduplicatingDestination`) under the reader's
    name and its offset plus one, so that reading it again stores nothing
    twice (`gateway.core.origins`).

    Attributes:
        reader: Who read it where: the consumer's name and the stream,
            ``<consumer name>@<stream>``, the same on every node.
        offset: Its offset in that stream.
    """

    reader: str
    offset: int


@attrs.define(kw_only=True, unsafe_hash=True, on_setattr=attrs.setters.NO_OP)
class Message:
    """One message in flight, independent of any wire format.

    A message is a value: nothing assigns to its fields once it is built
    (`with_address` and `attrs.evolve` make changed copies, and its headers
    are a read-only mapping). That is a rule of the code, not enforced at run
    time: a frozen attrs instance costs about twice as much to build (each
    field set through ``object.__setattr__``), and every message the gateway
    routes is built once on arrival and often once more by its route.

    Attributes:
        body: The payload, as bytes; never decoded by the core.
        address: Where it is going on the current hop: a topic, stream, sink,
            feed or resource name. Routes match on it and may rewrite it.
        id: Unique id; protocols that carry one (QMQP, AMQP message-id) keep it.
        sender: Who sent it (SSMP peer id, envelope sender, identity), if known.
        recipients: Envelope recipients (QMQP), empty where the protocol has none.
        headers: Extra properties (AMQP application properties, protocol verbs).
        timestamp: Arrival time in seconds since the epoch, from the adapter's clock.
        origin: Where a consumer read it (`Origin`), if it was; not part of
            what the message is (equality ignores it).
    """

    body: bytes
    address: str
    id: str = attrs.field(factory=new_message_id)
    sender: str | None = None
    recipients: tuple[str, ...] = ()
    headers: Mapping[str, HeaderValue] = attrs.field(
        default=_EMPTY_HEADERS, converter=_freeze_headers, hash=False
    )
    timestamp: float = 0.0
    origin: Origin | None = attrs.field(default=None, eq=False)

    @classmethod
    def arrived(
        cls,
        body: bytes,
        address: str,
        sender: str | None,
        headers: MappingProxyType[str, HeaderValue],
        timestamp: float,
    ) -> Message:
        """A message as a listener decodes one: a fresh id, no recipients, no origin.

        The same message as ``Message(body=..., address=..., sender=...,
        headers=..., timestamp=...)``, built by setting its slots: the
        listeners' hot paths build one per message. ``headers`` is read-only
        already (shared by every message of its kind).
        """
        message: Message = _new_object(cls)
        message.body = body
        message.address = address
        message.id = f"{_ID_PREFIX}-{next(_id_counter)}"
        message.sender = sender
        message.recipients = ()
        message.headers = headers
        message.timestamp = timestamp
        message.origin = None
        return message

    def with_address(self, address: str) -> Message:
        """Return this message bound for another address (same id and body)."""
        return self.translated(self.body, address, self.sender, self.recipients)

    def translated(
        self, body: bytes, address: str, sender: str | None, recipients: tuple[str, ...]
    ) -> Message:
        """Return this message as a route delivers it: same id, headers, time and origin.

        The same message as ``attrs.evolve`` would make, at a third of the
        cost of the keyword constructor: its slots are set directly, and the
        headers (read-only already) are not frozen again.
        """
        moved: Message = _new_object(Message)
        moved.body = body
        moved.address = address
        moved.id = self.id
        moved.sender = sender
        moved.recipients = recipients
        moved.headers = self.headers
        moved.timestamp = self.timestamp
        moved.origin = self.origin
        return moved


class Status(enum.Enum):
    """How a delivery ended, from best to worst."""

    ACCEPTED = "accepted"
    RETRY = "retry"
    REJECTED = "rejected"


_SEVERITY: Final = {Status.ACCEPTED: 0, Status.RETRY: 1, Status.REJECTED: 2}


@attrs.frozen
class Outcome:
    """The result of delivering a message, carried back to its sender.

    Attributes:
        status: Accepted, retry later (temporary) or rejected (permanent).
        reason: A sentence a person can act on; empty when accepted.
        code: The destination protocol's own code, when it gave one.
    """

    status: Status
    reason: str = ""
    code: str | None = None

    @classmethod
    def accepted(cls, reason: str = "") -> Outcome:
        """Return an accepted outcome."""
        return _ACCEPTED if not reason else cls(Status.ACCEPTED, reason)

    @classmethod
    def retry(cls, reason: str, code: str | None = None) -> Outcome:
        """Return a temporary failure: the sender may try again later."""
        return cls(Status.RETRY, reason, code)

    @classmethod
    def rejected(cls, reason: str, code: str | None = None) -> Outcome:
        """Return a permanent failure: trying again will not help."""
        return cls(Status.REJECTED, reason, code)

    @property
    def is_accepted(self) -> bool:
        """Whether the destination took responsibility for the message."""
        return self.status is Status.ACCEPTED


_ACCEPTED: Final = Outcome(Status.ACCEPTED)


def worst(outcomes: Iterable[Outcome]) -> Outcome:
    """Combine the outcomes of one message's deliveries into one.

    The sender learns the worst of them: accepted only if every route accepted,
    rejected if any route rejected. Reasons of equally bad outcomes are joined
    so that the sender learns each of them.

    Args:
        outcomes: The outcomes of all routes the message took.

    Returns:
        The combined outcome; accepted when there were none.
    """
    result: Outcome | None = None
    reasons: list[str] = []
    for outcome in outcomes:
        if result is None or _SEVERITY[outcome.status] > _SEVERITY[result.status]:
            result = outcome
            reasons = [outcome.reason] if outcome.reason else []
        elif outcome.status is result.status and outcome.reason:
            reasons.append(outcome.reason)
    if result is None:
        return _ACCEPTED
    joined = "; ".join(reasons)
    if joined != result.reason:  # also when only a later equal outcome had a reason
        return Outcome(result.status, joined, result.code)
    return result
