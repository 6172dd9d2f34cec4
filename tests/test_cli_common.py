"""Tests of what every protocol command shares: `gateway.cli.bodies`, `.connection`, `.output`.

Bodies from operands, files and standard input, ``--count`` going round
them, addresses, JSON output of bodies and values, and the progress bar's
three modes. No sockets.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from gateway.cli.arguments import add_sender_arguments
from gateway.cli.bodies import add_body_arguments, message_bodies
from gateway.cli.connection import Address, parse_address
from gateway.cli.errors import CommandError
from gateway.cli.output import Output, body_fields, json_value, printable, progress_bar


def sender_args(*argv: str) -> argparse.Namespace:
    """Parse a sender's body and output flags."""
    parser = argparse.ArgumentParser()
    add_body_arguments(parser)
    add_sender_arguments(parser)
    return parser.parse_args(list(argv))


def test_bodies_from_operands_then_files(tmp_path: Path) -> None:
    """Operands first, then each --file whole (its line ends kept); the total is known."""
    (tmp_path / "f").write_bytes(b"line 1\nline 2\n")
    bodies = message_bodies(sender_args("a", "b", "--file", str(tmp_path / "f")), io.BytesIO())
    assert bodies.total == 3
    assert list(bodies.items) == [b"a", b"b", b"line 1\nline 2\n"]


def test_bodies_from_stdin_lines() -> None:
    """No operand and no --file: each line of stdin (LF or CRLF) is a body; no total."""
    bodies = message_bodies(sender_args(), io.BytesIO(b"one\r\ntwo\n\nlast"))
    assert bodies.total is None
    assert list(bodies.items) == [b"one", b"two", b"", b"last"]


def test_count_goes_round_the_bodies() -> None:
    """--count 5 with two bodies sends five, in turn; the total is the count."""
    bodies = message_bodies(sender_args("x", "y", "--count", "5"), io.BytesIO())
    assert bodies.total == 5
    assert list(bodies.items) == [b"x", b"y", b"x", b"y", b"x"]


def test_an_unreadable_file_is_a_command_error(tmp_path: Path) -> None:
    """A --file that cannot be read fails when it is reached, naming it."""
    bodies = message_bodies(sender_args("--file", str(tmp_path / "gone")), io.BytesIO())
    with pytest.raises(CommandError, match="gone: No such file"):
        list(bodies.items)


def test_count_below_zero_is_a_usage_error() -> None:
    """--count -1 is refused by argparse."""
    with pytest.raises(SystemExit):
        sender_args("--count", "-1")


@pytest.mark.parametrize(
    ("text", "address"),
    [("127.0.0.1:5552", Address("127.0.0.1", 5552)), ("[::1]:80", Address("::1", 80)),
     ("gw.example:1", Address("gw.example", 1))],
)  # fmt: skip
def test_addresses(text: str, address: Address) -> None:
    """HOST:PORT and [v6]:PORT parse; the address prints back as it was given."""
    assert parse_address(text) == address
    assert str(address) == text


@pytest.mark.parametrize("text", ["nohost", ":80", "host:", "host:http", "host:70000"])
def test_bad_addresses(text: str) -> None:
    """Anything else is refused."""
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        parse_address(text)


def test_bodies_and_values_in_json() -> None:
    """UTF-8 bodies are text, others base64; bytes values are printable text."""
    assert body_fields("é".encode()) == {"body": "é"}
    assert body_fields(b"\xff\x00") == {"body_base64": "/wA="}
    assert json_value({"a": b"x\ny", "b": [1, None, True], "c": 1.5}) == {
        "a": "x\\ny",
        "b": [1, None, True],
        "c": 1.5,
    }
    assert printable(b"tab\there") == "tab\\there"


def test_output_writes_text_or_json_lines() -> None:
    """The same result is a text line, or with json_lines one JSON object."""
    text, lines = io.StringIO(), io.StringIO()
    Output(text, json_lines=False).emit("1 accepted", {"message": 1})
    Output(lines, json_lines=True).emit("1 accepted", {"message": 1, "body": "é"})
    assert text.getvalue() == "1 accepted\n"
    assert json.loads(lines.getvalue()) == {"message": 1, "body": "é"}
    assert lines.getvalue().endswith("}\n") and "é" in lines.getvalue()


@pytest.mark.parametrize(
    ("flags", "drawn"), [((), False), (("--progress",), False), (("--force-progress",), True)]
)
def test_progress_bar_modes(flags: tuple[str, ...], drawn: bool) -> None:
    """No flag: no bar; --progress: only on a terminal (not a StringIO); forced: always."""
    err = io.StringIO()
    with progress_bar(sender_args(*flags), err, total=2, desc="sent") as bar:
        bar.update(2)
    assert ("2/2" in err.getvalue()) is drawn
    assert (err.getvalue() == "") is not drawn
