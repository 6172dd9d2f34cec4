"""The MTL listener's control flow: sessions, SASL logins, profiles and data leases.

Control (spec, "Control Flow"): per REQ peer, Connection.Open (protocol
``MTL`` version 1) is answered ``201 Ready`` with the profiles, or ``401
Unauthorized`` with the configured mechanisms when ``require_auth``;
Connection.Authorize takes PLAIN (base64 of ``authzid NUL user NUL
password``, checked against the secrets file): ``201`` on success, ``401``
on failure, ``402 Challenged`` with an empty challenge when the response is
empty (the client is to send its credentials in the next round, RFC 4616).
SCRAM-SHA-256 (RFC 7677), when offered, takes rounds of ``402``: the
client-first message is answered with the server-first as the challenge,
the client-final with the server-final (``v=``, the server's proof that it
knows the secret too), and the empty response that acknowledges it with
``201``. Spec ambiguity: 201 has no field for SASL's "additional data with
success", so the server-final travels in a last 402, as RFC 4422 section 3
prescribes for such protocols. EXTERNAL takes the identity the ZAP handler
gave the client's CURVE key. A session whose login no longer verifies
against the secrets is asked again with ``401`` on its next request.
Connection.Profile: ``200`` or ``400``. Connection.Reader and
Connection.Writer (after a profile, else ``400``): ``202`` with the data
port and a lease, ``501`` for a confirmation model the profile lacks,
``400`` for resources it does not have. Ill-formed requests (frame count,
JSON) are dropped silently, as the spec says; other invalid requests get
``400`` with a reason. Every reply is valid JSON (the spec's 202 example is
not).

Refused logins wait before they are answered, and a session that keeps
guessing is closed (`LoginRefusals`). A Connection.Authorize that comes
while a refusal for its address or claimed identity is still owed is not
checked: it is refused once that wait is over (a REQ client asks again).

A session is its connection's: ZeroMQ names a peer by a routing id the
peer may choose, and once a connection is gone another may take its
routing id. Each session keeps the number the listener's ZAP handler gave
its connection (`ZmqSocket.connection`); a request under its routing id
from another connection finds no session (the old one is over, logged, and
nothing of it, a login least of all, is inherited), and a session ends when
ZeroMQ says its connection closed (`ControlFlow.closed`).

`ControlFlow` serves one listener (`ControlHost`: what it reads of the
listener, which the assembly may change after it is made); the data flow
finds the leases it granted with `ControlFlow.lease`.
"""

from __future__ import annotations

import base64
import binascii
import secrets as random_texts
from collections import OrderedDict
from typing import Any, Final, Protocol

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from gateway.codecs import mtl, scram
from gateway.core.auth import ANY_IDENTITY, Secrets
from gateway.core.authorization import Action, Authorization, check
from gateway.metrics import TrafficCounters
from gateway.protocols.logins import UNCHECKED, LoginRefusals
from gateway.protocols.mtl.settings import MTLListenerSettings

__all__ = ["TEST_RESOURCE", "ControlFlow", "ControlHost", "DataLease"]

TEST_RESOURCE: Final = "resource"
"""The test profile's one resource (spec, "The Test Profile")."""

Reply = tuple[int, dict[str, Any]]


@attrs.define
class _Session:
    """One control peer (a REQ socket)."""

    connection: str | None = None
    """The connection it was opened on (ZAP's number; None: not known)."""
    fd: int | None = None
    """That connection's file descriptor, by which ZeroMQ says it closed."""
    ended: bool = False
    """Its connection is gone: nothing more is sent under its routing id for it."""
    opened: bool = False
    identity: str | None = None
    secret: bytes | None = None
    external: bool = False
    """Logged in with EXTERNAL: the identity is the ZAP User-Id of its CURVE key."""
    claimed: str | None = None
    """The identity its last Connection.Authorize claimed (where a refusal counts)."""
    refused: int = 0
    """Refused Connection.Authorize since its Connection.Open."""
    answer_in: float = 0.0
    """How long the answer to its request must wait (a login's, `LoginRefusals`)."""
    waiting: bool = False
    """An answer is held back: its requests are dropped meanwhile (a REQ peer sends none)."""
    profile: str | None = None
    scram: scram.ScramServer | None = None


@attrs.define
class DataLease:
    """A data lease granted by a 202 reply."""

    profile: str
    kind: str  # "reader" or "writer"
    resources: tuple[str, ...]
    confirm: str
    identity: str | None = None
    """The session's authenticated identity when the lease was granted."""


class ControlHost(Protocol):
    """What the control flow reads of its listener (the assembly sets some after it is made)."""

    name: str
    settings: MTLListenerSettings
    secrets: Secrets
    clock: IReactorTime
    traffic: TrafficCounters
    authorization: Authorization
    data_port: int

    @property
    def logins(self) -> LoginRefusals:
        """Its refused logins: waits, counter and log."""

    @property
    def control_socket(self) -> Any:
        """The control ROUTER socket (`ZmqSocket`)."""

    @property
    def running(self) -> bool:
        """Whether its sockets are open (a held-back answer for a stopped listener is dropped)."""

    def count_error(self, kind: str, count: int = 1) -> None:
        """Count protocol errors of some kind."""


class ControlFlow:
    """The control flow of one MTL listener: its sessions and the leases they were granted.

    Args:
        host: The listener.
    """

    _log = Logger()

    def __init__(self, host: ControlHost) -> None:
        self._host = host
        # Both bounded (settings.max_sessions, max_leases), least recently used
        # first out: nothing a peer sends grows them without limit.
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._leases: OrderedDict[str, DataLease] = OrderedDict()
        self._by_fd: dict[int, bytes] = {}
        """The routing id of each session by its connection's file descriptor."""

    def lease(self, token: str) -> DataLease | None:
        """The lease a 202 reply gave as ``token``, if it is still remembered."""
        return self._leases.get(token)

    def closed(self, fd: int) -> None:
        """ZeroMQ says the connection with file descriptor ``fd`` closed: its session ends."""
        identity = self._by_fd.pop(fd, None)
        if identity is None:
            return
        session = self._sessions.get(identity)
        if session is not None and session.fd == fd:
            del self._sessions[identity]
            session.ended = True

    # --- requests ----------------------------------------------------------------------

    def receive(self, frames: list[bytes]) -> None:
        """Handle one message of the control socket (routing id first) and answer it."""
        if len(frames) < 2:
            return
        host = self._host
        identity, rest = frames[0], frames[1:]
        # A REQ peer's messages carry an empty delimiter frame after the identity.
        envelope = [identity]
        if rest and rest[0] == b"":
            envelope.append(b"")
            rest = rest[1:]
        host.traffic.messages_in += 1
        request = mtl.parse_request(rest)
        if request is None:
            host.count_error("ill-formed-request")
            return  # the spec: drop it silently
        session = self._session(identity, request.command == "connection.open")
        if session is not None and session.waiting:
            host.count_error("request-while-waiting")
            return  # a REQ peer waits for its answer: only a misbehaving one gets here
        if session is None:
            status, body = _bad("send Connection.Open first")
        else:
            status, body = self._answer(session, request)
        answer = envelope + mtl.reply(status, body)
        if session is not None and session.answer_in > 0:
            session.waiting = True
            host.clock.callLater(session.answer_in, self._answer_later, session, answer)
            session.answer_in = 0.0
            return
        host.control_socket.send(answer)
        host.traffic.messages_out += 1

    def _answer_later(self, session: _Session, answer: list[bytes]) -> None:
        """Send an answer held back (a login's); the session is heard again."""
        session.waiting = False
        host = self._host
        if not host.running:
            return  # stopped meanwhile
        if session.ended:
            return  # its connection is gone: the routing id may be another's now
        host.control_socket.send(answer)
        host.traffic.messages_out += 1

    def _session(self, identity: bytes, opening: bool) -> _Session | None:
        """The control peer's session, made the most recently used; the oldest may go.

        Only Connection.Open makes a session: other requests from an unknown
        peer are refused without anything kept. A session opened on another
        connection than the request's is over.
        """
        sessions = self._sessions
        socket = self._host.control_socket
        connection = getattr(socket, "connection", None)
        session = sessions.get(identity)
        if session is not None and session.connection != connection:
            self._taken(identity, session)
            session = None
        if session is None:
            if not opening:
                return None
            session = sessions[identity] = _Session(connection=connection)
            source_fd = getattr(socket, "source_fd", None)
            session.fd = source_fd() if source_fd is not None else None
            if session.fd is not None:
                self._by_fd[session.fd] = identity
            if len(sessions) > self._host.settings.max_sessions:
                oldest, forgotten = sessions.popitem(last=False)  # it must Open again
                if forgotten.fd is not None and self._by_fd.get(forgotten.fd) == oldest:
                    del self._by_fd[forgotten.fd]
        else:
            sessions.move_to_end(identity)
        return session

    def _taken(self, identity: bytes, session: _Session) -> None:
        """Another connection took a session's routing id: the session is over, not inherited."""
        del self._sessions[identity]
        session.ended = True
        if session.fd is not None and self._by_fd.get(session.fd) == identity:
            del self._by_fd[session.fd]
        host = self._host
        self._log.info(
            "MTL listener {listener}: control routing id {routing_id!r} now comes from another"
            " connection (from {peer}): the session of the old one ({who}) is over, not"
            " inherited",
            listener=host.name,
            routing_id=identity,
            peer=getattr(host.control_socket, "peer_address", None) or "an unknown address",
            who=f"logged in as {session.identity}"
            if session.identity is not None
            else "not logged in",
        )

    def _answer(self, session: _Session, request: mtl.ControlRequest) -> Reply:
        command, body = request.command, request.body
        if command == "connection.open":
            protocol = body.get("protocol")
            if (
                not isinstance(protocol, dict)
                or str(protocol.get("name", "")).upper() != "MTL"
                or protocol.get("version") != 1
            ):
                return _bad('Connection.Open needs "protocol": {"name": "MTL", "version": 1}')
            session.opened = True
            session.profile = session.scram = None
            session.refused = 0
            return self._ready_or_challenge(session)
        if not session.opened:
            return _bad("send Connection.Open first")
        if command == "connection.authorize":
            return self._authorize(session, body)
        if self._host.settings.require_auth and not self._still_valid(session):
            session.identity = session.secret = None
            session.external = False
            return 401, self._unauthorized()
        if command == "connection.profile":
            profile = str(body.get("profile", "")).lower()
            if profile not in self._host.settings.profiles:
                return _bad(f"unknown profile {body.get('profile')!r}")
            session.profile = profile
            return 200, {"status": "OK"}
        if command in ("connection.reader", "connection.writer"):
            return self._lease(session, command.split(".")[1], body)
        return _bad(
            f"unknown command {request.command!r}; MTL has Connection.Open, .Authorize,"
            " .Profile, .Reader and .Writer"
        )

    # --- logins ------------------------------------------------------------------------

    def _ready(self) -> Reply:
        return 201, {"status": "Ready", "profiles": list(self._host.settings.profiles)}

    def _ready_or_challenge(self, session: _Session) -> Reply:
        if self._host.settings.require_auth and not self._still_valid(session):
            return 401, self._unauthorized()
        return self._ready()

    def _still_valid(self, session: _Session) -> bool:
        if session.external:
            return session.identity is not None and session.identity == self._user_id()
        if session.identity is None or session.secret is None:
            return False
        return self._host.secrets.verify(session.identity, session.secret)

    def _unauthorized(self, reason: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "status": "Unauthorized",
            "mechanisms": list(self._host.settings.mechanisms),
        }
        if reason is not None:
            body["reason"] = reason
        return body

    def _authorize(self, session: _Session, body: dict[str, Any]) -> Reply:
        """Connection.Authorize, its answer held back as `LoginRefusals` says.

        A refusal (401) waits longer the more refusals in a row its peer's
        address or claimed identity had; one that comes while such a wait
        is owed is refused, unchecked, when it is over; after
        ``login_failures_per_connection`` refusals the session is closed:
        it must Connection.Open again.
        """
        host = self._host
        logins, address = host.logins, getattr(host.control_socket, "peer_address", None)
        mechanism = str(body.get("mechanism", "")).upper()
        owed = logins.wait_seconds(address, _claimed(session, mechanism, body))
        checked = owed == 0
        if checked:
            session.claimed = None
            status, reply = self._sasl(session, body)
        else:
            session.claimed, session.scram = _claimed(session, mechanism, body), None
            status, reply = 401, self._unauthorized(f"{UNCHECKED}: ask again after this answer")
        if status == 201:
            logins.accepted(session.identity)
        elif status == 401:
            session.refused += 1
            delay = logins.refused(
                peer=address,
                identity=session.claimed,
                mechanism=f"SASL {mechanism or '(none)'}",
                why=reply.get("reason", "wrong user or password"),
                checked=checked,
            )
            session.answer_in = delay if checked else owed
            if logins.spent(session.refused):
                session.opened = False
                session.scram = None
                reply["reason"] = (
                    f"{session.refused} refused logins: this session is closed;"
                    " send Connection.Open to begin again"
                )
        return status, reply

    def _sasl(self, session: _Session, body: dict[str, Any]) -> Reply:
        mechanism = str(body.get("mechanism", "")).upper()
        exchange, session.scram = session.scram, None
        if mechanism not in self._host.settings.mechanisms:
            return 401, self._unauthorized()
        try:
            raw = base64.b64decode(str(body.get("response", "")), validate=True)
        except (binascii.Error, ValueError):
            return _bad("the response is not base64")
        if mechanism == scram.MECHANISM:
            return self._scram(session, exchange, raw)
        if mechanism == "EXTERNAL":
            return self._external(session, raw)
        if not raw:
            return 402, {"status": "Challenged", "mechanism": "PLAIN", "challenge": ""}
        parts = raw.split(b"\0")
        if len(parts) != 3:
            return _bad("PLAIN is authzid NUL user NUL password")
        user, password = parts[1].decode("utf-8", "replace"), parts[2]
        session.claimed = user
        if not self._host.secrets.verify(user, password):
            self._host.count_error("unauthorized")
            return 401, self._unauthorized()
        session.identity, session.secret = user, password
        return self._ready()

    def _external(self, session: _Session, raw: bytes) -> Reply:
        """SASL EXTERNAL (RFC 4422 appendix A): the identity the CURVE key was let in as.

        The ZAP handler names the holders of the keys in ``curve_identities``
        (the User-Id libzmq attaches to each message). The response is the
        authorization identity: empty for that identity, or that identity
        itself; anything else, or a key without an identity, is ``401``.
        """
        user_id = self._user_id()
        requested = raw.decode("utf-8", "replace")
        session.claimed = requested or user_id
        if user_id is None or (requested and requested != user_id):
            self._host.count_error("unauthorized")
            reason = (
                "EXTERNAL: this CURVE key has no identity here"
                if user_id is None
                else f"EXTERNAL: this CURVE key is not {requested!r}"
            )
            return 401, self._unauthorized(reason)
        session.identity, session.secret, session.external = user_id, None, True
        return self._ready()

    def _user_id(self) -> str | None:
        user_id = getattr(self._host.control_socket, "user_id", None)
        return user_id if isinstance(user_id, str) and user_id else None

    def _scram(self, session: _Session, exchange: scram.ScramServer | None, raw: bytes) -> Reply:
        """One round of SCRAM-SHA-256; ``exchange`` is the session's one under way, if any."""
        try:
            if exchange is None:
                if not raw:  # no initial response: ask for the client-first message
                    return self._challenge(session, None, b"")
                exchange = scram.ScramServer(self._login_secret)
                return self._challenge(session, exchange, exchange.first(raw))
            if exchange.secret is None:
                return self._challenge(session, exchange, exchange.final(raw))
            if raw:
                raise scram.ScramError("the server-final message is acknowledged empty")
        except scram.ScramError as exc:
            self._host.count_error("unauthorized")
            session.claimed = (exchange.user or None) if exchange is not None else None
            return 401, self._unauthorized(f"SCRAM-SHA-256: {exc}")
        session.identity, session.secret = exchange.user, exchange.secret
        return self._ready()

    def _challenge(
        self, session: _Session, exchange: scram.ScramServer | None, challenge: bytes
    ) -> Reply:
        session.scram = exchange
        return 402, {
            "status": "Challenged",
            "mechanism": scram.MECHANISM,
            "challenge": base64.b64encode(challenge).decode(),
        }

    def _login_secret(self, user: str) -> bytes | None:
        logins = self._host.secrets.logins
        secret = logins.get(user)
        return secret if secret is not None else logins.get(ANY_IDENTITY)

    # --- leases ------------------------------------------------------------------------

    def _lease(self, session: _Session, kind: str, body: dict[str, Any]) -> Reply:
        if session.profile is None:
            return _bad("select a profile with Connection.Profile first")
        confirm = str(body.get("confirm", "none")).lower()
        if confirm not in ("none", "full"):
            return _bad('confirm is "none" or "full"')
        resources = body.get("resources", [])
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            return _bad("resources is a list of names")
        if session.profile == "test":
            if confirm == "full":
                return 501, {
                    "status": "Not implemented",
                    "reason": "the test profile never confirms",
                }
            if any(resource != TEST_RESOURCE for resource in resources):
                return _bad(f'the test profile has one resource, "{TEST_RESOURCE}"')
            resources = [TEST_RESOURCE]
        host = self._host
        action = Action.PUBLISH if kind == "writer" else Action.CONSUME
        for resource in resources:
            if not check(
                host.authorization,
                action,
                session.identity,
                resource,
                listener=host.name,
                count_error=host.count_error,
            ):
                return 403, {
                    "status": "Forbidden",
                    "reason": f"{session.identity or 'an unauthenticated client'} may not"
                    f" {action.value} {resource!r}",
                }
        lease = random_texts.token_urlsafe(18)
        self._leases[lease] = DataLease(
            session.profile, kind, tuple(resources), confirm, session.identity
        )
        if len(self._leases) > host.settings.max_leases:
            # Data peers keep the leases they presented; the oldest token no longer works.
            self._leases.popitem(last=False)
        return 202, {"status": "Data Lease", "port": host.data_port, "lease": lease}


def _claimed(session: _Session, mechanism: str, body: dict[str, Any]) -> str | None:
    """The identity a Connection.Authorize claims, where it can be read before it is checked.

    PLAIN's user; SCRAM's once its client-first message was taken; else none.
    """
    if mechanism == "PLAIN":
        try:
            parts = base64.b64decode(str(body.get("response", "")), validate=True).split(b"\0")
        except (binascii.Error, ValueError):
            return None
        return parts[1].decode("utf-8", "replace") if len(parts) == 3 else None
    if mechanism == scram.MECHANISM and session.scram is not None:
        return session.scram.user or None
    return None


def _bad(reason: str) -> Reply:
    return 400, {"status": "Bad Request", "reason": reason}
