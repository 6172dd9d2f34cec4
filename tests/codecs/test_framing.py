"""Tests for `gateway.codecs.framing`: the bounded line splitter and netstrings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.codecs.framing import (
    MAX_LENGTH_DIGITS,
    LineSplitter,
    LineTooLongError,
    NetstringError,
    NetstringReader,
    OversizedNetstring,
    encode_netstring,
    encode_netstrings,
    split_netstrings,
)
from tests.codec_checks import (
    assert_events_or_error,
    assert_split_error,
    assert_split_invariant,
    chunkings,
    feed,
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


# --- netstrings ----------------------------------------------------------------
# http://cr.yp.to/proto/netstrings.txt: ``[len] ":" [bytes] ","``, len in
# ASCII decimal without leading zeros.


class _NetstringFailedError(Exception):
    """`NetstringError` with the ``events`` attribute that the codec checks read."""

    def __init__(self, cause: NetstringError) -> None:
        super().__init__(str(cause))
        self.events = list(cause.complete)
        self.kind = cause.kind
        self.offset = cause.offset


class _ReaderDecoder:
    """`NetstringReader` under the codec surface that `tests.codec_checks` drives."""

    def __init__(
        self, max_length: int = 64, peek_bytes: int = 8, *, refuse_oversized: bool = False
    ) -> None:
        self.reader = NetstringReader(max_length, peek_bytes, refuse_oversized=refuse_oversized)

    def receive_data(self, data: bytes) -> Sequence[object]:
        """Feed the reader; its items are the events, its refusal the error."""
        try:
            return self.reader.feed(data)
        except NetstringError as exc:
            raise _NetstringFailedError(exc) from exc


def _small_reader() -> _ReaderDecoder:
    """A reader keeping up to 16 bytes and the first 4 bytes of larger netstrings."""
    return _ReaderDecoder(16, 4)


@pytest.mark.parametrize(
    ("payload", "wire"),
    [
        (b"", b"0:,"),
        (b"hello world!", b"12:hello world!,"),
        (b"1:a,", b"4:1:a,,"),
        (b"\x00:,\xff", b"4:\x00:,\xff,"),
        (b"x" * 1000, b"1000:" + b"x" * 1000 + b","),
    ],
)
def test_encode_netstring(payload: bytes, wire: bytes) -> None:
    """A netstring is the decimal length, ``:``, the bytes as they are, ``,``."""
    assert encode_netstring(payload) == wire
    assert split_netstrings(wire) == [payload]


def test_encode_netstrings_is_a_block() -> None:
    """`encode_netstrings` gives the netstring of the parts' netstrings (a QMQP block)."""
    assert encode_netstrings([b"A", b"myusername", b"the_password"]) == (
        b"34:1:A,10:myusername,12:the_password,,"
    )
    assert encode_netstrings(iter([b"A", b"0"])) == b"8:1:A,1:0,,"
    assert encode_netstrings([]) == b"0:,"
    assert encode_netstrings([b""]) == b"3:0:,,"


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.binary(max_size=300), max_size=10))
def test_encode_split_round_trip(parts: list[bytes]) -> None:
    """Any payloads, encoded back to back, split back into the same payloads.

    The block form is the netstring of that concatenation, built in one go.
    """
    inner = b"".join(encode_netstring(part) for part in parts)
    assert split_netstrings(inner) == parts
    assert split_netstrings(memoryview(inner)) == parts
    assert encode_netstrings(parts) == encode_netstring(inner)
    [block] = split_netstrings(encode_netstrings(parts))
    assert split_netstrings(block) == parts


def test_split_empty_and_zero_length() -> None:
    """No data is no netstrings; ``0:,`` is one empty netstring, valid."""
    assert split_netstrings(b"") == []
    assert split_netstrings(b"0:,") == [b""]
    assert split_netstrings(b"0:,0:,1:0,") == [b"", b"", b"0"]


def test_split_accepts_a_memoryview() -> None:
    """`split_netstrings` reads a memoryview slice and returns bytes."""
    data = memoryview(b"xx2:ab,0:,yy")[2:-2]
    parts = split_netstrings(data)
    assert parts == [b"ab", b""]
    assert all(type(part) is bytes for part in parts)


SPLIT_ERRORS: list[tuple[bytes, str, int, list[bytes]]] = [
    (b":a,", "bad-length", 0, []),
    (b"x", "bad-length", 0, []),
    (b"-1:a,", "bad-length", 0, []),
    (b"+1:a,", "bad-length", 0, []),
    (b" 1:a,", "bad-length", 0, []),
    (b"\xd9\xa1:a,", "bad-length", 0, []),
    (b"1:a, 1:b,", "bad-length", 4, [b"a"]),
    (b"1:a,x", "bad-length", 4, [b"a"]),
    (b"01:a,", "leading-zero", 0, []),
    (b"00:,", "leading-zero", 0, []),
    (b"0:,007:abcdefg,", "leading-zero", 3, [b""]),
    (b"1a:a,", "missing-colon", 1, []),
    (b"1 :a,", "missing-colon", 1, []),
    (b"1_0:aaaaaaaaaa,", "missing-colon", 1, []),
    (b"0,", "missing-colon", 1, []),
    (b"1:a;", "missing-comma", 3, []),
    (b"1:ab,", "missing-comma", 3, []),
    (b"2:ab,0:a", "missing-comma", 7, [b"ab"]),
    (b"12345678901:", "length-too-long", MAX_LENGTH_DIGITS, []),
    (b"1" * 100, "length-too-long", MAX_LENGTH_DIGITS, []),
    (b"1:a,2:b", "truncated", 4, [b"a"]),
    (b"1:a,2:bc", "truncated", 4, [b"a"]),
    (b"1:a,2", "truncated", 4, [b"a"]),
    (b"1:a,2:", "truncated", 4, [b"a"]),
    (b"1234567890:", "truncated", 0, []),
]


@pytest.mark.parametrize(("data", "kind", "offset", "complete"), SPLIT_ERRORS)
def test_split_refuses(data: bytes, kind: str, offset: int, complete: list[bytes]) -> None:
    """Every defect raises `NetstringError` naming it, its offset and the parts before it.

    Lengths are ASCII digits only (no sign, space, underscore or non-ASCII
    digit, which ``int()`` would take), without leading zeros, at most ten;
    the colon and the comma are checked; data ending inside a netstring is
    ``truncated``.
    """
    with pytest.raises(NetstringError) as info:
        split_netstrings(data)
    assert info.value.kind == kind
    assert info.value.offset == offset
    assert list(info.value.complete) == complete
    assert info.value.reason
    assert f"at byte {offset}" in str(info.value)


@settings(max_examples=300, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=60),
        st.lists(st.sampled_from([b"1", b"0", b":", b",", b"a", b"12"]), max_size=30).map(b"".join),
    )
)
def test_split_garbage(data: bytes) -> None:
    """Arbitrary bytes split into payloads that encode back to them, or raise `NetstringError`."""
    try:
        parts = split_netstrings(data)
    except NetstringError as exc:
        assert 0 <= exc.offset <= len(data)
        consumed = b"".join(
            encode_netstring(part) for part in exc.complete if isinstance(part, bytes)
        )
        assert data.startswith(consumed)
        return
    assert b"".join(encode_netstring(part) for part in parts) == data


STREAM_PARTS = [b"", b"abc", b"1:a,", b"\x00:,\xff\n", b"x" * 16, b"0", b":", b","]
STREAM = b"".join(encode_netstring(part) for part in STREAM_PARTS)


def test_reader_split_invariant() -> None:
    """Netstrings come out the same whole, one byte at a time, cut anywhere, with a tail left."""
    assert_split_invariant(
        _small_reader,
        STREAM,
        STREAM_PARTS,
        trailing=[b"1", b"16", b"16:", b"3:ab", b"3:abc", b"0:", b"20:xy"],
    )


def test_reader_oversized_split_invariant() -> None:
    """Oversized netstrings come out as the same records, with the same heads, however cut."""
    data = (
        b"2:ok,"
        + encode_netstring(b"abcdefghijklmnopq")
        + b"0:,"
        + encode_netstring(b"1:M,2:id," + b"z" * 30)
        + encode_netstring(b"y" * 16)
    )
    expected = [
        b"ok",
        OversizedNetstring(head=b"abcd", length=17),
        b"",
        OversizedNetstring(head=b"1:M,", length=39),
        b"y" * 16,
    ]
    assert_split_invariant(_small_reader, data, expected, trailing=[b"17:abcdefgh", b"99:"])


def test_reader_peek_larger_than_the_limit() -> None:
    """With ``peek_bytes`` above ``max_length`` an oversized payload is kept whole in its head."""
    reader = NetstringReader(4, peek_bytes=8)
    assert reader.feed(b"6:abcdef,4:abcd,") == [
        OversizedNetstring(head=b"abcdef", length=6),
        b"abcd",
    ]


def test_reader_need_more_is_not_an_error() -> None:
    """Partial netstrings give no items and stay pending; ``pending`` is zero between items."""
    reader = NetstringReader(64)
    assert reader.pending == 0
    assert reader.feed(b"1") == []
    assert reader.pending == 1
    assert reader.feed(b"2:hello") == []
    assert reader.pending == 8
    assert reader.feed(b"") == []
    assert reader.feed(b" world!") == []
    assert reader.feed(b",0:") == [b"hello world!"]
    assert reader.pending == 2
    assert reader.feed(b",") == [b""]
    assert reader.pending == 0


def test_reader_pending_while_skipping() -> None:
    """While an oversized netstring is skipped, ``pending`` counts its header and kept head only.

    It is never zero until the netstring ends, so a stream that stops inside
    a skipped netstring is still seen as truncated, even with no head kept.
    """
    reader = NetstringReader(4, peek_bytes=0)
    assert reader.feed(b"10:") == []
    assert reader.pending == 3
    assert reader.feed(b"0123456789") == []
    assert reader.pending == 3
    assert reader.feed(b",") == [OversizedNetstring(head=b"", length=10)]
    assert reader.pending == 0
    reader = NetstringReader(4, peek_bytes=2)
    assert reader.feed(b"10:012345") == []
    assert reader.pending == 5


def test_zero_length_netstring_is_valid() -> None:
    """``0:,`` is the empty netstring, and a reader returns it as empty bytes."""
    assert NetstringReader(0).feed(b"0:,0:,") == [b"", b""]


READER_ERRORS: list[tuple[bytes, str, int, list[object]]] = [
    (b"3:abc,x", "bad-length", 6, [b"abc"]),
    (b"3:abc,:", "bad-length", 6, [b"abc"]),
    (b"3:abc,01:", "leading-zero", 6, [b"abc"]),
    (b"00", "leading-zero", 0, []),
    (b"3:abc,1a", "missing-colon", 7, [b"abc"]),
    (b"0;", "missing-colon", 1, []),
    (b"3:abc;", "missing-comma", 5, []),
    (b"2:ab,3:abcd", "missing-comma", 10, [b"ab"]),
    (b"0:,12345678901", "length-too-long", 3 + MAX_LENGTH_DIGITS, [b""]),
    (b"20:" + b"x" * 20 + b";", "missing-comma", 23, []),
    (b"2:ok,20:" + b"x" * 20 + b"0:,", "missing-comma", 28, [b"ok"]),
]


@pytest.mark.parametrize(("data", "kind", "offset", "complete"), READER_ERRORS)
def test_reader_refuses(data: bytes, kind: str, offset: int, complete: list[object]) -> None:
    """Every defect fails the same way however the stream is cut, with the items before it.

    The offset counts from the first byte of the stream, across feeds.
    """
    errors = assert_split_error(_small_reader, data, _NetstringFailedError, complete)
    for exc in errors:
        assert isinstance(exc, _NetstringFailedError)
        assert exc.kind == kind
        assert exc.offset == offset


def test_digit_bound_before_the_colon() -> None:
    """(5) Ten digits may still become a header; the eleventh fails without waiting for ``:``."""
    reader = NetstringReader(1 << 30)
    assert reader.feed(b"9" * MAX_LENGTH_DIGITS) == []
    with pytest.raises(NetstringError) as info:
        reader.feed(b"9")
    assert info.value.kind == "length-too-long"
    assert info.value.offset == MAX_LENGTH_DIGITS


def test_hundred_digit_length_fails_at_once() -> None:
    """(5) A 100-digit length fails in the feed that brings it, nothing buffered."""
    reader = NetstringReader(1 << 30)
    with pytest.raises(NetstringError) as info:
        reader.feed(b"1" * 100)
    assert info.value.kind == "length-too-long"
    assert reader.pending == 0


def test_ten_digit_length_is_a_length() -> None:
    """A ten-digit length is read: far over the limit, its netstring is skipped, not refused."""
    reader = NetstringReader(64, peek_bytes=2)
    assert reader.feed(b"9999999999:ab") == []
    assert reader.pending == 13


def test_leading_zero_refused_before_the_colon() -> None:
    """``0`` may be a whole length; a digit after it fails at once."""
    reader = NetstringReader(64)
    assert reader.feed(b"0") == []
    with pytest.raises(NetstringError) as info:
        reader.feed(b"7")
    assert info.value.kind == "leading-zero"
    assert info.value.offset == 0


def test_oversized_skipped_in_bounded_memory() -> None:
    """(5) A 10 MB netstring over a 1 MiB limit streams through in 64 KB chunks.

    Only its first ``peek_bytes`` are kept: ``pending`` never passes the
    head plus its header, and the netstring after it is read normally.
    """
    size = 10_000_000
    payload = bytes(range(256)) * (size // 256) + b"\x01" * (size % 256)
    data = encode_netstring(payload) + b"2:ok,"
    reader = NetstringReader(1 << 20, peek_bytes=4096)
    items: list[object] = []
    most = 0
    chunk = 64 * 1024
    for start in range(0, len(data), chunk):
        items += reader.feed(data[start : start + chunk])
        most = max(most, reader.pending)
    assert items == [OversizedNetstring(head=payload[:4096], length=size), b"ok"]
    assert most <= 4096 + MAX_LENGTH_DIGITS + 1
    assert reader.pending == 0


def test_refusing_reader_fails_before_the_colon() -> None:
    """(5) A refusing reader fails once the digits read exceed the limit, before ``:``."""
    reader = NetstringReader(100, refuse_oversized=True)
    assert reader.feed(b"10") == []
    with pytest.raises(NetstringError) as info:
        reader.feed(b"1")
    assert info.value.kind == "too-large"
    assert "100-byte limit" in info.value.reason
    reader = NetstringReader(100, refuse_oversized=True)
    with pytest.raises(NetstringError) as info:
        reader.feed(b"2:ok,1000")
    assert info.value.complete == [b"ok"]
    assert info.value.offset == 5
    reader = NetstringReader(100, refuse_oversized=True)
    assert reader.feed(b"100:") == []
    assert reader.feed(b"x" * 100 + b",") == [b"x" * 100]
    with pytest.raises(NetstringError) as info:
        NetstringReader(100, refuse_oversized=True).feed(b"101:")
    assert info.value.kind == "too-large"


def test_reader_dead_after_error() -> None:
    """After an error every feed raises it again, without items, and nothing is buffered."""
    reader = NetstringReader(64)
    with pytest.raises(NetstringError) as first:
        reader.feed(b"1:a,1:b;")
    assert first.value.complete == [b"a"]
    for data in [b"", b"1:c,"]:
        with pytest.raises(NetstringError) as again:
            reader.feed(data)
        assert again.value.kind == first.value.kind
        assert again.value.offset == first.value.offset
        assert list(again.value.complete) == []
    assert reader.pending == 0


def test_reader_offsets_span_feeds() -> None:
    """Error offsets count every byte fed, not the bytes still buffered."""
    reader = NetstringReader(64)
    assert reader.feed(b"3:abc,") == [b"abc"]
    assert reader.feed(b"2:x") == []
    with pytest.raises(NetstringError) as info:
        reader.feed(b"yz")
    assert info.value.offset == 10
    assert info.value.kind == "missing-comma"


def test_reader_limits_must_not_be_negative() -> None:
    """Negative limits are refused at construction."""
    with pytest.raises(ValueError):
        NetstringReader(-1)
    with pytest.raises(ValueError):
        NetstringReader(1, peek_bytes=-1)


_PARTS = st.one_of(st.binary(max_size=16), st.binary(min_size=17, max_size=60))


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_PARTS, max_size=10), data=st.data())
def test_reader_random_cuts(parts: list[bytes], data: st.DataObject) -> None:
    """(3) Any netstrings, cut at random points, give their payloads or oversized records."""
    stream = b"".join(encode_netstring(part) for part in parts)
    expected = [
        part if len(part) <= 16 else OversizedNetstring(head=part[:4], length=len(part))
        for part in parts
    ]
    decoder = _small_reader()
    assert feed(decoder, data.draw(chunkings(stream, max_cuts=16))) == expected
    assert decoder.reader.pending == 0


_GARBAGE = st.one_of(
    st.binary(max_size=80),
    st.lists(
        st.one_of(
            st.sampled_from([b"0:,", b"1:", b"17:", b"99", b":", b",", b"2:ab,"]),
            st.binary(max_size=4),
        ),
        max_size=30,
    ).map(b"".join),
)


@settings(max_examples=300, deadline=None)
@given(garbage=_GARBAGE, refuse=st.booleans(), data=st.data())
def test_reader_garbage(garbage: bytes, refuse: bool, data: st.DataObject) -> None:
    """(4) Arbitrary bytes give items or `NetstringError`, and the buffer stays bounded.

    Between feeds a reader holds at most one netstring of ``max_length``
    with its header, or a kept head with its header.
    """
    reader = NetstringReader(16, 4, refuse_oversized=refuse)
    for chunk in data.draw(chunkings(garbage)):
        try:
            items = reader.feed(chunk)
        except NetstringError:
            with pytest.raises(NetstringError):
                reader.feed(b"")
            return
        assert all(isinstance(item, bytes | OversizedNetstring) for item in items)
        assert reader.pending <= 16 + MAX_LENGTH_DIGITS + 1
    assert_events_or_error(
        lambda: _ReaderDecoder(16, 4, refuse_oversized=refuse), [garbage], _NetstringFailedError
    )
