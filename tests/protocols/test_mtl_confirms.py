"""Tests for `gateway.protocols.mtl.confirms`: a writer learns what one answer each would say.

The listener covers a run of a confirm=full writer's accepted Contents with
one Confirm with ``multiple`` where it can. The differential property here
drives two listeners bridged by a route (as in test_mtl_server.py) with a
writer whose Contents the reader confirms, rejects or asks to recycle in any
order and in any bursts, under several ways of numbering them, some of which
the listener must not follow; a model writer settles its Contents as the
spec says (``multiple``: every unsettled one up to the sequence). Each
Content must be settled exactly once, only after the reader answered it, and
as the reader answered it: what the general code, one answer per Content,
tells it.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.codecs import mtl
from gateway.protocols.mtl.confirms import WriterAnswers
from tests.garbage import no_circles_left
from tests.protocols.test_mtl_server import bridge, burst, contents, lease

_VERDICTS: dict[str, mtl.DataCommand] = {
    "confirm": mtl.Confirm(0, False),
    "reject": mtl.Reject(0, False, False),
    "recycle": mtl.Reject(0, False, True),
}


def _learned(command: mtl.DataCommand) -> str:
    if isinstance(command, mtl.Confirm):
        return "confirm"
    assert isinstance(command, mtl.Reject)
    return "recycle" if command.recycle else "reject"


def _numbers(scheme: str, count: int) -> tuple[list[int], list[int]]:
    """The writer's sequences for ``count`` Contents, and the ones it sent that never arrive."""
    if scheme == "from 1":
        return list(range(1, count + 1)), []
    if scheme == "after the lease":  # one count for Lease (1) and Contents
        return list(range(2, count + 2)), []
    if scheme == "earlier connection":  # 1 to 4 went out on a connection now gone
        return list(range(5, count + 5)), [1, 2, 3, 4]
    assert scheme == "gap"  # the second never arrives (lost with a connection, or ill-formed)
    return [1, *range(3, count + 2)], [2]


@settings(max_examples=150, deadline=None)
@given(
    scheme=st.sampled_from(["from 1", "after the lease", "earlier connection", "gap"]),
    count=st.integers(1, 25),
    data=st.data(),
)
def test_a_writer_learns_what_one_answer_each_says(
    scheme: str, count: int, data: st.DataObject
) -> None:
    """Whatever the order and bursts of the reader's answers, each Content is told its own."""
    world = bridge()  # the writer sent Lease 1
    sequences, lost = _numbers(scheme, count)
    verdicts = data.draw(
        st.lists(st.sampled_from(sorted(_VERDICTS)), min_size=count, max_size=count)
    )
    unsettled = set(sequences) | set(lost)  # the model writer's, by sequence
    told: dict[int, str] = {}
    answered: dict[int, str] = {}  # by the reader, by the writer's sequence
    written = 0
    pending: list[int] = []  # positions delivered to the reader and not answered
    seen = 0  # the writer's commands already applied
    while written < count or pending:
        if written < count and (not pending or data.draw(st.booleans())):
            size = data.draw(st.integers(1, count - written))
            burst(
                world.writers,
                [
                    (b"w", mtl.Content(sequence, "in", {}, b"%d" % position))
                    for position, sequence in enumerate(
                        sequences[written : written + size], start=written
                    )
                ],
            )
            written += size
            pending = [int(c.body) for c in contents(world.readers_sent, b"r")]
            pending = [position for position in pending if sequences[position] not in answered]
            continue
        chosen = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True))
        delivered = {int(c.body): c.sequence for c in contents(world.readers_sent, b"r")}
        answers = []
        for position in chosen:
            verdict = _VERDICTS[verdicts[position]]
            answers.append((b"r", _with_sequence(verdict, delivered[position])))
            answered[sequences[position]] = verdicts[position]
            pending.remove(position)
        burst(world.readers, answers)
        commands = world.writers_sent.commands(b"w")
        for command in commands[seen:]:
            if not isinstance(command, mtl.Confirm | mtl.Reject):
                continue
            covered = (
                [s for s in sorted(unsettled) if s <= command.sequence]
                if command.multiple
                else [command.sequence]
                if command.sequence in unsettled
                else []
            )
            for sequence in covered:
                unsettled.discard(sequence)
                told[sequence] = _learned(command)
        seen = len(commands)
        assert set(told) <= set(answered)  # never told before the reader answered
    assert told == answered  # each told once (a set), as the reader answered it
    assert unsettled == set(lost)  # what never arrived is never settled


def _with_sequence(verdict: mtl.DataCommand, sequence: int) -> mtl.DataCommand:
    if isinstance(verdict, mtl.Confirm):
        return mtl.Confirm(sequence, False)
    assert isinstance(verdict, mtl.Reject)
    return mtl.Reject(sequence, False, verdict.recycle)


def test_lapsed_answers_keep_nothing() -> None:
    """Once the numbering is not followed, nothing is kept per Content (no growth)."""
    answers = WriterAnswers()
    answers.routed(1)
    answers.routed(3)  # a gap
    assert not answers.exact
    for sequence in range(4, 1000):
        answers.routed(sequence)
        answers.answered(sequence)
    assert answers.confirm([1]) == (None, [1])
    assert not answers._waiting and not answers._answered


def test_answered_contents_are_not_kept() -> None:
    """Contents answered in order leave nothing behind, Rejects included."""
    answers = WriterAnswers()
    for sequence in range(1, 100):
        answers.routed(sequence)
        answers.answered(sequence)
    assert answers.exact
    assert not answers._waiting and not answers._answered


def _general_confirm(
    waiting: list[int], answered: set[int], sequences: list[int]
) -> tuple[int | None, list[int]]:
    """`WriterAnswers.confirm`'s general rule, on plain copies of its state (changed in place)."""
    answered.update(sequences)
    while waiting and waiting[0] in answered:
        answered.remove(waiting.pop(0))
    lowest = waiting[0] if waiting else None
    covered = [s for s in sequences if lowest is None or s < lowest]
    alone = [s for s in sequences if lowest is not None and s > lowest]
    if len(covered) < 2:
        return None, covered + alone
    return max(covered), alone


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(1, 30),
    first=st.integers(1, 3),
    data=st.data(),
)
def test_confirm_matches_the_general_rule(count: int, first: int, data: st.DataObject) -> None:
    """Whole batches in order (the fast path) or anything else: as the general rule says."""
    answers = WriterAnswers()
    for sequence in range(1, first):  # a Lease and so on, on the shared count
        answers.numbered(sequence)
    for sequence in range(first, first + count):
        answers.routed(sequence)
    waiting = list(range(first, first + count))
    answered: set[int] = set()
    left = list(waiting)
    while left:
        if data.draw(st.booleans()):  # the oldest ones, in order: a route's whole batch
            size = data.draw(st.integers(1, len(left)))
            chosen = left[:size]
        else:
            chosen = sorted(data.draw(st.lists(st.sampled_from(left), min_size=1, unique=True)))
        left = [s for s in left if s not in chosen]
        if data.draw(st.integers(0, 4)) == 0:  # a Reject's, told alone
            for sequence in chosen:
                answers.answered(sequence)
                answered.add(sequence)
                while waiting and waiting[0] in answered:
                    answered.remove(waiting.pop(0))
            continue
        assert answers.confirm(chosen) == _general_confirm(waiting, answered, chosen)
        assert list(answers._waiting) == waiting
        assert answers._answered == answered


@pytest.mark.parametrize("readers", [1, 2])
def test_a_confirmed_routed_content_leaves_no_circles(readers: int) -> None:
    """Writer to reader and the Confirm back: the batch is freed when it is answered.

    At a paced rate each routed Content is a batch of its own; one left in
    a reference circle (its `PendingBatch` and its `Answers`) made a
    collection of the youngest generation, about 2 ms on the reactor, every
    thousand Contents or so.
    """
    world = bridge()
    if readers == 2:  # a second reader of "out": each Content goes out twice
        second = lease(world.readers, world.readers_control, "Reader", "full", ["out"])
        burst(world.readers, [(b"s", mtl.Lease(1, second)), (b"s", mtl.Summon(2, "out"))])
    for sequence in (2, 3):  # the first round makes what stays: plans, peers' state
        with no_circles_left() if sequence == 3 else nullcontext():
            burst(world.writers, [(b"w", mtl.Content(sequence, "in", {}, b"body"))])
            for reader in (b"r", b"s")[:readers]:
                (content,) = contents(world.readers_sent, reader)[-1:]
                burst(world.readers, [(reader, mtl.Confirm(content.sequence, False))])
            (confirm,) = world.writers_sent.commands(b"w")[-1:]
            assert confirm == mtl.Confirm(sequence, False)
