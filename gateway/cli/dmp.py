"""``msggateway dmp put|get``: write to a DMP sink or read a DMP feed by hand.

A small blocking DMP client (the same codec as the gateway) for operators:
``put`` opens a sink with a lease and writes one envelope per TEXT;
``get`` opens a feed and prints the messages it sends (routing key,
message-id and body, one line each) until ``--count`` have come. The lease
is a secret: it is read from the environment variable ``--lease-env`` names,
never from the command line. Exit status: 0 done, 1 refused or timed out
(the server's answer or the reason on stderr), 2 usage errors.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import TextIO

from gateway.cli.ssmp import connect, parse_address, tls_context
from gateway.codecs import dmp

__all__ = ["add_dmp_commands", "run_dmp"]

READ_BYTES = 65536


class _RefusedError(Exception):
    """The server refused, closed, or the time ran out."""


def add_dmp_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dmp put`` and ``dmp get`` to the command line."""
    command = commands.add_parser("dmp", help="write to a DMP sink or read a DMP feed by hand")
    actions = command.add_subparsers(dest="action", required=True)
    put = actions.add_parser("put", help="write messages into a sink")
    put.add_argument("address", metavar="HOST:PORT")
    put.add_argument("texts", nargs="+", metavar="TEXT", help="one message body each")
    put.add_argument("--routing-key", default="", help="the envelopes' routing key")
    put.add_argument("--exchange", default="", help="the envelopes' exchange field")
    get = actions.add_parser("get", help="print messages a feed sends")
    get.add_argument("address", metavar="HOST:PORT")
    get.add_argument("--count", type=int, default=1, help="messages to wait for (default: 1)")
    for each in (put, get):
        each.add_argument(
            "--lease-env", required=True, metavar="VAR", help="environment variable with the lease"
        )
        each.add_argument(
            "--timeout", type=float, default=10.0, help="seconds any read may wait (default: 10)"
        )
        each.add_argument("--tls", action="store_true", help="connect over TLS")
        each.add_argument("--ca", help="CA file to verify the server with (implies --tls)")


def run_dmp(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``dmp put`` or ``dmp get``; return the exit status."""
    lease = os.environ.get(args.lease_env)
    if lease is None:
        err.write(f"msggateway: dmp: environment variable {args.lease_env} is not set\n")
        return 2
    try:
        address = parse_address(args.address)
    except ValueError as exc:
        err.write(f"msggateway: dmp: {exc}\n")
        return 2
    if args.action == "get" and args.count < 1:
        err.write("msggateway: dmp get: --count must be at least 1\n")
        return 2
    try:
        sock = connect(address, tls_context(tls=args.tls, ca=args.ca), args.timeout)
    except OSError as exc:
        err.write(f"msggateway: cannot connect to {args.address}: {exc}\n")
        return 1
    with sock:
        try:
            codec, pending = _open(sock, lease)
            if args.action == "put":
                _put(sock, args)
                out.write(f"wrote {len(args.texts)} message(s)\n")
            else:
                _get(sock, codec, pending, args.count, out)
        except _RefusedError as exc:
            err.write(f"msggateway: dmp {args.action}: {exc}\n")
            return 1
        except OSError as exc:
            err.write(f"msggateway: dmp {args.action}: {exc}\n")
            return 1
    return 0


def _open(sock: socket.socket, lease: str) -> tuple[dmp.DMPCodec, list[dmp.Event]]:
    """Run the dialog; return the codec and any events that came with the second 200."""
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    sock.sendall(codec.send(dmp.ProtocolHeader()))
    answers = 0
    while True:
        events = _read(sock, codec)
        for index, event in enumerate(events):
            if not isinstance(event, dmp.Response):
                continue  # a null message during the dialog
            if not event.ok:
                raise _RefusedError(f"the server answered {dmp.encode_response(event)[1:]!r}")
            answers += 1
            if answers == 1:
                sock.sendall(codec.send(dmp.Lease(lease)))
            else:
                return codec, events[index + 1 :]  # what came with the second 200 is kept


def _put(sock: socket.socket, args: argparse.Namespace) -> None:
    envelopes = [
        dmp.encode_envelope(
            dmp.Envelope(
                exchange=args.exchange, routing_key=args.routing_key, body=text.encode("utf-8")
            )
        )
        for text in args.texts
    ]
    sock.sendall(b"".join(envelopes))


def _get(
    sock: socket.socket, codec: dmp.DMPCodec, pending: list[dmp.Event], count: int, out: TextIO
) -> None:
    seen = 0
    while True:
        for event in pending:
            if isinstance(event, dmp.Envelope):
                message_id = event.properties.message_id or "-"
                body = event.body.decode("utf-8", "replace")
                out.write(f"{event.routing_key or '-'} {message_id} {body}\n")
                seen += 1
                if seen == count:
                    return
        pending = _read(sock, codec)


def _read(sock: socket.socket, codec: dmp.DMPCodec) -> list[dmp.Event]:
    try:
        data = sock.recv(READ_BYTES)
    except TimeoutError:
        raise _RefusedError("timed out waiting for the server") from None
    if not data:
        raise _RefusedError("the server closed the connection")
    try:
        return codec.receive_data(data)
    except dmp.DMPError as exc:
        raise _RefusedError(f"bad data from the server: {exc}") from None
