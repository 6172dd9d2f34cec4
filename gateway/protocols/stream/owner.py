"""A connection to the node that owns a stream, relaying one client's commands (a fleet).

In a fleet (docs/fleet.rst) each stream of the embedded log has one owner
node (`gateway.fleet.streams`). A stream listener that is asked about a
stream another node owns relays the command there (`gateway.protocols.stream.relay`)
over an `OwnerConnection`: a stream protocol client of the owner's listener
of the same name, at the address the owner advertises, one per client
connection and owner, made when first needed.

It logs in one of two ways (`Login`), and opens the client's virtual host:

- `FleetLogin`, with ``[fleet] relay_secret``: as the fleet, stating the
  identity the client authenticated as here (`gateway.protocols.stream.fleetlogin`),
  which the owner takes from a relay that proved the secret; the relay
  checks the owner's proof in turn before anything else is sent. Over TLS
  on a TLS listener, the proofs bound to the TLS session;
- `ClientLogin`, without it: as the client did (the same SASL mechanism and
  response), over plain TCP only.

Either way the owner checks the client's rights itself, with the same
allow-lists; the connection is the client's, as far as the owner is
concerned, in its per-identity limits too. Its peer properties carry
`RELAY_PROPERTY` (the relaying node's id): the owner serves what comes on
it from its own log without relaying it again, so that two nodes that
disagree for a moment about an owner (one heard of a node joining before
the other) never relay in a circle.

Requests (anything with a correlation id) go out under a correlation id
of this connection and their answers come back under the client's; a
request not answered in `REQUEST_TIMEOUT_SECONDS` gives the connection up.
Until the handshake is over, what is asked waits in order. Publish and
StoreOffset frames go as they came. PublishConfirm, PublishError and
MetadataUpdate go to the relay (`OwnerEvents`). The connection tunes no
heartbeat: an owner that dies is noticed by TCP, or by the fleet when it
stops announcing itself (its streams then move, and the relay closes the
connection).

Back-pressure: when the owner does not read what is relayed (its
transport pauses us), the client's connection is held (its ``throttle``)
until it drains.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway import __version__
from gateway.codecs import stream as sp
from gateway.core.flow import Congestion, Throttle
from gateway.protocols.stream.fleetlogin import (
    NONCE_PROPERTY,
    RELAY_MECHANISM,
    RelayIdentity,
    channel_binding,
    check_owner_proof,
    new_nonce,
    relay_response,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_SECONDS",
    "RELAY_PROPERTY",
    "REQUEST_TIMEOUT_SECONDS",
    "ClientLogin",
    "FleetLogin",
    "Login",
    "OwnerConnection",
    "OwnerEvents",
]

RELAY_PROPERTY: Final = "msggateway-relay"
"""Peer property of a relay's connection: the relaying node's id."""
HANDSHAKE_TIMEOUT_SECONDS: Final = 10.0
"""An owner not through Open in this time is given up (the listener's own handshake limit)."""
REQUEST_TIMEOUT_SECONDS: Final = 30.0
"""An owner that does not answer a request in this time is given up (as the upstream does)."""
_OK: Final = 1

Answer = Callable[[sp.Event | None], None]
"""Gets the owner's response under the client's correlation id, or None: no answer."""


@attrs.frozen
class ClientLogin:
    """Log in as the client did: its SASL mechanism and response."""

    mechanism: str
    data: bytes = attrs.field(repr=False)


@attrs.frozen
class FleetLogin:
    """Log in as the fleet (`RELAY_MECHANISM`), on behalf of ``who``."""

    secret: bytes = attrs.field(repr=False)
    who: RelayIdentity


Login = ClientLogin | FleetLogin


class OwnerEvents(Protocol):
    """What an `OwnerConnection` tells the relay that made it."""

    def owner_confirmed(self, connection: OwnerConnection, event: sp.PublishConfirm) -> None:
        """The owner confirmed relayed messages."""

    def owner_refused(self, connection: OwnerConnection, event: sp.PublishError) -> None:
        """The owner refused relayed messages."""

    def owner_update(self, connection: OwnerConnection, event: sp.MetadataUpdate) -> None:
        """A stream at the owner changed (deleted, or moved on): its publishers there are gone."""

    def owner_lost(self, connection: OwnerConnection, reason: str) -> None:
        """The connection failed or ended; nothing more comes of it."""


class _RefusedError(Exception):
    """The owner refused the relay's login or virtual host."""


@implementer(IPushProducer)
class OwnerConnection(TwistedProtocol):
    """One client's relay to one owner node.

    Args:
        node: This node's id (announced to the owner as the relay).
        owner: The owner's node id (for the log).
        login: How it logs in.
        virtual_host: The virtual host the client opened.
        frame_max: The largest frame to tune to (the listener's).
        clock: Timers.
        events: Where confirms, errors, updates and the end go.
        client: The client connection's throttle, held while the owner does not read.
    """

    _log = Logger()

    def __init__(
        self,
        *,
        node: str,
        owner: str,
        login: Login,
        virtual_host: str,
        frame_max: int,
        clock: IReactorTime,
        events: OwnerEvents,
        client: Throttle,
    ) -> None:
        self.node = node
        self.owner = owner
        self._login = login
        self._virtual_host = virtual_host
        self._frame_max = frame_max
        self._clock = clock
        self._events = events
        self._client = client
        self._codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self._correlation = itertools.count(1)
        self._waiting: dict[int, tuple[Answer, IDelayedCall | None]] = {}
        self._pending: list[tuple[sp.Event, Answer | None]] = []
        self._tune: Deferred[sp.Tune] = Deferred()
        self._handshake_call: IDelayedCall | None = None
        self.congestion = Congestion()
        self.frame_max = frame_max
        """The frame_max tuned with the owner (0: no limit); ours until then."""
        self.open = False
        """Through Open: what is relayed goes out at once."""
        self.closed = False
        """Failed, lost or closed: nothing more is relayed or reported."""

    # --- what the relay asks ------------------------------------------------------------

    def request(self, event: Any, answer: Answer) -> None:
        """Relay a request; ``answer`` gets the response under ``event``'s correlation id."""
        if self.closed:
            answer(None)
        elif not self.open:
            self._pending.append((event, answer))
        else:
            self._request(event, answer)

    def send(self, event: sp.Event) -> None:
        """Relay a frame that has no response (Publish, StoreOffset)."""
        if self.closed:
            return
        if not self.open:
            self._pending.append((event, None))
        else:
            self._write(event)

    def close(self) -> None:
        """Close for good (the client went); pending answers get None, nothing is reported."""
        if self.closed:
            return
        self.closed = True
        self._answer_all()
        if self.transport is not None:
            self.transport.loseConnection()

    def connect_failed(self, failure: Failure) -> None:
        """The TCP connection to the owner could not be made."""
        self._fail(f"cannot connect: {failure.getErrorMessage()}")

    # --- life ----------------------------------------------------------------------------

    def connectionMade(self) -> None:
        """Register as the transport's producer, then log in as the client did."""
        if self.closed:
            assert self.transport is not None
            self.transport.loseConnection()
            return
        assert self.transport is not None
        self.transport.registerProducer(self, True)  # type: ignore[attr-defined]
        self._handshake_call = self._clock.callLater(
            HANDSHAKE_TIMEOUT_SECONDS,
            self._fail,
            f"not open within {HANDSHAKE_TIMEOUT_SECONDS:g} s",
        )
        Deferred.fromCoroutine(self._handshake()).addErrback(self._handshake_failed)

    def connectionLost(self, reason: Failure | None = None) -> None:
        """Whatever still waits gets no answer; the relay hears of the end."""
        self._fail("the connection ended")

    async def _handshake(self) -> None:
        login = self._login
        properties = {
            "product": "msggateway",
            "version": __version__,
            "connection_name": f"msggateway relay from {self.node}",
            RELAY_PROPERTY: self.node,
        }
        relay_nonce = new_nonce()
        if isinstance(login, FleetLogin):
            properties[NONCE_PROPERTY] = relay_nonce
        theirs = await self._ask(sp.PeerProperties(correlation_id=0, properties=properties))
        owner_nonce = str((theirs.properties or {}).get(NONCE_PROPERTY, ""))
        if isinstance(login, FleetLogin):
            mechanism = RELAY_MECHANISM
            binding = channel_binding(self.transport)
            data = relay_response(
                login.secret,
                owner_nonce=owner_nonce,
                relay_nonce=relay_nonce,
                binding=binding,
                who=login.who,
            )
        else:
            mechanism, data = login.mechanism, login.data
        offered = await self._ask(sp.SaslHandshake(correlation_id=0))
        if mechanism not in offered.mechanisms:
            raise _RefusedError(f"it does not offer SASL {mechanism}")
        answer = await self._ask(
            sp.SaslAuthenticate(correlation_id=0, mechanism=mechanism, data=data)
        )
        if answer.code != _OK:
            whose = "the fleet's" if isinstance(login, FleetLogin) else "the client's"
            raise _RefusedError(f"it refused {whose} login (code {answer.code})")
        if isinstance(login, FleetLogin) and not check_owner_proof(
            login.secret,
            answer.challenge,
            owner_nonce=owner_nonce,
            relay_nonce=relay_nonce,
            binding=binding,
            who=login.who,
        ):
            raise _RefusedError("its answer does not prove the fleet's relay secret")
        tune = await self._tune
        theirs_max, ours = tune.frame_max, self._frame_max
        frame_max = min(theirs_max, ours) if theirs_max and ours else theirs_max or ours
        self.frame_max = frame_max
        self._write(sp.Tune(frame_max=frame_max, heartbeat=0))
        opened = await self._ask(sp.Open(correlation_id=0, virtual_host=self._virtual_host))
        if opened.code != _OK:
            raise _RefusedError(
                f"it refused virtual host {self._virtual_host!r} (code {opened.code})"
            )
        if self.closed:
            return
        self.open = True
        if self._handshake_call is not None and self._handshake_call.active():
            self._handshake_call.cancel()
        self._handshake_call = None
        pending, self._pending = self._pending, []
        for event, answer_to in pending:
            if answer_to is None:
                self._write(event)
            else:
                self._request(event, answer_to)

    def _handshake_failed(self, failure: Failure) -> None:
        if failure.check(_RefusedError, ConnectionError):
            self._fail(failure.getErrorMessage())
        else:
            self._log.failure("relay to node {owner}: handshake", failure, owner=self.owner)
            self._fail("the handshake failed")

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        for call in (self._handshake_call,):
            if call is not None and call.active():
                call.cancel()
        self._handshake_call = None
        self.congestion.gone()
        self._answer_all()
        if not self._tune.called:
            self._tune.errback(ConnectionError(reason))
            self._tune.addErrback(lambda _failure: None)  # the handshake may not wait for it yet
        if self.transport is not None:
            self.transport.loseConnection()
        self._events.owner_lost(self, reason)

    def _answer_all(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for answer, timer in waiting.values():
            if timer is not None and timer.active():
                timer.cancel()
            answer(None)
        pending, self._pending = self._pending, []
        for _event, answer_to in pending:
            if answer_to is not None:
                answer_to(None)

    # --- requests ------------------------------------------------------------------------

    def _write(self, event: sp.Event) -> None:
        assert self.transport is not None
        self.transport.write(self._codec.send(event))

    def _request(self, event: Any, answer: Answer) -> None:
        correlation = next(self._correlation)
        original = event.correlation_id

        def answered(response: sp.Event | None) -> None:
            if response is None:
                answer(None)
            else:
                answer(dataclasses.replace(response, correlation_id=original))

        timer = self._clock.callLater(REQUEST_TIMEOUT_SECONDS, self._timed_out, event)
        self._waiting[correlation] = (answered, timer)
        self._write(dataclasses.replace(event, correlation_id=correlation))

    def _timed_out(self, event: sp.Event) -> None:
        self._fail(f"no answer to {type(event).__name__} within {REQUEST_TIMEOUT_SECONDS:g} s")

    def _ask(self, event: Any) -> Deferred[Any]:
        """Send a handshake request; fire with its response."""
        answer: Deferred[Any] = Deferred()

        def answered(response: sp.Event | None) -> None:
            if response is None:
                answer.errback(ConnectionError("the connection ended"))
            else:
                answer.callback(response)

        correlation = next(self._correlation)
        self._waiting[correlation] = (answered, None)
        self._write(dataclasses.replace(event, correlation_id=correlation))
        return answer

    # --- input ---------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Dispatch the owner's frames."""
        if self.closed:
            return
        try:
            events = self._codec.receive_data(data)
        except sp.StreamError as exc:
            self._handle(cast(list[sp.Event], exc.events))
            self._fail(f"a bad frame from it: {exc.reason}")
            return
        self._handle(events)

    def _handle(self, events: list[sp.Event]) -> None:
        for event in events:
            if self.closed:
                return
            if isinstance(event, sp.PublishConfirm):
                self._events.owner_confirmed(self, event)
            elif isinstance(event, sp.PublishError):
                self._events.owner_refused(self, event)
            elif isinstance(event, sp.MetadataUpdate):
                self._events.owner_update(self, event)
            elif isinstance(event, sp.Tune):
                if not self._tune.called:
                    self._tune.callback(event)
            elif isinstance(event, sp.Close):
                self._write(sp.CloseResponse(correlation_id=event.correlation_id, code=_OK))
                self._fail(f"it closed the connection: {event.code} {event.reason}")
            else:
                correlation = getattr(event, "correlation_id", None)
                waiting = self._waiting.pop(correlation, None) if correlation is not None else None
                if waiting is not None:
                    answer, timer = waiting
                    if timer is not None and timer.active():
                        timer.cancel()
                    answer(event)

    # --- IPushProducer: the owner does not read what is relayed ----------------------------

    def pauseProducing(self) -> None:
        """Hold the client's connection until the owner caught up."""
        self.congestion.begin()
        self.congestion.hold(self._client)

    def resumeProducing(self) -> None:
        """The owner caught up: read the client again."""
        self.congestion.drained()

    def stopProducing(self) -> None:
        """The transport is going; `connectionLost` follows."""
