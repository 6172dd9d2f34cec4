"""The RabbitMQ Stream protocol server role, over the embedded log.

A thin adapter over `gateway.codecs.stream`: the connection handshake (peer
properties, SASL PLAIN or ANONYMOUS, tune, open), stream management (create,
delete, metadata, stats), publishers (declare, publish answered by
PublishConfirm once the log committed the chunk, deduplication by publisher
reference, query publisher sequence), consumers (subscribe from any offset
specification, chunks delivered as stored under credit, store and query
offset), heartbeats and close. A listener's ``authorize`` table is checked
with the SASL identity (PLAIN, EXTERNAL; ANONYMOUS has none): Create,
Delete, DeclarePublisher and QueryPublisherSequence need the right to
publish to the stream, Subscribe and QueryOffset the right to consume from
it; a refusal is answered 16 (Access refused), and a StoreOffset without the
right is dropped (it has no response). See docs/stream-protocol-notes.md for the
byte-level details it follows, including the quirks clients rely on.

The gateway's own streams (``msggateway.*``, `gateway.core.internal`) are
not client streams, whatever the allow-lists say: Create, Delete,
DeclarePublisher and QueryPublisherSequence on one are answered 16 and a
StoreOffset there is dropped, for every identity, as are DeclarePublisher,
QueryPublisherSequence and StoreOffset under one of the gateway's own
references on any stream; Subscribe, QueryOffset, StreamStats and
ResolveOffsetSpec on one are answered 16 unless the operator granted the
identity reading it (`gateway.core.authorization.check_internal`). Each
refusal is logged and counted as ``internal-stream``. Metadata answers for
them as for any stream (RabbitMQ's does not check rights either): that a
route's stream exists is no secret.

In a fleet (``factory.fleet``, docs/fleet.rst) each stream has one owner
node; Metadata names it as the leader, Subscribe on a stream owned
elsewhere is answered 6 (stream not available), and the other commands on
such a stream are relayed to its owner (`gateway.protocols.stream.relay`).
A connection that is another node's relay is served from this log. With the
fleet's relay secret, a relay may log in as the fleet (SASL
``MSGGATEWAY-RELAY``, `gateway.protocols.stream.fleetlogin`): it is then
the identity its client authenticated as on the relaying node, checked
against the allow-lists here as that client would be; or the relaying
node's routes, which write as this node's own routes do (no allow-lists,
the gateway's references allowed, its own streams still refused).

Flow control: the listener stops reading from a connection with more than
``max_unconfirmed`` published messages awaiting their commit, or whose
client does not read what it is sent; deliveries stop while the client is
slow and resume when it catches up.

`StreamServerProtocol` is put together from one mixin per concern, over
`gateway.protocols.stream.serverbase` (reply codes, output, the allow-list
checks): `gateway.protocols.stream.serverauth` (peer properties, SASL,
Open), `.serveradmin` (Create, Delete, Metadata, StreamStats),
`.serverpublish` (publishers, Publish and its confirms) and
`.serverconsume` (subscriptions, deliveries, offsets). This module keeps
the connection's life, reading and dispatch, Tune, heartbeats and close,
what a fleet asks of a connection, and the factory that builds it (over
`.serverbase.StreamListenerFactory`, the listener's shared state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from gateway.codecs import stream as sp
from gateway.protocols.sendfile import FileSender
from gateway.protocols.stream.fleetlogin import RelayIdentity
from gateway.protocols.stream.relay import StreamRelays
from gateway.protocols.stream.serveradmin import ServerStreams
from gateway.protocols.stream.serverauth import ServerLogin
from gateway.protocols.stream.serverbase import OK, UNKNOWN_FRAME, StreamListenerFactory
from gateway.protocols.stream.serverconsume import ServerSubscriptions
from gateway.protocols.stream.serverpublish import ServerPublishers

__all__ = ["StreamServerFactory", "StreamServerProtocol"]

PRE_OPEN_FRAME_MAX: Final = 8192
"""Frames before Open may not be larger (the reference server's ceiling)."""
RESUME_FRACTION: Final = 0.25
CLOSE_WAIT_SECONDS: Final = 10.0

# The server's command versions, in the reference server's order (rstream
# looks the publish entry up by position).
COMMAND_VERSIONS: Final = (
    (1, 1, 1), (2, 1, 2), (5, 1, 1), (6, 1, 1), (7, 1, 1), (9, 1, 1), (10, 1, 1),
    (11, 1, 1), (12, 1, 1), (13, 1, 1), (14, 1, 1), (15, 1, 1), (22, 1, 1), (23, 1, 1),
    (24, 1, 1), (25, 1, 1), (28, 1, 1), (29, 1, 1), (30, 1, 1), (31, 1, 1),
)  # fmt: skip


class StreamServerProtocol(ServerLogin, ServerStreams, ServerPublishers, ServerSubscriptions):
    """One client of a stream listener."""

    def __init__(self, factory: StreamServerFactory) -> None:
        super().__init__(factory)
        self._codec = sp.StreamCodec(sp.Role.SERVER, frame_max=PRE_OPEN_FRAME_MAX)
        self._state = "connected"
        self.identity: str | None = None
        self._principal: str | None = None
        """The identity the allow-lists see: None for ANONYMOUS (it authenticates nobody)."""
        self._publishers = {}
        self._subscriptions = {}
        self._file_sender = FileSender()
        self._unconfirmed = 0
        self._in_batch = False
        self._heartbeat = 0
        self._frame_max = factory.settings.frame_max
        self._sent_since = False
        self._heard_at = factory.clock.seconds()
        """When the last read from the client arrived (noted per read, not per frame)."""
        self._beat_call: IDelayedCall | None = None
        self._silence_call: IDelayedCall | None = None
        self._login_wait: IDelayedCall | None = None
        """Set while a SaslAuthenticate waits (`LoginRefusals`): to be checked, or refused."""
        self._held: tuple[list[sp.Event], sp.StreamError | None] = ([], None)
        """The waiting SaslAuthenticate, the frames after it in its read, and its error."""
        self._waited = False
        """The SaslAuthenticate waited once: if a wait is still owed, it is refused unchecked."""
        self._relays: StreamRelays | None = None
        """In a fleet: commands on streams other nodes own go there (None: all served here)."""
        self._relay_nonces: tuple[str, str] | None = None
        """Another node's relay, with the fleet's secret: (our nonce, its nonce)."""
        self._relayed: RelayIdentity | None = None
        """Another node's relay logged in as the fleet: on whose behalf it acts."""
        fleet = factory.fleet
        if fleet is not None:
            self._relays = StreamRelays(
                fleet=fleet,
                listener=factory.name,
                client=self,
                clock=factory.clock,
                frame_max=factory.settings.frame_max,
                exists=lambda name: factory.store.get(name) is not None,
                advertised=factory.advertised,
                local_publisher=self._publishers.__contains__,
            )

    # --- connection life ------------------------------------------------------------

    def _connection_started(self) -> None:
        """Start the handshake time-out."""
        self._call_later(self.factory.settings.handshake_timeout_seconds, self._handshake_timed_out)

    def _handshake_timed_out(self) -> None:
        if self._state != "open" and not self._closing:
            self.factory.count_error("handshake-timeout")
            self._log.info(
                "{listener}: closing a connection not open after {seconds:g} s",
                listener=self.factory.name,
                seconds=self.factory.settings.handshake_timeout_seconds,
            )
            self._close()

    def _connection_ended(self, reason: Failure) -> None:
        """Forget publishers and subscriptions."""
        for subscription in self._subscriptions.values():
            self._stop_waiting(subscription)
        self._subscriptions.clear()
        self._publishers.clear()
        if self._relays is not None:
            self._relays.close()

    def _partial_frame_bytes(self) -> int:
        return self._codec.pending_bytes

    def _may_read(self) -> bool:
        return (
            self._unconfirmed <= self.factory.settings.max_unconfirmed * RESUME_FRACTION
            and self._login_wait is None
        )

    def _server_close(self, code: int, reason: str) -> None:
        """Ask the client to close (after Open), and close anyway after a while."""
        if self._state != "open":
            self._close()
            return
        self._state = "closing"
        self._send(sp.Close(correlation_id=1, code=code, reason=reason))
        self.flush()
        self._call_later(CLOSE_WAIT_SECONDS, self._close)

    # --- IPushProducer: deliveries stop while the client is slow ----------------------------

    def resumeProducing(self) -> None:
        """The client caught up: read it again, and deliver."""
        super().resumeProducing()
        for subscription in list(self._subscriptions.values()):
            self._deliver(subscription)

    # --- input -----------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Decode frames and handle each, then write what they produced."""
        if self._closing:
            return
        self._heard_at = self.factory.clock.seconds()
        self.factory.traffic.bytes_in += len(data)
        if self._state == "closing":
            # We sent Close after a bad frame, so the codec is dead: whatever
            # comes now (the client's answer) ends the connection, without
            # reporting the same bad frame a second time.
            self._close()
            return
        error: sp.StreamError | None = None
        try:
            events = self._codec.receive_data(data)
        except sp.StreamError as exc:
            error = exc
            events = cast(list[sp.Event], exc.events)
        if not self._handle_events(events, error):
            return
        if error is None:
            held = self._codec.pending_bytes
            if held or self._partial_since is not None:
                self._frame_read(bool(events), held)
        self.flush()

    def _handle_events(self, events: list[sp.Event], error: sp.StreamError | None) -> bool:
        """Handle a read's frames, then its error; False once the connection is closing.

        A SaslAuthenticate that must wait (`_on_sasl_authenticate`) holds
        itself and what follows it until the wait is over.
        """
        self._in_batch = True
        try:
            for index, event in enumerate(events):
                handler = _HANDLERS.get(type(event))
                if handler is None or (self._state == "closing" and not _CLOSING_OK(event)):
                    continue
                relays = self._relays
                if relays is not None and self._state == "open" and relays.take(event):
                    continue  # a stream another node owns
                handler(self, event)
                if self._closing:
                    return False
                if self._login_wait is not None:
                    self._held = (events[index:], error)
                    return True
        finally:
            self._in_batch = False
        if error is not None:
            self.factory.count_error(error.kind)
            self._log.warn(
                "{listener}: bad frame: {reason}", listener=self.factory.name, reason=error.reason
            )
            self._server_close(error.code or UNKNOWN_FRAME, error.reason)
        return True

    # --- tune, command versions and close --------------------------------------------------------

    def _on_tune(self, event: sp.Tune) -> None:
        server = self.factory.settings.frame_max
        client = event.frame_max
        self._frame_max = min(server, client) if server and client else (server or client)
        # As RabbitMQ does, the client's value as it is: it may lengthen or turn
        # off what we proposed (docs/stream-protocol-notes.md, "0x0014 Tune").
        self._heartbeat = event.heartbeat
        for call in (self._beat_call, self._silence_call):
            if call is not None and call.active():
                call.cancel()  # a second Tune replaces the first one's timers
        self._beat_call = self._silence_call = None
        if self._heartbeat:
            self._beat_call = self._call_later(self._heartbeat / 2, self._heartbeat_send)
            self._silence_call = self._call_later(2 * self._heartbeat, self._heartbeat_check)

    def _on_exchange_command_versions(self, event: sp.ExchangeCommandVersions) -> None:
        if not self._require_open(event):
            return
        self._send(
            sp.ExchangeCommandVersionsResponse(
                correlation_id=event.correlation_id,
                code=OK,
                versions=tuple(
                    sp.CommandVersion(key=k, min_version=lo, max_version=hi)
                    for k, lo, hi in COMMAND_VERSIONS
                ),
            )
        )

    def _on_heartbeat(self, event: sp.Heartbeat) -> None:
        """Liveness is noted for every frame; nothing to answer."""

    def _on_close(self, event: sp.Close) -> None:
        self._send(sp.CloseResponse(correlation_id=event.correlation_id, code=OK))
        self._close()

    def _on_close_response(self, event: sp.CloseResponse) -> None:
        self._close()

    # --- heartbeats -------------------------------------------------------------------------------

    def _heartbeat_send(self) -> None:
        self._beat_call = None
        if self._closing:
            return
        if not self._sent_since:
            self._send(sp.Heartbeat())
        self._sent_since = False
        self._beat_call = self._call_later(self._heartbeat / 2, self._heartbeat_send)

    def _heartbeat_check(self) -> None:
        """Abort a client from which nothing came for twice the tuned heartbeat.

        The timer is armed for the deadline as it stood (last read plus two
        intervals); reads only note their time, so the timer may fire early:
        it is then armed again for exactly the time left. RabbitMQ checks
        once per interval instead, which lets a silent client stay two to
        three intervals.
        """
        self._silence_call = None
        if self._closing:
            return
        limit = 2 * self._heartbeat
        silent = self.factory.clock.seconds() - self._heard_at
        if silent < limit:
            self._silence_call = self._call_later(limit - silent, self._heartbeat_check)
            return
        self._log.info(
            "{listener}: no heartbeat from {user} for {seconds:g} s; aborting",
            listener=self.factory.name,
            user=self.identity,
            seconds=silent,
            heartbeat=self._heartbeat,
        )
        self.factory.count_error("heartbeat-timeout")
        self._abort()  # given up on: it keeps nothing we wrote

    # --- streams deleted, or owned elsewhere now ------------------------------------------------

    def stream_gone(self, name: str) -> None:
        """A stream this connection uses was deleted: tell the client, drop its users."""
        used = any(p.stream.name == name for p in self._publishers.values()) or any(
            s.stream.name == name for s in self._subscriptions.values()
        )
        for publisher_id in [k for k, p in self._publishers.items() if p.stream.name == name]:
            del self._publishers[publisher_id]
        for subscription_id in [k for k, s in self._subscriptions.items() if s.stream.name == name]:
            self._stop_waiting(self._subscriptions.pop(subscription_id))
        if used:
            self._send(sp.MetadataUpdate(code=6, stream=name))

    # --- in a fleet (`gateway.protocols.stream.relay`) -------------------------------------------

    def answer(self, event: sp.Event) -> None:
        """Send a relayed answer (or a refusal of the relay) to the client."""
        if not self._closing:
            self._send(event)

    def relaying(self, change: int) -> None:
        """Relayed messages awaiting their confirm: they count against ``max_unconfirmed``."""
        self._unconfirmed += change
        if change > 0:
            self.factory.traffic.messages_in += change
            if self._unconfirmed > self.factory.settings.max_unconfirmed:
                self._pause_reading()
        else:
            self._resume_reading()

    def owners_changed(self) -> None:
        """Streams may have moved: tell the client of those it uses that are owned elsewhere now."""
        relays = self._relays
        if relays is None or self._state != "open":
            return  # no fleet, or another node's relay (served here whoever owns the stream)
        used = {p.stream.name for p in self._publishers.values()}
        used.update(s.stream.name for s in self._subscriptions.values())
        for name in sorted(used):
            if relays.remote(name):
                self.stream_gone(name)
        relays.owners_changed()


def _CLOSING_OK(event: sp.Event) -> bool:  # noqa: N802
    return isinstance(event, sp.Heartbeat | sp.CloseResponse)


_HANDLERS: Final[dict[type, Callable[[StreamServerProtocol, Any], None]]] = {
    sp.PeerProperties: StreamServerProtocol._on_peer_properties,
    sp.SaslHandshake: StreamServerProtocol._on_sasl_handshake,
    sp.SaslAuthenticate: StreamServerProtocol._on_sasl_authenticate,
    sp.Tune: StreamServerProtocol._on_tune,
    sp.Open: StreamServerProtocol._on_open,
    sp.Heartbeat: StreamServerProtocol._on_heartbeat,
    sp.Close: StreamServerProtocol._on_close,
    sp.CloseResponse: StreamServerProtocol._on_close_response,
    sp.Create: StreamServerProtocol._on_create,
    sp.Delete: StreamServerProtocol._on_delete,
    sp.Metadata: StreamServerProtocol._on_metadata,
    sp.StreamStats: StreamServerProtocol._on_stream_stats,
    sp.ExchangeCommandVersions: StreamServerProtocol._on_exchange_command_versions,
    sp.DeclarePublisher: StreamServerProtocol._on_declare_publisher,
    sp.DeletePublisher: StreamServerProtocol._on_delete_publisher,
    sp.QueryPublisherSequence: StreamServerProtocol._on_query_publisher_sequence,
    sp.Publish: StreamServerProtocol._on_publish,
    sp.Subscribe: StreamServerProtocol._on_subscribe,
    sp.Credit: StreamServerProtocol._on_credit,
    sp.Unsubscribe: StreamServerProtocol._on_unsubscribe,
    sp.StoreOffset: StreamServerProtocol._on_store_offset,
    sp.QueryOffset: StreamServerProtocol._on_query_offset,
    sp.ResolveOffsetSpec: StreamServerProtocol._on_resolve_offset_spec,
    sp.Route: StreamServerProtocol._on_route,
    sp.Partitions: StreamServerProtocol._on_partitions,
    sp.CreateSuperStream: StreamServerProtocol._on_unsupported,
    sp.DeleteSuperStream: StreamServerProtocol._on_unsupported,
}


class StreamServerFactory(StreamListenerFactory):
    """Builds connections for one stream listener (`StreamListenerFactory`'s state)."""

    protocol = StreamServerProtocol
