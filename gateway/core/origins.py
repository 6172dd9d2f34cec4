"""Delivering what a consumer read exactly once, wherever it is read again.

A consuming upstream (a stream upstream that subscribes) reads from an
offset it stored; whoever reads next goes on from there: the same process
after a reconnection or a restart, another node of the fleet after a
takeover (`gateway.fleet.locks`: one node at a time). What was read after
the last stored offset is read again. Each message it reads carries its
`Origin` (the reader, ``<consumer name>@<stream>``, and the offset), so
that a destination that stores each id once
(`gateway.core.interfaces.IDeduplicatingDestination`, a RabbitMQ or a local
stream) is handed the reader as the source of the ids and the offset plus
one as each id: a message read again is confirmed without being stored
twice (`deliver_once`).

The reference the destination derives from the reader has no node id in
it, unlike a route's own references (`gateway.fleet.node`): the node id is
there so that two processes publishing *at the same time* never share a
reference (RabbitMQ keeps one last id per reference and would drop one's
messages as duplicates of the other's). A reader runs on one node at a time
under its fleet lock, its ids are its stream's offsets, the same on every
node, and rise as it reads: every node delivering a message read at offset
N uses id N + 1, which is what makes the second copy recognisable. A node
that lost the lock may still deliver what it had routed before; those are
messages the next holder reads again (their offsets were not stored), and
it sends them in offset order, so whichever copy arrives second is dropped.

Durable routes (`gateway.core.durable`) keep the origin in the entries of
their stream, and their forwarder delivers with it. One more thing is
needed there: the consumer's offset is stored once the route has committed
a message, but the forwarder delivers it later, so a node killed in between
leaves messages in its own log that no other node reads again. Delivered
later under the shared reference, after the next holder stored higher ids,
they would be taken for duplicates and lost. So a durable route that
delivers by origin into a fleet-wide destination keeps what it committed
and has not delivered (`PendingOrigins`), and the consumer stores no offset
at or past the lowest of them (`gateway.core.router.Router.unforwarded`):
whatever a node has not delivered yet, the next holder reads again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from twisted.internet.defer import Deferred

from gateway.core.batch import Answers
from gateway.core.interfaces import IDeduplicatingDestination
from gateway.core.message import Message, Outcome

__all__ = ["PendingOrigins", "deliver_once"]


def deliver_once(
    destination: IDeduplicatingDestination,
    producer: str,
    messages: Sequence[Message],
    ids: Sequence[int] | None = None,
) -> Deferred[list[Outcome]]:
    """Deliver a batch, each message read by a consumer under its origin's id.

    Messages with an `Origin` go to ``destination.deliver_once`` with the
    reader as the source of their ids and their offset plus one as each id;
    the others with ``ids`` (a durable route's own: its stream's offsets
    plus one), or through ``destination.deliver`` when there are none. A
    batch from one reader (the usual case: one consumed chunk) is one call;
    a mixed one is split by reader, each part in its order, and answered
    as one batch (cancelling it cancels every part).

    Args:
        destination: Where to.
        producer: Who delivers (a route's name).
        messages: The batch.
        ids: The producer's own ids for messages without an origin, if any.

    Returns:
        One outcome per message, in order.
    """
    first = messages[0].origin if messages else None
    reader = None if first is None else first.reader
    if all(_read_by(message, reader) for message in messages):
        return _deliver_part(destination, producer, messages, reader, range(len(messages)), ids)
    parts: dict[str | None, list[int]] = {}
    for index, message in enumerate(messages):
        origin = message.origin
        parts.setdefault(None if origin is None else origin.reader, []).append(index)
    started: list[Deferred[list[Outcome]]] = []
    answers = Answers(len(messages), lambda _answers: _cancel_all(started))
    for part_reader, indices in parts.items():
        part = _deliver_part(
            destination, producer, [messages[index] for index in indices], part_reader, indices, ids
        )
        started.append(part)
        part.addCallback(_settle, answers, indices)
    return answers.deferred


def _read_by(message: Message, reader: str | None) -> bool:
    """Whether ``message`` was read by ``reader`` (None: by no consumer)."""
    origin = message.origin
    return origin is None if reader is None else origin is not None and origin.reader == reader


def _deliver_part(
    destination: IDeduplicatingDestination,
    producer: str,
    messages: Sequence[Message],
    reader: str | None,
    indices: Sequence[int],
    ids: Sequence[int] | None,
) -> Deferred[list[Outcome]]:
    """Deliver messages of one reader (or of none) as one call."""
    if reader is not None:
        origin_ids = [message.origin.offset + 1 for message in messages]  # type: ignore[union-attr]
        result: Deferred[list[Outcome]] = destination.deliver_once(
            messages, producer, origin_ids, reader=reader
        )
        return result
    if ids is None:
        plain: Deferred[list[Outcome]] = destination.deliver(messages)
        return plain
    own: Deferred[list[Outcome]] = destination.deliver_once(
        messages, producer, [ids[index] for index in indices] if len(indices) != len(ids) else ids
    )
    return own


def _settle(outcomes: list[Outcome], answers: Answers, indices: list[int]) -> None:
    for index, outcome in zip(indices, outcomes, strict=True):
        answers.settle(index, outcome)


def _cancel_all(parts: list[Deferred[list[Outcome]]]) -> None:
    for part in parts:
        if not part.called:
            part.cancel()


class PendingOrigins:
    """What a durable route committed and has not delivered yet, by reader.

    The lowest offset of each reader among the committed batches whose
    entries the forwarder has not finished: a consumer stores no offset at
    or past it (see the module docstring). A sliding minimum: per reader,
    the batches in commit order, each keeping the lowest offset it has, and
    only those whose lowest is below every later one's; a batch leaves once
    the forwarder is past its last entry.

    Args:
        delivered: The last offset of the route's stream the forwarder has
            finished (-1: none yet).
    """

    __slots__ = ("_readers", "delivered")

    def __init__(self, delivered: Callable[[], int]) -> None:
        self.delivered = delivered
        """Set again when the route's forwarder is replaced (a reload)."""
        self._readers: dict[str, deque[tuple[int, int]]] = {}

    def committed(self, last_offset: int, messages: Sequence[Message]) -> None:
        """A batch was committed, its last entry at ``last_offset`` of the route's stream."""
        lowest: dict[str, int] = {}
        for message in messages:
            origin = message.origin
            if origin is not None:
                known = lowest.get(origin.reader)
                if known is None or origin.offset < known:
                    lowest[origin.reader] = origin.offset
        for reader, offset in lowest.items():
            window = self._readers.get(reader)
            leaves_after = last_offset
            if window is None:
                window = self._readers[reader] = deque()
            elif window and window[-1][0] > leaves_after:
                leaves_after = window[-1][0]  # leave in commit order, whatever the offsets say
            while window and window[-1][1] >= offset:
                window.pop()  # never the lowest again: this batch leaves after it
            window.append((leaves_after, offset))

    def lowest(self, reader: str) -> int | None:
        """The lowest offset of ``reader`` committed and not delivered yet, if any."""
        window = self._readers.get(reader)
        if not window:
            return None
        done = self.delivered()
        while window and window[0][0] <= done:
            window.popleft()
        return window[0][1] if window else None
