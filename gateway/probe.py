"""A small blocking SSMP client for the command line (``msggateway ssmp``).

Operators use it to publish a test message or watch a topic by hand, against
the gateway or any SSMP server, over TCP or TLS. It uses the same codec as
the gateway; it is not used by the gateway itself.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Final

from gateway.codecs import ssmp

__all__ = ["SSMPProbe", "SSMPProbeError", "parse_address"]

READ_BYTES: Final = 65536


class SSMPProbeError(Exception):
    """The server refused, closed, or sent something unexpected."""


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` too).

    Raises:
        ValueError: Not of that form.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


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
        timeout: float | None = 10.0,
    ) -> None:
        raw = socket.create_connection(address, timeout=timeout)
        self._sock = context.wrap_socket(raw, server_hostname=address[0]) if context else raw
        self._sock.settimeout(timeout)
        self._codec = ssmp.SSMPCodec(ssmp.Role.CLIENT)
        self._lines: list[ssmp.Line] = []

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def _next_line(self) -> ssmp.Line:
        while not self._lines:
            data = self._sock.recv(READ_BYTES)
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
        """Send a request and return its response; events meanwhile go to ``on_event``."""
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
