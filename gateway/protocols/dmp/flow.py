"""Flow control shared by both DMP roles: held writes and reading paused by in-flight messages."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["HeldWrites", "InFlight"]


class HeldWrites:
    """Writes that wait, in order, while the peer is not reading.

    The connection registers itself as a streaming producer of its
    transport; `pause` and `resume` follow the transport's pauseProducing
    and resumeProducing. What is held is written in one piece on resume.

    Attributes:
        held_bytes: Bytes waiting now (the adapters refuse more past a limit).
    """

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self.paused = False
        self._held: list[bytes] = []
        self.held_bytes = 0

    def write(self, data: bytes) -> None:
        """Write now, or hold while paused."""
        if self.paused:
            self._held.append(data)
            self.held_bytes += len(data)
        else:
            self._write(data)

    def pause(self) -> None:
        """The peer stopped reading."""
        self.paused = True

    def resume(self) -> None:
        """The peer reads again: write what waited."""
        self.paused = False
        if self._held:
            data = b"".join(self._held)
            self._held, self.held_bytes = [], 0
            self._write(data)


class InFlight:
    """Messages read and awaiting their outcome; reading pauses at a limit, resumes at half.

    Args:
        limit: Messages in flight at which reading pauses.
        pause: Stops reading from the peer.
        resume: Reads from the peer again.
    """

    def __init__(self, limit: int, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._limit = limit
        self._pause = pause
        self._resume = resume
        self.count = 0
        self._paused = False

    def add(self) -> None:
        """One more message awaits its outcome."""
        self.count += 1
        if self.count >= self._limit and not self._paused:
            self._paused = True
            self._pause()

    def done(self, _result: object = None) -> None:
        """One message has its outcome (usable as a Deferred callback)."""
        self.count -= 1
        if self._paused and self.count <= self._limit // 2:
            self._paused = False
            self._resume()
