"""Control characters made visible: `gateway.codecs.escaping`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs.escaping import escape_controls, quote_bytes

CONTROLS = [chr(code) for code in [*range(0x20), *range(0x7F, 0xA0)]] + [
    "\u2028",
    "\u2029",
    "\u202a",
    "\u202e",
    "\u2066",
    "\u2069",
]
"""Everything `escape_controls` escapes: C0, DEL, C1, line/paragraph separators, bidi."""


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("\x1b[2J\x1b[31mroot\r\nFORGED", "\\x1b[2J\\x1b[31mroot\\r\\nFORGED"),
        ("a\tb\x00c\x07d\x7f", "a\\tb\\x00c\\x07d\\x7f"),
        ("\x85\x9b", "\\x85\\x9b"),
        ("one\u2028two\u2029three", "one\\u2028two\\u2029three"),
        ("\u202eevil", "\\u202eevil"),
    ],
)
def test_controls_become_python_style_escapes(text: str, escaped: str) -> None:
    r"""Each control character is written as ``\xNN``, ``\uNNNN`` or its short name."""
    assert escape_controls(text) == escaped


def test_other_text_is_left_alone() -> None:
    """Printable ASCII, backslashes and other Unicode (accents, CJK, emoji) pass unchanged."""
    text = "plain C:\\path \\x1b é 漢字 🙂 \u00a0"
    assert escape_controls(text) is text


def test_keep_newlines_escapes_all_but_lf() -> None:
    """``keep_newlines`` keeps LF (a traceback's lines) and still escapes CR and ESC."""
    assert escape_controls("a\nb\r\x1bc", keep_newlines=True) == "a\nb\\r\\x1bc"


@given(st.text())
def test_escaped_text_holds_no_control(text: str) -> None:
    """Whatever the input, the output holds none of the escaped characters."""
    assert not set(escape_controls(text)) & set(CONTROLS)


@given(st.text())
def test_escaping_twice_changes_nothing(text: str) -> None:
    """Escaped text has nothing left to escape."""
    once = escape_controls(text)
    assert escape_controls(once) == once


def test_quote_bytes_escapes_controls_and_non_ascii() -> None:
    """Peer bytes are quoted as ASCII: controls and bytes past 0x7f as escapes, cut with ``...``."""
    assert quote_bytes(b"\x1b[31mroot\r\xff", 64) == "'\\x1b[31mroot\\r\\xff'"
    assert quote_bytes(b"abcdef", 3) == "'abc'..."
    assert quote_bytes(b"", 3) == "''"
