"""The MTL client role: a REQ control socket and a DEALER data socket to a remote server.

`MTLUpstream` opens (Connection.Open), logs in when answered 401
(``username``, the upstream's secret as password) with its ``mechanism``:
PLAIN, or SCRAM-SHA-256 through the server's ``402 Challenged`` rounds; a
401 to the login itself starts over. It selects its profile, asks for a
reader or writer lease, connects its DEALER to the data port of the 202
reply and presents the lease; a reader then summons each resource. Each
reply must be one its request can have (201 to Open or Authorize, 200 to
Profile, 202 to Reader or Writer, 402 to Authorize, 401 to any): anything
else starts over. Any refusal, a control request unanswered for
``request_timeout_seconds`` or a data flow silent for
``dead_after_seconds`` makes it start over after a growing delay (a REQ
socket that lost its reply cannot be used again, so both sockets are made
anew).

The server is authenticated too, with SCRAM-SHA-256: its last 402 carries
the server-final message, whose signature proves it knows the secret
(RFC 5802, section 5), and that is checked before anything else is sent.
An upstream that logs in with SCRAM-SHA-256 takes no 201 from a server
that has not given that proof in this attempt, whether it came after
Connection.Open (a server that asks no login) or in the middle of the
exchange: it is refused, counted (``server-not-verified``) and logged as
an error, and nothing reaches that server (what is routed to the upstream
meanwhile is retry later). PLAIN authenticates only the client.

With CURVE, a wrong ``curve_server_key`` is only silence to the client:
the server cannot decrypt its handshake and drops it. So a Connection.Open
unanswered over CURVE is counted (``no-curve-handshake``) and its log line
says what ZeroMQ's monitor of the control socket saw: handshakes that
failed (the key is likely wrong, or the server refused this client's key)
or none at all.

Writer: the upstream is a route destination; a message becomes a Content
on its address (the resource) with its text headers, id and sender as
properties; with ``confirm = "full"`` Confirm is accepted, Reject rejected
and Reject with recycle retry later; without, written is accepted. Not
ready: retry later.

Reader: every Content is routed from the upstream with its resource as the
address; with ``confirm = "full"`` the route's outcome goes back as
Confirm, Reject, or Reject with recycle.

Batches (DESIGN.md, "The batch is the unit of work"): the Contents of one
ZeroMQ read burst go to the router as one batch, each answered on its own;
a batch routed to a writer goes out in one go, its outcomes gathered in one
`PendingBatch`.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, Unpack

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from zope.interface import implementer

from gateway.codecs import mtl, scram
from gateway.core.batch import all_same
from gateway.core.inbox import Inbox, Result
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Unrouted
from gateway.protocols.mtl.mapping import (
    Copy,
    PendingBatch,
    Unconfirmed,
    content_properties,
    give_back,
    message_from_content,
    settle,
)
from gateway.protocols.mtl.peer import MTLPeer, MTLPeerArgs
from gateway.protocols.mtl.settings import MTLUpstreamSettings

__all__ = ["MTLUpstream"]

RETRY_INITIAL_SECONDS: Final = 0.5
RETRY_MAX_SECONDS: Final = 30.0

_HANDSHAKE_NAMES: Final = {
    0x1000: "succeeded",  # zmq.EVENT_HANDSHAKE_SUCCEEDED
    0x0800: "failed",  # zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: the server dropped it
    0x2000: "failed",  # zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    0x4000: "refused",  # zmq.EVENT_HANDSHAKE_FAILED_AUTH: the server's ZAP said no
}
_HANDSHAKE_EVENTS: Final = sum(_HANDSHAKE_NAMES)


def _curve_silence(seen: dict[str, int]) -> str:
    """What a Connection.Open unanswered over CURVE may mean, from the handshakes seen."""
    if seen.get("refused"):
        return ": the server refused this client's CURVE key (check curve_secret_key_file)"
    if seen.get("failed") and not seen.get("succeeded"):
        return (
            f": ZeroMQ's CURVE handshake with the server failed {seen['failed']} time(s), the"
            " server dropping it: curve_server_key is probably not the server's public key"
        )
    if not seen:
        return (
            ": no CURVE handshake completed (the server is down or slow, or curve_server_key"
            " is not its public key: a CURVE server drops a wrong key silently)"
        )
    return ""


@implementer(IDestination)
class MTLUpstream(MTLPeer[MTLUpstreamSettings]):
    """A remote MTL server, as a writer (destination) or a reader (source).

    Built with `MTLPeerArgs`: ``host`` and ``port`` are the server's control
    socket, ``secrets`` hold the upstream's PLAIN or SCRAM password, and a
    reader's content goes to ``router``.
    """

    _log = Logger()

    def __init__(self, **args: Unpack[MTLPeerArgs[MTLUpstreamSettings]]) -> None:
        super().__init__(**args)
        name, router = self.name, self.router
        self._step = ""
        self._ready = False
        self._running = False
        self._attempt = 0
        self._timer: IDelayedCall | None = None
        self._ping: IDelayedCall | None = None
        self._dead: IDelayedCall | None = None
        """The next look at the data flow's silence (``dead_after_seconds``)."""
        self._heard = 0.0
        self._sequence = itertools.count(1)
        self._unconfirmed: Unconfirmed = {}
        self._flow = 0
        """Counts data flows, so that answers meant for one are not sent on the next."""
        self._inbox: Inbox[int] = Inbox(router, name, partial(self._answer, self._flow))
        self._server_who = f"the server of upstream {name}"
        self._summons: dict[int, str] = {}
        self._scram: scram.ScramClient | None = None
        self._scram_round = 0
        self._server_proved = False
        """The server gave SCRAM's server signature in this attempt (`_trusted`)."""
        self._handshakes: dict[str, int] = {}
        """What the control socket's monitor saw in this attempt (CURVE): event name to count."""
        if self._metrics is not None:
            self._metrics.upstream_up.labels(name).set(0)

    @property
    def connected(self) -> bool:
        """Whether the data flow is open."""
        return self._ready

    # --- life --------------------------------------------------------------------------

    def start(self) -> None:
        """Open the control flow (and keep trying)."""
        self._running = True
        self._begin()

    def stop(self) -> None:
        """Close both sockets; stop trying."""
        self._running = False
        self._teardown("the gateway is stopping")

    def _begin(self) -> None:
        import zmq

        from gateway.protocols.mtl.zmq import ZmqSocket, zmq_factory

        self._timer = None
        if not self._running:
            return
        self._zmq = zmq_factory(self._reactor)
        self._control = ZmqSocket(self._zmq, zmq.REQ, self._on_reply)
        self._server_proved = False
        self._handshakes = {}
        if self._curve(self._control):
            self._control.watch(_HANDSHAKE_EVENTS, self._on_handshake)
        self._control.connect(f"tcp://{self.host}:{self.port}")
        self._request("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})

    def _curve(self, socket: Any) -> bool:
        """Make ``socket`` a CURVE client of the server, with its key pair or a fresh one.

        Returns:
            Whether CURVE is on.
        """
        import zmq

        server_key = self.settings.curve_server_key
        if server_key is None:
            return False
        secret_key = self.settings.curve_secret_key
        if secret_key is None:
            public_key, secret_key = zmq.curve_keypair()
        else:
            public_key = zmq.curve_public(secret_key)
        socket.set_option(zmq.CURVE_SERVERKEY, server_key)
        socket.set_option(zmq.CURVE_PUBLICKEY, public_key)
        socket.set_option(zmq.CURVE_SECRETKEY, secret_key)
        return True

    def _on_handshake(self, event: int, _value: int) -> None:
        """Note what the control socket's monitor says of a CURVE handshake."""
        name = _HANDSHAKE_NAMES.get(event, "other")
        self._handshakes[name] = self._handshakes.get(name, 0) + 1

    def _teardown(self, why: str) -> None:
        for call in (self._timer, self._ping, self._dead):
            if call is not None and call.active():
                call.cancel()
        self._timer = self._ping = self._dead = None
        if self._ready:
            self._log.info("upstream {upstream}: closed: {why}", upstream=self.name, why=why)
        self._ready = False
        if self._metrics is not None:
            self._metrics.upstream_up.labels(self.name).set(0)
        # Contents read before the flow ended mid-burst are routed all the same
        # (their answers, for a flow that is gone, are not sent: the server recycles).
        self._inbox.dispatch()
        give_back(self._unconfirmed, Outcome.retry(f"upstream {self.name}: {why}"))
        self._outbox.clear()  # meant for the flow that is closing
        if self._zmq is not None:
            self._zmq.shutdown()
        self._zmq = self._control = self._data = None

    def _start_over(self, why: str) -> None:
        self._log.warn("upstream {upstream}: starting over: {why}", upstream=self.name, why=why)
        self._teardown(why)
        if self._running:
            self._attempt += 1
            delay = min(RETRY_INITIAL_SECONDS * 2 ** (self._attempt - 1), RETRY_MAX_SECONDS)
            self._timer = self.clock.callLater(delay, self._begin)

    # --- control flow ------------------------------------------------------------------

    def _request(self, command: str, body: dict[str, Any]) -> None:
        self._step = command.lower()
        self._control.send(mtl.request(command, body))
        self._timer = self.clock.callLater(
            self.settings.request_timeout_seconds, self._unanswered, command
        )

    def _unanswered(self, command: str) -> None:
        """A control request had no answer in time: start over, saying what may be wrong."""
        why = f"no answer to {command} in {self.settings.request_timeout_seconds:g} s"
        if command == "Connection.Open" and self.settings.curve_server_key is not None:
            self.count_error("no-curve-handshake")
            why += _curve_silence(self._handshakes)
        self._start_over(why)

    def _on_reply(self, frames: list[bytes]) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        parsed = mtl.parse_reply(frames)
        if parsed is None:
            self._start_over("an ill-formed control reply")
            return
        status, body = parsed
        settings = self.settings
        step = self._step
        if status == 401:
            self._login(body)
        elif status == 402 and step == "connection.authorize":
            self._challenged(body)
        elif status == 201 and step in ("connection.open", "connection.authorize"):
            if self._trusted(step):
                self._request("Connection.Profile", {"profile": settings.profile})
        elif status == 200 and step == "connection.profile":
            kind = "Connection.Reader" if settings.mode == "reader" else "Connection.Writer"
            self._request(
                kind, {"resources": list(settings.resources), "confirm": settings.confirm}
            )
        elif status == 202 and step in ("connection.reader", "connection.writer"):
            self._open_data(int(body.get("port", 0)), str(body.get("lease", "")))
        else:
            self._start_over(f"{step} answered {status} {body.get('reason') or body.get('status')}")

    def _trusted(self, step: str) -> bool:
        """Whether a 201 to ``step`` comes from a server that proved itself, as SCRAM requires.

        A server that is not trusted is refused, counted and logged; the
        upstream starts over.
        """
        settings = self.settings
        if settings.mechanism != scram.MECHANISM or settings.username is None:
            return True  # PLAIN authenticates the client only; no login, nothing to prove
        if self._server_proved:
            return True
        self._scram = None
        self.count_error("server-not-verified")
        why = (
            f"it answered {step} with 201 Ready before proving that it knows the secret"
            " (SCRAM-SHA-256's server signature, in a last 402 Challenged): it may not be the"
            " server it claims to be, and nothing is sent to it"
        )
        self._log.error(
            "upstream {upstream}: server not trusted: {why}", upstream=self.name, why=why
        )
        self._start_over(f"the server is not trusted: {why}")
        return False

    def _login(self, body: dict[str, Any]) -> None:
        """Answer a 401: log in with the configured mechanism, unless that just failed."""
        settings = self.settings
        password = self.secrets.credential_for(self.name)
        if self._step == "connection.authorize":
            self._start_over(f"the server refused the login: {body.get('reason') or 401}")
        elif settings.username is None or password is None:
            self._start_over("the server wants a login and none is configured")
        elif settings.mechanism not in body.get("mechanisms", [settings.mechanism]):
            self._start_over(f"the server does not offer {settings.mechanism}")
        elif settings.mechanism == scram.MECHANISM:
            try:
                self._scram = scram.ScramClient(settings.username, password)
            except scram.ScramError as exc:  # a name or password SASLprep refuses
                self._scram = None
                self._start_over(f"SCRAM-SHA-256 login failed: {exc}")
                return
            self._scram_round = 0
            self._server_proved = False  # a new login: the server proves itself again
            self._authorize(self._scram.first())
        else:
            self._authorize(b"\0" + settings.username.encode() + b"\0" + password)

    def _challenged(self, body: dict[str, Any]) -> None:
        """Answer a 402: the next SCRAM-SHA-256 message."""
        exchange = self._scram
        try:
            if exchange is None:
                raise scram.ScramError("a challenge for no exchange of ours")
            challenge = base64.b64decode(str(body.get("challenge", "")), validate=True)
            self._scram_round += 1
            if self._scram_round == 1:
                self._authorize(exchange.final(challenge))
            else:
                exchange.verify(challenge)
                self._scram = None
                self._server_proved = True
                self._authorize(b"")
        except (scram.ScramError, ValueError) as exc:
            self._scram = None
            self._start_over(f"SCRAM-SHA-256 login failed: {exc}")

    def _authorize(self, response: bytes) -> None:
        self._request(
            "Connection.Authorize",
            {"mechanism": self.settings.mechanism, "response": base64.b64encode(response).decode()},
        )

    # --- data flow ---------------------------------------------------------------------

    def _open_data(self, port: int, lease: str) -> None:
        import zmq

        from gateway.protocols.mtl.zmq import ZmqSocket

        self._data = ZmqSocket(self._zmq, zmq.DEALER, self._on_data, self._new_flow())
        self._curve(self._data)
        self._data.connect(f"tcp://{self.host}:{port}")
        self._send(mtl.Lease(next(self._sequence), lease))
        self._outbox.flush()
        self._watch_flow()

    def _watch_flow(self) -> None:
        """Ping the new data flow every ``ping_interval_seconds``; watch its silence."""
        self._heard = self.clock.seconds()
        self._ping = self.clock.callLater(self.settings.ping_interval_seconds, self._tick)
        self._dead = self.clock.callLater(self.settings.dead_after_seconds, self._check_dead)

    def _new_flow(self) -> Callable[[], None]:
        """Give a new data flow its inbox; return what ends one of its read bursts.

        An inbox per flow: answers for the contents of a flow that is gone
        are not sent on the next one, whose sequences mean other contents.
        """
        self._flow += 1
        self._inbox = Inbox(self.router, self.name, partial(self._answer, self._flow))
        return self._drained

    def _drained(self) -> None:
        """The data socket's read burst is over: route its Contents, send its answers."""
        self._inbox.dispatch()
        self._outbox.reading = False
        self._outbox.flush()

    def _on_data(self, frames: list[bytes]) -> None:
        try:
            command = mtl.decode_data(frames)
        except mtl.MTLError:
            self.count_error("ill-formed-data")
            return
        self._heard = self.clock.seconds()
        self.traffic.messages_in += 1
        self._outbox.reading = True  # answers go out when the burst is drained
        # The commands of the data path first: they are nearly all there is.
        if isinstance(command, mtl.Content):
            self._content(command)
        elif isinstance(command, mtl.Confirm | mtl.Reject):
            settle(self._unconfirmed, command, self._server_who)
        elif isinstance(command, mtl.Response):
            self._response(command)
        elif isinstance(command, mtl.Ping):
            self._send(mtl.Pong())

    def _response(self, response: mtl.Response) -> None:
        if response.code != 200:
            self._start_over(f"the server answered {response.code} on the data flow")
            return
        resource = self._summons.pop(response.sequence, None)
        if resource is not None:
            self._log.info(
                "upstream {upstream}: summoned {resource}", upstream=self.name, resource=resource
            )
        elif not self._ready:
            self._ready = True
            self._attempt = 0
            self._log.info("upstream {upstream}: connected", upstream=self.name)
            if self._metrics is not None:
                self._metrics.upstream_up.labels(self.name).set(1)
            if self.settings.mode == "reader":
                for resource in self.settings.resources:
                    sequence = next(self._sequence)
                    self._summons[sequence] = resource
                    self._send(mtl.Summon(sequence, resource))

    def _content(self, content: mtl.Content) -> None:
        message = message_from_content(
            content.resource, content.properties, content.body, self.clock.seconds()
        )
        # Routed with the rest of the read burst (`_inbox.dispatch` once it is drained).
        self._inbox.add(message, content.sequence)

    def _answer(self, flow: int, sequence: int, result: Result) -> None:
        """With confirm=full, tell the server what became of one Content of data flow ``flow``."""
        if self.settings.confirm != "full" or flow != self._flow or not self._ready:
            return
        if isinstance(result, Unrouted):
            self._send(mtl.Reject(sequence, False, False))
        elif result.status is Status.ACCEPTED:
            self._send(mtl.Confirm(sequence, False))
        else:
            self._send(mtl.Reject(sequence, False, result.status is Status.RETRY))

    def _tick(self) -> None:
        self._send(mtl.Ping())
        self._outbox.flush()
        self._ping = self.clock.callLater(self.settings.ping_interval_seconds, self._tick)

    def _check_dead(self) -> None:
        """Start over once the data flow has been silent for ``dead_after_seconds``.

        The timer is armed for the deadline as it stood (last heard plus the
        limit); what arrives only notes its time, so the timer may fire
        early: it is then armed again for exactly the time left.
        """
        self._dead = None
        limit = self.settings.dead_after_seconds
        silent = self.clock.seconds() - self._heard
        if silent < limit:
            self._dead = self.clock.callLater(limit - silent, self._check_dead)
            return
        self.count_error("dead-peer")
        self._start_over(f"the data flow was silent for {silent:g} s")

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Send a batch to the server as Contents on their addresses, all in one go.

        With ``confirm = "full"`` each Content's Confirm or Reject answers its
        message; without, written is accepted. Not connected, or ZeroMQ not
        taking a Content: retry later; a reader upstream takes nothing.
        """
        count = len(messages)
        if self.settings.mode != "writer":
            return all_same(
                count, Outcome.rejected(f"upstream {self.name} is a reader; it takes nothing")
            )
        if not self._ready or self._data is None:
            return all_same(count, Outcome.retry(f"upstream {self.name} is not connected"))
        unconfirmed = self._unconfirmed if self.settings.confirm == "full" else None
        batch = PendingBatch(count)
        frames: list[list[bytes]] = []
        copies: list[Copy] = []
        sequences = self._sequence
        for index, message in enumerate(messages):
            sequence = next(sequences)
            content = mtl.Content(
                sequence, message.address, content_properties(message), message.body
            )
            try:
                frames.append(mtl.encode_data(content))
            except mtl.MTLLocalError as exc:
                batch.settle(index, Outcome.rejected(f"upstream {self.name}: {exc.reason}"))
                continue
            copies.append((unconfirmed, sequence, index))
        not_reading = Outcome.retry(f"upstream {self.name}: the server is not reading")
        self._send_batch(batch, frames, copies, not_reading)
        return batch.deferred

    def _send(self, command: mtl.DataCommand) -> None:
        """Send a data command with the others of this burst or reactor turn (`Outbox`)."""
        if self._data is None:
            return
        self.traffic.messages_out += 1
        self._outbox.add(mtl.encode_data(command))
