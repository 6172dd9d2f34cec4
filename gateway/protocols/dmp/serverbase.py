"""What the DMP listener's parts share: the connection's state, closing, timers.

`gateway.protocols.dmp.server.DMPServerProtocol` is put together from the
handshake (`gateway.protocols.dmp.serverlease`: the protocol header, the
lease and the answer to it) and the connection's life, reading and data
path, which `gateway.protocols.dmp.server` keeps. Each is a
`DMPServerBase`: the connection state they share is declared here (the
protocol sets it up), with what both call: `_close_with` (which frees the
connection's feed first, `_leave_feed`) and `_schedule`. No call goes
through here that did not before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from gateway.codecs import dmp
from gateway.core.inbox import Inbox
from gateway.core.message import Message
from gateway.protocols.dmp.principal import PrincipalConnection
from gateway.protocols.dmp.sinks import SinkOutcomes
from gateway.protocols.listener import ListenerConnection

if TYPE_CHECKING:
    from gateway.protocols.dmp.server import DMPServerFactory

__all__ = ["DMPServerBase"]


class DMPServerBase(ListenerConnection["DMPServerFactory"]):
    """What every part of a DMP listener's connection uses (`DMPServerProtocol`)."""

    factory: DMPServerFactory
    kind: str | None
    identity: str | None
    target: str
    _timer: IDelayedCall | None
    _outcomes: SinkOutcomes
    _prefix: bytes | None
    _principal: PrincipalConnection | None
    _inbox: Inbox[Message]
    _login_wait: IDelayedCall | None
    _held: list[dmp.Event]
    _suspended: Deferred[Any] | None
    _claiming: str | None

    # --- closing ---------------------------------------------------------------------------

    def _leave_feed(self) -> None:
        factory = self.factory
        claiming, self._claiming = self._claiming, None
        if claiming is not None:
            if factory.claiming.get(claiming) is self:
                del factory.claiming[claiming]
            waiting, self._suspended = self._suspended, None
            if waiting is not None:
                waiting.cancel()  # the claim is given up
        if self.kind == "feed" and factory.readers.get(self.target) is self:
            del factory.readers[self.target]
            if factory.fleet is not None:
                factory.fleet.release(self.target)

    def _close_with(
        self, why: str, response: dmp.Response | None = None, *, abort: bool = False
    ) -> None:
        """Say why in the log (and to the peer, if there is a response), then close or abort."""
        if self._closing:
            return
        self._leave_feed()  # free for the next reader at once
        if response is not None:
            self._write(dmp.encode_response(response))
        self._log.info(
            "{listener}: {action} a DMP connection: {why}",
            listener=self.factory.name,
            action="aborting" if abort else "closing",
            why=why,
        )
        if abort:
            self._abort()
        else:
            self._close()

    # --- helpers -------------------------------------------------------------------------

    def _schedule(self, seconds: float, call: Callable[[], None]) -> None:
        if seconds > 0:
            self._timer = self._call_later(seconds, call)
