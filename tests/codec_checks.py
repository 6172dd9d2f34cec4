"""Checks shared by the tests of every byte-stream codec (STYLE.md, section 7).

A codec here is anything with ``receive_data(data: bytes)`` returning the
events completed so far and raising its own error family on bad input, with
the events decoded before the bad unit in the error's ``events``. The helpers
take a factory for a fresh codec, so that each way of feeding the input starts
from a clean state:

- `assert_split_invariant`: the input decoded whole, one byte at a time, cut
  in two at every point, and with the first bytes of a next unit left over,
  always gives the same events (family 2).
- `assert_split_error`: bad input fails the same way however it is cut, with
  the same events before the error.
- `assert_truncation_reported`: the end-of-input call reports a partial unit
  and accepts a clean end.
- `assert_events_or_error`: arbitrary bytes give events or the codec's own
  error, nothing else, and the codec stays dead after an error (family 4).
- `chunkings` and `split_at`: cut an input at random points in hypothesis
  tests (family 3).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

from hypothesis import strategies as st

__all__ = [
    "EVERY_CUT_MAX_BYTES",
    "Decoder",
    "assert_events_or_error",
    "assert_split_error",
    "assert_split_invariant",
    "assert_truncation_reported",
    "chunkings",
    "feed",
    "split_at",
    "ways_to_feed",
]

EVERY_CUT_MAX_BYTES = 4096
"""Longest input cut in two at every point; past it, cuts are sampled evenly.

Each cut decodes the whole input again, so the work is quadratic; a few KB
keep a check well under a second.
"""


class Decoder(Protocol):
    """The decoding half of a byte-stream codec, as these checks use it."""

    def receive_data(self, data: bytes) -> Sequence[object]:
        """Return the events ``data`` completes; raise the codec's error on bad input."""
        ...


CodecT = TypeVar("CodecT", bound=Decoder)


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    """Cut ``data`` at the given offsets (in any order, repeats allowed).

    Args:
        data: The bytes to cut.
        cuts: Offsets between 0 and ``len(data)``; each starts a new chunk.

    Returns:
        The chunks, in order; joined, they give ``data`` back. Empty chunks
        appear where offsets repeat or sit at either end, which exercises a
        codec's handling of ``receive_data(b"")``.
    """
    points = [0, *sorted(cuts), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(points)]


def chunkings(data: bytes, *, max_cuts: int = 8) -> st.SearchStrategy[list[bytes]]:
    """Hypothesis strategy: ``data`` cut at up to ``max_cuts`` random points.

    Args:
        data: The bytes to cut.
        max_cuts: Most cut points drawn.

    Returns:
        A strategy for lists of chunks that join back to ``data``.
    """
    offsets = st.lists(st.integers(min_value=0, max_value=len(data)), max_size=max_cuts)
    return offsets.map(lambda cuts: split_at(data, cuts))


def feed(codec: Decoder, chunks: Iterable[bytes]) -> list[object]:
    """Feed chunks to a codec in order and collect every event it returns.

    Errors propagate; use it where the input is known to be good.
    """
    events: list[object] = []
    for chunk in chunks:
        events.extend(codec.receive_data(chunk))
    return events


def ways_to_feed(
    data: bytes, *, every_cut_max_bytes: int = EVERY_CUT_MAX_BYTES
) -> Iterator[tuple[str, list[bytes]]]:
    """Yield the standard ways of cutting ``data``, each with a label for messages.

    Whole; one byte at a time; and in two pieces at every cut point (sampled
    evenly, about ``every_cut_max_bytes`` of them, when the input is longer).
    """
    yield "whole", [data]
    yield "one byte at a time", [data[i : i + 1] for i in range(len(data))]
    step = max(1, len(data) // every_cut_max_bytes)
    for cut in range(0, len(data) + 1, step):
        yield f"cut at {cut}", [data[:cut], data[cut:]]


def assert_split_invariant(
    factory: Callable[[], CodecT],
    data: bytes,
    expected: Sequence[object],
    *,
    trailing: Iterable[bytes] = (),
    every_cut_max_bytes: int = EVERY_CUT_MAX_BYTES,
) -> None:
    """Assert that every way of cutting ``data`` decodes to ``expected``.

    ``data`` is decoded whole, one byte at a time and in two pieces at every
    cut point. Then each entry of ``trailing`` (the first bytes of a next,
    incomplete unit) is appended and the same cuts are made again: the
    incomplete unit must produce nothing and disturb nothing before it.

    Args:
        factory: Makes a fresh codec; called once per way of feeding.
        data: Complete units only.
        expected: The events ``data`` decodes to, in order.
        trailing: Prefixes of a next unit that are not complete units.
        every_cut_max_bytes: See `ways_to_feed`.

    Raises:
        AssertionError: Some cut gave other events; the message names the cut.
    """
    wanted = list(expected)
    for extra in [b"", *trailing]:
        for label, chunks in ways_to_feed(data + extra, every_cut_max_bytes=every_cut_max_bytes):
            got = feed(factory(), chunks)
            assert got == wanted, f"{label} (trailing {extra!r}): {got!r} != {wanted!r}"


def _events_until_error(
    codec: Decoder, chunks: Iterable[bytes], error: type[Exception]
) -> tuple[list[object], Exception | None]:
    """Feed chunks until the codec raises ``error``; return events and the error."""
    events: list[object] = []
    for chunk in chunks:
        try:
            events.extend(codec.receive_data(chunk))
        except error as exc:
            events.extend(getattr(exc, "events", ()))
            return events, exc
    return events, None


def assert_split_error(
    factory: Callable[[], CodecT],
    data: bytes,
    error: type[Exception],
    expected_events: Sequence[object],
    *,
    every_cut_max_bytes: int = EVERY_CUT_MAX_BYTES,
) -> list[Exception]:
    """Assert that every way of cutting bad ``data`` raises ``error`` after the same events.

    The events returned by calls before the failing one plus the error's own
    ``events`` must equal ``expected_events`` for every cut, so no event is
    lost or repeated around the error.

    Args:
        factory: Makes a fresh codec; called once per way of feeding.
        data: Input whose bad unit comes after ``expected_events``.
        error: The codec's remote error class.
        expected_events: The events decoded before the bad unit.
        every_cut_max_bytes: See `ways_to_feed`.

    Returns:
        The errors raised, one per way of feeding, for further checks
        (reason, reply, kind).

    Raises:
        AssertionError: Some cut did not fail, or gave other events.
    """
    wanted = list(expected_events)
    errors: list[Exception] = []
    for label, chunks in ways_to_feed(data, every_cut_max_bytes=every_cut_max_bytes):
        got, exc = _events_until_error(factory(), chunks, error)
        assert exc is not None, f"{label}: no {error.__name__} raised, events {got!r}"
        assert got == wanted, f"{label}: events before the error {got!r} != {wanted!r}"
        errors.append(exc)
    return errors


def assert_truncation_reported(
    factory: Callable[[], CodecT],
    data: bytes,
    partial: bytes,
    end_of_input: Callable[[CodecT], object],
    error: type[Exception],
) -> None:
    """Assert that the end of input is accepted after ``data`` and refused after ``partial``.

    Args:
        factory: Makes a fresh codec.
        data: Complete units (possibly empty): ending here is clean.
        partial: A non-empty prefix of a next unit: ending here is truncation.
        end_of_input: Calls the codec's end-of-input method.
        error: The codec's remote error class.

    Raises:
        AssertionError: A clean end raised, or a truncated one did not.
    """
    clean = factory()
    feed(clean, [data])
    end_of_input(clean)
    truncated = factory()
    feed(truncated, [data, partial])
    try:
        end_of_input(truncated)
    except error:
        return
    raise AssertionError(f"end of input after partial unit {partial!r} was not reported")


def assert_events_or_error(
    factory: Callable[[], CodecT],
    chunks: Iterable[bytes],
    error: type[Exception],
    *,
    event_types: tuple[type, ...] | None = None,
) -> tuple[list[object], Exception | None]:
    """Feed arbitrary chunks; assert only events or ``error`` come out, and dead after error.

    Any other exception propagates and fails the test: that is the point.
    After ``error``, one more call must raise ``error`` again (a dead codec
    never guesses).

    Args:
        factory: Makes a fresh codec.
        chunks: Arbitrary input, already cut.
        error: The codec's remote error class.
        event_types: If given, every event must be an instance of one of them.

    Returns:
        The events decoded (including the error's ``events``) and the error,
        or None when the whole input was accepted.

    Raises:
        AssertionError: An event of another type, or a codec alive after its error.
    """
    codec = factory()
    events, exc = _events_until_error(codec, chunks, error)
    if event_types is not None:
        strays = [event for event in events if not isinstance(event, event_types)]
        assert not strays, f"events of unexpected types: {strays!r}"
    if exc is not None:
        try:
            codec.receive_data(b"")
        except error:
            pass
        else:
            raise AssertionError(f"codec accepted input after {exc!r}")
    return events, exc
