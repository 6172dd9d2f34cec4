"""The ``msggateway`` command: what an operator does by hand.

``msggateway check-config [PATH]`` validates a configuration (the embedded
default without PATH) and prints every problem as ``file: key: reason``
(exit status 1), or a one-line summary (exit status 0).
``msggateway run [twistd options]`` runs the gateway under twistd.
``msggateway ssmp publish|subscribe ...`` sends or watches SSMP messages by
hand, against the gateway or any SSMP server.
``msggateway qmqp send [ADDRESS] PATH...`` streams mail files to a QMQP
streaming server and prints what became of each (`gateway.cli.qmqp`).
``msggateway dmp put|get ADDRESS ...`` writes to a DMP sink or reads a DMP
feed with a lease from the environment (`gateway.cli.dmp`).
``msggateway spark archive|report|send ...`` runs the data pipeline's jobs
on Spark (`gateway.spark.cli`).
``msggateway mtl keygen PATH`` writes a new CURVE secret key file for an MTL
listener or upstream and prints its public key.
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
from gateway.cli.dmp import add_dmp_commands, run_dmp
from gateway.cli.qmqp import (
    DEFAULT_TIMEOUT_SECONDS,
    DEFAULT_WINDOW,
    MailSource,
    ProgressBar,
    QMQPSender,
    QMQPSendError,
)
from gateway.cli.ssmp import (
    SSMPProbe,
    SSMPProbeError,
    connect,
    describe,
    parse_address,
    tls_context,
)
from gateway.codecs import ssmp
from gateway.config import ConfigError, load_config, load_default_config
from gateway.spark.cli import add_spark_commands, run_spark

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


def _ssmp(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    secret = os.environ.get(args.secret_env) if args.secret_env else None
    if args.secret_env and secret is None:
        err.write(f"msggateway: environment variable {args.secret_env} is not set\n")
        return 2
    try:
        context = tls_context(tls=args.tls, ca=args.ca, cert=args.cert, key=args.key)
        probe = SSMPProbe(parse_address(args.address), context, timeout=args.timeout)
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


def _qmqp_send(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``msggateway qmqp send``: usage checks, then the session; return the exit status."""
    operands: list[str] = args.operands
    address_text = args.address or operands[0]
    paths = operands if args.address else operands[1:]
    if not paths:
        return _usage(err, "qmqp send: give ADDRESS (or --address) and at least one PATH")
    try:
        address = parse_address(address_text)
    except ValueError as exc:
        return _usage(err, f"qmqp send: {exc}")
    if (args.username is None) != (args.password_env is None):
        return _usage(err, "qmqp send: --username and --password-env go together")
    password = os.environ.get(args.password_env) if args.password_env else None
    if args.password_env and password is None:
        return _usage(err, f"qmqp send: environment variable {args.password_env} is not set")
    source = MailSource(
        paths,
        mbox=args.mbox,
        recursive=args.recursive,
        sender=args.sender,
        recipients=args.recipients,
        id_prefix=args.id_prefix,
    )
    progress = ProgressBar(err, total=lambda: source.total)
    try:
        context = tls_context(tls=args.tls, ca=args.ca, cert=args.cert, key=args.key)
        sock = connect(address, context, args.timeout)
    except (OSError, ValueError) as exc:
        err.write(f"msggateway: cannot connect to {address_text}: {exc}\n")
        return 1
    with QMQPSender(
        sock,
        window=args.window,
        timeout=args.timeout,
        on_progress=progress if args.progress or err.isatty() else None,
    ) as sender:
        try:
            if args.username is not None and password is not None:
                sender.authenticate(
                    os.fsencode(args.username),
                    os.fsencode(password),
                    success_reply=args.auth_success_reply.encode("ascii"),
                )
        except QMQPSendError as exc:
            err.write(f"msggateway: {exc}\n")
            return 1
        summary = sender.send(source, total=lambda: source.total)
    out.write(summary.render())
    return summary.exit_status


def _usage(err: TextIO, message: str) -> int:
    """Report a usage error the way argparse does; return its exit status, 2."""
    err.write(f"msggateway: error: {message}\n")
    return 2


def _positive(kind: type[int] | type[float]) -> argparse._ActionType:
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


def _add_qmqp_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = commands.add_parser("qmqp", help="send mail over QMQP streaming by hand")
    actions = command.add_subparsers(dest="action", required=True)
    send = actions.add_parser(
        "send",
        help="stream mail files to a QMQP streaming server",
        usage="%(prog)s [options] [ADDRESS] PATH [PATH ...]",
        description="Stream RFC 822 files, directories of them and mbox files to a QMQP"
        " streaming server; print the K, Z and D counts and every Z, D and error."
        " Exit status: 0 when every message got K, 1 otherwise, 2 for usage errors.",
    )
    send.add_argument(
        "operands",
        nargs="+",
        metavar="[ADDRESS] PATH",
        help="HOST:PORT of the server (unless --address), then files, directories or mboxes",
    )
    send.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="HOST:PORT of the server (then every operand is a PATH)",
    )
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
    send.add_argument(
        "--window",
        type=_positive(int),
        metavar="N",
        default=DEFAULT_WINDOW,
        help=f"most messages sent and not yet answered (default: {DEFAULT_WINDOW})",
    )
    send.add_argument(
        "--timeout",
        type=_positive(float),
        metavar="SECONDS",
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds to wait without progress (default: {DEFAULT_TIMEOUT_SECONDS:g})",
    )
    send.add_argument("--tls", action="store_true", help="connect over TLS")
    send.add_argument("--ca", help="CA file to verify the server with (implies --tls)")
    send.add_argument("--cert", help="client certificate (PEM; implies --tls)")
    send.add_argument("--key", help="client certificate key (PEM)")
    send.add_argument(
        "--progress", action="store_true", help="show progress on stderr even when not a terminal"
    )


def _mtl_keygen(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from gateway.protocols.mtl.curve import write_key_pair

    try:
        public_key = write_key_pair(Path(args.path))
    except OSError as exc:
        err.write(f"msggateway: {args.path}: {exc.strerror or exc}\n")
        return 1
    out.write(f"{public_key.decode('ascii')}\n")
    return 0


def _add_mtl_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = commands.add_parser("mtl", help="MTL tools")
    actions = command.add_subparsers(dest="action", required=True)
    keygen = actions.add_parser(
        "keygen", help="write a new CURVE secret key file; print its public key"
    )
    keygen.add_argument("path", help="the key file to create (never overwritten)")


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
    _add_qmqp_commands(commands)
    add_dmp_commands(commands)
    _add_mtl_commands(commands)
    add_spark_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.path, out, err)
    if args.command == "ssmp":
        return _ssmp(args, out, err)
    if args.command == "qmqp":
        return _qmqp_send(args, out, err)
    if args.command == "dmp":
        return run_dmp(args, out, err)
    if args.command == "mtl":
        return _mtl_keygen(args, out, err)
    if args.command == "spark":
        return run_spark(args, out, err)
    return _run(args.twistd_args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
