"""``msggateway dmp put|get``: write to a DMP sink or read a DMP feed by hand.

A small blocking DMP client (the gateway's own codec) for operators:
``put`` opens a sink with a lease and writes one envelope per body;
``get`` opens a feed and prints the messages it sends (routing key,
message-id and body, one line each, or JSON objects) until ``--count``
have come. The lease is a secret: it is read from the environment variable
``--lease-env`` names, never from the command line. DMP has no
acknowledgement: ``put`` can only say what it wrote, and the server's
refusal of the lease. Exit status: 0 done, 1 refused or timed out (the
server's answer or the reason on stderr), 2 usage errors.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterable, Iterator
from typing import IO, Final, TextIO

from gateway.cli.arguments import (
    DEFAULT_TIMEOUT_SECONDS,
    Commands,
    add_address_argument,
    add_header_argument,
    add_protocol_command,
    add_receiver_arguments,
    add_sender_arguments,
    add_timeout_argument,
    add_tls_arguments,
    secret_from_env,
)
from gateway.cli.bodies import add_body_arguments, message_bodies
from gateway.cli.connection import open_connection, receive
from gateway.cli.errors import CommandError
from gateway.cli.output import body_fields, json_value, printable, reporting
from gateway.cli.results import print_received
from gateway.codecs import dmp

__all__ = ["add_commands"]

WRITE_BATCH_BYTES: Final = 256 * 1024
"""Envelopes are written in batches of about this many bytes."""


def add_commands(commands: Commands) -> None:
    """Add ``dmp put`` and ``dmp get``."""
    actions = add_protocol_command(
        commands,
        "dmp",
        help="write to a DMP sink or read a DMP feed by hand",
        description="Write to a DMP sink or read a DMP feed, with a lease from the environment.",
    )
    put = actions.add_parser(
        "put",
        help="write messages into a sink",
        description="Open a sink with the lease and write one envelope per body. DMP has"
        " no acknowledgement: the output says what was written.",
    )
    _add_connection_arguments(put)
    add_body_arguments(put)
    put.add_argument("--routing-key", default="", help="the envelopes' routing key")
    put.add_argument("--exchange", default="", help="the envelopes' exchange field")
    add_header_argument(put, "header")
    add_sender_arguments(put)
    add_timeout_argument(put)
    put.set_defaults(run=_put)
    get = actions.add_parser(
        "get",
        help="print messages a feed sends",
        description="Open a feed with the lease and print each message: routing key,"
        " message-id and body on one line (or a JSON object), until --count have come.",
    )
    _add_connection_arguments(get)
    add_receiver_arguments(get)
    add_timeout_argument(get, None, "seconds to wait for each message")
    get.set_defaults(run=_get)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The server, the lease, TLS."""
    add_address_argument(parser, "dmp")
    parser.add_argument(
        "--lease-env", required=True, metavar="VAR", help="environment variable with the lease"
    )
    add_tls_arguments(parser)


_Session = tuple[socket.socket, dmp.DMPCodec, list[dmp.Event]]


def _open(args: argparse.Namespace, timeout: float) -> _Session:
    """Connect and run the dialog; return the socket, the codec and what came with the 200."""
    lease = secret_from_env(args.lease_env)
    sock = open_connection(args.address, args, timeout)
    try:
        codec, pending = _dialog(sock, lease)
    except BaseException:
        sock.close()
        raise
    return sock, codec, pending


def _dialog(sock: socket.socket, lease: str) -> tuple[dmp.DMPCodec, list[dmp.Event]]:
    """The protocol header, the server's 200, the lease, its 200 (spec, "Connection dialog")."""
    codec = dmp.DMPCodec(dmp.Role.CLIENT)
    _send(sock, codec.send(dmp.ProtocolHeader()))
    answers = 0
    while True:
        events = receive(sock, codec.receive_data, "the server's answer")
        for index, event in enumerate(events):
            if not isinstance(event, dmp.Response):
                continue  # a null message during the dialog
            if not event.ok:
                answer = dmp.encode_response(event)[1:].decode("utf-8", "replace")
                raise CommandError(f"the server answered {answer!r}")
            answers += 1
            if answers == 1:
                _send(sock, codec.send(dmp.Lease(lease)))
            else:
                return codec, events[index + 1 :]  # what came with the second 200 is kept


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise CommandError(f"sending failed: {exc.strerror or exc}") from None


def _put(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``dmp put``: one envelope per body."""
    bodies = message_bodies(args, stdin)
    properties = (
        dmp.BasicProperties(headers=dict(args.headers)) if args.headers else dmp.NO_PROPERTIES
    )
    sock, codec, _ = _open(args, args.timeout)
    written = 0
    with sock, reporting(args, out, err, total=bodies.total, desc="written") as output:
        for batch in _batches(codec, args, properties, bodies.items):
            _send(sock, b"".join(batch))
            for _ in batch:
                written += 1
                output.advance()
                if args.json:
                    output.emit("", {"message": written, "outcome": "written"})
    if not args.json:
        output.emit(f"wrote {written} message(s)", {})
    return 0


def _batches(
    codec: dmp.DMPCodec,
    args: argparse.Namespace,
    properties: dmp.BasicProperties,
    bodies: Iterable[bytes],
) -> Iterator[list[bytes]]:
    """Encoded envelopes in batches of about `WRITE_BATCH_BYTES`."""
    batch: list[bytes] = []
    size = 0
    for number, body in enumerate(bodies, start=1):
        envelope = dmp.Envelope(
            exchange=args.exchange, routing_key=args.routing_key, properties=properties, body=body
        )
        try:
            wire = codec.send(envelope)
        except dmp.DMPLocalError as exc:
            raise CommandError(f"message {number} cannot be sent: {exc}") from None
        batch.append(wire)
        size += len(wire)
        if size >= WRITE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _get(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``dmp get``: print envelopes until ``--count`` have come."""
    sock, codec, pending = _open(args, args.timeout or DEFAULT_TIMEOUT_SECONDS)
    with sock:
        sock.settimeout(args.timeout)
        envelopes = _envelopes(sock, codec, pending)
        print_received(args, out, err, ((_line(e), _record(e)) for e in envelopes))
    return 0


def _envelopes(
    sock: socket.socket, codec: dmp.DMPCodec, pending: list[dmp.Event]
) -> Iterator[dmp.Envelope]:
    """The envelopes in ``pending``, then each the feed sends."""
    while True:
        for event in pending:
            if isinstance(event, dmp.Envelope):
                yield event
        pending = receive(sock, codec.receive_data, "a message")


def _line(envelope: dmp.Envelope) -> str:
    """Routing key, message-id and body, ``-`` for what is empty."""
    message_id = envelope.properties.message_id or "-"
    return f"{envelope.routing_key or '-'} {message_id} {printable(envelope.body)}"


def _record(envelope: dmp.Envelope) -> dict[str, object]:
    """An envelope as a JSON object."""
    properties = envelope.properties
    record: dict[str, object] = {
        "exchange": envelope.exchange,
        "routing_key": envelope.routing_key,
        "message_id": properties.message_id,
    }
    if properties.timestamp is not None:
        record["timestamp"] = properties.timestamp
    if properties.headers:
        record["headers"] = json_value(properties.headers)
    return record | body_fields(envelope.body)
