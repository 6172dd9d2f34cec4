"""One RabbitMQ stream connection on a blocking socket, for the command line.

`StreamSession` speaks the client role of the stream protocol
(docs/stream-protocol-notes.md) with the gateway's own codec
(`gateway.codecs.stream`): the opening (PeerProperties, SaslHandshake,
SaslAuthenticate with PLAIN, the server's Tune and ours, Open), requests
matched to their responses by correlation id, and the frames that come
unasked (Deliver, PublishConfirm, PublishError) kept in order for the
caller. While it waits it sends a Heartbeat whenever it has been silent for
the negotiated interval, so a long ``--follow`` is not taken for a dead
peer; a Close from the server is answered and ends the command with the
server's reason.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from gateway import __version__
from gateway.cli.common import READ_BYTES, CommandError
from gateway.codecs import stream as sp
from gateway.codecs.errors import ProtocolError

__all__ = ["CLOSE_TIMEOUT_SECONDS", "StreamSession", "code_name"]

CLOSE_TIMEOUT_SECONDS: Final = 2.0
"""How long a clean Close waits for the server's CloseResponse."""


def code_name(code: int) -> str:
    """A response code in words: ``stream does not exist`` for 2."""
    try:
        return sp.ResponseCode(code).name.lower().replace("_", " ")
    except ValueError:
        return f"code {code}"


def _smaller(theirs: int, ours: int) -> int:
    """The tighter of two limits where 0 means none."""
    return min(theirs, ours) if theirs and ours else theirs or ours


class StreamSession:
    """One stream protocol connection, blocking.

    Args:
        sock: A connected socket (TLS handshake done); closed by `close`.
        timeout: Seconds to wait for any answer (None: for ever).
    """

    def __init__(self, sock: socket.socket, *, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout
        # A client allows more than it announced: the reference server does
        # not cap Deliver frames (notes, 14.34).
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._correlation = itertools.count(1)
        self._events: deque[sp.Event] = deque()
        self._heartbeat = 0.0
        self._sent_at = time.monotonic()
        self.frame_max = 0
        """The negotiated frame max (0: none), which a Publish frame must keep under."""

    def set_timeout(self, timeout: float | None) -> None:
        """Change how long to wait for the server (None: for ever)."""
        self._timeout = timeout

    # --- sending and receiving --------------------------------------------------------------

    def send(self, event: sp.Event) -> None:
        """Send one frame.

        Raises:
            CommandError: The connection is gone.
        """
        self.send_bytes(self._codec.send(event))

    def send_bytes(self, data: bytes) -> None:
        """Send frames already encoded (`gateway.codecs.stream.encode`)."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise CommandError(f"sending failed: {exc.strerror or exc}") from None
        self._sent_at = time.monotonic()

    def request(self, make: Callable[[int], sp.Event]) -> Any:
        """Send the request ``make(correlation_id)`` and return its response.

        Frames that come meanwhile without that correlation id are kept for `next`.

        Raises:
            CommandError: No response in time, or the connection ended.
        """
        correlation_id = next(self._correlation)
        request = make(correlation_id)
        self.send(request)
        waited: list[sp.Event] = []
        try:
            while True:
                event = self._receive_one(f"the answer to {type(request).__name__}")
                if getattr(event, "correlation_id", None) == correlation_id:
                    return event
                waited.append(event)
        finally:
            self._events.extendleft(reversed(waited))

    def next(self, waiting_for: str) -> sp.Event:
        """The next frame the server sent unasked (Heartbeats are not returned).

        Raises:
            CommandError: Nothing in time, the server closed the connection
                (its reason is the message), or a stream went away.
        """
        if self._events:
            return self._events.popleft()
        return self._receive_one(waiting_for)

    def _receive_one(self, waiting_for: str) -> sp.Event:
        start = time.monotonic()
        while not self._events:
            now = time.monotonic()
            wait = None if self._timeout is None else start + self._timeout - now
            if wait is not None and wait <= 0:
                raise CommandError(f"timed out waiting for {waiting_for}")
            if self._heartbeat:
                beat = max(0.0, self._sent_at + self._heartbeat - now)
                if wait is None or beat < wait:
                    wait = beat
                    if beat == 0.0:
                        self.send(sp.HEARTBEAT)
                        continue
            self._sock.settimeout(wait)
            try:
                data = self._sock.recv(READ_BYTES)
            except TimeoutError:
                continue
            except OSError as exc:
                raise CommandError(f"connection lost: {exc.strerror or exc}") from None
            if not data:
                raise CommandError(f"the server closed the connection; we waited for {waiting_for}")
            try:
                events = self._codec.receive_data(data)
            except ProtocolError as exc:
                raise CommandError(f"bad data from the server: {exc}") from None
            for event in events:
                self._take(event)
        return self._events.popleft()

    def _take(self, event: sp.Event) -> None:
        """Keep a frame for the caller, or deal with it here."""
        match event:
            case sp.Heartbeat():
                pass
            case sp.Close(correlation_id=correlation_id, code=code, reason=reason):
                self.send(sp.CloseResponse(correlation_id=correlation_id, code=1))
                raise CommandError(
                    f"the server closed the connection: {reason} ({code_name(code)})"
                )
            case sp.MetadataUpdate(stream=stream, code=code):
                raise CommandError(f"stream {stream} is no longer available ({code_name(code)})")
            case _:
                self._events.append(event)

    # --- opening and closing ----------------------------------------------------------------

    def open(self, *, username: str, password: str, virtual_host: str) -> None:
        """PeerProperties, SASL PLAIN, Tune, Open (notes, section 6).

        Raises:
            CommandError: The server refused the login or the virtual host.
        """
        properties = {
            "product": "msggateway",
            "version": __version__,
            "connection_name": "msggateway command line",
        }
        self.request(lambda c: sp.PeerProperties(correlation_id=c, properties=properties))
        offered = self.request(lambda c: sp.SaslHandshake(correlation_id=c))
        if "PLAIN" not in offered.mechanisms:
            raise CommandError(f"the server offers no PLAIN login ({list(offered.mechanisms)})")
        plain = b"\0" + username.encode() + b"\0" + password.encode()
        answer = self.request(
            lambda c: sp.SaslAuthenticate(correlation_id=c, mechanism="PLAIN", data=plain)
        )
        if answer.code != sp.ResponseCode.OK:
            raise CommandError(f"login as {username!r} refused ({code_name(answer.code)})")
        tune = self.next("the server's Tune")
        if not isinstance(tune, sp.Tune):
            raise CommandError(f"the server sent {type(tune).__name__} instead of Tune")
        self.frame_max = _smaller(tune.frame_max, sp.DEFAULT_FRAME_MAX_BYTES)
        self._heartbeat = float(tune.heartbeat)
        self.send(sp.Tune(frame_max=self.frame_max, heartbeat=tune.heartbeat))
        opened = self.request(lambda c: sp.Open(correlation_id=c, virtual_host=virtual_host))
        if opened.code != sp.ResponseCode.OK:
            raise CommandError(f"virtual host {virtual_host!r} refused ({code_name(opened.code)})")

    def close(self) -> None:
        """Close cleanly (Close, then its answer, briefly), then the socket."""
        try:
            self.set_timeout(CLOSE_TIMEOUT_SECONDS)
            self._heartbeat = 0.0
            self.request(lambda c: sp.Close(correlation_id=c, code=1, reason="done"))
        except CommandError:
            pass  # closing anyway
        finally:
            self._sock.close()
