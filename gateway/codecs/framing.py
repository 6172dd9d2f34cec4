"""Framing helpers shared by the codecs: one implementation of each.

So far: LF-delimited lines with a hard length cap (SSMP). Netstrings, length
prefixes and short strings join this module when their protocols arrive;
codecs compose them instead of writing their own parse loops.
"""

from __future__ import annotations

__all__ = ["LineSplitter", "LineTooLongError"]


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
