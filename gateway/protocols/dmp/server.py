"""The DMP server role: sinks that take messages into routing, feeds that routes deliver to.

A connection presents the protocol header and a lease (`gateway.codecs.dmp`).
The lease is looked up among the listener's grants (``leases``: a name, the
sink or feed it opens, an optional expiry; the lease text itself is that
name's text in the secrets file's ``[leases]``) and among leases made through the admin
API: unknown or expired is ``402 BAD-LEASE``, a sink or feed that is not
configured ``404 NOT-FOUND``, a feed that already has its reader ``403
NO-ACCESS``; each then closes. ``200`` opens the connection.

Identity: a lease may be bound to an identity (``identity`` in the config;
leases a principal connection gets are bound to its login). On an ``mtls:``
listener the verified client certificate names the connection; a lease
bound to an identity the certificate does not name, or a config lease bound
to an identity and used without a certificate, is ``402 BAD-LEASE`` ("not
valid for this client"). A listener's ``authorize`` table is then checked:
opening a sink needs the right to publish to it, a feed the right to consume
from it; otherwise ``403 NO-ACCESS`` and a close.

Sinks (many writers): every envelope is routed from the listener, one
read's envelopes as one batch, and what becomes of them is counted and
logged (`gateway.protocols.dmp.sinks`: DMP cannot tell the writer). Null
messages are ignored; a sink connection silent for
``idle_timeout_seconds`` is closed as dead.

Feeds (one reader): the listener is the route destination for them; a
batch's messages routed to feed ``F`` are written to F's reader at once, in
one write, and the route told *accepted* for each (written to the reader's
connection: DMP has nothing more), *retry later* when F has no reader,
*rejected* when no feed F exists or DMP cannot carry the message. Null
messages go to readers every ``heartbeat_seconds`` while they keep up; a
reader that is gone shows as the write failing and the connection closing.
A reader that writes envelopes is closed.

Slow feed readers (DESIGN.md, "Back-pressure before loss";
`gateway.core.flow`): DMP has no acknowledgement, so a message refused for a
reader's backlog would be lost to a sink writer. Instead, a batch written
while the reader's transport is full is answered only once it drained: the
route's sources run out of in-flight room (a sink writer's
``max_in_flight``, a QMQP sender's) and are not read until then. A reader
that does not drain for ``slow_consumer_seconds``, or whose backlog passes
``max_backlog_bytes``, is cut as a slow consumer, counted and logged, which
frees the feed; what waited for it is answered retry later (a durable route
keeps it). Under ``slow_consumer_policy = "disconnect"`` nothing waits: a
reader past the cap is cut.

In a fleet (`join_fleet`, `gateway.protocols.dmp.fleet`): leases made at
run time are signed texts every node checks, and a lease of the fleet waits
(reading nothing more) until the node knows the fleet's revocations; a
feed's reader first claims the feed's fleet lock, the lease's answer
waiting for it (``403`` when another node has the reader); a route's
delivery to a feed read on another node is forwarded there, and answered as
that reader took it.

`DMPServerProtocol` is put together over `gateway.protocols.dmp.serverbase`
(the connection state its parts share, closing, timers) from
`gateway.protocols.dmp.serverlease` (the protocol header, the lease's wait
and checks, the fleet's claim of a feed, the answer) and what this module
keeps: the connection's life, reading, the sinks' and feeds' data path
(flow control, idle time, heartbeats), and the factory that builds it (over
`.serverbase.DMPListenerFactory`, the listener's shared state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from gateway.codecs import dmp
from gateway.core.inbox import Inbox
from gateway.core.message import Message, Outcome
from gateway.protocols.dmp.flow import encode_envelopes
from gateway.protocols.dmp.mapping import message_from_envelope, messages_from_bodies
from gateway.protocols.dmp.principal import PrincipalConnection
from gateway.protocols.dmp.serverbase import DMPListenerFactory
from gateway.protocols.dmp.serverlease import ServerLease
from gateway.protocols.dmp.sinks import SinkOutcomes

__all__ = ["DMPServerFactory", "DMPServerProtocol"]


class DMPServerProtocol(ServerLease):
    """One DMP connection: a sink writer, a feed reader or a principal connection."""

    def __init__(self, factory: DMPServerFactory) -> None:
        super().__init__(factory)
        self._codec = dmp.DMPCodec(
            dmp.Role.SERVER, max_envelope_bytes=factory.settings.max_envelope_bytes, bodies=True
        )
        self.kind: str | None = None  # "sink" or "feed" once opened
        self.identity: str | None = None  # from the certificate or the lease, once opened
        self.target = ""
        self._timer: IDelayedCall | None = None
        self._outcomes = SinkOutcomes(
            factory.name,
            factory.clock,
            factory.settings.max_in_flight,
            self._too_many_in_flight,
            self._few_in_flight,
            factory.count_error,
            self._heard_now,
        )
        self._in_flight_full = False
        self._last_heard = factory.clock.seconds()
        self._prefix: bytes | None = b""  # header octets until DMP and AMQP 0-9-1 part ways
        self._principal: PrincipalConnection | None = None
        self._inbox: Inbox[Message] = Inbox(
            factory.router, factory.name, self._outcomes.one, self._outcomes.batch
        )
        self._login_wait: IDelayedCall | None = None
        """Set while a lease (or a principal's login) waits (`LoginRefusals`)."""
        self._held: list[dmp.Event] = []
        """The waiting lease and what was read after it."""
        self._held_error: dmp.DMPError | None = None
        """The error of that read, reported after them."""
        self._waited = False
        """The lease waited once: if a wait is still owed, it is refused unchecked."""
        self._suspended: Deferred[Any] | None = None
        """Set while the lease waits for the fleet (its revocations, the feed's lock)."""
        self._revocations_waited = False
        self._claiming: str | None = None
        """The feed whose fleet lock this connection is claiming."""

    # --- connection life -------------------------------------------------------------------

    def _connection_started(self) -> None:
        """Wait for the header and the lease, within the handshake time-out."""
        self._timer = self._call_later(
            self.factory.settings.handshake_timeout_seconds, self._handshake_timed_out
        )

    def _connection_ended(self, reason: Failure) -> None:
        """A feed is free for its next reader; what was counted and not logged yet is."""
        if self._principal is not None:
            self._principal.stop()
        waiting, self._suspended = self._suspended, None
        if waiting is not None:
            waiting.cancel()  # a claim is given up
        self._leave_feed()
        self._outcomes.last_lines(self.kind)

    def _abort(self) -> None:
        """Abort, the feed free for its next reader at once (a reader cut as slow, too)."""
        self._leave_feed()
        super()._abort()

    def _partial_frame_bytes(self) -> int:
        if self._principal is not None:
            return self._principal.pending_bytes
        return self._codec.pending_bytes + (len(self._prefix) if self._prefix else 0)

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self.kind is None:
            self.factory.count_error("handshake-timeout")
            self._close_with("no lease within the handshake time-out")

    # --- input ---------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Decode and handle what arrived."""
        if self._closing:
            return
        self._last_heard = self.factory.clock.seconds()
        self.factory.traffic.bytes_in += len(data)
        principal = self._principal
        if principal is not None:
            before = principal.pending_bytes + len(data)
            principal.receive_data(data)
            held = principal.pending_bytes
            self._frame_read(held < before, held)
            return
        if self._prefix is not None:
            data = self._sort_header(data)
            if not data:
                self._frame_read(False, self._partial_frame_bytes())
                return
        try:
            events = self._codec.receive_data(data)
        except dmp.DMPError as exc:
            self._handle_all(exc.events)  # type: ignore[arg-type]
            self._bad_input(exc)
            return
        self._handle_all(events)
        held = self._codec.pending_bytes
        if held or self._partial_since is not None:
            self._frame_read(bool(events), held)

    def _handle_all(self, events: list[dmp.Event]) -> None:
        """Handle a read's events; a sink's envelopes go to the router as one batch."""
        if self.kind == "sink":
            inbox = self._inbox
            target = self.target
            now = self.factory.clock.seconds()
            for event in events:
                if type(event) is dmp.Bodies:  # bare envelopes: nearly all there is
                    for message in messages_from_bodies(event.bodies, target, now):
                        inbox.add(message, message)
                elif type(event) is dmp.Envelope:
                    message = message_from_envelope(event, target, now)
                    inbox.add(message, message)
                # else: a heartbeat (nothing to do: being heard is enough)
        else:
            for index, event in enumerate(events):
                self._handle(event)
                if self._closing:
                    break
                if self._login_wait is not None:
                    self._held = events[index:]
                    break
                if self._suspended is not None:
                    self._held = events[index + 1 :]
                    break
        if len(self._inbox):
            self._dispatch()

    # --- sinks ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand the read's messages to the router as one batch, counted in flight."""
        inbox = self._inbox
        self.factory.traffic.messages_in += len(inbox)
        self._outcomes.dispatch(len(inbox), inbox.dispatch)

    def _heard_now(self) -> None:
        """No outcome is owed any more: the idle time counts from now."""
        self._last_heard = self.factory.clock.seconds()

    def _too_many_in_flight(self) -> None:
        self._in_flight_full = True
        self._pause_reading()

    def _few_in_flight(self) -> None:
        self._in_flight_full = False
        self._resume_reading()

    def _may_read(self) -> bool:
        return not self._in_flight_full and self._login_wait is None

    def _check_idle(self) -> None:
        """Close a sink writer silent for ``idle_timeout_seconds``, to the second.

        One timer, re-armed for the time left when the writer was heard
        since (or while its messages await outcomes).
        """
        self._timer = None
        if self._closing:
            return
        limit = self.factory.settings.idle_timeout_seconds
        if self._outcomes.count:  # busy: the last outcome restarts the count
            self._schedule(limit, self._check_idle)
            return
        silent = self.factory.clock.seconds() - self._last_heard
        if silent < limit:
            self._schedule(limit - silent, self._check_idle)
            return
        self.factory.count_error("idle-timeout")
        self._close_with(f"sink writer silent for {silent:g} s")

    # --- feeds ---------------------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> list[Outcome]:
        """Write a batch to this feed reader in one write; say for each message why not, if not.

        Returns:
            One outcome per message, in order: accepted when written to the
            connection (the caller waits for a congested reader to drain,
            `DMPServerFactory.deliver`), rejected when DMP cannot carry it.
        """
        if self._closing:
            return [Outcome.retry(f"the reader of feed {self.target!r} is leaving")] * len(messages)
        target = self.target
        outcomes, parts = encode_envelopes(
            messages,
            target,
            lambda why: Outcome.rejected(f"feed {target!r} cannot carry the message: {why}"),
        )
        if parts:
            self._write(b"".join(parts) if len(parts) > 1 else parts[0], len(parts))
        return outcomes

    def write_envelopes(self, data: bytes, count: int) -> bool:
        """Write ``count`` envelopes encoded elsewhere (another node's); False when leaving."""
        if self._closing:
            return False
        self._write(data, count)
        return True

    def _beat(self) -> None:
        self._timer = None
        if self._closing:
            return
        if not self._congested:  # a reader behind has data to read: no null message needed
            self._write(dmp.HEARTBEAT_BYTES)
        self._schedule(self.factory.settings.heartbeat_seconds, self._beat)


class DMPServerFactory(DMPListenerFactory):
    """Builds DMP connections for one listener (`DMPListenerFactory`'s state)."""

    protocol = DMPServerProtocol
