"""The ``msggateway`` command: what an operator does by hand.

``msggateway check-config [PATH]`` validates a configuration (the embedded
default without PATH) and prints every problem as ``file: key: reason``
(exit status 1), or a one-line summary (exit status 0).
``msggateway run [twistd options]`` runs the gateway under twistd.
``msggateway ssmp publish|subscribe ...`` sends or watches SSMP messages by
hand, against the gateway or any SSMP server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from gateway import __version__
from gateway.codecs import ssmp
from gateway.config import ConfigError, load_config, load_default_config
from gateway.probe import SSMPProbe, SSMPProbeError, describe, parse_address

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


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not (args.tls or args.ca or args.cert):
        return None
    context = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        context.load_cert_chain(args.cert, args.key)
    return context


def _ssmp(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    secret = os.environ.get(args.secret_env) if args.secret_env else None
    if args.secret_env and secret is None:
        err.write(f"msggateway: environment variable {args.secret_env} is not set\n")
        return 2
    try:
        probe = SSMPProbe(parse_address(args.address), _tls_context(args), timeout=args.timeout)
    except (OSError, ValueError) as exc:
        err.write(f"msggateway: cannot connect to {args.address}: {exc}\n")
        return 1
    try:
        probe.login(args.identity, args.scheme, secret)
        if args.action == "publish":
            return _publish(probe, args, out)
        return _subscribe(probe, args, out, err)
    except (SSMPProbeError, OSError) as exc:
        err.write(f"msggateway: {exc}\n")
        return 1
    finally:
        probe.close()


def _publish(probe: SSMPProbe, args: argparse.Namespace, out: TextIO) -> int:
    status = 0
    for text in args.messages:
        request = ssmp.Mcast(topic=args.topic.encode("ascii"), payload=text.encode("utf-8"))
        response = probe.request(request)
        out.write(describe(response) + "\n")
        status = status or (0 if response.code == 200 else 1)
    return status


def _subscribe(probe: SSMPProbe, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    for topic in args.topics:
        response = probe.request(
            ssmp.Subscribe(topic=topic.encode("ascii"), presence=args.presence)
        )
        if response.code != 200:
            err.write(f"msggateway: SUBSCRIBE {topic}: {describe(response)}\n")
            return 1
    for seen, event in enumerate(probe.events(), start=1):
        out.write(describe(event) + "\n")
        out.flush()
        if args.count and seen >= args.count:
            break
    return 0


def _add_ssmp_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = commands.add_parser("ssmp", help="publish or watch SSMP messages by hand")
    actions = command.add_subparsers(dest="action", required=True)
    publish = actions.add_parser("publish", help="MCAST messages to a topic")
    publish.add_argument("topic")
    publish.add_argument("messages", nargs="+", metavar="message")
    subscribe = actions.add_parser("subscribe", help="print the events of topics")
    subscribe.add_argument("topics", nargs="+", metavar="topic")
    subscribe.add_argument("--presence", action="store_true", help="subscribe with PRESENCE")
    subscribe.add_argument("--count", type=int, default=0, help="stop after N events")
    for action in (publish, subscribe):
        action.add_argument("--address", default="127.0.0.1:8787", help="HOST:PORT")
        action.add_argument("--identity", default=".", help="LOGIN identity (default: .)")
        action.add_argument("--scheme", default="open", help="LOGIN scheme (default: open)")
        action.add_argument("--secret-env", help="environment variable holding the credential")
        action.add_argument("--tls", action="store_true", help="connect over TLS")
        action.add_argument("--ca", help="CA file to verify the server with (implies --tls)")
        action.add_argument("--cert", help="client certificate (PEM; implies --tls)")
        action.add_argument("--key", help="client certificate key (PEM)")
        action.add_argument("--timeout", type=float, default=None, help="seconds a read may wait")


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
    _add_ssmp_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.path, out, err)
    if args.command == "ssmp":
        return _ssmp(args, out, err)
    return _run(args.twistd_args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
