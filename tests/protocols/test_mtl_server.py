"""Tests for `gateway.protocols.mtl.server` without sockets: timers on a `Clock`.

The listener's two ZeroMQ sockets are replaced by recorders of the
multipart messages it sends (ZeroMQ itself is exercised end to end in
tests/integration/test_mtl.py, the read bursts in test_mtl_zmq.py);
requests are handed to its receive functions as ZeroMQ would, identity
frame first, and the end of a read burst as the socket would say it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from zope.interface import implementer
from zope.interface.verify import verifyObject

from gateway.codecs import mtl
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.flow import Congestion
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings


@attrs.define
class Sent:
    """Records what the listener sends on one socket, and which sends went out together.

    It refuses as a ROUTER_MANDATORY socket does: a peer whose queue is
    full (``refuse``, or no ``room`` left), a peer it has no connection with
    (``gone``).
    """

    messages: list[list[bytes]] = attrs.Factory(list)
    batches: list[list[list[bytes]]] = attrs.Factory(list)
    refuse: set[bytes] = attrs.Factory(set)
    """Identities whose queue is full (ZeroMQ: EAGAIN)."""
    gone: set[bytes] = attrs.Factory(set)
    """Identities ZeroMQ has no connection with (EHOSTUNREACH)."""
    room: dict[bytes, int] = attrs.Factory(dict)
    """Messages an identity's queue takes before it is full (absent: no limit)."""
    paused: bool = False
    """Whether the listener paused reading this socket."""
    read_soon: int = 0
    """How many times reading resumed (each looks for what waited meanwhile)."""

    def _refusal(self, frames: list[bytes]) -> str | None:
        identity = frames[0]
        if identity in self.gone:
            return "gone"
        if identity in self.refuse:
            return "full"
        room = self.room.get(identity)
        if room is not None:
            if room <= 0:
                return "full"
            self.room[identity] = room - 1
        return None

    def send(self, frames: list[bytes]) -> bool:
        """Record; ZeroMQ took it unless it is refused."""
        if self._refusal(frames) is not None:
            return False
        self.messages.append(frames)
        return True

    def send_many(self, messages: list[list[bytes]]) -> list[int]:
        """Record each, and the group; the positions refused."""
        self.batches.append(messages)
        return [position for position, frames in enumerate(messages) if not self.send(frames)]

    def send_routed(self, messages: list[list[bytes]]) -> tuple[list[int], list[int]]:
        """Record each, and the group; the positions refused, full and gone.

        A peer refused once is not tried again in the same call, as the socket does.
        """
        self.batches.append(messages)
        full: list[int] = []
        gone: list[int] = []
        refused: dict[bytes, list[int]] = {}
        for position, frames in enumerate(messages):
            same = refused.get(frames[0])
            if same is not None:
                same.append(position)
                continue
            why = self._refusal(frames)
            if why is None:
                self.messages.append(frames)
            else:
                refused[frames[0]] = full if why == "full" else gone
                refused[frames[0]].append(position)
        return full, gone

    def send_in_order(self, messages: Iterable[list[bytes]]) -> tuple[int, bool]:
        """Record until one is refused; how many were taken, and whether its peer is gone."""
        taken = 0
        for frames in messages:
            why = self._refusal(frames)
            if why is not None:
                return taken, why == "gone"
            self.messages.append(frames)
            taken += 1
        return taken, False

    def pause_reading(self) -> None:
        """The listener stops reading."""
        self.paused = True

    def resume_reading(self) -> None:
        """The listener reads again."""
        self.paused = False
        self.read_soon += 1

    def commands(self, identity: bytes) -> list[mtl.DataCommand]:
        """Every data command sent to one peer, in order."""
        return [mtl.decode_data(frames[1:]) for frames in self.messages if frames[0] == identity]


def server(
    name: str = "mtl", router: Router | None = None, clock: Clock | None = None
) -> tuple[MTLServer, Clock, Sent, Sent]:
    """A listener with recorded sockets, pings every 5 s, dead after 12 s."""
    if clock is None:
        clock = Clock()
    if router is None:
        router = Router(bind_routes([], {}), clock)
    listener = MTLServer(
        name=name,
        settings=MTLListenerSettings(ping_interval_seconds=5.0, dead_after_seconds=12.0),
        host="127.0.0.1",
        port=0,
        router=router,
        secrets=Secrets(),
        clock=clock,
        reactor=clock,
    )
    control, data = Sent(), Sent()
    listener._control, listener._data = control, data
    listener._timer = clock.callLater(5.0, listener._tick)
    route = Route(name="in", source="app", pattern=AddressPattern("#"), destination=name)
    router.replace_table(bind_routes([route], {name: listener}))
    return listener, clock, control, data


@attrs.define
class Bridge:
    """Two listeners on one router and clock: writers' content on ``in`` reaches ``out`` readers.

    The route ``across`` takes what ``mtl`` writers write on ``in`` to the
    readers of ``out`` on ``mtl2``, with a 10 s deadline.
    """

    router: Router
    clock: Clock
    writers: MTLServer
    writers_sent: Sent
    readers: MTLServer
    readers_sent: Sent
    readers_control: Sent
    """The readers' REQ side: where another reader's lease is answered (`lease`)."""


def bridge(metrics: GatewayMetrics | None = None, reader_confirms: str = "full") -> Bridge:
    """Two recorded listeners and the route between them; the reader confirms or not."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock, metrics)
    writers, _, writers_control, writers_sent = server("mtl", router, clock)
    readers, _, readers_control, readers_sent = server("mtl2", router, clock)
    route = Route(
        name="across",
        source="mtl",
        pattern=AddressPattern("in"),
        destination="mtl2",
        target=AddressTemplate("out"),
        timeout_seconds=10.0,
    )
    router.replace_table(bind_routes([route], {"mtl": writers, "mtl2": readers}))
    writer_lease = lease(writers, writers_control, "Writer", "full", ["in", "nowhere"])
    data(writers, b"w", mtl.Lease(1, writer_lease))
    reader_lease = lease(readers, readers_control, "Reader", reader_confirms, ["out"])
    data(readers, b"r", mtl.Lease(1, reader_lease))
    data(readers, b"r", mtl.Summon(2, "out"))
    return Bridge(router, clock, writers, writers_sent, readers, readers_sent, readers_control)


def lease(
    listener: MTLServer,
    control: Sent,
    kind: str,
    confirm: str,
    resources: list[str] | None = None,
    profile: str = "gateway",
) -> str:
    """Walk a REQ peer through Open, Profile and Reader/Writer; the lease."""
    for command, body in (
        ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
        ("Connection.Profile", {"profile": profile}),
        (f"Connection.{kind}", {"resources": resources or ["news"], "confirm": confirm}),
    ):
        listener._on_control([b"peer", b"", *mtl.request(command, body)])
    status, body_bytes = control.messages[-1][2:]
    assert status == b"202"
    return str(json.loads(body_bytes)["lease"])


def data(listener: MTLServer, identity: bytes, command: mtl.DataCommand) -> None:
    """One data command from a DEALER peer, alone in its read burst."""
    burst(listener, [(identity, command)])


def burst(listener: MTLServer, commands: list[tuple[bytes, mtl.DataCommand]]) -> None:
    """Data commands read in one wake-up of the data socket, the burst's end, the next turn."""
    for identity, command in commands:
        listener._on_data([identity, *mtl.encode_data(command)])
    listener._drained()  # what the socket calls once the read is drained
    clock = listener.clock
    assert isinstance(clock, Clock)
    clock.advance(0)  # the reactor's next turn: what other listeners' outcomes queued goes out


def content_batches(sent: Sent) -> list[int]:
    """How many Contents each send of several messages held (those with any)."""
    sizes = [
        sum(isinstance(mtl.decode_data(frames[1:]), mtl.Content) for frames in batch)
        for batch in sent.batches
    ]
    return [size for size in sizes if size]


def contents(sent: Sent, identity: bytes) -> list[mtl.Content]:
    """The Contents sent to one peer."""
    return [c for c in sent.commands(identity) if isinstance(c, mtl.Content)]


def answers(sent: Sent, identity: bytes) -> dict[int, mtl.DataCommand]:
    """What a writer numbering its Contents from 1 learns of each, by sequence.

    The Confirms and Rejects sent to it, in order, each as if it answered
    one Content: a Confirm with ``multiple`` answers every Content up to
    its sequence not answered before it (spec, "Content Confirmation").
    """
    learned: dict[int, mtl.DataCommand] = {}
    for command in sent.commands(identity):
        if isinstance(command, mtl.Confirm) and command.multiple:
            for sequence in range(1, command.sequence + 1):
                learned.setdefault(sequence, mtl.Confirm(sequence, False))
        elif isinstance(command, mtl.Confirm | mtl.Reject):
            learned.setdefault(command.sequence, command)
    return learned


def test_is_a_destination() -> None:
    """The listener provides IDestination."""
    listener, _clock, _control, _sent = server()
    assert verifyObject(IDestination, listener)


def test_pings_and_a_dead_reader_gives_back_its_unconfirmed() -> None:
    """Idle peers are pinged; a silent one is forgotten and what it held is retried."""
    listener, clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", mtl.Summon(2, "news"))
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"x")]).addCallback(results.append)
    clock.advance(5)
    assert mtl.decode_data(sent.messages[-1][1:]) == mtl.Ping()
    data(listener, b"r", mtl.Pong())  # heard at 5 s
    clock.advance(5)
    clock.advance(5)
    assert results == []
    clock.advance(5)  # 15 s of silence: dead
    [[outcome]] = results
    assert outcome.status is Status.RETRY and "went away" in outcome.reason
    listener.deliver([Message(address="news", body=b"y")]).addCallback(results.append)
    [retry] = results[1]
    assert retry.status is Status.RETRY and "no MTL reader" in retry.reason


def test_multiple_and_recycle() -> None:
    """In one batch of three: Confirm multiple settles the first two, Reject recycle the third."""
    listener, _clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", mtl.Summon(2, "news"))
    results: list[list[Outcome]] = []
    batch = [Message(address="news", body=body) for body in (b"a", b"b", b"c")]
    listener.deliver(batch).addCallback(results.append)
    assert [c.sequence for c in contents(sent, b"r")] == [1, 2, 3]
    data(listener, b"r", mtl.Confirm(2, True))
    assert results == []  # the batch answers once every message has its outcome
    data(listener, b"r", mtl.Reject(3, False, True))
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED, Status.ACCEPTED, Status.RETRY]
    data(listener, b"r", mtl.Confirm(99, True))  # invalid: ignored silently
    assert len(results) == 1


def test_a_batch_goes_out_together() -> None:
    """All of a batch's Contents, to every reader of each address, are sent in one go."""
    listener, _clock, control, sent = server()
    for reader in (b"r1", b"r2"):
        data(listener, reader, mtl.Lease(1, lease(listener, control, "Reader", "full")))
        data(listener, reader, mtl.Summon(2, "news"))
    batch = [Message(address="news", body=body) for body in (b"a", b"b")]
    listener.deliver(batch)
    assert content_batches(sent) == [4]
    assert [c.body for c in contents(sent, b"r1")] == [b"a", b"b"]
    assert [c.body for c in contents(sent, b"r2")] == [b"a", b"b"]


def test_several_readers_answer_the_worst() -> None:
    """A message read by two readers is accepted only when both confirm; one recycle: retry."""
    listener, _clock, control, _sent = server()
    for reader in (b"r1", b"r2"):
        data(listener, reader, mtl.Lease(1, lease(listener, control, "Reader", "full")))
        data(listener, reader, mtl.Summon(2, "news"))
    results: list[list[Outcome]] = []
    batch = [Message(address="news", body=body) for body in (b"a", b"b")]
    listener.deliver(batch).addCallback(results.append)
    burst(listener, [(b"r1", mtl.Confirm(2, True)), (b"r2", mtl.Confirm(1, False))])
    assert results == []
    data(listener, b"r2", mtl.Reject(2, False, True))
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED, Status.RETRY]


def test_readers_without_confirmations_and_readers_gone() -> None:
    """Written to a confirm=none reader is accepted; one ZeroMQ cannot route to is retry; none too.

    The reader ZeroMQ has no connection with any more is forgotten at once
    (counted as ``gone-peer``) and what it left unconfirmed is retried.
    """
    listener, _clock, control, sent = server()
    metrics = listener._metrics = GatewayMetrics()
    data(listener, b"quiet", mtl.Lease(1, lease(listener, control, "Reader", "none")))
    data(listener, b"quiet", mtl.Summon(2, "news"))
    data(listener, b"gone", mtl.Lease(1, lease(listener, control, "Reader", "full", ["gone"])))
    data(listener, b"gone", mtl.Summon(2, "gone"))
    earlier: list[list[Outcome]] = []
    listener.deliver([Message(address="gone", body=b"before")]).addCallback(earlier.append)
    sent.gone.add(b"gone")
    results: list[list[Outcome]] = []
    batch = [
        Message(address="news", body=b"a"),
        Message(address="gone", body=b"b"),
        Message(address="nobody", body=b"c"),
    ]
    with capturedLogs() as events:
        listener.deliver(batch).addCallback(results.append)
    [[accepted, refused, unread]] = results
    assert accepted.status is Status.ACCEPTED
    assert refused.status is Status.RETRY and "went away" in refused.reason
    assert unread.status is Status.RETRY and "no MTL reader" in unread.reason
    assert listener._peers[b"gone"].departed and not listener._peers[b"gone"].summoned
    [[before]] = earlier
    assert before.status is Status.RETRY and "went away" in before.reason
    assert [e["log_format"] for e in events if "gone" in e["log_format"]] == [
        "MTL listener {listener}: a data peer is gone (ZeroMQ has no connection with it any"
        " more): nothing more is sent to it"
    ]
    gone = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": "gone-peer"}
    )
    assert gone == 1


def test_a_gone_reader_does_not_count_against_the_live_one() -> None:
    """Two readers, one gone without Dismiss: the other's Confirms answer, never a recycle.

    ZeroMQ refuses to route to the gone one (ROUTER_MANDATORY:
    EHOSTUNREACH); it is forgotten at once, its copy withdrawn, and the
    next batch goes to the live reader alone.
    """
    world = bridge()
    readers, control = world.readers, world.readers._control
    data(readers, b"dead", mtl.Lease(1, lease(readers, control, "Reader", "none", ["out"])))
    data(readers, b"dead", mtl.Summon(2, "out"))
    world.readers_sent.gone.add(b"dead")
    tried = len(world.readers_sent.batches)
    for first in (1, 4):
        burst(
            world.writers,
            [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (first, first + 1, first + 2)],
        )
        delivered = contents(world.readers_sent, b"r")[-3:]
        burst(readers, [(b"r", mtl.Confirm(c.sequence, False)) for c in delivered])
    assert answers(world.writers_sent, b"w") == {n: mtl.Confirm(n, False) for n in range(1, 7)}
    assert readers._peers[b"dead"].departed and not readers._peers[b"dead"].summoned
    to_dead = [
        frames
        for batch in world.readers_sent.batches[tried:]
        for frames in batch
        if frames[0] == b"dead"
    ]
    assert len(to_dead) == 3  # the first batch's, refused; none after


def test_a_ping_finds_a_gone_peer() -> None:
    """The ping round forgets a peer ZeroMQ cannot route to, long before dead_after_seconds."""
    listener, clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", mtl.Summon(2, "news"))
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"x")]).addCallback(results.append)
    sent.gone.add(b"r")
    clock.advance(5)  # the ping round
    assert listener._peers[b"r"].departed and not listener._peers[b"r"].summoned
    [[outcome]] = results
    assert outcome.status is Status.RETRY and "went away" in outcome.reason


def test_a_message_mtl_cannot_carry_is_rejected_alone() -> None:
    """A header name too long for a field table rejects that message; its batch goes on."""
    listener, _clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "none")))
    data(listener, b"r", mtl.Summon(2, "news"))
    results: list[list[Outcome]] = []
    batch = [
        Message(address="news", body=b"a", headers={"n" * 256: "x"}),
        Message(address="news", body=b"b"),
    ]
    listener.deliver(batch).addCallback(results.append)
    [[refused, accepted]] = results
    assert refused.status is Status.REJECTED and "cannot carry" in refused.reason
    assert accepted.status is Status.ACCEPTED
    assert [c.body for c in contents(sent, b"r")] == [b"b"]


def test_a_read_burst_is_one_batch() -> None:
    """N Contents read in one wake-up reach the route as one batch, sent on in one go."""
    world = bridge()
    count = 5
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"%d" % n)) for n in range(1, count + 1)])
    assert content_batches(world.readers_sent) == [count]
    delivered = contents(world.readers_sent, b"r")
    assert [c.body for c in delivered] == [b"%d" % n for n in range(1, count + 1)]
    assert {c.resource for c in delivered} == {"out"}
    assert answers(world.writers_sent, b"w") == {}  # nothing confirmed yet
    burst(world.readers, [(b"r", mtl.Confirm(c.sequence, False)) for c in delivered])
    assert answers(world.writers_sent, b"w") == {
        n: mtl.Confirm(n, False) for n in range(1, count + 1)
    }


def test_bursts_of_one_are_batches_of_one() -> None:
    """Contents read in separate wake-ups go out as separate batches."""
    world = bridge()
    data(world.writers, b"w", mtl.Content(1, "in", {}, b"a"))
    data(world.writers, b"w", mtl.Content(2, "in", {}, b"b"))
    assert content_batches(world.readers_sent) == [1, 1]


def test_partial_refusals_in_one_batch() -> None:
    """Each Content of one batch gets its own answer: Confirm, Reject, Reject recycle, unrouted."""
    world = bridge()
    burst(
        world.writers,
        [
            (b"w", mtl.Content(1, "in", {}, b"a")),
            (b"w", mtl.Content(2, "in", {}, b"b")),
            (b"w", mtl.Content(3, "nowhere", {}, b"no route")),
            (b"w", mtl.Content(4, "in", {}, b"c")),
        ],
    )
    assert answers(world.writers_sent, b"w") == {3: mtl.Reject(3, False, False)}  # no route
    first, second, third = contents(world.readers_sent, b"r")
    burst(
        world.readers,
        [
            (b"r", mtl.Reject(second.sequence, False, False)),
            (b"r", mtl.Confirm(first.sequence, False)),
            (b"r", mtl.Reject(third.sequence, False, True)),
        ],
    )
    assert answers(world.writers_sent, b"w") == {
        1: mtl.Confirm(1, False),
        2: mtl.Reject(2, False, False),
        3: mtl.Reject(3, False, False),
        4: mtl.Reject(4, False, True),
    }


def test_the_route_deadline_cuts_a_batch() -> None:
    """At the deadline the confirmed are confirmed, the rest recycled; late answers vanish."""
    metrics = GatewayMetrics()
    world = bridge(metrics)
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2, 3)])
    delivered = contents(world.readers_sent, b"r")
    data(world.readers, b"r", mtl.Confirm(delivered[0].sequence, False))
    world.clock.advance(9)
    assert answers(world.writers_sent, b"w") == {}
    world.clock.advance(1)
    assert answers(world.writers_sent, b"w") == {
        1: mtl.Confirm(1, False),
        2: mtl.Reject(2, False, True),
        3: mtl.Reject(3, False, True),
    }
    reader = world.readers._peers[b"r"]
    assert reader.unconfirmed == {}  # the cut batch is forgotten
    data(world.readers, b"r", mtl.Confirm(delivered[2].sequence, False))  # too late: nothing
    assert len(answers(world.writers_sent, b"w")) == 3
    retried = metrics.registry.get_sample_value(
        "msggateway_route_outcomes_total", {"route": "across", "outcome": "retry"}
    )
    assert retried == 2


def test_a_reader_dying_mid_batch() -> None:
    """A reader forgotten mid-batch: what it confirmed stays confirmed, the rest is recycled."""
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2, 3)])
    first, second, _third = contents(world.readers_sent, b"r")
    burst(
        world.readers,
        [(b"r", mtl.Confirm(first.sequence, False)), (b"r", mtl.Reject(second.sequence, False))],
    )
    assert answers(world.writers_sent, b"w") == {}
    data(world.writers, b"w", mtl.Pong())  # the writer keeps talking; the reader does not
    world.clock.advance(5)
    data(world.writers, b"w", mtl.Pong())
    world.clock.advance(5)
    data(world.writers, b"w", mtl.Pong())
    world.clock.advance(5)  # the reader: 15 s of silence
    assert b"r" not in world.readers._peers
    assert answers(world.writers_sent, b"w") == {
        1: mtl.Confirm(1, False),
        2: mtl.Reject(2, False, False),
        3: mtl.Reject(3, False, True),
    }


def test_a_writer_gone_before_its_answers_hears_nothing() -> None:
    """Outcomes for a writer forgotten meanwhile are not sent to anyone."""
    world = bridge()
    data(world.writers, b"w", mtl.Content(1, "in", {}, b"x"))
    world.writers.peers.forget(world.writers._peers[b"w"], "test")
    [delivered] = contents(world.readers_sent, b"r")
    data(world.readers, b"r", mtl.Confirm(delivered.sequence, False))
    assert answers(world.writers_sent, b"w") == {}


def test_confirm_none_writers_hear_nothing_and_unrouted_is_counted() -> None:
    """A confirm=none writer's Contents are routed in a batch; no answer, unrouted ones counted."""
    metrics = GatewayMetrics()
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    writers, _, control, sent = server("mtl", router)
    writers._metrics = metrics
    route = Route(name="r", source="mtl", pattern=AddressPattern("in"), destination="mtl")
    router.replace_table(bind_routes([route], {"mtl": writers}))
    data(writers, b"w", mtl.Lease(1, lease(writers, control, "Writer", "none", ["in", "x"])))
    burst(writers, [(b"w", mtl.Content(2, "in", {}, b"a")), (b"w", mtl.Content(3, "x", {}, b"b"))])
    assert answers(sent, b"w") == {}
    unrouted = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": "unrouted"}
    )
    assert unrouted == 1


def test_a_bursts_answers_go_out_together() -> None:
    """What a burst's commands are answered (Pongs here) is sent in one go when it is drained."""
    listener, _clock, _control, sent = server()
    for _ in range(3):
        listener._on_data([b"p", *mtl.encode_data(mtl.Ping())])
        assert sent.messages == []  # not before the burst is over
    listener._drained()
    [together] = sent.batches
    assert [mtl.decode_data(frames[1:]) for frames in together] == [mtl.Pong()] * 3


def test_outcomes_from_elsewhere_go_out_on_the_next_turn() -> None:
    """The Confirms a reader's burst settles reach their writer together, on the next turn."""
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2, 3)])
    for content in contents(world.readers_sent, b"r"):
        world.readers._on_data([b"r", *mtl.encode_data(mtl.Confirm(content.sequence, False))])
    world.readers._drained()
    assert answers(world.writers_sent, b"w") == {}
    sends = len(world.writers_sent.batches)
    world.clock.advance(0)
    assert world.writers_sent.batches[sends:] == [[[b"w", *mtl.encode_data(mtl.Confirm(3, True))]]]


def test_a_run_of_accepted_contents_is_one_confirm() -> None:
    """A writer numbering its Contents from 1 is told of a run of accepted ones in one Confirm.

    The Rejects of the same batch go first, one by one; the Confirm with
    ``multiple`` then covers the run, and what the writer learns of each
    Content is what one answer each would have told it.
    """
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in range(1, 6)])
    delivered = contents(world.readers_sent, b"r")
    burst(
        world.readers,
        [
            (b"r", mtl.Reject(delivered[1].sequence, False, True))
            if index == 1
            else (b"r", mtl.Confirm(content.sequence, False))
            for index, content in enumerate(delivered)
        ],
    )
    assert world.writers_sent.commands(b"w")[-2:] == [
        mtl.Reject(2, False, True),
        mtl.Confirm(5, True),
    ]
    assert answers(world.writers_sent, b"w") == {
        1: mtl.Confirm(1, False),
        2: mtl.Reject(2, False, True),
        3: mtl.Confirm(3, False),
        4: mtl.Confirm(4, False),
        5: mtl.Confirm(5, False),
    }


def test_route_batches_answered_in_one_reader_burst_are_one_confirm() -> None:
    """A reader burst that answers several route batches tells their writer with one Confirm.

    Each batch's Confirm with ``multiple`` covers everything the one before
    it covered: only the last goes out, and the writer learns what one
    answer each would have told it.
    """
    world = bridge()
    for first in (1, 4, 7):  # three read bursts: three route batches
        burst(
            world.writers,
            [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (first, first + 1, first + 2)],
        )
    delivered = contents(world.readers_sent, b"r")
    assert len(delivered) == 9
    before = len(world.writers_sent.commands(b"w"))
    burst(world.readers, [(b"r", mtl.Confirm(c.sequence, False)) for c in delivered])
    assert world.writers_sent.commands(b"w")[before:] == [mtl.Confirm(9, True)]
    assert answers(world.writers_sent, b"w") == {n: mtl.Confirm(n, False) for n in range(1, 10)}


def test_a_reject_between_route_batches_keeps_both_confirms() -> None:
    """A Reject for the writer after a batch's Confirm: the next batch's Confirm follows it."""
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2)])
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (3, 4, 5)])
    delivered = contents(world.readers_sent, b"r")
    before = len(world.writers_sent.commands(b"w"))
    burst(
        world.readers,
        [
            (b"r", mtl.Reject(c.sequence, False, False))
            if index == 2
            else (b"r", mtl.Confirm(c.sequence, False))
            for index, c in enumerate(delivered)
        ],
    )
    assert world.writers_sent.commands(b"w")[before:] == [
        mtl.Confirm(2, True),
        mtl.Reject(3, False, False),
        mtl.Confirm(5, True),
    ]


def test_one_count_for_every_command_is_followed_too() -> None:
    """A writer numbering Lease and Contents with one count (Lease 1, Contents 2...) too."""
    world = bridge()  # its writer sent Lease 1
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (2, 3, 4)])
    burst(world.readers, [(b"r", mtl.Confirm(3, True))])
    assert world.writers_sent.commands(b"w")[-1] == mtl.Confirm(4, True)


def test_contents_numbered_otherwise_are_confirmed_one_by_one() -> None:
    """A writer whose numbering is not followed (a gap, a first Content not 1) gets one each.

    A Confirm with ``multiple`` would cover Contents the listener never read
    (sent on an earlier connection, or dropped as ill-formed).
    """
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (5, 6, 7)])
    burst(world.readers, [(b"r", mtl.Confirm(3, True))])
    assert [c for c in world.writers_sent.commands(b"w") if isinstance(c, mtl.Confirm)] == [
        mtl.Confirm(n, False) for n in (5, 6, 7)
    ]


def test_an_ill_formed_command_ends_multiple_confirms() -> None:
    """After an ill-formed data command (perhaps a Content) a writer's Confirms are one each."""
    world = bridge()
    world.writers._on_data([b"w", b"\x05\x00", b"x"])  # a Content cut short: dropped
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2)])
    burst(world.readers, [(b"r", mtl.Confirm(2, True))])
    assert [c for c in world.writers_sent.commands(b"w") if isinstance(c, mtl.Confirm)] == [
        mtl.Confirm(1, False),
        mtl.Confirm(2, False),
    ]


def test_a_confirm_never_covers_a_content_still_on_its_way() -> None:
    """Contents answered before an earlier one is: confirmed alone, until the earlier is answered.

    The first batch waits at its reader while the second is confirmed; the
    second's Contents are then confirmed one by one (a Confirm with
    ``multiple`` would cover the first batch's too), and the first batch
    once answered is covered by one Confirm.
    """
    world = bridge()
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (1, 2)])
    burst(world.writers, [(b"w", mtl.Content(n, "in", {}, b"x")) for n in (3, 4)])
    _first, second, third, fourth = contents(world.readers_sent, b"r")
    burst(
        world.readers,
        [(b"r", mtl.Confirm(third.sequence, False)), (b"r", mtl.Confirm(fourth.sequence, False))],
    )
    assert world.writers_sent.commands(b"w")[-2:] == [mtl.Confirm(3, False), mtl.Confirm(4, False)]
    burst(world.readers, [(b"r", mtl.Confirm(second.sequence, True))])
    assert world.writers_sent.commands(b"w")[-1] == mtl.Confirm(2, True)
    assert answers(world.writers_sent, b"w") == {n: mtl.Confirm(n, False) for n in (1, 2, 3, 4)}


def test_a_reader_is_answered_before_it_is_sent_content() -> None:
    """In one burst a reader summons and a writer writes: the Summon's 200 goes out first."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    listener, _, control, sent = server("mtl", router, clock)
    route = Route(
        name="loop",
        source="mtl",
        pattern=AddressPattern("in"),
        destination="mtl",
        target=AddressTemplate("out"),
    )
    router.replace_table(bind_routes([route], {"mtl": listener}))
    data(listener, b"w", mtl.Lease(1, lease(listener, control, "Writer", "none", ["in"])))
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "none", ["out"])))
    burst(listener, [(b"r", mtl.Summon(2, "out")), (b"w", mtl.Content(2, "in", {}, b"x"))])
    response, content = sent.commands(b"r")[1:]
    assert response == mtl.Response(2, 200)
    assert isinstance(content, mtl.Content) and content.body == b"x"


def test_a_silent_peer_is_forgotten_at_its_deadline_not_at_a_ping_round() -> None:
    """Silent since t, a peer is forgotten at t + dead_after_seconds, to within a moment.

    Pings every 5 s, dead after 12 s: one heard last at 3.3 s goes at 15.3 s
    (not at the ping round of 20 s), one heard last at 7 s at 19 s; with no
    peer left, no timer but the pings' stays behind.
    """
    listener, clock, control, _sent = server()
    token = lease(listener, control, "Reader", "full")
    clock.advance(3.3)
    data(listener, b"early", mtl.Lease(1, token))
    clock.advance(3.7)  # 7 s
    data(listener, b"late", mtl.Lease(1, token))
    clock.advance(15.29 - 7.0)
    assert set(listener._peers) == {b"early", b"late"}
    clock.advance(0.02)  # 15.31 s
    assert set(listener._peers) == {b"late"}
    clock.advance(18.99 - 15.31)
    assert set(listener._peers) == {b"late"}
    clock.advance(0.02)  # 19.01 s
    assert listener._peers == {}
    assert [call.func for call in clock.getDelayedCalls()] == [listener._tick]


def test_time_the_data_socket_was_not_read_does_not_count_toward_the_deadline() -> None:
    """Reading held from 10 s to 14 s: a peer silent since 0 s goes at 16 s, not 12 s."""
    listener, clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    clock.advance(10)
    holder = Congestion()
    holder.begin()
    holder.hold(listener._backlogs.reading)
    assert sent.paused
    clock.advance(4)  # 14 s: the deadline of 12 s came while nothing was read
    assert b"r" in listener._peers
    holder.drained()
    assert not sent.paused and b"r" in listener._peers
    clock.advance(1.99)  # 15.99 s
    assert b"r" in listener._peers
    clock.advance(0.02)  # 16.01 s
    assert b"r" not in listener._peers


def test_stop_cancels_the_reaper() -> None:
    """After stop(), no timer of the listener is left on the clock."""
    listener, clock, control, _sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    assert any(call.func == listener.peers._reap for call in clock.getDelayedCalls())
    listener.stop()
    assert [call for call in clock.getDelayedCalls() if call.active()] == []


def test_a_writer_gone_after_its_last_contents_still_has_them_routed() -> None:
    """A writer that closed with Contents still queued here: they are its, routed as such.

    ZeroMQ refusing a send to it (it left) makes it departed: nothing more
    is sent to it, but what it sent before it left, read afterwards (the
    data socket may not have been read meanwhile), keeps its lease.
    """
    listener, clock, control, sent = server()
    reader = lease(listener, control, "Reader", "none", ["resource"], profile="test")
    data(listener, b"r", mtl.Lease(1, reader))
    data(listener, b"r", mtl.Summon(2, "resource"))
    writer = lease(listener, control, "Writer", "none", ["resource"], profile="test")
    data(listener, b"w", mtl.Lease(1, writer))
    sent.gone.add(b"w")
    clock.advance(5)  # the ping round finds it gone
    assert listener._peers[b"w"].departed
    burst(listener, [(b"w", mtl.Content(n, "resource", {}, b"m%d" % n)) for n in range(1, 4)])
    assert [c.body for c in contents(sent, b"r")] == [b"m1", b"m2", b"m3"]
    assert not [c for c in sent.commands(b"w") if isinstance(c, mtl.Reject)]


@implementer(IDestination)
class Recording:
    """A route destination that accepts every message and keeps it."""

    name = "rec"

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Keep the batch; accept all of it."""
        self.messages.extend(messages)
        return succeed([Outcome.accepted()] * len(messages))


def test_a_read_burst_shares_its_read_time() -> None:
    """One burst's messages arrive at its start, its peers heard then; the next reads anew."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    writers, _, control, _sent = server("mtl", router, clock)
    recording = Recording()
    route = Route(name="in", source="mtl", pattern=AddressPattern("#"), destination="rec")
    router.replace_table(bind_routes([route], {"mtl": writers, "rec": recording}))
    writer_lease = lease(writers, control, "Writer", "full", ["news"])
    data(writers, b"w", mtl.Lease(1, writer_lease))
    clock.advance(2)  # within the 12 s a silent peer is kept
    started = clock.seconds()
    writers._on_data([b"w", *mtl.encode_data(mtl.Content(2, "news", {}, b"one"))])
    clock.advance(3)  # a long burst: the clock moves while it is handled
    writers._on_data([b"w", *mtl.encode_data(mtl.Content(3, "news", {}, b"two"))])
    writers._drained()
    clock.advance(0)
    assert [m.timestamp for m in recording.messages] == [started, started]
    deaf = writers._backlogs.deaf_seconds
    assert writers.peers.by_identity[b"w"].heard == started - deaf
    burst(writers, [(b"w", mtl.Content(4, "news", {}, b"three"))])
    assert recording.messages[-1].timestamp == started + 3
    assert writers.peers.by_identity[b"w"].heard == started + 3 - deaf
