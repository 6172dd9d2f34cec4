"""One QMQP streaming session on a blocking socket: the one blocking QMQP client.

`QMQPSender` drives one connection (../shared/specs/qmqp-streaming.txt,
"QMQP Streaming Session Overview") on the gateway's own codec
(`gateway.codecs.qmqp`, client role): an optional A block first, then
message blocks while fewer than ``window`` are unanswered, replies read as
they come (in any order), then the done block, the server's done block and
its close. It returns a `Summary`; it never writes to a stream itself, and
reports progress through a callback. The socket is non-blocking and driven
with `selectors`, so one thread reads replies while it writes blocks, over
TCP or TLS. ``msggateway qmqp send`` and the Spark send job
(`gateway.spark.jobs`) use it; the gateway's upstreams use the Twisted
client (`gateway.protocols.qmqp.client`) on the same codec.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, cast

from gateway.cli.output import printable
from gateway.cli.qmqp.mail import Item, LocalFailure
from gateway.codecs import qmqp

__all__ = [
    "BATCH_BYTES",
    "DEFAULT_TIMEOUT_SECONDS",
    "DEFAULT_WINDOW",
    "OUTCOMES",
    "READ_BYTES",
    "Progress",
    "QMQPAuthRefusedError",
    "QMQPSendError",
    "QMQPSender",
    "Summary",
]

DEFAULT_WINDOW: Final = 100
"""Messages sent and not yet answered, at most, by default."""

DEFAULT_TIMEOUT_SECONDS: Final = 60.0
"""How long to wait without any progress (bytes in or out) before giving up."""

READ_BYTES: Final = 65536
"""Bytes asked of one ``recv``."""

BATCH_BYTES: Final = 256 * 1024
"""Blocks queued for writing at once stop past this many bytes (one message may pass it).

It bounds the output buffer while keeping system calls few; replies are read
between batches and while one is written.
"""

OUTCOMES: Final = {"K": "accepted", "Z": "retry", "D": "rejected", "error": "error"}
"""A reply's status (or ``error``: no reply) as the outcome every command prints."""


class QMQPSendError(Exception):
    """The session could not start: no answer to the authentication, or a broken connection."""


class QMQPAuthRefusedError(QMQPSendError):
    """The server refused the username and password."""


def _why(exc: OSError) -> str:
    """An OS error in a few words."""
    return exc.strerror or str(exc)


# --- results -----------------------------------------------------------------------


class Summary:
    """What happened to every message of a session.

    Attributes:
        counts: Replies by status: ``K``, ``Z`` and ``D``.
        errors: Messages that got no reply: not sendable, or unanswered
            when the session ended.
        failures: ``(kind, id, description)`` for every Z, D and error, in
            order; kind is ``Z``, ``D`` or ``error``.
        warnings: Oddities that lost nothing (a reply for an unknown id, ...).
        stopped: Why the session ended early, or None.
        complete: Whether every item of the input was taken (sent or failed).
        not_sent: Items never taken, when known.
    """

    def __init__(self, on_outcome: Callable[[str, bytes, str], None] | None = None) -> None:
        self._on_outcome = on_outcome
        self.counts: dict[str, int] = {"K": 0, "Z": 0, "D": 0}
        self.errors = 0
        self.failures: list[tuple[str, str, str]] = []
        self.warnings: list[str] = []
        self.stopped: str | None = None
        self.complete = True
        self.not_sent: int | None = 0

    def record(self, reply: qmqp.ReplyBlock) -> None:
        """Count a server reply; keep the Z and D ones."""
        status = reply.status.decode("ascii")
        self.counts[status] += 1
        if self._on_outcome is not None:
            self._on_outcome(status, reply.id, reply.description.decode("utf-8", "replace"))
        if status != "K":
            self.failures.append((status, printable(reply.id), printable(reply.description)))

    def fail(self, ident: bytes, reason: str) -> None:
        """Count a message that got no reply."""
        self.errors += 1
        self.failures.append(("error", printable(ident), reason))
        if self._on_outcome is not None:
            self._on_outcome("error", ident, reason)

    @property
    def answered(self) -> int:
        """Replies received."""
        return sum(self.counts.values())

    @property
    def exit_status(self) -> int:
        """0 when every message of the input got K, else 1."""
        clean = self.counts["Z"] == self.counts["D"] == self.errors == 0
        return 0 if clean and self.complete else 1

    def render(self) -> str:
        """The summary as text: the counts, then one line per Z, D and error."""
        counts = self.counts
        lines = [f"K {counts['K']}, Z {counts['Z']}, D {counts['D']}, errors {self.errors}"]
        for wanted in ("Z", "D", "error"):
            lines.extend(
                f"{kind} {ident}: {text}" for kind, ident, text in self.failures if kind == wanted
            )
        if self.stopped is not None:
            lost = ""
            if not self.complete:
                lost = (
                    "; the rest of the input was not sent"
                    if self.not_sent is None
                    else f"; {self.not_sent} message(s) not sent"
                )
            lines.append(f"stopped: {self.stopped}{lost}")
        lines.extend(f"warning: {warning}" for warning in self.warnings)
        return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """Where a session is.

    Attributes:
        sent: Message blocks queued for the server.
        answered: Replies received.
        failed: Items not sendable so far (no recipient, unreadable).
        elapsed: Seconds since sending started.
        finished: Whether this is the last report.
    """

    sent: int
    answered: int
    failed: int
    elapsed: float
    finished: bool = False


def _unknown_total() -> int | None:
    return None


# --- the session -------------------------------------------------------------------


class QMQPSender:
    """One QMQP streaming session on a connected socket.

    Call `authenticate` (optional) and then `send` once; then `close`.

    The window: a message counts as unanswered from the moment its block is
    queued for writing until its reply is read, and a block is queued only
    while fewer than ``window`` are unanswered; so the server never has more
    than ``window`` messages to answer, and at most ``window`` identifiers,
    one batch of blocks (`BATCH_BYTES`) and one message are held here.

    Args:
        sock: A connected socket, TLS handshake done; the sender makes it
            non-blocking and closes it in `close`.
        window: Most messages sent and not yet answered (at least 1).
        timeout: Seconds to wait without progress (bytes in or out).
        on_progress: Called with a `Progress` as the session goes, and once
            with ``finished=True`` at its end.
        on_outcome: Called with each message's outcome as it is known: the
            reply's status (``K``, ``Z``, ``D``) or ``error``, its id and
            the description (the Spark send job records them).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        window: int = DEFAULT_WINDOW,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        on_progress: Callable[[Progress], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_outcome: Callable[[str, bytes, str], None] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, not {window}")
        self._sock = sock
        self._window = window
        self._timeout = timeout
        self._on_progress = on_progress
        self._clock = clock
        self._codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        self._selector = selectors.DefaultSelector()
        sock.setblocking(False)
        self._registered = 0
        self._deadline = clock() + timeout
        self._out: memoryview | None = None
        self._out_offset = 0
        self._read_needs_write = False  # TLS: a read wants the socket writable
        self._write_needs_read = False  # TLS: a write wants the socket readable
        self._eof = False
        self._write_closed = False
        self._done_sent = False
        self._server_done = False
        self._input_done = False
        self._stopped: str | None = None
        self._auth_reply: qmqp.AuthReplyBlock | None = None
        self._unanswered: set[bytes] = set()
        self._taken = 0  # items taken from the input
        self._sent = 0
        self._not_sendable = 0
        self._summary = Summary(on_outcome)

    def close(self) -> None:
        """Close the connection."""
        self._selector.close()
        self._sock.close()

    def __enter__(self) -> QMQPSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- API ------------------------------------------------------------------

    def authenticate(
        self, username: bytes, password: bytes, *, success_reply: bytes = b"1"
    ) -> None:
        """Send the A block and wait for its answer.

        Args:
            username: The username.
            password: The password.
            success_reply: The answer meaning success: ``1`` as the spec's
                prose says, or ``0`` for servers that follow its example.

        Raises:
            QMQPAuthRefusedError: The server refused.
            QMQPSendError: No answer in time, a bad one, or the connection ended.
        """
        # Spec ambiguity: the prose says 1 is success, the example shows 0;
        # the codec reads 1 as success, and success_reply says which applies.
        self._queue(self._codec.send(qmqp.AuthBlock(username=username, password=password)))
        self._deadline = self._clock() + self._timeout
        while self._auth_reply is None:
            if self._finished():
                raise QMQPSendError(f"no answer to the authentication: {self._stopped}")
            if not self._step():
                raise QMQPSendError(f"no answer to the authentication within {self._timeout:g} s")
        if self._auth_reply.success != (success_reply == b"1"):
            name = username.decode("utf-8", "backslashreplace")
            raise QMQPAuthRefusedError(f"authentication refused for {name}")

    def send(
        self, messages: Iterable[Item], *, total: Callable[[], int | None] = _unknown_total
    ) -> Summary:
        """Stream the messages, then the done block; wait for every reply and the close.

        Args:
            messages: What to send, taken one at a time as the window allows;
                a `LocalFailure` is counted as an error and not sent.
            total: The number of items, when known; it says how many were
                not sent when the session ends early.

        Returns:
            What happened to each message.
        """
        summary = self._summary
        started = self._clock()
        self._deadline = started + self._timeout
        items = iter(messages)
        try:
            while not self._finished():
                if self._out is None and not self._write_closed and not self._done_sent:
                    self._fill(items)
                if self._finished():
                    break
                if not self._step():
                    if self._server_done and self._done_sent:
                        summary.warnings.append("the server did not close after its done block")
                    else:
                        self._stop(f"no progress for {self._timeout:g} s")
                    break
                self._report(started)
        finally:
            if isinstance(items, Generator):
                items.close()
        reason = self._stopped or "the session ended"
        for ident in sorted(self._unanswered):
            summary.fail(ident, f"no reply: {reason}")
        self._unanswered.clear()
        summary.stopped = self._stopped
        if not self._input_done:
            summary.complete = False
            known = total()
            summary.not_sent = None if known is None else max(0, known - self._taken)
        self._report(started, finished=True)
        return summary

    # --- writing --------------------------------------------------------------

    def _fill(self, items: Iterator[Item]) -> None:
        """Queue the next blocks the window allows, then the done block after the last."""
        batch: list[bytes] = []
        size = 0
        while not self._input_done and len(self._unanswered) < self._window and size < BATCH_BYTES:
            item = next(items, None)
            if item is None:
                self._input_done = True
                break
            self._taken += 1
            if isinstance(item, LocalFailure):
                self._not_sendable += 1
                self._summary.fail(item.id, item.reason)
            elif item.id in self._unanswered:
                self._not_sendable += 1
                self._summary.fail(item.id, "not sent: its id is already awaiting a reply")
            else:
                wire = self._codec.send(item.block())
                self._unanswered.add(item.id)
                self._sent += 1
                batch.append(wire)
                size += len(wire)
        if self._input_done:
            batch.append(self._codec.send(qmqp.DONE))
            self._done_sent = True
        if batch:
            self._queue(batch[0] if len(batch) == 1 else b"".join(batch))

    def _queue(self, data: bytes) -> None:
        """Make ``data`` the output buffer (only when the previous one is written)."""
        assert self._out is None
        self._out = memoryview(data)
        self._out_offset = 0

    def _write(self) -> None:
        """Write what the socket takes of the output buffer."""
        while self._out is not None:
            try:
                # A TLS write that wants to be retried gets the same bytes again.
                written = self._sock.send(self._out[self._out_offset :])
            except (BlockingIOError, ssl.SSLWantWriteError):
                return
            except ssl.SSLWantReadError:
                self._write_needs_read = True
                return
            except OSError as exc:
                # The server is gone; its last replies may still be readable.
                self._out = None
                self._write_closed = True
                self._stop(f"sending failed: {_why(exc)}")
                return
            self._progressed()
            self._out_offset += written
            if self._out_offset >= len(self._out):
                self._out = None

    # --- reading --------------------------------------------------------------

    def _read(self) -> None:
        """Read and handle every reply available now."""
        while not self._eof:
            try:
                data = self._sock.recv(READ_BYTES)
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:
                self._read_needs_write = True
                return
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                data = b""
            except OSError as exc:
                self._eof = True
                self._stop(f"connection lost: {_why(exc)}")
                return
            self._progressed()
            if not data:
                self._end_of_input()
                return
            try:
                blocks = self._codec.receive_data(data)
            except qmqp.QMQPError as exc:
                for block in cast(list[qmqp.Block], exc.events):
                    self._on_block(block)
                self._eof = True
                self._stop(f"bad reply from the server: {exc.reason}")
                return
            for block in blocks:
                self._on_block(block)

    def _end_of_input(self) -> None:
        """The server closed its side."""
        self._eof = True
        try:
            self._codec.end_of_input()
        except qmqp.QMQPError:
            self._stop("the server closed the connection in the middle of a reply")
        if not self._server_done:
            self._stop("the server closed the connection before its done block")

    def _on_block(self, block: qmqp.Block) -> None:
        """Handle one block from the server."""
        if isinstance(block, qmqp.ReplyBlock):
            if block.id in self._unanswered:
                self._unanswered.discard(block.id)
                self._summary.record(block)
            else:
                self._summary.warnings.append(
                    f"a reply for {printable(block.id)}, which was not awaiting one"
                )
        elif isinstance(block, qmqp.AuthReplyBlock):
            self._auth_reply = block
        elif isinstance(block, qmqp.DoneBlock):
            self._server_done = True
            if not self._done_sent:
                self._stop("the server sent its done block before the client's")
            elif self._unanswered:
                self._stop("the server sent its done block without answering every message")

    # --- the loop -------------------------------------------------------------

    def _stop(self, reason: str) -> None:
        """Note why the session ends early (the first reason wins)."""
        if self._stopped is None:
            self._stopped = reason

    def _finished(self) -> bool:
        """Whether nothing more can happen: the server's side is closed, or it broke the rules."""
        return self._eof or (self._server_done and not self._done_sent)

    def _progressed(self) -> None:
        self._deadline = self._clock() + self._timeout

    def _step(self) -> bool:
        """Wait for the socket once and do what it allows; False when the time is up."""
        want = 0
        if not self._eof:
            want |= selectors.EVENT_READ
        if self._read_needs_write or (self._out is not None and not self._write_needs_read):
            want |= selectors.EVENT_WRITE
        if want != self._registered:
            if not self._registered:
                self._selector.register(self._sock, want)
            elif want:
                self._selector.modify(self._sock, want)
            else:
                self._selector.unregister(self._sock)
            self._registered = want
        if not want:
            return True
        ready = self._selector.select(max(0.0, self._deadline - self._clock()))
        if not ready:
            return self._clock() < self._deadline
        events = ready[0][1]
        if events & selectors.EVENT_READ or (
            events & selectors.EVENT_WRITE and self._read_needs_write
        ):
            self._read_needs_write = False
            self._write_needs_read = False
            self._read()
        if events & selectors.EVENT_WRITE and self._out is not None:
            self._write()
        return True

    def _report(self, started: float, *, finished: bool = False) -> None:
        if self._on_progress is not None:
            self._on_progress(
                Progress(
                    sent=self._sent,
                    answered=self._summary.answered,
                    failed=self._not_sendable,
                    elapsed=self._clock() - started,
                    finished=finished,
                )
            )
