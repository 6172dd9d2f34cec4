"""Tests for `gateway.codecs.framing.LineSplitter`, the bounded line splitter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.codecs.framing import LineSplitter, LineTooLongError
from tests.codec_checks import (
    assert_split_error,
    assert_split_invariant,
    chunkings,
)

CAP = 1024


class _TooLongError(Exception):
    """`LineTooLongError` with the ``events`` attribute that the codec checks read."""

    def __init__(self, cause: LineTooLongError) -> None:
        super().__init__(str(cause))
        self.events = cause.complete
        self.length = cause.length


class _SplitterDecoder:
    """`LineSplitter` under the codec surface that `tests.codec_checks` drives."""

    def __init__(self, max_line_bytes: int = CAP, delimiter: bytes = b"\n") -> None:
        self.splitter = LineSplitter(max_line_bytes, delimiter)

    def receive_data(self, data: bytes) -> Sequence[object]:
        """Feed the splitter; its lines are the events, its refusal the error."""
        try:
            return self.splitter.feed(data)
        except LineTooLongError as exc:
            raise _TooLongError(exc) from exc


def _crlf_decoder() -> _SplitterDecoder:
    """A splitter on CRLF with a 10-byte cap, CRLF included."""
    return _SplitterDecoder(10, b"\r\n")


def test_split_invariant() -> None:
    """Lines come out the same whole, one byte at a time, cut anywhere, with a tail left."""
    data = b"first\n\nthird line \x00\r\xff\n" + b"x" * (CAP - 1) + b"\n"
    expected = [b"first", b"", b"third line \x00\r\xff", b"x" * (CAP - 1)]
    assert_split_invariant(
        _SplitterDecoder, data, expected, trailing=[b"n", b"next line", b"y" * (CAP - 1)]
    )


def test_empty_lines_are_lines() -> None:
    """The splitter does not judge content: consecutive LFs give empty lines."""
    assert LineSplitter(CAP).feed(b"\n\n") == [b"", b""]


def test_need_more_data_is_not_an_error() -> None:
    """Bytes without a delimiter give no lines and stay pending."""
    splitter = LineSplitter(CAP)
    assert splitter.feed(b"abc") == []
    assert splitter.feed(b"") == []
    assert splitter.pending == 3
    assert splitter.feed(b"d\ne") == [b"abcd"]
    assert splitter.pending == 1


def test_line_at_the_cap_is_accepted() -> None:
    """1,023 content bytes plus the LF make 1,024 bytes: exactly the cap, accepted."""
    line = b"x" * (CAP - 1)
    assert_split_invariant(_SplitterDecoder, line + b"\n", [line])


def test_line_over_the_cap_is_refused() -> None:
    """1,024 content bytes plus the LF pass the cap, however the input is cut."""
    errors = assert_split_error(_SplitterDecoder, b"x" * CAP + b"\n", _TooLongError, [])
    assert all(isinstance(exc, _TooLongError) and exc.length >= CAP + 1 for exc in errors)


def test_partial_line_refused_at_the_cap_without_its_lf() -> None:
    """A partial line fails once 1,024 bytes are buffered, without waiting for the LF."""
    splitter = LineSplitter(CAP)
    assert splitter.feed(b"x" * (CAP - 1)) == []
    with pytest.raises(LineTooLongError) as info:
        splitter.feed(b"x")
    assert info.value.complete == []
    assert info.value.length == CAP + 1


def test_oversize_partial_line_in_one_chunk() -> None:
    """A chunk holding a good line and 1,024 bytes of the next refuses the second at once."""
    with pytest.raises(LineTooLongError) as info:
        LineSplitter(CAP).feed(b"good\n" + b"x" * CAP)
    assert info.value.complete == [b"good"]


def test_lines_before_an_oversize_line_are_reported() -> None:
    """The good lines before an oversize one are in the exception, split or whole."""
    data = b"one\ntwo\n" + b"x" * (CAP + 10) + b"\nafter\n"
    assert_split_error(_SplitterDecoder, data, _TooLongError, [b"one", b"two"])


def test_complete_oversize_line_after_good_lines() -> None:
    """An oversize complete line in the middle of a batch reports the lines before it only."""
    with pytest.raises(LineTooLongError) as info:
        LineSplitter(CAP).feed(b"a\n" + b"x" * CAP + b"\nb\n")
    assert info.value.complete == [b"a"]
    assert info.value.length == CAP + 1


def test_nothing_kept_after_an_oversize_line() -> None:
    """After refusing a line the splitter holds no bytes."""
    splitter = LineSplitter(CAP)
    with pytest.raises(LineTooLongError):
        splitter.feed(b"x" * (CAP + 5))
    assert splitter.pending == 0


def test_cap_must_leave_room_for_content() -> None:
    """A cap below 2 bytes cannot hold one byte and the LF: refused at construction."""
    with pytest.raises(ValueError):
        LineSplitter(1)


def test_smallest_cap() -> None:
    """With a 2-byte cap one content byte fits and two do not."""
    assert LineSplitter(2).feed(b"a\n\n") == [b"a", b""]
    with pytest.raises(LineTooLongError):
        LineSplitter(2).feed(b"ab")


def test_multibyte_delimiter_split_invariant() -> None:
    """A CRLF splitter gives the same lines however the input is cut, even inside a CRLF."""
    data = b"12345678\r\nab\r\n\r\nc\rd\r\n"
    assert_split_invariant(
        _crlf_decoder, data, [b"12345678", b"ab", b"", b"c\rd"], trailing=[b"\r", b"1234567\r"]
    )


def test_multibyte_delimiter_partial_at_the_cap() -> None:
    r"""A partial line ending in the first delimiter byte may still fit; one more byte cannot.

    With a 10-byte cap on CRLF lines, ``12345678\r`` can still become a
    10-byte line; ``12345678\rx`` or ``123456789`` cannot.
    """
    splitter = LineSplitter(10, b"\r\n")
    assert splitter.feed(b"12345678\r") == []
    assert splitter.feed(b"\n") == [b"12345678"]
    with pytest.raises(LineTooLongError):
        LineSplitter(10, b"\r\n").feed(b"12345678\rx")
    with pytest.raises(LineTooLongError):
        LineSplitter(10, b"\r\n").feed(b"123456789")


def test_multibyte_delimiter_over_the_cap() -> None:
    """A CRLF line of 11 bytes is refused under a 10-byte cap, however it is cut."""
    assert_split_error(_crlf_decoder, b"ok\r\n123456789\r\n", _TooLongError, [b"ok"])


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=12),
    tail=st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")),
    data=st.data(),
)
def test_random_cuts_give_the_same_lines(
    lines: list[bytes], tail: bytes, data: st.DataObject
) -> None:
    """Lines joined with LFs, cut at random points, come back as the same lines."""
    stream = b"".join(line + b"\n" for line in lines) + tail
    chunks = data.draw(chunkings(stream))
    splitter = LineSplitter(64)
    got = [line for chunk in chunks for line in splitter.feed(chunk)]
    assert got == lines
    assert splitter.pending == len(tail)


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\x01", b"\n")), max_size=20)
)
def test_buffer_stays_bounded(chunks: list[bytes]) -> None:
    """Whatever arrives, the buffer never holds more than the cap less one byte.

    Each call returns lines that fit the cap or raises `LineTooLongError`;
    nothing else escapes.
    """
    cap = 16
    splitter = LineSplitter(cap)
    for chunk in chunks:
        try:
            lines = splitter.feed(chunk)
        except LineTooLongError as exc:
            lines = exc.complete
        assert all(len(line) < cap for line in lines)
        assert splitter.pending <= cap - 1
