r"""A blocking client of the RabbitMQ stream protocol: one socket, the gateway's codec, no reactor.

For code that cannot run a reactor: the command line (``msggateway stream
publish|consume``, `gateway.cli.stream`) and the Spark sink's tasks
(`gateway.spark.sink`, in executors). `BlockingStreamClient` speaks the
client role of the stream protocol (docs/stream-protocol-notes.md) with
`gateway.codecs.stream`:

- `BlockingStreamClient.open`: PeerProperties, SaslHandshake,
  SaslAuthenticate with PLAIN, the server's Tune and ours, Open (notes,
  section 6);
- `BlockingStreamClient.request`: a request, and its response matched by
  correlation id;
- frames that come unasked are handled as they are read, whichever call is
  reading: PublishConfirm and PublishError go to the callbacks when they
  were given, else, with Deliver and the rest, into a queue that
  `BlockingStreamClient.next` takes from; a Heartbeat is dropped; a Close
  is answered and, like a MetadataUpdate (a stream went away), ends the
  session with `StreamClientError` saying why.

Waiting is bounded by ``timeout``: the seconds the client waits without a
frame from the server (a Heartbeat is not one). While it waits it sends a
Heartbeat whenever it has been silent for the negotiated interval, so that a
long wait is not taken for a dead peer. Every failure (refused, closed, lost,
timed out, malformed) is a `StreamClientError`, a `ConnectionError`.

`connect` opens the socket a client endpoint string describes
(`parse_endpoint`: ``tcp:`` and ``tls:``, read as Twisted's
``clientFromString`` reads them), for the sink's ``endpoint`` option; the
command line connects with its own flags (`gateway.cli.connection`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from gateway import __version__
from gateway.codecs import stream as sp
from gateway.codecs.errors import ProtocolError
from gateway.codecs.stream import ENTRY_OVERHEAD_BYTES, PUBLISH_OVERHEAD_BYTES, REJECTING_CODES

__all__ = [
    "CLOSE_TIMEOUT_SECONDS",
    "CONNECT_TIMEOUT_SECONDS",
    "ENTRY_OVERHEAD_BYTES",
    "PUBLISH_OVERHEAD_BYTES",
    "RECEIVE_BYTES",
    "REJECTING_CODES",
    "BlockingStreamClient",
    "Endpoint",
    "StreamClientError",
    "code_name",
    "connect",
    "parse_endpoint",
]

CONNECT_TIMEOUT_SECONDS: Final = 30.0
"""Twisted's default ``timeout`` for a client endpoint."""

CLOSE_TIMEOUT_SECONDS: Final = 2.0
"""How long a clean Close waits for the server's CloseResponse, by default."""

RECEIVE_BYTES: Final = 262_144
"""Bytes asked of one ``recv``: a Deliver chunk or a run of confirms in a few reads."""


def code_name(code: int) -> str:
    """A response code in words: ``stream does not exist`` for 2."""
    try:
        return sp.ResponseCode(code).name.lower().replace("_", " ")
    except ValueError:
        return f"code {code}"


# --- endpoints -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to connect: a ``tcp:`` or ``tls:`` client endpoint string, parsed."""

    host: str
    port: int
    tls: bool = False
    timeout: float = CONNECT_TIMEOUT_SECONDS
    trust_roots: str | None = None
    certificate: str | None = None
    private_key: str | None = None

    def __str__(self) -> str:
        return f"{'tls' if self.tls else 'tcp'}:{self.host}:{self.port}"


def _tokens(description: str) -> list[tuple[str | None, str]]:
    r"""Twisted's endpoint string fields: ``(key or None, value)``, ``\\`` escaping one char."""
    fields: list[tuple[str | None, str]] = []
    key: str | None = None
    current: list[str] = []
    chars = iter(description)
    for char in chars:
        if char == "\\":
            current.append(next(chars, ""))
        elif char == ":":
            fields.append((key, "".join(current)))
            key, current = None, []
        elif char == "=" and key is None:
            key, current = "".join(current), []
        else:
            current.append(char)
    fields.append((key, "".join(current)))
    return fields


def parse_endpoint(description: str) -> Endpoint:
    """Parse ``tcp:host=H:port=P`` or ``tls:host=H:port=P[:trustRoots=...]...``.

    Host and port may also be positional (``tcp:H:P``). ``timeout`` is the
    connection's (seconds). A ``tls:`` endpoint verifies the server's
    certificate and name against ``trustRoots`` (else the system's CAs) and
    presents ``certificate`` with ``privateKey`` (the certificate file's own
    key when that is not given).

    Raises:
        ValueError: Another kind of endpoint, a key it does not take, or a
            missing or malformed host or port.
    """
    (_, kind), *fields = _tokens(description.strip())
    if kind not in ("tcp", "tls"):
        raise ValueError(f"endpoint {description!r}: only tcp: and tls: endpoints can publish")
    allowed = {"host", "port", "timeout"}
    if kind == "tls":
        allowed |= {"trustRoots", "certificate", "privateKey"}
    positional = [value for key, value in fields if key is None]
    named = {key: value for key, value in fields if key is not None}
    unknown = sorted(set(named) - allowed)
    if unknown or len(positional) > 2:
        what = ", ".join(unknown) if unknown else "more than a host and a port"
        raise ValueError(f"endpoint {description!r}: {kind}: does not take {what} here")
    for name, value in zip(("host", "port"), positional, strict=False):
        named.setdefault(name, value)
    if not named.get("host"):
        raise ValueError(f"endpoint {description!r}: no host")
    try:
        port = int(named.get("port", ""))
        timeout = float(named.get("timeout", CONNECT_TIMEOUT_SECONDS))
    except ValueError:
        raise ValueError(f"endpoint {description!r}: port and timeout are numbers") from None
    if not 0 < port < 65536:
        raise ValueError(f"endpoint {description!r}: port {port} is not a TCP port")
    return Endpoint(
        host=named["host"],
        port=port,
        tls=kind == "tls",
        timeout=timeout,
        trust_roots=named.get("trustRoots"),
        certificate=named.get("certificate"),
        private_key=named.get("privateKey"),
    )


def _tls_context(endpoint: Endpoint) -> ssl.SSLContext:
    """The client context a ``tls:`` endpoint describes (Twisted's reading of its keys)."""
    context = ssl.create_default_context()
    roots = endpoint.trust_roots
    if roots is not None:
        context = ssl.create_default_context(cafile=roots if os.path.isfile(roots) else None)
        if os.path.isdir(roots):  # every *.pem in it, as Twisted loads trustRoots
            pems = sorted(Path(roots).glob("*.pem")) + sorted(Path(roots).glob("*.PEM"))
            certificates = "".join(p.read_text("ascii", "replace") for p in pems)
            if not certificates:
                raise ValueError(f"trustRoots {roots}: no .pem certificate there")
            context = ssl.create_default_context(cadata=certificates)
    if endpoint.certificate is not None:
        context.load_cert_chain(endpoint.certificate, endpoint.private_key)
    return context


def connect(endpoint: Endpoint) -> socket.socket:
    """Open the connection ``endpoint`` describes: TCP without Nagle, then TLS for ``tls:``.

    Connecting and the TLS handshake wait at most ``endpoint.timeout``.

    Raises:
        OSError: The connection or the handshake failed (`ssl.SSLError` is one).
        ValueError: ``trustRoots`` is a directory without a ``.pem`` file.
    """
    raw = socket.create_connection((endpoint.host, endpoint.port), timeout=endpoint.timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.tls:
            return _tls_context(endpoint).wrap_socket(raw, server_hostname=endpoint.host)
    except BaseException:
        raw.close()
        raise
    return raw


# --- the client ------------------------------------------------------------------------------


class StreamClientError(ConnectionError):
    """The session cannot go on: refused, closed, lost, timed out, or bad data from the server."""


def _smaller(theirs: int, ours: int) -> int:
    """The tighter of two limits where 0 means none."""
    return min(theirs, ours) if theirs and ours else theirs or ours


class BlockingStreamClient:
    """One stream-protocol connection, client side, on a blocking socket (module docs).

    Args:
        sock: A connected socket (TLS handshake done: `connect`); `close` closes it.
        timeout: Seconds to wait without a frame from the server (None: for ever).
        on_confirm: Takes every PublishConfirm as it is read; without it they are queued.
        on_error: Takes every PublishError as it is read; without it they are queued.
        max_frame_bytes: Largest frame read (0: none). A client should allow
            more than it announces: the reference server does not cap Deliver
            frames (notes, 14.34).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float | None,
        on_confirm: Callable[[sp.PublishConfirm], object] | None = None,
        on_error: Callable[[sp.PublishError], object] | None = None,
        max_frame_bytes: int = 0,
    ) -> None:
        self._sock = sock
        self._timeout = timeout
        self._on_confirm = on_confirm
        self._on_error = on_error
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=max_frame_bytes)
        self._correlation = itertools.count(1)
        self._awaited: int | None = None
        self._response: sp.Event | None = None
        self._events: deque[sp.Event] = deque()
        self._frames = 0
        """Frames handled, Heartbeats aside: what a wait counts as progress."""
        self._sent_at = time.monotonic()
        self.frame_max = 0
        """The negotiated frame max (0: none), which a Publish frame must keep under."""
        self.heartbeat_seconds = 0.0
        """The negotiated heartbeat interval (0: none): the longest we stay silent while waiting."""

    def set_timeout(self, timeout: float | None) -> None:
        """Change how long to wait without a frame from the server (None: for ever)."""
        self._timeout = timeout

    # --- sending ---------------------------------------------------------------------------------

    def send(self, event: sp.Event) -> None:
        """Send one frame (waiting at most ``timeout`` for room to write it).

        Raises:
            StreamClientError: The connection is gone or stuck.
        """
        data = self._codec.send(event)
        self._sock.settimeout(self._timeout)
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise StreamClientError(f"sending failed: {exc.strerror or exc}") from None
        self._sent_at = time.monotonic()

    def publish(
        self, publisher_id: int, publishing_ids: Sequence[int], messages: Sequence[bytes]
    ) -> None:
        """Send one Publish frame: ``messages`` (stream entries) under their publishing ids."""
        self.send(
            sp.Publish(publisher_id=publisher_id, publishing_ids=publishing_ids, messages=messages)
        )

    def request(self, make: Callable[[int], sp.Event]) -> Any:
        """Send the request ``make(correlation_id)`` and return its response.

        Frames that come meanwhile are handled as always (callbacks, queue).
        A response read ahead of its request (a server that answers a script
        of requests at once) is taken from the queue.

        Raises:
            StreamClientError: No response in time, or the session ended.
        """
        correlation_id = next(self._correlation)
        request = make(correlation_id)
        self.send(request)
        for index, event in enumerate(self._events):
            if getattr(event, "correlation_id", None) == correlation_id:
                del self._events[index]
                return event
        self._awaited, self._response = correlation_id, None
        try:
            waiting_for = f"the answer to {type(request).__name__}"
            self._receive_until(lambda: self._response is not None, waiting_for)
            return self._response
        finally:
            self._awaited = self._response = None

    # --- receiving -------------------------------------------------------------------------------

    def next(self, waiting_for: str) -> sp.Event:
        """The next frame the server sent unasked (Heartbeats and what callbacks take aside).

        Args:
            waiting_for: What the caller awaits, for the time-out's message.

        Raises:
            StreamClientError: Nothing in time, the server closed the
                connection (its reason is the message), or a stream went away.
        """
        self._receive_until(lambda: bool(self._events), waiting_for)
        return self._events.popleft()

    def wait(self, waiting_for: str) -> None:
        """Wait for at least one frame (Heartbeats aside) and handle what comes.

        Raises:
            StreamClientError: As `next`.
        """
        before = self._frames
        self._receive_until(lambda: self._frames != before, waiting_for)

    def poll(self) -> None:
        """Handle what has arrived already, without waiting for more.

        Raises:
            StreamClientError: As `next`.
        """
        sock = self._sock
        while (isinstance(sock, ssl.SSLSocket) and sock.pending()) or select.select(
            [sock], [], [], 0
        )[0]:
            self._receive(self._timeout, "the rest of a frame")

    def _receive_until(self, done: Callable[[], bool], waiting_for: str) -> None:
        """Read and handle frames until ``done()``, sending a Heartbeat whenever one is due."""
        frames, since = self._frames, time.monotonic()
        while not done():
            now = time.monotonic()
            if self._frames != frames:
                frames, since = self._frames, now
            wait = None if self._timeout is None else since + self._timeout - now
            if wait is not None and wait <= 0:
                raise StreamClientError(f"timed out waiting for {waiting_for}")
            if self.heartbeat_seconds:
                beat = self._sent_at + self.heartbeat_seconds - now
                if beat <= 0:
                    self.send(sp.HEARTBEAT)
                    continue
                wait = beat if wait is None else min(wait, beat)
            self._receive(wait, waiting_for)

    def _receive(self, wait: float | None, waiting_for: str) -> None:
        """One ``recv`` of at most ``wait`` seconds; handle the frames it completes."""
        self._sock.settimeout(wait)
        try:
            data = self._sock.recv(RECEIVE_BYTES)
        except TimeoutError:
            return
        except OSError as exc:
            raise StreamClientError(f"connection lost: {exc.strerror or exc}") from None
        if not data:
            raise StreamClientError(
                f"the server closed the connection; we waited for {waiting_for}"
            )
        try:
            events = self._codec.receive_data(data)
        except ProtocolError as exc:
            raise StreamClientError(f"bad data from the server: {exc}") from None
        for event in events:
            self._take(event)

    def _take(self, event: sp.Event) -> None:
        """Hand a frame to its callback, the awaited request, or the queue; or end the session."""
        match event:
            case sp.Heartbeat():
                return
            case sp.Close(correlation_id=correlation_id, code=code, reason=reason):
                self.send(sp.CloseResponse(correlation_id=correlation_id, code=sp.ResponseCode.OK))
                raise StreamClientError(
                    f"the server closed the connection: {reason} ({code_name(code)})"
                )
            case sp.MetadataUpdate(stream=stream, code=code):
                raise StreamClientError(
                    f"stream {stream} is no longer available ({code_name(code)})"
                )
            case sp.PublishConfirm() if self._on_confirm is not None:
                self._on_confirm(event)
            case sp.PublishError() if self._on_error is not None:
                self._on_error(event)
            case _ if self._awaited is not None and (
                getattr(event, "correlation_id", None) == self._awaited
            ):
                self._response = event
            case _:
                self._events.append(event)
        self._frames += 1

    # --- opening and closing ---------------------------------------------------------------------

    def open(
        self,
        *,
        username: str,
        password: str,
        virtual_host: str,
        properties: Mapping[str, str] | None = None,
        heartbeats: bool = True,
    ) -> None:
        """PeerProperties, SASL PLAIN, Tune, Open (notes, section 6).

        Args:
            username: The PLAIN login.
            password: Its password.
            virtual_host: The virtual host to open.
            properties: Client properties, over ``product`` (msggateway) and ``version``.
            heartbeats: Take the server's heartbeat interval; False asks for
                none, for a caller that may neither read nor write for long.

        Raises:
            StreamClientError: The server refused the login or the virtual
                host, or the session ended.
        """
        offered = {"product": "msggateway", "version": __version__, **(properties or {})}
        self.request(lambda c: sp.PeerProperties(correlation_id=c, properties=offered))
        mechanisms = self.request(lambda c: sp.SaslHandshake(correlation_id=c)).mechanisms
        if "PLAIN" not in mechanisms:
            raise StreamClientError(f"the server offers no PLAIN login ({list(mechanisms)})")
        plain = b"\0" + username.encode() + b"\0" + password.encode()
        answer = self.request(
            lambda c: sp.SaslAuthenticate(correlation_id=c, mechanism="PLAIN", data=plain)
        )
        if answer.code != sp.ResponseCode.OK:
            raise StreamClientError(f"login as {username!r} refused ({code_name(answer.code)})")
        tune = self.next("the server's Tune")
        if not isinstance(tune, sp.Tune):
            raise StreamClientError(f"the server sent {type(tune).__name__} instead of Tune")
        self.frame_max = _smaller(tune.frame_max, sp.DEFAULT_FRAME_MAX_BYTES)
        heartbeat = tune.heartbeat if heartbeats else 0
        self.heartbeat_seconds = float(heartbeat)
        self.send(sp.Tune(frame_max=self.frame_max, heartbeat=heartbeat))
        opened = self.request(lambda c: sp.Open(correlation_id=c, virtual_host=virtual_host))
        if opened.code != sp.ResponseCode.OK:
            raise StreamClientError(
                f"virtual host {virtual_host!r} refused ({code_name(opened.code)})"
            )

    def close(self, timeout: float | None = CLOSE_TIMEOUT_SECONDS) -> None:
        """Close cleanly (Close, then its answer for at most ``timeout``), then the socket."""
        self._timeout = timeout
        self.heartbeat_seconds = 0.0
        try:
            self.request(
                lambda c: sp.Close(correlation_id=c, code=sp.ResponseCode.OK, reason="done")
            )
        except StreamClientError:
            pass  # closing anyway
        finally:
            self._sock.close()

    def abandon(self) -> None:
        """Close the socket at once, without a word to the server."""
        self._sock.close()
