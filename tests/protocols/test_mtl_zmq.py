"""Tests for `gateway.protocols.mtl.zmq`: real ZeroMQ sockets, the reactor's wake-ups by hand.

The socket under test lives on a `MemoryReactorClock` and talks over
``inproc://``, where a message sent is in the peer's queue at once; the
test plays the reactor, calling ``doRead`` as a wake-up would, so what one
wake-up reads is exactly what was sent before it.
"""

from __future__ import annotations

import select
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs

from gateway.protocols.mtl.zmq import (
    MAX_READ_BURST,
    ZmqSocket,
    compiled_send,
    zmq_factory,
)


class Recorder:
    """What a socket handed on: its messages, and the read bursts they came in."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self.bursts: list[int] = []
        self._since = 0

    def message(self, frames: list[bytes]) -> None:
        """One message."""
        self.messages.append(frames)
        self._since += 1

    def drained(self) -> None:
        """The end of a burst: how many messages it had."""
        self.bursts.append(self._since)
        self._since = 0


class World:
    """A ROUTER `ZmqSocket` on inproc, and raw pyzmq peers on the same context."""

    def __init__(self) -> None:
        self.reactor = MemoryReactorClock()
        self.factory: Any = zmq_factory(self.reactor)
        self.seen = Recorder()
        self.router = ZmqSocket(self.factory, zmq.ROUTER, self.seen.message, self.seen.drained)
        self.router.set_option(zmq.ROUTER_MANDATORY, 1)
        self.router.bind("inproc://router")
        self.peers: list[zmq.Socket[bytes]] = []

    def peer(self, identity: bytes) -> zmq.Socket[bytes]:
        """A DEALER with this identity, connected to the ROUTER."""
        socket: zmq.Socket[bytes] = self.factory.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect("inproc://router")
        self.peers.append(socket)
        return socket

    def narrow_router(self) -> ZmqSocket:
        """Another ROUTER, on ``inproc://narrow``, queueing 2 messages per peer (SNDHWM)."""
        router = ZmqSocket(self.factory, zmq.ROUTER, self.seen.message, self.seen.drained)
        router.set_option(zmq.ROUTER_MANDATORY, 1)
        router.set_option(zmq.SNDHWM, 2)  # before bind: inproc peers take it at connect
        router.bind("inproc://narrow")
        return router

    def narrow_peer(self, identity: bytes) -> zmq.Socket[bytes]:
        """A DEALER receiving at most one message, connected to `narrow_router` and known to it."""
        socket: zmq.Socket[bytes] = self.factory.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 1)
        socket.connect("inproc://narrow")
        self.peers.append(socket)
        socket.send_multipart([b"hello"])
        return socket

    def wake(self) -> None:
        """What the reactor does when the socket's descriptor is readable."""
        self.router._connection.doRead()

    def close(self) -> None:
        """Close every socket and the context."""
        for socket in self.peers:
            socket.close(linger=0)
        self.factory.shutdown()


@pytest.fixture
def world() -> Iterator[World]:
    """A fresh ROUTER and context, closed after the test."""
    made = World()
    yield made
    made.close()


def test_one_wake_up_is_one_burst(world: World) -> None:
    """Every message waiting when the reactor wakes is handed on, then drained is said once."""
    dealer = world.peer(b"a")
    for number in range(5):
        dealer.send_multipart([b"h%d" % number, b"body"])
    world.wake()
    assert world.seen.messages == [[b"a", b"h%d" % n, b"body"] for n in range(5)]
    assert world.seen.bursts == [5]
    world.wake()  # nothing more: no empty burst
    assert world.seen.bursts == [5]


def test_messages_of_any_frame_count_keep_their_boundaries(world: World) -> None:
    """One, two and four frames after the identity: each message whole, none run together."""
    dealer = world.peer(b"a")
    shapes = [[b"1"], [b"1", b"2"], [b"1", b"2", b"3", b""]]
    for frames in shapes:
        dealer.send_multipart(frames)
    world.wake()
    assert world.seen.messages == [[b"a", *frames] for frames in shapes]


def test_frames_go_to_the_compiled_send(world: World) -> None:
    """The sockets send through pyzmq's compiled class: this pyzmq still has it.

    If an upgrade of pyzmq drops or renames ``zmq.backend.Socket.send``,
    the sockets fall back to pyzmq's Python send (slower, the same frames),
    and this test says so.
    """
    from zmq.backend import Socket as CompiledSocket

    connection = world.router._connection
    assert isinstance(connection.socket, CompiledSocket)
    assert connection._send_frame.__func__ is CompiledSocket.send
    dealer = world.peer(b"a")
    dealer.send_multipart([b"hello"])
    world.wake()
    world.router.send([b"a", b"head", b"body"])
    assert dealer.recv_multipart() == [b"head", b"body"]


def test_without_the_compiled_class_the_sockets_own_send(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pyzmq without ``zmq.backend.Socket``, or a socket of another class: its own send."""
    import zmq.backend

    socket = world.router._connection.socket
    monkeypatch.delattr(zmq.backend, "Socket")
    assert compiled_send(socket) == socket.send
    monkeypatch.undo()

    class Other:
        def send(self, data: bytes, flags: int = 0) -> None:
            """A socket of another class."""

    other = Other()
    assert compiled_send(other) == other.send


def test_read_now_asks_before_it_reads(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing waiting: no read tried (pyzmq's Again costs more); a message waiting: read whole."""
    connection = world.router._connection
    reads: list[None] = []
    real_read = connection._read

    def counted() -> list[bytes]:
        reads.append(None)
        frames: list[bytes] = real_read()
        return frames

    monkeypatch.setattr(connection, "_read", counted)
    world.router.read_now()
    assert reads == []
    assert world.seen.bursts == []
    dealer = world.peer(b"a")
    dealer.send_multipart([b"head", b"body"])
    world.router.read_now()
    assert world.seen.messages == [[b"a", b"head", b"body"]]
    assert world.seen.bursts == [1]
    assert len(reads) == 2  # the message, then the read that found nothing (Again)
    dealer.send_multipart([b"again", b""])
    world.router.read_now()  # what arrives after an empty look is seen at the next
    assert world.seen.messages[-1] == [b"a", b"again", b""]


def test_a_long_burst_yields_to_the_reactor(world: World) -> None:
    """Past MAX_READ_BURST the burst is handed on and the rest read on the next reactor turn."""
    dealer = world.peer(b"a")
    for number in range(MAX_READ_BURST + 3):
        dealer.send_multipart([b"%d" % number, b""])
    world.wake()
    assert world.seen.bursts == [MAX_READ_BURST]
    world.reactor.advance(0)
    assert world.seen.bursts == [MAX_READ_BURST, 3]
    assert len(world.seen.messages) == MAX_READ_BURST + 3


def test_a_send_reads_again_only_when_something_waits(world: World) -> None:
    """A send may take the descriptor's wake-up (ZeroMQ's descriptor is edge-triggered).

    After each send ZeroMQ is asked what waits: nothing, and no read is
    scheduled (the descriptor signals the next arrival); a message, and it
    is read on the next reactor turn.
    """
    dealer = world.peer(b"a")
    dealer.send_multipart([b"hello"])
    world.wake()
    world.router.send_routed([[b"a", b"1", b""]])
    assert world.reactor.getDelayedCalls() == []
    dealer.send_multipart([b"next"])
    descriptor = world.router._connection.fileno()
    assert select.select([descriptor], [], [], 0)[0] == [descriptor]  # a wake-up will come
    dealer.send_multipart([b"more"])
    world.router.send_many([[b"a", b"2", b""]])  # before the reactor woke for them
    assert len(world.reactor.getDelayedCalls()) == 1
    world.reactor.advance(0)
    assert world.seen.messages[1:] == [[b"a", b"next"], [b"a", b"more"]]
    assert world.seen.bursts == [1, 2]
    assert [dealer.recv_multipart() for _ in range(2)] == [[b"1", b""], [b"2", b""]]


def test_send_many_says_which_were_refused(world: World) -> None:
    """A message for a peer that is not there is refused alone; those around it go out."""
    dealer = world.peer(b"a")
    dealer.send_multipart([b"hello", b""])
    world.wake()  # the ROUTER knows "a" now
    failed = world.router.send_many([[b"a", b"1", b""], [b"nobody", b"2", b""], [b"a", b"3", b""]])
    assert failed == [1]
    assert [dealer.recv_multipart() for _ in range(2)] == [[b"1", b""], [b"3", b""]]
    assert world.router.send([b"nobody", b"4", b""]) is False


def test_send_routed_tells_full_from_gone(world: World) -> None:
    """A peer with no connection is "gone" (EHOSTUNREACH), a full queue "full" (EAGAIN).

    Once a peer refused one, its later messages in the call are refused
    alike without being tried, so what it gets keeps its order.
    """
    router = world.narrow_router()
    slow = world.narrow_peer(b"slow")
    router._connection.doRead()  # the ROUTER knows "slow" now
    messages = [[b"slow", b"%d" % n] for n in range(20)]
    messages.insert(5, [b"nobody", b"x"])
    messages.append([b"nobody", b"y"])
    full, gone = router.send_routed(messages)
    assert gone == [5, len(messages) - 1]
    taken = [position for position in range(len(messages)) if position not in (*full, *gone)]
    assert taken and full and max(taken) < min(full)
    assert full == [p for p in range(min(full), len(messages) - 1) if p != 5]
    got = []
    while slow.poll(0):
        got.append(slow.recv_multipart()[0])
    assert got == [messages[p][1] for p in taken]


def test_send_in_order_stops_at_the_first_refusal(world: World) -> None:
    """One peer's messages go until ZeroMQ refuses one: how many, and whether it is gone."""
    router = world.narrow_router()
    slow = world.narrow_peer(b"slow")
    router._connection.doRead()
    taken, gone = router.send_in_order([b"slow", b"%d" % n] for n in range(50))
    assert 0 < taken < 50 and not gone
    got = []
    while slow.poll(0):
        got.append(slow.recv_multipart()[0])
    assert got == [b"%d" % n for n in range(taken)]
    assert router.send_in_order(iter([[b"nobody", b"x"]])) == (0, True)
    assert router.send_in_order([]) == (0, False)


def test_a_paused_socket_reads_nothing_until_resumed(world: World) -> None:
    """Paused, a wake-up reads nothing; resumed, what waited is read on the next turn."""
    dealer = world.peer(b"a")
    world.router.pause_reading()
    assert world.router.reading_paused
    for number in range(3):
        dealer.send_multipart([b"%d" % number])
    world.wake()
    world.reactor.advance(0)
    assert world.seen.messages == []
    world.router.resume_reading()
    assert not world.router.reading_paused
    world.reactor.advance(0)
    assert world.seen.messages == [[b"a", b"%d" % n] for n in range(3)]
    assert world.seen.bursts == [3]


def test_a_pause_within_a_burst_stops_it(world: World) -> None:
    """A handler that pauses reading ends the burst there; the rest waits for the resume."""
    dealer = world.peer(b"a")
    for number in range(5):
        dealer.send_multipart([b"%d" % number])

    def handle(frames: list[bytes]) -> None:
        world.seen.message(frames)
        if frames[1] == b"1":
            world.router.pause_reading()

    world.router._connection._on_message = handle
    world.wake()
    world.reactor.advance(0)
    assert world.seen.bursts == [2]
    world.router.resume_reading()
    world.reactor.advance(0)
    assert world.seen.bursts == [2, 3]


def test_a_failing_handler_does_not_lose_the_burst(world: World) -> None:
    """A handler that raises is logged; the burst's other messages and its end still come."""
    dealer = world.peer(b"a")
    for body in (b"1", b"boom", b"3"):
        dealer.send_multipart([body])
    handled: list[bytes] = []

    def handle(frames: list[bytes]) -> None:
        if frames[1] == b"boom":
            raise ValueError("boom")
        handled.append(frames[1])
        world.seen.message(frames)

    world.router._connection._on_message = handle
    with capturedLogs() as events:
        world.wake()
    assert handled == [b"1", b"3"]
    assert world.seen.bursts == [2]
    assert [e["log_format"] for e in events if e.get("log_failure")] == [
        "handling a ZeroMQ message failed unexpectedly"
    ]


def test_a_req_socket_waiting_to_send_reads_nothing(world: World) -> None:
    """A REQ socket woken between its reply and its next request neither reads nor fails."""
    replies = Recorder()
    req = ZmqSocket(world.factory, zmq.REQ, replies.message, replies.drained)
    req.connect("inproc://router")
    assert req.send([b"ask"])
    world.wake()
    [request] = world.seen.messages
    assert request[1:] == [b"", b"ask"]
    world.router.send([request[0], b"", b"answer"])
    req._connection.doRead()
    assert replies.messages == [[b"answer"]]
    req._connection.doRead()  # nothing to read in this state: no error, no burst
    assert replies.bursts == [1]
