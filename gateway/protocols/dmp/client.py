"""The DMP client role: the gateway writing to a remote sink or reading a remote feed.

`DMPUpstream` connects through a `ClientService` (reconnects with backoff),
sends the protocol header, waits for ``200``, presents its lease (the
upstream's secret in the secrets file), and waits for the second ``200``;
any other response is logged and counted, and the connection closed (the
service tries again later).

``mode = "put"``: the upstream is a route destination. Each message is
written to the sink as one envelope (`gateway.protocols.dmp.mapping`), a
batch's envelopes in one write, and the route told *accepted*: DMP has no
acknowledgement, so that means "written to the connection" (a durable route
answers its sender after the local commit and is the safe choice). A batch
written while the server does not read (its transport paused us) is
answered once it reads again (DESIGN.md, "Back-pressure before loss"): the
route's sources run out of in-flight room and stop, instead of being told
accepted for what may never leave. While not connected, or when more than
``max_backlog_bytes`` wait for a slow server (counting what the batch adds),
*retry later*; what waited when the connection ends is retry later too.

``mode = "get"``: every envelope the feed sends is routed from the
upstream, the envelopes of one read as one batch (`gateway.core.inbox`);
reading pauses while 1,000 of them await outcomes.

Null messages are written every ``heartbeat_seconds``; with
``dead_after_seconds``, a feed that sends nothing for that long is taken for
dead and the connection closed (the server heartbeats its feeds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IProtocol,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import dmp
from gateway.core.auth import Secrets
from gateway.core.batch import all_same
from gateway.core.flow import Congestion, answer_when_drained
from gateway.core.inbox import Inbox, Result
from gateway.core.interfaces import IDestination, IFleetLock
from gateway.core.message import Message, Outcome
from gateway.core.router import Router, Unrouted
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.flow import HeldWrites, InFlight, write_envelopes
from gateway.protocols.dmp.lease_request import LeaseRequest
from gateway.protocols.dmp.mapping import message_from_envelope
from gateway.protocols.dmp.settings import DMPUpstreamSettings
from gateway.protocols.tcp import UpstreamFactory
from gateway.protocols.upstream import Upstream, UpstreamConnection

__all__ = ["DMPClientProtocol", "DMPUpstream"]

MAX_IN_FLIGHT: Final = 1000


class DMPClientProtocol(UpstreamConnection["DMPUpstream"]):
    """One connection to a DMP server."""

    def __init__(self, upstream: DMPUpstream) -> None:
        super().__init__(upstream)
        self._codec = dmp.DMPCodec(
            dmp.Role.CLIENT, max_envelope_bytes=upstream.settings.max_envelope_bytes
        )
        self._answers = 0
        self.ready = False
        self._timer: IDelayedCall | None = None
        """The next null message."""
        self._dead_timer: IDelayedCall | None = None
        """The next look at the feed's silence (mode get, ``dead_after_seconds``)."""
        self._last_heard = upstream.clock.seconds()
        self._lease: str | None = None  # from a principal connection, once granted
        self._lease_request: Deferred[str] | None = None
        self._in_flight = InFlight(MAX_IN_FLIGHT, self._stop_reading, self._read)
        self.writes = HeldWrites(self._write)
        self.congestion = Congestion()
        """Put deliveries waiting for the server to read again."""
        self._inbox: Inbox[None] = Inbox(upstream.router, upstream.name, self._answer)

    def connection_started(self) -> None:
        """Send the protocol header (and ask for a lease, through a principal)."""
        self.write(self._codec.send(dmp.ProtocolHeader()))
        if self.upstream.settings.principal is not None:
            request = self.upstream.request_lease()
            self._lease_request = request
            request.addCallbacks(self._leased, self._not_leased)

    def connection_stopped(self) -> None:
        """Stop the timers and a lease request still on its way; answer what waited."""
        self.congestion.gone()
        for timer in (self._timer, self._dead_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._timer = self._dead_timer = None
        if self._lease_request is not None:
            self._lease_request.cancel()

    def _leased(self, lease: str) -> None:
        self._lease_request = None
        self._lease = lease
        if self._answers == 1:
            self.write(self._codec.send(dmp.Lease(lease)))

    def _not_leased(self, failure: Failure) -> None:
        self._lease_request = None
        if failure.check(CancelledError):
            return
        self.upstream.count_error("no-lease")
        self.close(f"no lease: {failure.getErrorMessage()}")

    def dataReceived(self, data: bytes) -> None:
        """Responses during the dialog, then envelopes (get) or nothing (put)."""
        if self._closing:
            return
        self._last_heard = self.upstream.clock.seconds()
        self.upstream.traffic.bytes_in += len(data)
        try:
            events = self._codec.receive_data(data)
        except dmp.DMPError as exc:
            self._handle_all(exc.events)  # type: ignore[arg-type]
            self.upstream.count_error(exc.kind)
            self.close(f"bad input from the server: {exc.reason}")
            return
        self._handle_all(events)

    def _handle_all(self, events: list[dmp.Event]) -> None:
        """Handle a read's events; a feed's envelopes go to the router as one batch."""
        if self.ready and self.upstream.settings.mode == "get":
            upstream = self.upstream
            inbox = self._inbox
            name = upstream.name
            now = upstream.clock.seconds()
            for event in events:
                if type(event) is dmp.Envelope:
                    inbox.add(message_from_envelope(event, name, now), None)
                # else: a heartbeat (being heard is enough)
        else:
            for event in events:
                self._handle(event)
                if self._closing:
                    break
        if len(self._inbox):
            self._dispatch()

    def _handle(self, event: dmp.Event) -> None:
        if isinstance(event, dmp.Response):
            if not event.ok:
                self.upstream.count_error(f"refused-{event.code}")
                self.close(f"the server answered {event.code} {event.indicator} {event.text}")
                return
            self._answers += 1
            if self._answers == 1:
                if self.upstream.settings.principal is None:
                    lease = self.upstream.secrets.credential_for(self.upstream.name) or b""
                    self.write(self._codec.send(dmp.Lease(lease.decode("utf-8"))))
                elif self._lease is not None:
                    self.write(self._codec.send(dmp.Lease(self._lease)))
                # else: sent when the principal connection grants it
            else:
                self.ready = True
                self._start_timers()
                self.upstream.connection_ready(self, f"connected ({self.upstream.settings.mode})")
        elif isinstance(event, dmp.Envelope):
            if self.upstream.settings.mode != "get":
                self.upstream.count_error("unexpected-message")
                self.close("the sink sent a message")
                return
            # The dialog's last response and the first envelopes came in one read.
            upstream = self.upstream
            message = message_from_envelope(event, upstream.name, upstream.clock.seconds())
            self._inbox.add(message, None)

    def _dispatch(self) -> None:
        """Hand the read's messages to the router as one batch, counted in flight."""
        inbox = self._inbox
        self.upstream.traffic.messages_in += len(inbox)
        self._in_flight.track(len(inbox), inbox.dispatch)

    def _answer(self, _token: None, result: Result) -> None:
        """One feed message's routes answered (DMP has no acknowledgement to give)."""
        self._in_flight.done()
        if isinstance(result, Unrouted):
            self.upstream.count_error("unrouted")

    def _stop_reading(self) -> None:
        assert self.transport is not None
        self.transport.pauseProducing()  # type: ignore[attr-defined]

    def _read(self) -> None:
        if not self._closing and self.transport is not None:
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def _start_timers(self) -> None:
        """Null messages every ``heartbeat_seconds``; in mode get, watch the feed's silence."""
        settings = self.upstream.settings
        clock = self.upstream.clock
        if settings.heartbeat_seconds > 0:
            self._timer = clock.callLater(settings.heartbeat_seconds, self._beat)
        if settings.mode == "get" and settings.dead_after_seconds > 0:
            self._dead_timer = clock.callLater(settings.dead_after_seconds, self._check_dead)

    def _beat(self) -> None:
        self._timer = None
        if self._closing:
            return
        if not self.writes.paused:
            self.write(dmp.HEARTBEAT_BYTES)
        self._timer = self.upstream.clock.callLater(
            self.upstream.settings.heartbeat_seconds, self._beat
        )

    def _check_dead(self) -> None:
        """Close the connection once the feed has sent nothing for ``dead_after_seconds``.

        The timer is armed for the deadline as it stood (last read plus the
        limit); reads only note their time, so the timer may fire early: it
        is then armed again for exactly the time left.
        """
        self._dead_timer = None
        if self._closing:
            return
        clock = self.upstream.clock
        limit = self.upstream.settings.dead_after_seconds
        silent = clock.seconds() - self._last_heard
        if silent < limit:
            self._dead_timer = clock.callLater(limit - silent, self._check_dead)
            return
        self.upstream.count_error("dead-peer")
        self.close(f"the feed sent nothing for {silent:g} s")

    def write(self, data: bytes) -> None:
        """Write (or hold while the server is not reading)."""
        self.writes.write(data)

    def _write(self, data: bytes) -> None:
        super().write(data)

    def pauseProducing(self) -> None:
        """The server is not reading: hold what we write; deliveries wait."""
        self.writes.pause()
        self.congestion.begin()

    def resumeProducing(self) -> None:
        """The server reads again: write what waited, answer the deliveries."""
        self.writes.resume()
        self.congestion.drained()

    def stopProducing(self) -> None:
        """The connection is going away."""
        self._closing = True


@implementer(IDestination)
class DMPUpstream(Upstream[DMPClientProtocol]):
    """A DMP server's sink (put) or feed (get).

    Args:
        name: The upstream's config name.
        settings: Its validated settings.
        endpoint: Where to connect.
        router: Where feed messages go.
        secrets: The lease (this upstream's secret).
        clock: Timers.
        metrics: Counters, or None.
        lock: In a fleet, the lock under which it connects (`gateway.protocols.upstream`).
    """

    kind = "dmp"

    def __init__(
        self,
        *,
        name: str,
        settings: DMPUpstreamSettings,
        endpoint: IStreamClientEndpoint,
        router: Router,
        secrets: Secrets,
        clock: IReactorTime,
        metrics: GatewayMetrics | None = None,
        lock: IFleetLock | None = None,
    ) -> None:
        super().__init__(
            name=name,
            endpoint=endpoint,
            connection=DMPClientProtocol,
            clock=clock,
            metrics=metrics,
            lock=lock,
        )
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self._unread = Outcome.retry(
            f"upstream {self.name}: the connection ended before the server read this"
        )

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Write a batch into the remote sink, in one write.

        Returns:
            A Deferred, already fired, with one outcome per message, in order.
        """
        connection = self._connection
        if self.settings.mode != "put":
            why = f"upstream {self.name} reads a feed; it takes nothing"
            return all_same(len(messages), Outcome.rejected(why))
        if connection is None:
            return all_same(len(messages), Outcome.retry(f"upstream {self.name} is not connected"))
        name = self.name
        outcomes, written = write_envelopes(
            connection.writes,
            messages,
            self.settings.exchange,
            self.settings.max_backlog_bytes,
            lambda held: Outcome.retry(f"upstream {name}: {held} bytes unwritten"),
            lambda why: Outcome.rejected(f"upstream {name}: {why}"),
        )
        self.traffic.messages_out += written
        return answer_when_drained((connection.congestion,), outcomes, self._unread)

    def request_lease(self) -> Deferred[str]:
        """Ask the server for a lease over a principal connection (``principal`` set)."""
        settings = self.settings
        assert settings.principal is not None
        secret = self.secrets.credential_for(self.name) or b""
        factory = UpstreamFactory(
            lambda _: LeaseRequest(
                settings.principal or "", secret, settings.mode, settings.target, self.clock
            ),
            self,
        )
        connecting = self._endpoint.connect(factory)

        def granted(request: IProtocol) -> Deferred[str]:
            assert isinstance(request, LeaseRequest)
            return request.result

        return connecting.addCallback(granted)
