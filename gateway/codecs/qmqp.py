"""QMQP streaming, GreenArrow's pipelined QMQP (../shared/specs/qmqp-streaming.txt).

Sans-IO: `QMQPCodec` turns bytes into blocks and blocks into bytes, for either
role. The server role reads message, auth and done blocks and writes replies;
the client role reads replies and writes the rest.

Spec, "Netstrings", "What does the client send?", "What does the server
send?" and "Authentication": every block is one netstring whose payload is
the concatenation of the netstrings of its elements, the first naming its
type (``ns`` is a netstring, framed by `gateway.codecs.framing`)::

    message block = ns( ns("M") ns(id) ns(message) ns(sender) 1*ns(recipient) )
    auth block    = ns( ns("A") ns(username) ns(password) )
    reply block   = ns( ns("R") ns(id) ns(result) ns(pending) )
    auth reply    = ns( ns("A") ns("1" | "0") )
    done block    = ns("D")                    i.e. "1:D,", both directions

Spec, "Result String": a result's first byte is K (accepted), Z (temporary
failure) or D (permanent failure); the rest describes it, in arbitrary bytes.
Spec, "QMQP Streaming Session Overview": the client streams its blocks and
then its done block, without waiting; the server replies to each message in
any order, then sends its done block and closes.

Errors. In the server role a block the server can still identify (it has a
type and an id) but must refuse decodes to `InvalidBlock`, which the adapter
answers with a D reply (`InvalidBlock.refusal`) while the stream goes on.
Anything that cannot be identified or resynchronised raises `QMQPError`, and
the codec is dead afterwards; the spec prescribes no answer, so the adapter
closes. In the client role any malformed reply raises `QMQPError`.

Readings of the spec (each marked ``Spec ambiguity:`` where it is applied):
an auth reply of ``1`` is success and ``0`` failure, as the prose says,
though the example labelled "success" shows ``0``; and a block is always
wrapped in its outer netstring, as the prose and hex dump show, though the
PHP sample leaves it out.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gateway.codecs.errors import LocalProtocolError, RemoteProtocolError
from gateway.codecs.framing import (
    NetstringError,
    NetstringReader,
    OversizedNetstring,
    encode_netstrings,
    split_netstrings,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DONE",
    "DONE_BYTES",
    "MAX_PENDING_DIGITS",
    "PEEK_BYTES",
    "AuthBlock",
    "AuthReplyBlock",
    "Block",
    "ClientBlock",
    "D",
    "DoneBlock",
    "InvalidBlock",
    "K",
    "MessageBlock",
    "QMQPCodec",
    "QMQPError",
    "QMQPLocalError",
    "ReplyBlock",
    "Role",
    "ServerBlock",
    "Z",
    "encode",
    "encode_reply",
]

DEFAULT_MAX_MESSAGE_BYTES: Final = 32 * 1024 * 1024
"""Largest block kept, in bytes: 32 MiB, envelope included.

Mail injectors send messages of a few KB to a few MB, and common MTA limits
are 10 to 50 MB; 32 MiB takes any message a relay would accept while one
connection can never hold more than that. Larger blocks are skipped (server
role) or refused (client role), never buffered.
"""

PEEK_BYTES: Final = 4096
"""Bytes of an oversized block kept to read its type and id before skipping it.

Ids are short (the spec's example is ``msg1``); 4 KiB leaves room for any
sane one while bounding what a skipped block costs.
"""

MAX_PENDING_DIGITS: Final = 20
"""Most digits in a reply's pending count: a 64-bit counter has 20."""

K: Final = b"K"
"""Spec, "Result String": accepted for delivery to all recipients."""

Z: Final = b"Z"
"""Spec, "Result String": temporary failure; try again later."""

D: Final = b"D"
"""Spec, "Result String": permanent failure."""

DONE_BYTES: Final = b"1:D,"
"""Spec, "Sample Session": the done block, a netstring holding just ``D``."""

_STATUSES: Final = {K: K, Z: Z, D: D}
_TYPE_M: Final = b"M"
_TYPE_A: Final = b"A"
_TYPE_R: Final = b"R"
_AUTH_OK: Final = b"1"
_AUTH_FAILED: Final = b"0"
_PENDING: Final = re.compile(rb"[0-9]{1,%d}\Z" % MAX_PENDING_DIGITS)
_PENDING_BOUND: Final = 10**MAX_PENDING_DIGITS


class Role(enum.Enum):
    """Which side of the connection a codec is on."""

    SERVER = "server"
    CLIENT = "client"


# --- blocks -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageBlock:
    """A message, client to server (spec, "What does the client send?").

    Attributes:
        id: The client's unique identifier, echoed in the reply.
        message: The message, ``firstline LF secondline LF ...``.
        sender: The envelope sender (Return-Path); may be empty.
        recipients: One or more envelope recipients.
    """

    id: bytes
    message: bytes
    sender: bytes
    recipients: tuple[bytes, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthBlock:
    """An authentication request, client to server (spec, "Authentication")."""

    username: bytes
    password: bytes


@dataclass(frozen=True, slots=True)
class DoneBlock:
    """``1:D,``: the client has no more messages, or the server no more replies."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyBlock:
    """The result for one message, server to client (spec, "What does the server send?").

    Attributes:
        id: The identifier of the message this reply is for.
        status: `K`, `Z` or `D` (spec, "Result String").
        description: The rest of the result string: any bytes.
        pending: How many messages the server has yet to complete.
    """

    id: bytes
    status: bytes
    description: bytes
    pending: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthReplyBlock:
    """The answer to an authentication request (spec, "Authentication")."""

    success: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidBlock:
    """A block the server identified but must refuse with a D reply (server role only).

    Never encoded: the adapter answers it with `refusal`.

    Attributes:
        id: The block's identifier (its second element).
        reason: Why it is refused, readable; it becomes the D description.
        kind: A short stable name for metrics: ``no-recipient``,
            ``missing-fields``, ``bad-framing``, ``too-large``,
            ``unknown-type`` or ``after-done``.
    """

    id: bytes
    reason: str
    kind: str

    def refusal(self, pending: int) -> ReplyBlock:
        """The D reply that answers this block, its reason as the description.

        Spec, "Result String": in a description not beginning with a space,
        ``#`` may appear only in HCMSSC codes, so it is escaped (reasons quote
        peer bytes); reasons are ASCII and never begin with a space.
        """
        description = self.reason.encode("ascii", "backslashreplace").replace(b"#", b"\\x23")
        return ReplyBlock(id=self.id, status=D, description=description, pending=pending)


DONE: Final = DoneBlock()

ClientBlock = MessageBlock | AuthBlock | DoneBlock
"""What a client sends."""

ServerBlock = ReplyBlock | AuthReplyBlock | DoneBlock
"""What a server sends."""

Block = MessageBlock | AuthBlock | DoneBlock | ReplyBlock | AuthReplyBlock | InvalidBlock
"""Every decoded unit; adapters ``match`` on this union."""


# --- errors -------------------------------------------------------------------


class QMQPError(RemoteProtocolError):
    """The peer broke QMQP streaming in a way that cannot be answered block by block.

    ``reason`` says what, ``kind`` names it for metrics, ``where`` is a
    stream offset when one is known and ``events`` holds the blocks decoded
    before it. The spec prescribes no answer: the adapter closes.
    """


class QMQPLocalError(LocalProtocolError):
    """We were asked to send a block this role or QMQP cannot carry."""


class _MalformedError(Exception):
    """Internal: a block cannot be decoded; turned into `QMQPError` by the codec."""

    def __init__(self, reason: str, kind: str, where: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.where = where


def _show(value: bytes, limit: int = 32) -> str:
    """Quote peer bytes for a reason: printable ASCII, escaped, cut to ``limit``."""
    text = repr(value[:limit])[2:-1]
    return f"'{text}'" + ("..." if len(value) > limit else "")


def _parts_before(exc: NetstringError) -> list[bytes]:
    """The elements of a block split before its framing defect."""
    return [item for item in exc.complete if isinstance(item, bytes)]


def _fields(content: bytes) -> list[bytes]:
    """Split a block's content, or its first bytes: the elements complete in it."""
    try:
        return split_netstrings(content)
    except NetstringError as exc:
        return _parts_before(exc)


# --- decoding: server role ------------------------------------------------------


def _identified(parts: list[bytes], broken: NetstringError | None) -> bytes:
    """The id of a block that is not an auth block, or raise: it cannot be refused by id."""
    if len(parts) >= 2:
        return parts[1]
    if broken is not None:
        raise _MalformedError(
            f"block framing is broken before its id: {broken.reason}"
            f" (at byte {broken.offset} of the block)",
            "bad-framing",
        )
    if not parts:
        raise _MalformedError("empty block", "empty-block")
    if parts[0] == _TYPE_M:
        raise _MalformedError("message block without an id", "no-id")
    raise _MalformedError(f"block of unknown type {_show(parts[0])} without an id", "unknown-type")


def _auth_block(parts: list[bytes], broken: NetstringError | None) -> AuthBlock:
    """Spec, "Authentication": ``A``, username, password, and nothing else."""
    if broken is not None:
        raise _MalformedError(
            f"auth block framing is broken: {broken.reason} (at byte {broken.offset} of the block)",
            "bad-framing",
        )
    if len(parts) != 3:
        raise _MalformedError(
            f"auth block has {len(parts) - 1} fields; it needs a username and a password",
            "bad-auth",
        )
    return AuthBlock(username=parts[1], password=parts[2])


def _refused_message(ident: bytes, parts: list[bytes], broken: NetstringError | None) -> Block:
    """An M block with an id that is not a valid message: say why."""
    if broken is not None:
        return InvalidBlock(
            id=ident,
            reason=f"message block framing is broken after the id: {broken.reason}"
            f" (at byte {broken.offset} of the block)",
            kind="bad-framing",
        )
    missing = {2: "a message, a sender and a recipient", 3: "a sender and a recipient"}
    if len(parts) in missing:
        return InvalidBlock(
            id=ident, reason=f"message block lacks {missing[len(parts)]}", kind="missing-fields"
        )
    return InvalidBlock(id=ident, reason="message block has no recipient", kind="no-recipient")


# --- decoding: client role --------------------------------------------------------


def _reply_block(parts: list[bytes]) -> ReplyBlock:
    """Spec, "What does the server send?": ``R``, id, result, pending count."""
    if len(parts) != 4:
        raise _MalformedError(
            f"reply block has {len(parts) - 1} fields; it needs an id, a result and a count",
            "bad-reply",
        )
    result = parts[2]
    status = _STATUSES.get(result[:1])
    if status is None:
        raise _MalformedError(
            f"reply result {_show(result)} does not start with K, Z or D", "bad-reply"
        )
    count = parts[3]
    # A decimal string (spec): leading zeros are still decimal and harmless,
    # so they are accepted; the digit bound keeps int() cheap.
    if _PENDING.match(count) is None:
        raise _MalformedError(f"pending count {_show(count)} is not a decimal number", "bad-reply")
    return ReplyBlock(id=parts[1], status=status, description=result[1:], pending=int(count))


def _auth_reply_block(parts: list[bytes]) -> AuthReplyBlock:
    """Spec, "Authentication": ``A``, then ``1`` or ``0``."""
    # Spec ambiguity: the prose says "1 if authentication is successful or 0
    # if not", but the example labelled "showing success" is 8:1:A,1:0,,. We
    # follow the prose (1 = success, 0 = failure), so that example decodes as
    # a failure; anything but 1 or 0 is malformed.
    if len(parts) == 2 and parts[1] in (_AUTH_OK, _AUTH_FAILED):
        return AuthReplyBlock(success=parts[1] == _AUTH_OK)
    raise _MalformedError("auth reply must hold A and then 1 or 0", "bad-auth-reply")


# --- encoding -----------------------------------------------------------------


def encode_reply(ident: bytes, status: bytes, description: bytes, pending: int) -> bytes:
    """Encode a `ReplyBlock`'s fields as its netstring, without building the block.

    A server answers every message: this is its per-message path (one bytes
    formatting), and `encode` uses it too. The result equals the general
    netstring encoding of ``R``, ``ident``, ``status + description`` and the
    pending count (tests/codecs check it for any fields).

    Raises:
        QMQPLocalError: ``status`` is not K, Z or D, or ``pending`` is
            negative or has more than `MAX_PENDING_DIGITS` digits.
    """
    if status not in _STATUSES:
        raise QMQPLocalError(f"reply status {status!r} is not K, Z or D", kind="bad-status")
    if not 0 <= pending < _PENDING_BOUND:
        raise QMQPLocalError(
            f"pending count {pending} is negative or over {MAX_PENDING_DIGITS} digits",
            kind="bad-pending",
        )
    count = b"%d" % pending
    # "1:R," then the id, the result string and the count, each a netstring.
    inner = b"1:R,%d:%b,%d:%b%b,%d:%b," % (
        len(ident), ident, len(status) + len(description), status, description, len(count), count
    )  # fmt: skip
    return b"%d:%b," % (len(inner), inner)


def encode(block: Block) -> bytes:
    """Encode one block as its netstring.

    Raises:
        QMQPLocalError: The block cannot be carried: a message without
            recipients, a reply whose status is not K, Z or D or whose pending
            count is negative or has more than `MAX_PENDING_DIGITS` digits, or
            an `InvalidBlock` (answer it with its `InvalidBlock.refusal`).
    """
    match block:
        case MessageBlock(id=ident, message=message, sender=sender, recipients=recipients):
            if not recipients:
                raise QMQPLocalError("a message block needs a recipient", kind="no-recipient")
            # Spec ambiguity: the PHP sample's create_message_block returns the
            # elements' netstrings without the outer one; the prose ("encodes
            # the result into a single netstring") and the hex dump wrap them,
            # and so do we. A server refuses a bare block as bad framing.
            return encode_netstrings((_TYPE_M, ident, message, sender, *recipients))
        case ReplyBlock(id=ident, status=status, description=description, pending=pending):
            return encode_reply(ident, status, description, pending)
        case DoneBlock():
            return DONE_BYTES
        case AuthBlock(username=username, password=password):
            return encode_netstrings((_TYPE_A, username, password))
        case AuthReplyBlock(success=success):
            return encode_netstrings((_TYPE_A, _AUTH_OK if success else _AUTH_FAILED))
        case InvalidBlock():
            raise QMQPLocalError(
                "an InvalidBlock is never sent; answer it with its refusal()", kind="wrong-block"
            )
    raise QMQPLocalError(f"{block!r} is not a QMQP block", kind="wrong-block")  # pragma: no cover


# --- the codec ------------------------------------------------------------------


class QMQPCodec:
    """One side of one QMQP streaming connection.

    Args:
        role: SERVER reads message, auth and done blocks; CLIENT reads reply,
            auth reply and done blocks.
        max_message_bytes: Largest block kept (its declared length). In the
            server role a larger block is skipped as it streams in and, if its
            type and id can be read from its first bytes, decodes to an
            `InvalidBlock` (``too-large``). In the client role it bounds
            replies, which are small: a larger one raises `QMQPError` as soon
            as its length is read.
    """

    __slots__ = ("_done_sent", "_error", "_limit", "_peer_done", "_reader", "_role")

    def __init__(self, role: Role, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role must be a qmqp.Role, not {role!r}")
        self._role = role
        self._limit = max_message_bytes
        self._reader = NetstringReader(
            max_message_bytes, PEEK_BYTES, refuse_oversized=role is Role.CLIENT
        )
        self._peer_done = False
        self._done_sent = False
        self._error: QMQPError | None = None

    @property
    def role(self) -> Role:
        """Which side this codec is on."""
        return self._role

    @property
    def peer_done(self) -> bool:
        """Whether the peer's done block has been decoded."""
        return self._peer_done

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an incomplete block; zero exactly between blocks.

        An oversized block being skipped counts as incomplete (its header and
        head are held) until its last byte is read. Lets the adapter time out
        a block that never completes.
        """
        return self._reader.pending

    def receive_data(self, data: bytes) -> list[Block]:
        """Decode the blocks that ``data`` completes.

        Returns:
            The complete blocks, in order; an empty list when more data is
            needed.

        Raises:
            QMQPError: Part of the input cannot be decoded or answered block
                by block. Blocks decoded before it are in its ``events``. The
                codec is dead afterwards: every later call raises again.
        """
        if self._error is not None:
            raise self._error
        try:
            items = self._reader.feed(data)
        except NetstringError as exc:
            blocks = self._decode(exc.complete)
            what = "reply" if self._role is Role.CLIENT else "block"
            self._fail(
                _MalformedError(f"{what} framing: {exc.reason}", exc.kind, f"byte {exc.offset}"),
                blocks,
            )
        return self._decode(items)

    def _decode(self, items: Sequence[bytes | OversizedNetstring]) -> list[Block]:
        """Decode the reader's items; on a bad one, fail with the blocks before it."""
        out: list[Block] = []
        decode = self._server_block if self._role is Role.SERVER else self._client_block
        try:
            for item in items:
                out.append(decode(item))
        except _MalformedError as exc:
            self._fail(exc, out)
        return out

    def _server_block(self, item: bytes | OversizedNetstring) -> Block:
        """Decode one block read by a server."""
        if isinstance(item, OversizedNetstring):
            return self._oversized(item)
        if item == b"D":
            if self._peer_done:
                raise _MalformedError("a second done block", "after-done")
            self._peer_done = True
            return DONE
        try:
            parts = split_netstrings(item)
        except NetstringError as exc:
            return self._irregular_block(_parts_before(exc), exc)
        # The hot path: a complete message block before the done block.
        if len(parts) >= 5 and parts[0] == _TYPE_M and not self._peer_done:
            return MessageBlock(
                id=parts[1], message=parts[2], sender=parts[3], recipients=tuple(parts[4:])
            )
        return self._irregular_block(parts, None)

    def _irregular_block(self, parts: list[bytes], broken: NetstringError | None) -> Block:
        """Decode a block off the hot path: auth, refused, or not decodable at all."""
        if parts and parts[0] == _TYPE_A:
            if self._peer_done:
                raise _MalformedError("an auth block after the done block", "after-done")
            return _auth_block(parts, broken)
        ident = _identified(parts, broken)
        if self._peer_done:
            return InvalidBlock(id=ident, reason="block after the done block", kind="after-done")
        if parts[0] != _TYPE_M:
            return InvalidBlock(
                id=ident, reason=f"unknown block type {_show(parts[0])}", kind="unknown-type"
            )
        return _refused_message(ident, parts, broken)

    def _oversized(self, record: OversizedNetstring) -> Block:
        """A block over the limit, skipped: refuse it by id if its head shows one."""
        parts = _fields(record.head)
        over = f"block of {record.length} bytes is over the {self._limit}-byte limit"
        if len(parts) < 2 or parts[0] == _TYPE_A:
            raise _MalformedError(over, "too-large")
        if self._peer_done:
            return InvalidBlock(id=parts[1], reason="block after the done block", kind="after-done")
        return InvalidBlock(id=parts[1], reason=over, kind="too-large")

    def _client_block(self, item: bytes | OversizedNetstring) -> Block:
        """Decode one block read by a client."""
        if isinstance(item, OversizedNetstring):  # pragma: no cover - the reader refuses them
            raise _MalformedError(f"reply of {item.length} bytes is too large", "too-large")
        if self._peer_done:
            raise _MalformedError("a block after the server's done block", "after-done")
        if item == b"D":
            self._peer_done = True
            return DONE
        try:
            parts = split_netstrings(item)
        except NetstringError as broken:
            raise _MalformedError(
                f"reply framing is broken: {broken.reason} (at byte {broken.offset} of the block)",
                "bad-framing",
            ) from None
        if not parts:
            raise _MalformedError("empty block", "empty-block")
        if parts[0] == _TYPE_R:
            return _reply_block(parts)
        if parts[0] == _TYPE_A:
            return _auth_reply_block(parts)
        raise _MalformedError(f"unknown reply type {_show(parts[0])}", "unknown-type")

    def _fail(self, exc: _MalformedError, before: list[Block]) -> None:
        """Raise `QMQPError` with the blocks before it, and stay dead."""
        error = QMQPError(exc.reason, where=exc.where, kind=exc.kind, events=list(before))
        self._error = QMQPError(exc.reason, where=exc.where, kind=exc.kind)
        raise error

    def end_of_input(self) -> None:
        """Report the end of the byte stream.

        Raises:
            QMQPError: The stream ended inside a block, or the codec is dead
                after an earlier error.
        """
        if self._error is not None:
            raise self._error
        if self.pending_bytes:
            self._fail(_MalformedError("connection ended inside a block", "truncated"), [])

    def send(self, block: Block) -> bytes:
        """Encode a block this role may send.

        A client sends `MessageBlock`, `AuthBlock` and `DoneBlock`; a server
        `ReplyBlock`, `AuthReplyBlock` and `DoneBlock`. Nothing follows one's
        own done block (spec, "QMQP Streaming Session Overview").

        Raises:
            QMQPLocalError: The role may not send it, the done block was sent,
                or `encode` refuses it.
        """
        allowed = (
            (MessageBlock, AuthBlock, DoneBlock)
            if self._role is Role.CLIENT
            else (ReplyBlock, AuthReplyBlock, DoneBlock)
        )
        if not isinstance(block, allowed):
            raise QMQPLocalError(
                f"a {self._role.value} cannot send {type(block).__name__}", kind="wrong-role"
            )
        if self._done_sent:
            raise QMQPLocalError("nothing may follow the done block", kind="after-done")
        wire = encode(block)
        if isinstance(block, DoneBlock):
            self._done_sent = True
        return wire
