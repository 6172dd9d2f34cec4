"""Ask a DMP server for a lease over a principal AMQP 0-9-1 connection (client role).

The other side of `gateway.protocols.dmp.principal`, on pika's Twisted adapter
(`TwistedProtocolConnection`), the project's one AMQP 0-9-1 client (the
fleet's backbone uses it too, `gateway.fleet.backbone`): protocol header,
Connection.Start-Ok with PLAIN (identity and secret), Tune-Ok (heartbeat 0,
frame-max at most the server's), Open, Channel.Open, then Direct.Put (a sink)
or Direct.Get (a feed); the lease in Put-Ok / Get-Ok is the result, after
which the connection is closed with Connection.Close 200. A Connection.Close
or Channel.Close from the server, an answer that is no AMQP 0-9-1, or the
connection ending first fail the result with `LeaseRequestError`.

DMP's Direct class (class 61500, ../shared/specs/dmp.txt) is no part of
pika's AMQP 0-9-1 spec: its four methods are declared here as pika method
classes and registered in ``pika.spec.methods`` (pika decodes a method frame
by looking its class and method ids up there), and Direct.Put and Direct.Get
are sent with the channel's synchronous-call machinery (``Channel._rpc``),
the one way pika has to send a method of a class it does not know.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Final

import pika
import pika.amqp_object
import pika.channel
import pika.connection
import pika.exceptions
import pika.spec
from pika.adapters.twisted_connection import TwistedProtocolConnection
from twisted.internet.defer import Deferred
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure

__all__ = [
    "DirectGet",
    "DirectGetOk",
    "DirectPut",
    "DirectPutOk",
    "LeaseRequest",
    "LeaseRequestError",
]

DIRECT_CLASS: Final = 61500
"""The Direct class of ../shared/specs/dmp.txt."""


class LeaseRequestError(Exception):
    """The server did not grant the lease; the message says why."""


class _ShortStringMethod(pika.amqp_object.Method):  # type: ignore[misc]
    """A Direct method with one short string field (the spec's XML: sink, feed, lease)."""

    INDEX: ClassVar[int]
    NAME: ClassVar[str]
    FIELD: ClassVar[str]
    SYNCHRONOUS: ClassVar[bool]

    def __init__(self, value: str = "") -> None:
        setattr(self, self.FIELD, value)

    @property
    def synchronous(self) -> bool:
        """Put and Get expect an answer; their answers do not."""
        return self.SYNCHRONOUS

    def decode(self, encoded: bytes, offset: int = 0) -> _ShortStringMethod:
        """Read the short string (pika's decoder calls this)."""
        length = struct.unpack_from("B", encoded, offset)[0]
        value = encoded[offset + 1 : offset + 1 + length].decode("utf-8")
        setattr(self, self.FIELD, value)
        return self

    def encode(self) -> list[bytes]:
        """Write the short string (pika's encoder calls this)."""
        raw = str(getattr(self, self.FIELD)).encode("utf-8")
        return [struct.pack("B", len(raw)), raw]


class DirectPut(_ShortStringMethod):
    """Direct.Put: a lease to write to a sink, please."""

    INDEX = (DIRECT_CLASS << 16) | 10
    NAME = "Direct.Put"
    FIELD = "sink"
    SYNCHRONOUS = True


class DirectPutOk(_ShortStringMethod):
    """Direct.Put-Ok: the lease."""

    INDEX = (DIRECT_CLASS << 16) | 11
    NAME = "Direct.PutOk"
    FIELD = "lease"
    SYNCHRONOUS = False


class DirectGet(_ShortStringMethod):
    """Direct.Get: a lease to read from a feed, please."""

    INDEX = (DIRECT_CLASS << 16) | 20
    NAME = "Direct.Get"
    FIELD = "feed"
    SYNCHRONOUS = True


class DirectGetOk(_ShortStringMethod):
    """Direct.Get-Ok: the lease."""

    INDEX = (DIRECT_CLASS << 16) | 21
    NAME = "Direct.GetOk"
    FIELD = "lease"
    SYNCHRONOUS = False


for _method in (DirectPut, DirectPutOk, DirectGet, DirectGetOk):
    pika.spec.methods.setdefault(_method.INDEX, _method)


class LeaseRequest(TwistedProtocolConnection):  # type: ignore[misc]
    """One principal connection that asks for one lease.

    Args:
        identity: The PLAIN identity.
        secret: Its password.
        mode: ``put`` (a sink) or ``get`` (a feed).
        target: The sink's or feed's name.
        clock: The reactor for pika's timers (the global one if None).

    Attributes:
        result: Fires with the lease text, or fails with `LeaseRequestError`.
    """

    def __init__(
        self, identity: str, secret: bytes, mode: str, target: str, clock: Any = None
    ) -> None:
        parameters = pika.ConnectionParameters(
            virtual_host="/",
            credentials=pika.PlainCredentials(identity, secret.decode("utf-8", "replace")),
            heartbeat=0,
            stack_timeout=None,
            client_properties={"product": "msggateway"},
        )
        super().__init__(parameters, custom_reactor=clock)
        self._mode = mode
        self._target = target
        self._heard = False
        self.result: Deferred[str] = Deferred(self._cancel)
        self._impl.add_on_open_error_callback(self._not_opened, remove_default=False)
        # pika reports a close during the handshake as the socket's end (ConnectionDone),
        # losing the server's code and text: they are kept from its Connection.Close here.
        self._refusal: str | None = None
        self._impl.callbacks.add(0, pika.spec.Connection.Close, self._closed_by_server, False)
        assert self.ready is not None
        self.ready.addCallbacks(self._opened, lambda _: None)

    def _cancel(self, result: Deferred[str]) -> None:
        if self.transport is not None:
            self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        """Hand the server's frames to pika, unless its first answer is no AMQP 0-9-1."""
        if self.result.called:
            return
        if not self._heard:
            self._heard = True
            if data.startswith(b"AMQP"):
                self._fail(f"the server does not take AMQP 0-9-1 (it answered {data[:8]!r})")
                return
            if data[1:4].isdigit():
                # A DMP listener without principals answers with a DMP response.
                answer = data[1 : 1 + data[0]].decode("utf-8", "replace")
                self._fail(f"the server takes no principal connections: it answered {answer!r}")
                return
        super().dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Fail the result if no lease came."""
        super().connectionLost(reason)
        self._fail(f"the connection ended before a lease: {reason.getErrorMessage()}")

    def _closed_by_server(self, frame: Any) -> None:
        method = frame.method
        self._refusal = (
            f"the server refused with connection.close {method.reply_code}: {method.reply_text}"
        )

    def _not_opened(self, connection: pika.connection.Connection, error: object) -> None:
        self._fail(self._refusal or _why(error))

    def _opened(self, _: object) -> None:
        self._impl.channel(on_open_callback=self._ask)

    def _ask(self, channel: pika.channel.Channel) -> None:
        channel.add_on_close_callback(self._channel_closed)
        if self._mode == "put":
            channel._rpc(DirectPut(self._target), self._granted, [DirectPutOk])
        else:
            channel._rpc(DirectGet(self._target), self._granted, [DirectGetOk])

    def _granted(self, frame: Any) -> None:
        if not self.result.called:
            self.result.callback(str(frame.method.lease))
        if self._impl.is_open:
            self.close(200, "")

    def _channel_closed(self, channel: pika.channel.Channel, error: Exception) -> None:
        self._fail(_why(error))

    def _fail(self, why: str) -> None:
        if self.result.called:
            return
        self.result.errback(Failure(LeaseRequestError(why)))
        if self.transport is not None:
            self.transport.loseConnection()


def _why(error: object) -> str:
    """What the server's refusal said, as ``connection.close 403: text`` where it said so."""
    if isinstance(error, pika.exceptions.ChannelClosed):
        return f"the server refused with channel.close {error.reply_code}: {error.reply_text}"
    if isinstance(error, pika.exceptions.ConnectionClosed):
        return f"the server refused with connection.close {error.reply_code}: {error.reply_text}"
    if isinstance(
        error,
        pika.exceptions.ProbableAuthenticationError | pika.exceptions.ProbableAccessDeniedError,
    ):
        return f"the server refused with connection.close 403: {error!r}"
    return str(error) or type(error).__name__
