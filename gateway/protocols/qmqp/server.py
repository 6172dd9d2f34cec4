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

from typing import Final, Unpack, cast

from twisted.internet.interfaces import IDelayedCall, ISSLTransport
from twisted.python.failure import Failure

from gateway.codecs import qmqp
from gateway.core.authorization import Action
from gateway.core.inbox import Inbox, Result
from gateway.core.message import Outcome
from gateway.core.router import Router, Unrouted
from gateway.protocols.listener import ListenerArgs, ListenerConnection, ListenerFactory
from gateway.protocols.logins import UNCHECKED
from gateway.protocols.qmqp.mapping import message_from_block, result_for, text
from gateway.protocols.qmqp.settings import QMQPListenerSettings
from gateway.tls import external_identity

__all__ = ["QMQPServerFactory", "QMQPServerProtocol"]

_DONE: Final = qmqp.encode(qmqp.DoneBlock())
RESUME_FRACTION: Final = 0.75
"""Reading resumes once in-flight work falls to this share of its limits."""


class QMQPServerProtocol(ListenerConnection["QMQPServerFactory"]):
    """One QMQP streaming client connected to a listener."""

    def __init__(self, factory: QMQPServerFactory) -> None:
        super().__init__(factory)
        self._codec = qmqp.QMQPCodec(
            qmqp.Role.SERVER, max_message_bytes=factory.settings.max_message_bytes
        )
        self.identity: str | None = None
        self._certificate_read = False
        self._outstanding = 0
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._in_batch = False
        self._flush_call: IDelayedCall | None = None
        self._done = False
        self._idle_since = factory.clock.seconds()
        """When the connection last stopped being busy: its last complete block, or the
        reply to its last outstanding message, whichever came later."""
        self._read_at = self._idle_since
        """When the last read that completed a block arrived: its messages' timestamp (one
        clock call per read, and the messages of a read share their entries' middle)."""
        self._idle_call: IDelayedCall | None = None
        self._inbox: Inbox[tuple[bytes, int]] = Inbox(
            factory.router, factory.name, self._answer, self._answer_batch
        )
        self._login_wait: IDelayedCall | None = None
        """Set while an ``A`` block waits (`LoginRefusals`): to be checked, or refused."""
        self._waiting_auth: qmqp.AuthBlock | None = None
        """The ``A`` block that waits to be checked (None: a refusal waits to be answered)."""
        self._held: tuple[list[qmqp.Block], qmqp.QMQPError | None] = ([], None)
        """The blocks read after the waiting ``A`` block, and that read's error."""
        self._refused_logins = 0
        self._waited = False
        """The ``A`` block being checked waited once: if a wait is still owed, it is refused."""

    # --- connection life -------------------------------------------------------

    def _connection_started(self) -> None:
        self._watch_idle(self.factory.settings.idle_timeout_seconds)

    def _watch_idle(self, seconds: float) -> None:
        self._idle_call = self._call_later(seconds, self._check_idle)

    def _check_idle(self) -> None:
        """Close the connection once it has been idle for ``idle_timeout_seconds``.

        The timer is armed for the deadline as it stood (idle since plus the
        time-out). Blocks and replies only move ``_idle_since``, once per read
        or per reply that leaves nothing outstanding, so the timer may fire
        early: it is then armed again for exactly the time left. While
        messages await outcomes it stops; the reply to the last one restarts it.
        """
        self._idle_call = None
        if self._closing or self._outstanding:
            return
        timeout = self.factory.settings.idle_timeout_seconds
        quiet = self.factory.clock.seconds() - self._idle_since
        if quiet < timeout:
            self._watch_idle(timeout - quiet)
            return
        self.factory.count_error("idle-timeout")
        self._log.info(
            "{listener}: closing the connection of {peer}: it completed no block in {seconds:g} s",
            listener=self.factory.name,
            peer=self._who(),
            identity=self.identity,
            seconds=quiet,
        )
        self._close()

    def _connection_ended(self, reason: Failure) -> None:
        """Outcomes still on their way are dropped."""
        if self._outstanding and not self._done:
            self._log.info(
                "{listener}: {peer} went away with {count} message(s) unanswered",
                listener=self.factory.name,
                peer=self._who(),
                identity=self.identity,
                count=self._outstanding,
            )

    def _partial_frame_bytes(self) -> int:
        return self._codec.pending_bytes

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
        """Queue a block; outside a read, replies that come in one reactor turn share a write."""
        self._out.append(data)
        self._out_count += 1
        if not self._in_batch and self._flush_call is None:
            self._flush_call = self._call_later(0, self._flush_due)

    def _flush_due(self) -> None:
        self._flush_call = None
        self.flush()

    def _reply(self, block_id: bytes, status: bytes, description: bytes) -> None:
        self._outstanding -= 1
        self._send(qmqp.encode_reply(block_id, status, description, self._outstanding))
        self.factory.count_reply(status, 1)
        self._replied()

    def _replied(self) -> None:
        """After replies: owing nothing any more, the connection is idle from now; it may close."""
        if not self._outstanding:
            # A read has noted its own time.
            if not self._in_batch:
                self._idle_since = self.factory.clock.seconds()
            if self._idle_call is None and not self._closing:
                self._watch_idle(self.factory.settings.idle_timeout_seconds)
        self._maybe_finished()

    # --- flow control: in-flight messages hold reading too ----------------------------

    def _may_read(self) -> bool:
        settings = self.factory.settings
        return (
            self._in_flight <= settings.max_in_flight * RESUME_FRACTION
            and self._in_flight_bytes <= settings.max_in_flight_bytes * RESUME_FRACTION
            and self._login_wait is None
        )

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
            # Once per read, not per block.
            self._idle_since = self._read_at = self.factory.clock.seconds()
        traffic = self.factory.traffic
        traffic.messages_in += len(blocks)
        traffic.bytes_in += len(data)
        # Count every block that will be answered first, so that each reply's
        # pending count includes the messages that arrived with it.
        for block in blocks:
            if isinstance(block, qmqp.MessageBlock | qmqp.InvalidBlock):
                self._outstanding += 1
        self._handle_blocks(blocks, error)
        if self._over_limits():
            self._pause_reading()
        held = self._codec.pending_bytes
        if held or self._partial_since is not None:
            self._frame_read(bool(blocks), held)
        self.flush()

    def _handle_blocks(self, blocks: list[qmqp.Block], error: qmqp.QMQPError | None) -> None:
        """Handle blocks in order, then the read's error; a waiting ``A`` block holds the rest."""
        self._in_batch = True
        try:
            for index, block in enumerate(blocks):
                self._handle(block)
                if self._login_wait is not None:
                    self._held = (blocks[index + 1 :], error)
                    error = None
                    break
            self._inbox.dispatch()  # the read's messages, one batch
        finally:
            self._in_batch = False
        if error is not None and not self._closing:
            self._protocol_error(error)

    def _login_waited(self) -> None:
        """The wait is over: check the ``A`` block now, then handle what was read after it."""
        self._login_wait = None
        block, self._waiting_auth = self._waiting_auth, None
        assert block is not None
        self._go_on([block])

    def _go_on(self, first: list[qmqp.Block]) -> None:
        """Handle ``first``, then the blocks held, as one read; then read again if we may."""
        (blocks, error), self._held = self._held, ([], None)
        self._handle_blocks(first + blocks, error)
        if self._over_limits():
            self._pause_reading()
        self.flush()
        self._resume_reading()

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
            "{listener}: bad input from {peer}, closing once {count} outstanding message(s)"
            " are answered: {reason}",
            listener=self.factory.name,
            peer=self._who(),
            identity=self.identity,
            count=self._outstanding,
            reason=error.reason,
        )
        self._finish()

    def _on_auth(self, block: qmqp.AuthBlock) -> None:
        """Check an ``A`` block once its address and identity owe no wait; refuse late.

        A refusal is answered after `LoginRefusals`' delay, the blocks read
        after it held meanwhile; after ``login_failures_per_connection``
        refusals the connection finishes (answers what it took) and closes.
        """
        username = text(block.username)
        logins = self.factory.logins
        wait = logins.wait_seconds(self._peer(), username)
        if wait > 0 and not self._waited:
            self._waited = True
            self._waiting_auth = block
            self._login_wait = self._call_later(wait, self._login_waited)
            self._pause_reading()
            return
        self._waited = False
        success = wait == 0 and self.factory.secrets.verify(username, block.password)
        why = UNCHECKED if wait > 0 else "wrong user or password"
        if success and not self.factory.admit(self, username):
            success = False
            why = self.factory.per_identity_refusal(username)
        elif success:
            self.identity = username
        elif wait == 0:
            self.factory.count_error("unauthorized")
        if success:
            logins.accepted(username)
            # Spec ambiguity: "1" is success, as the prose says (see gateway.codecs.qmqp).
            self._send(qmqp.encode(qmqp.AuthReplyBlock(success=True)))
            return
        self._refused_logins += 1
        delay = logins.refused(
            peer=self._peer(), identity=username, mechanism="A block", why=why, checked=wait == 0
        )
        if delay > 0:
            self._login_wait = self._call_later(delay, self._refuse_login_late)
            self._pause_reading()
        else:
            self._refuse_login()

    def _refuse_login(self) -> None:
        """Answer a refused ``A`` block; past the per-connection limit, finish."""
        self._send(qmqp.encode(qmqp.AuthReplyBlock(success=False)))
        if not self.factory.logins.spent(self._refused_logins):
            return
        self._log.info(
            "{listener}: closing the connection of {peer} after {count} refused logins",
            listener=self.factory.name,
            peer=self._who(),
            count=self._refused_logins,
        )
        blocks, _error = self._held
        self._held = ([], None)
        # Read but never to be answered: the connection closes without them.
        self._outstanding -= sum(
            isinstance(block, qmqp.MessageBlock | qmqp.InvalidBlock) for block in blocks
        )
        self._finish()

    def _refuse_login_late(self) -> None:
        """The refusal's wait is over: answer it, then go on with what was read after it."""
        self._login_wait = None
        self._refuse_login()
        if self._finishing:
            self.flush()
            return
        self._go_on([])

    def _read_certificate(self) -> None:
        """Take the identity from a verified client certificate, once, if there is one.

        Called when the first message block arrives: data has come through
        TLS, so the handshake (and the certificate's verification) is over.
        """
        self._certificate_read = True
        if self.identity is None:
            identity = external_identity(self.transport, name_types=self.factory.cert_identity)
            if identity is not None and not self.factory.admit(self, identity):
                # Over the limit: as if it had no certificate (require_auth then refuses).
                self._log.info(
                    "{listener}: {why}",
                    listener=self.factory.name,
                    why=self.factory.per_identity_refusal(identity),
                    peer=self._who(),
                    identity=identity,
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
        self._inbox.add(message_from_block(block, self._read_at), (block.id, size))

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
        self._resume_reading()

    def _answer_batch(self, tokens: list[tuple[bytes, int]], outcomes: list[Outcome]) -> None:
        """Reply to a route's batch, in order, and write the replies now, in one write.

        As `_answer` for each message, but outside a read the replies are
        written at once, in one write, and a small batch's go to the socket
        at once too (`push_answers`) instead of when the
        reactor next polls: a durable route answers here as the log
        acknowledges a commit, and its senders should not wait for what else
        that turn does (the forwarder's delivery of the same commit, the next
        read).
        """
        if self._in_batch:
            self._reply_all(tokens, outcomes)
            return
        self._in_batch = True
        try:
            self._reply_all(tokens, outcomes)
        finally:
            self._in_batch = False
        if self._outstanding == 0:
            # `_reply` leaves the idle time to a read; this is no read.
            self._idle_since = self.factory.clock.seconds()
        self.push_answers(len(tokens))

    def _reply_all(self, tokens: list[tuple[bytes, int]], outcomes: list[Outcome]) -> None:
        """`_answer` for each message of a batch, each distinct outcome mapped and counted once.

        A route's batch repeats one outcome (a durable route's commit
        accepts them all): its status and description are worked out once,
        and each reply is encoded from its fields (`qmqp.encode_reply`).
        """
        count = len(tokens)
        if count != len(outcomes):
            raise ValueError(f"{count} tokens for {len(outcomes)} outcomes")
        self._in_flight -= count
        self._in_flight_bytes -= sum(size for _block_id, size in tokens)
        if self._closing:
            return
        out = self._out
        outstanding = self._outstanding
        count_reply = self.factory.count_reply
        last: Outcome | None = None
        status = description = b""
        counted = 0
        for (block_id, _size), outcome in zip(tokens, outcomes, strict=True):
            if outcome is not last:
                if counted:
                    count_reply(status, counted)
                last, counted = outcome, 0
                status, description = result_for(outcome)
            outstanding -= 1
            out.append(qmqp.encode_reply(block_id, status, description, outstanding))
            counted += 1
        if counted:
            count_reply(status, counted)
        self._outstanding = outstanding
        self._out_count += count
        self._replied()  # only the last reply can owe nothing
        self._resume_reading()


class QMQPServerFactory(ListenerFactory[QMQPServerProtocol, QMQPListenerSettings]):
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
        self, *, router: Router, **common: Unpack[ListenerArgs[QMQPListenerSettings]]
    ) -> None:
        super().__init__(**common)
        self.router = router
        metrics = self._metrics
        self.count_reply = metrics.qmqp_reply_counter(self.name) if metrics else _not_counted
        """Count a reply by its status (K, Z or D)."""


def _not_counted(status: bytes, count: int) -> None:
    """Without metrics, replies are not counted."""
