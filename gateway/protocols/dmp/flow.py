"""Flow control shared by both DMP roles: held writes, batches written at once, reading paused.

`HeldWrites` keeps what is written while the peer does not read;
`write_envelopes` turns a batch of messages into envelopes, answers each
one, and writes all that it takes in one piece; `InFlight` pauses reading
while too many messages read await their outcome; `LogTally` keeps a fact
that may recur per message (a message not delivered, one refused for a
slow reader) to one log line in a while.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from twisted.internet.interfaces import IReactorTime

from gateway.codecs import dmp
from gateway.core.message import Message, Outcome
from gateway.protocols.dmp.mapping import encode_message

__all__ = [
    "LOG_EVERY_SECONDS",
    "HeldWrites",
    "InFlight",
    "LogTally",
    "encode_envelopes",
    "write_envelopes",
]

LOG_EVERY_SECONDS: Final = 10.0
"""A fact that recurs per message is logged at most once in this long (issue 18: a
slow feed reader made a warning of every message a sink writer sent, a million lines)."""

_ACCEPTED = Outcome.accepted()


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


def encode_envelopes(
    messages: Sequence[Message],
    exchange: str,
    cannot_carry: Callable[[str], Outcome],
    held: int | None = None,
    max_held_bytes: int = 0,
    behind: Callable[[int], Outcome] | None = None,
) -> tuple[list[Outcome], list[bytes]]:
    """Encode a batch's envelopes and answer each message as written.

    Args:
        messages: The batch.
        exchange: The envelopes' exchange (`encode_message`).
        cannot_carry: The outcome of a message DMP cannot carry, given why.
        held: Bytes held for a peer that does not read, counting what this
            batch adds (None: nothing is held back, no limit applies).
        max_held_bytes: With ``held``: a message that finds more than this
            held is refused with ``behind(held)`` and not encoded.
        behind: The outcome of a message refused for the backlog.

    Returns:
        One outcome per message, in order (accepted: encoded), and the
        encoded envelopes.
    """
    outcomes = [_ACCEPTED] * len(messages)
    parts: list[bytes] = []
    for index, message in enumerate(messages):
        if held is not None and held > max_held_bytes:
            assert behind is not None
            outcomes[index] = behind(held)
            continue
        try:
            data = encode_message(message, exchange)
        except dmp.DMPLocalError as exc:
            outcomes[index] = cannot_carry(exc.reason)
            continue
        parts.append(data)
        if held is not None:
            held += len(data)
    return outcomes, parts


def write_envelopes(
    writes: HeldWrites,
    messages: Sequence[Message],
    exchange: str,
    max_held_bytes: int,
    behind: Callable[[int], Outcome],
    cannot_carry: Callable[[str], Outcome],
) -> tuple[list[Outcome], int]:
    """Write a batch's envelopes in one piece and answer each message.

    Each message is taken as if it were written alone: while the peer does
    not read, what this batch adds counts towards ``max_held_bytes``, and a
    message that finds more than that held is refused with ``behind(held)``
    (retry later); one that DMP cannot carry gets ``cannot_carry(reason)``.
    Written means accepted: DMP has no acknowledgement.

    Args:
        writes: The connection's writes.
        messages: The batch.
        exchange: The envelopes' exchange (`encode_message`).
        max_held_bytes: Bytes held for a slow peer past which more are refused.
        behind: The outcome of a message refused for the backlog.
        cannot_carry: The outcome of a message DMP cannot carry, given why.

    Returns:
        One outcome per message, in order, and how many were written.
    """
    outcomes, parts = encode_envelopes(
        messages,
        exchange,
        cannot_carry,
        writes.held_bytes if writes.paused else None,
        max_held_bytes,
        behind,
    )
    if parts:
        writes.write(b"".join(parts) if len(parts) > 1 else parts[0])
    return outcomes, len(parts)


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

    def track(self, count: int, dispatch: Callable[[], None]) -> None:
        """Count ``count`` messages in flight while ``dispatch`` hands them on.

        Reading pauses when, after the dispatch, the limit is reached: the
        outcomes that came at once (a destination that answers at once)
        never stop and restart reading.
        """
        self.count += count
        dispatch()
        if self.count >= self._limit and not self._paused:
            self._paused = True
            self._pause()

    def done(self, count: int = 1) -> None:
        """``count`` messages have their outcomes."""
        self.count -= count
        if self._paused and self.count <= self._limit // 2:
            self._paused = False
            self._resume()


class LogTally:
    """Counts one recurring fact and says when it is time to log it again.

    The first occurrence is logged at once; later ones are counted, and the
    next occurrence at least ``seconds`` after the last line logs them all.
    What was counted and never logged is left in `count` (for a last line
    when the connection ends). Metrics count every occurrence; this is only
    the log.

    Args:
        clock: Time.
        seconds: The least time between two lines.
    """

    __slots__ = ("_clock", "_next", "_seconds", "count")

    def __init__(self, clock: IReactorTime, seconds: float = LOG_EVERY_SECONDS) -> None:
        self._clock = clock
        self._seconds = seconds
        self._next: float | None = None
        self.count = 0

    def add(self, count: int = 1) -> int:
        """Count ``count`` occurrences; return how many to log now (0: not yet)."""
        self.count += count
        now = self._clock.seconds()
        if self._next is not None and now < self._next:
            return 0
        self._next = now + self._seconds
        due, self.count = self.count, 0
        return due
