"""Where a protocol command connects, and how: addresses, TLS, blocking sockets.

``-a/--address HOST:PORT`` is parsed by `parse_address` (the flag itself is
`gateway.cli.arguments.add_address_argument`), by default the embedded
default configuration's listener for the protocol (`DEFAULT_ADDRESSES`);
``--tls``, ``--cafile``, ``--cert`` and ``--key`` become a client TLS
context (`tls_from`); `open_connection` connects with both, and `receive`
reads and decodes what the server answers with the protocol's codec.
"""

from __future__ import annotations

import argparse
import socket
import ssl
from collections.abc import Callable
from typing import Final, NamedTuple, TypeVar

from gateway.cli.errors import CommandError
from gateway.codecs.errors import ProtocolError

__all__ = [
    "DEFAULT_ADDRESSES",
    "READ_BYTES",
    "Address",
    "connect",
    "open_connection",
    "parse_address",
    "receive",
    "tls_context",
    "tls_from",
]

DEFAULT_ADDRESSES: Final = {
    "ssmp": "127.0.0.1:8787",
    "qmqp": "127.0.0.1:8628",
    "stream": "127.0.0.1:5552",
    "dmp": "127.0.0.1:5554",
    "mtl": "127.0.0.1:5555",
}
"""Where the embedded default configuration (gateway/default.toml) listens, per protocol."""

READ_BYTES: Final = 65536
"""Bytes asked of one ``recv``."""

_E = TypeVar("_E")


class Address(NamedTuple):
    """A server's ``(host, port)``; its text is ``HOST:PORT``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` too).

    Raises:
        ValueError: Not of that form.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return Address(host.strip("[]"), int(port))


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


def tls_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context of `add_tls_arguments`'s flags, or None for plain TCP.

    Raises:
        CommandError: A file cannot be read or holds no usable certificate or key.
    """
    try:
        return tls_context(tls=args.tls, ca=args.cafile, cert=args.cert, key=args.key)
    except OSError as exc:  # ssl.SSLError is one
        raise CommandError(f"TLS: {exc}") from None


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


def open_connection(
    address: Address, args: argparse.Namespace, timeout: float | None
) -> socket.socket:
    """`connect` to ``address`` over TLS as `add_tls_arguments`' flags say.

    Raises:
        CommandError: A TLS file is unusable, or the connection or handshake failed.
    """
    context = tls_from(args)
    try:
        return connect(address, context, timeout)
    except OSError as exc:
        raise CommandError(f"cannot connect to {address}: {exc}") from None


def receive(sock: socket.socket, decode: Callable[[bytes], list[_E]], waiting_for: str) -> list[_E]:
    """Read once from ``sock`` and decode what came with a codec's ``receive_data``.

    Args:
        sock: A blocking socket with its time-out set.
        decode: The codec's ``receive_data``.
        waiting_for: What is awaited, for the time-out's message.

    Returns:
        The events completed (possibly none: call again).

    Raises:
        CommandError: Timed out, the server closed the connection, or it
            sent something its protocol does not allow.
    """
    try:
        data = sock.recv(READ_BYTES)
    except TimeoutError:
        raise CommandError(f"timed out waiting for {waiting_for}") from None
    except OSError as exc:
        raise CommandError(f"connection lost: {exc.strerror or exc}") from None
    if not data:
        raise CommandError(f"the server closed the connection while we waited for {waiting_for}")
    try:
        return decode(data)
    except ProtocolError as exc:
        raise CommandError(f"bad data from the server: {exc}") from None
