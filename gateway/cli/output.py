"""What a command writes: text lines or JSON objects, and its progress bar.

Results go to standard output as text lines, or with ``--json`` as one JSON
object per line (`Output`), each flushed as it comes; peer bytes are made
printable (`printable`) or carried in JSON (`body_fields`, `json_value`). A
tqdm progress bar on standard error follows ``--progress`` and
``--force-progress`` (`progress_bar`); `reporting` gives both.
"""

from __future__ import annotations

import argparse
import base64
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Never, TextIO

from tqdm import tqdm

__all__ = [
    "Output",
    "body_fields",
    "json_value",
    "printable",
    "progress_bar",
    "reporting",
]


def printable(data: bytes) -> str:
    """Peer or file bytes as one line of text: UTF-8, anything else escaped."""
    text = data.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def body_fields(body: bytes) -> dict[str, str]:
    """A body for JSON output: ``{"body": text}``, or ``{"body_base64": ...}`` if not UTF-8."""
    try:
        return {"body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body_base64": base64.b64encode(body).decode("ascii")}


def json_value(value: object) -> object:
    """A header or property value as JSON can carry it: bytes as text, the unknown as text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return printable(bytes(value))
    if isinstance(value, Mapping):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    return str(value)


class Output:
    """Where a command writes its results: text lines, or JSON objects (``--json``).

    Every line is flushed at once, so that a pipe sees each message as it comes.

    Args:
        out: Standard output.
        json_lines: Write the records as JSON instead of the text.
        bar: The progress bar, cleared while a line is written to the same terminal.
    """

    def __init__(self, out: TextIO, *, json_lines: bool, bar: tqdm[Never] | None = None) -> None:
        self._out = out
        self._json = json_lines
        self._bar = bar

    def emit(self, text: str, record: Mapping[str, object]) -> None:
        """Write one result: ``text`` as a line, or ``record`` as one JSON object."""
        line = json.dumps(record, ensure_ascii=False) if self._json else text
        if self._bar is not None and not self._bar.disable and self._out.isatty():
            # Both on one terminal: the bar steps aside for the line.
            with self._bar.external_write_mode(file=self._out):
                self._write(line)
        else:
            self._write(line)

    def advance(self, messages: int = 1) -> None:
        """Move the progress bar on by ``messages`` (nothing without a bar)."""
        if self._bar is not None:
            self._bar.update(messages)

    def _write(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()


def progress_bar(
    args: argparse.Namespace, err: TextIO, *, total: int | None, unit: str = "msg", desc: str = ""
) -> tqdm[Never]:
    """A tqdm progress bar on ``err`` as ``--progress`` and ``--force-progress`` ask.

    Without either, the bar is disabled (its methods do nothing); with
    ``--progress`` it is drawn only when ``err`` is a terminal.
    """
    disable: bool | None = True
    if args.force_progress:
        disable = False
    elif args.progress:
        disable = None  # tqdm: drawn only when the stream is a terminal
    return tqdm(
        total=total,
        file=err,
        disable=disable,
        unit=unit,
        desc=desc or None,
        mininterval=0.1,
        dynamic_ncols=True,
        leave=True,
    )


@contextmanager
def reporting(
    args: argparse.Namespace, out: TextIO, err: TextIO, *, total: int | None, desc: str
) -> Iterator[Output]:
    """The `Output` ``--json`` asks for, with the `progress_bar` it advances, closed at the end."""
    with progress_bar(args, err, total=total, desc=desc) as bar:
        yield Output(out, json_lines=args.json, bar=bar)
