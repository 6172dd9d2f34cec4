"""What ZeroMQ refused for congested MTL data peers, and the reading they hold.

DESIGN.md, "Back-pressure before loss", for the MTL listener's data socket:
ZeroMQ queues at most SNDHWM commands for a peer and then refuses them
(``EAGAIN`` with ROUTER_MANDATORY). A peer with a refused command is
*congested*: the command, and every later one for that peer, waits in its
`Backlog`, in order; `Backlogs` offers each congested peer's backlog to
ZeroMQ again every `HELD_RETRY_SECONDS` (ZeroMQ says nothing when a queue
has room again) and, while any peer is congested, holds the socket's
reading: every writer shares that socket, so the writers' own ZeroMQ queues
fill and their sends wait, and nothing grows here but what was already
read. A route's copy waiting in a backlog is answered when ZeroMQ takes it.

A congested peer ZeroMQ takes nothing more for during
``slow_consumer_seconds``, or whose backlog passes ``max_backlog_bytes``,
is cut (the listener forgets it); one ZeroMQ has no connection with any
more is gone. Either way its backlog's waiting outcomes become retry later
and its hold on reading ends.

Nothing here is per message but the backlog's entries: one timer for the
socket while anything is held, one hold per congested peer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Generic, TypeAlias, TypeVar

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from gateway.core.flow import Congestion, FlowPolicy, Throttle
from gateway.core.message import Outcome
from gateway.protocols.mtl.mapping import PendingBatch

__all__ = ["HELD_RETRY_SECONDS", "Backlog", "Backlogs"]

HELD_RETRY_SECONDS: Final = 0.02
"""How often congested peers are offered what they hold, while anything is held.

A fraction of what a queue of ``max_backlog_messages`` takes to drain at any
useful rate; it costs a few sends per congested peer, never one per message.
"""

_ACCEPTED: Final = Outcome.accepted()

_Held: TypeAlias = tuple[list[bytes], PendingBatch | None, int]
"""A refused command: its frames, and the batch and index of the message accepted once
ZeroMQ takes it (a route's copy for a reader without confirmations), if any."""

K = TypeVar("K")


class Backlog:
    """One data peer's commands ZeroMQ refused, in order, and its congestion.

    Attributes:
        bytes: The frames' bytes held.
        progress_at: When ZeroMQ last took some of it (or it began).
        congestion: The peer as a consumer: its hold on the socket's reading.
    """

    __slots__ = ("_held", "bytes", "congestion", "progress_at")

    def __init__(self) -> None:
        self._held: deque[_Held] = deque()
        self.bytes = 0
        self.progress_at = 0.0
        self.congestion = Congestion()

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def frames(self) -> Iterator[list[bytes]]:
        """The held commands, oldest first."""
        return (frames for frames, _batch, _index in self._held)

    def append(self, frames: list[bytes], batch: PendingBatch | None, index: int) -> None:
        """Hold one more command (``batch``, ``index``: accepted once ZeroMQ takes it)."""
        self._held.append((frames, batch, index))
        self.bytes += sum(map(len, frames))

    def taken(self, count: int) -> None:
        """ZeroMQ took the oldest ``count``: what waited on them is accepted."""
        held = self._held
        size = 0
        for _ in range(count):
            frames, batch, index = held.popleft()
            size += sum(map(len, frames))
            if batch is not None:
                batch.settle(index, _ACCEPTED)
        self.bytes -= size

    def give_back(self, outcome: Outcome) -> None:
        """Drop everything held; what waited on it gets ``outcome``."""
        held, self._held = self._held, deque()
        self.bytes = 0
        for _frames, batch, index in held:
            if batch is not None:
                batch.settle(index, outcome)


class Backlogs(Generic[K]):
    """A data socket's congested peers, offered what they hold until they took it all.

    Args:
        clock: For the retry timer.
        flow: The listener's policy now (it may be replaced on reload).
        pause: Stops reading the socket (the first congested peer).
        resume: Reads it again (no hold left).
        send_in_order: Sends one peer's commands until ZeroMQ refuses one:
            how many it took, and whether the peer is gone.
        gone: Called with a peer ZeroMQ has no connection with any more.
        cut: Called with a peer given up on, and why (stuck, or past the cap).

    Attributes:
        reading: The socket's reading as a producer: held by every congested
            peer, and by whatever else the owner makes hold it.
        deaf_seconds: Seconds the socket was not read, up to the present
            pause if any (`listened` counts that one too).
    """

    def __init__(
        self,
        clock: IReactorTime,
        flow: Callable[[], FlowPolicy],
        pause: Callable[[], None],
        resume: Callable[[], None],
        send_in_order: Callable[[Iterable[list[bytes]]], tuple[int, bool]],
        gone: Callable[[K], None],
        cut: Callable[[K, str], None],
    ) -> None:
        self._clock = clock
        self._flow = flow
        self._pause = pause
        self._resume = resume
        self._send_in_order = send_in_order
        self._gone = gone
        self._cut = cut
        self.reading = Throttle(self._paused, self._resumed)
        self._congested: dict[K, Backlog] = {}
        self._call: IDelayedCall | None = None
        self.deaf_seconds = 0.0
        self._deaf_since: float | None = None

    @property
    def deaf(self) -> bool:
        """Whether the socket is not being read now."""
        return self._deaf_since is not None

    def listened(self, now: float) -> float:
        """The time the socket was read until ``now``: silence while it was not is not a peer's."""
        deaf = self.deaf_seconds
        if self._deaf_since is not None:
            deaf += now - self._deaf_since
        return now - deaf

    def hold(
        self,
        peer: K,
        backlog: Backlog,
        frames: list[bytes],
        batch: PendingBatch | None = None,
        index: int = 0,
    ) -> None:
        """Hold a command ZeroMQ refused for ``peer`` (or one for a peer already congested).

        The first makes the peer congested: it holds the socket's reading
        until its backlog is taken.
        """
        if not backlog:
            backlog.progress_at = self._clock.seconds()
            self._congested[peer] = backlog
            congestion = backlog.congestion
            congestion.begin()
            congestion.hold(self.reading)
            if self._call is None:
                self._call = self._clock.callLater(HELD_RETRY_SECONDS, self._retry)
        backlog.append(frames, batch, index)

    def check(self, peer: K, backlog: Backlog) -> None:
        """Cut ``peer`` if its backlog passed ``max_backlog_bytes`` (the hard cap)."""
        limit = self._flow().max_backlog_bytes
        if limit and backlog.bytes > limit and peer in self._congested:
            self._cut(
                peer,
                f"{backlog.bytes} bytes wait for it past its ZeroMQ queue"
                f" (max_backlog_bytes {limit})",
            )

    def forget(self, peer: K, backlog: Backlog, outcome: Outcome) -> None:
        """``peer`` is gone or cut: its backlog's waiting outcomes become ``outcome``."""
        backlog.give_back(outcome)
        self._congested.pop(peer, None)
        backlog.congestion.gone()  # reading resumes if nothing else holds it

    def stop(self) -> None:
        """Offer nothing more (the socket is closing)."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()

    def _retry(self) -> None:
        """Offer each congested peer its backlog; release the drained, cut the stuck."""
        self._call = None
        now = self._clock.seconds()
        seconds = self._flow().slow_consumer_seconds
        for peer, backlog in list(self._congested.items()):
            if self._congested.get(peer) is not backlog:
                continue  # forgotten meanwhile
            taken, gone = self._send_in_order(backlog.frames())
            if taken:
                backlog.progress_at = now
                backlog.taken(taken)
            if gone:
                self._gone(peer)
            elif not backlog:
                del self._congested[peer]
                backlog.congestion.drained()
            elif seconds > 0 and now - backlog.progress_at >= seconds:
                self._cut(
                    peer,
                    f"ZeroMQ took nothing more for it for {seconds:g} s"
                    f" (slow_consumer_seconds; {len(backlog)} commands waiting)",
                )
        if self._congested and self._call is None:
            self._call = self._clock.callLater(HELD_RETRY_SECONDS, self._retry)

    def _paused(self) -> None:
        if self._deaf_since is None:
            self._deaf_since = self._clock.seconds()
        self._pause()

    def _resumed(self) -> None:
        if self._deaf_since is not None:
            self.deaf_seconds += self._clock.seconds() - self._deaf_since
            self._deaf_since = None
        self._resume()
