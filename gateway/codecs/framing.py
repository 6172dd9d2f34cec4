"""Framing helpers shared by the codecs: one implementation of each.

So far: LF-delimited lines with a hard length cap (SSMP), netstrings
(http://cr.yp.to/proto/netstrings.txt; QMQP) and binary length prefixes
(the RabbitMQ stream protocol's uint32 frame size). Short strings join this
module when their protocol arrives; codecs compose these helpers instead of
writing their own parse loops.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_LENGTH_DIGITS",
    "LengthPrefixError",
    "LengthPrefixReader",
    "LineSplitter",
    "LineTooLongError",
    "NetstringError",
    "NetstringReader",
    "OversizedNetstring",
    "encode_netstring",
    "encode_netstrings",
    "split_netstrings",
]


class LineTooLongError(Exception):
    """A line passed its cap; ``complete`` holds the good lines before it.

    Attributes:
        complete: The lines that were complete before the offending one.
        length: How long the offending line was known to be, at least.
    """

    def __init__(self, complete: list[bytes], length: int) -> None:
        super().__init__(f"line of at least {length} bytes")
        self.complete = complete
        self.length = length


class LineSplitter:
    """Split a byte stream into lines at a delimiter, with a hard cap.

    ``max_line_bytes`` counts the delimiter, as SSMP's 1,024-byte limit does.
    A line is refused as soon as it is known to pass the cap: a partial line
    that can no longer end, delimiter included, within the cap fails at
    once, without waiting for its delimiter. The buffer never holds more than
    ``max_line_bytes - 1`` bytes between calls.
    """

    __slots__ = ("_delimiter", "_max_content", "_tail")

    def __init__(self, max_line_bytes: int, delimiter: bytes = b"\n") -> None:
        if max_line_bytes < 2:
            raise ValueError("a line needs room for at least one byte and its delimiter")
        self._delimiter = delimiter
        self._max_content = max_line_bytes - len(delimiter)
        self._tail = b""

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line buffered so far."""
        return len(self._tail)

    def feed(self, data: bytes) -> list[bytes]:
        """Add data; return the complete lines it finished, without delimiters.

        Raises:
            LineTooLongError: A line (complete or not) passed the cap. Lines before
                it are in the exception; nothing after it is kept.
        """
        if self._tail:
            data = self._tail + data
        lines = data.split(self._delimiter)
        tail = lines.pop()
        limit = self._max_content
        # One C-level pass finds whether any line is too long; the rare bad
        # batch is then scanned again to report the lines before it.
        if lines and max(map(len, lines)) > limit:
            for index, line in enumerate(lines):
                if len(line) > limit:
                    self._tail = b""
                    raise LineTooLongError(lines[:index], len(line) + len(self._delimiter))
        # The tail may run past the content limit only with the first bytes
        # of a multi-byte delimiter (``\r`` of ``\r\n``): it can still end in time.
        if len(tail) > limit and not self._delimiter.startswith(tail[limit:]):
            self._tail = b""
            raise LineTooLongError(lines, len(tail) + 1)
        self._tail = tail
        return lines


# --- netstrings ----------------------------------------------------------------
# http://cr.yp.to/proto/netstrings.txt: ``[len] ":" [bytes] ","`` where len is
# ASCII decimal with no leading zero ("0" itself excepted). QMQP's blocks are
# netstrings of concatenated netstrings.

MAX_LENGTH_DIGITS: Final = 10
"""Most digits a netstring length may have.

Ten digits declare up to 9,999,999,999 bytes, far beyond any limit we
configure (QMQP's default is 32 MiB), so no honest peer needs an eleventh;
it bounds a partial header at 10 bytes and keeps ``int()`` on peer digits
trivially cheap. An eleventh digit is refused before the ``:`` arrives.
"""

_COMMA: Final = 0x2C
_ZERO: Final = 0x30
_DIGITS: Final = re.compile(rb"[0-9]*")


class NetstringError(Exception):
    """Bytes that are not a netstring (or not a concatenation of netstrings).

    Attributes:
        reason: What is wrong, in words.
        offset: Where: the index of the offending byte in the data given to
            `split_netstrings`, or in the whole stream fed to a
            `NetstringReader` (counting from its first byte).
        kind: A short stable name: ``bad-length`` (no digit where the length
            starts), ``leading-zero``, ``length-too-long`` (more than
            `MAX_LENGTH_DIGITS` digits), ``missing-colon``, ``missing-comma``,
            ``truncated`` (`split_netstrings` only: the data ends inside a
            netstring) or ``too-large`` (a reader that refuses oversized
            netstrings).
        complete: The items completed before the defect, in order: payloads
            (and `OversizedNetstring` records, from a reader).
    """

    def __init__(
        self,
        reason: str,
        *,
        offset: int,
        kind: str,
        complete: Sequence[bytes | OversizedNetstring] = (),
    ) -> None:
        super().__init__(f"{reason} (at byte {offset})")
        self.reason = reason
        self.offset = offset
        self.kind = kind
        self.complete = complete


@dataclass(frozen=True, slots=True, kw_only=True)
class OversizedNetstring:
    """A netstring whose declared length passed the reader's limit, skipped.

    Attributes:
        head: The first bytes of its payload (at most the reader's
            ``peek_bytes``), enough for a codec to say what the item was.
        length: Its declared payload length.
    """

    head: bytes
    length: int


def encode_netstring(data: bytes) -> bytes:
    """Return ``data`` as one netstring: ``b"5:hello,"``."""
    return b"%d:%b," % (len(data), data)


def encode_netstrings(parts: Iterable[bytes]) -> bytes:
    """Return the netstring of the concatenated netstrings of ``parts``.

    That is a QMQP block: ``encode_netstrings([b"A", b"1"]) == b"8:1:A,1:1,,"``.
    Each part is copied once, by a single join.
    """
    pieces: list[bytes] = [b""]
    size = 0
    for part in parts:
        header = b"%d:" % len(part)
        pieces += (header, part, b",")
        size += len(header) + len(part) + 1
    pieces[0] = b"%d:" % size
    pieces.append(b",")
    return b"".join(pieces)


def _show_byte(byte: int) -> str:
    """Quote one peer byte for a reason text."""
    return repr(bytes([byte]))[1:]


def _header_defect(
    data: bytes | bytearray | memoryview, pos: int, end: int
) -> tuple[str, str, int] | None:
    """Say what is wrong with the netstring header starting at ``pos``.

    Only called once the fast path has failed. Looks at no more than
    ``MAX_LENGTH_DIGITS + 1`` bytes.

    Returns:
        ``(reason, kind, offset)`` for a defect, or None when the bytes up to
        ``end`` are a valid but incomplete header (digits, no colon yet).
    """
    match = _DIGITS.match(data, pos, min(end, pos + MAX_LENGTH_DIGITS + 1))
    digits = match.end() - pos if match is not None else 0
    if digits > MAX_LENGTH_DIGITS:
        reason = f"netstring length has more than {MAX_LENGTH_DIGITS} digits"
        return reason, "length-too-long", pos + MAX_LENGTH_DIGITS
    if digits > 1 and data[pos] == _ZERO:
        return "netstring length has a leading zero", "leading-zero", pos
    if pos + digits >= end:
        return None
    byte = data[pos + digits]
    if digits == 0:
        reason = f"expected a netstring length digit, got {_show_byte(byte)}"
        return reason, "bad-length", pos
    reason = f"expected a digit or ':' after the netstring length, got {_show_byte(byte)}"
    return reason, "missing-colon", pos + digits


def split_netstrings(data: bytes | memoryview) -> list[bytes]:
    """Parse a complete concatenation of netstrings, strictly.

    This is the inside of a QMQP block. Empty data gives an empty list.

    Args:
        data: Netstrings back to back, nothing before, between or after.

    Returns:
        Their payloads, in order.

    Raises:
        NetstringError: A defect, with its offset in ``data``; its
            ``complete`` holds the payloads before it. Data that ends inside a
            netstring is ``truncated``.
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    out: list[bytes] = []
    append = out.append
    find = data.find
    window = MAX_LENGTH_DIGITS + 1
    zero, comma = _ZERO, _COMMA  # locals: this loop runs once per field of every block
    pos = 0
    end = len(data)
    while pos < end:
        colon = find(b":", pos, pos + window)
        digits = data[pos:colon] if colon >= 0 else b""
        # isdigit() on bytes is ASCII-only; int() alone would take signs,
        # spaces and underscores.
        if not digits.isdigit() or (digits[0] == zero and colon > pos + 1):
            raise _split_error(data, pos, out)
        start = colon + 1
        stop = start + int(digits)
        if stop >= end or data[stop] != comma:
            raise _split_end_error(data, pos, start, stop, out)
        append(data[start:stop])
        pos = stop + 1
    return out


def _split_end_error(
    data: bytes, pos: int, start: int, stop: int, complete: list[bytes]
) -> NetstringError:
    """The error for a payload at ``start:stop`` that overruns ``data`` or lacks its comma."""
    if stop >= len(data):
        return NetstringError(
            f"netstring of {stop - start} bytes runs past the end of the data",
            offset=pos,
            kind="truncated",
            complete=complete,
        )
    return NetstringError(
        f"expected ',' after the netstring payload, got {_show_byte(data[stop])}",
        offset=stop,
        kind="missing-comma",
        complete=complete,
    )


def _split_error(data: bytes, pos: int, complete: list[bytes]) -> NetstringError:
    """The error for a bad or incomplete header at ``pos`` in `split_netstrings`."""
    defect = _header_defect(data, pos, len(data))
    if defect is None:
        return NetstringError(
            "data ends inside a netstring length", offset=pos, kind="truncated", complete=complete
        )
    reason, kind, offset = defect
    return NetstringError(reason, offset=offset, kind=kind, complete=complete)


class NetstringReader:
    """Read a stream of netstrings incrementally, with a bound on each.

    ``feed`` returns each completed payload as bytes. A netstring whose
    declared length is above ``max_length`` is not kept: its first
    ``peek_bytes`` bytes are, the rest is counted and dropped as it streams
    in, and once its comma has been checked it comes out as an
    `OversizedNetstring`. With ``refuse_oversized`` it is an error instead,
    raised as soon as the digits read so far exceed ``max_length``.

    The length digits are bounded before anything is buffered: an eleventh
    digit (`MAX_LENGTH_DIGITS`) is an error without waiting for the ``:``.
    After an error the reader is dead: every call raises it again.

    Memory: at most one netstring of ``max_length`` bytes plus the chunk being
    fed, or ``peek_bytes`` plus the chunk while skipping an oversized one.

    Args:
        max_length: Largest payload kept, in bytes.
        peek_bytes: Bytes of an oversized payload kept in its record.
        refuse_oversized: Raise ``too-large`` instead of skipping.
    """

    __slots__ = (
        "_buf",
        "_error",
        "_head",
        "_length",
        "_max_length",
        "_max_length_digits",
        "_offset",
        "_peek_bytes",
        "_refuse_oversized",
        "_skip_header_bytes",
        "_skip_left",
    )

    def __init__(
        self, max_length: int, peek_bytes: int = 4096, *, refuse_oversized: bool = False
    ) -> None:
        if max_length < 0 or peek_bytes < 0:
            raise ValueError("limits must not be negative")
        self._max_length = max_length
        self._max_length_digits = len(str(max_length))
        self._peek_bytes = peek_bytes
        self._refuse_oversized = refuse_oversized
        self._buf = bytearray()
        self._offset = 0  # stream offset of self._buf[0]
        # The oversized item being skipped, if any: its declared length, the
        # payload bytes still to come (-1 when not skipping) and its header size.
        self._length = -1
        self._skip_left = -1
        self._skip_header_bytes = 0
        self._head = bytearray()
        self._error: NetstringError | None = None

    @property
    def pending(self) -> int:
        """Bytes held of an incomplete item; zero exactly between items.

        A partial header or payload; for an oversized item being skipped, its
        header and the head kept so far (never the skipped bytes).
        """
        return len(self._buf) + len(self._head) + self._skip_header_bytes

    def feed(self, data: bytes) -> list[bytes | OversizedNetstring]:
        """Add data; return the items it completed, in order.

        Returns:
            Payloads as bytes, and an `OversizedNetstring` for each netstring
            over ``max_length``; an empty list when more data is needed.

        Raises:
            NetstringError: A defect; the items completed before it are in its
                ``complete``, and its offset counts from the stream's start.
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        buf += data
        out: list[bytes | OversizedNetstring] = []
        pos = 0
        view = memoryview(buf)
        try:
            pos = self._read(buf, view, out)
        except NetstringError as exc:
            self._error = NetstringError(exc.reason, offset=exc.offset, kind=exc.kind)
            self._buf = bytearray()
            self._head = bytearray()
            raise NetstringError(
                exc.reason, offset=exc.offset, kind=exc.kind, complete=out
            ) from None
        finally:
            view.release()
        # Drop the consumed prefix once per feed, not once per item.
        del buf[:pos]
        self._offset += pos
        return out

    def _read(self, buf: bytearray, view: memoryview, out: list[bytes | OversizedNetstring]) -> int:
        """Append the items complete in ``buf`` to ``out``; return the bytes consumed.

        An item whose payload is incomplete is left whole in the buffer, its
        header included, and parsed again by the next feed: that costs one
        short ``find`` and keeps the only state between feeds the skipping of
        an oversized item.
        """
        pos = 0
        end = len(buf)
        find = buf.find
        append = out.append
        max_length = self._max_length
        window = MAX_LENGTH_DIGITS + 1
        zero, comma = _ZERO, _COMMA  # locals: this loop runs once per block
        while True:
            if self._skip_left >= 0:
                pos, record = self._skip(buf, pos)
                if record is None:
                    return pos
                append(record)
                continue
            colon = find(b":", pos, pos + window)
            digits = buf[pos:colon] if colon >= 0 else b""
            if not digits.isdigit() or (digits[0] == zero and colon > pos + 1):
                self._check_partial_header(buf, pos)
                return pos
            length = int(digits)
            if length > max_length:
                if self._refuse_oversized:
                    raise self._too_large(length, pos)
                self._length = length
                self._skip_left = length
                self._skip_header_bytes = colon + 1 - pos
                pos = colon + 1
                continue
            stop = colon + 1 + length
            if stop >= end:
                return pos
            if buf[stop] != comma:
                raise NetstringError(
                    f"expected ',' after the netstring payload, got {_show_byte(buf[stop])}",
                    offset=self._offset + stop,
                    kind="missing-comma",
                )
            append(view[colon + 1 : stop].tobytes())
            pos = stop + 1

    def _check_partial_header(self, buf: bytearray, pos: int) -> None:
        """Raise for a bad header at ``pos``; return if it is valid so far."""
        defect = _header_defect(buf, pos, len(buf))
        if defect is not None:
            reason, kind, offset = defect
            raise NetstringError(reason, offset=self._offset + offset, kind=kind)
        # Digits only so far: a refusing reader need not wait for the ':'
        # once they already exceed the limit (no leading zero, so they only grow).
        if self._refuse_oversized:
            digits = len(buf) - pos
            if digits > self._max_length_digits or (
                digits == self._max_length_digits and int(buf[pos:]) > self._max_length
            ):
                raise self._too_large(int(buf[pos:]), pos, at_least=True)

    def _too_large(self, length: int, pos: int, *, at_least: bool = False) -> NetstringError:
        """The ``too-large`` error of a refusing reader."""
        size = f"at least {length}" if at_least else str(length)
        return NetstringError(
            f"netstring of {size} bytes is over the {self._max_length}-byte limit",
            offset=self._offset + pos,
            kind="too-large",
        )

    def _skip(self, buf: bytearray, pos: int) -> tuple[int, OversizedNetstring | None]:
        """Keep the head of an oversized payload, drop the rest, then check its comma.

        Returns:
            The new read offset, and the record once the comma has been seen.
        """
        left = self._skip_left
        room = self._peek_bytes - len(self._head)
        if room > 0 and left:
            take = min(room, left, len(buf) - pos)
            self._head += buf[pos : pos + take]
            pos += take
            left -= take
        take = min(left, len(buf) - pos)
        pos += take
        left -= take
        self._skip_left = left
        if left or pos == len(buf):
            return pos, None
        if buf[pos] != _COMMA:
            raise NetstringError(
                f"expected ',' after the netstring payload, got {_show_byte(buf[pos])}",
                offset=self._offset + pos,
                kind="missing-comma",
            )
        record = OversizedNetstring(head=bytes(self._head), length=self._length)
        self._head = bytearray()
        self._skip_left = -1
        self._skip_header_bytes = 0
        return pos + 1, record


# --- binary length prefixes ------------------------------------------------------
# A fixed-width binary length, then that many payload bytes: the RabbitMQ
# stream protocol's frames (uint32 big-endian, counting the bytes after it),
# and the shape of Twisted's Int8/16/32StringReceiver. One reader serves
# every width and byte order: it is given a precompiled `struct.Struct`.


class LengthPrefixError(Exception):
    """A declared length the reader refuses, found before its payload was kept.

    Attributes:
        reason: What is wrong, in words.
        offset: Stream offset of the offending length prefix (counting from the
            first byte fed to the reader).
        kind: ``too-large`` (over the limit) or ``bad-length`` (negative,
            from a signed prefix format).
        length: The declared length.
        limit: The limit in force when it was read, or None for none.
        complete: The payloads completed before it, in order.
    """

    def __init__(
        self,
        reason: str,
        *,
        offset: int,
        kind: str,
        length: int,
        limit: int | None,
        complete: Sequence[bytes] = (),
    ) -> None:
        super().__init__(f"{reason} (at byte {offset})")
        self.reason = reason
        self.offset = offset
        self.kind = kind
        self.length = length
        self.limit = limit
        self.complete = complete


class LengthPrefixReader:
    """Split a byte stream into length-prefixed payloads, with a bound on each.

    Each unit is a length in the format of ``prefix`` (say ``struct.Struct(">I")``)
    followed by that many payload bytes; ``feed`` returns the payloads, as
    ``bytes``, without their prefixes. A declared length over ``max_length``
    raises `LengthPrefixError` as soon as the prefix is complete, before one
    payload byte is kept.

    The limit may change between feeds (a protocol that negotiates its frame
    size sets it then): it applies to every prefix read afterwards. A unit
    whose prefix was accepted but whose payload is still arriving keeps the
    limit it was accepted under, so tightening never rejects it half-way
    (the RabbitMQ stream parser behaves the same). After an error the reader
    is dead: every call raises it again.

    Memory: at most one accepted unit (its prefix plus up to ``max_length``
    bytes) plus the chunk being fed. Each payload is copied once out of the
    input; when nothing is buffered the payloads are sliced straight from the
    chunk, so the common case of whole units per read costs one copy.

    Args:
        prefix: The length's format, precompiled; unsigned formats are usual
            (a negative length from a signed one is a ``bad-length`` error).
        max_length: Largest payload accepted, in bytes; None for no limit.
    """

    __slots__ = ("_buf", "_error", "_max_length", "_need", "_offset", "_size", "_unpack")

    def __init__(self, prefix: struct.Struct, max_length: int | None) -> None:
        self._size = prefix.size
        self._unpack = prefix.unpack_from
        self._max_length: int | None = None
        self.max_length = max_length
        self._buf = bytearray()
        self._offset = 0  # stream offset of self._buf[0]
        # The declared length of an accepted unit whose payload is incomplete
        # (its prefix still sits at the start of the buffer), or -1.
        self._need = -1
        self._error: LengthPrefixError | None = None

    @property
    def max_length(self) -> int | None:
        """Largest payload accepted from the next prefix on; None for no limit."""
        return self._max_length

    @max_length.setter
    def max_length(self, value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError("a length limit must not be negative")
        self._max_length = value

    @property
    def pending(self) -> int:
        """Bytes held of an incomplete unit; zero exactly between units."""
        return len(self._buf)

    @property
    def offset(self) -> int:
        """Stream offset just past the last complete unit returned."""
        return self._offset

    def feed(self, data: bytes) -> list[bytes]:
        """Add data; return the payloads of the units it completed, in order.

        Returns:
            The payloads; an empty list when more data is needed.

        Raises:
            LengthPrefixError: A refused length; the payloads completed before
                it are in its ``complete``.
        """
        if self._error is not None:
            raise self._error
        out: list[bytes] = []
        buf = self._buf
        try:
            if buf:
                buf += data
                with memoryview(buf) as view:
                    pos = self._split(view, out)
                del buf[:pos]
            else:
                pos = self._split(data, out)
                if pos < len(data):
                    buf += memoryview(data)[pos:]
        except LengthPrefixError as exc:
            # The units before it were consumed: offsets stay exact for them.
            self._offset = exc.offset
            self._error = LengthPrefixError(
                exc.reason, offset=exc.offset, kind=exc.kind, length=exc.length, limit=exc.limit
            )
            self._buf = bytearray()
            raise
        self._offset += pos
        return out

    def _split(self, source: bytes | memoryview, out: list[bytes]) -> int:
        """Append the payloads complete in ``source`` to ``out``; return the bytes consumed."""
        pos = 0
        end = len(source)
        size = self._size
        unpack = self._unpack
        limit = self._max_length
        append = out.append
        need = self._need
        while True:
            if need < 0:
                if end - pos < size:
                    break
                (need,) = unpack(source, pos)
                if need < 0 or (limit is not None and need > limit):
                    raise self._refused(need, pos, out)
            stop = pos + size + need
            if stop > end:
                break
            # bytes() of a bytes slice is that slice: one copy either way.
            append(bytes(source[pos + size : stop]))
            pos = stop
            need = -1
        self._need = need
        return pos

    def _refused(self, length: int, pos: int, complete: list[bytes]) -> LengthPrefixError:
        """The error for a declared ``length`` at ``pos`` of the current input."""
        offset = self._offset + pos
        limit = self._max_length
        if length < 0:
            return LengthPrefixError(
                f"negative length {length}",
                offset=offset,
                kind="bad-length",
                length=length,
                limit=limit,
                complete=complete,
            )
        return LengthPrefixError(
            f"declared length {length} is over the {limit}-byte limit",
            offset=offset,
            kind="too-large",
            length=length,
            limit=limit,
            complete=complete,
        )
