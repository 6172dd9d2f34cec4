"""The msggateway command: what an operator does by hand.

One module per concern, each adding its commands to one argparse parser
with an ``add_commands(commands)`` function:

- `gateway.cli.config`: ``check-config [PATH]`` and ``run [PLUGIN OPTIONS]``;
- `gateway.cli.init`: ``init DIR`` (an example configuration to start from);
- `gateway.cli.ssmp`: ``ssmp publish|subscribe``;
- `gateway.cli.qmqp`: ``qmqp send`` (mail files over QMQP streaming, read
  by `gateway.cli.mail`);
- `gateway.cli.stream`: ``stream publish|consume`` (the RabbitMQ stream
  protocol);
- `gateway.cli.dmp`: ``dmp put|get``;
- `gateway.cli.mtl`: ``mtl send|receive|keygen``;
- `gateway.cli.tap`, when present: watching what flows through a route;
- and `gateway.spark.cli`: ``spark archive|report|send``.

Every protocol command has the same flags (`gateway.cli.arguments`), connects
as `gateway.cli.connection` says, reads its bodies through `gateway.cli.bodies`
and writes through `gateway.cli.output` and `gateway.cli.results`. A command
in `PASSED_ON` (``run``) hands every argument after its name to another
program as it is: argparse would take ``--config`` for an option of its own
(and keep a ``--``), so `main` takes those arguments off before parsing. A leaf
command's parser sets ``run``, a function of the parsed arguments, stdout,
stderr and stdin's bytes that returns the exit status; it raises
`UsageError` (exit status 2) or `CommandError` (1) for what it cannot do.
Help texts are plain text: they are printed as they are written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import IO, Final, TextIO

from gateway import __version__
from gateway.cli.errors import CommandError, UsageError

__all__ = ["PASSED_ON", "build_parser", "main", "parse_arguments"]

_COMMAND_MODULES = ("config", "init", "ssmp", "qmqp", "stream", "dmp", "mtl", "tap")
"""The modules of `gateway.cli` that add commands, in the order the help lists them."""

PASSED_ON: Final = frozenset({"run"})
"""Commands whose arguments go on to another program unparsed, in ``args.passed_on``."""

DESCRIPTION = (
    "What an operator does by hand with msggateway: check a configuration, run the"
    " gateway, send and receive messages in every protocol it speaks, and run the"
    " data pipeline's jobs. 'msggateway COMMAND --help' says more about each."
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command of every module in `_COMMAND_MODULES`, and spark.

    A module of that list that does not exist is left out (``tap`` is added
    separately).
    """
    from gateway.spark.cli import add_spark_commands, run_spark

    parser = argparse.ArgumentParser(prog="msggateway", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"msggateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            continue
        module.add_commands(commands)
    add_spark_commands(commands)
    commands.choices["spark"].set_defaults(
        run=lambda args, out, err, stdin: run_spark(args, out, err)
    )
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line; a `PASSED_ON` command's arguments are kept as they are.

    ``run --config FILE`` gives ``passed_on == ["--config", "FILE"]``; a
    ``--`` right after the command's name is dropped, as argparse would;
    ``run --help`` is the command's own help.
    """
    argv = list(argv)
    if argv[:1] and argv[0] in PASSED_ON and argv[1:2] not in (["-h"], ["--help"]):
        args = parser.parse_args(argv[:1])
        rest = argv[1:]
        args.passed_on = rest[1:] if rest[:1] == ["--"] else rest
        return args
    return parser.parse_args(argv)


def main(
    argv: Sequence[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stdin: IO[bytes] | None = None,
) -> int:
    """Run the command line; return the exit status.

    Args:
        argv: The arguments (default: the process's).
        out: Where results go (default: stdout).
        err: Where errors and progress go (default: stderr).
        stdin: Where senders read bodies when given none (default: stdin's bytes).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    stdin = stdin or sys.stdin.buffer
    args = parse_arguments(build_parser(), sys.argv[1:] if argv is None else argv)
    try:
        status: int = args.run(args, out, err, stdin)
    except UsageError as exc:
        err.write(f"msggateway: error: {exc}\n")
        return 2
    except CommandError as exc:
        err.write(f"msggateway: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # A reader such as head went away: say nothing more, as cat does.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
