"""Tests for `gateway.core.message`: messages, outcomes and how outcomes combine."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.message import Message, Origin, Outcome, Status, new_message_id, worst

_BY_SEVERITY = (Status.ACCEPTED, Status.RETRY, Status.REJECTED)
"""Statuses from best to worst, as `worst` ranks them."""

_outcomes = st.builds(
    Outcome,
    st.sampled_from(Status),
    st.sampled_from(["", "full", "no such peer", "timed out"]),
    st.none() | st.sampled_from(["421", "550"]),
)


# --- Message -------------------------------------------------------------------------


def test_message_defaults() -> None:
    """A message needs only body and address; the rest has neutral defaults."""
    message = Message(body=b"hello", address="news")
    assert message.body == b"hello"
    assert message.address == "news"
    assert message.sender is None
    assert message.recipients == ()
    assert dict(message.headers) == {}
    assert message.timestamp == 0.0
    assert isinstance(message.id, str)
    assert message.id


def test_message_is_keyword_only() -> None:
    """Fields are passed by name, so body and address cannot be swapped by mistake."""
    with pytest.raises(TypeError):
        Message(b"hello", "news")  # type: ignore[call-arg]


def test_message_is_a_slotted_value() -> None:
    """A message has slots (no per-instance dict), equal messages hash alike, copies are new.

    Headers do not take part in the hash (a mapping is not hashable), nor
    does the origin in equality.
    """
    message = Message(body=b"hello", address="news", headers={"verb": "MCAST"})
    assert not hasattr(message, "__dict__")
    twin = attrs.evolve(message, headers={"verb": "UCAST"})
    assert hash(twin) == hash(message)
    assert twin != message
    moved = message.with_address("other")
    assert moved is not message
    assert message.address == "news"
    assert attrs.evolve(message, origin=Origin("r@s", 3)) == message


def test_headers_are_a_read_only_copy() -> None:
    """Headers are copied on the way in and cannot be changed through the message."""
    headers: dict[str, str | int] = {"verb": "MCAST", "priority": 3}
    message = Message(body=b"", address="news", headers=headers)
    headers["verb"] = "UCAST"
    assert message.headers == {"verb": "MCAST", "priority": 3}
    with pytest.raises(TypeError):
        message.headers["verb"] = "BCAST"  # type: ignore[index]


def test_with_address_keeps_everything_else() -> None:
    """`with_address` changes only the address: same id, body, sender and headers."""
    message = Message(
        body=b"23C",
        address="weather.paris",
        sender="alice",
        recipients=("a@example.org",),
        headers={"verb": "MCAST"},
        timestamp=1700000000.5,
    )
    moved = message.with_address("archive.paris")
    assert moved.address == "archive.paris"
    assert attrs.evolve(moved, address=message.address) == message
    assert moved.id == message.id
    assert moved.body == message.body
    assert message.address == "weather.paris"


_recipients = st.lists(st.text(max_size=4), max_size=2).map(tuple)
_messages = st.builds(
    Message,
    body=st.binary(max_size=8),
    address=st.text(max_size=8),
    id=st.text(max_size=8),
    sender=st.none() | st.text(max_size=8),
    recipients=_recipients,
    headers=st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    timestamp=st.floats(allow_nan=False),
    origin=st.none() | st.builds(Origin, st.text(max_size=4), st.integers(0, 9)),
)


@given(_messages, st.text(max_size=8))
def test_with_address_is_evolve_with_the_address(message: Message, address: str) -> None:
    """`with_address` (which sets the copy's slots itself) copies every field, origin too."""
    moved = message.with_address(address)
    expected = attrs.evolve(message, address=address)
    for field in attrs.fields(Message):
        assert getattr(moved, field.name) == getattr(expected, field.name), field.name
        if field.name != "address":
            assert getattr(moved, field.name) is getattr(message, field.name), field.name


@given(
    _messages,
    st.binary(max_size=8),
    st.text(max_size=8),
    st.none() | st.text(max_size=8),
    _recipients,
)
def test_translated_is_evolve_with_the_route_s_fields(
    message: Message, body: bytes, address: str, sender: str | None, recipients: tuple[str, ...]
) -> None:
    """`Message.translated` (which sets the copy's slots itself) is ``attrs.evolve``.

    The four fields a route changes are the ones given; the id, headers,
    timestamp and origin are the message's own (the same objects).
    """
    moved = message.translated(body, address, sender, recipients)
    changed = {"body": body, "address": address, "sender": sender, "recipients": recipients}
    expected = attrs.evolve(message, **changed)
    for field in attrs.fields(Message):
        assert getattr(moved, field.name) == getattr(expected, field.name), field.name
        if field.name not in changed:
            assert getattr(moved, field.name) is getattr(message, field.name), field.name


@given(
    body=st.binary(max_size=8),
    address=st.text(max_size=8),
    sender=st.none() | st.text(max_size=8),
    headers=st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    timestamp=st.floats(allow_nan=False),
)
def test_arrived_is_the_constructor(
    body: bytes, address: str, sender: str | None, headers: dict[str, int], timestamp: float
) -> None:
    """`Message.arrived` (which sets the slots itself) builds what the constructor builds.

    Every field but the id is the same; the id is fresh, as the constructor's.
    """
    frozen = MappingProxyType(headers)
    fast = Message.arrived(body, address, sender, frozen, timestamp)
    general = Message(
        body=body, address=address, sender=sender, headers=frozen, timestamp=timestamp
    )
    for field in attrs.fields(Message):
        if field.name != "id":
            assert getattr(fast, field.name) == getattr(general, field.name), field.name
    assert fast.id != general.id
    assert fast.id.rsplit("-", 1)[0] == general.id.rsplit("-", 1)[0]
    assert fast == attrs.evolve(general, id=fast.id)


def test_new_message_ids_are_unique() -> None:
    """Ids drawn in a row never repeat, and every message gets its own."""
    ids = {new_message_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    first = Message(body=b"", address="a")
    second = Message(body=b"", address="a")
    assert first.id != second.id
    assert first != second


def test_explicit_id_is_kept() -> None:
    """A protocol that carries its own id (QMQP, AMQP message-id) keeps it."""
    message = Message(body=b"", address="a", id="abc-1")
    assert message.id == "abc-1"
    assert message.with_address("b").id == "abc-1"


# --- Outcome -------------------------------------------------------------------------


def test_outcome_accepted() -> None:
    """`Outcome.accepted` is accepted, with no reason or code unless given a note."""
    outcome = Outcome.accepted()
    assert outcome == Outcome(Status.ACCEPTED, "", None)
    assert outcome.is_accepted
    noted = Outcome.accepted("queued")
    assert noted == Outcome(Status.ACCEPTED, "queued")
    assert noted.is_accepted


@pytest.mark.parametrize(
    ("make", "status"),
    [(Outcome.retry, Status.RETRY), (Outcome.rejected, Status.REJECTED)],
)
def test_outcome_failures(make: Callable[..., Outcome], status: Status) -> None:
    """`retry` and `rejected` carry the reason and the destination's code; not accepted."""
    outcome = make("mailbox full", "452")
    assert outcome == Outcome(status, "mailbox full", "452")
    assert not outcome.is_accepted
    assert make("gone").code is None


# --- worst ---------------------------------------------------------------------------


def test_worst_of_nothing_is_accepted() -> None:
    """A message that took no route has nothing against it: accepted."""
    assert worst([]) == Outcome.accepted()


def test_worst_of_one_is_that_one() -> None:
    """A single outcome is passed on unchanged, code included."""
    outcome = Outcome.retry("busy", "421")
    assert worst([outcome]) is outcome


@pytest.mark.parametrize(
    "outcomes",
    [
        [Outcome.accepted(), Outcome.retry("busy"), Outcome.rejected("no such topic")],
        [Outcome.rejected("no such topic"), Outcome.retry("busy"), Outcome.accepted()],
        [Outcome.retry("busy"), Outcome.rejected("no such topic"), Outcome.accepted()],
    ],
)
def test_any_rejection_wins(outcomes: list[Outcome]) -> None:
    """One rejected route makes the whole message rejected, wherever it comes."""
    assert worst(outcomes) == Outcome.rejected("no such topic")


def test_retry_beats_accepted() -> None:
    """Accepted only if every route accepted; otherwise the sender retries."""
    assert worst([Outcome.accepted(), Outcome.retry("busy")]) == Outcome.retry("busy")


def test_reasons_of_equally_bad_outcomes_are_joined() -> None:
    """The sender learns every reason of the worst kind, in route order."""
    combined = worst(
        [
            Outcome.retry("central: busy", "421"),
            Outcome.accepted("queued"),
            Outcome.retry("archive: timed out"),
        ]
    )
    assert combined == Outcome(Status.RETRY, "central: busy; archive: timed out", "421")


def test_reason_is_kept_when_the_first_worst_outcome_has_none() -> None:
    """An equally bad outcome's reason is not lost behind one without a reason."""
    combined = worst([Outcome.retry(""), Outcome.retry("archive: timed out")])
    assert combined == Outcome.retry("archive: timed out")


@given(st.lists(_outcomes, max_size=8))
def test_worst_status_is_the_most_severe(outcomes: list[Outcome]) -> None:
    """The combined status is the most severe status among the inputs."""
    expected = max(
        (outcome.status for outcome in outcomes),
        key=_BY_SEVERITY.index,
        default=Status.ACCEPTED,
    )
    assert worst(outcomes).status is expected


@given(st.lists(_outcomes, min_size=1, max_size=8))
def test_worst_reason_lists_every_worst_reason(outcomes: list[Outcome]) -> None:
    """The combined reason is every non-empty reason of the worst status, in order."""
    combined = worst(outcomes)
    expected = "; ".join(
        outcome.reason
        for outcome in outcomes
        if outcome.status is combined.status and outcome.reason
    )
    assert combined.reason == expected
