"""Quiet topics: the SSMP hub's MCASTs cross nodes only while another node may want them.

Part of the hub's cross-node seam (`gateway.fleet.hub`), for one hub
listener's exchange, ``msggateway.hub.<listener>``, which every node
declares ``others_only`` (`gateway.fleet.backbone`): what a node publishes
there reaches every *other* node bound for its key, and a mandatory
message comes back (`Published.UNROUTABLE`) when no other node is bound.
A node is bound with ``t.<topic>`` while the topic has a local subscriber.

A node publishes each run of MCASTs to ``t.<topic>``, mandatory. When one
comes back, no other node had subscribers: the node binds ``s.<topic>``,
and once that took effect publishes a ``probe`` to ``t.<topic>``,
mandatory; if that comes back too, the node holds the topic *quiet*: its
MCASTs are delivered to the local subscribers only, not published. Until
then they are published as before (not mandatory while probing).

A node whose topic gets its first local subscriber binds ``t.<topic>``, and
once that took effect publishes ``interest`` to ``s.<topic>``, mandatory.
A node that gets it stops holding the topic quiet, unbinds ``s.<topic>``,
and once that took effect answers ``interest-ok`` (to ``n.<node>``), on
which the newcomer publishes ``interest`` again. The newcomer answers the
topic's SUBSCRIBEs ``200`` once an ``interest`` comes back: no node holds
the topic quiet any more.

Why that answer holds (the ordering argument). A node A holds topic T quiet
only after its probe came back: the probe was routed at a time p when no
other node was bound for ``t.T``, after A's ``s.T`` binding took effect at
s (s < p). A newcomer B's ``t.T`` binding takes effect at b; had b < p, the
probe would have reached B; so s < p < b. B publishes ``interest`` after b,
so each one reaches A through ``s.T`` until A unbinds ``s.T``, which A does
only after it handled an ``interest`` and stopped holding T quiet. B
answers ``200`` once an ``interest`` came back: A's unbinding had taken
effect, so A had stopped holding T quiet before. Every MCAST A handles
after that (any MCAST a client sent after it saw B's ``200``) is published
to ``t.T``, for which B is bound. The same holds for every node that held
T quiet, however many, known to B or not.

A node that loses its connection forgets its quiet topics (nothing is
published then anyway), and one that (re)connects announces every topic it
has: its filter was deleted and declared anew, and while it had none,
other nodes may have found nobody bound for its topics. A round not done
within `INTEREST_SECONDS` (a node holding the topic quiet was stalled: its
deliveries held by a congested subscriber) is answered all the same, which
is logged and counted (`QuietTopics.slow`): that node's MCASTs miss the new
subscriber until it handles the ``interest``. A node holds at most
`MAX_QUIET_TOPICS` topics quiet, each forgotten (with its binding) when it
was not published to between two sweeps `QUIET_SWEEP_SECONDS` apart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Final

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway.core.interfaces import IBackbone
from gateway.fleet.backbone import Delivery, Published

__all__ = [
    "INTEREST",
    "INTEREST_OK",
    "INTEREST_SECONDS",
    "MAX_QUIET_TOPICS",
    "PROBE",
    "QUIET_SWEEP_SECONDS",
    "QuietTopics",
]

INTEREST_SECONDS: Final = 5.0
"""How long a SUBSCRIBE to a topic new to the node waits for the nodes holding it quiet
(a broker round trip each; only a node stalled by congestion takes longer)."""
MAX_QUIET_TOPICS: Final = 4096
"""Topics a node holds quiet at most: each is a binding (``s.<topic>``). Past it, MCASTs to
topics nobody else subscribes to are published, and dropped by RabbitMQ."""
QUIET_SWEEP_SECONDS: Final = 60.0
"""A quiet topic not published to between two sweeps this far apart is forgotten (its
binding goes): a node that published to many topics once keeps few bindings."""
_INTEREST_RETRY_SECONDS: Final = 0.05
"""After RabbitMQ refused (nacked) an ``interest``, it is published again this much later."""

PROBE: Final = "probe"
INTEREST: Final = "interest"
INTEREST_OK: Final = "interest-ok"


class _Quiet:
    """A topic no other node seemed to subscribe to: probing, then held quiet (in ``held``)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = True
        """Published to (or entered) since the last sweep, while probing."""


class _Round:
    """A topic new to this node: ``interest`` published until no node holds it quiet."""

    __slots__ = ("again", "deadline", "in_flight", "waiters")

    def __init__(self, deadline: IDelayedCall) -> None:
        self.waiters: list[Callable[[], None]] = []
        """SUBSCRIBEs of the topic waiting for their 200."""
        self.in_flight = False
        self.again = False
        """An ``interest-ok`` came while one was in flight: publish again after its result."""
        self.deadline = deadline


class QuietTopics:
    """One hub listener's quiet topics, and the rounds of its topics new to this node.

    Args:
        backbone: The node's backbone.
        exchange: The listener's exchange (declared ``others_only``).
        clock: For the rounds' deadline and the sweeps.
        listener: The listener's name (for the log).
    """

    _log = Logger()

    def __init__(
        self, backbone: IBackbone, exchange: str, clock: IReactorTime, listener: str
    ) -> None:
        self.backbone = backbone
        self.exchange = exchange
        self._clock = clock
        self._listener = listener
        self._reply = f"n.{backbone.node}"
        self._quiet: dict[bytes, _Quiet] = {}
        """The topics held quiet or probing."""
        self.held: dict[bytes, int] = {}
        """The topics held quiet, each with the MCAST events it kept since the last sweep.

        The hub's seam counts a held topic's events here itself and drops
        them, before it copies or queues anything: one dictionary lookup
        per event, no call. Asked when the hub handles them, which is early
        enough (the ordering argument above: a node handles every MCAST
        sent after a newcomer's ``200`` after it let go).
        """
        self._sweep_call: IDelayedCall | None = None
        self._rounds: dict[bytes, _Round] = {}
        self._unpublished = 0
        self.waits = 0
        """``interest`` rounds that found a node holding the topic quiet."""
        self.slow = 0
        """``interest`` rounds answered after `INTEREST_SECONDS` without being done."""

    # --- publishing MCAST runs -----------------------------------------------------------------

    @property
    def unpublished(self) -> int:
        """MCAST events not published: their topic was held quiet."""
        return self._unpublished + sum(self.held.values())

    def publish_mcast(self, topic: bytes, body: bytes, count: int) -> None:
        """Publish a run of ``count`` MCAST events to ``topic``, unless it is held quiet."""
        held = self.held
        if topic in held:
            held[topic] += count
            return
        quiet = self._quiet.get(topic)
        if quiet is not None:
            quiet.used = True
        # Mandatory unless probing: coming back unroutable starts a probe.
        self.backbone.publish(
            self.exchange,
            "t." + topic.decode("ascii"),
            body,
            kind="mcast",
            headers={"n": count},
            mandatory=quiet is None,
            on_result=functools.partial(self._mcast_published, topic) if quiet is None else None,
        )

    def _mcast_published(self, topic: bytes, result: Published) -> None:
        """A run's confirm: back unroutable, no other node had subscribers; probe."""
        if (
            result is not Published.UNROUTABLE
            or topic in self._quiet
            or len(self._quiet) >= MAX_QUIET_TOPICS
            or not self.backbone.ready
        ):
            return
        quiet = self._quiet[topic] = _Quiet()
        self.backbone.bind(self.exchange, "s." + topic.decode("ascii"))
        self.backbone.when_bound(functools.partial(self._probe, topic, quiet))
        if self._sweep_call is None:
            self._sweep_call = self._clock.callLater(QUIET_SWEEP_SECONDS, self._sweep)

    def _probe(self, topic: bytes, quiet: _Quiet) -> None:
        """``s.<topic>`` is bound: is any other node bound for ``t.<topic>`` now?"""
        if self._quiet.get(topic) is not quiet:
            return
        self.backbone.publish(
            self.exchange,
            "t." + topic.decode("ascii"),
            b"",
            kind=PROBE,
            mandatory=True,
            on_result=functools.partial(self._probed, topic, quiet),
        )

    def _probed(self, topic: bytes, quiet: _Quiet, result: Published) -> None:
        if self._quiet.get(topic) is not quiet:
            return  # an interest came meanwhile, or the connection went
        if result is Published.UNROUTABLE:
            self.held[topic] = 0
        else:
            self._forget(topic)

    def _forget(self, topic: bytes) -> None:
        del self._quiet[topic]
        self._unpublished += self.held.pop(topic, 0)
        self.backbone.unbind(self.exchange, "s." + topic.decode("ascii"))

    def _sweep(self) -> None:
        """Forget the quiet topics not published to since the last sweep."""
        self._sweep_call = None
        held = self.held
        for topic, quiet in list(self._quiet.items()):
            count = held.get(topic, 0)
            if quiet.used or count:
                quiet.used = False
                if count:
                    self._unpublished += count
                    held[topic] = 0
            else:
                self._forget(topic)
        if self._quiet:
            self._sweep_call = self._clock.callLater(QUIET_SWEEP_SECONDS, self._sweep)

    def got_interest(self, delivery: Delivery) -> None:
        """Another node has a new subscriber of the topic: stop holding it quiet, then say so."""
        name = delivery.routing_key[2:]
        topic = name.encode("ascii")
        if topic in self._quiet:
            self._forget(topic)
        reply = str(delivery.headers.get("reply", ""))
        # Once s.<topic> is unbound: the newcomer's next interest then tells whether any
        # node still holds the topic quiet.
        self.backbone.when_bound(functools.partial(self._interest_ok, reply, name))

    def _interest_ok(self, reply: str, topic: str) -> None:
        self.backbone.publish(self.exchange, reply, b"", kind=INTEREST_OK, headers={"topic": topic})

    # --- topics new to this node ------------------------------------------------------------

    def topic_added(self, topic: bytes) -> None:
        """``topic`` got its first local subscriber (its binding asked for): announce it."""
        if self.backbone.ready:
            self._start_round(topic)

    def when_subscribed(self, topic: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once no node holds ``topic`` quiet and this node is bound for it.

        At once without a connection to RabbitMQ: nothing crosses then anyway.
        """
        round_ = self._rounds.get(topic)
        if round_ is not None:
            round_.waiters.append(callback)
        elif self.backbone.ready:
            self.backbone.when_bound(callback)
        else:
            callback()

    def got_interest_ok(self, delivery: Delivery) -> None:
        """A node let go of a topic this node announced: ask again whether any still holds it."""
        topic = str(delivery.headers.get("topic", "")).encode("ascii")
        round_ = self._rounds.get(topic)
        if round_ is not None:
            self._announce(topic, round_)

    def _start_round(self, topic: bytes) -> None:
        """Once ``t.<topic>`` is bound, tell the nodes holding ``topic`` quiet about it."""
        round_ = self._rounds.get(topic)
        if round_ is None:
            deadline = self._clock.callLater(INTEREST_SECONDS, self._too_slow, topic)
            round_ = self._rounds[topic] = _Round(deadline)
        self.backbone.when_bound(functools.partial(self._announce, topic, round_))

    def _announce(self, topic: bytes, round_: _Round) -> None:
        if self._rounds.get(topic) is not round_:
            return
        if round_.in_flight:
            round_.again = True
            return
        round_.in_flight = True
        round_.again = False
        self.backbone.publish(
            self.exchange,
            "s." + topic.decode("ascii"),
            b"",
            kind=INTEREST,
            headers={"reply": self._reply},
            mandatory=True,
            on_result=functools.partial(self._announced, topic, round_),
        )

    def _announced(self, topic: bytes, round_: _Round, result: Published) -> None:
        round_.in_flight = False
        if self._rounds.get(topic) is not round_:
            return
        if result is Published.UNROUTABLE:  # no node holds the topic quiet
            del self._rounds[topic]
            _done(round_)
        elif result is Published.LOST:
            return  # the connection went: `lost` answers the round
        elif result is Published.NACKED:
            self._clock.callLater(_INTEREST_RETRY_SECONDS, self._announce, topic, round_)
        else:  # routed: the nodes holding it answer interest-ok once they let go
            self.waits += 1
            if round_.again:  # one let go meanwhile: again
                self._announce(topic, round_)

    def _too_slow(self, topic: bytes) -> None:
        round_ = self._rounds.pop(topic, None)
        if round_ is None:
            return
        self.slow += 1
        self._log.warn(
            "fleet: {listener}: a node held topic {topic} quiet for more than {seconds:g} s"
            " after this node's new subscriber asked for it; the SUBSCRIBE is answered, and"
            " that node's MCASTs may miss the subscriber until it catches up",
            listener=self._listener,
            topic=topic.decode("ascii"),
            seconds=INTEREST_SECONDS,
        )
        _done(round_)

    # --- the connection ----------------------------------------------------------------------

    def connected(self, topics: Iterable[bytes]) -> None:
        """After every (re)connection: announce every topic with local subscribers.

        Nodes may have held them quiet while this one had no queue.
        """
        for topic in topics:
            self._start_round(topic)

    def lost(self) -> None:
        """No connection: forget the quiet topics; SUBSCRIBEs waiting are answered now."""
        for topic in self._quiet:
            self.backbone.unbind(self.exchange, "s." + topic.decode("ascii"))
        self._quiet.clear()
        self._unpublished += sum(self.held.values())
        self.held.clear()
        rounds, self._rounds = self._rounds, {}
        for round_ in rounds.values():
            _done(round_)


def _done(round_: _Round) -> None:
    if round_.deadline.active():
        round_.deadline.cancel()
    waiters, round_.waiters = round_.waiters, []
    for waiter in waiters:
        waiter()
