"""``msggateway mtl send|receive|keygen``: MTL by hand, over ZeroMQ with pyzmq.

`MTLSession` is a small blocking MTL client (../shared/specs/mtl.txt) on
the gateway's own codec (`gateway.codecs.mtl`): a REQ control socket
(Connection.Open, a SASL login when the server answers 401, Connection.Profile,
Connection.Writer or Connection.Reader) and a DEALER data socket on the port
of the 202 reply (Lease, then Summon for a reader). Pings from the server
are answered with Pong.

``send [BODY...]`` writes one Content per body to a resource. With
``--confirm full`` (the gateway profile) each gets its outcome: Confirm is
accepted, Reject rejected, Reject with recycle retry later; with ``none``
(the test profile's only model) a last Ping and its Pong make sure the
server has read every Content before the command says they were sent.
``receive`` summons resources and prints each Content (resource and body,
or a JSON object), confirming it with ``--confirm full``, until
``--count`` have come. ``keygen PATH`` writes a CURVE secret key file and
prints its public key.

MTL has no TLS: its encryption is CURVE. ``--server-key`` (the listener's
public key, as ``keygen`` prints it) makes both sockets CURVE clients, with
the key pair of ``--key-file`` or a fresh one.
"""

from __future__ import annotations

import argparse
import base64
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TextIO

from gateway.cli.arguments import (
    DEFAULT_TIMEOUT_SECONDS,
    Commands,
    add_address_argument,
    add_header_argument,
    add_protocol_command,
    add_receiver_arguments,
    add_sender_arguments,
    add_timeout_argument,
    add_window_argument,
    secret_from_env,
)
from gateway.cli.bodies import add_body_arguments, message_bodies
from gateway.cli.connection import Address
from gateway.cli.errors import CommandError, UsageError
from gateway.cli.output import Output, body_fields, json_value, printable, reporting
from gateway.cli.results import InOrderOutcomes, print_received
from gateway.codecs import mtl, scram
from gateway.codecs.fieldtable import FieldValue

if TYPE_CHECKING:
    import zmq

__all__ = ["DEFAULT_WINDOW", "MTLSession", "add_commands"]

DEFAULT_WINDOW: Final = 1000
"""Contents sent and not yet confirmed, at most, by default (``--confirm full``)."""

MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "EXTERNAL")
"""The SASL mechanisms the command can log in with."""


class MTLSession:
    """One MTL connection: the control socket, then a data flow.

    Args:
        context: The ZeroMQ context the sockets are made in.
        address: The server's control socket.
        timeout: Seconds to wait for any answer (None: for ever).
        server_key: The server's CURVE public key (Z85), or None for plaintext.
        secret_key: Our CURVE secret key (Z85); None: a fresh key pair.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        address: Address,
        *,
        timeout: float | None,
        server_key: bytes | None = None,
        secret_key: bytes | None = None,
    ) -> None:
        import zmq

        self._zmq_context = context
        self._host = address.host
        self._timeout_ms = None if timeout is None else int(timeout * 1000)
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if server_key is not None:
            if secret_key is None:
                public_key, secret_key = zmq.curve_keypair()
            else:
                public_key = zmq.curve_public(secret_key)
            self._curve = (server_key, public_key, secret_key)
        self._control = self._socket(zmq.REQ)
        self._control.connect(f"tcp://{address}")
        self._data: zmq.Socket[bytes] | None = None
        self._sequence = itertools.count(1)
        self._waiting: list[mtl.DataCommand] = []

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        import zmq

        made = self._zmq_context.socket(kind)
        made.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            server_key, public_key, secret_key = self._curve
            made.curve_serverkey = server_key
            made.curve_publickey = public_key
            made.curve_secretkey = secret_key
        return made

    def set_timeout(self, timeout: float | None) -> None:
        """Change how long to wait for the server (None: for ever)."""
        self._timeout_ms = None if timeout is None else int(timeout * 1000)

    def _receive(self, socket: zmq.Socket[bytes], waiting_for: str) -> list[bytes]:
        if not socket.poll(self._timeout_ms):
            raise CommandError(f"timed out waiting for {waiting_for}")
        return socket.recv_multipart()

    # --- control flow ---------------------------------------------------------------------

    def ask(self, command: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Send a control request; return the reply's status and body.

        Raises:
            CommandError: No reply in time, or an ill-formed one.
        """
        self._control.send_multipart(mtl.request(command, body))
        parsed = mtl.parse_reply(self._receive(self._control, f"the answer to {command}"))
        if parsed is None:
            raise CommandError(f"an ill-formed answer to {command}")
        return parsed

    def open(
        self,
        virtual_host: str,
        *,
        mechanism: str,
        username: str | None = None,
        password: bytes | None = None,
    ) -> list[str]:
        """Connection.Open, and a login when the server asks for one; return the profiles.

        Raises:
            CommandError: Refused, or a login is needed and none was given.
        """
        opening = {"protocol": {"name": "MTL", "version": 1}, "virtual-host": virtual_host}
        status, body = self.ask("Connection.Open", opening)
        if status == 401:
            offered = body.get("mechanisms", [])
            if mechanism not in offered:
                raise CommandError(f"the server wants a login with one of {offered}")
            status, body = self._login(mechanism, username, password)
        if status != 201:
            raise CommandError(f"Connection.Open: {_refusal(status, body)}")
        return [str(profile) for profile in body.get("profiles", [])]

    def _login(
        self, mechanism: str, username: str | None, password: bytes | None
    ) -> tuple[int, dict[str, Any]]:
        """Connection.Authorize with PLAIN, SCRAM-SHA-256 (its 402 rounds) or EXTERNAL."""
        if mechanism == "EXTERNAL":
            return self._authorize(mechanism, (username or "").encode())
        if username is None or password is None:
            raise CommandError("the server wants a login: give --username and --password-env")
        if mechanism == "PLAIN":
            return self._authorize(mechanism, b"\0" + username.encode() + b"\0" + password)
        try:
            exchange = scram.ScramClient(username, password)
            status, body = self._authorize(mechanism, exchange.first())
            if status != 402:
                return status, body
            status, body = self._authorize(mechanism, exchange.final(_challenge(body)))
            if status != 402:
                return status, body
            exchange.verify(_challenge(body))
        except (scram.ScramError, ValueError) as exc:
            raise CommandError(f"SCRAM-SHA-256 login failed: {exc}") from None
        return self._authorize(mechanism, b"")

    def _authorize(self, mechanism: str, response: bytes) -> tuple[int, dict[str, Any]]:
        encoded = base64.b64encode(response).decode("ascii")
        return self.ask("Connection.Authorize", {"mechanism": mechanism, "response": encoded})

    def lease(self, profile: str, kind: str, resources: list[str], confirm: str) -> None:
        """Select the profile, ask for a reader or writer lease, open the data flow with it.

        Args:
            profile: The profile (``test``, ``gateway``).
            kind: ``Reader`` or ``Writer``.
            resources: The lease's resources.
            confirm: ``none`` or ``full``.

        Raises:
            CommandError: A refusal, or no answer in time.
        """
        status, body = self.ask("Connection.Profile", {"profile": profile})
        if status != 200:
            raise CommandError(f"profile {profile}: {_refusal(status, body)}")
        request = {"resources": resources, "confirm": confirm}
        status, body = self.ask(f"Connection.{kind}", request)
        if status != 202:
            raise CommandError(f"Connection.{kind}: {_refusal(status, body)}")
        import zmq

        self._data = self._socket(zmq.DEALER)
        self._data.connect(f"tcp://{_host(self._host)}:{int(body.get('port', 0))}")
        code = self.command(mtl.Lease(self.next_sequence(), str(body.get("lease", ""))))
        if code != 200:
            raise CommandError(f"the data lease was refused ({code})")

    # --- data flow -------------------------------------------------------------------------

    def next_sequence(self) -> int:
        """The next command sequence (Lease, Summon, Dismiss)."""
        return next(self._sequence)

    def send(self, command: mtl.DataCommand) -> None:
        """Send one data command."""
        assert self._data is not None
        self._data.send_multipart(mtl.encode_data(command))

    def command(self, command: mtl.Lease | mtl.Summon | mtl.Dismiss) -> int:
        """Send a command that is answered with a Response; return its code.

        What comes meanwhile (Contents, Confirms) is kept for `next`.
        """
        self.send(command)
        while True:
            answer = self._next_from_server(f"the answer to {type(command).__name__}")
            if isinstance(answer, mtl.Response) and answer.sequence == command.sequence:
                return answer.code
            self._waiting.append(answer)

    def next(self, waiting_for: str) -> mtl.DataCommand:
        """The next data command from the server (Pings are answered, not returned)."""
        if self._waiting:
            return self._waiting.pop(0)
        return self._next_from_server(waiting_for)

    def _next_from_server(self, waiting_for: str) -> mtl.DataCommand:
        assert self._data is not None
        while True:
            frames = self._receive(self._data, waiting_for)
            try:
                command = mtl.decode_data(frames)
            except mtl.MTLError:
                continue  # the spec: ill-formed commands are dropped
            if isinstance(command, mtl.Ping):
                self.send(mtl.Pong())
            else:
                return command

    def round_trip(self) -> None:
        """Ping and wait for the Pong: the server has read everything sent before."""
        self.send(mtl.Ping())
        while not isinstance(self.next("the server's Pong"), mtl.Pong):
            pass

    def close(self) -> None:
        """Close both sockets (unsent data is dropped)."""
        self._control.close(linger=0)
        if self._data is not None:
            self._data.close(linger=0)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _challenge(body: dict[str, Any]) -> bytes:
    return base64.b64decode(str(body.get("challenge", "")), validate=True)


def _refusal(status: int, body: dict[str, Any]) -> str:
    """A refusal in words: the status and the server's reason or status text."""
    return f"{status} {body.get('reason') or body.get('status') or ''}".strip()


# --- the commands ------------------------------------------------------------------------


def add_commands(commands: Commands) -> None:
    """Add ``mtl send``, ``mtl receive`` and ``mtl keygen``."""
    actions = add_protocol_command(
        commands,
        "mtl",
        help="send or receive MTL content by hand; make CURVE keys",
        description="Send or receive MTL content over ZeroMQ, against the gateway or any MTL"
        " server, and make CURVE key files for MTL listeners and upstreams.",
    )
    send = actions.add_parser(
        "send",
        help="write content to a resource; print each outcome",
        description="Get a writer lease and send one Content per body to --resource. With"
        " --confirm full each is confirmed (accepted), rejected, or rejected with recycle"
        " (retry later); with none, each is sent once the server has read it. Exit status:"
        " 0 when every message was accepted or sent, 1 otherwise, 2 for usage errors.",
    )
    _add_connection_arguments(send)
    add_body_arguments(send)
    add_header_argument(send, "property")
    add_window_argument(
        send, DEFAULT_WINDOW, "most Contents unconfirmed at once with --confirm full"
    )
    add_sender_arguments(send)
    add_timeout_argument(send)
    send.set_defaults(run=_send, kind="Writer")
    receive = actions.add_parser(
        "receive",
        help="print content from resources",
        description="Get a reader lease, summon the resources and print each Content:"
        " resource and body on one line (or a JSON object), until --count have come."
        " With --confirm full each is confirmed.",
    )
    _add_connection_arguments(receive)
    add_receiver_arguments(receive)
    add_timeout_argument(receive, None, "seconds to wait for each message")
    receive.set_defaults(run=_receive, kind="Reader")
    keygen = actions.add_parser(
        "keygen",
        help="write a new CURVE secret key file; print its public key",
        description="Write a new CURVE secret key file (mode 0600, never overwritten) for an"
        " MTL listener or upstream, and print its public key.",
    )
    keygen.add_argument("path", metavar="PATH", help="the key file to create")
    keygen.set_defaults(run=_keygen)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The server, the resources, the profile and lease, the login, CURVE."""
    add_address_argument(parser, "mtl")
    parser.add_argument(
        "--resource",
        dest="resources",
        action="append",
        metavar="NAME",
        help="resource to write to or read from; receive takes several"
        " (default: resource, the test profile's one)",
    )
    parser.add_argument(
        "--profile", default="test", help="test (the spec's) or gateway (default: test)"
    )
    parser.add_argument(
        "--confirm",
        choices=("none", "full"),
        default="none",
        help="the lease's confirmation model (default: none; the test profile has no other)",
    )
    parser.add_argument("--vhost", default="/", help="virtual host to open (default: /)")
    _add_login_arguments(parser)
    _add_curve_arguments(parser)


def _add_login_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("login (when the server answers 401)")
    group.add_argument("--username", metavar="NAME", help="the login's user name")
    group.add_argument(
        "--password-env", metavar="VAR", help="environment variable with the password"
    )
    group.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="PLAIN",
        help="SASL mechanism (default: PLAIN; EXTERNAL logs in as the CURVE key's identity)",
    )


def _add_curve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CURVE (MTL's encryption; MTL has no TLS)")
    group.add_argument(
        "--server-key",
        metavar="KEY",
        help="the server's CURVE public key (Z85, as mtl keygen prints it): encrypt both flows",
    )
    group.add_argument(
        "--key-file",
        metavar="PATH",
        help="our CURVE secret key file (as mtl keygen writes it; default: a fresh key pair)",
    )


def _open(args: argparse.Namespace, context: zmq.Context[zmq.Socket[bytes]]) -> MTLSession:
    """Make the session, log in, lease and (for a reader) summon, as the flags say."""
    from gateway.protocols.mtl.settings import curve_key, read_curve_secret_key

    password = secret_from_env(args.password_env) if args.password_env else None
    resources: list[str] = args.resources or ["resource"]
    if args.kind == "Writer" and len(resources) > 1:
        raise UsageError("mtl send: give one --resource")
    try:
        server_key = curve_key(args.server_key) if args.server_key else None
        secret_key = read_curve_secret_key(Path(args.key_file)) if args.key_file else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if secret_key is not None and server_key is None:
        raise UsageError("--key-file goes with --server-key")
    session = MTLSession(
        context,
        args.address,
        timeout=args.timeout or DEFAULT_TIMEOUT_SECONDS,
        server_key=server_key,
        secret_key=secret_key,
    )
    try:
        session.open(
            args.vhost,
            mechanism=args.mechanism,
            username=args.username,
            password=None if password is None else password.encode("utf-8"),
        )
        session.lease(args.profile, args.kind, resources, args.confirm)
        if args.kind == "Reader":
            for resource in resources:
                code = session.command(mtl.Summon(session.next_sequence(), resource))
                if code != 200:
                    raise CommandError(f"summoning {resource} was refused ({code})")
    except BaseException:
        session.close()
        raise
    return session


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    import zmq

    return zmq.Context()


def _send(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``mtl send``: one Content per body; each one's outcome."""
    bodies = message_bodies(args, stdin)
    properties = dict(args.headers)
    context = _context()
    try:
        session = _open(args, context)
        try:
            with reporting(args, out, err, total=bodies.total, desc="sent") as output:
                writer = _Writer(session, output, output.advance, resource=_one(args.resources))
                if args.confirm == "full":
                    return writer.confirmed(bodies.items, properties, args.window)
                return writer.unconfirmed(bodies.items, properties)
        finally:
            session.close()
    finally:
        context.destroy(linger=0)


def _one(resources: list[str] | None) -> str:
    return resources[0] if resources else "resource"


class _Writer:
    """Sends Contents to one resource and prints what became of each, in order."""

    def __init__(
        self,
        session: MTLSession,
        output: Output,
        advance: Callable[[int], object],
        *,
        resource: str,
    ) -> None:
        self._session = session
        self._resource = resource
        self._outcomes = InOrderOutcomes(output, advance)

    def _settle(self, sequence: int, outcome: str) -> None:
        record = {"message": sequence, "resource": self._resource, "outcome": outcome}
        self._outcomes.settle(sequence, outcome, f"{sequence} {outcome}", record)

    def _send(self, body: bytes, properties: dict[str, FieldValue]) -> None:
        sequence = self._outcomes.take_number()
        self._session.send(mtl.Content(sequence, self._resource, properties, body))

    def unconfirmed(self, bodies: Iterable[bytes], properties: dict[str, FieldValue]) -> int:
        """``--confirm none``: send them all, then a Ping; each is sent once the Pong comes."""
        for body in bodies:
            self._send(body, properties)
        self._session.round_trip()
        for sequence in range(self._outcomes.next_printed, self._outcomes.last_number + 1):
            self._settle(sequence, "sent")
        self._outcomes.print_ready()
        return 0

    def confirmed(
        self, bodies: Iterable[bytes], properties: dict[str, FieldValue], window: int
    ) -> int:
        """``--confirm full``: at most ``window`` unconfirmed; print each outcome in order."""
        source = iter(bodies)

        def send_some() -> bool:
            while self._outcomes.waiting < window:
                body = next(source, None)
                if body is None:
                    return True
                self._send(body, properties)
            return False

        def read_answer() -> None:
            self._read_answer(self._session.next("confirmations"))

        return int(self._outcomes.send_within(window, send_some, read_answer))

    def _read_answer(self, answer: mtl.DataCommand) -> None:
        """Settle what a Confirm or Reject says (``multiple``: every open one up to it)."""
        if isinstance(answer, mtl.Confirm):
            outcome = "accepted"
        elif isinstance(answer, mtl.Reject):
            outcome = "retry" if answer.recycle else "rejected"
        else:
            return  # a stray Response or Pong
        unsettled = self._outcomes.next_printed
        last = min(answer.sequence, self._outcomes.last_number)
        first = unsettled if answer.multiple else last
        for sequence in range(max(first, unsettled), last + 1):
            self._settle(sequence, outcome)


def _receive(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``mtl receive``: print Contents until ``--count`` have come."""
    context = _context()
    try:
        session = _open(args, context)
        session.set_timeout(args.timeout)
        confirm = args.confirm == "full"
        try:
            print_received(args, out, err, _contents(session, confirm=confirm))
            if confirm:
                session.round_trip()  # the last Confirm is read before the sockets close
        finally:
            session.close()
    finally:
        context.destroy(linger=0)
    return 0


def _contents(session: MTLSession, *, confirm: bool) -> Iterator[tuple[str, dict[str, object]]]:
    """Each Content's line and record as it comes, confirmed first if ``confirm``."""
    while True:
        command = session.next("content")
        if isinstance(command, mtl.Content):
            if confirm:
                session.send(mtl.Confirm(command.sequence))
            yield _content_line(command), _content_record(command)


def _content_line(content: mtl.Content) -> str:
    return f"{content.resource or '-'} {printable(content.body)}"


def _content_record(content: mtl.Content) -> dict[str, object]:
    record: dict[str, object] = {"resource": content.resource, "sequence": content.sequence}
    if content.properties:
        record["properties"] = json_value(content.properties)
    return record | body_fields(content.body)


def _keygen(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: IO[bytes]) -> int:
    """``mtl keygen``: write a secret key file; print its public key."""
    from gateway.protocols.mtl.curve import write_key_pair

    try:
        public_key = write_key_pair(Path(args.path))
    except OSError as exc:
        raise CommandError(f"{args.path}: {exc.strerror or exc}") from None
    out.write(f"{public_key.decode('ascii')}\n")
    return 0
