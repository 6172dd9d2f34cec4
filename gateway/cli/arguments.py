"""The flags every protocol command of ``msggateway`` shares.

Every protocol command has the same shape (issue 17):

- ``-a/--address HOST:PORT``, by default the embedded default
  configuration's listener for that protocol
  (`gateway.cli.connection.DEFAULT_ADDRESSES`);
- ``--tls``, ``--cafile``, ``--cert``, ``--key`` for TCP protocols
  (`add_tls_arguments`, `gateway.cli.connection.tls_from`);
- ``--timeout SECONDS``: how long to wait for the server;
- ``--count N``: a sender sends N messages, going round its bodies as often
  as needed; a receiver stops after N messages (0: never);
- ``--json``: one JSON object per line on stdout, one per message or
  outcome (`gateway.cli.output.Output`);
- ``--progress``: a progress bar (tqdm) on stderr when it is a terminal,
  ``--force-progress`` even when it is not (`gateway.cli.output.progress_bar`).

Senders take their bodies as `gateway.cli.bodies` says; what a command
prints is `gateway.cli.output` and `gateway.cli.results`; how it fails,
`gateway.cli.errors`. Secrets come from the environment (`secret_from_env`),
never from the command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Final, TypeAlias

from gateway.cli.connection import DEFAULT_ADDRESSES, Address, parse_address
from gateway.cli.errors import UsageError

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "Commands",
    "add_address_argument",
    "add_header_argument",
    "add_protocol_command",
    "add_receiver_arguments",
    "add_sender_arguments",
    "add_timeout_argument",
    "add_tls_arguments",
    "add_window_argument",
    "positive",
    "secret_from_env",
]

DEFAULT_TIMEOUT_SECONDS: Final = 10.0
"""How long a command waits for the server by default."""

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The object ``add_subparsers`` returns, which each protocol module adds its commands to."""


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
