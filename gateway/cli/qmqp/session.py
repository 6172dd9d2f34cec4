"""Stream mail files to a QMQP streaming server (``msggateway qmqp send``).

Three parts, used in this order by the command line:

* `MailSource` turns command-line paths (RFC 822 files, directories of them,
  mbox files) into `Outgoing` messages, or `LocalFailure` for what cannot be
  sent, one at a time: a huge mbox is never held in memory (`mailbox.mbox`
  keeps only the offsets of its messages).
* `envelope_of` reads the envelope from the headers when the options do not
  give it: the sender from ``Return-Path``, else ``From``; the recipients
  from ``To``, ``Cc`` and ``Bcc``. Message bytes are sent as they are, but
  with CRLF turned into LF (QMQP's message format is LF lines) and without
  the ``Bcc`` header, as ``sendmail -t`` does (its recipients get the mail;
  the others must not see them).
* `QMQPSender` drives one connection (../shared/specs/qmqp-streaming.txt,
  "QMQP Streaming Session Overview"): an optional A block first, then message
  blocks while fewer than ``window`` are unanswered, replies read as they
  come (in any order), then the done block, the server's done block and its
  close. It returns a `Summary`; it never writes to a stream itself, and
  reports progress through a callback (`ProgressBar` draws one).

The socket is non-blocking and driven with `selectors`, so one thread reads
replies while it writes blocks, over TCP or TLS.
"""

from __future__ import annotations

import email.policy
import mailbox
import os
import selectors
import socket
import ssl
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from email.utils import getaddresses
from pathlib import Path, PurePosixPath
from typing import Final, Literal, TextIO, cast

from gateway.codecs import qmqp

__all__ = [
    "BATCH_BYTES",
    "DEFAULT_TIMEOUT_SECONDS",
    "DEFAULT_WINDOW",
    "MBOX_MAGIC",
    "PROGRESS_INTERVAL_SECONDS",
    "READ_BYTES",
    "Envelope",
    "Item",
    "LocalFailure",
    "MailSource",
    "Outgoing",
    "Progress",
    "ProgressBar",
    "QMQPAuthRefusedError",
    "QMQPSendError",
    "QMQPSender",
    "Summary",
    "envelope_of",
    "prepare",
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

PROGRESS_INTERVAL_SECONDS: Final = 0.1
"""A progress bar redraws at most this often (ten times a second)."""

MBOX_MAGIC: Final = b"From "
"""An mbox file starts with a ``From `` line."""

_HEADERS: Final = BytesHeaderParser(policy=email.policy.compat32)
_RECIPIENT_FIELDS: Final = ("to", "cc", "bcc")


class QMQPSendError(Exception):
    """The session could not start: no answer to the authentication, or a broken connection."""


class QMQPAuthRefusedError(QMQPSendError):
    """The server refused the username and password."""


# --- messages ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """Who a message is from and to, as QMQP carries it.

    Attributes:
        sender: The envelope sender; empty for the null sender.
        recipients: The envelope recipients, without duplicates.
    """

    sender: bytes
    recipients: tuple[bytes, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A message ready to send.

    Attributes:
        id: Its unique identifier in this session.
        message: The message, LF lines.
        envelope: Its envelope.
    """

    id: bytes
    message: bytes
    envelope: Envelope

    def block(self) -> qmqp.MessageBlock:
        """The QMQP message block carrying it."""
        return qmqp.MessageBlock(
            id=self.id,
            message=self.message,
            sender=self.envelope.sender,
            recipients=self.envelope.recipients,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalFailure:
    """Something that was not sent, and why (no recipient, unreadable file, ...).

    Attributes:
        id: The identifier it would have had.
        reason: Why it was not sent.
    """

    id: bytes
    reason: str


Item = Outgoing | LocalFailure
"""What a `MailSource` yields and a `QMQPSender` consumes."""


def _wire(text: str) -> bytes:
    """Text from headers, paths or arguments back to its bytes (surrogates are raw bytes)."""
    return text.encode("utf-8", "surrogateescape")


def _addresses(values: Sequence[str]) -> list[str]:
    """The addresses (without display names) in header values."""
    if not values:
        return []
    return [address for _, address in getaddresses(list(values)) if address]


def _without_duplicates(addresses: Iterable[str]) -> list[str]:
    """Drop repeated addresses, keeping the first spelling; domains compare without case."""
    seen: set[str] = set()
    kept = []
    for address in addresses:
        local, at, domain = address.strip().rpartition("@")
        key = f"{local}{at}{domain.lower()}" if at else address.strip()
        if key and key not in seen:
            seen.add(key)
            kept.append(address.strip())
    return kept


def envelope_of(
    message: bytes, *, sender: str | None = None, recipients: Sequence[str] = ()
) -> Envelope:
    """Read a message's envelope from its headers, unless the options give it.

    Args:
        message: The message (LF or CRLF lines); only its header is read.
        sender: The sender to use instead of the headers' (``""`` is the
            null sender).
        recipients: The recipients to use instead of the headers'.

    Returns:
        The sender: ``sender``, else the address of the first
        ``Return-Path`` (``<>`` is the null sender), else the first address
        of ``From``, else empty. The recipients: ``recipients``, else every
        address in ``To``, ``Cc`` and ``Bcc``; either way without duplicates
        and possibly none.
    """
    end = message.find(b"\n\n")
    header = message if end < 0 else message[: end + 1]
    fields: dict[str, list[str]] = {}
    for name, value in _HEADERS.parsebytes(header).raw_items():
        fields.setdefault(name.lower(), []).append(value)
    if sender is None:
        if "return-path" in fields:
            found = _addresses(fields["return-path"][:1])
        else:
            found = _addresses(fields.get("from", []))
        sender = found[0] if found else ""
    wanted = list(recipients) or _addresses(
        [value for name in _RECIPIENT_FIELDS for value in fields.get(name, ())]
    )
    return Envelope(
        sender=_wire(sender.strip()),
        recipients=tuple(_wire(address) for address in _without_duplicates(wanted)),
    )


def prepare(
    ident: bytes, data: bytes, *, sender: str | None = None, recipients: Sequence[str] = ()
) -> Item:
    """Turn a message's bytes into what is sent: LF lines and its envelope.

    Args:
        ident: The message's identifier.
        data: The message as read (CRLF or LF lines).
        sender: See `envelope_of`.
        recipients: See `envelope_of`.

    Returns:
        The `Outgoing` message, or a `LocalFailure` when it has no recipient.
    """
    message = data.replace(b"\r\n", b"\n")
    envelope = envelope_of(message, sender=sender, recipients=recipients)
    if not envelope.recipients:
        return LocalFailure(
            id=ident, reason="no recipient: no --recipient and no address in To, Cc or Bcc"
        )
    return Outgoing(id=ident, message=without_bcc(message), envelope=envelope)


def without_bcc(message: bytes) -> bytes:
    """Remove ``Bcc`` header fields (with their continuation lines) from a message.

    Only the header block (up to the first empty line) is looked at.
    """
    end = message.find(b"\n\n")
    head, rest = (message, b"") if end == -1 else (message[: end + 1], message[end + 1 :])
    if b"bcc:" not in head.lower():
        return message
    kept: list[bytes] = []
    skipping = False
    for line in head.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t"):
            if not skipping:
                kept.append(line)
            continue
        skipping = line[:4].lower() == b"bcc:"
        if not skipping:
            kept.append(line)
    return b"".join(kept) + rest


# --- reading files --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    """One file to read: a message, an mbox, or one that failed already."""

    path: Path
    name: str
    kind: Literal["file", "mbox", "error"]
    reason: str = ""


def _why(exc: OSError) -> str:
    """An OS error in a few words."""
    return exc.strerror or str(exc)


class _UniqueIds:
    """Issues identifiers, adding ``~2``, ``~3``, ... to names already issued."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._issued: set[bytes] = set()
        self._next_suffix: dict[bytes, int] = {}

    def issue(self, name: str) -> bytes:
        """The identifier for ``name``: the prefix and the name, made unique."""
        base = _wire(self._prefix + name)
        ident = base
        suffix = self._next_suffix.get(base, 2)
        while ident in self._issued:
            ident = base + b"~%d" % suffix
            suffix += 1
        if ident != base:
            self._next_suffix[base] = suffix
        self._issued.add(ident)
        return ident


class MailSource:
    """The messages that command-line paths name, read one at a time.

    A path is a file holding one RFC 822 message, a directory (every regular
    file in it, in name order; subdirectories too with ``recursive``), or an
    mbox file: one whose first line starts with ``From ``, or every file with
    ``mbox``. The paths are listed, and each file's first bytes read, at
    construction; messages are read as they are iterated.

    Identifiers: a file's path as given, or its path relative to the
    directory given; ``mbox:N`` for the N-th message of an mbox (from 1);
    after ``id_prefix``, and made unique with ``~2``, ``~3``, ...

    Args:
        paths: Files and directories.
        mbox: Read every file as an mbox.
        recursive: Descend into subdirectories.
        sender: The envelope sender for every message (see `envelope_of`).
        recipients: The envelope recipients for every message.
        id_prefix: Put before every identifier.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        mbox: bool = False,
        recursive: bool = False,
        sender: str | None = None,
        recipients: Sequence[str] = (),
        id_prefix: str = "",
    ) -> None:
        self._mbox = mbox
        self._recursive = recursive
        self._sender = sender
        self._recipients = tuple(recipients)
        self._ids = _UniqueIds(id_prefix)
        self._entries = [entry for path in paths for entry in self._expand(str(path))]
        self._counted = sum(1 for entry in self._entries if entry.kind != "mbox")
        self._uncounted_mboxes = len(self._entries) - self._counted

    @property
    def total(self) -> int | None:
        """How many items iterating yields, once every mbox has been opened; else None."""
        return None if self._uncounted_mboxes else self._counted

    def _expand(self, text: str) -> Iterator[_Entry]:
        """The entries one path names."""
        path = Path(text)
        if path.is_dir():
            found = sorted(self._walk(path, PurePosixPath()), key=lambda pair: pair[0])
            yield from (entry for _, entry in found)
        elif path.is_file():
            yield self._classify(path, text)
        elif path.exists():
            yield _Entry(path, text, "error", "not a regular file or a directory")
        else:
            yield _Entry(path, text, "error", "no such file or directory")

    def _walk(
        self, directory: Path, relative: PurePosixPath
    ) -> Iterator[tuple[PurePosixPath, _Entry]]:
        """The regular files of a directory, keyed by their relative path."""
        try:
            with os.scandir(directory) as listing:
                children = list(listing)
        except OSError as exc:
            name = relative.as_posix() if relative.parts else str(directory)
            yield relative, _Entry(directory, name, "error", f"cannot list: {_why(exc)}")
            return
        for child in children:
            inner = relative / child.name
            if child.is_file():
                yield inner, self._classify(Path(child.path), inner.as_posix())
            elif self._recursive and child.is_dir(follow_symlinks=False):
                yield from self._walk(Path(child.path), inner)

    def _classify(self, path: Path, name: str) -> _Entry:
        """A message file or an mbox, by its first bytes (or the ``mbox`` option)."""
        try:
            with path.open("rb") as file:
                head = file.read(len(MBOX_MAGIC))
        except OSError as exc:
            return _Entry(path, name, "error", f"cannot read: {_why(exc)}")
        if head == MBOX_MAGIC or (self._mbox and not head):
            return _Entry(path, name, "mbox")
        if self._mbox:
            return _Entry(path, name, "error", "not an mbox: it does not start with 'From '")
        return _Entry(path, name, "file")

    def __iter__(self) -> Iterator[Item]:
        """Yield every message or failure, in order; files are read as they are reached."""
        for entry in self._entries:
            if entry.kind == "mbox":
                yield from self._read_mbox(entry)
            elif entry.kind == "file":
                yield self._read_file(entry)
            else:
                yield LocalFailure(id=self._ids.issue(entry.name), reason=entry.reason)

    def _prepare(self, name: str, data: bytes) -> Item:
        return prepare(
            self._ids.issue(name), data, sender=self._sender, recipients=self._recipients
        )

    def _read_file(self, entry: _Entry) -> Item:
        """One message file."""
        try:
            data = entry.path.read_bytes()
        except OSError as exc:
            return LocalFailure(id=self._ids.issue(entry.name), reason=f"cannot read: {_why(exc)}")
        return self._prepare(entry.name, data)

    def _read_mbox(self, entry: _Entry) -> Iterator[Item]:
        """The messages of an mbox, one at a time (the ``From `` line is not sent)."""
        try:
            box = mailbox.mbox(entry.path, create=False)
            count = len(box)  # reads the file once, keeping only offsets
        except (OSError, mailbox.Error) as exc:
            self._counted += 1
            self._uncounted_mboxes -= 1
            reason = _why(exc) if isinstance(exc, OSError) else str(exc)
            yield LocalFailure(id=self._ids.issue(entry.name), reason=f"cannot read: {reason}")
            return
        self._counted += count
        self._uncounted_mboxes -= 1
        try:
            for number, key in enumerate(box.iterkeys(), start=1):
                name = f"mbox:{number}"
                try:
                    data = box.get_bytes(key)
                except OSError as exc:
                    yield LocalFailure(id=self._ids.issue(name), reason=f"cannot read: {_why(exc)}")
                    continue
                yield self._prepare(name, data)
        finally:
            box.close()


# --- results -----------------------------------------------------------------------


def _readable(data: bytes) -> str:
    """Peer or file bytes as one line of text: UTF-8, anything else escaped."""
    text = data.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


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
            self.failures.append((status, _readable(reply.id), _readable(reply.description)))

    def fail(self, ident: bytes, reason: str) -> None:
        """Count a message that got no reply."""
        self.errors += 1
        self.failures.append(("error", _readable(ident), reason))
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


class ProgressBar:
    """Draws `Progress` on one line of a stream, at most ten times a second.

    Args:
        stream: Where to draw (the error stream).
        total: Returns the number of items when known.
        clock: Monotonic seconds.
        interval: Least seconds between two redraws (the last one always draws).
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        total: Callable[[], int | None] = _unknown_total,
        clock: Callable[[], float] = time.monotonic,
        interval: float = PROGRESS_INTERVAL_SECONDS,
    ) -> None:
        self._stream = stream
        self._total = total
        self._clock = clock
        self._interval = interval
        self._drawn_at: float | None = None
        self._width = 0

    def __call__(self, progress: Progress) -> None:
        """Redraw if the last redraw is old enough, or if this is the last report."""
        now = self._clock()
        if (
            not progress.finished
            and self._drawn_at is not None
            and now - self._drawn_at < self._interval
        ):
            return
        self._drawn_at = now
        text = self.describe(progress)
        padding = " " * max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write(f"\r{text}{padding}" + ("\n" if progress.finished else ""))
        self._stream.flush()

    def describe(self, progress: Progress) -> str:
        """The progress line: sent, answered of the total, errors, rate."""
        total = self._total()
        answered = f"answered {progress.answered}"
        if total is not None:
            done = progress.answered + progress.failed
            share = 100 * done // total if total else 100
            answered += f" of {total} ({share}%)"
        rate = progress.answered / progress.elapsed if progress.elapsed > 0 else 0.0
        errors = f", {progress.failed} not sendable" if progress.failed else ""
        return f"sent {progress.sent}, {answered}{errors}, {rate:.0f} msg/s"


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
                    f"a reply for {_readable(block.id)}, which was not awaiting one"
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
