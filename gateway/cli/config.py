"""``msggateway check-config`` and ``msggateway run``: the gateway's own configuration.

``check-config [PATH]`` validates a configuration (the embedded default
without PATH) and prints every problem as ``file: key: reason`` on stderr
with exit status 1, or a one-line summary with exit status 0, after a
``warning:`` line on stderr for each insecure setting it accepts (those the
gateway logs at every start: `gateway.config.insecure`). ``run
[PLUGIN OPTIONS]`` runs the gateway in the foreground under twistd, the
options going to twistd's msggateway plugin as they are written
(`gateway.cli.PASSED_ON`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TextIO

from gateway.cli.arguments import Commands
from gateway.cli.errors import CommandError
from gateway.config import ConfigError, load_config, load_default_config
from gateway.config.insecure import insecure_settings

__all__ = ["add_commands"]


def add_commands(commands: Commands) -> None:
    """Add ``check-config`` and ``run``."""
    check = commands.add_parser(
        "check-config",
        help="validate a configuration",
        description="Validate a configuration: print a one-line summary (exit status 0), after"
        " a 'warning:' line on stderr for each insecure setting it accepts, or every problem as"
        " 'file: key: reason' on stderr (exit status 1).",
    )
    check.add_argument(
        "path", nargs="?", metavar="PATH", help="main config file (default: the embedded default)"
    )
    check.set_defaults(run=_check_config)
    run = commands.add_parser(
        "run",
        help="run the gateway in the foreground under twistd",
        description="Run the gateway in the foreground under twistd (twistd --nodaemon"
        " --pidfile= --logfile=- msggateway OPTION...), logging to stdout. Every option goes"
        " to twistd's msggateway plugin as it is written: --config PATH (the main file;"
        " default: the embedded default), --log-format json; 'twistd msggateway --help'"
        " lists them all.",
    )
    run.add_argument(
        "passed_on",
        nargs=argparse.REMAINDER,
        metavar="OPTION",
        help="e.g. --config /etc/msggateway/gateway.toml",
    )
    run.set_defaults(run=_run)


def _check_config(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``check-config``: validate; print the summary or every problem."""
    path: str | None = args.path
    try:
        config = load_config(Path(path)) if path else load_default_config()
    except ConfigError as exc:
        for problem in exc.problems:
            err.write(f"{problem}\n")
        err.write(f"{len(exc.problems)} problem(s) found\n")
        return 1
    for warning in insecure_settings(config):
        err.write(f"warning: {warning}\n")
    out.write(config.summary() + "\n")
    return 0


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``run``: replace this process with twistd running the gateway."""
    arguments: Sequence[str] = args.passed_on
    twistd = shutil.which("twistd", path=os.path.dirname(sys.executable)) or shutil.which("twistd")
    if twistd is None:
        raise CommandError("twistd not found next to this Python or on PATH")
    argv = [twistd, "--nodaemon", "--pidfile=", "--logfile=-", "msggateway", *arguments]
    os.execv(twistd, argv)
    return 1  # pragma: no cover  (execv does not return)
