"""The back-pressure parts: throttles, congestion, and answers that wait for a drain."""

from __future__ import annotations

import attrs
import pytest

from gateway.core.flow import (
    DEFAULT_FLOW,
    DISCONNECT,
    PAUSE_PRODUCERS,
    Congestion,
    FlowPolicy,
    Throttle,
    answer_when_drained,
)
from gateway.core.message import Outcome


class _Reading:
    """A producer's reading, as its throttle switches it."""

    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.throttle = Throttle(self._pause, self._resume)

    def _pause(self) -> None:
        self.paused += 1

    def _resume(self) -> None:
        self.resumed += 1


def test_a_throttle_pauses_on_the_first_hold_and_resumes_on_the_last_release() -> None:
    """Reading is switched once per change of state, however many consumers hold it."""
    reading = _Reading()
    first, second = Congestion(), Congestion()
    first.begin()
    second.begin()
    first.hold(reading.throttle)
    first.hold(reading.throttle)  # a second hold by the same consumer is nothing
    second.hold(reading.throttle)
    assert (reading.paused, reading.resumed) == (1, 0)
    first.drained()
    assert reading.throttle.held
    second.gone()
    assert not reading.throttle.held
    assert (reading.paused, reading.resumed) == (1, 1)


def test_a_forgotten_producer_is_not_released_later() -> None:
    """A producer that went away leaves its consumers nothing to release."""
    reading = _Reading()
    consumer = Congestion()
    consumer.begin()
    consumer.hold(reading.throttle)
    assert consumer.held_count == 1
    reading.throttle.forget()
    assert consumer.held_count == 0
    consumer.drained()
    assert reading.resumed == 0


def test_answers_that_find_nobody_congested_are_given_at_once() -> None:
    """No congested consumer: the outcomes stand, already fired."""
    outcomes = [Outcome.accepted(), Outcome.rejected("no")]
    result: list[list[Outcome]] = []
    answer_when_drained([Congestion()], outcomes).addCallback(result.append)
    assert result == [outcomes]


def test_answers_wait_for_every_congested_consumer() -> None:
    """The batch is answered when the last of its congested consumers drained."""
    first, second = Congestion(), Congestion()
    first.begin()
    second.begin()
    result: list[list[Outcome]] = []
    answer_when_drained([first, second], [Outcome.accepted()]).addCallback(result.append)
    first.drained()
    assert result == []
    second.drained()
    assert result == [[Outcome.accepted()]]


@pytest.mark.parametrize("if_cut", [None, Outcome.retry("cut")])
def test_a_consumer_cut_first_answers_as_told(if_cut: Outcome | None) -> None:
    """Cut before it drained: accepted messages become ``if_cut``, when given; others stand."""
    consumer = Congestion()
    consumer.begin()
    outcomes = [Outcome.accepted(), Outcome.rejected("too long")]
    result: list[list[Outcome]] = []
    answer_when_drained([consumer], outcomes, if_cut).addCallback(result.append)
    consumer.gone()
    expected = outcomes if if_cut is None else [if_cut, outcomes[1]]
    assert result == [expected]


def test_a_cancelled_wait_answers_as_written() -> None:
    """The route's deadline cancels the wait: the outcomes as they stand, and no second answer."""
    consumer = Congestion()
    consumer.begin()
    result: list[list[Outcome]] = []
    waiting = answer_when_drained([consumer], [Outcome.accepted()])
    waiting.addCallback(result.append)
    waiting.cancel()
    consumer.drained()
    assert result == [[Outcome.accepted()]]


def test_the_policy_defaults_and_choices() -> None:
    """Pause producers, cut after 10 s or 64 MiB; only the two policies exist."""
    assert DEFAULT_FLOW.policy == PAUSE_PRODUCERS and DEFAULT_FLOW.pauses_producers
    assert DEFAULT_FLOW.slow_consumer_seconds == 10.0
    assert DEFAULT_FLOW.max_backlog_bytes == 64 * 1024 * 1024
    assert not FlowPolicy(policy=DISCONNECT).pauses_producers
    with pytest.raises(ValueError, match="policy"):
        attrs.evolve(DEFAULT_FLOW, policy="drop")
