"""Tests for `gateway.protocols.mtl.client` without sockets: timers on a `Clock`.

The upstream's data socket is replaced by a recorder (the control dialogue
and ZeroMQ itself are exercised end to end in tests/integration/test_mtl.py):
a data flow is opened as `_open_data` opens it, minus the socket, and the
server's commands are handed to the upstream as its DEALER would, a read
burst at a time. Routes from the upstream lead to a recorded MTL listener
(`tests.protocols.test_mtl_server`) whose reader answers for each message.
"""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from zope.interface.verify import verifyObject

from gateway.codecs import mtl
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.protocols.mtl.client import MTLUpstream
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLUpstreamSettings
from tests.protocols.test_mtl_server import Sent, content_batches, contents, lease, server
from tests.protocols.test_mtl_server import burst as listener_burst


@attrs.define
class Peer:
    """Records what the upstream sends on its data flow (a DEALER: no identity frame)."""

    messages: list[list[bytes]] = attrs.Factory(list)
    batches: list[list[list[bytes]]] = attrs.Factory(list)
    refuse: bool = False
    """ZeroMQ will not take anything (no server connected, queue full)."""

    def send(self, frames: list[bytes]) -> bool:
        """Record, unless refusing."""
        if self.refuse:
            return False
        self.messages.append(frames)
        return True

    def send_many(self, messages: list[list[bytes]]) -> list[int]:
        """Record each, and the group; the positions refused."""
        self.batches.append(messages)
        return [position for position, frames in enumerate(messages) if not self.send(frames)]

    def commands(self) -> list[mtl.DataCommand]:
        """Every data command sent, in order."""
        return [mtl.decode_data(frames) for frames in self.messages]

    def answers(self) -> dict[int, mtl.DataCommand]:
        """The Confirms and Rejects sent, by the sequence they answer."""
        return {c.sequence: c for c in self.commands() if isinstance(c, mtl.Confirm | mtl.Reject)}


def upstream(mode: str, confirm: str = "full") -> tuple[MTLUpstream, Clock, Router]:
    """An upstream with no sockets yet."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    up = MTLUpstream(
        name="up",
        settings=MTLUpstreamSettings(mode=mode, confirm=confirm, resources=("news",)),
        host="127.0.0.1",
        port=1,
        router=router,
        secrets=Secrets(),
        clock=clock,
        reactor=clock,
    )
    return up, clock, router


def open_flow(up: MTLUpstream) -> Peer:
    """A data flow as `_open_data` opens it (the Lease sent), the server's Response 200 read."""
    drained = up._new_flow()
    peer = Peer()
    up._data = peer
    sequence = next(up._sequence)
    up._send(mtl.Lease(sequence, "lease"))
    up._on_data(mtl.encode_data(mtl.Response(sequence, 200)))
    drained()
    up.clock.advance(0)  # type: ignore[attr-defined]  # a Clock: the next reactor turn
    assert up.connected
    return peer


def burst(up: MTLUpstream, commands: list[mtl.DataCommand]) -> None:
    """Data commands read in one wake-up of the DEALER, the burst's end, the next turn."""
    for command in commands:
        up._on_data(mtl.encode_data(command))
    up._drained()  # what the socket calls once the read is drained
    up.clock.advance(0)  # type: ignore[attr-defined]  # a Clock: the next reactor turn


def reader_world() -> tuple[MTLUpstream, Peer, MTLServer, Sent, Clock]:
    """A reader upstream whose "news" is routed to the readers of "news" on listener mtl."""
    up, clock, router = upstream("reader")
    listener, _, control, listener_sent = server("mtl", router, clock)
    route = Route(
        name="down", source="up", pattern=AddressPattern("news"), destination="mtl",
        timeout_seconds=10.0,
    )  # fmt: skip
    router.replace_table(bind_routes([route], {"mtl": listener, "up": up}))
    listener_burst(
        listener, [(b"r", mtl.Lease(1, lease(listener, control, "Reader", "full", ["news"])))]
    )
    listener_burst(listener, [(b"r", mtl.Summon(2, "news"))])
    return up, open_flow(up), listener, listener_sent, clock


def test_is_a_destination() -> None:
    """The upstream provides IDestination."""
    up, _clock, _router = upstream("writer")
    assert verifyObject(IDestination, up)


def test_a_reader_summons_its_resources() -> None:
    """Once the lease is answered 200, a reader summons each resource."""
    _up, peer, _listener, _sent, _clock = reader_world()
    assert peer.commands() == [mtl.Lease(1, "lease"), mtl.Summon(2, "news")]


def test_a_read_burst_is_one_batch_each_answered() -> None:
    """The server's Contents of one read go to the route as one batch; each gets its answer."""
    up, peer, _listener, listener_sent, _clock = reader_world()
    burst(up, [mtl.Content(n, "news", {}, b"%d" % n) for n in (10, 11, 12)])
    assert content_batches(listener_sent) == [3]
    first, second, third = contents(listener_sent, b"r")
    assert peer.answers() == {}
    listener_burst(
        _listener,
        [
            (b"r", mtl.Reject(third.sequence, False, True)),
            (b"r", mtl.Confirm(first.sequence, False)),
            (b"r", mtl.Reject(second.sequence, False, False)),
        ],
    )
    assert peer.answers() == {
        10: mtl.Confirm(10, False),
        11: mtl.Reject(11, False, False),
        12: mtl.Reject(12, False, True),
    }


def test_unrouted_content_is_rejected_beside_routed_content() -> None:
    """In one burst, Content with no route is Rejected at once; the routed one waits its answer."""
    up, peer, listener, listener_sent, _clock = reader_world()
    burst(up, [mtl.Content(5, "elsewhere", {}, b"x"), mtl.Content(6, "news", {}, b"y")])
    assert peer.answers() == {5: mtl.Reject(5, False, False)}
    [delivered] = contents(listener_sent, b"r")
    listener_burst(listener, [(b"r", mtl.Confirm(delivered.sequence, False))])
    assert peer.answers() == {5: mtl.Reject(5, False, False), 6: mtl.Confirm(6, False)}


def test_answers_for_a_flow_that_is_gone_are_not_sent_on_the_next() -> None:
    """Outcomes arriving after the flow started over are dropped: the server recycles those."""
    up, old_peer, listener, listener_sent, _clock = reader_world()
    burst(up, [mtl.Content(7, "news", {}, b"x")])
    up._teardown("test")
    new_peer = open_flow(up)
    [delivered] = contents(listener_sent, b"r")
    listener_burst(listener, [(b"r", mtl.Confirm(delivered.sequence, False))])
    assert old_peer.answers() == {}
    assert new_peer.answers() == {}


def test_a_confirm_none_reader_answers_nothing() -> None:
    """With confirm=none the server hears nothing back, routed or not."""
    up, _clock, router = upstream("reader", confirm="none")
    listener, _, control, listener_sent = server("mtl", router)
    route = Route(name="down", source="up", pattern=AddressPattern("news"), destination="mtl")
    router.replace_table(bind_routes([route], {"mtl": listener}))
    listener_burst(
        listener, [(b"r", mtl.Lease(1, lease(listener, control, "Reader", "none", ["news"])))]
    )
    listener_burst(listener, [(b"r", mtl.Summon(2, "news"))])
    peer = open_flow(up)
    burst(up, [mtl.Content(3, "news", {}, b"x"), mtl.Content(4, "other", {}, b"y")])
    assert len(contents(listener_sent, b"r")) == 1
    assert peer.answers() == {}


def deliver(
    up: MTLUpstream, bodies: list[bytes]
) -> tuple[Deferred[list[Outcome]], list[list[Outcome]]]:
    """Deliver a batch on "news"; the Deferred and where its outcomes land."""
    results: list[list[Outcome]] = []
    d = up.deliver([Message(address="news", body=body) for body in bodies])
    d.addCallback(results.append)
    return d, results


def test_a_writer_sends_a_batch_together() -> None:
    """A batch goes out as Contents in one go; Confirm multiple and Reject settle each."""
    up, _clock, _router = upstream("writer")
    peer = open_flow(up)
    _d, results = deliver(up, [b"a", b"b", b"c"])
    sent = [mtl.decode_data(frames) for frames in peer.batches[-1]]
    assert [(c.sequence, c.body) for c in sent if isinstance(c, mtl.Content)] == [
        (2, b"a"), (3, b"b"), (4, b"c"),
    ]  # fmt: skip
    burst(up, [mtl.Confirm(3, True)])
    assert results == []
    burst(up, [mtl.Reject(4, False, False)])
    [outcomes] = results
    assert [o.status for o in outcomes] == [Status.ACCEPTED, Status.ACCEPTED, Status.REJECTED]


def test_a_writer_flow_lost_mid_batch() -> None:
    """The flow closes mid-batch: confirmed stays accepted, the rest is retry later."""
    up, _clock, _router = upstream("writer")
    open_flow(up)
    _d, results = deliver(up, [b"a", b"b"])
    burst(up, [mtl.Confirm(2, False)])
    up._teardown("the server went away")
    [[accepted, retry]] = results
    assert accepted.status is Status.ACCEPTED
    assert retry.status is Status.RETRY and "the server went away" in retry.reason


def test_a_cancelled_writer_batch_answers_what_it_knows() -> None:
    """The router's deadline cancels the batch: known outcomes kept, the rest unanswered."""
    up, _clock, _router = upstream("writer")
    open_flow(up)
    d, results = deliver(up, [b"a", b"b", b"c"])
    burst(up, [mtl.Reject(3, False, True)])
    d.cancel()
    [[unanswered, recycled, still]] = results
    assert recycled.status is Status.RETRY and "recycle" in recycled.reason
    assert unanswered.status is still.status is Status.RETRY
    assert "no outcome before the deadline" in unanswered.reason
    assert up._unconfirmed == {}  # a late Confirm finds nothing
    burst(up, [mtl.Confirm(4, True)])
    assert len(results) == 1


def test_a_writer_without_confirmations_or_a_peer() -> None:
    """confirm=none: written is accepted; ZeroMQ not taking it, or not connected: retry."""
    up, _clock, _router = upstream("writer", confirm="none")
    results: list[list[Outcome]] = []
    up.deliver([Message(address="news", body=b"a")]).addCallback(results.append)
    assert "not connected" in results[0][0].reason
    peer = open_flow(up)
    up.deliver([Message(address="news", body=b"b")]).addCallback(results.append)
    assert results[1] == [Outcome.accepted()]
    peer.refuse = True
    up.deliver([Message(address="news", body=b"c")]).addCallback(results.append)
    assert results[2][0].status is Status.RETRY and "not reading" in results[2][0].reason
    assert up._unconfirmed == {}


def test_a_reader_upstream_takes_nothing() -> None:
    """Routes to a reader upstream are rejected, every message of the batch."""
    up, _clock, _router = upstream("reader")
    results: list[list[Outcome]] = []
    up.deliver([Message(address="x", body=b"a")] * 2).addCallback(results.append)
    assert [o.status for o in results[0]] == [Status.REJECTED, Status.REJECTED]


def test_a_message_mtl_cannot_carry_is_rejected_alone() -> None:
    """A header name too long for a field table rejects that message; its batch goes on."""
    up, _clock, _router = upstream("writer", confirm="none")
    open_flow(up)
    results: list[list[Outcome]] = []
    batch = [
        Message(address="news", body=b"a", headers={"n" * 256: "x"}),
        Message(address="news", body=b"b"),
    ]
    up.deliver(batch).addCallback(results.append)
    [[refused, accepted]] = results
    assert refused.status is Status.REJECTED
    assert accepted.status is Status.ACCEPTED


def test_a_flow_ending_mid_burst_still_routes_what_it_read() -> None:
    """Contents read before a bad Response ends the flow are delivered; no answer goes back."""
    up, _old_peer, _listener, listener_sent, _clock = reader_world()
    up._running = False  # no new attempt: this test is about the flow that ends
    for command in (mtl.Content(8, "news", {}, b"x"), mtl.Response(99, 403)):
        up._on_data(mtl.encode_data(command))
    assert not up.connected
    assert [c.body for c in contents(listener_sent, b"r")] == [b"x"]
    assert up._outbox.reading is False  # the next flow's answers are not held back


def test_a_silent_data_flow_starts_over_at_dead_after_seconds() -> None:
    """Heard at 3 s, dead after 30 s: still up at 32.5 s, started over at 33 s (not at 40 s)."""
    up, clock, _router = upstream("reader")
    peer = open_flow(up)
    up._watch_flow()  # as `_open_data` does, minus the socket
    clock.advance(3)
    burst(up, [mtl.Pong()])
    with capturedLogs() as events:
        clock.advance(29.5)
        assert up.connected
        clock.advance(0.5)
    assert not up.connected
    assert next(event["why"] for event in events if "why" in event) == (
        "the data flow was silent for 30 s"
    )
    assert mtl.Ping() in peer.commands()  # pings went out every ping_interval_seconds
