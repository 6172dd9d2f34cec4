"""A small blocking SSMP client for the command line (``msggateway ssmp``).

Operators use it to publish a test message or watch a topic by hand, against
the gateway or any SSMP server, over TCP or TLS. It uses the same codec as
the gateway; it is not used by the gateway itself. `parse_address`,
`tls_context` and `connect` are shared with the other hand tools
(``msggateway qmqp send``, `gateway.cli.qmqp`).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Final

from gateway.codecs import ssmp

__all__ = ["SSMPProbe", "SSMPProbeError", "connect", "parse_address", "tls_context"]

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


def tls_context(
    *, tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext | None:
    """Build the client TLS context the command-line options ask for.

    Args:
        tls: Connect over TLS, verifying the server with the system's CAs.
        ca: CA file to verify the server with (implies TLS).
        cert: Client certificate, PEM (implies TLS).
        key: The client certificate's key, PEM (default: read from ``cert``).

    Returns:
        A context, or None for plain TCP.

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: A file holds no usable certificate or key.
    """
    if not (tls or ca or cert):
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def connect(
    address: tuple[str, int], context: ssl.SSLContext | None, timeout: float | None
) -> socket.socket:
    """Open a blocking TCP connection, over TLS when ``context`` is given.

    The TLS handshake is done here, bounded by ``timeout``; the server's
    certificate is checked against the host name of ``address``.

    Args:
        address: ``(host, port)``.
        context: TLS context, or None for plain TCP.
        timeout: Seconds connecting (and each later read) may wait; None: forever.

    Raises:
        OSError: The connection or the handshake failed (`ssl.SSLError` is one).
    """
    raw = socket.create_connection(address, timeout=timeout)
    if context is None:
        return raw
    try:
        return context.wrap_socket(raw, server_hostname=address[0])
    except BaseException:
        raw.close()
        raise


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
        self._sock = connect(address, context, timeout)
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
