"""The RabbitMQ Stream client role: the gateway publishing to and consuming from RabbitMQ.

`StreamUpstream` keeps one connection to a stream node (RabbitMQ 3.10+ with
the stream plugin, or another gateway's stream listener): peer properties,
SASL PLAIN, tune, open, then Metadata for the streams it uses. Its
connecting, reconnecting with back-off and stopping are the upstream
role's (`gateway.protocols.upstream.Upstream`, a Twisted `ClientService`);
the back-off waits 0.5 s, doubling up to 30 s, counted since the last
connection that was open. When the leader that Metadata names is another
host or port than the one it is connected to, it relocates: the service's
endpoint is set to that member (through ``relocate``: the service keeps
the locator's TLS settings) and the connection is closed, so that the
service connects there next; an attempt there that fails, or a
MetadataUpdate, sends the next one back to the locator (the configured
endpoint). While the stream has no leader (one is being elected after
its node went away) the connection is not made ready: it is closed, and
the next attempt, after the back-off, asks the locator again. Stopping
stores the consumed offsets, then closes.

The module holds the upstream and its connection (`StreamClientProtocol`:
frames, requests, heartbeats); publishing (`gateway.protocols.stream.publishing`)
and consuming (`gateway.protocols.stream.consuming`) are parts in modules of
their own, which see the upstream only as a `gateway.protocols.stream.link`.

Publishing: it is the route destination, and takes a batch (DESIGN.md,
"The batch is the unit of work"). While it is not connected it answers
"retry later" at once. Messages are encoded as AMQP 1.0
(`gateway.protocols.stream.mapping`), queued per stream and published at
once: a batch goes out in as few Publish frames as ``batch_size`` and
frame_max allow, all in one write, with at most ``max_unconfirmed``
awaiting confirmation (the rest wait in the queue, up to ``max_queue``).
A batch's outcomes are one `Answers`: each queued message knows its place
in it, and confirms and errors settle messages one by one; when the
route's deadline cancels the batch, its messages still queued are never
sent. Each stream has a publisher
with a stable reference, ``publisher_reference`` (by default
``msggateway.<upstream>``) followed by this process's node id
(`gateway.fleet.node`): two gateways publishing to one stream must not
share a reference, or RabbitMQ drops one's messages as duplicates of the
other's. Its publishing ids come from QueryPublisherSequence at
every (re)connection: messages that were sent but not confirmed when a
connection ended are confirmed if the broker stored them (their id is not
above the sequence) and published again with the same ids otherwise, so a
reconnect never duplicates a message. PublishConfirm is accepted;
PublishError codes map to rejected (stream missing, access refused,
precondition failed) or retry later (the rest).

Consuming: each stream of ``subscribe`` is read under credit from the
offset stored under ``consumer_name`` (or the configured offset the first
time; after a reconnect, from past what was already settled if that is
further); each chunk's messages go along the routes from this upstream as
one batch, credit is granted once they all have outcomes, and the last
offset whose messages all have outcomes is stored every
``store_offset_interval_seconds`` and at stop.

In a fleet (``lock``), the subscriptions run only while this node holds
the upstream's lock (`gateway.fleet.locks`): every node connects and
publishes, one consumes. Losing the lock stops the consuming at once
(`Subscriptions.forbid`); the node that takes over reads on from the
offsets stored under ``consumer_name``, which has no node id in it.
Stopping stores the offsets, closes, and only then releases the lock.

With ``consume_from = "replica"`` the subscriptions are read over a
connection of their own, by a consumer-only `StreamUpstream` inside this
one (``<upstream>.consumer`` in metrics and in its connection name), which
moves to a replica that Metadata names for its first stream (to the leader
when the stream has none, as on a single node); it stores offsets there
(RabbitMQ accepts StoreOffset on any member) and routes see its messages
as coming from this upstream. Publishing stays on the leader connection.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway import __version__
from gateway.codecs import stream as sp
from gateway.core.auth import Secrets
from gateway.core.interfaces import IDeduplicatingDestination, IFleetLock
from gateway.core.message import Message, Outcome
from gateway.core.router import Router
from gateway.fleet.node import node_reference
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.consuming import Subscriptions, parse_offset
from gateway.protocols.stream.publishing import (
    ENTRY_OVERHEAD_BYTES,
    PUBLISH_OVERHEAD_BYTES,
    Publishers,
)
from gateway.protocols.stream.settings import StreamUpstreamSettings
from gateway.protocols.upstream import (
    RECONNECT_INITIAL_DELAY_SECONDS,
    RECONNECT_MAX_DELAY_SECONDS,
    Upstream,
    UpstreamConnection,
)

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "PUBLISH_OVERHEAD_BYTES",
    "REQUEST_TIMEOUT_SECONDS",
    "StreamClientProtocol",
    "StreamUpstream",
    "parse_offset",
]


REQUEST_TIMEOUT_SECONDS: Final = 30.0
"""How long a request waits for its response before the connection is given up."""


class StreamClientProtocol(UpstreamConnection["StreamUpstream"]):
    """One connection to a stream node."""

    def __init__(self, upstream: StreamUpstream) -> None:
        super().__init__(upstream)
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._correlation = itertools.count(1)
        self._waiting: dict[int, Deferred[Any]] = {}
        self._tune: Deferred[sp.Tune] = Deferred()
        self.frame_max = upstream.settings.frame_max
        self.heartbeat = 0
        self._heard_at = upstream.clock.seconds()
        """When the last read from the server arrived (noted per read, not per frame)."""
        self._timers: list[IDelayedCall] = []
        # Looked up once: the frames of the hot path go straight there.
        self._delivered = upstream.subscriptions.delivered
        self._confirmed = upstream.publishers.confirmed
        self._publish_failed = upstream.publishers.failed

    # --- connection life ------------------------------------------------------

    def connection_started(self) -> None:
        """Start the handshake."""
        Deferred.fromCoroutine(self.upstream.handshake(self)).addErrback(self._handshake_failed)

    def _handshake_failed(self, failure: Failure) -> None:
        if not self._closing:
            self.close(f"handshake failed: {failure.getErrorMessage()}")

    def connection_stopped(self) -> None:
        """Cancel the heartbeats; fail what waits for an answer."""
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        waiting, self._waiting = self._waiting, {}
        for d in waiting.values():
            d.errback(ConnectionError("connection lost"))
        if not self._tune.called:
            self._tune.errback(ConnectionError("connection lost"))
            # A handshake waiting for Tune has its failure by now; one that
            # ended before (a refused login) does not wait: nothing is left
            # to report as an unhandled error when the Deferred is collected.
            self._tune.addErrback(lambda _: None)

    # --- output ---------------------------------------------------------------

    def send(self, event: sp.Event) -> None:
        """Send one frame."""
        self.write(self._codec.send(event))

    def send_all(self, events: Sequence[sp.Event]) -> None:
        """Send frames in one write."""
        send = self._codec.send
        frames = [send(event) for event in events]
        assert self.transport is not None
        self.transport.writeSequence(frames)
        self.upstream.traffic.bytes_out += sum(map(len, frames))

    def request(self, request: Callable[..., sp.Event], **fields: Any) -> Deferred[Any]:
        """Send ``request(correlation_id=..., **fields)``; fire with its response."""
        correlation = next(self._correlation)
        answer: Deferred[Any] = Deferred()
        self._waiting[correlation] = answer
        self.send(request(correlation_id=correlation, **fields))
        answer.addTimeout(REQUEST_TIMEOUT_SECONDS, self.upstream.clock)
        return answer

    def tuned(self) -> Deferred[sp.Tune]:
        """Fire with the server's Tune."""
        return self._tune

    # --- input ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Dispatch responses and server frames."""
        if self._closing:
            return
        self._heard_at = self.upstream.clock.seconds()
        self.upstream.traffic.bytes_in += len(data)
        try:
            events = self._codec.receive_data(data)
        except sp.StreamError as exc:
            events = cast(list[sp.Event], exc.events)
            self._handle_all(events)
            self.upstream.count_error(exc.kind)
            self.close(f"bad frame from the server: {exc.reason}")
            return
        self._handle_all(events)

    def _handle_all(self, events: list[sp.Event]) -> None:
        for event in events:
            if isinstance(event, sp.Deliver):
                self._delivered(self, event)
            elif isinstance(event, sp.PublishConfirm):
                self._confirmed(event)
            elif isinstance(event, sp.PublishError):
                self._publish_failed(event)
            elif isinstance(event, sp.Tune):
                if not self._tune.called:
                    self._tune.callback(event)
            elif isinstance(event, sp.Heartbeat | sp.CreditResponse):
                if isinstance(event, sp.CreditResponse):
                    self.upstream.count_error("credit-refused")
            elif isinstance(event, sp.MetadataUpdate):
                self.upstream.forget_member()
                self.close(f"stream {event.stream} changed (code {event.code})")
            elif isinstance(event, sp.Close):
                self.send(sp.CloseResponse(correlation_id=event.correlation_id, code=1))
                self.close(f"the server closed the connection: {event.code} {event.reason}")
            else:
                correlation = getattr(event, "correlation_id", None)
                waiter = self._waiting.pop(correlation, None) if correlation is not None else None
                if waiter is not None:
                    waiter.callback(event)
            if self._closing:
                return

    # --- heartbeats -----------------------------------------------------------

    def start_heartbeats(self, seconds: int) -> None:
        """Send heartbeats every ``seconds``; close after two intervals without a frame."""
        self.heartbeat = seconds
        if seconds:
            self._later(seconds, self._beat)
            self._later(2 * seconds, self._check_silence)

    def _later(self, seconds: float, call: Callable[[], None]) -> None:
        timers = self._timers
        if len(timers) > 4:
            timers[:] = [timer for timer in timers if timer.active()]
        timers.append(self.upstream.clock.callLater(seconds, call))

    def _beat(self) -> None:
        if self._closing:
            return
        self.send(sp.Heartbeat())
        self._later(self.heartbeat, self._beat)

    def _check_silence(self) -> None:
        """Close the connection once the server has sent nothing for two intervals.

        The timer is armed for the deadline as it stood (last read plus two
        intervals); reads only note their time, so the timer may fire early:
        it is then armed again for exactly the time left.
        """
        if self._closing:
            return
        limit = 2 * self.heartbeat
        silent = self.upstream.clock.seconds() - self._heard_at
        if silent < limit:
            self._later(limit - silent, self._check_silence)
            return
        self.close(f"no frame from the server for {silent:g} s")


def _smaller(theirs: int, ours: int) -> int:
    """The smaller of two tuned values where 0 means none (the other applies)."""
    return min(theirs, ours) if theirs and ours else theirs or ours


def _retry_wait(failures: int) -> float:
    """The wait before the next attempt: 0.5 s after one failure, doubling up to 30 s."""
    # The exponent is capped: past it the maximum applies anyway, and a
    # float power of two overflows after about a thousand failures.
    wait: float = RECONNECT_INITIAL_DELAY_SECONDS * 2.0 ** min(failures - 1, 16)
    return min(wait, RECONNECT_MAX_DELAY_SECONDS)


@implementer(IDeduplicatingDestination)
class StreamUpstream(Upstream[StreamClientProtocol]):
    """A RabbitMQ stream node the gateway publishes to and consumes from.

    Its `publishers` publish what routes deliver to it; its `subscriptions`
    read the streams it consumes. With ``consume_from = "replica"`` and
    streams to subscribe to, the subscriptions live on a second,
    consumer-only `StreamUpstream` (`consumer`), named ``<name>.consumer``
    in metrics and in its connection name, which reads from a replica; it
    logs in with this upstream's secret and dispatches under this
    upstream's name, so routes see one source. Starting and stopping this
    upstream start and stop that one too.

    Args:
        name: The upstream's config name.
        settings: Its validated settings.
        endpoint: The locator endpoint (from the config's endpoint string).
        router: Where consumed messages go.
        secrets: The password.
        node: This process's node id, appended to its publisher references.
        clock: Timers and reconnect delays.
        reactor: For connecting to a leader elsewhere (a HostnameEndpoint).
        metrics: Counters, or None.
        relocate: The endpoint of another node (host, port) that Metadata
            names; plain TCP by default (the service passes one that keeps
            the locator's TLS settings).
        source: For a consumer link: the upstream it reads for (its route
            source, secret and default names); None for a configured upstream.
        lock: The fleet lock under which the subscriptions run (None: no
            fleet, they always run).
    """

    kind = "stream"
    fleet_wide = True
    """Other gateway processes publish into RabbitMQ's streams too."""

    def __init__(
        self,
        *,
        name: str,
        settings: StreamUpstreamSettings,
        endpoint: IStreamClientEndpoint,
        router: Router,
        secrets: Secrets,
        node: str,
        clock: IReactorTime,
        reactor: Any,
        metrics: GatewayMetrics | None = None,
        relocate: Callable[[str, int], IStreamClientEndpoint] | None = None,
        source: str | None = None,
        lock: IFleetLock | None = None,
    ) -> None:
        super().__init__(
            name=name,
            endpoint=endpoint,
            connection=StreamClientProtocol,
            clock=clock,
            metrics=metrics,
            retry_policy=_retry_wait,
        )
        self.source = source or name
        """The name routes see as the source of consumed messages."""
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self._relocate = relocate or (
            lambda host, port: HostnameEndpoint(reactor, host.encode(), port)
        )
        self.reference = node_reference(
            settings.publisher_reference or f"msggateway.{self.source}", node
        )
        """The publisher reference: this node's own, never shared with another process."""
        self.consumer_name = settings.consumer_name or f"msggateway.{self.source}"
        """Where consumed offsets are stored: no node id in it, so that whichever node
        consumes goes on from the offset stored last."""
        self._publishing = source is None
        self._prefer_replica = source is not None
        self.consumer: StreamUpstream | None = None
        """The consumer-only link reading from a replica, if configured."""
        if source is None and settings.consume_from == "replica" and settings.subscribe:
            self.consumer = StreamUpstream(
                name=f"{name}.consumer",
                settings=attrs.evolve(settings, stream=None),
                endpoint=endpoint,
                router=router,
                secrets=secrets,
                node=node,
                clock=clock,
                reactor=reactor,
                metrics=metrics,
                relocate=relocate,
                source=name,
            )
        self.publishers = Publishers(self)
        """What routes deliver here, on its way to the streams."""
        self.subscriptions = Subscriptions(
            self, settings.subscribe if self.consumer is None else ()
        )
        """The streams read here (none when the consumer link reads them)."""
        self._consume_lock = lock
        """The fleet lock the subscriptions run under (the connection is every node's)."""

    @property
    def connected(self) -> bool:
        """Whether the upstream is connected and open (its consumer link too, if any)."""
        return self._connection is not None and (self.consumer is None or self.consumer.connected)

    # --- service life ---------------------------------------------------------

    @property
    def reading(self) -> Subscriptions:
        """The subscriptions that consume: the consumer link's, or this upstream's."""
        return self.consumer.subscriptions if self.consumer is not None else self.subscriptions

    def start(self) -> None:
        """Connect (and keep reconnecting); the consumer link too; ask for the lock."""
        lock = self._consume_lock
        if lock is not None:
            self.reading.forbid()  # until this node holds the lock
        super().start()
        if self.consumer is not None:
            self.consumer.start()
        if lock is not None:
            lock.start(self.reading.allow, self.reading.forbid)

    def stop(self) -> Deferred[None]:
        """Store consumed offsets, close, and stop reconnecting; the consumer link too.

        The lock is released once both are closed: the stored offsets are
        then in, for the node that takes over.
        """
        self.subscriptions.stop()
        stopped = super().stop()
        if self.consumer is not None:
            both: Deferred[Any] = DeferredList([stopped, self.consumer.stop()])
            stopped = both.addCallback(lambda _: None)
        if self._consume_lock is not None:
            return self._consume_lock.stop(stopped)
        return stopped

    def forget_member(self) -> None:
        """Connect through the locator next time: the leader or replica may have moved."""
        self.endpoint.target = self.endpoint.home

    def connection_ended(self, connection: StreamClientProtocol) -> str:
        """Sent messages stay in flight until the next connection's sequence query."""
        self.publishers.connection_ended()
        return ""

    # --- handshake ------------------------------------------------------------

    async def handshake(self, protocol: StreamClientProtocol) -> None:
        """Peer properties, SASL PLAIN, tune, open; then publishers and subscriptions."""
        settings = self.settings
        await protocol.request(
            sp.PeerProperties,
            properties={
                "product": "msggateway",
                "version": __version__,
                "connection_name": self.name,
            },
        )
        mechanisms = await protocol.request(sp.SaslHandshake)
        if "PLAIN" not in mechanisms.mechanisms:
            raise ConnectionError(f"the server offers no PLAIN login ({mechanisms.mechanisms})")
        password = self.secrets.credential_for(self.source)
        if password is None and settings.username == "guest":
            password = b"guest"
        plain = b"\0" + settings.username.encode() + b"\0" + (password or b"")
        answer = await protocol.request(sp.SaslAuthenticate, mechanism="PLAIN", data=plain)
        if answer.code != 1:
            self.count_error("auth-refused")
            raise ConnectionError(f"login as {settings.username!r} refused (code {answer.code})")
        tune = await protocol.tuned()
        # 0 means "no limit" on either side: the other side's value applies.
        frame_max = _smaller(tune.frame_max, settings.frame_max)
        heartbeat = _smaller(tune.heartbeat, settings.heartbeat_seconds)
        protocol.send(sp.Tune(frame_max=frame_max, heartbeat=heartbeat))
        protocol.frame_max = frame_max  # 0: neither side set a limit
        protocol.start_heartbeats(heartbeat)
        opened = await protocol.request(sp.Open, virtual_host=settings.virtual_host)
        if opened.code != 1:
            raise ConnectionError(
                f"virtual host {settings.virtual_host!r} refused (code {opened.code})"
            )
        if not await self._at_leader(protocol):
            return
        if not self.running:
            protocol.close("the gateway is stopping")
            return
        self.connection_ready(protocol)
        await self.publishers.declare_all(protocol)
        await self.subscriptions.subscribe_all(protocol)
        self.subscriptions.schedule_store()
        self.publishers.pump()

    def _streams_used(self) -> list[str]:
        # The stream published to first: it decides where the connection goes.
        streams = list(self.subscriptions.streams)
        if self._publishing and self.settings.stream is not None:
            streams.insert(0, self.settings.stream)
        return list(dict.fromkeys(streams))

    async def _at_leader(self, protocol: StreamClientProtocol) -> bool:
        """Create streams if configured; move to the member it should use if elsewhere.

        That is the leader, or for a consumer link a replica (the leader when
        the stream has none, as on a single node). The first stream that
        Metadata reports well decides (the one published to, if any); once
        moved it stays where it went until a MetadataUpdate. If the stream
        that would decide has no leader yet, the connection is closed and
        the next attempt goes through the locator.
        """
        streams = self._streams_used()
        if self.settings.create_streams:
            for stream in streams:
                created = await protocol.request(sp.Create, stream=stream, arguments={})
                if created.code not in (1, 5):
                    self._log.warn(
                        "upstream {upstream}: cannot create stream {stream} (code {code})",
                        upstream=self.name,
                        stream=stream,
                        code=created.code,
                    )
        if not streams:
            return True
        metadata = await protocol.request(sp.Metadata, streams=tuple(streams))
        brokers = {broker.reference: broker for broker in metadata.brokers}
        for entry in metadata.streams:
            leader = brokers.get(entry.leader)
            if entry.code == sp.ResponseCode.STREAM_NOT_AVAILABLE or (
                entry.code == sp.ResponseCode.OK and leader is None
            ):
                # A leader is being elected (the old one's node went away).
                # Not ready here: RabbitMQ 3.10 crashes a connection that
                # declares a publisher now, and after a few such crashes stops
                # the node's whole stream listener. As rstream does, ask again
                # (through the locator) after the back-off.
                self.forget_member()
                protocol.close(f"stream {entry.stream} has no leader yet (code {entry.code})")
                return False
            if entry.code != 1 or leader is None:
                continue
            members = [leader]
            role = "leader"
            if self._prefer_replica:
                replicas = [brokers[r] for r in entry.replicas if r in brokers]
                if replicas:
                    members, role = replicas, "replica"
            peer = protocol.transport.getPeer() if protocol.transport is not None else None
            here = (getattr(peer, "host", None), getattr(peer, "port", None))
            if here not in {(m.host, m.port) for m in members} and not self.endpoint.moved:
                target = members[0]
                self._log.info(
                    "upstream {upstream}: the {role} of {stream} is {host}:{port}; moving there",
                    upstream=self.name,
                    role=role,
                    stream=entry.stream,
                    host=target.host,
                    port=target.port,
                )
                where = self._relocate(target.host, target.port)
                self.move_to(where, protocol, f"moving to a stream {role}")
                return False
            break
        return True

    # --- IDeduplicatingDestination ----------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Publish a batch (`Publishers.deliver`); fire with one outcome per message, in order."""
        return self.publishers.deliver(messages)

    def deliver_once(
        self,
        messages: Sequence[Message],
        producer: str,
        ids: Sequence[int],
        reader: str | None = None,
    ) -> Deferred[list[Outcome]]:
        """Publish a route's batch under a reference of its own (`Publishers.deliver_once`)."""
        return self.publishers.deliver_once(messages, producer, ids, reader)
