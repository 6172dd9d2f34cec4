"""ZeroMQ sockets on the gateway's reactor, through txzmq.

txzmq imports the global reactor when it is imported, and its ``send``
schedules reads on that global reactor. So it is imported only when a
socket is made (twistd has chosen the reactor by then), and the socket
classes here send and schedule on the reactor they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["ZmqSocket", "zmq_factory"]


@cache
def _classes() -> tuple[Any, Any, Any, Any]:
    import zmq
    from txzmq import ZmqEndpoint, ZmqEndpointType, ZmqFactory
    from txzmq.connection import ZmqConnection

    class _Socket(ZmqConnection):  # type: ignore[misc]
        """A txzmq connection whose reads are scheduled on its factory's reactor."""

        def __init__(self, factory: Any, kind: int, on_message: Callable[[list[bytes]], None]):
            self.socketType = kind
            self._on_message = on_message
            super().__init__(factory)

        def send(self, message: list[bytes]) -> None:
            for part in message[:-1]:
                self.socket.send(part, zmq.NOBLOCK | zmq.SNDMORE)
            self.socket.send(message[-1], zmq.NOBLOCK)
            if getattr(self, "read_scheduled", None) is None:
                self.read_scheduled = self.factory.reactor.callLater(0, self.doRead)

        def messageReceived(self, message: list[bytes]) -> None:  # noqa: N802 (txzmq's name)
            self._on_message(list(message))

        track_user_id = False
        user_id: str | None = None

        def _readMultipart(self) -> list[bytes]:  # noqa: N802 (txzmq's name)
            if not self.track_user_id:
                whole: list[bytes] = super()._readMultipart()
                return whole
            # Frames, not bytes, so that the ZAP User-Id of the message can be read.
            parts: list[bytes] = getattr(self, "recv_parts")  # noqa: B009 (kept across EAGAIN)
            while True:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
                parts.append(frame.bytes)
                if not self.socket.get(zmq.RCVMORE):
                    try:
                        self.user_id = frame.get("User-Id") or None
                    except zmq.ZMQError:  # no ZAP handler: no such property
                        self.user_id = None
                    setattr(self, "recv_parts", [])  # noqa: B010 (txzmq's untyped attribute)
                    return list(parts)

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
    """

    def __init__(self, factory: Any, kind: int, on_message: Callable[[list[bytes]], None]):
        socket_class, _factory, _endpoint, _type = _classes()
        self._connection = socket_class(factory, kind, on_message)

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
        except zmq.Again:
            return False
        except zmq.ZMQError:
            return False
        return True

    def track_user_id(self) -> None:
        """Read each message's ZAP User-Id (`user_id`); a little slower, for control sockets."""
        self._connection.track_user_id = True

    @property
    def user_id(self) -> str | None:
        """The ZAP User-Id of the message being handled, if the ZAP handler gave one."""
        user_id: str | None = self._connection.user_id
        return user_id

    def close(self) -> None:
        """Close the socket."""
        self._connection.shutdown()
