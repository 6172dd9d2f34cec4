r"""Peer text made safe to print: control characters become visible escapes.

A peer's bytes end up in reason texts, replies and log lines. Printed raw, a
control character there moves a terminal's cursor or changes its colours
(ESC, CSI), ends a line early (CR, LF, the Unicode line and paragraph
separators) or reverses what follows (the bidirectional overrides), so one
line could pose as several or hide what it says. `escape_controls` writes
each such character as a Python-style escape (``\x1b``, ``\r``, ``\n``,
``\u2028``) and leaves all other text alone: escaped text is one line and
moves nothing.

Standard library only, so that codecs use it as well as the log format.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["escape_controls", "quote_bytes"]

_NOT_C0: Final = (
    "\x7f"  # DEL
    "\x80-\x9f"  # C1 (NEL, CSI, ...): terminals obey them too
    "\u2028\u2029"  # line and paragraph separators
    "\u202a-\u202e\u2066-\u2069"  # bidirectional embeddings, overrides and isolates
)
_ANY_CONTROL: Final = re.compile(f"[\x00-\x1f{_NOT_C0}]")
_CONTROL_BUT_LF: Final = re.compile(f"[\x00-\x09\x0b-\x1f{_NOT_C0}]")
_NAMED: Final = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    """The visible escape of one control character."""
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character written as a visible escape.

    Backslashes are left as they are: the result is for people and log
    shippers to read, not to be decoded back.

    Args:
        text: Any text, typically holding a peer's input.
        keep_newlines: Leave LF alone (for a traceback's lines); everything
            else is still escaped.

    Returns:
        ``text`` itself when it holds nothing to escape.
    """
    pattern = _CONTROL_BUT_LF if keep_newlines else _ANY_CONTROL
    if pattern.search(text) is None:
        return text
    return pattern.sub(_escape, text)


def quote_bytes(value: bytes, limit: int) -> str:
    r"""Quote peer bytes for a reason text: ``'...'``, ASCII, at most ``limit`` bytes shown.

    Bytes outside ASCII appear as ``\xNN``, control characters as their
    escapes, and ``...`` follows the quote when ``value`` was cut.
    """
    text = escape_controls(value[:limit].decode("ascii", "backslashreplace"))
    return f"'{text}'" + ("..." if len(value) > limit else "")
