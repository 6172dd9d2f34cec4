"""The QMQP streaming client role: the gateway streaming mail to a server.

`QMQPUpstream` is a route destination. A batch's messages join a queue and
are streamed to the server with at most ``window`` unanswered at a time: all
the blocks the window takes are written at once, in one write. Replies are
matched by id and become outcomes: ``K`` accepted, ``D`` rejected, ``Z``
resent after a growing delay until ``max_attempts``, then "retry later".
Each batch collects its outcomes in one `Answers` (no Deferred per
message); when the router cancels it at the route's deadline, the messages
already answered keep their outcome and the rest are never sent again.

The connection comes from Twisted's `ClientService` (reconnect with
backoff). When it is lost, messages that were sent but never answered go
back to the front of the queue and are sent again on the next connection;
each message's outcome fires once, so a message never counts two K's (the
server may still receive it twice: QMQP has no way to tell).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from zope.interface import implementer

from gateway.codecs import qmqp
from gateway.core.auth import Secrets
from gateway.core.batch import Answers
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.metrics import GatewayMetrics
from gateway.protocols.qmqp.mapping import block_for, outcome_from_reply, raw
from gateway.protocols.qmqp.settings import QMQPUpstreamSettings
from gateway.protocols.upstream import Upstream, UpstreamConnection

__all__ = ["QMQPClientProtocol", "QMQPUpstream"]


class _Job:
    """One message on its way: its block, where its outcome goes, its attempts.

    Attributes:
        answers: The outcomes of the batch the message came in.
        index: The message's place in that batch.
    """

    __slots__ = ("answers", "attempts", "block", "cancelled", "id", "index", "retry_call")

    def __init__(self, block: qmqp.MessageBlock, answers: Answers, index: int) -> None:
        self.id = block.id
        self.block = block
        self.answers = answers
        self.index = index
        self.attempts = 0
        self.retry_call: IDelayedCall | None = None
        self.cancelled = False


class QMQPClientProtocol(UpstreamConnection["QMQPUpstream"]):
    """One connection from the gateway to a QMQP streaming server.

    It is a push producer on its own transport: while the server does not
    read, the upstream sends nothing more (the window bounds the rest).
    """

    def __init__(self, upstream: QMQPUpstream) -> None:
        super().__init__(upstream)
        self._codec = qmqp.QMQPCodec(
            qmqp.Role.CLIENT, max_message_bytes=upstream.settings.max_message_bytes
        )
        self.ready = False
        self.paused = False

    def connection_started(self) -> None:
        """Authenticate if configured, else start streaming (over TLS: once it is established).

        The server says nothing until it is sent a block: without an ``A``
        block to answer, only TLS's own handshake tells that the server
        verified (a connection called ready before it would reset the
        back-off at every failed handshake).
        """
        settings = self.upstream.settings
        if settings.username is None:
            if not self.tls:
                self._ready()
            return
        password = self.upstream.secrets.credential_for(self.upstream.name) or b""
        self.write(
            self._codec.send(qmqp.AuthBlock(username=raw(settings.username), password=password))
        )

    def tls_established(self) -> None:
        """TLS is up: without authentication the connection is ready now."""
        if self.upstream.settings.username is None and not self._closing:
            self._ready()

    def pauseProducing(self) -> None:
        """The server is not reading: stop sending."""
        self.paused = True

    def resumeProducing(self) -> None:
        """The server reads again."""
        self.paused = False
        self.upstream.pump()

    def _ready(self) -> None:
        self.ready = True
        self.upstream.connection_ready(self)

    def dataReceived(self, data: bytes) -> None:
        """Turn replies into outcomes."""
        if self._closing:
            return
        error: qmqp.QMQPError | None = None
        try:
            blocks = self._codec.receive_data(data)
        except qmqp.QMQPError as exc:
            error = exc
            blocks = cast(list[qmqp.Block], exc.events)
        self.upstream.traffic.bytes_in += len(data)
        self.upstream.traffic.messages_in += len(blocks)
        for block in blocks:
            if isinstance(block, qmqp.ReplyBlock):
                self.upstream.replied(block)
            elif isinstance(block, qmqp.AuthReplyBlock):
                self._on_auth_reply(block)
            elif isinstance(block, qmqp.DoneBlock):
                self.close("the server sent its done block")
            if self._closing:
                return
        self.upstream.pump()
        if error is not None:
            self.upstream.count_error(error.kind)
            self.close(f"bad input from the server: {error.reason}")

    def _on_auth_reply(self, block: qmqp.AuthReplyBlock) -> None:
        # Spec ambiguity: the prose says "1" is success, the example shows
        # "0"; the codec follows the prose and auth_success_reply can flip it.
        success = block.success == (self.upstream.settings.auth_success_reply == "1")
        if self.ready:
            return
        if success:
            self._ready()
        else:
            self.upstream.count_error("auth-refused")
            self.close(f"authentication as {self.upstream.settings.username!r} refused")


@implementer(IDestination)
class QMQPUpstream(Upstream[QMQPClientProtocol]):
    """A QMQP streaming server the gateway delivers to.

    Args:
        name: The upstream's config name.
        settings: Its validated settings.
        endpoint: Where to connect.
        secrets: The password for its ``A`` block, if it authenticates.
        clock: Timers and reconnect delays.
        metrics: Counters, or None.
    """

    kind = "qmqp"

    def __init__(
        self,
        *,
        name: str,
        settings: QMQPUpstreamSettings,
        endpoint: IStreamClientEndpoint,
        secrets: Secrets,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        super().__init__(
            name=name,
            endpoint=endpoint,
            connection=QMQPClientProtocol,
            clock=clock,
            metrics=metrics,
        )
        self.settings = settings
        self.secrets = secrets
        self._queue: deque[_Job] = deque()
        self._sent: dict[bytes, _Job] = {}
        self._waiting_retry = 0
        self._ids = itertools.count(1)
        self._count_reply = metrics.qmqp_reply_counter(name) if metrics else None

    @property
    def unanswered(self) -> int:
        """Messages queued, sent or waiting to be resent."""
        return len(self._queue) + len(self._sent) + self._waiting_retry

    # --- IDestination -------------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Queue a batch and stream what the window takes, in one write.

        Returns:
            A Deferred firing with the server's answer for each message, in
            order. Messages past ``max_queue`` are "retry later" at once;
            cancelling it (the route's deadline) answers what is known and
            `UNANSWERED` for the rest, which are never sent again.
        """
        jobs: list[_Job] = []
        answers = Answers(len(messages), lambda cancelled: self._cancel(cancelled, jobs))
        queue = self._queue
        # max_queue bounds the messages waiting (for the window or a resend),
        # not those in the window: the window's free slots take the first of
        # the queue as soon as they are pumped (once, below).
        free = self._free_window()
        max_queue = self.settings.max_queue
        retrying = self._waiting_retry
        ids = self._ids
        for index, message in enumerate(messages):
            waiting = max(len(queue) - free, 0) + retrying
            if waiting >= max_queue:
                answers.settle(
                    index, Outcome.retry(f"upstream {self.name}: {waiting} messages queued already")
                )
                continue
            # Ids only need to be unique per connection; the message id keeps
            # them readable in the server's logs.
            job = _Job(block_for(message, raw(f"{message.id}.{next(ids)}")), answers, index)
            jobs.append(job)
            queue.append(job)
        if jobs:
            self.pump()
        return answers.deferred

    def _free_window(self) -> int:
        """Window slots a pump would fill now (none while it cannot send)."""
        connection = self._connection
        if connection is None or connection.paused or connection.closing:
            return 0
        return max(self.settings.window - len(self._sent), 0)

    def _cancel(self, answers: Answers, jobs: list[_Job]) -> None:
        """The router gave up on a batch (time-out): never send its open messages again.

        A message on the wire keeps its place in the window until the server
        answers (the answer is then dropped) or the connection ends: a server
        that stops answering must not make us write without bound.
        """
        outcomes = answers.outcomes
        queued = False
        for job in jobs:
            if outcomes[job.index] is not None:
                continue  # answered already
            job.cancelled = True
            if job.retry_call is not None and job.retry_call.active():
                # Waiting for a resend: in neither the queue nor the window.
                job.retry_call.cancel()
                job.retry_call = None
                self._waiting_retry -= 1
            elif job.id not in self._sent:
                queued = True
        if queued:  # one pass over the queue for the whole batch
            self._queue = deque(job for job in self._queue if not job.cancelled)

    # --- streaming --------------------------------------------------------------------------

    def pump(self) -> None:
        """Send queued messages while the window has room and the socket keeps up."""
        connection = self._connection
        if connection is None or connection.paused or connection.closing:
            return
        window = self.settings.window
        queue = self._queue
        sent = self._sent
        out: list[bytes] = []
        while queue and len(sent) < window:
            job = queue.popleft()
            job.attempts += 1
            sent[job.id] = job
            out.append(qmqp.encode(job.block))
        if out:
            self.traffic.messages_out += len(out)
            connection.write(b"".join(out))

    def replied(self, reply: qmqp.ReplyBlock) -> None:
        """Turn a reply into its message's outcome (or a resend after Z)."""
        job = self._sent.pop(reply.id, None)
        if self._count_reply is not None:
            self._count_reply(reply.status, 1)
        if job is None or job.cancelled:
            return  # a message the router gave up on, or an id we never sent
        if reply.status == qmqp.Z and job.attempts < self.settings.max_attempts:
            delay = min(
                self.settings.retry_initial_seconds * 2 ** (job.attempts - 1),
                self.settings.retry_max_seconds,
            )
            self._waiting_retry += 1
            job.retry_call = self.clock.callLater(delay, self._retry, job)
            return
        job.answers.settle(job.index, outcome_from_reply(reply, self.name))

    def _retry(self, job: _Job) -> None:
        job.retry_call = None
        self._waiting_retry -= 1
        self._queue.appendleft(job)
        self.pump()

    # --- connection state ----------------------------------------------------------------------

    def connection_ready(self, connection: QMQPClientProtocol, detail: str = "connected") -> None:
        """The connection may carry messages now: stream what waits."""
        super().connection_ready(connection, detail)
        self.pump()

    def connection_ended(self, connection: QMQPClientProtocol) -> str:
        """Put unanswered messages back in front of the queue, in order."""
        unanswered = [job for job in self._sent.values() if not job.cancelled]
        self._sent.clear()
        self._queue.extendleft(reversed(unanswered))
        return f"{len(unanswered)} message(s) to resend"
