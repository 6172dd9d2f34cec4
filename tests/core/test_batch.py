"""The batch path gives each message exactly the outcome the one-at-a-time path gives.

`gateway.core.batch.Answers` is checked directly; then a hypothesis property
drives the real `Router` with batches of messages whose routes, destinations
and fates (accepted, retry later, rejected, never answered until the
deadline, lost when the destination's connection drops mid-batch, a body
the route cannot transform) are drawn at random, and compares every
message's result with what the same message gets when it is routed alone.
Destinations are small real `IDestination` implementations built on
`Answers`; time is a `Clock`. A finished batch must leave no reference
circles behind (`tests.garbage`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from zope.interface import implementer

from gateway.core.addressing import AddressPattern
from gateway.core.batch import UNANSWERED, Answers
from gateway.core.inbox import Inbox
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import Result, Route, Router, Unrouted, bind_routes
from tests.garbage import no_circles_left

SOURCE = "in"
TIMEOUT_SECONDS = 5.0
DROP_AFTER_SECONDS = 1.0
"""When a destination's connection drops, losing the messages still open."""

FATES = ("accepted", "retry", "rejected", "hang", "lost", "untransformable")
_FATE_OUTCOMES = {
    "accepted": Outcome.accepted(),
    "retry": Outcome.retry("queue full"),
    "rejected": Outcome.rejected("no such mailbox"),
}
LOST = Outcome.retry("connection lost")


# --- Answers --------------------------------------------------------------------------


def test_answers_fire_once_every_message_has_its_outcome() -> None:
    """Outcomes settle in any order; the Deferred fires with them in batch order."""
    answers = Answers(3)
    fired: list[list[Outcome]] = []
    answers.deferred.addCallback(fired.append)
    answers.settle(2, Outcome.rejected("c"))
    answers.settle(0, Outcome.accepted())
    assert fired == []
    answers.settle(0, Outcome.retry("a second outcome is ignored"))
    answers.settle(1, Outcome.retry("b"))
    assert fired == [[Outcome.accepted(), Outcome.retry("b"), Outcome.rejected("c")]]


def test_answers_settle_rest_gives_the_open_messages_one_outcome() -> None:
    """A destination going away answers what it had not answered, and only that."""
    answers = Answers(3)
    answers.settle(1, Outcome.accepted())
    answers.settle_rest(LOST)
    assert answers.deferred.result == [LOST, Outcome.accepted(), LOST]


def test_cancelled_answers_keep_what_is_known_and_call_on_cancel() -> None:
    """The router's deadline: known outcomes stay, the rest become UNANSWERED."""
    cancelled: list[Answers] = []
    answers = Answers(2, cancelled.append)
    answers.settle(0, Outcome.accepted())
    answers.deferred.cancel()
    assert answers.deferred.result == [Outcome.accepted(), UNANSWERED]
    assert cancelled == [answers]


@given(
    st.integers(min_value=1, max_value=8).flatmap(
        lambda count: st.tuples(
            st.just(count),
            st.lists(
                st.tuples(
                    st.lists(st.integers(0, count - 1), max_size=count),
                    st.sampled_from(["ok", "later"]),
                    st.booleans(),
                ),
                max_size=6,
            ),
        )
    )
)
def test_settle_all_is_settle_for_each(case: tuple[int, list[tuple[list[int], str, bool]]]) -> None:
    """`Answers.settle_all` leaves the batch as `settle` one index at a time would.

    Also when an index is settled already or named twice: the first outcome stays,
    and the Deferred fires once, when the last open message gets one.
    """
    count, steps = case
    outcomes = {"ok": Outcome.accepted(), "later": Outcome.retry("later")}
    at_once, one_by_one = Answers(count), Answers(count)
    fired: list[list[list[Outcome]]] = [[], []]
    at_once.deferred.addCallback(fired[0].append)
    one_by_one.deferred.addCallback(fired[1].append)
    for indices, name, all_at_once in steps:
        outcome = outcomes[name]
        if all_at_once:
            at_once.settle_all(indices, outcome)
        else:
            for index in indices:
                at_once.settle(index, outcome)
        for index in indices:
            one_by_one.settle(index, outcome)
        assert at_once.outcomes == one_by_one.outcomes
        assert at_once.open == one_by_one.open
        assert fired[0] == fired[1]


def test_an_empty_batch_has_fired_already() -> None:
    """A batch of nothing needs no answer."""
    assert Answers(0).deferred.result == []


def test_cancelling_a_complete_batch_changes_nothing() -> None:
    """Once every message is answered, the deadline passing is not a cancellation."""
    answers = Answers(1, lambda _: pytest.fail("on_cancel after completion"))
    answers.settle(0, Outcome.accepted())
    answers.deferred.cancel()  # a fired Deferred ignores cancel()
    assert answers.deferred.result == [Outcome.accepted()]


# --- a destination with scripted fates -------------------------------------------------


@implementer(IDestination)
class ScriptedDestination:
    """Answers each message as the first word of its body says, through one `Answers`.

    ``accepted``/``retry``/``rejected`` are answered at once; ``hang`` is
    never answered (the router's deadline decides); ``lost`` is still open
    when the connection drops, `DROP_AFTER_SECONDS` later, and is answered
    retry then, as every real destination answers what it had in flight.
    """

    def __init__(self, name: str, clock: Clock) -> None:
        self.name = name
        self._clock = clock
        self.batches: list[list[str]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Answer the batch as scripted."""
        self.batches.append([m.id for m in messages])
        answers = Answers(len(messages))
        lost: list[int] = []
        for index, message in enumerate(messages):
            fate = message.body.split(b" ", 1)[0].decode()
            if fate in _FATE_OUTCOMES:
                answers.settle(index, _FATE_OUTCOMES[fate])
            elif fate == "lost":
                lost.append(index)
        if lost:
            self._clock.callLater(DROP_AFTER_SECONDS, _drop, answers, lost)
        return answers.deferred


def _drop(answers: Answers, lost: list[int]) -> None:
    for index in lost:
        answers.settle(index, LOST)


ROUTES = (
    # Two routes take "a.x": its outcome is the worse of the two.
    Route(name="a", source=SOURCE, pattern=AddressPattern("a.*"), destination="one",
          timeout_seconds=TIMEOUT_SECONDS),
    Route(name="x", source=SOURCE, pattern=AddressPattern("*.x"), destination="two",
          timeout_seconds=TIMEOUT_SECONDS),
    # A body that is not base64 cannot be decoded on this route: rejected by the route.
    Route(name="b", source=SOURCE, pattern=AddressPattern("b.*"), destination="two",
          timeout_seconds=TIMEOUT_SECONDS, body="unbase64"),
)  # fmt: skip
ADDRESSES = ("a.y", "a.x", "b.y", "c.x", "c.y")
"""a.y: route a; a.x: routes a and x; b.y: route b; c.x: route x; c.y: no route."""


def _world() -> tuple[Router, Clock]:
    clock = Clock()
    destinations = {name: ScriptedDestination(name, clock) for name in ("one", "two")}
    return Router(bind_routes(ROUTES, destinations), clock), clock


def _message(index: int, address: str, fate: str) -> Message:
    # "untransformable" bodies are not base64 (a space); the others' first word is the fate.
    body = f"{fate} body-{index}".encode()
    if address.startswith("b.") and fate != "untransformable":
        body = b"YWNjZXB0ZWQ="  # base64 of b"accepted": decodes, then is accepted
    return Message(body=body, address=address, id=f"m{index}")


def _settled(router: Router, clock: Clock, messages: list[Message]) -> list[Result]:
    results = router.dispatch(SOURCE, messages)
    clock.advance(DROP_AFTER_SECONDS)
    clock.advance(TIMEOUT_SECONDS)
    assert results.called, "every message has a result once the deadline has passed"
    outcome: list[Result] = results.result
    return outcome


def _key(result: Result) -> tuple[str, str]:
    if isinstance(result, Unrouted):
        return ("unrouted", ",".join(result.addresses))
    return (result.status.value, result.reason)


batches = st.lists(
    st.tuples(st.sampled_from(ADDRESSES), st.sampled_from(FATES)), min_size=1, max_size=12
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_a_batch_answers_each_message_as_if_it_were_alone(spec: list[tuple[str, str]]) -> None:
    """Partial refusals, time-outs and drops mid-batch: per message, batch == one at a time."""
    messages = [_message(i, address, fate) for i, (address, fate) in enumerate(spec)]
    router, clock = _world()
    together = _settled(router, clock, messages)
    alone = []
    for message in messages:
        router, clock = _world()
        alone.extend(_settled(router, clock, [message]))
    assert [_key(r) for r in together] == [_key(r) for r in alone]


@settings(max_examples=100, deadline=None)
@given(batches)
def test_each_route_gets_one_batch_in_arrival_order(spec: list[tuple[str, str]]) -> None:
    """A route's destination sees the messages it takes as one batch, in their order."""
    messages = [_message(i, address, fate) for i, (address, fate) in enumerate(spec)]
    router, clock = _world()
    _settled(router, clock, messages)
    table = router.table
    for bound in table.routes:
        destination = bound.delivery.destination  # type: ignore[attr-defined]
        taken = [
            m.id
            for m in messages
            if bound.route.pattern.match(m.address) is not None
            and not (bound.route.body == "unbase64" and m.body.startswith(b"untransformable"))
        ]
        if taken:
            assert taken in destination.batches


def test_the_inbox_answers_each_token_in_one_pass() -> None:
    """An Inbox hands a read to the router once and answers every token."""
    router, clock = _world()
    answered: list[tuple[str, tuple[str, str]]] = []
    inbox: Inbox[str] = Inbox(router, SOURCE, lambda token, r: answered.append((token, _key(r))))
    inbox.add(_message(0, "a.y", "accepted"), "t0")
    inbox.add(_message(1, "c.y", "accepted"), "t1")
    inbox.add(_message(2, "a.y", "hang"), "t2")
    assert len(inbox) == 3
    inbox.dispatch()
    assert len(inbox) == 0
    assert answered == [("t1", ("unrouted", "c.y"))]  # known at once; the route's batch waits
    clock.advance(TIMEOUT_SECONDS)
    assert [token for token, _ in answered] == ["t1", "t0", "t2"]
    assert answered[1][1] == ("accepted", "")
    assert answered[2][1][0] == "retry"
    inbox.dispatch()  # nothing added: nothing routed
    assert len(answered) == 3


def test_a_cancelled_batch_is_not_an_error() -> None:
    """Cancellation is the router's own doing; Answers turns it into outcomes, never a failure."""
    answers = Answers(1)
    answers.deferred.cancel()
    failures: list[object] = []
    answers.deferred.addErrback(lambda f: failures.append(f.check(CancelledError)))
    assert failures == []


# --- no circles: a finished batch is freed by reference counting -------------------------


class _Destination:
    """Holds its open batch, and forgets it when cancelled: a destination's usual shape."""

    def __init__(self, count: int) -> None:
        self.open: Answers | None = Answers(count, self._forget)
        self.forgotten = 0

    def _forget(self, _answers: Answers) -> None:
        self.forgotten += 1
        self.open = None


@pytest.mark.parametrize("finish", ["settle", "settle_all", "settle_rest", "cancel", "empty"])
def test_a_finished_batch_leaves_no_circles(finish: str) -> None:
    """Answered however it ends, a batch and its destination's side are freed at once.

    An ``on_cancel`` (here a bound method of the destination that holds the
    batch) kept after the batch fired would leave both to the cyclic collector.
    """
    with no_circles_left():
        destination = _Destination(0 if finish == "empty" else 3)
        answers = destination.open
        assert answers is not None
        fired: list[list[Outcome]] = []
        answers.deferred.addCallback(fired.append)
        if finish == "settle":
            for index in range(3):
                answers.settle(index, Outcome.accepted())
        elif finish == "settle_all":
            answers.settle_all([0, 1, 2], Outcome.accepted())
        elif finish == "settle_rest":
            answers.settle(1, Outcome.accepted())
            answers.settle_rest(LOST)
        elif finish == "cancel":
            answers.deferred.cancel()
            assert destination.forgotten == 1
        assert len(fired) == 1
        del destination, answers


def test_routed_batches_leave_no_circles() -> None:
    """Through the router, answered, timed out or dropped: nothing waits for the collector."""
    router, clock = _world()
    messages = [_message(i, address, fate) for i, (address, fate) in enumerate(
        [("a.y", "accepted"), ("a.x", "retry"), ("b.y", "accepted"), ("c.y", "accepted"),
         ("a.y", "hang"), ("c.x", "lost"), ("b.y", "untransformable")]
    )]  # fmt: skip
    _settled(router, clock, messages)  # the first batch builds each route's plan: kept
    with no_circles_left():
        results = _settled(router, clock, messages)
        assert len(results) == len(messages)
        del results
