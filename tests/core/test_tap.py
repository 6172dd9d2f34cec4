"""Tests for `gateway.core.tap` and the router's tap hook.

A real `Router` on a `Clock`, with small real route deliveries: one that
answers at once, one whose outcomes the test fires.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from zope.interface import implementer

from gateway.core import tap as tap_module
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.interfaces import IRouteDelivery
from gateway.core.message import Message, Outcome
from gateway.core.router import BoundRoute, Result, Route, Router, RouteTable, Unrouted
from gateway.core.tap import (
    COUNTS_INTERVAL_SECONDS,
    MAX_LISTED_ITEMS,
    MAX_TAP_RECORDS,
    UNROUTED,
    Sampler,
    Tap,
    TapWriter,
)


@implementer(IRouteDelivery)
class _Answering:
    """Answers every message of a batch at once with one outcome."""

    def __init__(self, outcome: Outcome | None = None) -> None:
        self.outcome = outcome or Outcome.accepted()
        self.batches: list[list[Message]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch, answer it."""
        self.batches.append(list(messages))
        return succeed([self.outcome] * len(messages))


@implementer(IRouteDelivery)
class _Held:
    """Holds each batch until the test answers it (or the route's time-out does)."""

    def __init__(self) -> None:
        self.held: list[Deferred[list[Outcome]]] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hold the batch."""
        d: Deferred[list[Outcome]] = Deferred()
        self.held.append(d)
        return d


WEATHER = Route(
    name="weather",
    source="ssmp-in",
    pattern=AddressPattern("weather.*"),
    destination="archive",
    target=AddressTemplate("archive.{1}"),
    timeout_seconds=5.0,
)
ALL = Route(name="all", source="ssmp-in", pattern=AddressPattern("#"), destination="audit")
MAIL = Route(
    name="mail", source="qmqp-in", pattern=AddressPattern("#@example.com"), destination="hub"
)
SUBJECT = Route(
    name="subject",
    source="qmqp-in",
    pattern=AddressPattern("#@example.com"),
    destination="hub",
    body="subject",
)


def _router(*routes: tuple[Route, IRouteDelivery]) -> tuple[Router, Clock]:
    clock = Clock()
    clock.advance(1000.0)
    table = RouteTable([BoundRoute(route, delivery) for route, delivery in routes])
    return Router(table, clock), clock


def _route(router: Router, source: str, messages: Sequence[Message]) -> dict[int, Result]:
    results: dict[int, Result] = {}
    router.route(source, messages, results.__setitem__)
    return results


def _records(tap: Tap) -> list[dict[str, Any]]:
    return [json.loads(line) for line in tap.take().splitlines()]


# --- Sampler and Tap ----------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "taken"), [(1.0, 1000), (0.5, 500), (0.1, 100), (0.01, 10)])
def test_sampler_takes_a_steady_share(rate: float, taken: int) -> None:
    """A rate takes exactly that share of 1,000 offers, the first one included."""
    sampler = Sampler(rate)
    took = [sampler.take() for _ in range(1000)]
    assert took[0]
    assert sum(took) == taken


def test_sampler_spreads_what_it_takes() -> None:
    """Rate 0.01 takes the first message and every hundredth after it."""
    sampler = Sampler(0.01)
    assert [i for i in range(300) if sampler.take()] == [0, 100, 200]


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.3, 0.1, 0.07, 0.01, 0.001])
@pytest.mark.parametrize("chunks", [[1000], [1] * 50 + [950], [7, 333, 0, 1, 659], [999, 1]])
def test_take_many_takes_what_take_would(rate: float, chunks: list[int]) -> None:
    """Taking a batch at a time picks the same offers as taking one at a time."""
    one, many = Sampler(rate), Sampler(rate)
    expected = [i for i in range(sum(chunks)) if one.take()]
    got: list[int] = []
    offset = 0
    for count in chunks:
        got.extend(offset + position for position in many.take_many(count))
        offset += count
    assert got == expected


@pytest.mark.parametrize("rate", [0.0, -0.5, 1.5])
def test_sampler_refuses_rates_out_of_range(rate: float) -> None:
    """Rates outside (0, 1] are refused."""
    with pytest.raises(ValueError, match="above 0 and at most 1"):
        Sampler(rate)


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "either a listener or a route"),
        ({"listener": "a", "route": "b"}, "either a listener or a route"),
        ({"listener": "a", "max_records": 0}, "records"),
        ({"listener": "a", "max_records": MAX_TAP_RECORDS + 1}, "records"),
        ({"listener": "a", "sample": 2.0}, "sampling rate"),
    ],
)
def test_tap_refuses_what_it_cannot_do(arguments: dict[str, Any], problem: str) -> None:
    """A tap needs exactly one of listener and route, a rate and a record count in range."""
    with pytest.raises(ValueError, match=problem):
        Tap(**arguments)


# --- nobody taps ---------------------------------------------------------------------------


def test_without_taps_the_router_does_no_tap_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no taps the router never calls into the tap module, and routes as before."""

    def refuse(*args: object) -> None:
        raise AssertionError("observe_batch called without taps")

    monkeypatch.setattr(tap_module, "observe_batch", refuse)
    router, _ = _router((WEATHER, _Answering()))
    assert router.taps == ()
    results = _route(router, "ssmp-in", [Message(body=b"x", address="weather.oslo")])
    assert results == {0: Outcome.accepted()}


def test_a_tap_elsewhere_picks_nothing() -> None:
    """A tap on another listener or route sees nothing and counts nothing."""
    router, _ = _router((WEATHER, _Answering()), (MAIL, _Answering()))
    other = Tap(listener="qmqp-in")
    route = Tap(route="mail")
    router.add_tap(other)
    router.add_tap(route)
    _route(router, "ssmp-in", [Message(body=b"x", address="weather.oslo")])
    assert (other.counts(), route.counts()) == (
        {"seen": 0, "shown": 0, "sampled_out": 0, "dropped": 0},
    ) * 2
    assert other.take() == route.take() == b""


# --- records -------------------------------------------------------------------------------


def test_listener_tap_records_envelope_routes_and_outcome_once_answered() -> None:
    """A record comes when the route answers: envelope, size, headers, route, outcome, time."""
    held = _Held()
    router, clock = _router((WEATHER, held))
    tap = Tap(listener="ssmp-in")
    woken: list[int] = []
    tap.on_records = lambda: woken.append(tap.pending)
    router.add_tap(tap)
    message = Message(
        body=b"sunny", address="weather.oslo", id="m1", sender="alice", headers={"a": 1, "b": "x"}
    )
    _route(router, "ssmp-in", [message])
    assert (tap.pending, woken) == (0, [])
    clock.advance(0.25)
    held.held[0].callback([Outcome.retry("busy", code="421")])
    [record] = _records(tap)
    assert woken == [1]
    assert record == {
        "time": 1000.0,
        "listener": "ssmp-in",
        "id": "m1",
        "sender": "alice",
        "address": "weather.oslo",
        "recipients": [],
        "size": 5,
        "headers": 2,
        "header_keys": ["a", "b"],
        "routes": [
            {
                "route": "weather",
                "destination": "archive",
                "address": "archive.oslo",
                "recipients": [],
                "sender": "alice",
                "size": 5,
                "status": "retry",
                "code": "421",
                "reason": "busy",
                "seconds": 0.25,
            }
        ],
        "outcome": "retry",
    }
    assert tap.counts() == {"seen": 1, "shown": 1, "sampled_out": 0, "dropped": 0}


def test_unrouted_messages_are_recorded_at_once() -> None:
    """A message no route takes is recorded as it is routed, outcome unrouted."""
    router, _ = _router((WEATHER, _Answering()))
    tap = Tap(listener="ssmp-in")
    router.add_tap(tap)
    results = _route(router, "ssmp-in", [Message(body=b"", address="nowhere", id="n")])
    assert results == {0: Unrouted(("nowhere",))}
    [record] = _records(tap)
    assert (record["id"], record["routes"], record["outcome"]) == ("n", [], UNROUTED)


def test_a_message_on_several_routes_lists_each_in_table_order() -> None:
    """Every route a message took is listed in table order; the outcome is the worst."""
    weather = _Held()
    audit = _Answering(Outcome.rejected("no room", code="552"))
    router, _ = _router((WEATHER, weather), (ALL, audit))
    listener = Tap(listener="ssmp-in")
    only_weather = Tap(route="weather")
    router.add_tap(listener)
    router.add_tap(only_weather)
    _route(router, "ssmp-in", [Message(body=b"x", address="weather.oslo", id="w")])
    assert listener.pending == only_weather.pending == 0  # weather has not answered yet
    weather.held[0].callback([Outcome.accepted()])
    [record] = _records(listener)
    assert [(r["route"], r["status"]) for r in record["routes"]] == [
        ("weather", "accepted"),
        ("all", "rejected"),
    ]
    assert record["outcome"] == "rejected"
    [mine] = _records(only_weather)
    assert [(r["route"], r["address"]) for r in mine["routes"]] == [("weather", "archive.oslo")]
    assert mine["outcome"] == "accepted"


def test_route_tap_sees_only_that_routes_messages() -> None:
    """A route tap records the messages its route took, none of the others."""
    router, _ = _router((WEATHER, _Answering()), (MAIL, _Answering()))
    tap = Tap(route="weather")
    router.add_tap(tap)
    _route(
        router,
        "ssmp-in",
        [
            Message(body=b"", address="weather.oslo", id="1"),
            Message(body=b"", address="news", id="2"),
            Message(body=b"", address="weather.rome", id="3"),
        ],
    )
    assert [r["id"] for r in _records(tap)] == ["1", "3"]
    assert tap.seen == 2


def test_pattern_filters_on_the_source_address_or_any_recipient() -> None:
    """Only messages whose address, or one of whose recipients, matches are recorded."""
    router, _ = _router((WEATHER, _Answering()), (MAIL, _Answering()))
    weather = Tap(listener="ssmp-in", pattern=AddressPattern("weather.rome"))
    mail = Tap(route="mail", pattern=AddressPattern("ops@#"))
    router.add_tap(weather)
    router.add_tap(mail)
    _route(
        router,
        "ssmp-in",
        [Message(body=b"", address=a, id=a) for a in ("weather.oslo", "weather.rome")],
    )
    _route(
        router,
        "qmqp-in",
        [
            Message(body=b"", address="", recipients=("bob@example.com",), id="bob"),
            Message(
                body=b"",
                address="",
                recipients=("bob@example.com", "ops@example.com"),
                id="both",
            ),
        ],
    )
    assert [r["id"] for r in _records(weather)] == ["weather.rome"]
    assert [r["id"] for r in _records(mail)] == ["both"]
    assert weather.seen == mail.seen == 1


def test_sampling_counts_what_it_leaves_out() -> None:
    """With rate 0.1, one message in ten is recorded and the others counted sampled out."""
    router, _ = _router((WEATHER, _Answering()))
    tap = Tap(listener="ssmp-in", sample=0.1)
    router.add_tap(tap)
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo") for _ in range(100)])
    assert len(_records(tap)) == 10
    assert tap.counts() == {"seen": 100, "shown": 10, "sampled_out": 90, "dropped": 0}


def test_sampler_stops_at_a_limit() -> None:
    """With a limit, take_many takes no more than it, from the first offers it would take."""
    assert Sampler(1.0).take_many(10, limit=3) == [0, 1, 2]
    assert Sampler(0.5).take_many(100, limit=2) == [0, 2]
    assert Sampler(0.5).take_many(3, limit=10) == [0, 2]


def test_a_cap_per_second_takes_a_second_worth_then_refills() -> None:
    """per_second=5: five records at once, then none until the clock moves, then as it moves.

    What the cap leaves out counts as sampled out; it is described with the tap.
    """
    router, clock = _router((WEATHER, _Answering()))
    tap = Tap(listener="ssmp-in", per_second=5, clock=clock)
    assert tap.describe()["per_second"] == 5
    router.add_tap(tap)
    batch = [Message(body=b"", address="weather.oslo", id=str(i)) for i in range(20)]
    _route(router, "ssmp-in", batch)
    assert [r["id"] for r in _records(tap)] == ["0", "1", "2", "3", "4"]
    _route(router, "ssmp-in", batch)
    assert _records(tap) == []
    clock.advance(0.4)  # two records' worth
    _route(router, "ssmp-in", batch)
    assert [r["id"] for r in _records(tap)] == ["0", "1"]
    clock.advance(60)  # never more than a second's worth at once
    _route(router, "ssmp-in", batch)
    assert len(_records(tap)) == 5
    assert tap.counts() == {"seen": 80, "shown": 12, "sampled_out": 68, "dropped": 0}


@pytest.mark.parametrize("per_second", [0.0, -1.0, float("nan"), float("inf"), 1e9])
def test_a_cap_out_of_range_is_refused(per_second: float) -> None:
    """A cap is above 0 and at most MAX_TAP_PER_SECOND."""
    with pytest.raises(ValueError, match="records a second"):
        Tap(listener="x", per_second=per_second, clock=Clock())


def test_a_cap_needs_a_clock() -> None:
    """A cap per second cannot be kept without a clock."""
    with pytest.raises(ValueError, match="clock"):
        Tap(listener="x", per_second=1.0)


def test_a_full_buffer_drops_and_counts() -> None:
    """Records past max_records are dropped and counted; once taken, records come again."""
    router, _ = _router((WEATHER, _Answering()))
    tap = Tap(listener="ssmp-in", max_records=3)
    woken: list[int] = []
    tap.on_records = lambda: woken.append(tap.pending)
    router.add_tap(tap)
    batch = [Message(body=b"", address="weather.oslo", id=str(i)) for i in range(10)]
    _route(router, "ssmp-in", batch)
    _route(router, "ssmp-in", batch)
    assert woken == [3]  # once per batch that brought records, never past the cap
    assert tap.counts() == {"seen": 20, "shown": 3, "sampled_out": 0, "dropped": 17}
    assert [r["id"] for r in _records(tap)] == ["0", "1", "2"]
    _route(router, "ssmp-in", batch[:1])
    assert [r["id"] for r in _records(tap)] == ["0"]


def test_records_dropped_while_waiting_for_outcomes_are_counted() -> None:
    """A buffer that fills while a batch waits for its route drops that batch's records."""
    held = _Held()
    router, _ = _router((WEATHER, held))
    tap = Tap(listener="ssmp-in", max_records=2)
    router.add_tap(tap)
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo") for _ in range(2)])
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo") for _ in range(2)])
    held.held[1].callback([Outcome.accepted()] * 2)
    held.held[0].callback([Outcome.accepted()] * 2)
    assert tap.counts() == {"seen": 4, "shown": 2, "sampled_out": 0, "dropped": 2}


def test_a_timed_out_route_is_recorded_as_retry() -> None:
    """A route that never answers is recorded with the router's time-out outcome."""
    held = _Held()
    router, clock = _router((WEATHER, held))
    tap = Tap(route="weather")
    router.add_tap(tap)
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo")])
    clock.advance(WEATHER.timeout_seconds)
    [record] = _records(tap)
    [part] = record["routes"]
    assert (part["status"], part["seconds"]) == ("retry", 5.0)
    assert "within 5 seconds" in part["reason"]


def test_a_refused_translation_is_recorded_at_once() -> None:
    """A message a route cannot translate is recorded as that route's rejection."""
    router, _ = _router((SUBJECT, _Answering()))
    tap = Tap(route="subject")
    router.add_tap(tap)
    _route(
        router,
        "qmqp-in",
        [Message(body=b"no headers", address="", recipients=("a@example.com",), id="r")],
    )
    [record] = _records(tap)
    [part] = record["routes"]
    assert (record["outcome"], part["route"], part["status"]) == ("rejected", "subject", "rejected")
    assert "no Subject" in part["reason"]


def test_long_lists_are_cut_with_their_count() -> None:
    """At most MAX_LISTED_ITEMS recipients and header names are listed; the count says all."""
    router, _ = _router((MAIL, _Answering()))
    tap = Tap(listener="qmqp-in")
    router.add_tap(tap)
    recipients = tuple(f"r{i}@example.com" for i in range(MAX_LISTED_ITEMS + 5))
    headers = {f"h{i}": i for i in range(MAX_LISTED_ITEMS + 1)}
    _route(
        router, "qmqp-in", [Message(body=b"", address="", recipients=recipients, headers=headers)]
    )
    [record] = _records(tap)
    assert len(record["recipients"]) == MAX_LISTED_ITEMS
    assert record["recipients_count"] == MAX_LISTED_ITEMS + 5
    assert (record["headers"], len(record["header_keys"])) == (
        MAX_LISTED_ITEMS + 1,
        MAX_LISTED_ITEMS,
    )
    assert record["routes"][0]["recipients_count"] == MAX_LISTED_ITEMS + 5


def test_removed_tap_sees_no_new_batches() -> None:
    """After remove_tap, batches are routed without it; other taps keep theirs."""
    router, _ = _router((WEATHER, _Answering()))
    gone, kept = Tap(listener="ssmp-in"), Tap(listener="ssmp-in")
    router.add_tap(gone)
    router.add_tap(kept)
    router.remove_tap(gone)
    assert router.taps == (kept,)
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo")])
    assert (gone.seen, kept.seen) == (0, 1)
    router.remove_tap(kept)
    assert router.taps == ()


def test_describe_says_what_the_tap_watches() -> None:
    """describe() gives listener or route, pattern, rate and records kept."""
    tap = Tap(route="weather", pattern=AddressPattern("weather.*"), sample=0.5, max_records=7)
    assert tap.describe() == {
        "listener": None,
        "route": "weather",
        "match": "weather.*",
        "sample": 0.5,
        "max": 7,
    }


# --- TapWriter -----------------------------------------------------------------------------


def _written(transport: StringTransport) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in transport.value().splitlines()]
    transport.clear()
    return lines


def _writer(tap: Tap) -> tuple[TapWriter, Router, Clock, StringTransport]:
    router, clock = _router((WEATHER, _Answering()))
    transport = StringTransport()
    writer = TapWriter(tap, router, transport, clock)
    writer.start()
    return writer, router, clock, transport


def test_writer_writes_what_it_taps_then_the_records() -> None:
    """The first line says what is tapped; each batch's records follow in one write."""
    tap = Tap(listener="ssmp-in", pattern=AddressPattern("weather.*"))
    writer, router, _, transport = _writer(tap)
    assert transport.producer is writer and transport.streaming
    assert router.taps == (tap,)
    assert _written(transport) == [{"tap": tap.describe(), "time": 1000.0}]
    writes: list[bytes] = []
    transport.write = writes.append  # type: ignore[method-assign]  # count the writes
    _route(
        router, "ssmp-in", [Message(body=b"", address="weather.oslo", id=str(i)) for i in range(3)]
    )
    [data] = writes
    assert [json.loads(line)["id"] for line in data.splitlines()] == ["0", "1", "2"]


def test_writer_writes_changed_counters_each_second() -> None:
    """Once a second the counters are written, only when they changed since the last time."""
    tap = Tap(listener="ssmp-in", sample=0.5)
    _, router, clock, transport = _writer(tap)
    _written(transport)
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo") for _ in range(4)])
    _written(transport)
    clock.advance(COUNTS_INTERVAL_SECONDS)
    assert _written(transport) == [
        {"time": 1001.0, "seen": 4, "shown": 2, "sampled_out": 2, "dropped": 0}
    ]
    clock.advance(COUNTS_INTERVAL_SECONDS)
    assert _written(transport) == []


def test_a_paused_consumer_gets_nothing_and_drops_past_the_buffer() -> None:
    """Paused: nothing is written, max_records wait and the rest are counted dropped."""
    tap = Tap(listener="ssmp-in", max_records=2)
    writer, router, clock, transport = _writer(tap)
    _written(transport)
    writer.pauseProducing()
    _route(
        router, "ssmp-in", [Message(body=b"", address="weather.oslo", id=str(i)) for i in range(5)]
    )
    clock.advance(COUNTS_INTERVAL_SECONDS)
    assert transport.value() == b""
    writer.resumeProducing()
    assert [line["id"] for line in _written(transport)] == ["0", "1"]
    clock.advance(COUNTS_INTERVAL_SECONDS)
    assert _written(transport) == [
        {"time": 1002.0, "seen": 5, "shown": 2, "sampled_out": 0, "dropped": 3}
    ]


def test_stop_removes_the_tap_and_the_timer() -> None:
    """stop() takes the tap off the router, cancels the timer and unregisters; twice is fine."""
    tap = Tap(listener="ssmp-in")
    writer, router, clock, transport = _writer(tap)
    writer.stop()
    writer.stop()
    assert router.taps == ()
    assert clock.getDelayedCalls() == []
    assert transport.producer is None
    assert tap.on_records is None


def test_stop_producing_stops() -> None:
    """The consumer's stopProducing stops the tap."""
    tap = Tap(route="weather")
    writer, router, clock, _ = _writer(tap)
    writer.stopProducing()
    assert (router.taps, clock.getDelayedCalls()) == ((), [])


def test_end_writes_what_is_left_and_why() -> None:
    """end() writes the waiting records (even when paused) and the counters with the reason."""
    tap = Tap(listener="ssmp-in")
    writer, router, _, transport = _writer(tap)
    _written(transport)
    writer.pauseProducing()
    _route(router, "ssmp-in", [Message(body=b"", address="weather.oslo", id="last")])
    writer.end("bye")
    first, last = _written(transport)
    assert first["id"] == "last"
    assert last == {
        "time": 1000.0,
        "seen": 1,
        "shown": 1,
        "sampled_out": 0,
        "dropped": 0,
        "end": "bye",
    }
    assert router.taps == ()
    writer.end("again")
    assert transport.value() == b""


def test_pattern_cache_starts_afresh_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its cap the match cache is cleared, and matching stays right."""
    monkeypatch.setattr(tap_module, "MAX_PATTERN_CACHE_ENTRIES", 2)
    router, _ = _router((WEATHER, _Answering()))
    tap = Tap(listener="ssmp-in", pattern=AddressPattern("weather.*"))
    router.add_tap(tap)
    addresses = ["weather.oslo", "news", "weather.rome", "sport", "weather.oslo", "x.y"]
    for _ in range(2):
        _route(router, "ssmp-in", [Message(body=b"", address=a, id=a) for a in addresses])
    assert [r["id"] for r in _records(tap)] == ["weather.oslo", "weather.rome", "weather.oslo"] * 2
    assert len(tap._matches) <= 2


@pytest.mark.parametrize("held", [False, True])
def test_a_failing_tap_never_costs_the_batch_its_routing(held: bool) -> None:
    """A tap that fails (here its reader) is logged; every message is answered all the same."""
    delivery: _Held | _Answering = _Held() if held else _Answering()
    router, _ = _router((WEATHER, delivery), (ALL, _Answering()))
    tap = Tap(listener="ssmp-in")

    def broken() -> None:
        raise RuntimeError("reader broke")

    tap.on_records = broken
    router.add_tap(tap)
    messages = [Message(body=b"", address="weather.oslo"), Message(body=b"", address="x")]
    with capturedLogs() as events:
        results = _route(router, "ssmp-in", messages)
        if isinstance(delivery, _Held):
            delivery.held[0].callback([Outcome.accepted()])
    assert results == {0: Outcome.accepted(), 1: Outcome.accepted()}
    failures = [formatEvent(event) for event in events if "log_failure" in event]
    assert failures
    assert all(text.startswith("a tap failed") for text in failures)
