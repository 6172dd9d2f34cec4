"""The SSMP server role: one connection to the hub.

A thin adapter over `gateway.codecs.ssmp`: it feeds the codec, applies the
spec's rules for each request (login first, schemes, 405/404/409/501), hands
forwarding to the `Hub` and the requests that routes take to the `Router`
(MCASTs by topic, BCASTs as ``!bcast``, UCASTs to a peer not connected here
as ``!ucast.<peer>``: `gateway.protocols.ssmp.mapping`), one batch per read,
and keeps responses in request order even when a route answers later.
In a fleet (docs/fleet.rst), a UCAST to a peer not connected here goes to
the node that has it (`gateway.fleet.hub`): 200 once that node took it,
404 when no node has it (and no route takes ``!ucast.<peer>`` either).

Flow control (docs/protocols/ssmp.rst, "Flow control"; `gateway.core.flow`):
each connection is a push producer on its own transport. When a subscriber's
transport fills (it reads slower than its publishers write), the publishers
whose reads queued to it are held: we stop reading their requests until it
drained, as lipwig's publisher blocks on a subscriber's write, so a healthy
subscriber misses nothing. A subscriber that does not drain for
``slow_consumer_seconds``, or whose backlog passes ``max_backlog_bytes``, is
disconnected as a slow consumer, counted and logged, and its publishers read
again. Under ``slow_consumer_policy = "disconnect"`` publishers are never
held and only the cap and the time apply.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Mapping
from typing import Final, Unpack, cast

from twisted.internet.interfaces import IDelayedCall, ISSLTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import ssmp
from gateway.core.authorization import Action
from gateway.core.inbox import Inbox
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Result, Router, RouteTable, Unrouted
from gateway.protocols.listener import ListenerArgs, ListenerConnection, ListenerFactory
from gateway.protocols.logins import UNCHECKED
from gateway.protocols.ssmp.hub import Hub
from gateway.protocols.ssmp.mapping import (
    BCAST_ADDRESS,
    mcast_message,
    message_from_bcast,
    message_from_ucast,
    ucast_address,
)
from gateway.protocols.ssmp.settings import SSMPListenerSettings
from gateway.tls import peer_identities

__all__ = [
    "SSMPServerFactory",
    "SSMPServerProtocol",
    "cert_identity_matches",
    "cert_name_for",
    "outcome_response",
    "secret_name_for",
    "ucast_response",
]

OK: Final = b"200\n"
PONG_EVENT: Final = b"000 . PONG\n"
PING_EVENT: Final = b"000 . PING\n"
_NO_SUCH_PEER: Final = b"404 no such peer\n"
MAX_ROUTED_TOPICS: Final = 4096
"""Topics a connection remembers whether routes take; past it, it starts afresh."""


def cert_name_for(identity: str, names: frozenset[str]) -> str | None:
    """The client certificate name a LOGIN identifier is, or extends; None if neither.

    Spec, "Client certificate": LOGIN MUST succeed for any identifier matching
    the Common Name or a Subject Alternative Name, and MAY for such a name
    followed by ``/`` and one or more ID characters (several connections with
    one certificate): ``alice/laptop`` is ``alice``'s (the longest name wins).

    Spec deviation: ``names`` are the certificate's names of the listener's
    ``cert_identity`` types, by default its Common Name alone, not every SAN
    as the spec's MUST says: a CA that issues ``DNS:bob`` vouches for a host,
    not for the login name ``bob`` (docs/tls.rst, "Which certificate names
    are identities").
    """
    if identity in names:
        return identity
    bases = [n for n in names if identity.startswith(n + "/") and len(identity) > len(n) + 1]
    return max(bases, key=len, default=None)


def secret_name_for(identity: str, logins: Mapping[str, bytes]) -> str:
    """Whose secret a ``secret`` login as ``identity`` must present, and who it then is.

    ``identity`` itself when it has a secret of its own (or none has, and
    the shared ``*`` secret applies). ``name/suffix`` without a secret of its
    own is ``name``'s, when ``name`` has one (the longest such ``name``): the
    suffix form the spec allows for certificate names ("Client
    certificate"), for several connections of one peer, which the TLS
    front-end passes on as a ``secret`` login with the certificate name's
    secret.
    """
    if identity in logins:
        return identity
    cut = identity.rfind("/")
    while cut > 0:
        if identity[cut + 1 :] and identity[:cut] in logins:
            return identity[:cut]
        cut = identity.rfind("/", 0, cut)
    return identity


def cert_identity_matches(identity: str, names: frozenset[str]) -> bool:
    """Whether a LOGIN identifier is allowed by a client certificate's names (`cert_name_for`)."""
    return cert_name_for(identity, names) is not None


def outcome_response(outcome: Outcome) -> bytes:
    """Map a route outcome to the SSMP response line for the publisher.

    Accepted is 200. SSMP has no code for "try again later"; a temporary
    failure is answered 400 with a payload starting ``retry:`` so that a
    person (or a client that looks) can tell it from a permanent rejection.
    """
    if outcome.status is Status.ACCEPTED:
        return OK
    if outcome.status is Status.RETRY:
        return ssmp.response_line(400, f"retry: {outcome.reason}")
    return ssmp.response_line(400, f"rejected: {outcome.reason}")


def ucast_response(result: Result) -> bytes:
    """Map a routed UCAST's result to the SSMP response line for its sender.

    Spec, "Unicast": 404 when no peer with the identifier is connected. A
    UCAST that no route took after all (a route's ``match_sender``), or
    that a route's destination rejected with code ``404`` (the far hub has
    no such peer), is answered ``404``; other outcomes as `outcome_response`.
    """
    if isinstance(result, Unrouted):
        return _NO_SUCH_PEER
    if result.code == "404" and result.status is Status.REJECTED:
        return ssmp.response_line(404, result.reason or "no such peer")
    return outcome_response(result)


class _Pending:
    """A response slot waiting for a route outcome (of an MCAST, a UCAST or a BCAST)."""

    __slots__ = ("line", "ucast")

    def __init__(self, ucast: bool) -> None:
        self.line: bytes | None = None
        self.ucast = ucast


class SSMPServerProtocol(ListenerConnection["SSMPServerFactory"]):
    """One peer connected to the hub."""

    def __init__(self, factory: SSMPServerFactory) -> None:
        super().__init__(factory)
        self.hub = factory.hub
        self.identity = b""
        self.principal: str | None = None
        """The authenticated identity allow-lists are checked against (None: anonymous, open)."""
        self.topics: dict[bytes, bool] = {}
        self._codec = ssmp.SSMPCodec(ssmp.Role.SERVER)
        self._pending: deque[bytes | _Pending] = deque()
        self._logged_in = False
        self._last_heard = 0.0
        self._mcast_prefix = b""
        self._ucast_prefix = b""
        self._timer: IDelayedCall | None = None
        self._awaiting_pong = False
        self._inbox: Inbox[_Pending] = Inbox(
            factory.router, factory.name, self._answer, self._answer_batch
        )
        self._sender = ""
        """The identity as text: the sender of the messages routes take."""
        self._max_pending = factory.settings.max_pending_replies
        self._routes_table: RouteTable | None = None
        self._routed_topics: dict[bytes, str | None] | None = None
        """For `_routes_table`: each topic seen, as an address if routes take it (else
        None); None when no route takes anything from this listener."""
        self._login_wait: IDelayedCall | None = None
        """Set while a LOGIN waits for the refusals its address or identity still owe."""
        self._waited = False
        """The LOGIN waited once: if a wait is still owed, it is refused unchecked."""
        self._held: tuple[list[ssmp.Line], ssmp.SSMPError | None] = ([], None)
        """That LOGIN, what came after it in its read, and that read's error."""
        self._dispatching = False
        """Set while a read's batch is handed to the router: its answers go with the read's."""

    # --- connection life ----------------------------------------------------

    def _connection_started(self) -> None:
        """Start the login time-out."""
        self._last_heard = self.factory.clock.seconds()
        self._timer = self._call_later(
            self.factory.settings.login_timeout_seconds, self._login_timed_out
        )

    def _connection_ended(self, reason: Failure) -> None:
        """Unsubscribe from everything (presence events)."""
        if self._logged_in:
            self.hub.detach(self)
            self.hub.schedule_flush()

    def _partial_frame_bytes(self) -> int:
        return self._codec.pending_bytes

    def _may_read(self) -> bool:
        return (
            len(self._pending) < self.factory.settings.max_pending_replies
            and self._login_wait is None
        )

    def _finish(self) -> None:
        """Read no more requests; close once every pending response is written.

        Used after CLOSE, a 400 and a 401. Responses still waiting for a
        route outcome get it first, so that their senders learn the truth;
        the route time-out bounds the wait.
        """
        self._finishing = True
        self._pause_reading()
        if not self._pending:
            self._close()

    def evict(self, reason: str) -> None:
        """Close because the identity logged in again elsewhere."""
        self._log.info(
            "{listener}: closing older connection of {identity}: {reason}",
            listener=self.factory.name,
            identity=self.identity.decode("ascii"),
            reason=reason,
        )
        self._logged_in = False  # the hub has already detached it
        self._close()

    # --- output -------------------------------------------------------------

    def queue(self, data: bytes, lines: int = 1) -> None:
        """Queue bytes (``lines`` SSMP lines) for this peer (see `Hub.flush`)."""
        if self._closing:
            return
        out = self._out
        if not out:
            self.hub.mark_dirty(self)
        out.append(data)
        self._out_count += lines

    # --- input ----------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        """Decode and handle every complete request, then flush the batch."""
        if self._finishing or self._closing:
            return
        self._last_heard = self.factory.clock.seconds()
        error: ssmp.SSMPError | None = None
        try:
            lines = self._codec.receive_data(data)
        except ssmp.SSMPError as exc:
            error = exc
            lines = exc.events  # type: ignore[assignment]
        self.factory.count_in(len(lines), len(data))
        self._handle_lines(lines, error)
        held = self._codec.pending_bytes
        if held or self._partial_since is not None:
            self._frame_read(bool(lines), held)
        self.hub.flush(self)

    def _handle_lines(self, lines: list[ssmp.Line], error: ssmp.SSMPError | None) -> None:
        """Handle a read's requests in order, then its error; a waiting LOGIN holds the rest."""
        handlers = self._handlers
        for index, line in enumerate(lines):
            handlers[type(line)](self, line)
            if self._finishing:
                break
            if self._login_wait is not None:
                self._held = (lines[index:], error)
                error = None
                break
        self._dispatching = True
        try:
            self._inbox.dispatch()  # the read's routed MCASTs, one batch
        finally:
            self._dispatching = False
        if error is not None and not self._finishing:
            self._protocol_error(error)

    def _login_waited(self) -> None:
        """The wait is over: handle the LOGIN (checked now) and what came after it."""
        self._login_wait = None
        (lines, error), self._held = self._held, ([], None)
        self._handle_lines(lines, error)
        self.hub.flush(self)
        self._resume_reading()

    def _protocol_error(self, error: ssmp.SSMPError) -> None:
        self.factory.count_error(error.kind)
        self._log.warn(
            "{listener}: bad input from {peer}: {reason}; answering 400 and closing",
            listener=self.factory.name,
            peer=self._who(),
            reason=error.reason,
        )
        self._respond(error.reply or ssmp.response_line(400))
        self._finish()

    def _who(self) -> str:
        if self.identity:
            return self.identity.decode("ascii")
        peer = self._peer()
        return str(getattr(peer, "host", peer))

    # --- responses in request order -----------------------------------------------

    def _respond(self, line: bytes) -> None:
        if self._pending:
            self._pending.append(line)
        else:
            self.queue(line)

    def _respond_later(self, message: Message, ucast: bool = False) -> None:
        """Route the message with the rest of this read; its response waits in a slot."""
        slot = _Pending(ucast)
        pending = self._pending
        pending.append(slot)
        if len(pending) >= self._max_pending:
            self._pause_reading()
        self._inbox.add(message, slot)

    def _answer(self, slot: _Pending, result: Result) -> None:
        """A routed request's outcome: fill its slot, write the responses now in order."""
        if slot.ucast:
            line = ucast_response(result)
        else:
            # No route after all (a route's match_sender): as without routes, 200.
            line = OK if isinstance(result, Unrouted) else outcome_response(result)
        self._fill(slot, line)

    def _answer_batch(self, slots: list[_Pending], outcomes: list[Outcome]) -> None:
        """A route's batch answered: fill its slots, then write what is in order, once.

        Answered outside a read (a broker's confirm), the responses go to the
        socket at once (`push_answers`), not a reactor turn or two later.
        """
        for slot, outcome in zip(slots, outcomes, strict=True):
            # Accepted is 200 for a UCAST too (`ucast_response`).
            if outcome.status is Status.ACCEPTED:
                slot.line = OK
            else:
                slot.line = ucast_response(outcome) if slot.ucast else outcome_response(outcome)
        self._write_ready()
        if not self._dispatching:
            self.push_answers(len(slots))

    def _fill(self, slot: _Pending, line: bytes) -> None:
        """Give a slot its response; write the responses now in order."""
        slot.line = line
        self._write_ready()

    def _write_ready(self) -> None:
        """Write the responses now in order (one write); resume reading if it may."""
        pending = self._pending
        lines: list[bytes] = []
        while pending:
            head = pending[0]
            if isinstance(head, bytes):
                lines.append(head)
            elif head.line is not None:
                lines.append(head.line)
            else:
                break
            pending.popleft()
        if lines:
            self.queue(lines[0] if len(lines) == 1 else b"".join(lines), len(lines))
        if self._closing:
            return
        if self._finishing:
            if not pending:
                self._close()
            return
        self.hub.schedule_flush()
        self._resume_reading()

    # --- timers -----------------------------------------------------------------------

    def _login_timed_out(self) -> None:
        # Spec, "Login": no request after a reasonable period: close without a response.
        self._timer = None
        self._log.info(
            "{listener}: no LOGIN from {peer} within {seconds} s; closing",
            listener=self.factory.name,
            peer=self._who(),
            seconds=self.factory.settings.login_timeout_seconds,
        )
        self.factory.count_error("login-timeout")
        self._close()

    def _arm_idle_timer(self, delay: float) -> None:
        self._timer = self._call_later(delay, self._idle_check)

    def _idle_check(self) -> None:
        settings = self.factory.settings
        now = self.factory.clock.seconds()
        quiet = now - self._last_heard
        if self._awaiting_pong:
            if quiet >= settings.pong_timeout_seconds:
                self._timer = None
                self._log.info(
                    "{listener}: no PONG from {peer} within {seconds} s; aborting",
                    listener=self.factory.name,
                    peer=self._who(),
                    seconds=settings.pong_timeout_seconds,
                )
                self.factory.count_error("pong-timeout")
                self._abort()  # given up on: it keeps nothing we wrote (issue 18)
                return
            self._awaiting_pong = False
        if quiet >= settings.ping_interval_seconds:
            # Spec, "Server-initiated": PING after a period without requests.
            self._awaiting_pong = True
            self.queue(PING_EVENT)
            self.flush()
            self._arm_idle_timer(settings.pong_timeout_seconds)
            return
        self._arm_idle_timer(settings.ping_interval_seconds - quiet)

    # --- requests -----------------------------------------------------------------------

    def _on_login(self, login: ssmp.Login) -> None:
        if self._logged_in:
            self._respond(ssmp.response_line(405, "already logged in"))
            return
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        offered = self.factory.schemes_for(self._is_tls())
        scheme = login.scheme.decode("ascii")
        identity = login.identity.decode("ascii")
        logins = self.factory.logins
        wait = logins.wait_seconds(self._peer(), identity)
        if wait > 0 and not self._waited:
            # Checked once the refusal its address or identity owes is answered.
            self._waited = True
            self._login_wait = self._call_later(wait, self._login_waited)
            self._pause_reading()
            return
        why = (
            UNCHECKED
            if wait > 0
            else self._authenticate(identity, scheme, login.credential, offered)
        )
        principal = self._principal(identity, scheme)
        if why is None and not self.factory.authorization.knows(principal):
            why = (
                f"{principal or 'a peer without an authenticated identity'} is granted nothing"
                f" here (listeners.{self.factory.name}.authorize)"
            )
        previous = self.hub.peers.get(login.identity)
        if why is None and previous is not None and previous is not self:
            # The spec: this login replaces the connection with the same identifier.
            self.factory.release(cast(SSMPServerProtocol, previous))  # the hub's peers are ours
        if why is None and not self.factory.admit(self, principal):
            assert principal is not None
            why = self.factory.per_identity_refusal(principal)
        if why is not None:
            self.factory.count_error("unauthorized")
            delay = logins.refused(
                peer=self._peer(),
                identity=identity,
                mechanism=f"LOGIN {scheme}",
                why=why,
                checked=wait == 0,
            )
            # Spec: 401 with a space-separated list of supported schemes, then close.
            refusal = ssmp.response_line(401, " ".join(sorted(offered)))
            if delay > 0:
                self._finishing = True  # nothing more is read meanwhile
                self._pause_reading()
                self._call_later(delay, self._refuse_login, refusal)
            else:
                self._refuse_login(refusal)
            return
        logins.accepted(identity)
        self.identity = login.identity
        self._sender = identity
        self.principal = principal
        self._logged_in = True
        self._mcast_prefix = b"000 " + login.identity + b" MCAST "
        self._ucast_prefix = b"000 " + login.identity + b" UCAST "
        self._respond(OK)
        self.hub.attach(self)
        self._arm_idle_timer(self.factory.settings.ping_interval_seconds)

    def _refuse_login(self, refusal: bytes) -> None:
        self._respond(refusal)
        self._finish()

    def _principal(self, identity: str, scheme: str) -> str | None:
        """The identity a login authenticates, for the allow-lists.

        A ``secret`` login authenticates the name whose secret it gave
        (`secret_name_for`); a ``cert`` login the certificate name it matched
        (``alice`` for ``alice/laptop``, either way).
        Anonymous and ``open`` logins authenticate nobody.
        """
        if identity == "." or scheme not in ("secret", "cert"):
            return None
        if scheme == "cert":
            return cert_name_for(
                identity, peer_identities(self.transport, self.factory.cert_identity)
            )
        return secret_name_for(identity, self.factory.secrets.logins)

    def _allowed(self, action: Action, topic: bytes) -> bool:
        """Check the allow-lists; answer 405 (Not Allowed) if refused."""
        if self.factory.authorized(action, self.principal, topic.decode("ascii"), self._peer()):
            return True
        self._respond(ssmp.response_line(405, f"not allowed to {action.value} {topic.decode()}"))
        return False

    def _is_tls(self) -> bool:
        return ISSLTransport.providedBy(self.transport)

    def _authenticate(
        self, identity: str, scheme: str, credential: bytes | None, offered: frozenset[str]
    ) -> str | None:
        """Return None if the login is good, else why not (for the log only)."""
        # Spec, "Login": an unsupported scheme gets 401, for the anonymous id too.
        if scheme not in offered:
            return f"scheme {scheme!r} is not offered here"
        if identity == ".":
            return None if self.factory.settings.anonymous else "anonymous login is disabled"
        if scheme == "open":
            return None  # Spec: the server MUST ignore the credential.
        if scheme == "secret":
            owner = secret_name_for(identity, self.factory.secrets.logins)
            if self.factory.secrets.verify(owner, credential):
                return None
            return "wrong or missing secret"
        if scheme == "cert":
            names = peer_identities(self.transport, self.factory.cert_identity)
            if not names:
                return "no client certificate"
            if cert_identity_matches(identity, names):
                return None
            return f"certificate names {sorted(names)} do not include {identity!r}"
        return f"scheme {scheme!r} is not implemented"  # pragma: no cover

    def _on_close(self, line: ssmp.Close) -> None:
        # Spec, "Closing connections": reply 200 and immediately close. Requests
        # before it that still wait for a route outcome are answered first.
        self._respond(OK)
        self._finish()

    def _on_ping(self, line: ssmp.Ping) -> None:
        # Spec, "Client-initiated": answer with a PONG event from the anonymous id.
        self.queue(PONG_EVENT)

    def _on_pong(self, line: ssmp.Pong) -> None:
        # Spec: servers MUST NOT send any message in response to a PONG.
        self._awaiting_pong = False

    def _on_subscribe(self, line: ssmp.Subscribe) -> None:
        if self.identity == ssmp.ANONYMOUS:
            self._respond(ssmp.response_line(405, "anonymous peers cannot SUBSCRIBE"))
        elif line.topic in self.topics:
            self._respond(ssmp.response_line(409, "already subscribed"))
        elif self._allowed(Action.CONSUME, line.topic):
            fleet = self.hub.fleet
            if fleet is None:
                self._respond(OK)
                self.hub.subscribe(self, line.topic, line.presence)
                return
            # In a fleet, 200 once what any node publishes to the topic comes
            # here (this node's binding is in place, no node holds it quiet).
            slot = _Pending(False)
            self._pending.append(slot)
            self.hub.subscribe(self, line.topic, line.presence)
            fleet.when_subscribed(line.topic, functools.partial(self._fill, slot, OK))

    def _on_unsubscribe(self, line: ssmp.Unsubscribe) -> None:
        if self.identity == ssmp.ANONYMOUS:
            self._respond(ssmp.response_line(405, "anonymous peers cannot UNSUBSCRIBE"))
        elif self.hub.unsubscribe(self, line.topic):
            self._respond(OK)
        else:
            self._respond(ssmp.response_line(404, "not subscribed"))

    def _on_mcast(self, line: ssmp.Mcast) -> None:
        topic = line.topic
        payload = line.payload
        prefix = self._mcast_prefix
        # The forwarded event must itself fit SSMP's limit.
        if len(prefix) + len(topic) + len(payload) + 2 > ssmp.MAX_LINE_BYTES:
            self._respond(_TOO_LONG_TO_FORWARD)
            return
        factory = self.factory
        if factory.authorization.restricted and not self._allowed(Action.PUBLISH, topic):
            return
        hub = self.hub
        if topic in hub.topics or hub.fleet is not None:  # else nobody takes the event
            hub.mcast(self, topic, b"".join((prefix, topic, b" ", payload, b"\n")))
        table = factory.router.table
        if table is not self._routes_table:
            self._routes_table = table
            self._routed_topics = {} if factory.name in table.sources() else None
        known = self._routed_topics
        address: str | None = None
        if known is not None:
            try:
                address = known[topic]
            except KeyError:
                address = self._routed_address(topic)
        if address is None:
            self._respond(OK)
        else:
            # The read's time is the arrival time of all its messages: one
            # clock call per read, and the entries they make share it.
            self._respond_later(mcast_message(self._sender, address, payload, self._last_heard))

    def _routed_address(self, topic: bytes) -> str | None:
        """An MCAST topic's address if routes take it, else None; remembered per route table."""
        known = self._routed_topics
        assert known is not None
        if len(known) >= MAX_ROUTED_TOPICS:
            known.clear()
        address = topic.decode("ascii")
        routed = self.factory.router.table.match(self.factory.name, address)
        known[topic] = address if routed else None
        return known[topic]

    def _on_ucast(self, line: ssmp.Ucast) -> None:
        to = line.to
        if to == ssmp.ANONYMOUS:
            self._respond(ssmp.response_line(405, "anonymous peers cannot receive UCAST"))
            return
        factory = self.factory
        if factory.authorization.restricted and not self._allowed(Action.PUBLISH, to):
            return
        target = self.hub.peers.get(to)
        if target is None and self.hub.fleet is not None:
            self._ucast_across(to, line.payload)
            return
        if target is None:
            # Not connected here: a route taking ``!ucast.<to>`` may know the peer.
            if factory.routed and factory.router.has_routes(factory.name, ucast_address(to)):
                message = message_from_ucast(self.identity, to, line.payload, self._last_heard)
                self._respond_later(message, ucast=True)
            else:
                self._respond(_NO_SUCH_PEER)
            return
        prefix = self._ucast_prefix
        if len(prefix) + len(to) + len(line.payload) + 2 > ssmp.MAX_LINE_BYTES:
            self._respond(_TOO_LONG_TO_FORWARD)
            return
        target.queue(prefix + to + b" " + line.payload + b"\n")
        self._respond(OK)

    def _ucast_across(self, to: bytes, payload: bytes) -> None:
        """UCAST to a peer not connected here: through the fleet, then a route if none has it."""
        event = self._ucast_prefix + to + b" " + payload + b"\n"
        if len(event) > ssmp.MAX_LINE_BYTES:
            self._respond(_TOO_LONG_TO_FORWARD)
            return
        fleet = self.hub.fleet
        assert fleet is not None
        slot = _Pending(ucast=True)
        self._pending.append(slot)
        if len(self._pending) >= self.factory.settings.max_pending_replies:
            self._pause_reading()
        factory = self.factory
        routed = factory.routed and factory.router.has_routes(factory.name, ucast_address(to))
        sent = factory.clock.seconds()

        def answered(outcome: Outcome) -> None:
            if routed and outcome.code == "404" and not self._closing:
                # No node has the peer: a route taking ``!ucast.<to>`` may know it.
                self._inbox.add(message_from_ucast(self.identity, to, payload, sent), slot)
                self._inbox.dispatch()
            else:
                self._answer(slot, outcome)

        fleet.ucast(to, event, answered)

    def _on_bcast(self, line: ssmp.Bcast) -> None:
        if self.identity == ssmp.ANONYMOUS:
            self._respond(ssmp.response_line(405, "anonymous peers cannot BCAST"))
            return
        factory = self.factory
        routed = factory.routed and factory.router.has_routes(factory.name, BCAST_ADDRESS)
        if factory.authorization.restricted:
            # BCAST reaches the sender's topics: it needs the right to publish to each,
            # and to ``!bcast`` when a route takes it beyond the hub.
            for topic in self.topics:
                if not self._allowed(Action.PUBLISH, topic):
                    return
            if routed and not self._allowed(Action.PUBLISH, _BCAST_ADDRESS_BYTES):
                return
        event = b"000 " + self.identity + b" BCAST " + line.payload + b"\n"
        if len(event) > ssmp.MAX_LINE_BYTES:
            self._respond(_TOO_LONG_TO_FORWARD)
            return
        self.hub.bcast(self, event)
        if routed:
            message = message_from_bcast(self.identity, line.payload, self._last_heard)
            self._respond_later(message)
        else:
            self._respond(OK)

    def _on_compat(self, line: ssmp.Compat) -> None:
        # Spec, "Forward compatibility": unrecognized verb, 501.
        verb = line.verb.decode("ascii")
        self._respond(ssmp.response_line(501, f"{verb} is not implemented"))

    _handlers: Final[dict[type, Callable[[SSMPServerProtocol, ssmp.Line], None]]] = {
        ssmp.Mcast: _on_mcast,  # type: ignore[dict-item]
        ssmp.Ucast: _on_ucast,  # type: ignore[dict-item]
        ssmp.Bcast: _on_bcast,  # type: ignore[dict-item]
        ssmp.Subscribe: _on_subscribe,  # type: ignore[dict-item]
        ssmp.Unsubscribe: _on_unsubscribe,  # type: ignore[dict-item]
        ssmp.Ping: _on_ping,  # type: ignore[dict-item]
        ssmp.Pong: _on_pong,  # type: ignore[dict-item]
        ssmp.Close: _on_close,  # type: ignore[dict-item]
        ssmp.Login: _on_login,  # type: ignore[dict-item]
        ssmp.Compat: _on_compat,  # type: ignore[dict-item]
    }


_BCAST_ADDRESS_BYTES: Final = BCAST_ADDRESS.encode("ascii")
_TOO_LONG_TO_FORWARD: Final = ssmp.response_line(
    400, f"too long to forward: the event would pass the {ssmp.MAX_LINE_BYTES}-byte limit"
)


class SSMPServerFactory(ListenerFactory[SSMPServerProtocol, SSMPListenerSettings]):
    """Builds hub connections for one SSMP listener.

    Args:
        name: The listener's name.
        settings: Its validated settings.
        hub: Its hub (also its route destination).
        router: Where MCASTs with matching routes go.
        secrets: For the ``secret`` scheme.
        clock: Timers and timestamps.
        metrics: Counters, or None in tests that do not look.
    """

    protocol = SSMPServerProtocol
    kind = "ssmp"
    _log = Logger()

    def __init__(
        self, *, hub: Hub, router: Router, **common: Unpack[ListenerArgs[SSMPListenerSettings]]
    ) -> None:
        super().__init__(**common)
        self.hub = hub
        self.router = router
        schemes = self.settings.schemes
        self._offered_plain = frozenset(schemes - {"cert"})
        self._offered_tls = frozenset(schemes | {"cert"})

    @property
    def routed(self) -> bool:
        """Whether any route takes messages from this listener."""
        return self.name in self.router.table.sources()

    def schemes_for(self, tls: bool) -> frozenset[str]:
        """Login schemes offered on a plain or a TLS connection."""
        return self._offered_tls if tls else self._offered_plain

    def count_in(self, lines: int, size: int) -> None:
        """Count received lines and bytes (once per batch)."""
        traffic = self.traffic
        traffic.messages_in += lines
        traffic.bytes_in += size
