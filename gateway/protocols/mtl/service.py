"""The MTL listener as the service tree sees it: an endpoint that binds ZeroMQ sockets.

`gateway.service.ListenerService` listens on an endpoint and reports the
address it got; `MTLEndpoint` lets an `MTLServer` be listened on the same
way, so the gateway's ready line, /healthz and the tests treat MTL
listeners like every other.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, succeed

from gateway.protocols.mtl.server import MTLServer

__all__ = ["MTLEndpoint"]


class _BoundSockets:
    """What `MTLEndpoint.listen` returns: the control address, and a way to stop."""

    def __init__(self, server: MTLServer) -> None:
        self._server = server

    def getHost(self) -> IPv4Address:  # noqa: N802 (IListeningPort's name)
        """The control socket's address."""
        return IPv4Address("TCP", self._server.host, self._server.port)

    def stopListening(self) -> Deferred[None]:  # noqa: N802 (IListeningPort's name)
        """Close both sockets."""
        self._server.stop()
        return succeed(None)


class MTLEndpoint:
    """Binds an `MTLServer`'s sockets when listened on."""

    def __init__(self, server: MTLServer) -> None:
        self.server = server

    def listen(self, factory: Any) -> Deferred[_BoundSockets]:
        """Bind the control and data sockets."""
        try:
            self.server.start()
        except Exception as exc:  # ZMQError: address in use, bad interface
            return fail(exc)
        return succeed(_BoundSockets(self.server))
