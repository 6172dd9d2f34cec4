"""Commands sent together: what one read burst or reactor turn produced, in one go.

An `Outbox` gathers the commands of a burst (its answers, or the answers a
batch's outcomes give) and hands them to a socket's ``send_many`` together
at the end of the burst or on the next reactor turn: ZeroMQ then wakes its
I/O thread once for them instead of once per message
(`gateway.protocols.mtl.zmq`).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

__all__ = ["Outbox"]


class Outbox:
    """Multipart messages waiting to be sent together.

    They go out when the read burst that made them is drained (`flush`), or,
    for those made outside a burst (outcomes arriving, timers), on the next
    reactor turn. Something sent at once on the same socket calls `flush`
    first, so that the order of a peer's commands is kept.

    Args:
        clock: For the next reactor turn.
        send_many: Sends a list of multipart messages.

    Attributes:
        reading: Set while a read burst is handled: its end flushes.
    """

    __slots__ = ("_call", "_clock", "_latest", "_messages", "_send_many", "reading")

    def __init__(
        self, clock: IReactorTime, send_many: Callable[[list[list[bytes]]], object]
    ) -> None:
        self._clock = clock
        self._send_many = send_many
        self._messages: list[list[bytes]] = []
        self._call: IDelayedCall | None = None
        self._latest: dict[bytes, int] = {}
        """Where a peer's waiting message that a later one may replace is (`add_latest`)."""
        self.reading = False

    def add(self, frames: list[bytes]) -> None:
        """Send one multipart message with the others of this burst or reactor turn."""
        if self._latest:
            self._latest.pop(frames[0], None)  # it is no longer the peer's last
        self._messages.append(frames)
        if self._call is None and not self.reading:
            self._call = self._clock.callLater(0, self.flush)

    def add_latest(self, frames: list[bytes]) -> None:
        """`add` a ROUTER's message (identity first) that makes its peer's previous one needless.

        If the last message waiting for that peer was added this way too, it
        is replaced by this one, in its place (nothing for that peer comes
        between): a Confirm with ``multiple`` that covers everything the one
        before it covered, and more.
        """
        latest = self._latest
        identity = frames[0]
        position = latest.get(identity)
        if position is not None:
            self._messages[position] = frames
            return
        self.add(frames)
        latest[identity] = len(self._messages) - 1

    def flush(self) -> None:
        """Send everything waiting now (what ZeroMQ refuses is dropped, as a lone send's is)."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()
        messages = self._messages
        if messages:
            self._messages = []
            self._latest = {}
            self._send_many(messages)

    def clear(self) -> None:
        """Drop everything waiting (the socket is going away, perhaps mid-burst)."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()
        self._messages = []
        self._latest = {}
        self.reading = False
