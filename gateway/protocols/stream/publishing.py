"""Publishing to RabbitMQ streams: the stream upstream's publishers, jobs and confirms.

`Publishers` is the publishing half of `StreamUpstream` (DESIGN.md, "The
batch is the unit of work"). A batch delivered along a route is one
`Answers`; each of its messages becomes a `_Job` that knows its place in
it, queued on its stream's publisher and published at once (`pump`): as
few Publish frames as ``batch_size`` and frame_max allow, all in one write,
with at most ``max_unconfirmed`` awaiting confirmation and at most
``max_queue`` waiting. PublishConfirm accepts; PublishError codes map to
rejected (stream missing, access refused, precondition failed) or retry
later (the rest).

Each stream has a publisher with a stable reference; its publishing ids
come from QueryPublisherSequence at every (re)connection (`declare`):
messages sent but not confirmed when a connection ended are accepted if
the broker stored them (their id is not above the sequence) and published
again with the same ids otherwise, so that a reconnect never duplicates a
message.

A durable route's forwarder publishes through `Publishers.deliver_once`:
its messages go through a publisher of their own per stream, whose
reference names the route (``<upstream reference>.route.<route>``, so it
carries the node id too) and whose publishing ids are the route log's
offsets (plus one), so that the chunk a forwarder delivers again after a
gateway crash is confirmed by the broker without being stored twice. What
a consumer read goes under its reader's ids (`gateway.core.origins`), with
the reference ``<reader>.route.<route>``, the same on every node.

Such a *keyed* publisher takes the ids it is given. One below an id it
already sent in this process is sent again under its id (the broker
confirms it without storing it twice) when this process knows nothing
against it: it was confirmed, or never sent here. It goes through the
upstream's own publisher instead, which the broker would otherwise drop
as a duplicate, when its earlier copy is still on its way, or was given up
without a confirm (refused, cancelled, not sent: a *hole*, which later ids
may have passed): at least once, never lost.

Each message published counts one hop in its ``x-gateway-hops`` header
(`gateway.core.internal`): one that routes have written into streams
`MAX_HOPS` times already is rejected instead (routes loop, through the
broker), counted as the protocol error ``hop-limit`` and logged at most
once in a while.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from typing import Final

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import stream as sp
from gateway.codecs.stream import ENTRY_OVERHEAD_BYTES, PUBLISH_OVERHEAD_BYTES, REJECTING_CODES
from gateway.core.batch import Answers, all_same
from gateway.core.durable import producer_reference, reader_reference
from gateway.core.internal import HOP_LIMIT, HOPS_HEADER, MAX_HOPS, Tally, hop_limit_refusal, hops
from gateway.core.message import Message, Outcome
from gateway.protocols.stream.link import StreamConnection, StreamLink
from gateway.protocols.stream.mapping import EntryEncoder

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "MAX_PUBLISHER_ID",
    "PUBLISH_OVERHEAD_BYTES",
    "Publishers",
]

MAX_PUBLISHER_ID: Final = 255
"""Publisher ids are a uint8 on the wire."""
MAX_HOLES: Final = 65_536
"""Ids a keyed publisher remembers as given up without a confirm; past that it forgets
them and takes every id below its next one for such (at least once, as before it knew)."""

_ACCEPTED: Final = Outcome.accepted()


class _Job:
    """One message on its way to a stream: its entry, and where its outcome goes.

    No Deferred of its own: its outcome is ``answers.settle(index, ...)``,
    the batch it came in (`gateway.core.batch.Answers`).
    """

    __slots__ = ("answers", "entry", "index", "keyed", "publishing_id", "queued")

    def __init__(self, answers: Answers, index: int, entry: bytes) -> None:
        self.answers = answers
        self.index = index
        self.entry = entry
        self.publishing_id = 0
        """0 until first published; the same id ever after (deduplication)."""
        self.keyed: _Publisher | None = None
        """The keyed publisher whose id it has, if any: told when it is done."""
        self.queued = True
        """Waiting in its publisher's queue; False once sent, or when its batch was
        cancelled there (`pump` then drops it)."""


class _Publisher:
    """A declared publisher: one per stream and reference, declared on each connection."""

    __slots__ = (
        "floor",
        "holes",
        "id",
        "in_flight",
        "keyed",
        "next_id",
        "open",
        "queue",
        "ready",
        "reference",
        "stream",
    )

    def __init__(self, publisher_id: int, stream: str, reference: str, keyed: bool) -> None:
        self.id = publisher_id
        self.stream = stream
        self.reference = reference
        self.keyed = keyed
        """Its jobs come with their publishing ids (`Publishers.deliver_once`)."""
        self.ready = False
        self.next_id = 1
        """Keyed: above every id sent in this process. Else: the next id to give."""
        self.queue: deque[_Job] = deque()
        self.in_flight: dict[int, _Job] = {}
        self.open: dict[int, _Job] = {}
        """Keyed: the jobs queued or in flight, by id."""
        self.holes: set[int] = set()
        """Keyed: ids given up without a confirm (refused, cancelled, never sent)."""
        self.floor = 0
        """Keyed: every id below it counts as a hole (`MAX_HOLES` were passed)."""

    def closed(self, job: _Job, confirmed: bool) -> None:
        """A keyed job is done: a hole unless the broker confirmed it."""
        if self.open.get(job.publishing_id) is job:
            del self.open[job.publishing_id]
        if not confirmed:
            self.hole(job.publishing_id)

    def hole(self, publishing_id: int) -> None:
        """Remember ``publishing_id`` as given up without a confirm."""
        holes = self.holes
        if len(holes) >= MAX_HOLES:
            holes.clear()
            self.floor = self.next_id
        holes.add(publishing_id)

    def resend_keyed(self, publishing_id: int) -> bool:
        """Whether an id below `next_id` may go again under this reference (see the module)."""
        return (
            publishing_id >= self.floor
            and publishing_id not in self.holes
            and publishing_id not in self.open
        )


class Publishers:
    """The publishers of a stream upstream: one per stream, with their queues and confirms.

    Args:
        upstream: The upstream it publishes for (its name, settings,
            counters and ready connection).
    """

    _log = Logger()

    def __init__(self, upstream: StreamLink) -> None:
        self._upstream = upstream
        self.looped = Tally(upstream.clock)
        """Messages refused for their hop count (routes loop)."""
        self._name = upstream.name
        self._settings = upstream.settings
        self._traffic = upstream.traffic
        self._reference = upstream.reference
        self._publishers: dict[tuple[str, str], _Publisher] = {}
        self._publisher_ids: dict[int, _Publisher] = {}
        self.queued = 0
        """Messages waiting in the publishers' queues."""
        self.unconfirmed = 0
        """Messages published and awaiting their confirm or error."""
        self._entry = EntryEncoder().entry

    def streams(self) -> list[str]:
        """The stream of each publisher, in the order they were added."""
        return [stream for stream, _reference in self._publishers]

    async def declare_all(self, protocol: StreamConnection) -> None:
        """Declare every publisher on a new connection, one after the other."""
        for key in list(self._publishers):
            await self.declare(protocol, key)

    def connection_ended(self) -> None:
        """The connection ended: nothing is published until each is declared again."""
        for publisher in self._publishers.values():
            publisher.ready = False

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Queue a batch for its stream(s); fire with one outcome per message, in order.

        See `_publish`.
        """
        return self._publish(messages, self._reference, None)

    def deliver_once(
        self,
        messages: Sequence[Message],
        producer: str,
        ids: Sequence[int],
        reader: str | None = None,
    ) -> Deferred[list[Outcome]]:
        """Publish as `deliver` does, through the producer's publishers, with these ids.

        The reference is ``<upstream reference>.route.<producer>`` (it has the
        node id), or for what ``reader`` read ``<reader>.route.<producer>``.
        """
        reference = (
            producer_reference(self._reference, producer)
            if reader is None
            else reader_reference(reader, producer)
        )
        return self._publish(messages, reference, ids)

    def _publish(
        self, messages: Sequence[Message], reference: str, ids: Sequence[int] | None
    ) -> Deferred[list[Outcome]]:
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
        if self._upstream.connection is None:
            # Not connected: say so at once (a durable route's forwarder
            # retries with backoff; a direct route's sender learns "later").
            return all_same(count, Outcome.retry(f"upstream {self._name} is not connected"))
        jobs: list[_Job] = []
        answers = Answers(count, lambda _answers: self._forget(jobs))
        room = self._settings.max_queue - self.queued
        if room < count:
            full = Outcome.retry(
                f"upstream {self._name}: {max(self.queued, self._settings.max_queue)}"
                " messages queued already"
            )
            for index in range(max(room, 0), count):
                answers.settle(index, full)
            if ids is not None:  # never sent: later ids may pass them
                self._holes(messages, reference, ids, range(max(room, 0), count))
        fixed = self._settings.stream
        publishers = self._publishers
        plain = self._reference
        keyed = ids is not None
        stream: str | None = None
        publisher: _Publisher | None = None
        encode = self._entry
        add_job = jobs.append
        last_headers: object = None  # a run's messages share their headers, hence their hop
        hop = 0
        for index in range(min(max(room, 0), count)):
            message = messages[index]
            address = fixed or message.address
            headers = message.headers
            if headers is not last_headers:
                last_headers = headers
                count_before = headers.get(HOPS_HEADER)
                hop = 1 if count_before is None else hops(count_before) + 1
            if hop > MAX_HOPS:
                self._looped(address)
                answers.settle(index, hop_limit_refusal(f"upstream {self._name}", address))
                if ids is not None:
                    self._holes(messages, reference, ids, (index,))
                continue
            if address != stream:
                stream = address
                publisher = publishers.get((address, reference)) or self._add(
                    address, reference, keyed
                )
            if publisher is None:
                answers.settle(index, Outcome.rejected(f"upstream {self._name}: too many streams"))
                continue
            job = _Job(answers, index, encode(message, hop))
            add_job(job)
            if ids is None:
                publisher.queue.append(job)
                continue
            publishing_id = ids[index]
            if publishing_id >= publisher.next_id or publisher.resend_keyed(publishing_id):
                job.publishing_id = publishing_id
                job.keyed = publisher
                if publishing_id >= publisher.next_id:
                    publisher.next_id = publishing_id + 1
                publisher.open[publishing_id] = job
                publisher.queue.append(job)
                continue
            # Sent before by this process and given up, while a later id may
            # have been stored, or on its way still: the broker would take
            # this id for a duplicate.
            again = publishers.get((address, plain)) or self._add(address, plain, False)
            if again is None:
                answers.settle(index, Outcome.rejected(f"upstream {self._name}: too many streams"))
                jobs.pop()
                continue
            again.queue.append(job)
        self.queued += len(jobs)
        if jobs:
            self.pump()
        return answers.deferred

    def _holes(
        self,
        messages: Sequence[Message],
        reference: str,
        ids: Sequence[int],
        indices: Sequence[int],
    ) -> None:
        """Remember keyed messages answered without being sent as holes of their publisher."""
        fixed = self._settings.stream
        for index in indices:
            address = fixed or messages[index].address
            publisher = self._publishers.get((address, reference)) or self._add(
                address, reference, True
            )
            if publisher is not None:
                publisher.hole(ids[index])

    def _add(self, stream: str, reference: str, keyed: bool) -> _Publisher | None:
        """A publisher for a new stream or reference, declared on the open connection.

        None past 256 publishers.
        """
        # The smallest id not in use: a publisher dropped after a refusal
        # frees its id, and an id must never name two streams at once.
        used = self._publisher_ids
        free = next(i for i in range(len(used) + 1) if i not in used)
        if free > MAX_PUBLISHER_ID:
            return None
        key = (stream, reference)
        publisher = self._publishers[key] = used[free] = _Publisher(free, stream, reference, keyed)
        connection = self._upstream.connection
        if connection is not None:
            Deferred.fromCoroutine(self.declare(connection, key)).addErrback(
                self._declare_failed, connection
            )
        return publisher

    def _declare_failed(self, failure: Failure, connection: StreamConnection) -> None:
        connection.close(f"declaring a publisher failed: {failure.getErrorMessage()}")

    async def declare(self, protocol: StreamConnection, key: tuple[str, str]) -> None:
        """Declare a publisher and learn where its publishing ids go on."""
        publisher = self._publishers[key]
        stream, reference = key
        publisher.ready = False
        if self._settings.create_streams:
            await protocol.request(sp.Create, stream=stream, arguments={})  # 5: it exists
        if self._settings.stream is None:
            # A stream named by an address, not checked when connecting:
            # RabbitMQ 3.10 crashes the connection that declares a publisher
            # on a stream without a leader (an election under way).
            code = await self._leader_code(protocol, stream)
            if code != sp.ResponseCode.OK:
                self._fail_queue(
                    publisher,
                    code,
                    f"{self._name}: stream {stream} has no leader now (code {code})"
                    if code == sp.ResponseCode.STREAM_NOT_AVAILABLE
                    else f"{self._name}: stream {stream} cannot be published to (code {code})",
                )
                return
        declared = await protocol.request(
            sp.DeclarePublisher, publisher_id=publisher.id, reference=reference, stream=stream
        )
        if declared.code != 1:
            self._fail_queue(publisher, declared.code)
            return
        answer = await protocol.request(
            sp.QueryPublisherSequence, reference=reference, stream=stream
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
                if job.keyed is not None:
                    job.keyed.closed(job, True)
            elif job.answers.outcomes[job.index] is None:
                job.queued = True
                again.append(job)
            elif job.keyed is not None:
                job.keyed.closed(job, False)  # cancelled: not sent again
        if not publisher.keyed:
            # A keyed publisher's ids are its producer's: those up to the
            # sequence are the broker's to deduplicate, not to skip here.
            publisher.next_id = max(sequence, *in_flight, 0) + 1
        in_flight.clear()
        self.unconfirmed = sum(len(p.in_flight) for p in self._publishers.values())
        publisher.queue.extendleft(reversed(again))
        self.queued += len(again)
        publisher.ready = True
        self.pump()

    @staticmethod
    async def _leader_code(protocol: StreamConnection, stream: str) -> int:
        """OK if Metadata names a leader for the stream; else the code that says why not."""
        metadata = await protocol.request(sp.Metadata, streams=(stream,))
        brokers = {broker.reference for broker in metadata.brokers}
        for entry in metadata.streams:
            if entry.stream == stream:
                if entry.code == sp.ResponseCode.OK and entry.leader not in brokers:
                    return int(sp.ResponseCode.STREAM_NOT_AVAILABLE)
                return int(entry.code)
        return int(sp.ResponseCode.STREAM_NOT_AVAILABLE)

    def _fail_queue(self, publisher: _Publisher, code: int, reason: str | None = None) -> None:
        """Answer what waits for a publisher that could not be declared; forget it."""
        if reason is None:
            reason = f"{self._name} refused a publisher on {publisher.stream} (code {code})"
        outcome = Outcome.rejected(reason) if code in REJECTING_CODES else Outcome.retry(reason)
        # Gone before anyone is answered: an answer may lead to a delivery to
        # the same stream at once, which then declares a publisher afresh.
        del self._publishers[publisher.stream, publisher.reference]
        del self._publisher_ids[publisher.id]
        queued = [job for job in publisher.queue if job.queued]  # else cancelled, forgotten
        publisher.queue.clear()
        in_flight = list(publisher.in_flight.values())
        publisher.in_flight.clear()
        self.queued -= len(queued)
        self.unconfirmed -= len(in_flight)
        for job in queued:
            job.queued = False
        for job in (*in_flight, *queued):
            job.answers.settle(job.index, outcome)

    def pump(self) -> None:
        """Publish queued messages in batches while confirmations allow; one write for all."""
        connection = self._upstream.connection
        if connection is None or connection.closing:
            return
        settings = self._settings
        frame_max = connection.frame_max
        budget = frame_max - PUBLISH_OVERHEAD_BYTES if frame_max else sys.maxsize
        frames: list[sp.Event] = []
        too_large: list[_Job] = []
        unconfirmed = self.unconfirmed
        taken = 0
        for publisher in self._publishers.values():
            queue = publisher.queue
            in_flight = publisher.in_flight
            while publisher.ready and queue and unconfirmed < settings.max_unconfirmed:
                # Within batch_size and within what max_unconfirmed still allows.
                room = min(settings.batch_size, settings.max_unconfirmed - unconfirmed)
                ids: list[int] = []
                entries: list[bytes] = []
                add_id, add_entry, take = ids.append, entries.append, queue.popleft
                size = 0
                next_id = publisher.next_id
                while queue and room:
                    job = queue[0]
                    if not job.queued:  # its batch was cancelled while it waited
                        take()
                        continue
                    entry = job.entry
                    cost = ENTRY_OVERHEAD_BYTES + len(entry)
                    if size + cost > budget:
                        if ids:
                            break  # the next frame
                        # It would never fit: sent alone, its frame would make
                        # the server close the connection, again and again.
                        take()
                        job.queued = False
                        taken += 1
                        too_large.append(job)
                        continue
                    take()
                    job.queued = False
                    publishing_id = job.publishing_id
                    if not publishing_id:
                        publishing_id = job.publishing_id = next_id
                        next_id += 1
                    in_flight[publishing_id] = job
                    add_id(publishing_id)
                    add_entry(entry)
                    size += cost
                    room -= 1
                publisher.next_id = next_id
                if not ids:
                    break
                taken += len(ids)
                unconfirmed += len(ids)
                frames.append(
                    sp.Publish(publisher_id=publisher.id, publishing_ids=ids, messages=entries)
                )
        self.queued -= taken
        if frames:
            sent = unconfirmed - self.unconfirmed
            self.unconfirmed = unconfirmed
            self._traffic.messages_out += sent
            connection.send_all(frames)
        # Answered last: an answer may reach a sender that delivers again at
        # once, and that pump must find this one's counts and frames done.
        for job in too_large:
            if job.keyed is not None:
                job.keyed.closed(job, False)
            job.answers.settle(
                job.index,
                Outcome.rejected(
                    f"upstream {self._name}: a message of {len(job.entry)} bytes"
                    f" does not fit in a frame of {frame_max} bytes"
                ),
            )

    def confirmed(self, event: sp.PublishConfirm) -> None:
        """Accept the confirmed messages: each run of one batch's messages at once."""
        publisher = self._publisher_ids.get(event.publisher_id)
        if publisher is None:
            return
        take = publisher.in_flight.pop
        keyed = publisher.keyed
        answers: Answers | None = None
        indices: list[int] = []
        for publishing_id in event.publishing_ids:
            job = take(publishing_id, None)
            if job is None:
                continue
            if keyed and job.keyed is not None:
                job.keyed.closed(job, True)
            if job.answers is not answers:
                if answers is not None:
                    self._accept(answers, indices)
                answers = job.answers
                indices = []
            indices.append(job.index)
        if answers is not None:
            self._accept(answers, indices)
        self.pump()

    def _accept(self, answers: Answers, indices: list[int]) -> None:
        """Confirmed messages of one batch: no longer unconfirmed, accepted."""
        self.unconfirmed -= len(indices)
        answers.settle_all(indices, _ACCEPTED)

    def failed(self, event: sp.PublishError) -> None:
        """Map PublishError codes to outcomes."""
        publisher = self._publisher_ids.get(event.publisher_id)
        if publisher is None:
            return
        take = publisher.in_flight.pop
        for publishing_id, code in zip(event.publishing_ids, event.codes, strict=True):
            job = take(publishing_id, None)
            if job is None:
                continue
            self.unconfirmed -= 1
            if job.keyed is not None:
                job.keyed.closed(job, False)
            reason = f"{self._name} refused the message on {publisher.stream} (code {code})"
            job.answers.settle(
                job.index,
                Outcome.rejected(reason, code=str(code))
                if code in REJECTING_CODES
                else Outcome.retry(reason, code=str(code)),
            )
        self.pump()

    def _looped(self, stream: str) -> None:
        """Count a message refused for its hop count; log such refusals once in a while."""
        self._upstream.count_error(HOP_LIMIT)
        due = self.looped.add()
        if due:
            self._log.warn(
                "upstream {upstream}: refused {count} message(s) bound for {stream} that"
                " routes had written into streams {hops} times already ({header}): routes loop",
                upstream=self._name,
                count=due,
                stream=stream,
                hops=MAX_HOPS,
                header=HOPS_HEADER,
            )

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
                if job.keyed is not None:
                    job.keyed.closed(job, False)
        self.queued -= dropped
