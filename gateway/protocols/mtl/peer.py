"""What an MTL listener and an MTL upstream share (DESIGN.md, "One lifecycle per role").

Both ends of MTL hold a pair of ZeroMQ sockets on a reactor, route what they
read and send what they are given; `MTLPeer` keeps what that takes in
common: the name, settings and address, the router and secrets, the clock
and reactor, the traffic and error counters, and the data socket's output
(an `Outbox` sends what a read burst produced in one go). `MTLServer` and
`MTLUpstream` hold their own sockets' protocol.

What the data socket does not take (the peer's queue is at its high-water
mark because the peer does not read, or the peer is gone) and is not kept
to be sent later is counted as ``not-sent`` and in `MTLPeer.not_sent`: a
routed Content is answered by its caller, anything else is dropped, as
ZeroMQ would drop it. The listener keeps what its congested readers' queues
refuse instead (`MTLServer`, "Slow readers"); the upstream has one peer,
the server, and answers retry later.
"""

from __future__ import annotations

from typing import Any, Generic, NotRequired, TypedDict, TypeVar, Unpack

from twisted.internet.interfaces import IReactorTime

from gateway.core.auth import Secrets
from gateway.core.message import Outcome
from gateway.core.router import Router
from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.mtl.mapping import Copy, PendingBatch
from gateway.protocols.mtl.outbox import Outbox

__all__ = ["MTLPeer", "MTLPeerArgs"]

S = TypeVar("S")


class MTLPeerArgs(TypedDict, Generic[S]):
    """What an MTL listener or upstream is built with (see `MTLPeer`)."""

    name: str
    settings: S
    host: str
    port: int
    router: Router
    secrets: Secrets
    clock: IReactorTime
    reactor: Any
    metrics: NotRequired[GatewayMetrics | None]


class MTLPeer(Generic[S]):
    """One end of MTL: a listener's two bound sockets, or an upstream's two connected ones.

    Args:
        name: The listener's or upstream's name.
        settings: Its validated settings.
        host: Where its sockets bind or connect.
        port: Its control port (0 for a listener: the OS picks).
        router: Where content read from peers goes.
        secrets: For PLAIN and SCRAM.
        clock: Timers.
        reactor: The sockets' reactor.
        metrics: Counters, or None.
    """

    def __init__(self, **args: Unpack[MTLPeerArgs[S]]) -> None:
        self.name = args["name"]
        self.settings: S = args["settings"]
        self.host = args["host"]
        self.port = args["port"]
        self.router = args["router"]
        self.secrets = args["secrets"]
        self.clock = clock = args["clock"]
        self._reactor = args["reactor"]
        self._metrics = metrics = args.get("metrics")
        self.traffic = metrics.traffic(self.name) if metrics is not None else TrafficCounters()
        self._zmq: Any = None
        self._control: Any = None
        self._data: Any = None
        self._outbox = Outbox(clock, self._send_out)
        self.not_sent = 0
        """Commands the data socket did not take since the owner last reset this."""

    def _send_batch(
        self,
        batch: PendingBatch,
        frames: list[list[bytes]],
        copies: list[Copy],
        not_reading: Outcome,
    ) -> None:
        """Send a routed batch's Contents at once, after what was queued before them.

        What ZeroMQ does not take answers ``not_reading``; the rest wait for
        their confirmations (`PendingBatch.sent`).
        """
        if not frames:
            return
        self.traffic.messages_out += len(frames)
        self._outbox.flush()  # what the peer was told before goes first
        failed = self._data.send_many(frames)
        if failed:
            self._count_not_sent(len(failed))
        batch.sent(copies, failed, not_reading)

    def _send_out(self, messages: list[list[bytes]]) -> None:
        """Send what the outbox gathered on the data socket, if it is open."""
        if self._data is not None:
            failed = self._data.send_many(messages)
            if failed:
                self._count_not_sent(len(failed))

    def _count_not_sent(self, count: int) -> None:
        self.not_sent += count
        self.count_error("not-sent", count)

    def count_error(self, kind: str, count: int = 1) -> None:
        """Count ``count`` protocol errors (or refused or dropped commands) of some kind."""
        if self._metrics is not None:
            self._metrics.protocol_errors.labels(self.name, kind).inc(count)
