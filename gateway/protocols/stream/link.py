"""What the stream upstream's publishing and consuming halves need of it.

`Publishers` (`gateway.protocols.stream.publishing`) and `Subscriptions`
(`gateway.protocols.stream.consuming`) are parts of `StreamUpstream`; they
see it, and its connection, only through these two protocols, so that they
depend on nothing above them and the upstream is free to own them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from gateway.codecs import stream as sp
from gateway.core.router import Router
from gateway.metrics import TrafficCounters
from gateway.protocols.stream.settings import StreamUpstreamSettings

__all__ = ["StreamConnection", "StreamLink"]


class StreamConnection(Protocol):
    """One open connection to a stream node, as its requests and frames go out."""

    frame_max: int
    """The negotiated frame size (0: no limit)."""

    @property
    def closing(self) -> bool:
        """Whether the connection is on its way out (send nothing more on it)."""

    def send(self, event: sp.Event) -> None:
        """Send one frame."""

    def send_all(self, events: Sequence[sp.Event]) -> None:
        """Send frames in one write."""

    def request(self, request: Callable[..., sp.Event], **fields: Any) -> Deferred[Any]:
        """Send a request; fire with its response."""

    def close(self, why: str) -> None:
        """Close, saying why."""


class StreamLink(Protocol):
    """The stream upstream, as its publishing and consuming halves see it."""

    name: str
    source: str
    """The name routes see as the source of consumed messages."""
    settings: StreamUpstreamSettings
    traffic: TrafficCounters
    router: Router
    clock: IReactorTime
    reference: str
    """The publisher reference (deduplication)."""
    consumer_name: str
    """The name consumed offsets are stored under."""

    @property
    def connection(self) -> StreamConnection | None:
        """The ready connection, if any."""

    @property
    def running(self) -> bool:
        """Whether the upstream is started."""

    def count_error(self, kind: str) -> None:
        """Count a protocol error of some kind."""
