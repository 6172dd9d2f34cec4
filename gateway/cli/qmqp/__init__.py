"""``msggateway qmqp send``: stream mail files to a QMQP streaming server.

The mail files, directories and mbox files are read one message at a time
(`gateway.cli.qmqp.mail`) and sent over one session (`gateway.cli.qmqp.session`,
on the gateway's own QMQP codec). The output is the K, Z and D counts and
every Z, D and error, or with ``--json`` one object per message; a tqdm bar
counts the answers with ``--progress``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Never, TextIO

from tqdm import tqdm

from gateway.cli.arguments import (
    Commands,
    add_address_argument,
    add_protocol_command,
    add_sender_arguments,
    add_timeout_argument,
    add_tls_arguments,
    add_window_argument,
    secret_from_env,
)
from gateway.cli.connection import DEFAULT_ADDRESSES, Address, open_connection, parse_address
from gateway.cli.errors import CommandError, UsageError
from gateway.cli.output import Output, printable, progress_bar
from gateway.cli.qmqp.mail import Item, MailSource
from gateway.cli.qmqp.session import (
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_WINDOW,
    OUTCOMES,
    Progress,
    QMQPSender,
    QMQPSendError,
)

__all__ = ["add_commands"]


def add_commands(commands: Commands) -> None:
    """Add ``qmqp send``."""
    actions = add_protocol_command(
        commands,
        "qmqp",
        help="send mail over QMQP streaming by hand",
        description="Send mail files to a QMQP streaming server.",
    )
    send = actions.add_parser(
        "send",
        help="stream mail files to a QMQP streaming server",
        description="Stream RFC 822 files, directories of them and mbox files to a QMQP"
        " streaming server; print the K, Z and D counts and every Z, D and error (with"
        " --json, one object per message). The server is --address, or a first operand"
        " of the form HOST:PORT that is not a file. Exit status: 0 when every message got"
        " K, 1 otherwise, 2 for usage errors.",
    )
    send.add_argument(
        "operands",
        nargs="+",
        metavar="PATH",
        help="files, directories or mboxes; before them, HOST:PORT of the server (unless"
        " --address)",
    )
    add_address_argument(send, "qmqp")
    send.set_defaults(address=None)  # a first operand may name it instead
    send.add_argument("--mbox", action="store_true", help="read every file as an mbox")
    send.add_argument("-r", "--recursive", action="store_true", help="descend into directories")
    send.add_argument("--sender", metavar="ADDR", help="envelope sender (default: from headers)")
    send.add_argument(
        "--recipient",
        dest="recipients",
        metavar="ADDR",
        action="append",
        default=[],
        help="envelope recipient, repeatable (default: To, Cc and Bcc)",
    )
    send.add_argument("--id-prefix", metavar="TEXT", default="", help="put before every message id")
    send.add_argument("--username", metavar="NAME", help="authenticate with an A block first")
    send.add_argument(
        "--password-env", metavar="VAR", help="environment variable with the password"
    )
    send.add_argument(
        "--auth-success-reply",
        choices=["1", "0"],
        default="1",
        help="the A reply meaning success: 1 as the spec's prose says (default), 0 as its example",
    )
    add_window_argument(send, DEFAULT_WINDOW, "most messages sent and not yet answered")
    add_timeout_argument(send, DEFAULT_TIMEOUT_SECONDS, "seconds to wait without progress")
    add_sender_arguments(send)
    add_tls_arguments(send)
    send.set_defaults(run=_send)
    # argparse cannot show an optional operand before a repeated one: its usage,
    # every option listed, gets the [ADDRESS] put in by hand.
    usage = send.format_usage().removeprefix("usage: ").rstrip()
    send.usage = usage.replace(" PATH [PATH ...]", " [ADDRESS] PATH [PATH ...]")


def _address_and_paths(args: argparse.Namespace) -> tuple[Address, list[str]]:
    """The server and the paths: ``--address``, a first operand, or the default."""
    operands: list[str] = args.operands
    if args.address is not None:
        return args.address, operands
    first = operands[0]
    try:
        address = parse_address(first)
    except ValueError:
        return parse_address(DEFAULT_ADDRESSES["qmqp"]), operands
    if os.path.exists(first):
        return parse_address(DEFAULT_ADDRESSES["qmqp"]), operands
    if len(operands) == 1:
        raise UsageError("qmqp send: give at least one PATH after the ADDRESS")
    return address, operands[1:]


def _repeated(source: MailSource, count: int) -> Iterator[Item]:
    """``count`` items, going round the source as often as needed (ids stay unique)."""
    taken = 0
    while True:
        before = taken
        for item in source:
            yield item
            taken += 1
            if taken == count:
                return
        if taken == before:
            return  # nothing to go round


def _send(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``msggateway qmqp send``: usage checks, then the session; return the exit status."""
    address, paths = _address_and_paths(args)
    if (args.username is None) != (args.password_env is None):
        raise UsageError("qmqp send: --username and --password-env go together")
    password = secret_from_env(args.password_env) if args.password_env else None
    source = MailSource(
        paths,
        mbox=args.mbox,
        recursive=args.recursive,
        sender=args.sender,
        recipients=args.recipients,
        id_prefix=args.id_prefix,
    )
    items: Iterable[Item] = _repeated(source, args.count) if args.count else source

    def total() -> int | None:
        return args.count or source.total

    sock = open_connection(address, args, args.timeout)
    with progress_bar(args, err, total=total(), desc="answered") as bar:
        output = Output(out, json_lines=args.json, bar=bar)
        on_outcome = _printer(output) if args.json else None
        with QMQPSender(
            sock,
            window=args.window,
            timeout=args.timeout,
            on_progress=_ProgressDrawing(bar, total),
            on_outcome=on_outcome,
        ) as sender:
            if args.username is not None and password is not None:
                try:
                    sender.authenticate(
                        os.fsencode(args.username),
                        os.fsencode(password),
                        success_reply=args.auth_success_reply.encode("ascii"),
                    )
                except QMQPSendError as exc:
                    raise CommandError(str(exc)) from None
            summary = sender.send(items, total=total)
    if args.json:
        if summary.stopped is not None:
            err.write(f"msggateway: stopped: {summary.stopped}\n")
        for warning in summary.warnings:
            err.write(f"msggateway: warning: {warning}\n")
    else:
        out.write(summary.render())
    return summary.exit_status


def _printer(output: Output) -> Callable[[str, bytes, str], None]:
    """Print each message's outcome as a JSON object (``--json``)."""

    def emit(status: str, ident: bytes, description: str) -> None:
        output.emit(
            "",
            {
                "id": printable(ident),
                "outcome": OUTCOMES[status],
                "status": status,
                "reason": description,
            },
        )

    return emit


class _ProgressDrawing:
    """Shows a session's `Progress` on a tqdm bar: messages answered (or not sendable)."""

    def __init__(self, bar: tqdm[Never], total: Callable[[], int | None]) -> None:
        self._bar = bar
        self._total = total

    def __call__(self, progress: Progress) -> None:
        bar = self._bar
        if bar.disable:
            return
        total = self._total()
        if total != bar.total:
            bar.total = total
        done = progress.answered + progress.failed
        if done > bar.n or progress.finished:
            bar.set_postfix(sent=progress.sent, not_sendable=progress.failed, refresh=False)
            bar.update(done - bar.n)
