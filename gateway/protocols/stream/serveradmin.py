"""Stream management on the stream listener: Create, Delete, Metadata, StreamStats.

`ServerStreams` is the part of `StreamServerProtocol` that creates and
deletes streams in the embedded log (Create needs the right to publish to
the stream, as Delete does; the gateway's own streams are refused), answers
Metadata (this node as every stream's leader) and StreamStats, and refuses
what the listener does not offer: super streams, Route and Partitions.
Create's arguments map to the log's retention with `parse_retention`.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.codecs import stream as sp
from gateway.core.authorization import Action
from gateway.core.log import Retention, StreamExistsError, StreamMissingError
from gateway.protocols.stream.serverbase import (
    ACCESS_REFUSED,
    OK,
    PRECONDITION_FAILED,
    STREAM_ALREADY_EXISTS,
    STREAM_DOES_NOT_EXIST,
    StreamServerBase,
)

__all__ = ["ServerStreams", "parse_age", "parse_retention"]


def parse_retention(arguments: dict[str, str], default: Retention) -> Retention:
    """Map Create arguments (``max-length-bytes``, ``max-age``...) to a retention.

    Raises:
        ValueError: An argument that cannot be understood (code 17).
    """
    max_bytes = default.max_bytes
    max_age = default.max_age_seconds
    segment = default.max_segment_bytes
    if "max-length-bytes" in arguments:
        max_bytes = int(arguments["max-length-bytes"])
    if "max-age" in arguments:
        max_age = parse_age(arguments["max-age"])
    if "stream-max-segment-size-bytes" in arguments:
        segment = int(arguments["stream-max-segment-size-bytes"])
    for value in (max_bytes, max_age, segment):
        if value is not None and value <= 0:
            raise ValueError("retention values must be positive")
    return Retention(max_bytes=max_bytes, max_age_seconds=max_age, max_segment_bytes=segment)


_AGE_UNITS: Final = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}


def parse_age(text: str) -> float:
    """Parse a RabbitMQ max-age such as ``7D``, ``12h``, ``30s``.

    Raises:
        ValueError: Not a number followed by one of Y M D h m s.
    """
    if len(text) < 2 or text[-1] not in _AGE_UNITS or not text[:-1].isdigit():
        raise ValueError(f"max-age {text!r} is not like 7D, 12h or 30s")
    return int(text[:-1]) * _AGE_UNITS[text[-1]]


class ServerStreams(StreamServerBase):
    """Create, Delete, Metadata and StreamStats; what is not offered, refused."""

    # --- streams ---------------------------------------------------------------------------------

    def _on_create(self, event: sp.Create) -> None:
        if not self._require_open(event):
            return
        name = event.stream.strip("\r\n")
        store = self.factory.store
        code = OK
        if self._internal("create", name):
            code = ACCESS_REFUSED
        elif not name or name.startswith("amq."):
            code = PRECONDITION_FAILED
        elif self._refused(Action.PUBLISH, name):
            code = ACCESS_REFUSED
        else:
            try:
                retention = parse_retention(dict(event.arguments), store.default_retention)
                store.create(name, retention)
            except StreamExistsError:
                code = STREAM_ALREADY_EXISTS
            except ValueError:
                code = PRECONDITION_FAILED
            else:
                self.factory.stream_created(name)
        self._send(sp.Response(key=sp.Key.CREATE, correlation_id=event.correlation_id, code=code))

    def _on_delete(self, event: sp.Delete) -> None:
        if not self._require_open(event):
            return
        if self._internal("delete", event.stream) or self._refused(Action.PUBLISH, event.stream):
            self._send(
                sp.Response(
                    key=sp.Key.DELETE, correlation_id=event.correlation_id, code=ACCESS_REFUSED
                )
            )
            return
        try:
            self.factory.store.delete(event.stream)
        except StreamMissingError:
            code = STREAM_DOES_NOT_EXIST
        else:
            code = OK
            self.factory.stream_deleted(event.stream)
        self._send(sp.Response(key=sp.Key.DELETE, correlation_id=event.correlation_id, code=code))

    def _on_metadata(self, event: sp.Metadata) -> None:
        if not self._require_open(event):
            return
        host, port = self.factory.advertised()
        streams = []
        for name in event.streams:
            if self.factory.store.get(name) is None:
                streams.append(
                    sp.StreamMetadata(
                        stream=name, code=STREAM_DOES_NOT_EXIST, leader=0xFFFF, replicas=()
                    )
                )
            else:
                streams.append(sp.StreamMetadata(stream=name, code=OK, leader=0, replicas=()))
        self._send(
            sp.MetadataResponse(
                correlation_id=event.correlation_id,
                brokers=(sp.Broker(reference=0, host=host, port=port),),
                streams=tuple(streams),
            )
        )

    def _on_stream_stats(self, event: sp.StreamStats) -> None:
        if not self._require_open(event):
            return
        stream, code = self._readable("read the stats of", event.stream)
        if stream is None:
            self._send(
                sp.StreamStatsResponse(
                    correlation_id=event.correlation_id, code=code, statistics={}
                )
            )
            return
        last = stream.last_chunk_id
        stats = {
            "committed_chunk_id": stream.committed_chunk_id,
            # -1 for an empty stream, as osiris reports it (the log says "next offset").
            "first_chunk_id": stream.first_chunk_id if last >= 0 else -1,
            "last_chunk_id": last,
        }
        self._send(
            sp.StreamStatsResponse(correlation_id=event.correlation_id, code=OK, statistics=stats)
        )

    def _on_unsupported(self, event: Any) -> None:
        if not self._require_open(event):
            return
        # Super streams are not supported.
        key = (
            sp.Key.CREATE_SUPER_STREAM
            if isinstance(event, sp.CreateSuperStream)
            else sp.Key.DELETE_SUPER_STREAM
        )
        self._send(
            sp.Response(key=key, correlation_id=event.correlation_id, code=PRECONDITION_FAILED)
        )

    def _on_route(self, event: Any) -> None:
        if not self._require_open(event):
            return
        self._send(
            sp.RouteResponse(
                correlation_id=event.correlation_id, code=STREAM_DOES_NOT_EXIST, streams=()
            )
        )

    def _on_partitions(self, event: Any) -> None:
        if not self._require_open(event):
            return
        self._send(
            sp.PartitionsResponse(
                correlation_id=event.correlation_id, code=STREAM_DOES_NOT_EXIST, streams=()
            )
        )
