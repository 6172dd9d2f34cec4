"""The admin endpoint's HTTP layer: bounded request bodies and the Host check.

twisted.web's channel reads a request's whole body into ``request.content``
(a temporary file past 100 kB) before any resource sees the request, and
answers whatever ``Host`` the request names. `AdminChannel` decides first,
once the headers are in and before one byte of the body is kept:

- **Host** (`HostPolicy`): a browser sends the name it was given, so a
  page whose name was rebound to this machine (DNS rebinding) names itself,
  not us. Allowed are the address the connection arrived on, ``localhost``
  when that is a loopback address (or a Unix socket), and the names of
  ``[admin] allowed_hosts``; any port, or none. Anything else is refused
  with 421 Misdirected Request. An HTTP/1.1 request without a Host (RFC
  9112 section 3.2), or with several, is 400; an HTTP/1.0 request without
  one is served, since a browser always sends one.
- **Body**: at most `MAX_BODY_BYTES` for POST (the JSON of ``/leases``),
  `MAX_BODYLESS_BYTES` for any other method (nothing the admin site serves
  reads one, but some clients send a little). A declared Content-Length
  past the limit is refused with 413 before the body is read; a chunked
  body is counted as it comes and refused once it passes the limit. What
  is kept stays in memory: no temporary file.

A refusal is a JSON answer with ``Connection: close``; the connection then
reads and drops what the client still sends, for at most
`LINGER_SECONDS` and `MAX_LINGER_BYTES`, so that closing does not reset
the connection before the client has read the answer.
"""

from __future__ import annotations

import io
import ipaddress
import json
import re
from collections.abc import Iterable
from typing import Final

import attrs
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.interfaces import IAddress, IDelayedCall, ITransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.server import Request

__all__ = [
    "MAX_BODYLESS_BYTES",
    "MAX_BODY_BYTES",
    "AdminChannel",
    "AdminRequest",
    "HostError",
    "HostPolicy",
    "body_limit_bytes",
    "host_name",
]

MAX_BODY_BYTES: Final = 16 * 1024
"""A POST body: ``/leases`` takes a JSON object of a few hundred bytes."""
MAX_BODYLESS_BYTES: Final = 4 * 1024
"""Any other method's body: nothing reads it, but some clients send a small one."""
LINGER_SECONDS: Final = 2.0
"""After a refusal, how long what the client still sends is read and dropped."""
MAX_LINGER_BYTES: Final = 1024 * 1024
"""After a refusal, how much is read and dropped before the connection is cut."""

MISDIRECTED_REQUEST: Final = 421
"""RFC 9110 section 15.5.20; twisted.web has no constant for it."""
_PHRASES: Final = {
    http.BAD_REQUEST: b"Bad Request",
    http.REQUEST_ENTITY_TOO_LARGE: b"Content Too Large",  # RFC 9110 section 15.5.14
    MISDIRECTED_REQUEST: b"Misdirected Request",
}
_METHODS_WITH_BODY: Final = frozenset({b"POST"})
_LOCALHOST: Final = "localhost"
_PORT: Final = re.compile(r"[0-9]{1,5}\Z")
_LABEL: Final = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
MAX_HOST_NAME_CHARS: Final = 253
"""A DNS name's longest text form (RFC 1035 section 2.3.4, less the root's dot)."""


def body_limit_bytes(method: bytes) -> int:
    """The largest request body the admin site takes with ``method``."""
    return MAX_BODY_BYTES if method in _METHODS_WITH_BODY else MAX_BODYLESS_BYTES


class HostError(ValueError):
    """A Host value (or an ``allowed_hosts`` entry) that names no host."""


def host_name(text: str) -> str:
    """The host a name or IP address literal names, in its canonical form.

    Names are lower-cased without a trailing dot; IPv6 literals may be
    bracketed or not and come back without brackets, compressed.

    Raises:
        HostError: Neither a DNS name nor an IP address.
    """
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if bare is not text:
        raise HostError(f"{text!r} is not an IPv6 address")
    name = text.lower().removesuffix(".")
    if not name or len(name) > MAX_HOST_NAME_CHARS:
        raise HostError(f"{text!r} is not a host name")
    if not all(_LABEL.match(label) for label in name.split(".")):
        raise HostError(f"{text!r} is not a host name (letters, digits, - and . only)")
    return name


def _split_host(value: bytes) -> str:
    """The host part of a Host header value (``name``, ``name:port``, ``[v6]:port``).

    Raises:
        HostError: Not a valid Host value.
    """
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        raise HostError("the Host header is not ASCII") from None
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[: end + 1], text[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise HostError(f"{text!r} is not a host and port")
        port = rest[1:]
    else:
        host, colon, port = text.partition(":")
        if colon and not port:
            raise HostError(f"{text!r} has an empty port")
    if port and not _PORT.match(port):
        raise HostError(f"{text!r} has a bad port")
    return host_name(host)


def _local_ip(address: IAddress) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a connection arrived on (an IPv4-mapped one as IPv4), if it has one."""
    if not isinstance(address, (IPv4Address, IPv6Address)):
        return None
    try:
        ip = ipaddress.ip_address(address.host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@attrs.frozen
class HostPolicy:
    """Which Host values the admin site answers (see the module's docstring).

    Attributes:
        allowed: Names and addresses allowed besides the address the
            connection arrived on (``[admin] allowed_hosts``), in the
            canonical form of `host_name`.
    """

    allowed: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: Iterable[str]) -> HostPolicy:
        """A policy allowing ``names`` too (each checked with `host_name`).

        Raises:
            HostError: One of them names no host.
        """
        return cls(frozenset(host_name(name) for name in names))

    def refusal(
        self, values: list[bytes] | None, version: bytes, local: IAddress
    ) -> tuple[int, str] | None:
        """Why a request's Host is refused (its status and reason), or None when it is allowed.

        Args:
            values: The request's Host header values (None: none).
            version: The request's HTTP version (``HTTP/1.1``).
            local: The address the connection arrived on.
        """
        if not values:
            if version == b"HTTP/1.1":
                return http.BAD_REQUEST, "an HTTP/1.1 request needs a Host header"
            return None
        if len(values) > 1:
            return http.BAD_REQUEST, "give one Host header"
        try:
            host = _split_host(values[0])
        except HostError as exc:
            return http.BAD_REQUEST, f"bad Host header: {exc}"
        if host in self.allowed:
            return None
        ip = _local_ip(local)
        if host == _LOCALHOST and (isinstance(local, UNIXAddress) or (ip and ip.is_loopback)):
            return None
        if ip is not None and host == str(ip):
            return None
        return (
            MISDIRECTED_REQUEST,
            f"this admin endpoint does not answer for host {host!r}: name its address,"
            " localhost on loopback, or a name in [admin] allowed_hosts",
        )


class AdminRequest(Request):
    """A request whose body is counted as it comes and kept in memory.

    The channel sets `body_limit_bytes` from the method before the body
    arrives; a chunked body passing it makes the channel refuse the
    request (413).
    """

    body_limit_bytes: int = MAX_BODYLESS_BYTES

    def __init__(self, channel: AdminChannel, *args: object, **kwargs: object) -> None:
        super().__init__(channel, *args, **kwargs)  # type: ignore[no-untyped-call]  # Twisted's
        self._admin_channel = channel
        self._received_bytes = 0

    def gotLength(self, length: int | None) -> None:
        """Keep the body in memory: the channel bounds it to a few kilobytes."""
        self.content = io.BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        """Keep a piece of the body, or have the channel refuse it once past the limit."""
        if self._admin_channel.refused:
            return
        self._received_bytes += len(data)
        if self._received_bytes > self.body_limit_bytes:
            self._admin_channel.refuse(
                http.REQUEST_ENTITY_TOO_LARGE, _too_large(self.body_limit_bytes)
            )
            return
        super().handleContentChunk(data)  # type: ignore[no-untyped-call]  # Twisted's


def _too_large(limit: int) -> str:
    return f"the request body is too large: this request takes at most {limit} bytes"


class AdminChannel(http.HTTPChannel):
    """An HTTP channel that checks Host and bounds the body before reading it.

    Attributes:
        hosts: The Host policy (the site sets it on each channel it builds).
        refused: Whether this connection's request was refused; nothing
            more is parsed or served on it.
    """

    _log = Logger()

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # Twisted's
        self.hosts = HostPolicy()
        self.refused = False
        self._lingered_bytes = 0
        self._linger: IDelayedCall | None = None

    def allHeadersReceived(self) -> None:
        """Refuse a foreign Host or a declared body past the limit; else go on as Twisted does."""
        request = self.requests[-1]
        method: bytes = self._command
        refusal = self.hosts.refusal(
            request.requestHeaders.getRawHeaders(b"Host"), self._version, self._transport.getHost()
        )
        if refusal is not None:
            self.refuse(*refusal)
            return
        limit = body_limit_bytes(method)
        if self.length is not None and self.length > limit:
            self.refuse(http.REQUEST_ENTITY_TOO_LARGE, _too_large(limit))
            return
        if isinstance(request, AdminRequest):
            request.body_limit_bytes = limit
        super().allHeadersReceived()  # type: ignore[no-untyped-call]  # Twisted's

    def dataReceived(self, data: bytes) -> None:
        """Parse as Twisted does, or drop what comes after a refusal (within bounds)."""
        if not self.refused:
            super().dataReceived(data)  # type: ignore[no-untyped-call]  # Twisted's
            return
        self._lingered_bytes += len(data)
        if self._lingered_bytes > MAX_LINGER_BYTES:
            abort = getattr(self._transport, "abortConnection", self._transport.loseConnection)
            abort()

    def rawDataReceived(self, data: bytes) -> None:
        """Read the body as Twisted does, unless the request was refused."""
        if not self.refused:
            super().rawDataReceived(data)

    def allContentReceived(self) -> None:
        """Hand the request on as Twisted does, unless it was refused."""
        if not self.refused:
            super().allContentReceived()  # type: ignore[no-untyped-call]  # Twisted's

    def refuse(self, status: int, reason: str) -> None:
        """Answer ``status`` with a JSON reason, and end the connection.

        The answer is written at once, the write side closed, and what the
        client still sends read and dropped until it closes, for at most
        `LINGER_SECONDS` and `MAX_LINGER_BYTES`.
        """
        if self.refused:
            return
        self.refused = True
        self.persistent = False
        self.clearLineBuffer()  # type: ignore[no-untyped-call]  # Twisted's
        transport = self._transport
        method = getattr(self, "_command", b"")
        path = getattr(self, "_path", b"")
        self._log.warn(
            "admin: refused {method} {path} from {peer}: {status} {reason}",
            method=method.decode("latin-1"),
            path=path.decode("latin-1"),
            peer=str(transport.getPeer()),
            status=status,
            reason=reason,
        )
        body = json.dumps({"error": reason}, ensure_ascii=False, indent=2).encode() + b"\n"
        head = b"\r\n".join(
            (
                b"HTTP/1.1 %d %s" % (status, _PHRASES.get(status, b"Refused")),
                b"Content-Type: application/json",
                b"Content-Length: %d" % (len(body),),
                b"Cache-Control: no-store",
                b"X-Content-Type-Options: nosniff",
                b"Connection: close",
                b"",
                b"",
            )
        )
        transport.write(head if method == b"HEAD" else head + body)
        self.setTimeout(None)  # type: ignore[no-untyped-call]  # Twisted's
        half_close = getattr(transport, "loseWriteConnection", None)
        if half_close is None:
            self.loseConnection()  # type: ignore[no-untyped-call]  # Twisted's
            return
        half_close()
        self._linger = self.callLater(  # type: ignore[no-untyped-call]  # Twisted's
            LINGER_SECONDS, self._linger_over
        )

    @property
    def _transport(self) -> ITransport:
        transport = self.transport
        assert transport is not None, "used only while connected"
        return transport

    def _linger_over(self) -> None:
        self._linger = None
        self._transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Stop lingering, then clean up as Twisted does."""
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        self._linger = None
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # Twisted's
