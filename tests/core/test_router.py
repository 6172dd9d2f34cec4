"""Tests for `gateway.core.router`: route tables, dispatch, time-outs and metrics.

Destinations here are small real implementations of `IDestination`; time is a
`twisted.internet.task.Clock` and metrics a real `GatewayMetrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.batch import UNANSWERED
from gateway.core.interfaces import IDestination, IRouteDelivery
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import (
    MAX_MATCH_CACHE_ENTRIES,
    DirectDelivery,
    Route,
    Router,
    RouteTable,
    Unrouted,
    bind_routes,
)
from gateway.metrics import GatewayMetrics
from tests.doubles import deliver_each, dispatch_one

T = TypeVar("T")


# --- destinations ---------------------------------------------------------------------


@implementer(IDestination)
class _AnsweringDestination:
    """A destination that answers every message at once with a fixed outcome."""

    def __init__(self, name: str, outcome: Outcome | None = None) -> None:
        self.name = name
        self.outcome = outcome or Outcome.accepted()
        self.received: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the messages and answer each with the fixed outcome."""
        self.received.extend(messages)
        return succeed([self.outcome] * len(messages))


@implementer(IDestination)
class _HeldDestination:
    """A destination whose outcomes the test decides, one message at a time."""

    def __init__(self, name: str, *, cancellable: bool = True) -> None:
        self.name = name
        self.cancellable = cancellable
        self.held: list[tuple[Message, Deferred[Outcome]]] = []
        self.cancelled: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hold each message of the batch."""
        return deliver_each(self._hold, messages)

    def _hold(self, message: Message) -> Deferred[Outcome]:
        """Keep the message; if cancellable, remember when the router gives up on it."""
        d: Deferred[Outcome] = Deferred(
            (lambda _: self.cancelled.append(message)) if self.cancellable else None
        )
        self.held.append((message, d))
        return d

    def answer(self, index: int, outcome: Outcome) -> None:
        """Fire the outcome of the ``index``-th held message."""
        self.held[index][1].callback(outcome)


@implementer(IDestination)
class _BrokenDestination:
    """A destination with a bug: every delivery fails with an exception."""

    def __init__(self, name: str) -> None:
        self.name = name

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Fail, as a buggy adapter would."""
        return fail(RuntimeError("disk on fire"))


@implementer(IRouteDelivery)
class _LoggedDelivery:
    """A stand-in for the durable log: accepts once "committed", remembers what."""

    def __init__(self, route: Route, destination: IDestination) -> None:
        self.route = route
        self.destination = destination
        self.committed: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Commit the messages (in memory) and accept them."""
        self.committed.extend(messages)
        return succeed([Outcome.accepted("committed")] * len(messages))


# --- helpers ------------------------------------------------------------------------


def _route(
    name: str,
    match: str,
    *,
    source: str = "hub",
    destination: str = "central",
    address: str | None = None,
    timeout: float = 10.0,
    durable: bool = False,
) -> Route:
    """Return a route; the defaults take messages from ``hub`` to ``central``."""
    return Route(
        name=name,
        source=source,
        pattern=AddressPattern(match),
        destination=destination,
        target=AddressTemplate(address) if address is not None else None,
        durable=durable,
        timeout_seconds=timeout,
    )


def _router(
    routes: list[Route], *destinations: IDestination
) -> tuple[Router, Clock, GatewayMetrics]:
    """Return a router over routes bound to destinations, with its clock and metrics."""
    clock = Clock()
    metrics = GatewayMetrics()
    table = bind_routes(routes, {d.name: d for d in destinations})
    return Router(table, clock, metrics), clock, metrics


def _dispatch(
    router: Router, address: str, body: bytes = b"23C", source: str = "hub"
) -> Deferred[Outcome]:
    """Dispatch a message that some route must take."""
    d = dispatch_one(router, source, Message(body=body, address=address))
    assert not isinstance(d, Unrouted), f"no route takes {address} from {source}"
    return d


def _result(d: Deferred[T]) -> T:
    """Return what an already fired Deferred fired with, or raise its failure."""
    results: list[T] = []
    failures: list[Failure] = []
    d.addCallbacks(results.append, failures.append)
    if failures:
        failures[0].raiseException()
    assert results, "the Deferred has not fired"
    return results[0]


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    """Return one sample of the metrics registry; 0 if it was never counted."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# --- interfaces ---------------------------------------------------------------------


def test_fakes_and_direct_delivery_provide_their_interfaces() -> None:
    """The test destinations and both deliveries really implement the interfaces."""
    for destination in (
        _AnsweringDestination("a"),
        _HeldDestination("b"),
        _BrokenDestination("c"),
    ):
        assert verifyObject(IDestination, destination)
    assert verifyObject(IRouteDelivery, DirectDelivery(_AnsweringDestination("a")))
    assert verifyObject(
        IRouteDelivery, _LoggedDelivery(_route("r", "x"), _AnsweringDestination("a"))
    )


# --- matching and translation -----------------------------------------------------------


def test_no_matching_route_gives_none() -> None:
    """A message no route takes is not delivered; dispatch answers Unrouted."""
    central = _AnsweringDestination("central")
    router, _, _ = _router([_route("weather", "weather.#")], central)
    assert not router.has_routes("hub", "news.today")
    assert dispatch_one(router, "hub", Message(body=b"", address="news.today")) == Unrouted(
        ("news.today",)
    )
    assert central.received == []


def test_routes_belong_to_their_source() -> None:
    """A route takes messages only from the endpoint it names as ``from``."""
    central = _AnsweringDestination("central")
    hub = _AnsweringDestination("hub")
    routes = [
        _route("weather-out", "weather.#"),
        _route("alerts-in", "alerts", source="central", destination="hub"),
    ]
    router, _, _ = _router(routes, central, hub)
    assert router.table.sources() == frozenset({"hub", "central"})
    assert router.has_routes("hub", "weather.paris")
    assert not router.has_routes("central", "weather.paris")
    assert isinstance(
        dispatch_one(router, "central", Message(body=b"", address="weather.paris")), Unrouted
    )
    assert not router.has_routes("hub", "alerts")

    assert _result(_dispatch(router, "alerts", source="central")).is_accepted
    assert [m.address for m in hub.received] == ["alerts"]
    assert central.received == []


def test_address_is_translated_through_the_template() -> None:
    """The destination receives the templated address; id and body are unchanged."""
    central = _AnsweringDestination("central")
    router, _, _ = _router([_route("archive", "weather.*.#", address="archive.{1}[{2}]")], central)
    message = Message(body=b"23C", address="weather.fr.paris.east", sender="alice")
    d = dispatch_one(router, "hub", message)
    assert d is not None
    assert _result(d) == Outcome.accepted()
    [delivered] = central.received
    assert delivered.address == "archive.fr[paris.east]"
    assert delivered.with_address(message.address) == message


def test_address_is_kept_without_a_template() -> None:
    """A route without ``address`` delivers on the source address."""
    central = _AnsweringDestination("central")
    router, _, _ = _router([_route("weather", "weather.#")], central)
    message = Message(body=b"23C", address="weather.paris")
    assert not isinstance(dispatch_one(router, "hub", message), Unrouted)
    assert central.received == [message]


def test_destination_outcome_is_the_answer() -> None:
    """With one route, the sender gets exactly the destination's outcome."""
    refused = Outcome.rejected("no such topic", "404")
    router, _, _ = _router(
        [_route("weather", "weather.#")], _AnsweringDestination("central", refused)
    )
    assert _result(_dispatch(router, "weather.paris")) == refused


# --- several routes -------------------------------------------------------------------------


def test_several_routes_all_get_the_message() -> None:
    """A message matching several routes is delivered along each of them."""
    central = _AnsweringDestination("central")
    archive = _AnsweringDestination("archive")
    routes = [
        _route("weather", "weather.#"),
        _route("archive", "weather.*", destination="archive", address="old.{1}"),
    ]
    router, _, _ = _router(routes, central, archive)
    assert _result(_dispatch(router, "weather.paris")) == Outcome.accepted()
    assert [m.address for m in central.received] == ["weather.paris"]
    assert [m.address for m in archive.received] == ["old.paris"]


def test_several_routes_answer_the_worst_outcome() -> None:
    """The combined outcome waits for every route and is the worst of them."""
    central = _HeldDestination("central")
    archive = _HeldDestination("archive")
    mirror = _HeldDestination("mirror")
    routes = [
        _route("a-central", "weather.#"),
        _route("b-archive", "weather.#", destination="archive"),
        _route("c-mirror", "weather.#", destination="mirror"),
    ]
    router, _, _ = _router(routes, central, archive, mirror)
    d = _dispatch(router, "weather.paris")
    central.answer(0, Outcome.retry("central busy"))
    archive.answer(0, Outcome.accepted())
    assert not d.called
    mirror.answer(0, Outcome.retry("mirror busy"))
    assert _result(d) == Outcome(Status.RETRY, "central busy; mirror busy")


def test_a_rejection_on_one_route_rejects_the_message() -> None:
    """Accepted only if every route accepted: one rejection is the answer."""
    routes = [
        _route("weather", "weather.#"),
        _route("archive", "weather.#", destination="archive"),
    ]
    router, _, _ = _router(
        routes,
        _AnsweringDestination("central"),
        _AnsweringDestination("archive", Outcome.rejected("disk full")),
    )
    assert _result(_dispatch(router, "weather.paris")) == Outcome.rejected("disk full")


# --- time-out -------------------------------------------------------------------------


def test_timeout_answers_retry_naming_route_and_destination() -> None:
    """No outcome within ``timeout_seconds``: retry, saying which route and where."""
    central = _HeldDestination("central")
    router, clock, _ = _router([_route("weather", "weather.#", timeout=5)], central)
    d = _dispatch(router, "weather.paris")
    clock.advance(4.9)
    assert not d.called
    clock.advance(0.1)
    outcome = _result(d)
    assert outcome.status is Status.RETRY
    assert "route weather" in outcome.reason
    assert "central" in outcome.reason
    assert "5 seconds" in outcome.reason
    assert central.cancelled == [central.held[0][0]]


def test_outcome_after_the_timeout_is_ignored() -> None:
    """A destination that cannot cancel and answers after the time-out changes nothing."""
    central = _HeldDestination("central", cancellable=False)
    router, clock, _ = _router([_route("weather", "weather.#", timeout=5)], central)
    d = _dispatch(router, "weather.paris")
    clock.advance(5)
    central.answer(0, Outcome.accepted())
    assert _result(d).status is Status.RETRY


def test_timely_outcome_cancels_the_timer() -> None:
    """One timer per route, not per message; it ends once nothing is left to watch."""
    central = _HeldDestination("central")
    router, clock, _ = _router([_route("weather", "weather.#", timeout=5)], central)
    d = _dispatch(router, "weather.paris")
    more = [_dispatch(router, "weather.lyon") for _ in range(10)]
    assert len(clock.getDelayedCalls()) == 1
    for index in range(11):
        central.answer(index, Outcome.accepted())
    clock.advance(5)  # the timer finds nothing waiting and does not come back
    assert clock.getDelayedCalls() == []
    assert central.cancelled == []
    assert _result(d) == Outcome.accepted()
    assert [_result(m) for m in more] == [Outcome.accepted()] * 10

    answering, answering_clock, _ = _router(
        [_route("weather", "weather.#")], _AnsweringDestination("central")
    )
    _dispatch(answering, "weather.paris")
    assert answering_clock.getDelayedCalls() == []


def test_timeout_of_one_route_among_several() -> None:
    """A route that times out makes the combined outcome retry with its reason."""
    routes = [
        _route("fast", "weather.#", destination="archive"),
        _route("slow", "weather.#", timeout=2),
    ]
    router, clock, _ = _router(
        routes, _AnsweringDestination("archive"), _HeldDestination("central")
    )
    d = _dispatch(router, "weather.paris")
    clock.advance(2)
    outcome = _result(d)
    assert outcome.status is Status.RETRY
    assert "route slow" in outcome.reason


# --- DirectDelivery ---------------------------------------------------------------------


def test_unexpected_failure_becomes_retry_and_is_logged() -> None:
    """A destination's exception is logged with its traceback and answered with retry."""
    broken = _BrokenDestination("central")
    message = Message(body=b"", address="weather.paris")
    with capturedLogs() as events:
        outcomes = _result(DirectDelivery(broken).deliver([message, message]))
    assert outcomes == [Outcome.retry("internal error delivering to central")] * 2
    [event] = [e for e in events if "log_failure" in e]
    assert event["log_failure"].check(RuntimeError)
    assert event["count"] == 2
    assert event["destination"] == "central"


def test_unexpected_failure_through_the_router() -> None:
    """Through the router the sender gets retry at once, not a time-out later."""
    router, clock, metrics = _router(
        [_route("weather", "weather.#")], _BrokenDestination("central")
    )
    with capturedLogs() as events:
        outcome = _result(_dispatch(router, "weather.paris"))
    assert outcome == Outcome.retry("internal error delivering to central")
    assert any("log_failure" in e for e in events)
    assert clock.getDelayedCalls() == []
    assert _sample(metrics, "msggateway_route_in_flight", route="weather") == 0


def test_cancellation_passes_through_direct_delivery() -> None:
    """Cancelling a delivery is not an internal error: the batch answers UNANSWERED, unlogged."""
    central = _HeldDestination("central")
    with capturedLogs() as events:
        d = DirectDelivery(central).deliver([Message(body=b"", address="x")])
        d.cancel()
        assert _result(d) == [UNANSWERED]
    assert [e for e in events if "log_failure" in e] == []


def test_timeout_is_not_logged_as_a_failure() -> None:
    """A time-out answers with the time-out reason and logs no failure."""
    router, clock, _ = _router(
        [_route("weather", "weather.#", timeout=1)], _HeldDestination("central")
    )
    with capturedLogs() as events:
        d = _dispatch(router, "weather.paris")
        clock.advance(1)
    assert "no outcome from central" in _result(d).reason
    assert [e for e in events if "log_failure" in e] == []


# --- metrics ---------------------------------------------------------------------------


def test_metrics_count_messages_outcomes_latency_and_in_flight() -> None:
    """Each route counts messages, bytes, outcomes by status and latency; in flight returns to 0."""
    central = _HeldDestination("central")
    router, clock, metrics = _router([_route("weather", "weather.#", timeout=10)], central)
    first = _dispatch(router, "weather.paris", b"12345")
    second = _dispatch(router, "weather.lyon", b"123")
    third = _dispatch(router, "weather.nice", b"")
    assert _sample(metrics, "msggateway_route_in_flight", route="weather") == 3
    assert _sample(metrics, "msggateway_route_messages_total", route="weather") == 3
    assert _sample(metrics, "msggateway_route_bytes_total", route="weather") == 8

    clock.advance(2)
    central.answer(0, Outcome.accepted())
    central.answer(1, Outcome.rejected("no"))
    assert _sample(metrics, "msggateway_route_in_flight", route="weather") == 1
    clock.advance(8)  # the third times out
    for d in (first, second, third):
        _result(d)

    assert _sample(metrics, "msggateway_route_in_flight", route="weather") == 0
    for status in ("accepted", "rejected", "retry"):
        assert (
            _sample(metrics, "msggateway_route_outcomes_total", route="weather", outcome=status)
            == 1
        )
    assert _sample(metrics, "msggateway_route_latency_seconds_count", route="weather") == 3
    assert _sample(metrics, "msggateway_route_latency_seconds_sum", route="weather") == 14.0


def test_router_works_without_metrics() -> None:
    """Metrics are optional: a router without them still delivers."""
    table = bind_routes(
        [_route("weather", "weather.#")], {"central": _AnsweringDestination("central")}
    )
    router = Router(table, Clock())
    assert _result(_dispatch(router, "weather.paris")).is_accepted


# --- replacing the table ----------------------------------------------------------------


def test_replace_table_applies_to_new_messages() -> None:
    """After `replace_table` new messages follow the new routes; earlier ones finish."""
    old_central = _HeldDestination("central")
    router, _, _ = _router([_route("weather", "weather.#")], old_central)
    earlier = _dispatch(router, "weather.paris")

    new_central = _AnsweringDestination("central")
    router.replace_table(bind_routes([_route("news", "news.*")], {"central": new_central}))
    assert isinstance(
        dispatch_one(router, "hub", Message(body=b"", address="weather.lyon")), Unrouted
    )
    assert _result(_dispatch(router, "news.today")).is_accepted
    assert [m.address for m in new_central.received] == ["news.today"]

    old_central.answer(0, Outcome.accepted())
    assert _result(earlier).is_accepted
    assert len(old_central.held) == 1


# --- the match cache ---------------------------------------------------------------------


def _table() -> RouteTable:
    """Return a table with overlapping routes from two sources."""
    destination = _AnsweringDestination("central")
    return bind_routes(
        [
            _route("all-weather", "weather.#"),
            _route("city", "weather.*"),
            _route("paris", "weather.paris"),
            _route("alerts", "alerts", source="other"),
        ],
        {"central": destination},
    )


@pytest.mark.parametrize(
    ("source", "address", "names"),
    [
        ("hub", "weather.paris", ["all-weather", "city", "paris"]),
        ("hub", "weather.lyon", ["all-weather", "city"]),
        ("hub", "weather", ["all-weather"]),
        ("hub", "news", []),
        ("other", "weather.paris", []),
        ("other", "alerts", ["alerts"]),
    ],
)
def test_match_cache_gives_the_same_results(source: str, address: str, names: list[str]) -> None:
    """A cached match equals the first one, in route order, with its captures."""
    table = _table()
    first = table.match(source, address)
    second = table.match(source, address)
    assert first == second
    assert [bound.route.name for bound, _ in first] == names
    assert [bound.route.name for bound, _ in _table().match(source, address)] == names


def test_match_cache_is_bounded() -> None:
    """Past `MAX_MATCH_CACHE_ENTRIES` distinct addresses the cache starts afresh."""
    table = _table()
    for i in range(MAX_MATCH_CACHE_ENTRIES + 10):
        table.match("hub", f"weather.{i}")
    # Private, but the bound is the point of this test: full at MAX entries,
    # cleared on the next new one, so the last 10 addresses are all it holds.
    assert len(table._cache) == 10
    [(bound, captures), _] = table.match("hub", "weather.1")
    assert bound.route.name == "all-weather"
    assert captures == ("1",)


# --- bind_routes -----------------------------------------------------------------------


def test_bind_routes_unknown_destination() -> None:
    """A route to a destination nobody provides is refused, naming both."""
    with pytest.raises(ValueError, match=r"route weather: no destination named 'nowhere'"):
        bind_routes([_route("weather", "weather.#", destination="nowhere")], {})


def test_bind_routes_durable_without_durable_delivery() -> None:
    """Durable routes are refused while no durable delivery exists."""
    with pytest.raises(ValueError, match=r"route weather: durable routes need the embedded log"):
        bind_routes(
            [_route("weather", "weather.#", durable=True)],
            {"central": _AnsweringDestination("central")},
        )


def test_bind_routes_gives_each_route_its_delivery() -> None:
    """Plain routes deliver directly; durable ones through the durable delivery."""
    central = _AnsweringDestination("central")
    made: list[_LoggedDelivery] = []

    def durable(route: Route, destination: IDestination) -> IRouteDelivery:
        made.append(_LoggedDelivery(route, destination))
        return made[-1]

    plain = _route("plain", "weather.#")
    kept = _route("kept", "orders", durable=True)
    table = bind_routes([plain, kept], {"central": central}, durable)
    assert (table.routes[0].route, table.routes[0].delivery) == (
        plain,
        DirectDelivery(central, "plain"),
    )
    assert (table.routes[1].route, table.routes[1].delivery) == (kept, made[0])
    assert made[0].route == kept
    assert made[0].destination is central

    router = Router(table, Clock())
    assert _result(_dispatch(router, "orders")) == Outcome.accepted("committed")
    assert [m.address for m in made[0].committed] == ["orders"]
    assert central.received == []


# --- recipients (QMQP) ------------------------------------------------------------


def _mail(*recipients: str, sender: str = "app@example.org") -> Message:
    """A message routed by its envelope recipients."""
    return Message(body=b"Subject: hi\n\nhello\n", address=recipients[0],
                   recipients=recipients, sender=sender)  # fmt: skip


def test_recipients_are_routed_each_and_delivered_once_per_route() -> None:
    """Each recipient is matched; each route delivers once, with its recipients translated."""
    alerts = _AnsweringDestination("alerts")
    archive = _AnsweringDestination("archive")
    router, _, _ = _router(
        [
            _route("to-alerts", "#@alerts.example.com", destination="alerts", address="alerts.{1}"),
            _route("to-archive", "#", destination="archive"),
        ],
        alerts,
        archive,
    )
    d = dispatch_one(router, "hub", _mail("disk@alerts.example.com", "cpu@alerts.example.com"))
    assert not isinstance(d, Unrouted)
    assert _result(d) == Outcome.accepted()
    [to_alerts] = alerts.received
    assert to_alerts.recipients == ("alerts.disk", "alerts.cpu")
    assert to_alerts.address == "alerts.disk"
    [to_archive] = archive.received
    assert to_archive.recipients == ("disk@alerts.example.com", "cpu@alerts.example.com")


def test_one_unroutable_recipient_stops_the_whole_message() -> None:
    """All or nothing: a recipient without a route means no delivery, and says which."""
    alerts = _AnsweringDestination("alerts")
    router, _, _ = _router(
        [_route("to-alerts", "*@alerts.example.com", destination="alerts")], alerts
    )
    result = dispatch_one(router, "hub", _mail("disk@alerts.example.com", "bob@elsewhere.org"))
    assert result == Unrouted(("bob@elsewhere.org",))
    assert alerts.received == []


def test_match_sender_filters_routes() -> None:
    """A route with match_sender takes only messages from matching senders."""
    central = _AnsweringDestination("central")
    route = attrs.evolve(
        _route("trusted", "#"), match_sender=AddressPattern("#@trusted.example.com")
    )
    router, _, _ = _router([route], central)
    from_eve = _mail("x@y.org", sender="eve@evil.org")
    assert isinstance(dispatch_one(router, "hub", from_eve), Unrouted)
    no_sender = attrs.evolve(_mail("x@y.org"), sender=None)
    assert isinstance(dispatch_one(router, "hub", no_sender), Unrouted)
    d = dispatch_one(router, "hub", _mail("x@y.org", sender="app@trusted.example.com"))
    assert not isinstance(d, Unrouted)
    assert len(central.received) == 1


def test_fixed_recipients_and_envelope_sender() -> None:
    """A route can send a topic's messages as mail to fixed recipients, from a set sender."""
    mail = _AnsweringDestination("mail")
    route = attrs.evolve(
        _route("topic-to-mail", "alerts", destination="mail"),
        recipients=("ops@example.com", "oncall@example.com"),
        envelope_sender="gateway@example.com",
    )
    router, _, _ = _router([route], mail)
    _result(_dispatch(router, "alerts"))
    [sent] = mail.received
    assert sent.recipients == ("ops@example.com", "oncall@example.com")
    assert sent.address == "ops@example.com"
    assert sent.sender == "gateway@example.com"


def test_single_address_message_keeps_no_recipients() -> None:
    """An SSMP-style message (no recipients) to one address stays recipient-less."""
    central = _AnsweringDestination("central")
    router, _, _ = _router([_route("w", "weather.*", address="wx.{1}")], central)
    _result(_dispatch(router, "weather.paris"))
    [sent] = central.received
    assert (sent.address, sent.recipients) == ("wx.paris", ())


# --- a clean stop: idle and no more intake ---------------------------------------------


def test_idle_at_once_when_nothing_is_in_flight() -> None:
    """`when_idle` has fired already when no batch waits for an answer."""
    router, _, _ = _router([_route("all", "#")], _AnsweringDestination("central"))
    assert router.when_idle().called
    _dispatch(router, "a")  # answered at once
    assert router.batches_in_flight == 0
    assert router.when_idle().called


def test_idle_fires_after_the_last_batch_is_answered_to_its_source() -> None:
    """Batches are counted, not messages; idle fires once the answers were handed on."""
    central = _HeldDestination("central")
    router, _, _ = _router([_route("all", "#")], central)
    answered: list[int] = []
    messages = [Message(body=b"x", address="a"), Message(body=b"y", address="b")]
    router.route("hub", messages, lambda index, _result: answered.append(index))
    _dispatch(router, "c")
    assert router.batches_in_flight == 2
    idle = router.when_idle()
    idle.addCallback(lambda _: answered.append(-1))  # after the answers, never before
    central.answer(0, Outcome.accepted())
    central.answer(2, Outcome.accepted())
    assert not idle.called
    central.answer(1, Outcome.accepted())
    assert answered == [0, 1, -1]
    assert router.batches_in_flight == 0


def test_a_batch_over_several_routes_is_one_batch_until_every_route_answered() -> None:
    """A message on two routes keeps the router busy until both have answered."""
    central, side = _HeldDestination("central"), _HeldDestination("side")
    router, _, _ = _router(
        [_route("one", "#"), _route("two", "#", destination="side")], central, side
    )
    d = _dispatch(router, "a")
    assert router.batches_in_flight == 1
    idle = router.when_idle()
    central.answer(0, Outcome.accepted())
    assert not idle.called
    side.answer(0, Outcome.accepted())
    assert _result(d).status is Status.ACCEPTED
    assert idle.called


def test_a_timed_out_batch_is_answered_and_no_longer_in_flight() -> None:
    """The route's deadline answers retry; the router is idle then."""
    router, clock, _ = _router([_route("all", "#", timeout=5)], _HeldDestination("central"))
    d = _dispatch(router, "a")
    idle = router.when_idle()
    clock.advance(5)
    assert _result(d).status is Status.RETRY
    assert idle.called


def test_a_cancelled_idle_waiter_is_forgotten() -> None:
    """Cancelling a wait (the grace ran out) leaves the other waiters and the count alone."""
    central = _HeldDestination("central")
    router, _, _ = _router([_route("all", "#")], central)
    _dispatch(router, "a")
    gave_up, waiting = router.when_idle(), router.when_idle()
    gave_up.addErrback(lambda failure: None)
    gave_up.cancel()
    central.answer(0, Outcome.accepted())
    assert waiting.called
    assert router.batches_in_flight == 0


def test_after_stop_taking_batches_are_refused_retry_or_left_unanswered() -> None:
    """Stopping: a listener's batch is answered retry at once; an upstream's gets no answer."""
    central = _AnsweringDestination("central")
    router, _, _ = _router([_route("all", "#"), _route("up", "#", source="upstream")], central)
    router.stop_taking(unanswered={"upstream"})
    outcome = _result(_dispatch(router, "a"))
    assert outcome.status is Status.RETRY
    assert outcome.reason == "the gateway is stopping"
    answered: list[int] = []
    router.route("upstream", [Message(body=b"x", address="a")], lambda i, _r: answered.append(i))
    assert answered == []
    assert central.received == []
    assert router.batches_in_flight == 0
    assert router.when_idle().called


# --- the plain routes' fast path against the general translation ------------------------

_WORDS = st.sampled_from(["a", "b", "wx", "paris", "x@y"])
_ADDRESSES = st.lists(_WORDS, min_size=1, max_size=3).map(".".join)
_SENDERS = st.none() | st.sampled_from(["alice", "bob@trusted", "eve"])


@st.composite
def _plain_routes(draw: st.DrawFn) -> list[Route]:
    """One to three routes from ``hub`` that rewrite at most the address."""
    routes = []
    for number in range(draw(st.integers(min_value=1, max_value=3))):
        match = draw(st.sampled_from(["#", "a.#", "*.paris", "wx", "*", "a.*.b"]))
        wildcards = AddressPattern(match).wildcards
        address = draw(
            st.none()
            | st.sampled_from(["fixed", "{address}", "copy.{address}"])
            | st.sampled_from([f"t.{{{n}}}" for n in range(1, wildcards + 1)] or ["fixed"])
        )
        route = _route(f"r{number}", match, destination=f"d{number}", address=address)
        if draw(st.booleans()):
            route = attrs.evolve(route, match_sender=AddressPattern("#@trusted"))
        routes.append(route)
    return routes


def _batches(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Message]]:
    """Batches of up to 12 messages of the plain routes' addresses and senders, and ``fields``."""
    return st.lists(
        st.builds(
            Message, body=st.binary(max_size=8), address=_ADDRESSES, sender=_SENDERS, **fields
        ),
        max_size=12,
    )


def _delivered(destinations: list[_AnsweringDestination]) -> list[list[object]]:
    """What each destination received: every message's fields and origin, in order."""
    return [[(attrs.astuple(m, recurse=False), m.origin) for m in d.received] for d in destinations]


@given(
    routes=_plain_routes(),
    batch=_batches(
        headers=st.sampled_from([{}, {"ssmp.verb": "MCAST"}]),
        timestamp=st.sampled_from([0.0, 1.5]),
    ),
)
def test_plain_routes_translate_as_the_general_code(
    routes: list[Route], batch: list[Message]
) -> None:
    """A batch over plain routes (the fast path) is delivered and answered as the general code.

    The same batch goes through a router whose routes are marked not plain,
    which translates every message through the general `_translate`: each
    destination gets the same messages, in the same order, with the same
    fields, and each message gets the same result.
    """
    results = []
    received = []
    for plain in (True, False):
        destinations = [_AnsweringDestination(f"d{n}") for n in range(len(routes))]
        router, _, _ = _router(routes, *destinations)
        for bound in router.table.routes:
            assert bound.plain
            object.__setattr__(bound, "plain", plain)
        answers: dict[int, object] = {}
        router.route("hub", batch, answers.__setitem__)
        results.append(answers)
        received.append(_delivered(destinations))
    assert results[0] == results[1]
    assert received[0] == received[1]


@given(
    routes=_plain_routes(),
    # Few recipients, so that a batch's messages often share them.
    batch=_batches(recipients=st.sampled_from([("a.b",), ("wx",), ("a.paris", "wx"), ("x@y",)])),
)
def test_a_batch_by_recipients_is_routed_as_each_message_alone(
    routes: list[Route], batch: list[Message]
) -> None:
    """Messages routed by their recipients (QMQP) share their routes' lookup within a batch.

    Routed as one batch, or each alone, every message gets the same result
    and each destination the same messages, in the same order, with the
    same fields (sender filters included).
    """
    results = []
    received = []
    for together in (True, False):
        destinations = [_AnsweringDestination(f"d{n}") for n in range(len(routes))]
        router, _, _ = _router(routes, *destinations)
        answers: dict[int, object] = {}
        if together:
            router.route("hub", batch, answers.__setitem__)
        else:
            for index, message in enumerate(batch):
                alone: dict[int, object] = {}
                router.route("hub", [message], alone.__setitem__)
                answers[index] = alone[0]
        results.append(answers)
        received.append(_delivered(destinations))
    assert results[0] == results[1]
    assert received[0] == received[1]


@given(
    st.lists(
        st.sampled_from(
            [
                Outcome.accepted(),
                Outcome(Status.ACCEPTED),  # equal to the shared one, not it
                Outcome.accepted("committed"),
                Outcome.retry("later"),
                Outcome.rejected("no"),
            ]
        ),
        min_size=1,
        max_size=12,
    )
)
def test_outcome_counts_match_the_outcomes(outcomes: list[Outcome]) -> None:
    """The route's outcome counters count each message once, under its status."""

    @implementer(IDestination)
    class Replaying:
        name = "central"

        def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
            return succeed(list(outcomes))

    router, _, metrics = _router([_route("all", "#")], Replaying())
    router.route("hub", [Message(body=b"x", address="a")] * len(outcomes), lambda i, r: None)
    for status in Status:
        expected = sum(outcome.status is status for outcome in outcomes)
        counted = _sample(
            metrics, "msggateway_route_outcomes_total", route="all", outcome=status.value
        )
        assert counted == expected
