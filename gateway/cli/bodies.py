"""What a sender sends: message bodies from its arguments, files or standard input.

Senders take message bodies from their arguments, from files (``--file``,
one message per file) or, given neither, from standard input, one message
per line (`add_body_arguments`, `message_bodies`); ``--count N`` goes round
them as often as needed.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gateway.cli.errors import CommandError

__all__ = [
    "Bodies",
    "add_body_arguments",
    "message_bodies",
]


def add_body_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``BODY`` operands and ``--file PATH`` (see `message_bodies`)."""
    parser.add_argument(
        "bodies",
        nargs="*",
        metavar="BODY",
        help="message bodies, one message each; with no BODY and no --file, every line"
        " of standard input is one message",
    )
    parser.add_argument(
        "--file",
        dest="files",
        action="append",
        default=[],
        metavar="PATH",
        help="send the whole content of PATH as one message (repeatable)",
    )


@dataclass(frozen=True, slots=True)
class Bodies:
    """The message bodies a sender sends, in order, read as they are taken.

    Attributes:
        items: The bodies.
        total: How many there are, when known before reading standard input.
    """

    items: Iterable[bytes]
    total: int | None


def _file_bodies(paths: Sequence[str]) -> Iterator[bytes]:
    for path in paths:
        try:
            yield Path(path).read_bytes()
        except OSError as exc:
            raise CommandError(f"{path}: {exc.strerror or exc}") from None


def _line_bodies(stream: IO[bytes]) -> Iterator[bytes]:
    for line in stream:
        yield line.rstrip(b"\n").removesuffix(b"\r")


def message_bodies(args: argparse.Namespace, stdin: IO[bytes]) -> Bodies:
    """The bodies `add_body_arguments` and ``--count`` ask for.

    The ``BODY`` operands (as UTF-8, or the bytes the shell gave), then
    each ``--file`` whole; with neither, every line of ``stdin`` without its
    line end. With ``--count N``, N bodies, going round those.

    Raises:
        CommandError: A file cannot be read (when it is reached).
    """
    given: list[bytes] = [os.fsencode(text) for text in args.bodies]
    if given or args.files:
        source: Iterable[bytes] = itertools.chain(given, _file_bodies(args.files))
        known: int | None = len(given) + len(args.files)
    else:
        source = _line_bodies(stdin)
        known = None
    if args.count:
        return Bodies(itertools.islice(itertools.cycle(source), args.count), args.count)
    return Bodies(source, known)
