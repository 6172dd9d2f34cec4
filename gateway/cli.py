"""The ``msggateway`` command: what an operator does by hand.

``msggateway check-config [PATH]`` validates a configuration (the embedded
default without PATH) and prints every problem as ``file: key: reason``
(exit status 1), or a one-line summary (exit status 0).
``msggateway run [twistd options]`` runs the gateway under twistd.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from gateway import __version__
from gateway.config import ConfigError, load_config, load_default_config

__all__ = ["main"]


def _check_config(path: str | None, out: TextIO, err: TextIO) -> int:
    try:
        config = load_config(Path(path)) if path else load_default_config()
    except ConfigError as exc:
        for problem in exc.problems:
            err.write(f"{problem}\n")
        err.write(f"{len(exc.problems)} problem(s) found\n")
        return 1
    out.write(config.summary() + "\n")
    return 0


def _run(arguments: Sequence[str]) -> int:
    twistd = shutil.which("twistd", path=os.path.dirname(sys.executable)) or shutil.which("twistd")
    if twistd is None:
        sys.stderr.write("msggateway: twistd not found next to this Python or on PATH\n")
        return 1
    argv = [twistd, "--nodaemon", "--pidfile=", "--logfile=-", "msggateway", *arguments]
    os.execv(twistd, argv)
    return 1  # pragma: no cover  (execv does not return)


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run the command line; return the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = argparse.ArgumentParser(prog="msggateway", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"msggateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-config", help="validate a configuration")
    check.add_argument("path", nargs="?", help="main config file (default: the embedded default)")
    run = commands.add_parser("run", help="run the gateway in the foreground under twistd")
    run.add_argument("twistd_args", nargs=argparse.REMAINDER, help="e.g. --config etc/gateway.toml")
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.path, out, err)
    return _run(args.twistd_args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
