"""Routes, the route table and the router.

A route takes messages that arrive at one endpoint (a listener or upstream,
by config name) on addresses matching a pattern, and delivers them to another
endpoint, on an address built from a template. Each route hands messages on
through an `IRouteDelivery`: `DirectDelivery` answers with the destination's
own outcome; the durable log (issue 4) supplies another implementation, so
any route can become durable without the router or the adapters changing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final, Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.batch import UNANSWERED
from gateway.core.deadlines import RouteDeadlines
from gateway.core.interfaces import IDeduplicatingDestination, IDestination, IRouteDelivery
from gateway.core.message import Message, Outcome, worst
from gateway.core.origins import deliver_once
from gateway.core.outcomes import KIND_ROUTE, OutcomeRecorder
from gateway.core.transforms import ENVELOPE_TRANSFORMS, TransformError, transform
from gateway.metrics import GatewayMetrics, RouteStats

__all__ = [
    "BoundRoute",
    "DirectDelivery",
    "Result",
    "Route",
    "RouteTable",
    "RouteTap",
    "Router",
    "TappedBatch",
    "Unrouted",
    "bind_routes",
]

DEFAULT_ROUTE_TIMEOUT_SECONDS: Final = 30.0
_UNANSWERED_ID: Final = id(UNANSWERED)
_ACCEPTED: Final = Outcome.accepted()
_ACCEPTED_LABEL: Final = _ACCEPTED.status.value
_BODY: Final = operator.attrgetter("body")
MAX_MATCH_CACHE_ENTRIES: Final = 65536
"""Distinct (source, address) pairs remembered; past it the cache starts afresh."""


@attrs.frozen
class Route:
    """One route, as configured (one file in ``etc/routes/``).

    Attributes:
        name: The route's name (its file name without ``.toml``).
        source: The listener or upstream messages arrive at.
        pattern: Which source addresses the route takes.
        destination: The listener or upstream it delivers to.
        target: How the destination address is built; None keeps the address.
        durable: Whether messages go through the embedded log (issue 4).
        timeout_seconds: How long a delivery may take before the sender is
            told to retry later.
        match_sender: If set, the route only takes messages whose sender
            (QMQP envelope sender, SSMP peer id) matches it.
        recipients: If set, the destination addresses, whatever the source
            address was (e.g. an SSMP topic's messages become mail to these).
        envelope_sender: If set, the sender the destination sees.
        body: How the body is transformed on the way (`gateway.core.transforms`).
        max_attempts: Durable routes: deliveries of a rejected message before
            it goes to the dead-letter stream.
        dead_letter: Durable routes: the dead-letter stream.
    """

    name: str
    source: str
    pattern: AddressPattern
    destination: str
    target: AddressTemplate | None = None
    durable: bool = False
    timeout_seconds: float = DEFAULT_ROUTE_TIMEOUT_SECONDS
    match_sender: AddressPattern | None = None
    recipients: tuple[str, ...] = ()
    envelope_sender: str | None = None
    body: str = "unchanged"
    max_attempts: int = 5
    dead_letter: str = "msggateway.dead-letter"

    def destination_address(self, address: str, captures: tuple[str, ...]) -> str:
        """Return the address a message on ``address`` is delivered to."""
        if self.target is None:
            return address
        return self.target.expand(address, captures)


@implementer(IRouteDelivery)
@attrs.frozen
class DirectDelivery:
    """Deliver straight to the destination and answer with its outcomes.

    Messages a consumer read (with an `Origin`) go to a destination that
    stores each id once under their origin's ids, with the route's name as
    producer (`gateway.core.origins`): read again, they are stored once.
    """

    destination: IDestination
    route: str = ""
    """The route's name: the producer of what it delivers by origin."""
    _log: Logger = attrs.field(factory=Logger, eq=False, repr=False)
    _once: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        once = IDeduplicatingDestination.providedBy(self.destination)
        object.__setattr__(self, "_once", once)

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hand the batch to the destination."""
        try:
            d: Deferred[list[Outcome]]
            if self._once and messages and messages[0].origin is not None:
                d = deliver_once(self.destination, self.route, messages)  # type: ignore[arg-type]
            else:
                d = self.destination.deliver(messages)
        except Exception:
            return succeed(self._failed(Failure(), len(messages)))
        return d.addErrback(self._failed, len(messages))

    def _failed(self, failure: Failure, count: int) -> list[Outcome]:
        if isinstance(failure.value, CancelledError):
            return failure  # type: ignore[return-value]  # the router's time-out handles it
        self._log.failure(
            "delivery of {count} message(s) to {destination} failed unexpectedly",
            failure,
            count=count,
            destination=self.destination.name,
        )
        return [Outcome.retry(f"internal error delivering to {self.destination.name}")] * count


@attrs.frozen
class Unrouted:
    """No route took these addresses; the message went nowhere.

    Attributes:
        addresses: The source addresses (recipients) without a route.
    """

    addresses: tuple[str, ...]


Result = Outcome | Unrouted
"""What a message's sender is answered from: its combined outcome, or no route."""


@attrs.frozen(eq=False)
class BoundRoute:
    """A route together with the delivery that carries its messages.

    Compared and hashed by identity: it is a dictionary key on the hot path.
    """

    route: Route
    delivery: IRouteDelivery
    plain: bool = attrs.field(init=False, repr=False)
    """The route rewrites at most the address (no recipients, envelope sender or body
    transform): a message without recipients is translated by `Message.with_address`."""

    def __attrs_post_init__(self) -> None:
        route = self.route
        plain = not route.recipients and route.envelope_sender is None and route.body == "unchanged"
        object.__setattr__(self, "plain", plain)


Match = tuple[BoundRoute, tuple[str, ...]]


class RouteTable:
    """An immutable set of routes with a cache of address matches.

    Matching is cached per (source, address) so that the hot path of a busy
    topic costs one dictionary lookup.
    """

    def __init__(self, routes: Iterable[BoundRoute] = ()) -> None:
        self.routes: tuple[BoundRoute, ...] = tuple(routes)
        self._by_source: dict[str, tuple[BoundRoute, ...]] = {}
        for bound in self.routes:
            self._by_source[bound.route.source] = (
                *self._by_source.get(bound.route.source, ()),
                bound,
            )
        self._cache: dict[tuple[str, str], tuple[Match, ...]] = {}
        self.rank: dict[BoundRoute, int] = {bound: i for i, bound in enumerate(self.routes)}
        """Each route's place in the table: several routes' outcomes combine in this order."""
        self._sources = frozenset(self._by_source)
        self.filters_senders = any(b.route.match_sender is not None for b in self.routes)
        """Some route takes messages by their sender (``match_sender``)."""

    def sources(self) -> frozenset[str]:
        """Return the endpoints some route takes messages from."""
        return self._sources

    def match(self, source: str, address: str, sender: str | None = None) -> tuple[Match, ...]:
        """Return the routes (with wildcard captures) a message takes.

        Routes with ``match_sender`` take the message only if its sender
        matches; the address part is cached, the sender check is not.
        """
        found = self._match_address(source, address)
        if self.filters_senders and found:
            found = tuple(
                (bound, captures)
                for bound, captures in found
                if bound.route.match_sender is None
                or (sender is not None and bound.route.match_sender.match(sender) is not None)
            )
        return found

    def _match_address(self, source: str, address: str) -> tuple[Match, ...]:
        key = (source, address)
        found = self._cache.get(key)
        if found is not None:
            return found
        matches: list[Match] = []
        for bound in self._by_source.get(source, ()):
            captures = bound.route.pattern.match(address)
            if captures is not None:
                matches.append((bound, captures))
        if len(self._cache) >= MAX_MATCH_CACHE_ENTRIES:
            self._cache.clear()
        result = self._cache[key] = tuple(matches)
        return result


def bind_routes(
    routes: Iterable[Route],
    destinations: Mapping[str, IDestination],
    durable: Callable[[Route, IDestination], IRouteDelivery] | None = None,
) -> RouteTable:
    """Build a route table, giving each route its delivery.

    Args:
        routes: The configured routes (already validated).
        destinations: Every listener's and upstream's destination, by name.
        durable: Builds the delivery for a durable route; None until the
            embedded log exists, in which case durable routes are refused.

    Raises:
        ValueError: A route names an unknown destination, or is durable and
            no durable delivery is available.
    """
    bound: list[BoundRoute] = []
    for route in routes:
        destination = destinations.get(route.destination)
        if destination is None:
            raise ValueError(f"route {route.name}: no destination named {route.destination!r}")
        if route.durable:
            if durable is None:
                raise ValueError(f"route {route.name}: durable routes need the embedded log")
            delivery = durable(route, destination)
        else:
            delivery = DirectDelivery(destination, route.name)
        bound.append(BoundRoute(route, delivery))
    return RouteTable(bound)


class _HoldsOrigins(Protocol):
    """A route delivery's `unforwarded` (`gateway.core.durable.DurableDelivery` has it)."""

    def __call__(self, reader: str) -> int | None: ...


class TappedBatch(Protocol):
    """What a tap keeps of one routed batch until its routes answer (`gateway.core.tap`)."""

    def answered(self, bound: BoundRoute, outcomes: Sequence[Outcome]) -> None:
        """One route's batch was answered."""


class RouteTap(Protocol):
    """A watcher of routed batches (`gateway.core.tap.Tap` is one).

    The router does not know the tap's module: it shows each batch to its
    taps through the first tap's ``observe_batch``, which picks every tap's
    messages at once (one pass per batch however many taps there are).
    """

    def observe_batch(
        self,
        taps: Sequence[RouteTap],
        source: str,
        messages: Sequence[Message],
        plan: dict[BoundRoute, tuple[list[int], list[Message]]],
        refused: dict[int, list[tuple[int, Outcome]]],
        table: RouteTable,
        clock: IReactorTime,
    ) -> TappedBatch | None:
        """Pick each of ``taps``' messages out of a routed batch (`gateway.core.tap`)."""


class Router:
    """Dispatches inbound messages along the routes that match them.

    Adapters ask `has_routes` on their hot path (one cached lookup) and call
    `dispatch` only when a route applies. The table can be replaced at any
    time (SIGHUP reload); messages already dispatched finish on the old one.

    A clean stop asks it to `stop_taking` batches and waits for `when_idle`:
    every batch routed before has then been answered to its source.
    """

    _log = Logger()

    def __init__(
        self,
        table: RouteTable,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.table = table
        self._clock = clock
        self._metrics = metrics
        self._watches: dict[BoundRoute, RouteDeadlines] = {}
        self.recorder: OutcomeRecorder | None = None
        """Keeps each message's route, source, times and outcome (issue 9), when set."""
        self.taps: tuple[RouteTap, ...] = ()
        """Who watches messages live (`gateway.core.tap`); looked at once per batch."""
        self.batches_in_flight = 0
        """Batches routed whose messages are not all answered yet."""
        self._idle_waiters: list[Deferred[None]] = []
        self._refusal: Outcome | None = None
        self._unanswered_sources: frozenset[str] = frozenset()

    def add_tap(self, tap: RouteTap) -> None:
        """Show ``tap`` the batches routed from now on."""
        self.taps = (*self.taps, tap)

    def remove_tap(self, tap: RouteTap) -> None:
        """Stop showing ``tap`` anything (records of batches in flight still reach it)."""
        self.taps = tuple(other for other in self.taps if other is not tap)

    def replace_table(self, table: RouteTable) -> None:
        """Use a new route table for messages dispatched from now on."""
        self.table = table

    def unforwarded(self, source: str, reader: str) -> int | None:
        """The lowest offset of ``reader`` that a route from ``source`` holds undelivered.

        Durable routes that deliver by origin into a fleet-wide destination
        keep what they committed until their forwarder delivered it
        (`gateway.core.origins.PendingOrigins`): a consumer stores no offset
        at or past it. None when no route holds any.
        """
        lowest: int | None = None
        for bound in self.table.routes:
            if bound.route.source != source:
                continue
            holds: _HoldsOrigins | None = getattr(bound.delivery, "unforwarded", None)
            found = None if holds is None else holds(reader)
            if found is not None and (lowest is None or found < lowest):
                lowest = found
        return lowest

    def has_routes(self, source: str, address: str) -> bool:
        """Whether any route takes messages from ``source`` on ``address``."""
        return bool(self.table.match(source, address))

    def dispatch(self, source: str, messages: Sequence[Message]) -> Deferred[list[Result]]:
        """`route` a batch and collect its results in one Deferred.

        Returns:
            A Deferred firing with one result per message, in order, once
            every message has one. It has fired already when nothing waits
            for a destination.
        """
        results: list[Result | None] = [None] * len(messages)
        done: Deferred[list[Result]] = Deferred()
        waiting = len(messages)
        if not waiting:
            done.callback([])
            return done

        def answer(index: int, result: Result) -> None:
            nonlocal waiting
            results[index] = result
            waiting -= 1
            if not waiting:
                done.callback(results)  # type: ignore[arg-type]  # no None left

        self.route(source, messages, answer)
        return done

    def route(
        self,
        source: str,
        messages: Sequence[Message],
        answer: Callable[[int, Result], None],
        answer_batch: Callable[[list[int], list[Outcome]], None] | None = None,
    ) -> None:
        """Deliver a batch along the routes that take its messages.

        Each message is routed by its recipients when it has any (QMQP),
        else by its address. It is all or nothing per message: when any
        recipient has no route, the message is delivered nowhere and its
        result is `Unrouted` naming them. Each route receives one batch: the
        messages it took, translated, in their order (a message with several
        recipients on one route is delivered once, with all of them).

        ``answer(index, result)`` is called once per message: at once when
        it has no route (or a route refused to translate it), else when
        every route it took has answered, with the combined `Outcome`
        (accepted only if every route accepted). A route's messages are
        answered together, when its batch is; a route never waits for
        another route's batch.

        Args:
            source: The listener or upstream the batch arrived at.
            messages: The messages, with their source-side address(es).
            answer: Told each message's result, by its index in ``messages``.
            answer_batch: If given, told the results of a one-route batch's
                messages at once instead (their indices and outcomes, in the
                batch's order): the adapter answers them in one go.
        """
        if self._refusal is not None:
            self._refuse(source, len(messages), answer)
            return
        table = self.table
        plan: dict[BoundRoute, tuple[list[int], list[Message]]] = {}
        refused: dict[int, list[tuple[int, Outcome]]] = {}
        # The routes a message takes, with its destination address on each, are
        # the same as the message before's when its address (and, with sender
        # filters, its sender) is: a read's messages usually share them.
        targets: list[tuple[BoundRoute, str]] = []
        last_address: str | None = None
        last_sender: str | None = None
        by_sender = table.filters_senders
        # Likewise for recipients (QMQP): the same recipients, the same routes.
        spread: list[tuple[BoundRoute, list[str]]] | Unrouted = []
        last_recipients: tuple[str, ...] = ()
        recipients_sender: str | None = None
        for index, message in enumerate(messages):
            recipients = message.recipients
            if recipients:
                if recipients != last_recipients or (
                    by_sender and message.sender != recipients_sender
                ):
                    last_recipients, recipients_sender = recipients, message.sender
                    spread = self._spread(table, source, message)
                if isinstance(spread, Unrouted):
                    answer(index, spread)
                    continue
                for bound, addresses in spread:
                    self._plan(plan, bound, index, message, addresses, refused)
                continue
            address = message.address
            if address != last_address or (by_sender and message.sender != last_sender):
                last_address, last_sender = address, message.sender
                targets = [
                    (bound, bound.route.destination_address(address, captures))
                    for bound, captures in table.match(source, address, last_sender)
                ]
            if not targets:
                answer(index, Unrouted((address,)))
                continue
            for bound, destination in targets:
                if bound.plain:  # the general `_plan`'s result, without its work
                    translated = (
                        message if destination == address else message.with_address(destination)
                    )
                    entry = plan.get(bound)
                    if entry is None:
                        plan[bound] = ([index], [translated])
                    else:
                        entry[0].append(index)
                        entry[1].append(translated)
                else:
                    self._plan(plan, bound, index, message, [destination], refused)
        tapped = None
        if self.taps:  # all that a batch pays when nobody taps
            taps = self.taps
            tapped = taps[0].observe_batch(
                taps, source, messages, plan, refused, table, self._clock
            )
        if plan:
            self.batches_in_flight += 1  # until its last message is answered (when_idle)
        if len(plan) == 1 and not refused:  # the common case: one route, each message once
            [(bound, (indices, batch))] = plan.items()
            self._deliver(bound, batch, source, tapped).addBoth(
                self._answer_all, indices, answer, answer_batch
            )
            return
        _Combined(plan, refused, table.rank, answer, self._batch_answered).start(
            self, source, tapped
        )

    def _spread(
        self, table: RouteTable, source: str, message: Message
    ) -> list[tuple[BoundRoute, list[str]]] | Unrouted:
        """The routes of a message routed by its recipients (QMQP), each with its addresses there.

        All of them routed, or none: `Unrouted` naming those without a route.
        """
        per_route: dict[BoundRoute, list[str]] = {}
        unrouted: list[str] = []
        for address in message.recipients:
            matches = table.match(source, address, message.sender)
            if not matches:
                unrouted.append(address)
            for bound, captures in matches:
                per_route.setdefault(bound, []).append(
                    bound.route.destination_address(address, captures)
                )
        if unrouted:
            return Unrouted(tuple(unrouted))
        return list(per_route.items())

    # --- a clean stop ---------------------------------------------------------------

    def stop_taking(self, unanswered: Collection[str] = ()) -> None:
        """Route nothing more: the gateway is stopping.

        A batch routed from now on is delivered nowhere. Its messages are
        answered retry later at once, so that a listener that still reads
        (ZeroMQ, a last TLS record) tells its peer the truth; those from the
        sources in ``unanswered`` (the upstreams) get no answer at all: their
        server keeps them (a stream chunk is settled, and its offset stored,
        whatever its outcome), and their in-flight limits stop their reading.

        Args:
            unanswered: Sources whose batches are left unanswered.
        """
        self._refusal = Outcome.retry("the gateway is stopping")
        self._unanswered_sources = frozenset(unanswered)

    def when_idle(self) -> Deferred[None]:
        """Fire once no routed batch waits for an answer; at once when none does.

        The answers have been handed to their sources when it fires. Cancel
        it to stop waiting.
        """
        if not self.batches_in_flight:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle_waiters.append(waiter)
        return waiter

    def _refuse(self, source: str, count: int, answer: Callable[[int, Result], None]) -> None:
        refusal = self._refusal
        if refusal is None or source in self._unanswered_sources:
            return  # left unanswered
        for index in range(count):
            answer(index, refusal)

    def _answer_all(
        self,
        outcomes: list[Outcome] | Failure,
        indices: list[int],
        answer: Callable[[int, Result], None],
        answer_batch: Callable[[list[int], list[Outcome]], None] | None = None,
    ) -> list[Outcome] | Failure | None:
        """Answer a one-route batch's messages, then count the batch answered."""
        try:
            if isinstance(outcomes, Failure):
                return outcomes  # a delivery's bug: logged as unhandled, as before
            if len(outcomes) != len(indices):
                raise ValueError(f"{len(outcomes)} outcomes for {len(indices)} messages")
            if answer_batch is not None:
                answer_batch(indices, outcomes)
                return None
            for index, outcome in zip(indices, outcomes, strict=True):
                answer(index, outcome)
            return None
        finally:
            self._batch_answered()

    def _batch_answered(self) -> None:
        self.batches_in_flight -= 1
        if not self.batches_in_flight and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.called:  # not cancelled
                    waiter.callback(None)

    # --- planning and delivery -------------------------------------------------------

    def _plan(
        self,
        plan: dict[BoundRoute, tuple[list[int], list[Message]]],
        bound: BoundRoute,
        index: int,
        message: Message,
        addresses: list[str],
        refused: dict[int, list[tuple[int, Outcome]]],
    ) -> None:
        """Put a message (translated) in its route's batch, or note the route's refusal."""
        try:
            translated = _translate(bound.route, message, addresses)
        except TransformError as exc:
            outcome = Outcome.rejected(f"route {bound.route.name}: {exc}")
            refused.setdefault(index, []).append((self.table.rank.get(bound, 0), outcome))
            return
        entry = plan.get(bound)
        if entry is None:
            plan[bound] = ([index], [translated])
        else:
            entry[0].append(index)
            entry[1].append(translated)

    def _deliver(
        self,
        bound: BoundRoute,
        batch: list[Message],
        source: str,
        tapped: TappedBatch | None = None,
    ) -> Deferred[list[Outcome]]:
        route = bound.route
        started = self._clock.seconds()
        stats = self._stats(route.name)
        count = len(batch)
        if stats is not None:
            stats.messages += count
            stats.bytes += sum(map(len, map(_BODY, batch)))
            stats.in_flight += count
        d = bound.delivery.deliver(batch)
        recorder = self.recorder

        def finished(outcomes: list[Outcome]) -> list[Outcome]:
            if _UNANSWERED_ID in map(id, outcomes):  # identity, at C speed
                late = self._deadlines(bound).timed_out_outcome()
                outcomes = [late if outcome is UNANSWERED else outcome for outcome in outcomes]
            if stats is not None:
                stats.in_flight -= count
                tally = stats.outcomes
                # Most are the shared accepted outcome: counted at C speed.
                accepted = outcomes.count(_ACCEPTED)
                if accepted:
                    tally[_ACCEPTED_LABEL] += accepted
                if accepted != len(outcomes):
                    for outcome in outcomes:
                        if outcome != _ACCEPTED:
                            tally[outcome.status.value] += 1
                stats.observe_latency(self._clock.seconds() - started, count)
            if recorder is not None and not route.durable:
                # One call per batch. A durable route's delivery records its
                # own batches: a range of its stream once committed.
                recorder.record_batch(KIND_ROUTE, route.name, source, batch, started, outcomes)
            if tapped is not None:
                tapped.answered(bound, outcomes)
            return outcomes

        if d.called:
            return d.addCallback(finished)
        return self._deadlines(bound).watch(d, count).addCallback(finished)

    def _deadlines(self, bound: BoundRoute) -> RouteDeadlines:
        watch = self._watches.get(bound)
        if watch is None:
            if len(self._watches) > 4 * len(self.table.routes) + 16:
                # Routes of tables replaced long ago: drop the idle ones.
                self._watches = {b: w for b, w in self._watches.items() if w.busy}
            watch = self._watches[bound] = RouteDeadlines(bound.route, self._clock)
        return watch

    def _stats(self, route: str) -> RouteStats | None:
        return None if self._metrics is None else self._metrics.route(route)


class _Combined:
    """One batch's messages spread over several routes: each answered when all its routes are.

    A message's outcomes combine (`worst`) in table order, whichever route
    answers first, so that its reason reads as it does when routed alone.

    Args:
        plan: Each route's indices and translated messages.
        refused: Messages a route refused to translate, with that refusal.
        rank: Each route's place in the table.
        answer: Told each message's combined outcome.
        done: Called once every route's batch is answered (not at all without routes).
    """

    __slots__ = ("_answer", "_done", "_known", "_pending", "_plan", "_rank", "_routes_left")

    def __init__(
        self,
        plan: dict[BoundRoute, tuple[list[int], list[Message]]],
        refused: dict[int, list[tuple[int, Outcome]]],
        rank: dict[BoundRoute, int],
        answer: Callable[[int, Result], None],
        done: Callable[[], None],
    ) -> None:
        self._plan = plan
        self._rank = rank
        self._answer = answer
        self._done = done
        self._pending = len(plan)
        self._known = refused
        self._routes_left: dict[int, int] = {}
        left = self._routes_left
        for indices, _batch in plan.values():
            for index in indices:
                left[index] = left.get(index, 0) + 1

    def start(self, router: Router, source: str, tapped: TappedBatch | None) -> None:
        """Answer the messages no route took, deliver each route's batch."""
        for index in [i for i in self._known if i not in self._routes_left]:
            self._answer(index, _combine(self._known.pop(index)))
        for bound, (indices, batch) in self._plan.items():
            router._deliver(bound, batch, source, tapped).addBoth(
                self._route_answered, indices, self._rank.get(bound, 0)
            )

    def _route_answered(
        self, outcomes: list[Outcome] | Failure, indices: list[int], rank: int
    ) -> Failure | None:
        try:
            if isinstance(outcomes, Failure):
                return outcomes  # a delivery's bug: logged as unhandled, as before
            known = self._known
            left = self._routes_left
            for index, outcome in zip(indices, outcomes, strict=True):
                known.setdefault(index, []).append((rank, outcome))
                remaining = left[index] - 1
                if remaining:
                    left[index] = remaining
                else:
                    del left[index]
                    self._answer(index, _combine(known.pop(index)))
            return None
        finally:
            self._pending -= 1
            if not self._pending:
                self._done()


def _combine(ranked: list[tuple[int, Outcome]]) -> Outcome:
    ranked.sort(key=lambda pair: pair[0])
    return worst(outcome for _rank, outcome in ranked)


def _translate(route: Route, message: Message, addresses: list[str]) -> Message:
    """The message as the route's destination sees it.

    Its address is the first destination address and its recipients all of
    them (once each), unless the message had no recipients and goes to one
    address only, in which case it keeps having none. The route's body
    transform is applied last.

    Raises:
        TransformError: The body cannot be transformed.
    """
    if route.recipients:
        destinations: tuple[str, ...] = route.recipients
    elif len(addresses) == 1:
        destinations = (addresses[0],)
    else:
        destinations = tuple(dict.fromkeys(addresses))
    sender = route.envelope_sender if route.envelope_sender is not None else message.sender
    recipients = destinations if (message.recipients or len(destinations) > 1) else ()
    body = message.body
    if route.body != "unchanged":
        envelope = message
        if route.body in ENVELOPE_TRANSFORMS:  # they write the new envelope into the body
            envelope = Message(
                body=body, address=destinations[0], id=message.id, sender=sender,
                recipients=recipients, timestamp=message.timestamp,
            )  # fmt: skip
        body = transform(route.body, envelope, message.address)
    if (
        destinations[0] == message.address
        and recipients == message.recipients
        and sender == message.sender
        and body is message.body
    ):
        return message
    return message.translated(body, destinations[0], sender, recipients)
