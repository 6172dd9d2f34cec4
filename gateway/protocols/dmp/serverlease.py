"""The DMP listener's handshake: the protocol header and the lease, up to its answer.

`ServerLease` is the part of `DMPServerProtocol` that tells a principal
connection (AMQP 0-9-1, `gateway.protocols.dmp.principal`) from DMP by the
protocol header, answers DMP's, and opens a sink or a feed with a lease:
once what the peer owes is waited out (`LoginRefusals`), the lease is
looked up (a run-time lease of a fleet once the node knows the fleet's
revocations), its identity checked against the client certificate, then
the ``authorize`` table and the per-identity limit, a feed's reader claimed
(in a fleet, the feed's lock), and ``200`` answered. While the lease waits
nothing more is read; what was read after it is handled once it is
answered. `gateway.protocols.dmp.server` says what each refusal is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

from twisted.internet.defer import CancelledError, Deferred

from gateway.codecs import amqp091, dmp
from gateway.core.authorization import Action
from gateway.protocols.dmp.fleet import LeaseCheck
from gateway.protocols.dmp.mapping import message_from_envelope, messages_from_bodies
from gateway.protocols.dmp.principal import PrincipalConnection
from gateway.protocols.dmp.serverbase import DMPServerBase
from gateway.protocols.dmp.settings import LeaseGrant
from gateway.protocols.logins import UNCHECKED
from gateway.tls import external_identity, peer_identities

__all__ = ["DIALECT", "ServerLease"]

DIALECT: Final = "DMP/0.1"
_SORT_OCTETS: Final = 5
"""``AMQP`` and the octet that tells 0-9-1 (0) from DMP (protocol id 10)."""
_T = TypeVar("_T")


class ServerLease(DMPServerBase):
    """The protocol header, the lease's wait and checks, the fleet's claim of a feed, ``200``."""

    _held_error: dmp.DMPError | None
    _waited: bool
    _revocations_waited: bool

    # --- the header ------------------------------------------------------------------------

    def _sort_header(self, data: bytes) -> bytes:
        """Tell AMQP 0-9-1 (a principal connection) from DMP by the header's fifth octet.

        Returns:
            The bytes for the DMP codec (empty: not known yet, or principal).
        """
        assert self._prefix is not None
        data = self._prefix + data
        header = amqp091.PROTOCOL_HEADER
        if len(data) < _SORT_OCTETS and header.startswith(data):
            self._prefix = data
            return b""
        self._prefix = None
        if not self.factory.settings.principals or not data.startswith(header[:_SORT_OCTETS]):
            return data
        if len(data) < len(header) and header.startswith(data):
            self._prefix = data  # keep waiting for the whole 0-9-1 header
            return b""
        if not data.startswith(header):
            # AMQP 0-9-1 section 4.2.2: answer a header we do not take with ours, then close.
            self.factory.count_error("bad-header")
            self._write(header)
            self._close_with("an AMQP protocol header that is neither 0-9-1 nor DMP")
            return b""
        self._principal = PrincipalConnection(
            self.factory,
            self._write,
            self._close_with,
            self._principal_open,
            self._wait_for_login,
            self._peer(),
        )
        self._principal.start()
        rest = data[len(header) :]
        if rest:
            self._principal.receive_data(rest)
        return b""

    # --- the lease -------------------------------------------------------------------------

    def _wait_for_login(self, seconds: float, then: Callable[[], None]) -> None:
        """Read nothing for ``seconds`` (a login's wait); then call ``then`` and read again."""

        def waited() -> None:
            self._login_wait = None
            then()
            self._resume_reading()

        self._login_wait = self._call_later(seconds, waited)
        self._pause_reading()

    def _lease_waited(self) -> None:
        """The wait is over: check the lease now, and handle what was read after it."""
        events, self._held = self._held, []
        error, self._held_error = self._held_error, None
        self._handle_all(events)
        if error is not None and not self._closing:
            self._bad_input(error)

    def _bad_input(self, error: dmp.DMPError) -> None:
        """Close with the error's response; after the lease, if one waits."""
        if self._login_wait is not None or self._suspended is not None:
            self._held_error = error
            return
        self.factory.count_error(error.kind)
        self._close_with(f"bad input: {error.reason}", error.response)

    def _refuse_lease(
        self, why: str, response: dmp.Response, identity: str | None, *, checked: bool = True
    ) -> None:
        """Answer a lease refused (402) once `LoginRefusals` says, then close."""
        self.factory.count_error("bad-lease")
        delay = self.factory.logins.refused(
            peer=self._peer(), identity=identity, mechanism="DMP lease", why=why, checked=checked
        )
        if delay > 0:
            self._wait_for_login(delay, lambda: self._close_with(why, response))
        else:
            self._close_with(why, response)

    def _principal_open(self) -> None:
        # A principal connection may stay open while its DMP connections come and go.
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.kind = "principal"

    def _handle(self, event: dmp.Event) -> None:
        if isinstance(event, dmp.ProtocolHeader):
            self._write(dmp.encode_response(dmp.Response(200, DIALECT)))
        elif isinstance(event, dmp.Lease):
            self._open(event.lease)
        elif isinstance(event, dmp.Envelope | dmp.Bodies):
            if self.kind == "sink":
                # The lease and the first envelopes came in one read.
                now = self.factory.clock.seconds()
                if isinstance(event, dmp.Bodies):
                    messages = messages_from_bodies(event.bodies, self.target, now)
                else:
                    messages = [message_from_envelope(event, self.target, now)]
                for message in messages:
                    self._inbox.add(message, message)
            else:
                self.factory.count_error("write-to-feed")
                self._close_with(f"the reader of feed {self.target!r} wrote a message")
        # Heartbeats: nothing to do (being heard is enough).

    def _suspend(self, waiting: Deferred[_T], then: Callable[[_T], None]) -> None:
        """Read nothing until ``waiting`` fires; then call ``then`` with its result.

        What was read after the lease waits too, and is handled after
        ``then`` (unless that waits again). The connection's end cancels
        ``waiting``.
        """
        self._suspended = waiting
        self._pause_reading()

        def resume(result: _T) -> None:
            if self._suspended is not waiting:
                return  # given up (the connection is gone)
            self._suspended = None
            then(result)
            if self._suspended is None and not self._closing:
                self._lease_waited()
                self._resume_reading()

        waiting.addCallbacks(resume, lambda failure: failure.trap(CancelledError))

    def _open(self, lease: str) -> None:
        factory = self.factory
        wait = factory.logins.wait_seconds(self._peer(), None)
        if wait > 0 and not self._waited:  # checked once the refusal owed is answered
            self._waited = True
            self._wait_for_login(wait, self._lease_waited)
            return
        if wait > 0:
            refusal = dmp.Response(402, "unknown or expired lease")
            self._refuse_lease(UNCHECKED, refusal, None, checked=False)
            return
        grant = factory.grant_for(lease)
        if grant is LeaseCheck.REVOCATIONS_UNKNOWN:
            fleet = factory.fleet
            if fleet is not None and not self._revocations_waited:
                self._revocations_waited = True
                self._suspend(fleet.when_known(), lambda _: self._open(lease))
                return
            self._refuse_lease(
                "a run-time lease, and this node does not know the fleet's revocations now"
                " (no connection to RabbitMQ)",
                dmp.Response(402, "lease cannot be checked now"),
                None,
            )
            return
        if grant is None:
            self._refuse_lease(
                "unknown or expired lease", dmp.Response(402, "unknown or expired lease"), None
            )
            return
        known = factory.settings.sinks if grant.kind == "sink" else factory.settings.feeds
        if grant.target not in known:
            factory.count_error("not-found")
            self._close_with(
                f"no {grant.kind} {grant.target!r}",
                dmp.Response(404, f"no {grant.kind} named {grant.target!r}"),
            )
            return
        identity, why = self._identity_for(grant)
        if why is not None:
            self._refuse_lease(
                why, dmp.Response(402, "lease not valid for this client"), grant.identity
            )
            return
        action = Action.PUBLISH if grant.kind == "sink" else Action.CONSUME
        if not factory.authorized(action, identity, grant.target, self._peer()):
            self._close_with(
                f"{identity or 'a client without an identity'} may not {action.value}"
                f" {grant.kind} {grant.target!r}",
                dmp.Response(403, f"not allowed to {action.value} {grant.target!r}"),
            )
            return
        if not factory.admit(self, identity):
            assert identity is not None
            why = factory.per_identity_refusal(identity)
            self._close_with(why, dmp.Response(403, "too many connections for this identity"))
            return
        self.identity = identity
        target = grant.target
        if grant.kind == "feed" and (target in factory.readers or target in factory.claiming):
            factory.count_error("feed-busy")
            self._close_with(
                f"feed {target!r} already has a reader",
                dmp.Response(403, f"feed {target!r} already has a reader"),
            )
            return
        if grant.kind == "feed" and factory.fleet is not None:
            # The lease is answered once the fleet says whether another node reads the feed.
            factory.claiming[target] = self
            self._claiming = target
            self._suspend(
                factory.fleet.claim(target), lambda refusal: self._claimed(grant, refusal)
            )
            return
        self._opened(grant)

    def _claimed(self, grant: LeaseGrant, refusal: tuple[int, str] | None) -> None:
        """The feed's fleet lock: held (open the feed), or refused with a code and why."""
        factory = self.factory
        target = grant.target
        self._claiming = None
        if factory.claiming.get(target) is self:
            del factory.claiming[target]
        if refusal is not None:
            code, why = refusal
            factory.count_error("feed-busy" if code == 403 else "feed-unclaimed")
            self._close_with(f"feed {target!r} {why}", dmp.Response(code, f"feed {target!r} {why}"))
            return
        self._opened(grant)

    def _opened(self, grant: LeaseGrant) -> None:
        """Answer 200: the sink or feed is this connection's."""
        factory = self.factory
        self.kind, self.target = grant.kind, grant.target
        self._outcomes.sink = grant.target
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if grant.kind == "feed":
            factory.readers[grant.target] = self
            self._write(
                dmp.encode_response(dmp.Response(200, f'Ready to read from "{self.target}"'))
            )
            self._schedule(factory.settings.heartbeat_seconds, self._beat)
        else:
            self._write(
                dmp.encode_response(dmp.Response(200, f'Ready to write to "{self.target}"'))
            )
            self._schedule(factory.settings.idle_timeout_seconds, self._check_idle)

    def _identity_for(self, grant: LeaseGrant) -> tuple[str | None, str | None]:
        """The identity this connection acts as with ``grant``, or why the lease is not its own.

        A verified client certificate (on an ``mtls:`` listener) names the
        connection; a lease bound to an identity must be used by that
        identity: its certificate must name it, and a lease of the config
        (``certified``) needs such a certificate.

        Returns:
            The identity (None: none known), and None or the reason for 402.
        """
        name_types = self.factory.cert_identity
        names = peer_identities(self.transport, name_types)
        bound = grant.identity
        if bound is None:
            return external_identity(self.transport, name_types=name_types), None
        if bound in names or (not names and not grant.certified):
            return bound, None
        if not names:
            return None, f"the lease is bound to {bound!r}: present its client certificate"
        return None, f"the lease is bound to {bound!r}, the certificate names {sorted(names)}"
