"""Tests for `gateway.protocols.mtl.server` without sockets: timers on a `Clock`.

The listener's two ZeroMQ sockets are replaced by recorders of the
multipart messages it sends (ZeroMQ itself is exercised end to end in
tests/integration/test_mtl.py, the read bursts in test_mtl_zmq.py);
requests are handed to its receive functions as ZeroMQ would, identity
frame first, and the end of a read burst as the socket would say it.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet.task import Clock
from zope.interface.verify import verifyObject

from gateway.codecs import mtl
from gateway.core.addressing import AddressPattern, AddressTemplate
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings


@attrs.define
class Sent:
    """Records what the listener sends on one socket, and which sends went out together."""

    messages: list[list[bytes]] = attrs.Factory(list)
    batches: list[list[list[bytes]]] = attrs.Factory(list)
    refuse: set[bytes] = attrs.Factory(set)
    """Identities ZeroMQ will not take a message for (gone, queue full)."""

    def send(self, frames: list[bytes]) -> bool:
        """Record; ZeroMQ took it unless it is for a refused identity."""
        if frames[0] in self.refuse:
            return False
        self.messages.append(frames)
        return True

    def send_many(self, messages: list[list[bytes]]) -> list[int]:
        """Record each, and the group; the positions refused."""
        self.batches.append(messages)
        return [position for position, frames in enumerate(messages) if not self.send(frames)]

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


def bridge(metrics: GatewayMetrics | None = None) -> Bridge:
    """Two recorded listeners and the route between them."""
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
    data(readers, b"r", mtl.Lease(1, lease(readers, readers_control, "Reader", "full", ["out"])))
    data(readers, b"r", mtl.Summon(2, "out"))
    return Bridge(router, clock, writers, writers_sent, readers, readers_sent)


def lease(
    listener: MTLServer,
    control: Sent,
    kind: str,
    confirm: str,
    resources: list[str] | None = None,
) -> str:
    """Walk a REQ peer through Open, Profile and Reader/Writer; the lease."""
    for command, body in (
        ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
        ("Connection.Profile", {"profile": "gateway"}),
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
    """The Confirms and Rejects sent to one peer, by the sequence they answer."""
    return {
        c.sequence: c for c in sent.commands(identity) if isinstance(c, mtl.Confirm | mtl.Reject)
    }


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


def test_readers_without_confirmations_and_readers_not_reading() -> None:
    """Written to a confirm=none reader is accepted; one ZeroMQ refuses is retry; no reader too."""
    listener, _clock, control, sent = server()
    data(listener, b"quiet", mtl.Lease(1, lease(listener, control, "Reader", "none")))
    data(listener, b"quiet", mtl.Summon(2, "news"))
    data(listener, b"gone", mtl.Lease(1, lease(listener, control, "Reader", "full", ["gone"])))
    data(listener, b"gone", mtl.Summon(2, "gone"))
    sent.refuse.add(b"gone")
    results: list[list[Outcome]] = []
    batch = [
        Message(address="news", body=b"a"),
        Message(address="gone", body=b"b"),
        Message(address="nobody", body=b"c"),
    ]
    listener.deliver(batch).addCallback(results.append)
    [[accepted, refused, unread]] = results
    assert accepted.status is Status.ACCEPTED
    assert refused.status is Status.RETRY and "not reading" in refused.reason
    assert unread.status is Status.RETRY and "no MTL reader" in unread.reason
    assert listener._peers[b"gone"].unconfirmed == {}


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
    world.writers._forget(world.writers._peers[b"w"], "test")
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
    assert world.writers_sent.batches[sends:] == [
        [[b"w", *mtl.encode_data(mtl.Confirm(n, False))] for n in (1, 2, 3)]
    ]


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
