"""The QMQP streaming server role: message blocks in, honest replies out.

Blocks are read as they stream in, without waiting for replies. Each message
is routed by its recipients (all or nothing); its one reply says what the
routes did (DESIGN.md, "Outcomes travel back"):

* ``K`` only when every route accepted it (direct: the destination accepted;
  durable: committed to the log, when that exists);
* ``Z`` for a temporary failure (destination down, queue full, time-out);
* ``D`` for a permanent one (no route for a recipient, rejected, too large,
  not authenticated, a recipient domain the identity may not send to).

Identity: an ``A`` block with the right secret, or, on an ``mtls:``
listener, the verified client certificate (its Common Name, or its one
name), which stands in for the ``A`` block; an ``A`` block on such a
connection replaces the certificate's identity. A listener's ``authorize``
table then says which recipient domains (the part after the last ``@``,
lower case) each identity may send to: publishing is all a QMQP client does.

Replies go out in completion order with the count of messages still pending.
On the done block the server answers everything outstanding, sends its own
done block and closes. Flow control: past ``max_in_flight`` messages (or
``max_in_flight_bytes``) awaiting outcomes, or when the client does not read
its replies, the server stops reading until replies complete.
"""

from __future__ import annotations

from typing import Any, Final, cast

from twisted.internet.interfaces import (
    IConsumer,
    IDelayedCall,
    IPushProducer,
    IReactorTime,
    ISSLTransport,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import qmqp
from gateway.core.auth import Secrets
from gateway.core.authorization import Action
from gateway.core.inbox import Inbox, Result
from gateway.core.message import Outcome
from gateway.core.router import Router, Unrouted
from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import ListenerFactory
from gateway.protocols.qmqp.mapping import message_from_block, result_for, text
from gateway.protocols.qmqp.settings import QMQPListenerSettings
from gateway.protocols.tcp import disable_nagle
from gateway.tls import external_identity

__all__ = ["QMQPServerFactory", "QMQPServerProtocol"]

_DONE: Final = qmqp.encode(qmqp.DoneBlock())
RESUME_FRACTION: Final = 0.75
"""Reading resumes once in-flight work falls to this share of its limits."""


@implementer(IPushProducer)
class QMQPServerProtocol(Protocol):
    """One QMQP streaming client connected to a listener."""

    _log = Logger()

    def __init__(self, factory: QMQPServerFactory) -> None:
        self.factory = factory
        self._codec = qmqp.QMQPCodec(
            qmqp.Role.SERVER, max_message_bytes=factory.settings.max_message_bytes
        )
        self.identity: str | None = None
        self._certificate_read = False
        self._outstanding = 0
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._out: list[bytes] = []
        self._in_batch = False
        self._flush_call: IDelayedCall | None = None
        self._done = False
        self._finishing = False
        self._closing = False
        self._reading_paused = False
        self._congested = False
        self._last_block = factory.clock.seconds()
        self._idle_call: IDelayedCall | None = None
        self._inbox: Inbox[tuple[bytes, int]] = Inbox(factory.router, factory.name, self._answer)

    # --- connection life -------------------------------------------------------

    def connectionMade(self) -> None:
        """Register as the transport's producer (slow readers stop our reading)."""
        disable_nagle(self.transport)
        cast(IConsumer, self.transport).registerProducer(self, True)
        self.factory.connection_opened(self)
        self._watch_idle()

    def _watch_idle(self) -> None:
        timeout = self.factory.settings.idle_timeout_seconds
        self._idle_call = self.factory.clock.callLater(timeout / 2, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_call = None
        if self._closing:
            return
        quiet = self.factory.clock.seconds() - self._last_block
        if self._outstanding == 0 and quiet >= self.factory.settings.idle_timeout_seconds:
            self.factory.count_error("idle-timeout")
            self._log.info(
                "{listener}: closing a connection that completed no block in {seconds:g} s",
                listener=self.factory.name,
                seconds=quiet,
            )
            self._close()
            return
        self._watch_idle()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Forget the connection; outcomes still on their way are dropped."""
        self._closing = True
        for call in (self._flush_call, self._idle_call):
            if call is not None and call.active():
                call.cancel()
        self._flush_call = self._idle_call = None
        self._out.clear()
        if self._outstanding and not self._done:
            self._log.info(
                "{listener}: client went away with {count} message(s) unanswered",
                listener=self.factory.name,
                count=self._outstanding,
            )
        self.factory.connection_closed(self)

    def _close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._flush()
        assert self.transport is not None
        cast(IConsumer, self.transport).unregisterProducer()  # TLS shuts down only without one
        self.transport.loseConnection()

    def _finish(self) -> None:
        """Read nothing more; close once every outstanding message is answered."""
        self._finishing = True
        self._pause_reading()
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        if self._finishing and self._outstanding == 0 and not self._closing:
            if self._done:
                self._out.append(_DONE)  # Spec: the server sends its done block, then closes.
            self._close()

    # --- output ---------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        if not self._in_batch and self._flush_call is None:
            self._flush_call = self.factory.clock.callLater(0, self._flush)

    def _flush(self) -> None:
        self._flush_call = None
        if not self._out or self.transport is None:
            return
        data = b"".join(self._out)
        self.factory.traffic.messages_out += len(self._out)
        self.factory.traffic.bytes_out += len(data)
        self._out.clear()
        self.transport.write(data)

    def _reply(self, block_id: bytes, status: bytes, description: bytes) -> None:
        self._outstanding -= 1
        reply = qmqp.ReplyBlock(
            id=block_id, status=status, description=description, pending=self._outstanding
        )
        self._send(qmqp.encode(reply))
        self.factory.count_reply(status)
        self._maybe_finished()

    # --- IPushProducer: the client does not read its replies -------------------------

    def pauseProducing(self) -> None:
        """Replies pile up: stop reading new blocks."""
        self._congested = True
        self._pause_reading()

    def resumeProducing(self) -> None:
        """The client reads again."""
        self._congested = False
        self._maybe_resume()

    def stopProducing(self) -> None:
        """The transport is going away; connectionLost cleans up."""

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def _maybe_resume(self) -> None:
        settings = self.factory.settings
        if (
            self._reading_paused
            and not self._congested
            and not self._finishing
            and not self._closing
            and self._in_flight <= settings.max_in_flight * RESUME_FRACTION
            and self._in_flight_bytes <= settings.max_in_flight_bytes * RESUME_FRACTION
            and self.transport is not None
        ):
            self._reading_paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _over_limits(self) -> bool:
        settings: QMQPListenerSettings = self.factory.settings
        return (
            self._in_flight >= settings.max_in_flight
            or self._in_flight_bytes >= settings.max_in_flight_bytes
        )

    # --- input ------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Handle every complete block, then write the replies that are ready."""
        if self._finishing or self._closing:
            return
        error: qmqp.QMQPError | None = None
        try:
            blocks = self._codec.receive_data(data)
        except qmqp.QMQPError as exc:
            error = exc
            blocks = cast(list[qmqp.Block], exc.events)
        if blocks:
            self._last_block = self.factory.clock.seconds()
        traffic = self.factory.traffic
        traffic.messages_in += len(blocks)
        traffic.bytes_in += len(data)
        # Count every block that will be answered first, so that each reply's
        # pending count includes the messages that arrived with it.
        for block in blocks:
            if isinstance(block, qmqp.MessageBlock | qmqp.InvalidBlock):
                self._outstanding += 1
        self._in_batch = True
        try:
            for block in blocks:
                self._handle(block)
            self._inbox.dispatch()  # the read's messages, one batch
        finally:
            self._in_batch = False
        if error is not None and not self._closing:
            self._protocol_error(error)
        if self._over_limits():
            self._pause_reading()
        self._flush()

    def _handle(self, block: qmqp.Block) -> None:
        if isinstance(block, qmqp.MessageBlock):
            self._on_message(block)
        elif isinstance(block, qmqp.InvalidBlock):
            self.factory.count_error(block.kind)
            # The codec's refusal escapes "#" in quoted peer bytes (spec, "Result
            # String"); _reply sets the pending count.
            self._reply(block.id, qmqp.D, block.refusal(pending=0).description)
        elif isinstance(block, qmqp.AuthBlock):
            self._on_auth(block)
        elif isinstance(block, qmqp.DoneBlock):
            self._done = True
            self._finish()

    def _protocol_error(self, error: qmqp.QMQPError) -> None:
        self.factory.count_error(error.kind)
        self._log.warn(
            "{listener}: bad input, closing once {count} outstanding message(s) are answered:"
            " {reason}",
            listener=self.factory.name,
            count=self._outstanding,
            reason=error.reason,
        )
        self._finish()

    def _on_auth(self, block: qmqp.AuthBlock) -> None:
        username = text(block.username)
        success = self.factory.secrets.verify(username, block.password)
        if success and not self.factory.admit(self, username):
            success = False
            self._log.info(
                "{listener}: {why}",
                listener=self.factory.name,
                why=self.factory.per_identity_refusal(username),
            )
        elif success:
            self.identity = username
        else:
            self.factory.count_error("unauthorized")
            self._log.info(
                "{listener}: authentication of {username} refused",
                listener=self.factory.name,
                username=username,
            )
        # Spec ambiguity: "1" is success, as the prose says (see gateway.codecs.qmqp).
        self._send(qmqp.encode(qmqp.AuthReplyBlock(success=success)))

    def _read_certificate(self) -> None:
        """Take the identity from a verified client certificate, once, if there is one.

        Called when the first message block arrives: data has come through
        TLS, so the handshake (and the certificate's verification) is over.
        """
        self._certificate_read = True
        if self.identity is None:
            identity = external_identity(self.transport)
            if identity is not None and not self.factory.admit(self, identity):
                # Over the limit: as if it had no certificate (require_auth then refuses).
                self._log.info(
                    "{listener}: {why}",
                    listener=self.factory.name,
                    why=self.factory.per_identity_refusal(identity),
                )
                identity = None
            self.identity = identity

    def _forbidden_domain(self, block: qmqp.MessageBlock) -> str | None:
        """The first recipient domain the identity may not send to, if any."""
        factory = self.factory
        for recipient in block.recipients:
            domain = text(recipient).rpartition("@")[2].lower()
            if not factory.authorized(Action.PUBLISH, self.identity, domain, self._peer()):
                return domain
        return None

    def _peer(self) -> object:
        return self.transport.getPeer() if self.transport is not None else None

    def _on_message(self, block: qmqp.MessageBlock) -> None:
        factory = self.factory
        if not self._certificate_read:
            self._read_certificate()
        if factory.settings.require_auth and self.identity is None:
            self.factory.count_error("unauthenticated")
            hint = (
                b" or present a client certificate" if ISSLTransport(self.transport, None) else b""
            )
            self._reply(block.id, qmqp.D, b"authentication required: send an A block first" + hint)
            return
        if factory.authorization.restricted:
            domain = self._forbidden_domain(block)
            if domain is not None:
                # One reply per message (spec): a refused recipient refuses them all.
                who = self.identity or "a client without an identity"
                status, description = result_for(
                    Outcome.rejected(f"{who} may not send to recipient domain {domain}")
                )
                self._reply(block.id, status, description)
                return
        size = len(block.message)
        self._in_flight += 1
        self._in_flight_bytes += size
        self._inbox.add(message_from_block(block, factory.clock.seconds()), (block.id, size))

    def _answer(self, token: tuple[bytes, int], result: Result) -> None:
        """Reply to one message of a dispatched batch with what its routes did."""
        block_id, size = token
        self._in_flight -= 1
        self._in_flight_bytes -= size
        if self._closing:
            return
        if isinstance(result, Unrouted):
            # Through result_for: recipients are peer bytes and may hold "#".
            result = Outcome.rejected("no route for recipient " + ", ".join(result.addresses))
        status, description = result_for(result)
        self._reply(block_id, status, description)
        self._maybe_resume()


class QMQPServerFactory(ListenerFactory[QMQPServerProtocol]):
    """Builds connections for one QMQP streaming listener.

    Args:
        name: The listener's name (the source of its routes).
        settings: Its validated settings.
        router: Where messages go.
        secrets: For ``A`` blocks.
        clock: Timers and timestamps.
        metrics: Counters, or None.
    """

    protocol = QMQPServerProtocol
    kind = "qmqp"

    def __init__(
        self,
        *,
        name: str,
        settings: QMQPListenerSettings,
        router: Router,
        secrets: Secrets,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        super().__init__(name, metrics)
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self.clock = clock
        self._replies: dict[bytes, Any] = {}  # reply counters by status, looked up once

    def count_reply(self, status: bytes) -> None:
        """Count a reply by its status (K, Z or D)."""
        if self._metrics is not None:
            counter = self._replies.get(status)
            if counter is None:
                label = status.decode("ascii")
                counter = self._replies[status] = self._metrics.qmqp_replies.labels(
                    self.name, label
                )
            counter.inc()
