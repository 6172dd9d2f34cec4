"""ZeroMQ sockets on the gateway's reactor, through txzmq, and what is written to them.

txzmq imports the global reactor when it is imported, and its ``send``
schedules reads on that global reactor. So it is imported only when a
socket is made (twistd has chosen the reactor by then), and the socket
classes here send and schedule on the reactor they are given.

Reading: one reactor wake-up reads every message waiting (up to
`MAX_READ_BURST`), hands each to ``on_message``, then calls ``on_drained``
once: what one wake-up read is one batch (DESIGN.md, "The batch is the unit
of work"). txzmq's own read loop is replaced for that, and because it asks
ZeroMQ for the socket's events and wraps a logging context around every
message, which cost more than the read itself.

Writing: a socket sends several messages in one call (`ZmqSocket.send_many`,
`ZmqSocket.send_routed`), which `gateway.protocols.mtl.outbox.Outbox` gathers
from a burst: ZeroMQ then wakes its I/O thread once for them instead of once
per message. Frames go straight to the send of
pyzmq's compiled socket (``zmq.backend.Socket.send``), bound once per
socket: pyzmq's Python ``Socket.send`` in front of it only adds the
routing-id and group arguments of draft socket types, which MTL's ROUTER
and DEALER sockets never take, and costs about a quarter of a microsecond a
frame, two thirds of what ZeroMQ's own send of a small frame costs here (a
pyzmq without that class, or a socket not made from it, gets the Python
send).
A ROUTER's first frame (the peer's routing id, always followed by more) is
read as bytes; the others as frame objects, which say whether more follow
for less than asking the socket does.

Queues: every socket made here holds at most `DEFAULT_HIGH_WATER_MARK`
messages per peer each way (a socket's owner may set another ``SNDHWM``
before it binds or connects). txzmq sets no limit at all (0), so a peer
that stopped reading grew the gateway's memory by everything sent to it,
and every send "succeeded". At the mark a send fails at once
(``NOBLOCK``; ``ROUTER_MANDATORY`` for a ROUTER, which also fails a send to
a peer it has no connection with), and the caller holds, answers or counts
what was refused (`ZmqSocket.send_routed` tells a full queue from a gone
peer); a peer's writes wait in its own process while our queue of its
messages is full, and a socket whose reading is paused
(`ZmqSocket.pause_reading`) lets exactly that happen to every peer.

Connections: a ROUTER names a peer by its routing id, which a peer may
choose, and which another connection may take once the first is gone. A
listener's ZAP handler (`gateway.protocols.mtl.zap`) gives every connection
a number, which libzmq attaches to each of its messages as the
`CONNECTION_PROPERTY` (`ZmqSocket.connection`); `ZmqSocket.watch` reports
the socket's ZeroMQ events (a failed handshake, a connection closed) as
libzmq's socket monitor gives them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any, Final

from twisted.logger import Logger

__all__ = [
    "CONNECTION_PROPERTY",
    "DEFAULT_HIGH_WATER_MARK",
    "MAX_READ_BURST",
    "ZmqSocket",
    "compiled_send",
    "zmq_factory",
]

CONNECTION_PROPERTY: Final = "X-Connection"
"""The message property naming a message's connection (set by the listener's ZAP handler)."""

DEFAULT_HIGH_WATER_MARK: Final = 10_000
"""Messages a socket queues for one peer, and from one peer, at most.

Ten read bursts: ZeroMQ's own default (1,000) is one burst, and the answers
to one burst (a Confirm or Reject for each Content) then overflow a queue
that still holds some of the previous burst's, for a peer that reads them.
"""
MAX_READ_BURST: Final = 1000
"""Messages read in one wake-up before they are handed on and reading yields to the reactor.

It bounds one batch's memory, and a peer that writes without pause cannot
keep the gateway from answering it (or anyone else).
"""

_log = Logger(namespace="gateway.protocols.mtl.zmq")
_MONITORS = itertools.count(1)
"""Numbers the monitors' inproc addresses (unique within the process)."""


def compiled(socket: Any, name: str) -> Callable[..., Any]:
    """The method ``name`` of pyzmq's compiled socket class bound to ``socket``, or its own.

    The compiled one skips pyzmq's Python wrapper (`_classes`); where this
    pyzmq has no such class, or ``socket`` is not one, the socket's own.
    """
    try:
        from zmq.backend import Socket as CompiledSocket

        method: Callable[..., Any] = getattr(CompiledSocket, name)
    except (ImportError, AttributeError):
        return getattr(socket, name)  # type: ignore[no-any-return]
    if not isinstance(socket, CompiledSocket):
        return getattr(socket, name)  # type: ignore[no-any-return]
    return method.__get__(socket)  # type: ignore[no-any-return]


def compiled_send(socket: Any) -> Callable[..., object]:
    """`compiled` ``send``."""
    return compiled(socket, "send")


@cache
def _classes() -> tuple[Any, Any, Any, Any]:
    import zmq
    from txzmq import ZmqEndpoint, ZmqEndpointType, ZmqFactory
    from txzmq.connection import ZmqConnection

    # Plain ints: or-ing pyzmq's flag enums costs more than the send.
    more = int(zmq.NOBLOCK | zmq.SNDMORE)
    last = int(zmq.NOBLOCK)
    again = zmq.Again
    events = int(zmq.EVENTS)
    pollin = int(zmq.POLLIN)
    connection_property = CONNECTION_PROPERTY.encode("ascii")  # bytes: not encoded per message
    router = int(zmq.ROUTER)
    unroutable = int(zmq.EHOSTUNREACH)

    class _Socket(ZmqConnection):  # type: ignore[misc]
        """A txzmq connection that reads in bursts and schedules on its factory's reactor."""

        read_scheduled: Any = None
        highWaterMark = DEFAULT_HIGH_WATER_MARK  # noqa: N815 (txzmq's name; it sets 0)

        def __init__(
            self,
            factory: Any,
            kind: int,
            on_message: Callable[[list[bytes]], None],
            on_drained: Callable[[], None] | None,
        ) -> None:
            self.socketType = kind
            self._on_message = on_message
            self._on_drained = on_drained
            self._routed = kind == router  # before txzmq's first read
            super().__init__(factory)
            self._send_frame = compiled_send(self.socket)
            self._events = compiled(self.socket, "get")

        def send(self, message: list[bytes]) -> None:
            send = self._send_frame
            for part in message[:-1]:
                send(part, more)
            send(message[-1], last)
            self._sent()

        def send_many(self, messages: Sequence[list[bytes]]) -> list[int]:
            """Send each message; the positions of those ZeroMQ would not take."""
            send = self._send_frame
            failed: list[int] = []
            for position, message in enumerate(messages):
                try:
                    for part in message[:-1]:
                        send(part, more)
                    send(message[-1], last)
                except zmq.ZMQError:  # zmq.Again too: a full queue, a peer gone
                    failed.append(position)
            self._sent()
            return failed

        def send_routed(self, messages: Sequence[list[bytes]]) -> tuple[list[int], list[int]]:
            """Send each message (identity frame first); the positions refused, full and gone.

            Once a peer refused one, its later ones are not tried: its queue
            may have room again a moment later, and what it gets must keep
            its order.
            """
            send = self._send_frame
            full: list[int] = []
            gone: list[int] = []
            refused: dict[bytes, list[int]] = {}
            for position, message in enumerate(messages):
                if refused:
                    same = refused.get(message[0])
                    if same is not None:
                        same.append(position)
                        continue
                try:
                    if len(message) == 3:  # identity, header, body: a data command's shape
                        send(message[0], more)
                        send(message[1], more)
                        send(message[2], last)
                    else:
                        for part in message[:-1]:
                            send(part, more)
                        send(message[-1], last)
                except zmq.ZMQError as exc:
                    # ROUTER_MANDATORY refuses the identity frame, so nothing of it went out.
                    why = gone if exc.errno == unroutable else full
                    why.append(position)
                    refused[message[0]] = why
            self._sent()
            return full, gone

        def send_in_order(self, messages: Iterable[list[bytes]]) -> tuple[int, bool]:
            """Send messages for one peer until one is refused; how many went, and if it is gone."""
            send = self._send_frame
            taken = 0
            gone = False
            try:
                for message in messages:
                    for part in message[:-1]:
                        send(part, more)
                    send(message[-1], last)
                    taken += 1
            except zmq.ZMQError as exc:
                gone = exc.errno == unroutable
            self._sent()
            return taken, gone

        reading_paused = False

        def pause_reading(self) -> None:
            """Read nothing until `resume_reading`."""
            self.reading_paused = True

        def resume_reading(self) -> None:
            """Read again, from the next reactor turn."""
            if self.reading_paused:
                self.reading_paused = False
                if self.factory is not None:  # not closed
                    # ZeroMQ's descriptor says nothing of what waited meanwhile: look now.
                    self._read_soon()

        def _read_soon(self) -> None:
            # A send may take the wake-up meant for incoming messages (ZeroMQ's
            # descriptor is edge-triggered): read once more on the next turn.
            if self.read_scheduled is None:
                self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        def _sent(self) -> None:
            # A send may have taken the wake-up meant for incoming messages (ZeroMQ's
            # descriptor is edge-triggered). Asking ZeroMQ's events processes what
            # it was told meanwhile, so the descriptor signals whatever comes next
            # (zmq_getsockopt(3), ZMQ_FD); what already waits is read on the next turn.
            if (
                self.read_scheduled is None
                and self.factory is not None
                and self._events(events) & pollin
            ):
                self._read_soon()

        def read_waiting(self) -> None:
            """`doRead` if a message waits: asking costs a third of a read that finds none."""
            if self.factory is not None and self._events(events) & pollin:
                self.doRead()

        def doRead(self) -> None:  # noqa: N802 (IReadDescriptor's name)
            """Read every message waiting (up to a burst), then say the read is drained."""
            scheduled = self.read_scheduled
            if scheduled is not None:
                if not scheduled.called:
                    scheduled.cancel()
                self.read_scheduled = None
            if self.factory is None:  # closed
                return
            if self.reading_paused:
                # Have ZeroMQ process its commands all the same, so that its
                # descriptor goes quiet instead of waking the reactor again.
                self.socket.get(events)
                return
            if self.before_read is not None:
                self.before_read()
            read = self._read
            on_message = self._on_message
            count = 0
            try:
                while count < MAX_READ_BURST and not self.reading_paused:
                    try:
                        frames = read()
                    except again:
                        # Reading until EAGAIN lets ZeroMQ process its commands, so
                        # the descriptor signals again when more arrives.
                        break
                    except zmq.ZMQError as exc:
                        if exc.errno != zmq.EFSM:
                            raise
                        # A REQ socket between its reply and its next request: nothing
                        # to read; have ZeroMQ process its commands all the same.
                        self.socket.get(events)
                        break
                    count += 1
                    try:
                        on_message(frames)
                    except Exception:
                        _log.failure("handling a ZeroMQ message failed unexpectedly")
                    if self.factory is None:  # a handler closed the socket
                        return
                else:
                    if count == MAX_READ_BURST:
                        self._read_soon()  # more may be waiting: after the reactor's other work
            finally:
                if count and self._on_drained is not None and self.factory is not None:
                    self._on_drained()

        before_read: Callable[[], None] | None = None
        track_user_id = False
        user_id: str | None = None
        track_peer_address = False
        peer_address: str | None = None
        track_connection = False
        connection: str | None = None
        last_frame: Any = None

        def _read(self) -> list[bytes]:
            # ZeroMQ hands over a message's frames together. Frame objects, because
            # asking a frame whether more follow costs less than asking the socket
            # (and the last one carries the ZAP User-Id).
            recv = self.socket.recv
            if self._routed:  # the routing id, and at least one frame after it
                frames: list[bytes] = [recv(last)]
                frame = recv(last, copy=False)
                frames.append(frame.bytes)
            else:
                frame = recv(last, copy=False)
                frames = [frame.bytes]
            while frame.more:
                frame = recv(last, copy=False)
                frames.append(frame.bytes)
            if self.track_user_id:
                try:
                    self.user_id = frame.get("User-Id") or None
                except zmq.ZMQError:  # no ZAP handler: no such property
                    self.user_id = None
            if self.track_peer_address:
                try:
                    self.peer_address = frame.get("Peer-Address") or None
                except zmq.ZMQError:  # a transport without addresses (inproc)
                    self.peer_address = None
            if self.track_connection:
                self.last_frame = frame
                try:
                    self.connection = frame.get(connection_property)
                except zmq.ZMQError:  # no ZAP handler gave it one
                    self.connection = None
            return frames

    return _Socket, ZmqFactory, ZmqEndpoint, ZmqEndpointType


def zmq_factory(reactor: Any) -> Any:
    """A txzmq factory (one ZeroMQ context) whose sockets use ``reactor``."""
    _socket, factory_class, _endpoint, _type = _classes()
    factory = factory_class()
    factory.reactor = reactor
    return factory


class ZmqSocket:
    """One ZeroMQ socket (ROUTER, DEALER, REQ...) bound or connected on the reactor.

    Args:
        factory: From `zmq_factory`.
        kind: ``zmq.ROUTER`` and so on.
        on_message: Called with each whole multipart message.
        on_drained: Called once after each reactor wake-up that read
            messages, when they have all been given to ``on_message``.
    """

    def __init__(
        self,
        factory: Any,
        kind: int,
        on_message: Callable[[list[bytes]], None],
        on_drained: Callable[[], None] | None = None,
    ) -> None:
        socket_class, _factory, _endpoint, _type = _classes()
        self._connection = socket_class(factory, kind, on_message, on_drained)

    def bind(self, address: str) -> str:
        """Bind (``tcp://127.0.0.1:*`` picks a port); return the endpoint bound."""
        import zmq

        self._connection.socket.bind(address)
        endpoint: bytes = self._connection.socket.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode("ascii")

    def set_option(self, option: int, value: int | bytes) -> None:
        """Set a socket option (``zmq.ROUTER_MANDATORY``, CURVE keys and so on)."""
        self._connection.socket.setsockopt(option, value)

    def connect(self, address: str) -> None:
        """Connect to an endpoint."""
        self._connection.socket.connect(address)

    def send(self, frames: list[bytes]) -> bool:
        """Send one multipart message; False when ZeroMQ could not take it now."""
        import zmq

        try:
            self._connection.send(frames)
        except zmq.ZMQError:  # zmq.Again too
            return False
        return True

    def send_many(self, messages: Sequence[list[bytes]]) -> list[int]:
        """Send several multipart messages in one go; the positions ZeroMQ did not take.

        A message ZeroMQ refuses (its peer gone, its queue full) does not stop
        the ones after it: each has its own answer.
        """
        failed: list[int] = self._connection.send_many(messages)
        return failed

    def send_routed(self, messages: Sequence[list[bytes]]) -> tuple[list[int], list[int]]:
        """Send several messages of a ROUTER (identity frame first); the positions refused.

        Returns:
            The positions ZeroMQ did not take because their peer's queue is
            full (``EAGAIN``), and those whose peer is gone (``EHOSTUNREACH``:
            ZeroMQ has no connection with that identity any more), each in
            order. Once a peer refused one, its later ones are refused
            alike without being tried, so that what it gets keeps its order.
        """
        refused: tuple[list[int], list[int]] = self._connection.send_routed(messages)
        return refused

    def send_in_order(self, messages: Iterable[list[bytes]]) -> tuple[int, bool]:
        """Send one peer's messages, in order, until ZeroMQ refuses one.

        Returns:
            How many it took, and whether the refusal (if any) was because
            the peer is gone rather than its queue full.
        """
        result: tuple[int, bool] = self._connection.send_in_order(messages)
        return result

    def pause_reading(self) -> None:
        """Read nothing until `resume_reading`: the peers' own queues fill and they wait."""
        self._connection.pause_reading()

    def resume_reading(self) -> None:
        """Read again, starting with what waited meanwhile (on the next reactor turn)."""
        self._connection.resume_reading()

    @property
    def reading_paused(self) -> bool:
        """Whether reading is paused."""
        paused: bool = self._connection.reading_paused
        return paused

    def track_user_id(self) -> None:
        """Read each message's ZAP User-Id (`user_id`); a little slower, for control sockets."""
        self._connection.track_user_id = True

    @property
    def user_id(self) -> str | None:
        """The ZAP User-Id of the message being handled, if the ZAP handler gave one."""
        user_id: str | None = self._connection.user_id
        return user_id

    def track_peer_address(self) -> None:
        """Read each message's Peer-Address (`peer_address`): where refused logins count."""
        self._connection.track_peer_address = True

    @property
    def peer_address(self) -> str | None:
        """The address of the peer that sent the message being handled (TCP: its IP)."""
        address: str | None = self._connection.peer_address
        return address

    def track_connection(self) -> None:
        """Read each message's connection number (`connection`), as the ZAP handler gave it."""
        self._connection.track_connection = True

    @property
    def connection(self) -> str | None:
        """The connection the message being handled came on (`track_connection`), if known.

        ZeroMQ gives a routing id to one connection at a time: a message
        under a known routing id from another connection means the one it
        named before is gone.
        """
        connection: str | None = self._connection.connection
        return connection

    def source_fd(self) -> int | None:
        """The file descriptor of the connection the message being handled came on.

        What `watch` reports a closed connection by (``DISCONNECTED``);
        known with `track_connection` only.
        """
        import zmq

        frame = self._connection.last_frame
        if frame is None:
            return None
        try:
            fd: int = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return None
        return fd

    def read_first(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` before each read burst (to take in events that came before it)."""
        self._connection.before_read = callback

    def watch(self, events: int, on_event: Callable[[int, int], None]) -> ZmqSocket:
        """Report this socket's ZeroMQ ``events`` (``zmq.EVENT_*``): ``on_event(event, value)``.

        libzmq's socket monitor, read on the reactor: a ``PAIR`` socket on
        the same context, returned (its `read_now` takes in what waits).
        The value is the file descriptor for connection events, the error
        for failed handshakes.
        """
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        def on_message(frames: list[bytes]) -> None:
            event = parse_monitor_message(frames)
            on_event(int(event["event"]), int(event["value"]))

        address = f"inproc://msggateway.monitor.{next(_MONITORS)}"
        self._connection.socket.monitor(address, events)
        monitor = ZmqSocket(self._connection.factory, zmq.PAIR, on_message)
        monitor.connect(address)
        # ZeroMQ's descriptor signals a change of state once: read after the connect,
        # or what it changed (and every event after) goes unnoticed.
        monitor.read_soon()
        return monitor

    def read_soon(self) -> None:
        """Read on the next reactor turn (after a change ZeroMQ's descriptor may not signal)."""
        self._connection._read_soon()

    def read_now(self) -> None:
        """Read what waits now, as a reactor wake-up would (a monitor's events, say).

        ZeroMQ is asked first whether anything waits: a read that finds
        nothing raises pyzmq's ``Again``, which costs three times the asking,
        and this runs before every read burst of a listener's sockets.
        """
        self._connection.read_waiting()

    def close(self) -> None:
        """Close the socket."""
        self._connection.shutdown()
