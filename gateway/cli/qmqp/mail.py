"""Mail files as QMQP messages: what ``msggateway qmqp send`` reads.

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

The Spark send job (`gateway.spark.jobs`) prepares its datasets' messages
with `prepare` too.
"""

from __future__ import annotations

import email.policy
import mailbox
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from email.utils import getaddresses
from pathlib import Path, PurePosixPath
from typing import Final, Literal

from gateway.codecs import qmqp

__all__ = [
    "MBOX_MAGIC",
    "Envelope",
    "Item",
    "LocalFailure",
    "MailSource",
    "Outgoing",
    "envelope_of",
    "prepare",
    "without_bcc",
]

MBOX_MAGIC: Final = b"From "
"""An mbox file starts with a ``From `` line."""

_HEADERS: Final = BytesHeaderParser(policy=email.policy.compat32)
_RECIPIENT_FIELDS: Final = ("to", "cc", "bcc")


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
