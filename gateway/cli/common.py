"""What every protocol command of ``msggateway`` shares: flags, connections, bodies, output.

Every protocol command has the same shape (issue 17):

- ``-a/--address HOST:PORT``, by default the embedded default
  configuration's listener for that protocol (`DEFAULT_ADDRESSES`);
- ``--tls``, ``--cafile``, ``--cert``, ``--key`` for TCP protocols
  (`add_tls_arguments`, `tls_from`);
- ``--timeout SECONDS``: how long to wait for the server;
- ``--count N``: a sender sends N messages, going round its bodies as often
  as needed; a receiver stops after N messages (0: never);
- ``--json``: one JSON object per line on stdout, one per message or
  outcome (`Output`);
- ``--progress``: a progress bar (tqdm) on stderr when it is a terminal,
  ``--force-progress`` even when it is not (`progress_bar`).

Senders take message bodies from their arguments, from files (``--file``,
one message per file) or, given neither, from standard input, one message
per line (`add_body_arguments`, `message_bodies`). A sender that lets
``--window`` messages wait for their outcomes prints those outcomes in the
order it sent the messages (`InOrderOutcomes`); a receiver prints what comes
until ``--count`` (`print_received`).

Exit status, everywhere: 0 when everything was accepted (or received), 1
when something was refused, failed or timed out (`CommandError`, or a
refusal in the output), 2 for usage errors (`UsageError`).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, NamedTuple, Never, TextIO, TypeAlias, TypeVar

from tqdm import tqdm

from gateway.codecs.errors import ProtocolError

__all__ = [
    "DEFAULT_ADDRESSES",
    "DEFAULT_TIMEOUT_SECONDS",
    "READ_BYTES",
    "Address",
    "CommandError",
    "Commands",
    "InOrderOutcomes",
    "Output",
    "UsageError",
    "add_address_argument",
    "add_body_arguments",
    "add_header_argument",
    "add_protocol_command",
    "add_receiver_arguments",
    "add_sender_arguments",
    "add_timeout_argument",
    "add_tls_arguments",
    "add_window_argument",
    "body_fields",
    "connect",
    "json_value",
    "message_bodies",
    "open_connection",
    "parse_address",
    "positive",
    "print_messages",
    "print_received",
    "printable",
    "progress_bar",
    "receive",
    "reporting",
    "secret_from_env",
    "tls_context",
    "tls_from",
]

DEFAULT_ADDRESSES: Final = {
    "ssmp": "127.0.0.1:8787",
    "qmqp": "127.0.0.1:8628",
    "stream": "127.0.0.1:5552",
    "dmp": "127.0.0.1:5554",
    "mtl": "127.0.0.1:5555",
}
"""Where the embedded default configuration (gateway/default.toml) listens, per protocol."""

DEFAULT_TIMEOUT_SECONDS: Final = 10.0
"""How long a command waits for the server by default."""

READ_BYTES: Final = 65536
"""Bytes asked of one ``recv``."""

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The object ``add_subparsers`` returns, which each protocol module adds its commands to."""

_E = TypeVar("_E")


class UsageError(Exception):
    """The command line asks for something impossible (exit status 2)."""


class CommandError(Exception):
    """The command could not do its work: refused, closed, timed out (exit status 1)."""


def add_protocol_command(commands: Commands, name: str, *, help: str, description: str) -> Commands:
    """Add the command ``NAME ACTION``; return what its actions are added to.

    Args:
        commands: The top-level commands.
        name: The command, a protocol's name.
        help: Its line in the top-level help.
        description: Its own help's text.
    """
    command = commands.add_parser(name, help=help, description=description)
    return command.add_subparsers(dest="action", required=True, metavar="ACTION")


# --- addresses and connections ----------------------------------------------------------


class Address(NamedTuple):
    """A server's ``(host, port)``; its text is ``HOST:PORT``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` too).

    Raises:
        ValueError: Not of that form.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return Address(host.strip("[]"), int(port))


def _address_type(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_address_argument(parser: argparse.ArgumentParser, protocol: str) -> None:
    """Add ``-a/--address HOST:PORT``, by default the default configuration's listener."""
    default = DEFAULT_ADDRESSES[protocol]
    parser.add_argument(
        "-a",
        "--address",
        type=_address_type,
        default=parse_address(default),
        metavar="HOST:PORT",
        help=f"the server (default: {default}, where the default configuration listens)",
    )


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tls``, ``--cafile`` (alias ``--ca``), ``--cert`` and ``--key``."""
    group = parser.add_argument_group("TLS")
    group.add_argument("--tls", action="store_true", help="connect over TLS")
    group.add_argument(
        "--cafile",
        "--ca",
        dest="cafile",
        metavar="PATH",
        help="CA file to verify the server with (implies --tls; default: the system's CAs)",
    )
    group.add_argument("--cert", metavar="PATH", help="client certificate, PEM (implies --tls)")
    group.add_argument(
        "--key", metavar="PATH", help="the client certificate's key, PEM (default: in --cert)"
    )


def tls_context(
    *, tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext | None:
    """Build the client TLS context the command-line options ask for.

    Args:
        tls: Connect over TLS, verifying the server with the system's CAs.
        ca: CA file to verify the server with (implies TLS).
        cert: Client certificate, PEM (implies TLS).
        key: The client certificate's key, PEM (default: read from ``cert``).

    Returns:
        A context, or None for plain TCP.

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: A file holds no usable certificate or key.
    """
    if not (tls or ca or cert):
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def tls_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context of `add_tls_arguments`'s flags, or None for plain TCP.

    Raises:
        CommandError: A file cannot be read or holds no usable certificate or key.
    """
    try:
        return tls_context(tls=args.tls, ca=args.cafile, cert=args.cert, key=args.key)
    except OSError as exc:  # ssl.SSLError is one
        raise CommandError(f"TLS: {exc}") from None


def connect(
    address: tuple[str, int], context: ssl.SSLContext | None, timeout: float | None
) -> socket.socket:
    """Open a blocking TCP connection, over TLS when ``context`` is given.

    The TLS handshake is done here, bounded by ``timeout``; the server's
    certificate is checked against the host name of ``address``.

    Args:
        address: ``(host, port)``.
        context: TLS context, or None for plain TCP.
        timeout: Seconds connecting (and each later read) may wait; None: forever.

    Raises:
        OSError: The connection or the handshake failed (`ssl.SSLError` is one).
    """
    raw = socket.create_connection(address, timeout=timeout)
    if context is None:
        return raw
    try:
        return context.wrap_socket(raw, server_hostname=address[0])
    except BaseException:
        raw.close()
        raise


def open_connection(
    address: Address, args: argparse.Namespace, timeout: float | None
) -> socket.socket:
    """`connect` to ``address`` over TLS as `add_tls_arguments`' flags say.

    Raises:
        CommandError: A TLS file is unusable, or the connection or handshake failed.
    """
    context = tls_from(args)
    try:
        return connect(address, context, timeout)
    except OSError as exc:
        raise CommandError(f"cannot connect to {address}: {exc}") from None


def receive(sock: socket.socket, decode: Callable[[bytes], list[_E]], waiting_for: str) -> list[_E]:
    """Read once from ``sock`` and decode what came with a codec's ``receive_data``.

    Args:
        sock: A blocking socket with its time-out set.
        decode: The codec's ``receive_data``.
        waiting_for: What is awaited, for the time-out's message.

    Returns:
        The events completed (possibly none: call again).

    Raises:
        CommandError: Timed out, the server closed the connection, or it
            sent something its protocol does not allow.
    """
    try:
        data = sock.recv(READ_BYTES)
    except TimeoutError:
        raise CommandError(f"timed out waiting for {waiting_for}") from None
    except OSError as exc:
        raise CommandError(f"connection lost: {exc.strerror or exc}") from None
    if not data:
        raise CommandError(f"the server closed the connection while we waited for {waiting_for}")
    try:
        return decode(data)
    except ProtocolError as exc:
        raise CommandError(f"bad data from the server: {exc}") from None


def secret_from_env(variable: str) -> str:
    """The value of the environment variable a ``--...-env`` flag names.

    Secrets never go on the command line, where ``ps`` shows them.

    Raises:
        UsageError: It is not set.
    """
    value = os.environ.get(variable)
    if value is None:
        raise UsageError(f"environment variable {variable} is not set")
    return value


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number above zero."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above zero")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is below zero")
    return value


def add_timeout_argument(
    parser: argparse.ArgumentParser,
    default: float | None = DEFAULT_TIMEOUT_SECONDS,
    what: str = "seconds to wait for the server at any step",
) -> None:
    """Add ``--timeout SECONDS``."""
    shown = "none: wait for ever" if default is None else f"{default:g}"
    parser.add_argument(
        "--timeout",
        type=positive(float),
        default=default,
        metavar="SECONDS",
        help=f"{what} (default: {shown})",
    )


def add_window_argument(parser: argparse.ArgumentParser, default: int, what: str) -> None:
    """Add ``--window N``: ``what`` says what it bounds."""
    parser.add_argument(
        "--window",
        type=positive(int),
        default=default,
        metavar="N",
        help=f"{what} (default: {default})",
    )


# --- what senders send ----------------------------------------------------------------------


def add_sender_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the output group for a sender: ``--count``, ``--json``, the progress flags."""
    group = parser.add_argument_group("count and output")
    group.add_argument(
        "--count",
        type=_count,
        default=0,
        metavar="N",
        help="send N messages in all, going round the bodies as often as needed"
        " (default: each body once)",
    )
    _add_output_arguments(group)


def add_receiver_arguments(parser: argparse.ArgumentParser, default_count: int = 0) -> None:
    """Add the output group for a receiver: ``--count``, ``--json``, the progress flags."""
    group = parser.add_argument_group("count and output")
    group.add_argument(
        "--count",
        type=_count,
        default=default_count,
        metavar="N",
        help=f"stop after N messages; 0: never (default: {default_count})",
    )
    _add_output_arguments(group)


def _add_output_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per line on stdout, one per message or outcome",
    )
    group.add_argument(
        "--progress",
        action="store_true",
        help="draw a progress bar on stderr when stderr is a terminal",
    )
    group.add_argument(
        "--force-progress",
        action="store_true",
        help="draw the progress bar even when stderr is not a terminal",
    )


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def add_header_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--header KEY=VALUE`` (repeatable); ``args.headers`` is a list of pairs."""
    parser.add_argument(
        "--header",
        dest="headers",
        type=_header,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a text {what} on every message (repeatable)",
    )


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


# --- output --------------------------------------------------------------------------------


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


# --- sender and receiver loops ------------------------------------------------------------

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
