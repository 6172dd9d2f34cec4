"""Routes into and out of the local streams of a stream listener.

Into: `StreamDestination` is a stream listener's route destination. The
destination address is a stream name; the message is stored as an AMQP 1.0
message (`gateway.protocols.stream.mapping`), so stream clients read body
and headers natively, and the outcome is accepted once the log committed it.
A stream that does not exist yet is created. A durable route's forwarder
appends with the route's publisher reference and each message's log offset
as publishing id, so what it delivers again after a crash is stored once.
In a fleet with ``[fleet] relay_secret``, a stream another node owns is
appended at that node, over a relay (`gateway.protocols.stream.routed`),
so that its consumers there see what every node's routes deliver; without
the secret, and for the streams this node owns, the local log takes it.

Two things are never written (`gateway.core.internal`): a message bound for
one of the gateway's own streams (``msggateway.*``: a route's own stream,
the outcome records, the dead letters) is rejected, and so is one that
routes have already written into streams `MAX_HOPS` times (a loop: each
write here counts one hop in its ``x-gateway-hops`` header). Both
rejections are final: a durable route's forwarder dead-letters them at
once. They are counted, and logged at most once in a while.

Out of: `StreamRouteFeeds` runs one `LogForwarder` per local stream that a
route from the listener takes, so that what clients publish is routed on
(to SSMP, QMQP...) after it is committed, at least once, from a stored
offset, surviving restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.core.batch import UNANSWERED, Answers, all_same
from gateway.core.durable import producer_reference
from gateway.core.forwarder import LogForwarder
from gateway.core.interfaces import IDeduplicatingDestination
from gateway.core.internal import (
    DEAD_LETTER_STREAM,
    FEED_REFERENCE_PREFIX,
    GATEWAY_REFERENCE,
    HOP_LIMIT,
    HOPS_HEADER,
    INTERNAL_STREAM,
    MAX_HOPS,
    Tally,
    hop_limit_refusal,
    hops,
    internal_refusal,
    is_internal,
)
from gateway.core.log import LogError, LogFullError, LogStore, StreamLog
from gateway.core.message import Message, Outcome
from gateway.core.router import Router, Unrouted
from gateway.protocols.stream.mapping import EntryEncoder, entry_from_message, message_from_entry
from gateway.protocols.stream.routed import OwnerAppends

__all__ = ["StreamDestination", "StreamRouteFeeds", "dead_letter_writer", "decode_entry"]


def decode_entry(stream: str) -> Callable[[bytes, int, float], Message]:
    """A forwarder's entry decoder for messages published to ``stream``."""

    def decode(entry: bytes, offset: int, timestamp: float) -> Message:
        return message_from_entry(entry, stream=stream, timestamp=timestamp, offset=offset)

    return decode


def dead_letter_writer(
    store: LogStore, name: str, route: str
) -> Callable[[Message, Outcome], Deferred[object]]:
    """Write messages that keep being rejected to the dead-letter stream ``name``."""

    def write(message: Message, outcome: Outcome) -> Deferred[object]:
        stream = store.get(name) or store.create(name)
        headers = dict(message.headers)
        headers["x-gateway-dead-letter-route"] = route
        headers["x-gateway-dead-letter-reason"] = outcome.reason
        stored = Message(
            body=message.body,
            address=message.address,
            id=message.id,
            sender=message.sender,
            recipients=message.recipients,
            headers=headers,
            timestamp=message.timestamp,
        )
        appended: Deferred[object] = stream.append([entry_from_message(stored)])  # type: ignore[assignment]
        return appended

    return write


@implementer(IDeduplicatingDestination)
class StreamDestination:
    """Deliver routed messages into local streams (accepted once committed).

    Never into the gateway's own streams, and never a message that has been
    written into streams `MAX_HOPS` times (see the module docstring).

    Args:
        name: The stream listener's name.
        store: The embedded log.
        clock: Spaces out the log lines of refusals (the store's if None).
        count_error: Counts each refusal by kind (``internal-stream``,
            ``hop-limit``), as the listener counts its protocol errors,
            if given.
    """

    _log = Logger()
    fleet_wide = False
    """These streams are this process's own log: no other node appends to them."""

    def __init__(
        self,
        name: str,
        store: LogStore,
        clock: IReactorTime | None = None,
        count_error: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self._store = store
        self.count_error = count_error
        """Counts refusals by kind (set after construction by the assembly, if at all)."""
        clock = store.clock if clock is None else clock
        self.refused: dict[str, Tally] = {INTERNAL_STREAM: Tally(clock), HOP_LIMIT: Tally(clock)}
        """The refusals by kind: how many, and how many not logged yet."""
        self.fleet: OwnerAppends | None = None
        """In a fleet: appends at the owners of streams other nodes own (`join_fleet`)."""
        self._told_local = False

    def join_fleet(self, appends: OwnerAppends) -> None:
        """Append at each stream's owner, when it is another node (and the relay secret is set)."""
        self.fleet = appends

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Append the batch to the streams named by its addresses: one append per stream."""
        return self._deliver(messages, None, None)

    def deliver_once(
        self,
        messages: Sequence[Message],
        producer: str,
        ids: Sequence[int],
        reader: str | None = None,
    ) -> Deferred[list[Outcome]]:
        """Append as `deliver` does, deduplicated by ``ids`` under the producer's reference.

        The reference is the same in every stream (each stream keeps its own
        last id for it), so a message whose id a stream has already stored
        is accepted and not stored again. It carries no node id, unlike the
        stream upstream's: these streams are in this process's own log (its
        data dir), which no other process appends to; another gateway
        reaches them through a stream upstream, under references of its own.
        At another node that owns the stream, this node's id is added to it
        (`gateway.protocols.stream.routed.node_reference`). What a consumer
        read (``reader``) goes under ``msggateway.route.<producer>@<reader>``,
        its ids being the reader's offsets plus one (`gateway.core.origins`).
        """
        name = producer if reader is None else f"{producer}@{reader}"
        return self._deliver(messages, producer_reference(GATEWAY_REFERENCE, name), ids)

    def _deliver(
        self, messages: Sequence[Message], reference: str | None, ids: Sequence[int] | None
    ) -> Deferred[list[Outcome]]:
        by_stream: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_stream.setdefault(message.address, []).append(index)
        if len(by_stream) == 1:
            [(name, _)] = by_stream.items()
            return self._append(name, messages, reference, ids)
        answers = Answers(len(messages))
        for name, indices in by_stream.items():
            self._append(
                name,
                [messages[index] for index in indices],
                reference,
                None if ids is None else [ids[index] for index in indices],
            ).addCallback(self._settle, answers, indices)
        return answers.deferred

    @staticmethod
    def _settle(outcomes: list[Outcome], answers: Answers, indices: list[int]) -> None:
        for index, outcome in zip(indices, outcomes, strict=True):
            answers.settle(index, outcome)

    def _append(
        self,
        name: str,
        messages: Sequence[Message],
        reference: str | None,
        ids: Sequence[int] | None,
    ) -> Deferred[list[Outcome]]:
        """Append one stream's messages, each counting a hop; refuse what must not go there."""
        count = len(messages)
        if is_internal(name):  # once per stream of the batch
            self._refuse(INTERNAL_STREAM, count, name)
            return all_same(count, internal_refusal(f"stream listener {self.name}", name))
        entries: list[bytes] = []
        looped: list[int] | None = None
        encode = EntryEncoder().entry  # a batch's messages share most of their entries
        for index, message in enumerate(messages):
            count_before = message.headers.get(HOPS_HEADER)
            hop = 1 if count_before is None else hops(count_before) + 1
            if hop > MAX_HOPS:
                if looped is None:
                    looped = []
                looped.append(index)
                continue
            entries.append(encode(message, hop))
        if looped is not None:
            return self._append_some(name, messages, reference, ids, entries, looped)
        return self._append_entries(name, entries, reference, ids)

    def _append_some(
        self,
        name: str,
        messages: Sequence[Message],
        reference: str | None,
        ids: Sequence[int] | None,
        entries: list[bytes],
        looped: list[int],
    ) -> Deferred[list[Outcome]]:
        """Append ``entries``, the messages not in ``looped``; those are refused."""
        self._refuse(HOP_LIMIT, len(looped), name)
        refusal = hop_limit_refusal(f"stream listener {self.name}", name)
        outcomes: list[Outcome | None] = [None] * len(messages)
        for index in looped:
            outcomes[index] = refusal
        kept = [index for index, outcome in enumerate(outcomes) if outcome is None]
        if not kept:
            return succeed(outcomes)  # type: ignore[arg-type]  # every one was refused
        kept_ids = None if ids is None else [ids[index] for index in kept]

        def merge(appended: list[Outcome]) -> list[Outcome]:
            for index, outcome in zip(kept, appended, strict=True):
                outcomes[index] = outcome
            return outcomes  # type: ignore[return-value]  # every one has its outcome

        return self._append_entries(name, entries, reference, kept_ids).addCallback(merge)

    def _refuse(self, kind: str, count: int, name: str) -> None:
        """Count refusals of one kind; log them at most once in a while."""
        if self.count_error is not None:
            for _ in range(count):
                self.count_error(kind)
        due = self.refused[kind].add(count)
        if not due:
            return
        if kind == INTERNAL_STREAM:
            self._log.warn(
                "{listener}: refused {count} message(s) a route would write into the"
                " gateway's own stream {stream} (names starting with msggateway. are"
                " internal); check the route's address",
                listener=self.name,
                count=due,
                stream=name,
            )
        else:
            self._log.warn(
                "{listener}: refused {count} message(s) bound for {stream} that routes had"
                " written into streams {hops} times already ({header}): routes loop",
                listener=self.name,
                count=due,
                stream=name,
                hops=MAX_HOPS,
                header=HOPS_HEADER,
            )

    def _append_entries(
        self,
        name: str,
        entries: list[bytes],
        reference: str | None,
        ids: Sequence[int] | None,
    ) -> Deferred[list[Outcome]]:
        count = len(entries)
        fleet = self.fleet
        if fleet is not None and not fleet.available():
            self._appending_locally(fleet, name)
        elif fleet is not None:
            owner = fleet.owner(name)
            if owner is None:
                return all_same(
                    count,
                    Outcome.retry(
                        f"stream listener {self.name}: stream {name!r} has no owner now"
                        " (the node it is pinned to is down)"
                    ),
                )
            if owner != fleet.node:
                return fleet.append(owner, name, entries, reference, ids)
        stream = self._store.get(name)
        if stream is None:
            try:
                stream = self._store.create(name)
            except (LogError, ValueError) as exc:
                return all_same(count, Outcome.rejected(f"cannot create stream {name!r}: {exc}"))
            self._log.info(
                "{listener}: created stream {stream} for a route", listener=self.name, stream=name
            )
        try:
            appended = stream.append(entries, reference=reference, publishing_ids=ids)
        except (LogError, ValueError) as exc:
            return all_same(count, Outcome.rejected(f"stream {name!r}: {exc}"))
        return appended.addCallbacks(
            lambda _: [Outcome.accepted()] * count, self._failed, errbackArgs=(count,)
        )

    def _appending_locally(self, fleet: OwnerAppends, name: str) -> None:
        """Say once that routes append here what another node owns (no relay secret)."""
        if self._told_local:
            return
        owner = fleet.owner(name)
        if owner == fleet.node:
            return
        self._told_local = True
        self._log.warn(
            "{listener}: routes append to stream {stream}, owned by node {owner}, in this"
            " node's own log: relaying them to the owner needs [fleet] relay_secret in the"
            " secrets file (docs/fleet.rst); said once",
            listener=self.name,
            stream=name,
            owner=owner or "none now",
        )

    def _failed(self, failure: Failure, count: int) -> list[Outcome]:
        if failure.check(CancelledError):
            # The route's deadline came first: the router words the answer
            # (the append itself goes on; it cannot be taken back).
            return [UNANSWERED] * count
        if failure.check(LogFullError):
            # The stream has logged the file and the free space: no path to senders.
            reason = (
                f"stream listener {self.name}: the log's file system is full;"
                " writing resumes by itself once there is room"
            )
            return [Outcome.retry(reason)] * count
        if not failure.check(LogError):
            self._log.failure("{listener}: append failed", failure, listener=self.name)
        return [Outcome.retry(f"stream listener {self.name}: {failure.getErrorMessage()}")] * count


class StreamRouteFeeds:
    """Route what is published to a listener's streams, from the log.

    One forwarder per stream that a route from the listener takes (checked
    at start, when streams are created, and on reload), each with its own
    stored offset.

    Args:
        listener: The stream listener's name (the routes' source).
        store: The embedded log.
        router: Where messages go.
        clock: For retries.
        dead_letter: The dead-letter stream name.
    """

    _log = Logger()

    def __init__(
        self,
        listener: str,
        store: LogStore,
        router: Router,
        clock: IReactorTime,
        dead_letter: str = DEAD_LETTER_STREAM,
    ) -> None:
        self.listener = listener
        self._store = store
        self._router = router
        self._clock = clock
        self._dead_letter = dead_letter
        self.forwarders: dict[str, LogForwarder] = {}
        self._running = False

    def _routed(self, stream: str) -> bool:
        return bool(self._router.table.match(self.listener, stream))

    def _deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        return self._router.dispatch(self.listener, messages).addCallback(_no_longer_routed)

    def refresh(self) -> None:
        """Start forwarders for routed streams, stop those no route takes (after a reload)."""
        if not self._running:
            return
        for name in self._store.names():
            stream = self._store.get(name)
            if stream is None or is_internal(name):
                continue  # the gateway's own streams are not routed from here
            if self._routed(name) and name not in self.forwarders:
                self._start(stream)
        for name in list(self.forwarders):
            if not self._routed(name) or self._store.get(name) is None:
                self.forwarders.pop(name).stop()

    def _start(self, stream: StreamLog) -> None:
        forwarder = LogForwarder(
            reference=FEED_REFERENCE_PREFIX + self.listener,
            stream=stream,
            deliver=self._deliver,
            to_message=decode_entry(stream.name),
            dead_letter=dead_letter_writer(self._store, self._dead_letter, self.listener),
            clock=self._clock,
        )
        self.forwarders[stream.name] = forwarder
        forwarder.start()

    def stream_created(self, name: str) -> None:
        """A client created a stream: route it if a route takes it."""
        self.refresh()

    def start(self) -> None:
        """Start forwarding."""
        self._running = True
        self.refresh()

    def stop(self) -> None:
        """Stop forwarding; stored offsets let the next start resume."""
        self._running = False
        for forwarder in self.forwarders.values():
            forwarder.stop()
        self.forwarders.clear()


def _no_longer_routed(results: list[Outcome | Unrouted]) -> list[Outcome]:
    """A stream's message that no route takes any more is refused (dead-lettered in the end)."""
    return [
        Outcome.rejected(f"no route for {', '.join(result.addresses)} any more")
        if isinstance(result, Unrouted)
        else result
        for result in results
    ]
