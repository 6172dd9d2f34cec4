"""Ask a DMP server for a lease over a principal AMQP 0-9-1 connection (client role).

The other side of `gateway.protocols.dmp.principal`: protocol header,
Connection.Start-Ok with PLAIN (identity and secret), Tune-Ok (heartbeat 0,
frame-max at most the server's), Open, Channel.Open on channel 1, then
Direct.Put (a sink) or Direct.Get (a feed); the lease in Put-Ok / Get-Ok
is the result, after which the connection is closed with Connection.Close
200. A Connection.Close or Channel.Close from the server, bad frames, or
the connection ending first fail the result with `LeaseRequestError`.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure

from gateway.codecs import amqp091
from gateway.codecs.amqp091 import Method

__all__ = ["LeaseRequest", "LeaseRequestError"]


class LeaseRequestError(Exception):
    """The server did not grant the lease; the message says why."""


class LeaseRequest(Protocol):
    """One principal connection that asks for one lease.

    Args:
        identity: The PLAIN identity.
        secret: Its password.
        mode: ``put`` (a sink) or ``get`` (a feed).
        target: The sink's or feed's name.

    Attributes:
        result: Fires with the lease text, or fails with `LeaseRequestError`.
    """

    def __init__(self, identity: str, secret: bytes, mode: str, target: str) -> None:
        self._identity = identity
        self._secret = secret
        self._mode = mode
        self._target = target
        self._codec = amqp091.FrameCodec(amqp091.DEFAULT_FRAME_MAX)
        self.result: Deferred[str] = Deferred(self._cancel)
        self._started = False

    def _cancel(self, result: Deferred[str]) -> None:
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionMade(self) -> None:
        """Send the AMQP 0-9-1 protocol header."""
        assert self.transport is not None
        self.transport.write(amqp091.PROTOCOL_HEADER)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Fail the result if no lease came."""
        self._fail(f"the connection ended before a lease: {reason.getErrorMessage()}")

    def dataReceived(self, data: bytes) -> None:
        """Answer the server's methods in turn."""
        if self.result.called:
            return
        if not self._started and data.startswith(b"AMQP"):
            self._fail(f"the server does not take AMQP 0-9-1 (it answered {data[:8]!r})")
            return
        if not self._started and data[1:4].isdigit():
            # A DMP listener without principals answers with a DMP response (a short string).
            answer = data[1 : 1 + data[0]].decode("utf-8", "replace")
            self._fail(f"the server takes no principal connections: it answered {answer!r}")
            return
        try:
            events = self._codec.receive_data(data)
        except amqp091.AMQPError as exc:
            self._fail(f"bad frames from the server: {exc.reason}")
            return
        for event in events:
            if isinstance(event, Method):
                self._handle(event)
            if self.result.called:
                return

    def _handle(self, method: Method) -> None:
        arguments = method.arguments
        name = method.name
        if name == "connection.start":
            self._started = True
            if b"PLAIN" not in bytes(arguments["mechanisms"]).split():
                self._fail(f"the server offers no PLAIN ({arguments['mechanisms']!r})")
                return
            response = b"\0" + self._identity.encode("utf-8") + b"\0" + self._secret
            self._send(
                0,
                "connection.start-ok",
                client_properties={"product": "msggateway"},
                mechanism="PLAIN",
                response=response,
                locale="en_US",
            )
        elif name == "connection.tune":
            frame_max = arguments["frame_max"] or amqp091.DEFAULT_FRAME_MAX
            frame_max = min(frame_max, amqp091.DEFAULT_FRAME_MAX)
            self._codec.frame_max = frame_max
            self._send(0, "connection.tune-ok", channel_max=1, frame_max=frame_max, heartbeat=0)
            self._send(0, "connection.open", virtual_host="/", reserved_1="", reserved_2=False)
        elif name == "connection.open-ok":
            self._send(1, "channel.open", reserved_1="")
        elif name == "channel.open-ok":
            if self._mode == "put":
                self._send(1, "direct.put", sink=self._target)
            else:
                self._send(1, "direct.get", feed=self._target)
        elif name in ("direct.put-ok", "direct.get-ok"):
            self.result.callback(str(arguments["lease"]))
            self._send(
                0, "connection.close", reply_code=200, reply_text="", class_id=0, method_id=0
            )
            assert self.transport is not None
            self.transport.loseConnection()
        elif name in ("connection.close", "channel.close"):
            if name == "connection.close":
                self._send(0, "connection.close-ok")
            code, text = arguments["reply_code"], arguments["reply_text"]
            self._fail(f"the server refused with {name} {code}: {text}")
        else:
            self._fail(f"unexpected {name} from the server")

    def _fail(self, why: str) -> None:
        if self.result.called:
            return
        self.result.errback(Failure(LeaseRequestError(why)))
        if self.transport is not None:
            self.transport.loseConnection()

    def _send(self, channel: int, name: str, **arguments: object) -> None:
        assert self.transport is not None
        self.transport.write(
            amqp091.encode_method(Method(channel=channel, name=name, arguments=arguments))
        )
