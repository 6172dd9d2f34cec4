"""A confirm=full writer's answers, in as few commands as the spec lets them be.

Spec, "Content Confirmation": a Confirm with ``multiple`` covers every
Content up to and including its sequence. A writer that streams a burst of
Contents can then be told of a whole run of accepted ones with one Confirm
instead of one each: half of the commands of a routed round trip, and
ZeroMQ sends are most of what a Content costs the listener.

"Every Content up to N" is the writer's numbering, and the listener knows
only what it read. So a multiple Confirm is sent only where both are the
same (`WriterAnswers.exact`): the Contents the writer sent on this
connection are numbered without a gap from 1 (or all of its numbered
commands are: Lease, Summon, Dismiss and Content sharing one count, as the
gateway's own upstream does), each was read here and routed, and nothing it
sent was dropped as ill-formed (whose sequence nobody knows). A gap, a
Content answered on the spot, or a writer that goes on numbering from an
earlier connection (its first Content is not 1) ends that for the peer:
each of its Contents is then answered alone, as the general code always
did. Within that, a run of accepted Contents is covered by one Confirm only
when every Content below the run's last one has been answered already (the
Rejects of the same batch go out first), so no Content still on its way is
ever confirmed by another's answer.

`WriterReplies` is what a listener's inbox answers through: one Content's
outcome, or a route's batch of them, told to their writers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from itertools import islice
from typing import Generic, Protocol, TypeVar

from gateway.codecs import mtl
from gateway.core.inbox import Result
from gateway.core.message import Outcome, Status
from gateway.core.router import Unrouted

__all__ = ["Writer", "WriterAnswers", "WriterReplies"]


class WriterAnswers:
    """What one writer peer was answered, and which of its Confirms may be one multiple Confirm.

    The listener tells it each numbered command the peer sent (`numbered`,
    `routed`), each Content answered alone (`answered`), and asks it how
    to confirm a batch's accepted Contents (`confirm`).
    """

    __slots__ = ("_answered", "_next_any", "_next_content", "_waiting")

    def __init__(self) -> None:
        self._next_content: int | None = 1
        """The sequence the next Content has if Contents are numbered alone (None: they are not)."""
        self._next_any: int | None = 1
        """The same if every numbered command shares one count (None: it does not)."""
        self._waiting: deque[int] = deque()
        """The Contents routed and not answered yet, in the order read (lowest first)."""
        self._answered: set[int] = set()
        """Contents answered while one read before them still waits."""

    @property
    def exact(self) -> bool:
        """Whether "every Content up to N" is still exactly what was read here and routed."""
        return self._next_content is not None or self._next_any is not None

    def lapse(self) -> None:
        """The peer's numbering can no longer be followed: answer each Content alone from now on."""
        self._next_content = self._next_any = None
        self._waiting.clear()
        self._answered.clear()

    def numbered(self, sequence: int) -> None:
        """The peer sent a Lease, Summon or Dismiss with this sequence."""
        if self._next_any is not None:
            self._next_any = sequence + 1 if sequence == self._next_any else None
            if self._next_content is None and self._next_any is None:
                self.lapse()

    def routed(self, sequence: int) -> None:
        """A Content read from the peer is routed and waits for its answer."""
        next_content, next_any = self._next_content, self._next_any
        if next_content is None and next_any is None:
            return
        self._next_content = sequence + 1 if sequence == next_content else None
        self._next_any = sequence + 1 if sequence == next_any else None
        if self._next_content is None and self._next_any is None:
            self.lapse()
        else:
            self._waiting.append(sequence)

    def answered(self, sequence: int) -> None:
        """A routed Content is answered alone (a Reject, say), before any Confirm that follows."""
        if self._next_content is None and self._next_any is None:
            return
        answered = self._answered
        answered.add(sequence)
        waiting = self._waiting
        while waiting and waiting[0] in answered:
            answered.remove(waiting.popleft())

    def confirm(self, sequences: list[int]) -> tuple[int | None, list[int]]:
        """How to confirm these routed Contents, accepted (the others' answers already sent).

        Returns:
            The sequence of one Confirm with ``multiple`` that covers those
            it can (None: none), and the sequences to confirm one by one.
        """
        if self._next_content is None and self._next_any is None:
            return None, sequences
        waiting = self._waiting
        count = len(sequences)
        if (
            not self._answered
            and 0 < count <= len(waiting)
            and waiting[count - 1] == sequences[-1]
            and list(islice(waiting, count)) == sequences
        ):  # the oldest waiting, in order (a route's whole batch): what follows, at C speed
            pop = waiting.popleft
            for _ in range(count):
                pop()
            return (None, sequences) if count < 2 else (sequences[-1], [])
        answered = self._answered
        answered.update(sequences)
        while waiting and waiting[0] in answered:
            answered.remove(waiting.popleft())
        if not waiting:  # everything read is answered
            covered, alone = sequences, []
        else:
            lowest = waiting[0]
            covered = [sequence for sequence in sequences if sequence < lowest]
            alone = [sequence for sequence in sequences if sequence > lowest]
        if len(covered) < 2:
            return None, covered + alone
        return max(covered), alone


class Writer(Protocol):
    """What `WriterReplies` reads of a writer peer (`gateway.protocols.mtl.peers.DataPeer`)."""

    @property
    def identity(self) -> bytes:
        """Its routing id."""

    @property
    def answers(self) -> WriterAnswers:
        """What it was answered."""


W = TypeVar("W", bound=Writer)


class WriterReplies(Generic[W]):
    """Tells writers what became of their routed Contents: a listener's inbox's answers.

    Each routed Content's token is its writer and sequence when its writer
    wants an answer, None when it does not.

    Args:
        peers: The listener's data peers by routing id (a writer forgotten
            since its Contents were routed is told nothing).
        send: Sends a data command to a peer (with the rest of the burst).
        answered: Told how many routed Contents have their outcomes now.
        count_error: Counts a protocol error of some kind.
    """

    __slots__ = ("_answered", "_count_error", "_peers", "_send")

    def __init__(
        self,
        peers: Mapping[bytes, W],
        send: Callable[[W, mtl.DataCommand], None],
        answered: Callable[[int], None],
        count_error: Callable[[str], None],
    ) -> None:
        self._peers = peers
        self._send = send
        self._answered = answered
        self._count_error = count_error

    def one(self, token: tuple[W, int] | None, result: Result) -> None:
        """Tell a writer what became of one Content: Confirm, or Reject (recycle: retry later)."""
        self._answered(1)
        if token is None:  # confirm=none: the writer hears nothing
            if isinstance(result, Unrouted):
                self._count_error("unrouted")
            return
        peer, sequence = token
        if self._peers.get(peer.identity) is not peer:
            return  # forgotten since: nobody to tell
        peer.answers.answered(sequence)
        if isinstance(result, Unrouted):
            self._send(peer, mtl.Reject(sequence, False, False))
        elif result.status is Status.ACCEPTED:
            self._send(peer, mtl.Confirm(sequence, False))
        else:
            self._send(peer, mtl.Reject(sequence, False, result.status is Status.RETRY))

    def batch(self, tokens: list[tuple[W, int] | None], outcomes: list[Outcome]) -> None:
        """Tell writers what became of a route's batch of their Contents, in few commands.

        Rejects go one by one, first; a writer's accepted Contents are
        covered by one Confirm with ``multiple`` where `WriterAnswers` says
        that confirms exactly them, and confirmed one by one otherwise.
        """
        self._answered(len(tokens))
        peers = self._peers
        send = self._send
        accepted: dict[W, list[int]] = {}
        for token, outcome in zip(tokens, outcomes, strict=True):
            if token is None:  # confirm=none: the writer hears nothing
                continue
            peer, sequence = token
            status = outcome.status
            if status is Status.ACCEPTED:  # a writer forgotten since is told nothing (below)
                run = accepted.get(peer)
                if run is None:
                    accepted[peer] = [sequence]
                else:
                    run.append(sequence)
            elif peers.get(peer.identity) is peer:  # not forgotten since: somebody to tell
                peer.answers.answered(sequence)
                send(peer, mtl.Reject(sequence, False, status is Status.RETRY))
        for peer, sequences in accepted.items():
            if peers.get(peer.identity) is not peer:
                continue  # forgotten since: nobody to tell
            upto, alone = peer.answers.confirm(sequences)
            if upto is not None:
                send(peer, mtl.Confirm(upto, True))
            for sequence in alone:
                send(peer, mtl.Confirm(sequence, False))
