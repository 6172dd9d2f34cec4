"""The RabbitMQ Stream client role: the gateway publishing to and consuming from RabbitMQ.

`StreamUpstream` keeps one connection to a stream node (RabbitMQ 3.10+ with
the stream plugin, or another gateway's stream listener): peer properties,
SASL PLAIN, tune, open, then Metadata for the streams it uses. When the
leader that Metadata names is another host or port than the one it is
connected to, it reconnects there (through ``relocate``: the service keeps
the locator's TLS settings). It reconnects with backoff when a connection
ends.

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
with a stable reference; publishing ids come from QueryPublisherSequence at
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
import sys
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import attrs
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway import __version__
from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.auth import Secrets
from gateway.core.batch import Answers, all_same
from gateway.core.inbox import Inbox
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import Result, Router, Unrouted
from gateway.metrics import GatewayMetrics, TrafficCounters
from gateway.protocols.stream.mapping import entry_from_message, message_from_entry
from gateway.protocols.stream.settings import StreamUpstreamSettings
from gateway.protocols.tcp import UpstreamFactory, disable_nagle

__all__ = ["StreamClientProtocol", "StreamUpstream", "parse_offset"]

RECONNECT_INITIAL_DELAY_SECONDS: Final = 0.5
RECONNECT_MAX_DELAY_SECONDS: Final = 30.0
REQUEST_TIMEOUT_SECONDS: Final = 30.0
PUBLISH_OVERHEAD_BYTES: Final = 13
"""Size, key, version, publisher id and count of a Publish frame."""
ENTRY_OVERHEAD_BYTES: Final = 12
"""Publishing id and length of each message in a Publish frame."""
MAX_PUBLISHER_ID: Final = 255
"""Publisher ids are a uint8 on the wire."""

_ACCEPTED: Final = Outcome.accepted()

_REJECTING_CODES: Final = frozenset({2, 16, 17})
"""PublishError codes that no retry will fix: stream missing, access refused,
precondition failed. Everything else (not available, internal error,
publisher unknown after a broker restart...) is worth retrying."""


def parse_offset(text: str) -> sp.OffsetSpec:
    """Parse ``first``, ``last``, ``next``, ``offset:N`` or ``timestamp:MS``.

    Raises:
        ValueError: Anything else.
    """
    kind, _, value = text.partition(":")
    simple = {"first": sp.OffsetKind.FIRST, "last": sp.OffsetKind.LAST, "next": sp.OffsetKind.NEXT}
    if kind in simple and not value:
        return sp.OffsetSpec(kind=simple[kind])
    if kind in ("offset", "timestamp") and value.lstrip("-").isdigit():
        number = int(value)
        if kind == "offset" and number >= 0:
            return sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=number)
        if kind == "timestamp":
            return sp.OffsetSpec(kind=sp.OffsetKind.TIMESTAMP, value=number)
    raise ValueError(f"{text!r} is not first, last, next, offset:N or timestamp:MILLISECONDS")


def _smaller(theirs: int, ours: int) -> int:
    """The smaller of two tuned values where 0 means none (the other applies)."""
    return min(theirs, ours) if theirs and ours else theirs or ours


class _Job:
    """One message on its way to a stream: its entry, and where its outcome goes.

    No Deferred of its own: its outcome is ``answers.settle(index, ...)``,
    the batch it came in (`gateway.core.batch.Answers`).
    """

    __slots__ = ("answers", "entry", "index", "publishing_id", "queued")

    def __init__(self, answers: Answers, index: int, entry: bytes) -> None:
        self.answers = answers
        self.index = index
        self.entry = entry
        self.publishing_id = 0
        """0 until first published; the same id ever after (deduplication)."""
        self.queued = True
        """Waiting in its publisher's queue; False once sent, or when its batch was
        cancelled there (`pump` then drops it)."""


class _Publisher:
    """A declared publisher: one per stream per connection."""

    __slots__ = ("id", "in_flight", "next_id", "queue", "ready", "stream")

    def __init__(self, publisher_id: int, stream: str) -> None:
        self.id = publisher_id
        self.stream = stream
        self.ready = False
        self.next_id = 1
        self.queue: deque[_Job] = deque()
        self.in_flight: dict[int, _Job] = {}


class _Subscription:
    """One consumed stream."""

    __slots__ = ("after", "chunks", "id", "last_stored", "settled", "stream")

    def __init__(self, subscription_id: int, stream: str) -> None:
        self.id = subscription_id
        self.stream = stream
        self.after = -1
        """Offsets up to this one were dispatched already (whole chunks come again)."""
        self.settled = -1
        """Offsets up to this one have outcomes: the offset that may be stored."""
        self.last_stored = -1
        self.chunks: deque[list[int]] = deque()
        """Dispatched chunks in order, as [last offset, 1 once settled else 0]."""

    def settle(self, chunk: list[int]) -> None:
        """Mark a chunk settled; move `settled` past the settled chunks at the front."""
        chunk[1] = 1
        while self.chunks and self.chunks[0][1]:
            self.settled = max(self.settled, self.chunks.popleft()[0])


class StreamClientProtocol(Protocol):
    """One connection to a stream node."""

    _log = Logger()

    def __init__(self, upstream: StreamUpstream) -> None:
        self.upstream = upstream
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._correlation = itertools.count(1)
        self._waiting: dict[int, Deferred[Any]] = {}
        self._tune: Deferred[sp.Tune] = Deferred()
        self.frame_max = upstream.settings.frame_max
        self.heartbeat = 0
        self._closing = False
        self._heard = True
        self._silent = 0
        self._timers: list[IDelayedCall] = []

    # --- connection life ------------------------------------------------------

    def connectionMade(self) -> None:
        """Start the handshake."""
        disable_nagle(self.transport)
        Deferred.fromCoroutine(self.upstream.handshake(self)).addErrback(self._handshake_failed)

    def _handshake_failed(self, failure: Failure) -> None:
        if not self._closing:
            self.close(f"handshake failed: {failure.getErrorMessage()}")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Fail what waits for an answer; tell the upstream."""
        self._closing = True
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
        self.upstream.connection_lost(self, reason)

    def close(self, why: str) -> None:
        """Close the connection, saying why in the log."""
        if self._closing:
            return
        self._closing = True
        self._log.warn("upstream {upstream}: closing: {why}", upstream=self.upstream.name, why=why)
        assert self.transport is not None
        self.transport.loseConnection()

    @property
    def closing(self) -> bool:
        """Whether the connection is on its way out."""
        return self._closing

    # --- output ---------------------------------------------------------------

    def send(self, event: sp.Event) -> None:
        """Send one frame."""
        data = self._codec.send(event)
        assert self.transport is not None
        self.transport.write(data)
        self.upstream.traffic.bytes_out += len(data)

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
        self._heard = True
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
        upstream = self.upstream
        for event in events:
            if isinstance(event, sp.Deliver):
                upstream.delivered(self, event)
            elif isinstance(event, sp.PublishConfirm):
                upstream.confirmed(event)
            elif isinstance(event, sp.PublishError):
                upstream.publish_failed(event)
            elif isinstance(event, sp.Tune):
                if not self._tune.called:
                    self._tune.callback(event)
            elif isinstance(event, sp.Heartbeat | sp.CreditResponse):
                if isinstance(event, sp.CreditResponse):
                    upstream.count_error("credit-refused")
            elif isinstance(event, sp.MetadataUpdate):
                upstream.forget_member()
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
        """Send heartbeats every ``seconds`` and close after two silent periods."""
        self.heartbeat = seconds
        if seconds:
            self._timers.append(self.upstream.clock.callLater(seconds, self._beat))

    def _beat(self) -> None:
        if self._closing:
            return
        self.send(sp.Heartbeat())
        if self._heard:
            self._silent = 0
        else:
            self._silent += 1
            if self._silent >= 2:
                self.close(f"no frame from the server for {2 * self.heartbeat} s")
                return
        self._heard = False
        self._timers = [t for t in self._timers if t.active()]
        self._timers.append(self.upstream.clock.callLater(self.heartbeat, self._beat))


@implementer(IDestination)
class StreamUpstream:
    """A RabbitMQ stream node the gateway publishes to and consumes from.

    With ``consume_from = "replica"`` and streams to subscribe to, the
    subscriptions live on a second, consumer-only `StreamUpstream` (`consumer`),
    named ``<name>.consumer`` in metrics and in its connection name, which
    reads from a replica; it logs in with this upstream's secret and
    dispatches under this upstream's name, so routes see one source.

    Args:
        name: The upstream's config name.
        settings: Its validated settings.
        endpoint: The locator endpoint (from the config's endpoint string).
        router: Where consumed messages go.
        secrets: The password.
        clock: Timers and reconnect delays.
        reactor: For connecting to a leader elsewhere (a HostnameEndpoint).
        metrics: Counters, or None.
        relocate: The endpoint of another node (host, port) that Metadata
            names; plain TCP by default (the service passes one that keeps
            the locator's TLS settings).
        source: For a consumer link: the upstream it reads for (its route
            source, secret and default names); None for a configured upstream.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        name: str,
        settings: StreamUpstreamSettings,
        endpoint: IStreamClientEndpoint,
        router: Router,
        secrets: Secrets,
        clock: IReactorTime,
        reactor: Any,
        metrics: GatewayMetrics | None = None,
        relocate: Callable[[str, int], IStreamClientEndpoint] | None = None,
        source: str | None = None,
    ) -> None:
        self.name = name
        self.source = source or name
        """The name routes see as the source of consumed messages."""
        self.settings = settings
        self.router = router
        self.secrets = secrets
        self._relocate = relocate or (
            lambda host, port: HostnameEndpoint(reactor, host.encode(), port)
        )
        self.clock = clock
        self._reactor = reactor
        self._locator = endpoint
        self._endpoint = endpoint
        self._metrics = metrics
        self.traffic = metrics.traffic(name) if metrics is not None else TrafficCounters()
        self.reference = settings.publisher_reference or f"msggateway.{self.source}"
        self.consumer_name = settings.consumer_name or f"msggateway.{self.source}"
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
                clock=clock,
                reactor=reactor,
                metrics=metrics,
                relocate=relocate,
                source=name,
            )
        self._subscribing = settings.subscribe if self.consumer is None else ()
        self._connection: StreamClientProtocol | None = None
        self._publishers: dict[str, _Publisher] = {}
        self._publisher_ids: dict[int, _Publisher] = {}
        self._subscriptions: dict[int, _Subscription] = {}
        self._unconfirmed = 0
        self._queued = 0
        self._running = False
        self._attempt = 0
        self._connect_call: IDelayedCall | None = None
        self._store_call: IDelayedCall | None = None
        self._connecting: Deferred[Any] | None = None
        self._stopped: Deferred[None] | None = None
        self._live: set[StreamClientProtocol] = set()
        if metrics is not None:
            metrics.upstream_up.labels(name).set(0)

    @property
    def connected(self) -> bool:
        """Whether the upstream is connected and open (its consumer link too, if any)."""
        return self._connection is not None and (self.consumer is None or self.consumer.connected)

    # --- service life ---------------------------------------------------------

    def start(self) -> None:
        """Connect (and keep reconnecting)."""
        self._running = True
        self._connect()
        if self.consumer is not None:
            self.consumer.start()

    def stop(self) -> Deferred[None]:
        """Store consumed offsets, close, and stop reconnecting."""
        own = self._stop_own()
        if self.consumer is None:
            return own
        both: Deferred[Any] = DeferredList([own, self.consumer.stop()])
        return both.addCallback(lambda _: None)

    def _stop_own(self) -> Deferred[None]:
        self._running = False
        for call in (self._connect_call, self._store_call):
            if call is not None and call.active():
                call.cancel()
        if self._connecting is not None and not self._connecting.called:
            self._connecting.cancel()
        for other in list(self._live):
            if other is not self._connection:
                other.close("the gateway is stopping")  # still in its handshake
        connection = self._connection
        if connection is None:
            return succeed(None)
        self._store_offsets()
        self._stopped = Deferred()
        connection.close("the gateway is stopping")
        return self._stopped

    def _connect(self) -> None:
        self._connect_call = None
        if not self._running:
            return
        self._connecting = self._endpoint.connect(UpstreamFactory(StreamClientProtocol, self))
        self._connecting.addErrback(self._connect_failed)

    def _connect_failed(self, failure: Failure) -> None:
        self._connecting = None
        self._endpoint = self._locator  # a leader that is gone: ask the locator again
        if self._running:
            self._log.info(
                "upstream {upstream}: cannot connect: {reason}",
                upstream=self.name,
                reason=failure.getErrorMessage(),
            )
            self._retry_later()

    def forget_member(self) -> None:
        """Connect through the locator next time: the leader or replica may have moved."""
        self._endpoint = self._locator

    def _retry_later(self) -> None:
        self._attempt += 1
        delay = min(
            RECONNECT_INITIAL_DELAY_SECONDS * 2 ** (self._attempt - 1), RECONNECT_MAX_DELAY_SECONDS
        )
        if self._connect_call is None or not self._connect_call.active():
            self._connect_call = self.clock.callLater(delay, self._connect)

    # --- handshake ------------------------------------------------------------

    async def handshake(self, protocol: StreamClientProtocol) -> None:
        """Peer properties, SASL PLAIN, tune, open; then publishers and subscriptions."""
        settings = self.settings
        self._live.add(protocol)
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
        if not self._running:
            protocol.close("the gateway is stopping")
            return
        self._connection = protocol
        self._attempt = 0
        self._log.info("upstream {upstream}: connected", upstream=self.name)
        if self._metrics is not None:
            self._metrics.upstream_up.labels(self.name).set(1)
        for stream in list(self._publishers):
            await self._declare(protocol, stream)
        await self._subscribe_all(protocol)
        self._schedule_store()
        self.pump()

    def _streams_used(self) -> list[str]:
        # The stream published to first: it decides where the connection goes.
        streams = list(self._subscribing)
        if self._publishing and self.settings.stream is not None:
            streams.insert(0, self.settings.stream)
        return list(dict.fromkeys(streams))

    async def _at_leader(self, protocol: StreamClientProtocol) -> bool:
        """Create streams if configured; move to the member it should use if elsewhere.

        That is the leader, or for a consumer link a replica (the leader when
        the stream has none, as on a single node). The first stream that
        Metadata reports well decides (the one published to, if any); once
        moved it stays where it went until a MetadataUpdate.
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
            if here not in {(m.host, m.port) for m in members} and self._endpoint is self._locator:
                target = members[0]
                self._log.info(
                    "upstream {upstream}: the {role} of {stream} is {host}:{port}; moving there",
                    upstream=self.name,
                    role=role,
                    stream=entry.stream,
                    host=target.host,
                    port=target.port,
                )
                self._endpoint = self._relocate(target.host, target.port)
                protocol.close(f"moving to a stream {role}")
                self._attempt = 0
                return False
            break
        return True

    # --- publishing -----------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Queue a batch for its stream(s); fire with one outcome per message, in order.

        The batch is one `Answers`; each message becomes a job that knows its
        place in it. The jobs are published at once (`pump`): a batch for one
        stream goes out in as few Publish frames as ``batch_size``,
        ``max_unconfirmed`` and frame_max allow, in one write. Not
        connected: every message is answered "retry later" at once; past
        ``max_queue`` the messages that do not fit are (as one at a time
        would have been). Cancelling the batch (the route's deadline)
        answers what is known and `UNANSWERED` for the rest (`_forget`).
        """
        count = len(messages)
        if self._connection is None:
            # Not connected: say so at once (a durable route's forwarder
            # retries with backoff; a direct route's sender learns "later").
            return all_same(count, Outcome.retry(f"upstream {self.name} is not connected"))
        jobs: list[_Job] = []
        answers = Answers(count, lambda _answers: self._forget(jobs))
        room = self.settings.max_queue - self._queued
        if room < count:
            full = Outcome.retry(
                f"upstream {self.name}: {max(self._queued, self.settings.max_queue)}"
                " messages queued already"
            )
            for index in range(max(room, 0), count):
                answers.settle(index, full)
        fixed = self.settings.stream
        publishers = self._publishers
        stream: str | None = None
        publisher: _Publisher | None = None
        for index in range(min(max(room, 0), count)):
            message = messages[index]
            address = fixed or message.address
            if address != stream:
                stream = address
                publisher = publishers.get(address) or self._add_publisher(address)
            if publisher is None:
                answers.settle(index, Outcome.rejected(f"upstream {self.name}: too many streams"))
                continue
            job = _Job(answers, index, entry_from_message(message))
            jobs.append(job)
            publisher.queue.append(job)
        self._queued += len(jobs)
        if jobs:
            self.pump()
        return answers.deferred

    def _add_publisher(self, stream: str) -> _Publisher | None:
        """A publisher for a new stream, declared on the open connection; None past 256."""
        # The smallest id not in use: a publisher dropped after a refusal
        # frees its id, and an id must never name two streams at once.
        used = self._publisher_ids
        free = next(i for i in range(len(used) + 1) if i not in used)
        if free > MAX_PUBLISHER_ID:
            return None
        publisher = self._publishers[stream] = used[free] = _Publisher(free, stream)
        connection = self._connection
        if connection is not None:
            Deferred.fromCoroutine(self._declare(connection, stream)).addErrback(
                self._declare_failed, connection
            )
        return publisher

    def _declare_failed(self, failure: Failure, connection: StreamClientProtocol) -> None:
        connection.close(f"declaring a publisher failed: {failure.getErrorMessage()}")

    async def _declare(self, protocol: StreamClientProtocol, stream: str) -> None:
        """Declare the stream's publisher and learn where its publishing ids go on."""
        publisher = self._publishers[stream]
        publisher.ready = False
        if self.settings.create_streams:
            await protocol.request(sp.Create, stream=stream, arguments={})  # 5: it exists
        declared = await protocol.request(
            sp.DeclarePublisher, publisher_id=publisher.id, reference=self.reference, stream=stream
        )
        if declared.code != 1:
            self._fail_queue(publisher, declared.code)
            return
        answer = await protocol.request(
            sp.QueryPublisherSequence, reference=self.reference, stream=stream
        )
        sequence = answer.sequence if answer.code == 1 else 0
        # Sent before the connection ended: stored if not above the sequence;
        # else sent again, first and with the same ids (the broker
        # deduplicates). A message whose batch was cancelled meanwhile has
        # its answer already: it is not sent again, but its id stays used.
        in_flight = publisher.in_flight
        again: list[_Job] = []
        for publishing_id in sorted(in_flight):
            job = in_flight[publishing_id]
            if publishing_id <= sequence:
                job.answers.settle(job.index, _ACCEPTED)
            elif job.answers.outcomes[job.index] is None:
                job.queued = True
                again.append(job)
        publisher.next_id = max(sequence, *in_flight, 0) + 1
        in_flight.clear()
        self._unconfirmed = sum(len(p.in_flight) for p in self._publishers.values())
        publisher.queue.extendleft(reversed(again))
        self._queued += len(again)
        publisher.ready = True
        self.pump()

    def _fail_queue(self, publisher: _Publisher, code: int) -> None:
        outcome = (
            Outcome.rejected(f"{self.name} refused a publisher on {publisher.stream} (code {code})")
            if code in _REJECTING_CODES
            else Outcome.retry(
                f"{self.name} refused a publisher on {publisher.stream} (code {code})"
            )
        )
        # Gone before anyone is answered: an answer may lead to a delivery to
        # the same stream at once, which then declares a publisher afresh.
        del self._publishers[publisher.stream]
        del self._publisher_ids[publisher.id]
        queued = [job for job in publisher.queue if job.queued]  # else cancelled, forgotten
        publisher.queue.clear()
        in_flight = list(publisher.in_flight.values())
        publisher.in_flight.clear()
        self._queued -= len(queued)
        self._unconfirmed -= len(in_flight)
        for job in queued:
            job.queued = False
        for job in (*in_flight, *queued):
            job.answers.settle(job.index, outcome)

    def pump(self) -> None:
        """Publish queued messages in batches while confirmations allow; one write for all."""
        connection = self._connection
        if connection is None or connection.closing:
            return
        settings = self.settings
        frame_max = connection.frame_max
        budget = frame_max - PUBLISH_OVERHEAD_BYTES if frame_max else sys.maxsize
        frames: list[sp.Event] = []
        too_large: list[_Job] = []
        unconfirmed = self._unconfirmed
        taken = 0
        for publisher in self._publishers.values():
            queue = publisher.queue
            in_flight = publisher.in_flight
            while publisher.ready and queue and unconfirmed < settings.max_unconfirmed:
                # Within batch_size and within what max_unconfirmed still allows.
                room = min(settings.batch_size, settings.max_unconfirmed - unconfirmed)
                ids: list[int] = []
                entries: list[bytes] = []
                size = 0
                while queue and len(ids) < room:
                    job = queue[0]
                    if not job.queued:  # its batch was cancelled while it waited
                        queue.popleft()
                        continue
                    entry = job.entry
                    cost = ENTRY_OVERHEAD_BYTES + len(entry)
                    if size + cost > budget:
                        if ids:
                            break  # the next frame
                        # It would never fit: sent alone, its frame would make
                        # the server close the connection, again and again.
                        queue.popleft()
                        job.queued = False
                        taken += 1
                        too_large.append(job)
                        continue
                    queue.popleft()
                    job.queued = False
                    publishing_id = job.publishing_id
                    if not publishing_id:
                        publishing_id = job.publishing_id = publisher.next_id
                        publisher.next_id = publishing_id + 1
                    in_flight[publishing_id] = job
                    ids.append(publishing_id)
                    entries.append(entry)
                    size += cost
                if not ids:
                    break
                taken += len(ids)
                unconfirmed += len(ids)
                frames.append(
                    sp.Publish(publisher_id=publisher.id, publishing_ids=ids, messages=entries)
                )
        self._queued -= taken
        if frames:
            sent = unconfirmed - self._unconfirmed
            self._unconfirmed = unconfirmed
            self.traffic.messages_out += sent
            connection.send_all(frames)
        # Answered last: an answer may reach a sender that delivers again at
        # once, and that pump must find this one's counts and frames done.
        for job in too_large:
            job.answers.settle(
                job.index,
                Outcome.rejected(
                    f"upstream {self.name}: a message of {len(job.entry)} bytes"
                    f" does not fit in a frame of {frame_max} bytes"
                ),
            )

    def confirmed(self, event: sp.PublishConfirm) -> None:
        """Accept the confirmed messages."""
        publisher = self._publisher_ids.get(event.publisher_id)
        if publisher is None:
            return
        take = publisher.in_flight.pop
        for publishing_id in event.publishing_ids:
            job = take(publishing_id, None)
            if job is not None:
                self._unconfirmed -= 1
                job.answers.settle(job.index, _ACCEPTED)
        self.pump()

    def publish_failed(self, event: sp.PublishError) -> None:
        """Map PublishError codes to outcomes."""
        publisher = self._publisher_ids.get(event.publisher_id)
        if publisher is None:
            return
        take = publisher.in_flight.pop
        for publishing_id, code in zip(event.publishing_ids, event.codes, strict=True):
            job = take(publishing_id, None)
            if job is None:
                continue
            self._unconfirmed -= 1
            reason = f"{self.name} refused the message on {publisher.stream} (code {code})"
            job.answers.settle(
                job.index,
                Outcome.rejected(reason, code=str(code))
                if code in _REJECTING_CODES
                else Outcome.retry(reason, code=str(code)),
            )
        self.pump()

    def _forget(self, jobs: list[_Job]) -> None:
        """The router gave up on a batch (its deadline): forget its open messages.

        Still queued: never sent (`pump` drops them). Sent: each keeps its id
        and its place under ``max_unconfirmed`` until the broker answers
        (which is then ignored) or, after a reconnect, is not sent again.
        """
        dropped = 0
        for job in jobs:
            if job.queued:
                job.queued = False
                dropped += 1
        self._queued -= dropped

    # --- consuming ------------------------------------------------------------

    async def _subscribe_all(self, protocol: StreamClientProtocol) -> None:
        # What the last connection settled but had not stored yet: resuming
        # from the stored offset alone would route those messages twice.
        settled = {sub.stream: sub.settled for sub in self._subscriptions.values()}
        self._subscriptions.clear()
        for index, stream in enumerate(self._subscribing):
            stored = await protocol.request(
                sp.QueryOffset, reference=self.consumer_name, stream=stream
            )
            subscription = _Subscription(index, stream)
            stored_offset = stored.offset if stored.code == 1 else -1
            resume = max(stored_offset, settled.get(stream, -1))
            if resume >= 0:
                spec = sp.OffsetSpec(kind=sp.OffsetKind.OFFSET, value=resume + 1)
                subscription.after = resume
                subscription.settled = resume
                subscription.last_stored = stored_offset
            else:
                spec = parse_offset(self.settings.offset)
                if spec.kind is sp.OffsetKind.OFFSET and spec.value is not None:
                    subscription.after = spec.value - 1
            answer = await protocol.request(
                sp.Subscribe,
                subscription_id=index,
                stream=stream,
                offset_spec=spec,
                credit=self.settings.credit,
                properties={"name": self.consumer_name},
            )
            if answer.code == 1:
                self._subscriptions[index] = subscription
            else:
                self._log.warn(
                    "upstream {upstream}: cannot subscribe to {stream} (code {code})",
                    upstream=self.name,
                    stream=stream,
                    code=answer.code,
                )

    def delivered(self, protocol: StreamClientProtocol, event: sp.Deliver) -> None:
        """Route a chunk's messages; grant credit once they all have outcomes."""
        subscription = self._subscriptions.get(event.subscription_id)
        if subscription is None:
            return
        chunk = bytes(event.chunk)
        try:
            header = osiris.ChunkHeader.unpack(chunk)
            data = chunk[osiris.HEADER_BYTES :]
            if len(data) != header.data_length or zlib.crc32(data) != header.crc:
                raise osiris.OsirisError("chunk length or CRC does not match", kind="bad-crc")
        except osiris.OsirisError as exc:
            self.count_error(exc.kind)
            protocol.close(f"bad chunk from the server: {exc.reason}")
            return
        entries: list[bytes | memoryview] = []
        try:
            entries.extend(osiris.iter_entries(data))
        except osiris.OsirisError as exc:
            # Intact as sent (the CRC matched) but not readable here, such as
            # a sub-batch compressed with snappy, lz4 or zstd by its
            # publisher: reading it again would not help, so skip the rest.
            self.count_error(exc.kind)
            self._log.error(
                "upstream {upstream}: skipping the rest of chunk {chunk_id} of {stream}"
                " after {read} readable records: {reason}",
                upstream=self.name,
                chunk_id=header.first_offset,
                stream=subscription.stream,
                read=len(entries),
                reason=exc.reason,
            )
        timestamp = header.timestamp / 1000
        last = header.first_offset + header.num_records - 1
        first_new = subscription.after + 1 - header.first_offset
        subscription.after = max(subscription.after, last)
        chunk_state = [last, 0]
        subscription.chunks.append(chunk_state)
        self.traffic.messages_in += len(entries)
        stream = subscription.stream
        left = 0
        dispatched = False

        def answer(message: Message, result: Result) -> None:
            nonlocal left
            if isinstance(result, Unrouted):
                self.count_error("unrouted")
            elif not result.is_accepted:
                self._log.warn(
                    "upstream {upstream}: message {id} from {stream} not delivered: {reason}",
                    upstream=self.name,
                    id=message.id,
                    stream=stream,
                    reason=result.reason,
                )
            left -= 1
            if not left and dispatched:
                self._chunk_settled(protocol, subscription, chunk_state)

        # The chunk is one batch: the router has it all at once, and the
        # chunk is settled (credit, then its offset may be stored) once every
        # message has its result, whatever the result.
        inbox: Inbox[Message] = Inbox(self.router, self.source, answer)
        for index in range(max(first_new, 0), len(entries)):
            message = message_from_entry(
                entries[index],
                stream=stream,
                timestamp=timestamp,
                offset=header.first_offset + index,
            )
            inbox.add(message, message)
        left = len(inbox)
        inbox.dispatch()
        dispatched = True
        if not left:
            self._chunk_settled(protocol, subscription, chunk_state)

    def _chunk_settled(
        self, protocol: StreamClientProtocol, subscription: _Subscription, chunk: list[int]
    ) -> None:
        subscription.settle(chunk)
        self._credit(protocol, subscription)

    def _credit(self, protocol: StreamClientProtocol, subscription: _Subscription) -> None:
        if protocol is self._connection and not protocol.closing:
            protocol.send(sp.Credit(subscription_id=subscription.id, credit=1))

    def _schedule_store(self) -> None:
        if self._store_call is None or not self._store_call.active():
            self._store_call = self.clock.callLater(
                self.settings.store_offset_interval_seconds, self._store_tick
            )

    def _store_tick(self) -> None:
        self._store_call = None
        self._store_offsets()
        if self._running and self._subscriptions:
            self._schedule_store()

    def _store_offsets(self) -> None:
        connection = self._connection
        if connection is None or connection.closing:
            return
        for subscription in self._subscriptions.values():
            # Only offsets whose messages all have outcomes: a restart must not
            # skip messages that were dispatched but never delivered.
            if subscription.settled > subscription.last_stored:
                connection.send(
                    sp.StoreOffset(
                        reference=self.consumer_name,
                        stream=subscription.stream,
                        offset=subscription.settled,
                    )
                )
                subscription.last_stored = subscription.settled

    # --- connection state -----------------------------------------------------

    def connection_lost(self, protocol: StreamClientProtocol, reason: Failure) -> None:
        """Reconnect with backoff; sent messages stay in flight until the next sequence query."""
        self._live.discard(protocol)
        if self._connection is protocol:
            self._connection = None
            self._log.info(
                "upstream {upstream}: connection lost: {reason}",
                upstream=self.name,
                reason=reason.getErrorMessage(),
            )
            if self._metrics is not None:
                self._metrics.upstream_up.labels(self.name).set(0)
        for publisher in self._publishers.values():
            publisher.ready = False
        if self._running:
            self._retry_later()
        elif self._stopped is not None and not self._stopped.called:
            self._stopped.callback(None)

    def count_error(self, kind: str) -> None:
        """Count a protocol error."""
        if self._metrics is not None:
            self._metrics.protocol_errors.labels(self.name, kind).inc()
