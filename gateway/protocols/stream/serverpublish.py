"""Publishers on the stream listener: declared, publishing, confirmed.

`ServerPublishers` is the part of `StreamServerProtocol` that declares and
deletes publishers (DeclarePublisher needs the right to publish to the
stream; the gateway's own streams and references are refused), answers
QueryPublisherSequence with the last id the log stored for a reference,
and appends each Publish to the log: PublishConfirm once the log committed
the chunk, PublishError otherwise. Messages awaiting their commit count
against the listener's ``max_unconfirmed``: past it the connection is not
read until the confirms catch up. Sub-batch entries are stored whole
(`_sub_batch_entries`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from twisted.python.failure import Failure

from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.core.authorization import Action
from gateway.core.log import LogError, StreamLog, StreamMissingError
from gateway.protocols.stream.serverbase import (
    ACCESS_REFUSED,
    MAX_REFERENCE_BYTES,
    OK,
    PRECONDITION_FAILED,
    PUBLISHER_DOES_NOT_EXIST,
    STREAM_DOES_NOT_EXIST,
    StreamServerBase,
)

__all__ = ["MAX_PUBLISHERS", "ServerPublishers"]

MAX_PUBLISHERS: Final = 256


class _Publisher:
    __slots__ = ("id", "reference", "stream")

    def __init__(self, publisher_id: int, stream: StreamLog, reference: str | None) -> None:
        self.id = publisher_id
        self.stream = stream
        self.reference = reference


class ServerPublishers(StreamServerBase):
    """DeclarePublisher, DeletePublisher, QueryPublisherSequence and Publish, confirmed."""

    _publishers: dict[int, _Publisher]

    # --- publishers ----------------------------------------------------------------------------

    def _on_declare_publisher(self, event: sp.DeclarePublisher) -> None:
        if not self._require_open(event):
            return
        reference = event.reference or None
        stream = self.factory.store.get(event.stream)
        taken = (
            event.publisher_id in self._publishers
            or (self._relays is not None and self._relays.has_publisher(event.publisher_id))
            or (
                reference is not None
                and any(
                    p.reference == reference and p.stream.name == event.stream
                    for p in self._publishers.values()
                )
            )
        )
        too_long = reference is not None and len(reference.encode()) > MAX_REFERENCE_BYTES
        code = OK
        if len(self._publishers) >= MAX_PUBLISHERS or too_long or taken:
            code = PRECONDITION_FAILED
        elif self._internal("publish to", event.stream, reference) or self._refused(
            Action.PUBLISH, event.stream
        ):
            code = ACCESS_REFUSED
        elif stream is None:
            code = STREAM_DOES_NOT_EXIST
        else:
            self._publishers[event.publisher_id] = _Publisher(event.publisher_id, stream, reference)
        self._send(
            sp.Response(
                key=sp.Key.DECLARE_PUBLISHER, correlation_id=event.correlation_id, code=code
            )
        )

    def _on_delete_publisher(self, event: sp.DeletePublisher) -> None:
        if not self._require_open(event):
            return
        code = (
            OK
            if self._publishers.pop(event.publisher_id, None) is not None
            else PUBLISHER_DOES_NOT_EXIST
        )
        self._send(
            sp.Response(key=sp.Key.DELETE_PUBLISHER, correlation_id=event.correlation_id, code=code)
        )

    def _on_query_publisher_sequence(self, event: sp.QueryPublisherSequence) -> None:
        if not self._require_open(event):
            return
        stream = self.factory.store.get(event.stream)
        refused = self._internal(
            "query the publisher sequence of", event.stream, event.reference
        ) or self._refused(Action.PUBLISH, event.stream)
        if stream is None or refused:
            self._send(
                sp.QueryPublisherSequenceResponse(
                    correlation_id=event.correlation_id,
                    code=ACCESS_REFUSED if refused else STREAM_DOES_NOT_EXIST,
                    sequence=0,
                )
            )
            return
        sequence = stream.writer_sequence(event.reference)
        self._send(
            sp.QueryPublisherSequenceResponse(
                correlation_id=event.correlation_id, code=OK, sequence=sequence
            )
        )

    def _on_publish(self, event: sp.Publish) -> None:
        if not self._require_open(event):
            return
        publisher = self._publishers.get(event.publisher_id)
        ids = event.publishing_ids
        if publisher is None:
            self._send(_publish_error(event.publisher_id, ids, PUBLISHER_DOES_NOT_EXIST))
            return
        messages: Sequence[bytes | memoryview] | Sequence[osiris.SubBatch | bytes | memoryview]
        messages = event.messages
        sub_batches = event.sub_batches is not None and any(event.sub_batches)
        if sub_batches:
            entries = _sub_batch_entries(event)
            if isinstance(entries, str):
                self.factory.count_error("sub-batch")
                self._log.warn(
                    "{listener}: refused a Publish: {reason}",
                    listener=self.factory.name,
                    reason=entries,
                )
                self._send(_publish_error(event.publisher_id, ids, PRECONDITION_FAILED))
                return
            messages = entries
        count = len(ids)
        self._unconfirmed += count
        self.factory.traffic.messages_in += count
        reference = publisher.reference
        appended = publisher.stream.append(
            messages,
            reference=reference,
            publishing_ids=ids if reference is not None else None,
            sub_batches=sub_batches,
        )
        appended.addCallbacks(
            self._confirmed,
            self._not_stored,
            callbackArgs=(event.publisher_id, ids),
            errbackArgs=(event.publisher_id, ids),
        )
        if self._unconfirmed > self.factory.settings.max_unconfirmed:
            self._pause_reading()

    def _confirmed(self, _result: object, publisher_id: int, ids: list[int]) -> None:
        self._unconfirmed -= len(ids)
        if self._closing:
            return
        self._send(sp.PublishConfirm(publisher_id=publisher_id, publishing_ids=ids))
        self._resume_reading()

    def _not_stored(self, failure: Failure, publisher_id: int, ids: list[int]) -> None:
        self._unconfirmed -= len(ids)
        code = STREAM_DOES_NOT_EXIST if failure.check(StreamMissingError) else 15
        if not failure.check(LogError):
            # The log says itself, once, why it refuses (a full file system,
            # a closed store); anything else is a fault of ours, with its traceback.
            self._log.failure("{listener}: append failed", failure, listener=self.factory.name)
        if self._closing:
            return
        self._send(_publish_error(publisher_id, ids, code))
        self._resume_reading()


_STORABLE_COMPRESSIONS: Final = {osiris.COMPRESSION_NONE: "none", osiris.COMPRESSION_GZIP: "gzip"}
"""Sub-batch compressions stored: the ones the gateway's own readers can open."""


def _sub_batch_entries(event: sp.Publish) -> list[osiris.SubBatch | bytes | memoryview] | str:
    """A Publish's entries with its sub-batches parsed, or why they cannot be stored.

    Sub-batches are stored whole, as osiris does, so consumers unpack them;
    but routes and durable forwarders read them here too, so only
    compressions this gateway can inflate are taken (none and gzip; rstream
    and the Java client offer snappy, lz4 and zstd as well).
    """
    if len(event.messages) > osiris.MAX_ENTRIES_PER_CHUNK:
        return f"more than {osiris.MAX_ENTRIES_PER_CHUNK} entries with sub-batches"
    entries: list[osiris.SubBatch | bytes | memoryview] = []
    for message, is_sub_batch in zip(event.messages, event.sub_batches or (), strict=True):
        if not is_sub_batch:
            entries.append(message)
            continue
        try:
            sub_batch = osiris.SubBatch.parse(message)
        except osiris.OsirisError as exc:
            return f"a malformed sub-batch entry: {exc.reason}"
        if sub_batch.compression not in _STORABLE_COMPRESSIONS:
            return (
                f"sub-batch compression type {sub_batch.compression} is not supported"
                " (use none or gzip)"
            )
        if sub_batch.records == 0:
            return "a sub-batch entry with no records"
        entries.append(sub_batch)
    return entries


def _publish_error(publisher_id: int, ids: Sequence[int], code: int) -> sp.PublishError:
    return sp.PublishError(publisher_id=publisher_id, publishing_ids=ids, codes=[code] * len(ids))
