"""``msggateway ssmp publish|subscribe``: send or watch SSMP messages by hand.

A small blocking SSMP client (`SSMPProbe`, on the gateway's own codec) for
operators, against the gateway or any SSMP server, over TCP or TLS.

``publish TOPIC [BODY...]`` logs in and sends one MCAST per body, each
answered before the next goes; it prints each answer (the response line,
or with ``--json`` an object with the outcome: 200 is accepted, ``400
retry: ...`` retry later, any other answer rejected). ``subscribe
TOPIC...`` prints the events of the topics as their wire lines (or JSON
objects) until ``--count`` have come. SSMP payloads are one line of at most
about a kilobyte: a body that cannot be carried is an error of its own and
the others still go.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Callable, Iterator
from typing import IO, TextIO

from gateway.cli.arguments import (
    DEFAULT_TIMEOUT_SECONDS,
    Commands,
    add_address_argument,
    add_protocol_command,
    add_receiver_arguments,
    add_sender_arguments,
    add_timeout_argument,
    add_tls_arguments,
    secret_from_env,
)
from gateway.cli.bodies import add_body_arguments, message_bodies
from gateway.cli.connection import READ_BYTES, Address, connect, tls_from
from gateway.cli.errors import CommandError
from gateway.cli.output import body_fields, printable, reporting
from gateway.cli.results import print_received
from gateway.codecs import ssmp

__all__ = ["SSMPProbe", "SSMPProbeError", "add_commands", "describe", "outcome_of"]


class SSMPProbeError(Exception):
    """The server refused, closed, or sent something unexpected."""


class SSMPProbe:
    """One blocking SSMP connection.

    Args:
        address: ``(host, port)``.
        context: TLS context, or None for plain TCP.
        timeout: Seconds a read may wait (None: forever).
    """

    def __init__(
        self,
        address: tuple[str, int],
        context: ssl.SSLContext | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        self._sock = connect(address, context, timeout)
        self._sock.settimeout(timeout)
        self._codec = ssmp.SSMPCodec(ssmp.Role.CLIENT)
        self._lines: list[ssmp.Line] = []

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def set_timeout(self, timeout: float | None) -> None:
        """Change how long a read may wait (None: forever)."""
        self._sock.settimeout(timeout)

    def _next_line(self) -> ssmp.Line:
        while not self._lines:
            try:
                data = self._sock.recv(READ_BYTES)
            except TimeoutError:
                raise SSMPProbeError("timed out waiting for the server") from None
            if not data:
                raise SSMPProbeError("the server closed the connection")
            try:
                self._lines.extend(self._codec.receive_data(data))
            except ssmp.SSMPError as exc:
                raise SSMPProbeError(f"bad input from the server: {exc.reason}") from None
        return self._lines.pop(0)

    def _send(self, request: ssmp.Request) -> None:
        self._sock.sendall(self._codec.send(request))

    def request(
        self, request: ssmp.Request, on_event: Callable[[ssmp.Event], None] | None = None
    ) -> ssmp.Response:
        """Send a request and return its response; events meanwhile go to ``on_event``.

        Raises:
            ssmp.SSMPLocalError: The request cannot be carried (nothing was sent).
            SSMPProbeError: No answer, or a bad one.
        """
        self._send(request)
        while True:
            line = self._next_line()
            if isinstance(line, ssmp.Response):
                return line
            if isinstance(line, ssmp.Event):
                self._on_event(line, on_event)

    def _on_event(self, event: ssmp.Event, on_event: Callable[[ssmp.Event], None] | None) -> None:
        if isinstance(event.message, ssmp.Ping):
            self._send(ssmp.PONG)  # Spec: clients MUST answer a PING event.
        elif on_event is not None:
            on_event(event)

    def login(self, identity: str, scheme: str, credential: str | None = None) -> None:
        """Log in.

        Raises:
            SSMPProbeError: The server did not answer 200.
        """
        response = self.request(
            ssmp.Login(
                identity=identity.encode("ascii"),
                scheme=scheme.encode("ascii"),
                credential=credential.encode("utf-8") if credential else None,
            )
        )
        if response.code != 200:
            raise SSMPProbeError(f"login refused: {describe(response)}")

    def events(self) -> Iterator[ssmp.Event]:
        """Yield events as they come (PINGs are answered, not yielded)."""
        while True:
            line = self._next_line()
            if isinstance(line, ssmp.Event) and not isinstance(line.message, ssmp.Ping):
                yield line
            elif isinstance(line, ssmp.Event):
                self._on_event(line, None)


def describe(line: ssmp.Response | ssmp.Event) -> str:
    """Return a line as text, the way it looks on the wire (without the LF)."""
    return ssmp.encode(line).rstrip(b"\n").decode("utf-8", "backslashreplace")


def outcome_of(response: ssmp.Response) -> str:
    """``accepted`` for 200, ``retry`` for the gateway's ``400 retry: ...``, else ``rejected``."""
    if response.code == 200:
        return "accepted"
    if response.code == 400 and (response.payload or b"").startswith(b"retry:"):
        return "retry"
    return "rejected"


# --- the commands ------------------------------------------------------------------------


def add_commands(commands: Commands) -> None:
    """Add ``ssmp publish`` and ``ssmp subscribe``."""
    actions = add_protocol_command(
        commands,
        "ssmp",
        help="publish or watch SSMP messages by hand",
        description="Send or watch SSMP messages, against the gateway or any SSMP server.",
    )
    publish = actions.add_parser(
        "publish",
        help="MCAST messages to a topic; print each answer",
        description="Log in and MCAST each body to TOPIC, one at a time; print each answer:"
        " the response line, or with --json its outcome. Exit status: 0 when every"
        " message got 200, 1 otherwise, 2 for usage errors.",
    )
    _add_connection_arguments(publish)
    publish.add_argument("topic", metavar="TOPIC", help="the topic to MCAST to")
    add_body_arguments(publish)
    add_sender_arguments(publish)
    add_timeout_argument(publish)
    publish.set_defaults(run=_publish)
    subscribe = actions.add_parser(
        "subscribe",
        help="print the events of topics",
        description="Log in, subscribe to each TOPIC and print every event as its wire line"
        " (or a JSON object) until --count have come.",
    )
    _add_connection_arguments(subscribe)
    subscribe.add_argument(
        "topics", nargs="+", metavar="TOPIC", help="a topic to subscribe to (exact, no wildcards)"
    )
    subscribe.add_argument("--presence", action="store_true", help="subscribe with PRESENCE")
    add_receiver_arguments(subscribe)
    add_timeout_argument(subscribe, None, "seconds to wait for each event")
    subscribe.set_defaults(run=_subscribe)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The server, the login, TLS."""
    add_address_argument(parser, "ssmp")
    parser.add_argument("--identity", default=".", help="LOGIN identity (default: .)")
    parser.add_argument("--scheme", default="open", help="LOGIN scheme (default: open)")
    parser.add_argument(
        "--secret-env", metavar="VAR", help="environment variable holding the credential"
    )
    add_tls_arguments(parser)


def _open(args: argparse.Namespace, timeout: float | None) -> SSMPProbe:
    """Connect and log in as the flags say."""
    secret = secret_from_env(args.secret_env) if args.secret_env else None
    context = tls_from(args)
    address: Address = args.address
    try:
        probe = SSMPProbe(address, context, timeout=timeout)
    except OSError as exc:
        raise CommandError(f"cannot connect to {address}: {exc}") from None
    try:
        probe.login(args.identity, args.scheme, secret)
    except (SSMPProbeError, OSError) as exc:
        probe.close()
        raise CommandError(str(exc)) from None
    return probe


def _publish(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``ssmp publish``: one MCAST per body, each answered before the next."""
    bodies = message_bodies(args, stdin)
    probe = _open(args, args.timeout)
    topic = os.fsencode(args.topic)
    status = 0
    with reporting(args, out, err, total=bodies.total, desc="published") as output:
        try:
            for number, body in enumerate(bodies.items, start=1):
                record: dict[str, object] = {"message": number, "topic": args.topic}
                try:
                    # A payload is one line: a file's last line end is not part of it.
                    payload = body.removesuffix(b"\n").removesuffix(b"\r")
                    response = probe.request(ssmp.Mcast(topic=topic, payload=payload))
                except ssmp.SSMPLocalError as exc:
                    status = 1
                    failed = {**record, "outcome": "error", "reason": exc.reason}
                    output.emit(f"error: {exc.reason}", failed)
                    continue
                outcome = outcome_of(response)
                status = status or int(outcome != "accepted")
                reply = printable(response.payload or b"")
                output.emit(
                    describe(response),
                    {**record, "outcome": outcome, "code": response.code, "reply": reply},
                )
                output.advance()
        except (SSMPProbeError, OSError) as exc:
            raise CommandError(str(exc)) from None
        finally:
            probe.close()
    return status


def _subscribe(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``ssmp subscribe``: print events until ``--count`` have come."""
    probe = _open(args, args.timeout or DEFAULT_TIMEOUT_SECONDS)
    try:
        for topic in args.topics:
            response = probe.request(
                ssmp.Subscribe(topic=os.fsencode(topic), presence=args.presence)
            )
            if response.code != 200:
                raise CommandError(f"SUBSCRIBE {topic}: {describe(response)}")
        probe.set_timeout(args.timeout)
        print_received(
            args, out, err, ((describe(event), _event_record(event)) for event in probe.events())
        )
    except (SSMPProbeError, OSError, ssmp.SSMPLocalError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        probe.close()
    return 0


def _event_record(event: ssmp.Event) -> dict[str, object]:
    """An event as a JSON object: source, verb, topic or recipient, and body."""
    record: dict[str, object] = {"source": printable(event.source)}
    message = event.message
    match message:
        case ssmp.Mcast(topic=topic, payload=payload):
            record |= {"verb": "MCAST", "topic": printable(topic), **body_fields(payload)}
        case ssmp.Ucast(to=to, payload=payload):
            record |= {"verb": "UCAST", "to": printable(to), **body_fields(payload)}
        case ssmp.Bcast(payload=payload):
            record |= {"verb": "BCAST", **body_fields(payload)}
        case ssmp.Subscribe(topic=topic, presence=presence):
            record |= {"verb": "SUBSCRIBE", "topic": printable(topic), "presence": presence}
        case ssmp.Unsubscribe(topic=topic):
            record |= {"verb": "UNSUBSCRIBE", "topic": printable(topic)}
        case _:
            record |= {"verb": describe(event).split(" ", 3)[2]}
    return record
