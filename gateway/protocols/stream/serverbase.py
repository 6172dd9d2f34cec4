"""What the stream listener's rooms share: reply codes, output, the open check, allow-lists.

And the listener itself, `StreamListenerFactory`: what its connections
share (the log, settings, the fleet, created and deleted streams); its
subclass in `gateway.protocols.stream.server` builds the connections.

`gateway.protocols.stream.server.StreamServerProtocol` is put together from
mixins of one concern each: the login (`gateway.protocols.stream.serverauth`),
stream management (`.serveradmin`), publishers (`.serverpublish`) and
consumers (`.serverconsume`). Each is a `StreamServerBase`: the connection
state they share is declared here (the protocol sets it up), with what every
command handler calls: `_send`, `_require_open`, and the allow-list checks
(`_refused`, `_internal`). The protocol's dispatch table maps each event type
to the mixin's method directly: no call goes through here that did not before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Unpack

from gateway.codecs import stream as sp
from gateway.core.authorization import Action, check_internal
from gateway.protocols.listener import ListenerArgs, ListenerConnection, ListenerFactory
from gateway.protocols.stream.fleetlogin import ROUTES, RelayIdentity
from gateway.protocols.stream.relay import StreamFleet, StreamRelays
from gateway.protocols.stream.settings import StreamListenerSettings

if TYPE_CHECKING:
    from twisted.internet.interfaces import IAddress

    from gateway.core.log import LogStore, StreamLog

__all__ = [
    "ACCESS_REFUSED",
    "AUTHENTICATION_FAILURE",
    "AUTHENTICATION_FAILURE_LOOPBACK",
    "MAX_REFERENCE_BYTES",
    "NO_OFFSET",
    "OK",
    "PRECONDITION_FAILED",
    "PUBLISHER_DOES_NOT_EXIST",
    "SASL_ERROR",
    "SASL_MECHANISM_NOT_SUPPORTED",
    "STREAM_ALREADY_EXISTS",
    "STREAM_DOES_NOT_EXIST",
    "SUBSCRIPTION_ID_ALREADY_EXISTS",
    "SUBSCRIPTION_ID_DOES_NOT_EXIST",
    "UNKNOWN_FRAME",
    "VIRTUAL_HOST_ACCESS_FAILURE",
    "StreamListenerFactory",
    "StreamServerBase",
]

MAX_REFERENCE_BYTES: Final = 255

OK: Final = 1
STREAM_DOES_NOT_EXIST: Final = 2
SUBSCRIPTION_ID_ALREADY_EXISTS: Final = 3
SUBSCRIPTION_ID_DOES_NOT_EXIST: Final = 4
STREAM_ALREADY_EXISTS: Final = 5
SASL_MECHANISM_NOT_SUPPORTED: Final = 7
AUTHENTICATION_FAILURE: Final = 8
SASL_ERROR: Final = 9
AUTHENTICATION_FAILURE_LOOPBACK: Final = 11
VIRTUAL_HOST_ACCESS_FAILURE: Final = 12
UNKNOWN_FRAME: Final = 13
ACCESS_REFUSED: Final = 16
PRECONDITION_FAILED: Final = 17
PUBLISHER_DOES_NOT_EXIST: Final = 18
NO_OFFSET: Final = 19


class StreamServerBase(ListenerConnection["StreamListenerFactory"]):
    """What every part of a stream listener's connection uses (`StreamServerProtocol`)."""

    factory: StreamListenerFactory
    _codec: sp.StreamCodec
    _state: str
    identity: str | None
    _principal: str | None
    _relayed: RelayIdentity | None
    _relays: StreamRelays | None
    _unconfirmed: int
    _in_batch: bool
    _sent_since: bool

    if TYPE_CHECKING:  # the connection's own (`StreamServerProtocol`)

        def _handle_events(self, events: list[sp.Event], error: sp.StreamError | None) -> bool:
            """Handle a read's frames, then its error."""

        def stream_gone(self, name: str) -> None:
            """A stream this connection uses was deleted."""

        def owners_changed(self) -> None:
            """Streams may have moved to other nodes of the fleet."""

    # --- output ------------------------------------------------------------------------

    def _send(self, event: sp.Event) -> None:
        self._out.append(self._codec.send(event))
        self._sent_since = True
        if not self._in_batch:
            self.flush()

    def _require_open(self, event: sp.Event) -> bool:
        if self._state == "open":
            return True
        # Before Open only the handshake is allowed: close without a word.
        self.factory.count_error("not-open")
        self._close()
        return False

    # --- allow-lists ---------------------------------------------------------------------------

    def _refused(self, action: Action, stream: str) -> bool:
        """Whether the allow-lists refuse ``action`` on ``stream`` (counted and logged)."""
        factory = self.factory
        if not factory.authorization.restricted or self._routes():
            return False  # routes write as this node's own routes do
        return not factory.authorized(action, self._principal, stream, self._peer())

    def _routes(self) -> bool:
        """Whether this is another node's relay of its routes' deliveries."""
        return self._relayed is not None and self._relayed.role == ROUTES

    def _readable(self, command: str, name: str) -> tuple[StreamLog | None, int]:
        """The stream ``name`` to read for ``command``, or None and the code to answer.

        The code is `ACCESS_REFUSED` for an internal stream without a grant
        (logged and counted), `STREAM_DOES_NOT_EXIST` for a missing one.
        """
        stream = self.factory.store.get(name)
        if self._internal(command, name, read=True):
            return None, ACCESS_REFUSED
        return stream, OK if stream is not None else STREAM_DOES_NOT_EXIST

    def _internal(
        self, command: str, stream: str, reference: str | None = None, *, read: bool = False
    ) -> bool:
        """Whether ``command`` touches the gateway's own streams or references (refused).

        Reading (``read``) an internal stream is allowed by an explicit
        grant only; nothing else is. The refusal is counted and logged.
        """
        factory = self.factory
        if self._routes():
            reference = None  # the routes' own references: msggateway.route.*
        return not check_internal(
            factory.authorization,
            command,
            self._principal,
            stream,
            reference=reference,
            read=read,
            listener=factory.name,
            count_error=factory.count_error,
            peer=self._peer(),
            shown_identity=self.identity,
        )


class StreamListenerFactory(ListenerFactory[StreamServerBase, StreamListenerSettings]):
    """One stream listener: what its connections share (its subclass in `.server` builds them).

    Args:
        name: The listener's name.
        settings: Its validated settings.
        store: The embedded log.
        secrets: For SASL PLAIN.
        clock: Timers.
        metrics: Counters, or None.
    """

    kind = "stream"

    def __init__(
        self, *, store: LogStore, **common: Unpack[ListenerArgs[StreamListenerSettings]]
    ) -> None:
        super().__init__(**common)
        self.store = store
        self._bound: tuple[str, int] = ("127.0.0.1", 0)
        self.on_stream_created: list[Callable[[str], None]] = []
        self.fleet: StreamFleet | None = None
        """In a fleet: who owns each stream, and how to relay to its owner (`join_fleet`)."""

    def join_fleet(self, fleet: StreamFleet) -> None:
        """Act as one node of a fleet: streams owned elsewhere are relayed or refused there."""
        self.fleet = fleet
        fleet.placement.on_change(self._owners_changed)

    def _owners_changed(self) -> None:
        for connection in list(self.connections):
            connection.owners_changed()

    def listening_on(self, address: IAddress) -> None:
        """Learn the address the listener got (port 0 in tests) to advertise it."""
        host = getattr(address, "host", "127.0.0.1")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        self._bound = (host, int(getattr(address, "port", 0)))

    def advertised(self) -> tuple[str, int]:
        """The host and port clients are told to connect to."""
        return (
            self.settings.advertised_host or self._bound[0],
            self.settings.advertised_port or self._bound[1],
        )

    def stream_created(self, name: str) -> None:
        """A client created a stream (routes from this listener may start on it)."""
        for callback in self.on_stream_created:
            callback(name)

    def stream_deleted(self, name: str) -> None:
        """Tell every connection using the stream that it is gone."""
        for connection in list(self.connections):
            connection.stream_gone(name)
