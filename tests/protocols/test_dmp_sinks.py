"""Tests for `gateway.protocols.dmp.sinks`: a batch answered as its messages one by one."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import LogEvent, capturedLogs

from gateway.core.message import Message, Outcome, Status
from gateway.protocols.dmp.sinks import SinkOutcomes

_OUTCOMES = st.sampled_from(
    [
        Outcome.accepted(),
        Outcome(Status.ACCEPTED),  # equal to the shared one, not the same object
        Outcome.accepted("taken, with a word"),
        Outcome.retry("no reader"),
        Outcome.rejected("no such feed"),
    ]
)


class Sink:
    """A `SinkOutcomes` with its counters: errors, pauses and resumes, idle calls."""

    def __init__(self, clock: Clock, limit: int = 4) -> None:
        self.errors: Counter[str] = Counter()
        self.calls: list[str] = []
        self.outcomes = SinkOutcomes(
            "dmp",
            clock,
            limit,
            lambda: self.calls.append("pause"),
            lambda: self.calls.append("resume"),
            self.errors.update,
            lambda: self.calls.append("idle"),
        )
        self.outcomes.sink = "in"

    def read(self, count: int) -> None:
        """``count`` messages read and handed on, their outcomes to come."""
        self.outcomes.dispatch(count, lambda: None)


def _lines(events: list[LogEvent]) -> list[tuple[str, int]]:
    return [(event["log_format"], event["count"]) for event in events]


@given(st.lists(st.lists(_OUTCOMES, min_size=1, max_size=6), min_size=1, max_size=6))
def test_a_batch_is_answered_as_its_messages_one_by_one(batches: list[list[Outcome]]) -> None:
    """Property: counts, log lines, in-flight limit and idle calls are those of one answer each."""
    clock = Clock()
    alone, together = Sink(clock), Sink(clock)
    total = sum(len(batch) for batch in batches)
    alone.read(total)
    together.read(total)
    messages = [Message(body=b"x", address="in", id=f"m{n}") for n in range(total)]
    with capturedLogs() as one_by_one:
        start = 0
        for batch in batches:
            for message, outcome in zip(messages[start:], batch, strict=False):
                alone.outcomes.one(message, outcome)
            start += len(batch)
    with capturedLogs() as in_batches:
        start = 0
        for batch in batches:
            together.outcomes.batch(messages[start : start + len(batch)], batch)
            start += len(batch)
    assert together.errors == alone.errors
    assert _lines(in_batches) == _lines(one_by_one)
    assert together.outcomes.count == alone.outcomes.count == 0
    assert together.calls == alone.calls
    assert together.calls[-1] == "idle"
