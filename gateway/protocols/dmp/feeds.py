"""Routes' deliveries to a DMP listener's feeds: to the reader here, or to the node reading.

`FeedDeliveries` is the delivering half of `DMPServerFactory` (the route
destination of its feeds). A batch's messages for feed ``F`` are written to
F's reader in one write and answered *accepted* (written to the reader's
connection: DMP has nothing more), once the reader drained if it was
behind (`gateway.core.flow.answer_when_drained`); *retry later* when F has
no reader (or its reader went before it drained), *rejected* when there is
no feed ``F`` or DMP cannot carry the message. In a fleet (`fleet`), a
feed with no reader here is read on another node, or nowhere: its share is
encoded here and forwarded (`gateway.protocols.dmp.fleet.FleetLink.forward`),
answered as that node's reader took it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from twisted.internet.defer import Deferred, succeed

from gateway.core.batch import Answers
from gateway.core.flow import Congestion, answer_when_drained
from gateway.core.message import Message, Outcome
from gateway.protocols.dmp.fleet import FleetLink
from gateway.protocols.dmp.flow import encode_envelopes

__all__ = ["FeedDeliveries", "FeedWriter"]


class FeedWriter(Protocol):
    """A feed's reader here, as deliveries write to it (`DMPServerProtocol` is one)."""

    @property
    def congestion(self) -> Congestion:
        """Congested while the reader is behind."""

    def deliver(self, messages: Sequence[Message]) -> list[Outcome]:
        """Write a batch in one write; one outcome per message (accepted: written)."""


class FeedDeliveries:
    """Deliveries to one DMP listener's feeds.

    Args:
        name: The listener's name.
        names: Its feeds.
        readers: The feeds read here, and their readers (the listener's, live).
    """

    def __init__(self, name: str, names: frozenset[str], readers: Mapping[str, FeedWriter]) -> None:
        self.name = name
        self._names = names
        self.readers = readers
        self.fleet: FleetLink | None = None
        """The seam to the nodes of a fleet, where feeds may be read elsewhere."""
        self._reader_cut = Outcome.retry(
            f"the feed reader of {name} went away before it read this"
            " (cut as a slow consumer, or gone)"
        )

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Write routed messages to the readers of the feeds their addresses name.

        The messages for one feed are written to its reader in one write; in
        a fleet, those for a feed read on another node are forwarded there.

        Returns:
            A Deferred with one outcome per message, in order: fired at once,
            or once every reader the batch congested drained (retry later
            for what was written to a reader cut before it drained), or once
            the node with the reader answered.
        """
        if not messages:
            return succeed([])
        feed = messages[0].address
        if any(message.address != feed for message in messages):
            return self._to_feeds(messages)
        if self._elsewhere(feed):
            return self._forward(feed, messages)
        readers: list[Congestion] = []
        outcomes = self._to_feed(feed, messages, readers)
        return answer_when_drained(readers, outcomes, self._reader_cut)

    def _to_feeds(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """A batch for several feeds: each feed's share as one batch, answered in order."""
        by_feed: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_feed.setdefault(message.address, []).append(index)
        outcomes: list[Outcome] = [Outcome.accepted()] * len(messages)
        readers: list[Congestion] = []
        forwarded: list[tuple[list[int], Deferred[list[Outcome]]]] = []
        for feed, indices in by_feed.items():
            share = [messages[index] for index in indices]
            if self._elsewhere(feed):
                forwarded.append((indices, self._forward(feed, share)))
                continue
            answered = self._to_feed(feed, share, readers)
            for index, outcome in zip(indices, answered, strict=True):
                outcomes[index] = outcome
        here = answer_when_drained(readers, outcomes, self._reader_cut)
        if not forwarded:
            return here
        return _gathered(len(messages), here, forwarded)

    def _elsewhere(self, feed: str) -> bool:
        """Whether ``feed``'s deliveries go to another node (in a fleet, not read here)."""
        return self.fleet is not None and feed in self._names and feed not in self.readers

    def _forward(self, feed: str, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Encode the envelopes here, and send them to the node that has the feed's reader."""
        assert self.fleet is not None
        outcomes, parts = encode_envelopes(
            messages,
            feed,
            lambda why: Outcome.rejected(f"feed {feed!r} cannot carry the message: {why}"),
        )
        if not parts:
            return succeed(outcomes)
        indices = [index for index, outcome in enumerate(outcomes) if outcome.is_accepted]

        def placed(answered: list[Outcome]) -> list[Outcome]:
            for index, outcome in zip(indices, answered, strict=True):
                outcomes[index] = outcome
            return outcomes

        return self.fleet.forward(feed, parts).addCallback(placed)

    def _to_feed(
        self, feed: str, messages: Sequence[Message], readers: list[Congestion]
    ) -> list[Outcome]:
        if feed not in self._names:
            return [Outcome.rejected(f"{self.name} has no feed named {feed!r}")] * len(messages)
        reader = self.readers.get(feed)
        if reader is None:
            return [Outcome.retry(f"feed {feed!r} of {self.name} has no reader")] * len(messages)
        readers.append(reader.congestion)
        return reader.deliver(messages)


def _gathered(
    count: int,
    here: Deferred[list[Outcome]],
    forwarded: Sequence[tuple[list[int], Deferred[list[Outcome]]]],
) -> Deferred[list[Outcome]]:
    """One batch's outcomes from its share written here and its shares forwarded."""
    elsewhere = {index for indices, _ in forwarded for index in indices}

    def cancel(_: Answers) -> None:
        for waiting in (here, *(d for _, d in forwarded)):
            waiting.cancel()

    answers = Answers(count, cancel)

    def settle_here(outcomes: list[Outcome]) -> None:
        for index, outcome in enumerate(outcomes):
            if index not in elsewhere:
                answers.settle(index, outcome)

    def settle(outcomes: list[Outcome], indices: list[int]) -> None:
        for index, outcome in zip(indices, outcomes, strict=True):
            answers.settle(index, outcome)

    here.addCallback(settle_here)
    for indices, waiting in forwarded:
        waiting.addCallback(settle, indices)
    return answers.deferred
