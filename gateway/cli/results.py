"""Sender and receiver loops: outcomes printed in sending order, messages until ``--count``.

A sender that lets ``--window`` messages wait for their outcomes prints
those outcomes in the order it sent the messages (`InOrderOutcomes`); a
receiver prints what comes until ``--count`` (`print_received`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Final, TextIO

from gateway.cli.output import Output, reporting

__all__ = [
    "InOrderOutcomes",
    "print_messages",
    "print_received",
]

_SUCCESSES: Final = frozenset({"accepted", "sent"})
"""The outcomes that leave a sender's exit status 0."""


class InOrderOutcomes:
    """Numbered messages' outcomes, printed in the order of their numbers.

    A windowed sender takes a number for each message it sends
    (`take_number`), records each outcome as the server tells it, in any
    order (`settle`; the first word on a number stands), and has those
    next in line printed (`print_ready`); `send_within` is the whole loop.

    Args:
        output: Where each outcome is printed.
        advance: Moves the progress bar on by a number of messages.
        first: The first message's number.
    """

    def __init__(self, output: Output, advance: Callable[[int], object], *, first: int = 1) -> None:
        self._output = output
        self._advance = advance
        self._next_number = first
        self._next_printed = first
        self._settled: dict[int, tuple[str, str, Mapping[str, object]]] = {}
        self.failed = False
        """Whether an outcome printed so far was neither accepted nor sent."""

    @property
    def next_printed(self) -> int:
        """The number whose outcome is printed next."""
        return self._next_printed

    @property
    def last_number(self) -> int:
        """The last number taken (one less than the first while none is)."""
        return self._next_number - 1

    @property
    def waiting(self) -> int:
        """How many messages have a number and no printed outcome."""
        return self._next_number - self._next_printed

    def take_number(self) -> int:
        """The next message's number."""
        number = self._next_number
        self._next_number += 1
        return number

    def settle(self, number: int, outcome: str, text: str, record: Mapping[str, object]) -> None:
        """Record an outcome, its text line and its JSON record (unless one is recorded)."""
        self._settled.setdefault(number, (outcome, text, record))

    def print_ready(self) -> None:
        """Print the outcomes next in line, up to the first not yet settled."""
        while self._next_printed in self._settled:
            outcome, text, record = self._settled.pop(self._next_printed)
            self._next_printed += 1
            self.failed = self.failed or outcome not in _SUCCESSES
            self._output.emit(text, record)
            self._advance(1)

    def send_within(
        self, window: int, send_some: Callable[[], bool], read_answer: Callable[[], None]
    ) -> bool:
        """Send with at most ``window`` waiting; print every outcome; return `failed`.

        Args:
            window: Messages waiting for their outcomes, at most.
            send_some: Sends messages while `waiting` is below ``window``;
                returns True once there is nothing more to send.
            read_answer: Reads one answer from the server and settles what it says.
        """
        exhausted = False
        while not exhausted or self.waiting:
            if not exhausted and self.waiting < window:
                exhausted = send_some()
            elif self._next_printed not in self._settled:
                read_answer()
            self.print_ready()
        return self.failed


def print_messages(
    output: Output,
    advance: Callable[[int], object],
    messages: Iterable[tuple[str, Mapping[str, object]]],
    count: int,
) -> int:
    """Print each message's text line or JSON record as it comes; return how many.

    Args:
        output: Where they go.
        advance: Moves the progress bar on by a number of messages.
        messages: Each message's text and record, read as they are taken.
        count: Stop after this many; 0: when ``messages`` ends.
    """
    seen = 0
    for text, record in messages:
        output.emit(text, record)
        advance(1)
        seen += 1
        if count and seen >= count:
            break
    return seen


def print_received(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    messages: Iterable[tuple[str, Mapping[str, object]]],
) -> int:
    """A receiver's output: `print_messages` until ``--count``, with the progress bar."""
    with reporting(args, out, err, total=args.count or None, desc="received") as output:
        return print_messages(output, output.advance, messages, args.count)
