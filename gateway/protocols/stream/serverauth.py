"""The stream listener's login: peer properties, SASL, Open.

`ServerLogin` is the part of `StreamServerProtocol` that answers
PeerProperties, offers the SASL mechanisms (PLAIN; EXTERNAL with a verified
client certificate; ANONYMOUS when the listener allows it; and, to another
node's relay with the fleet's relay secret, ``MSGGATEWAY-RELAY``,
`gateway.protocols.stream.fleetlogin`), authenticates a SaslAuthenticate
once what its address or identity owes is waited out (`LoginRefusals`),
then proposes Tune, and checks the virtual host at Open. A relay logged in
as the fleet is the identity its client authenticated as on the relaying
node, or the relaying node's routes.
"""

from __future__ import annotations

import ipaddress
from typing import Final

from twisted.internet.interfaces import IAddress, IDelayedCall

from gateway import __version__
from gateway.codecs import stream as sp
from gateway.protocols.logins import UNCHECKED
from gateway.protocols.stream.fleetlogin import (
    NONCE_PROPERTY,
    RELAY_MECHANISM,
    ROUTES,
    channel_binding,
    check_relay_response,
    new_nonce,
    owner_proof,
)
from gateway.protocols.stream.owner import RELAY_PROPERTY
from gateway.protocols.stream.serverbase import (
    AUTHENTICATION_FAILURE,
    AUTHENTICATION_FAILURE_LOOPBACK,
    OK,
    SASL_ERROR,
    SASL_MECHANISM_NOT_SUPPORTED,
    VIRTUAL_HOST_ACCESS_FAILURE,
    StreamServerBase,
)
from gateway.tls import external_identity, peer_identities

__all__ = ["ServerLogin"]

_REFUSALS: Final = {
    SASL_MECHANISM_NOT_SUPPORTED: "the mechanism is not offered here",
    AUTHENTICATION_FAILURE: "wrong user or password (or certificate name)",
    SASL_ERROR: "a PLAIN response is authzid NUL user NUL password",
    AUTHENTICATION_FAILURE_LOOPBACK: "guest logs in from loopback only",
}
"""Why a SaslAuthenticate was refused, by the code it is answered with (for the log)."""


def _is_loopback(address: IAddress) -> bool:
    host = getattr(address, "host", None)
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerLogin(StreamServerBase):
    """PeerProperties, SaslHandshake, SaslAuthenticate (with the fleet's relay login), Open."""

    _frame_max: int
    _login_wait: IDelayedCall | None
    _held: tuple[list[sp.Event], sp.StreamError | None]
    _waited: bool
    _relay_nonces: tuple[str, str] | None

    # --- handshake ----------------------------------------------------------------------------

    def _on_peer_properties(self, event: sp.PeerProperties) -> None:
        properties = {
            "product": "msggateway",
            "version": __version__,
            "platform": "Python/Twisted",
            "copyright": "msggateway developers",
            "information": "msggateway stream listener over its embedded log",
            "cluster_name": self.factory.name,
        }
        theirs = event.properties or {}
        if RELAY_PROPERTY in theirs:
            self._relays = None  # another node's relay: served from this log, never relayed on
            if self._relay_secret() is not None:
                self._relay_nonces = (new_nonce(), str(theirs.get(NONCE_PROPERTY, "")))
                properties[NONCE_PROPERTY] = self._relay_nonces[0]
        self._send(
            sp.PeerPropertiesResponse(
                correlation_id=event.correlation_id, code=OK, properties=properties
            )
        )

    def _relay_secret(self) -> bytes | None:
        fleet = self.factory.fleet
        return fleet.relay_secret() if fleet is not None else None

    def _mechanisms(self) -> list[str]:
        mechanisms = ["PLAIN"]
        if self._relay_nonces is not None:
            mechanisms.append(RELAY_MECHANISM)  # another node's relay, as the fleet
        if peer_identities(self.transport, self.factory.cert_identity):
            mechanisms.append("EXTERNAL")  # a verified client certificate names the identity
        if self.factory.settings.anonymous:
            mechanisms.append("ANONYMOUS")
        return mechanisms

    def _on_sasl_handshake(self, event: sp.SaslHandshake) -> None:
        self._send(
            sp.SaslHandshakeResponse(
                correlation_id=event.correlation_id, code=OK, mechanisms=tuple(self._mechanisms())
            )
        )

    def _on_sasl_authenticate(self, event: sp.SaslAuthenticate) -> None:
        """Check a login once what its address or identity owes is waited out; refuse late.

        A refusal is answered after `LoginRefusals`' delay (nothing is read
        meanwhile), then the connection closes.
        """
        data = event.data or b""
        claimed = _claimed_identity(event.mechanism, data)
        logins = self.factory.logins
        wait = logins.wait_seconds(self._peer(), claimed)
        if wait > 0 and not self._waited:
            self._waited = True
            self._login_wait = self._call_later(wait, self._login_waited)
            self._pause_reading()
            return
        code = AUTHENTICATION_FAILURE if wait > 0 else self._authenticate(event.mechanism, data)
        why = UNCHECKED if wait > 0 else _REFUSALS.get(code, f"code {code}")
        if code == OK and not self.factory.admit(self, self._principal):
            assert self._principal is not None
            why = self.factory.per_identity_refusal(self._principal)
            code = AUTHENTICATION_FAILURE
        if code != OK:
            self.factory.count_error("unauthorized")
            delay = logins.refused(
                peer=self._peer(),
                identity=claimed,
                mechanism=f"SASL {event.mechanism}",
                why=why,
                checked=wait == 0,
            )
            if delay > 0:
                self._login_wait = self._call_later(
                    delay, self._refuse_login, event.correlation_id, code
                )
                self._pause_reading()
            else:
                self._refuse_login(event.correlation_id, code)
            return
        logins.accepted(claimed)
        if self._relays is not None:
            self._relays.login = (event.mechanism, data)
            self._relays.principal = self._principal
        proof = None
        relayed, nonces, secret = self._relayed, self._relay_nonces, self._relay_secret()
        if relayed is not None and nonces is not None and secret is not None:
            proof = owner_proof(
                secret,
                owner_nonce=nonces[0],
                relay_nonce=nonces[1],
                binding=channel_binding(self.transport),
                who=relayed,
            )
        self._send(
            sp.SaslAuthenticateResponse(
                correlation_id=event.correlation_id, code=OK, challenge=proof
            )
        )
        self._state = "tuning"
        settings = self.factory.settings
        self._send(sp.Tune(frame_max=settings.frame_max, heartbeat=settings.heartbeat_seconds))

    def _login_waited(self) -> None:
        """The wait is over: handle the SaslAuthenticate (checked now) and what followed it."""
        self._login_wait = None
        (events, error), self._held = self._held, ([], None)
        if self._handle_events(events, error):
            self.flush()
            self._resume_reading()

    def _refuse_login(self, correlation_id: int, code: int) -> None:
        """Answer a refused SaslAuthenticate, then close."""
        self._login_wait = None
        self._held = ([], None)
        self._send(sp.SaslAuthenticateResponse(correlation_id=correlation_id, code=code))
        self.flush()
        self._close()

    def _authenticate(self, mechanism: str, data: bytes) -> int:
        settings = self.factory.settings
        if mechanism == RELAY_MECHANISM and self._relay_nonces is not None:
            return self._authenticate_relay(data)
        if mechanism == "ANONYMOUS" and settings.anonymous:
            self.identity = "anonymous"
            self._principal = None
            return OK
        name_types = self.factory.cert_identity
        if mechanism == "EXTERNAL" and peer_identities(self.transport, name_types):
            requested = data.decode("utf-8", "replace")
            identity = external_identity(self.transport, requested, name_types)
            if identity is None:
                self._log.info(
                    "{listener}: EXTERNAL login refused: no verified certificate for {name}",
                    listener=self.factory.name,
                    name=data.decode("utf-8", "replace") or "its subject",
                )
                return AUTHENTICATION_FAILURE
            self.identity = self._principal = identity
            return OK
        if mechanism != "PLAIN":
            return SASL_MECHANISM_NOT_SUPPORTED
        parts = data.split(b"\0")
        if len(parts) != 3:
            return SASL_ERROR
        username = parts[1].decode("utf-8", "replace")
        password = parts[2]
        if username == "guest" and password == b"guest" and settings.guest:
            assert self.transport is not None
            if not _is_loopback(self.transport.getPeer()):
                return AUTHENTICATION_FAILURE_LOOPBACK
            self.identity = self._principal = username
            return OK
        if self.factory.secrets.verify(username, password):
            self.identity = self._principal = username
            return OK
        return AUTHENTICATION_FAILURE

    def _authenticate_relay(self, data: bytes) -> int:
        """Another node's relay logs in as the fleet: its proof, then on whose behalf."""
        secret = self._relay_secret()
        nonces = self._relay_nonces
        assert nonces is not None
        who = (
            None
            if secret is None
            else check_relay_response(
                secret,
                data,
                owner_nonce=nonces[0],
                relay_nonce=nonces[1],
                binding=channel_binding(self.transport),
            )
        )
        if who is None:
            self._log.warn(
                "{listener}: a relay's fleet login from {peer} was refused: its proof does not"
                " hold (another relay_secret, or not a node of this fleet)",
                listener=self.factory.name,
                peer=self._peer(),
            )
            return AUTHENTICATION_FAILURE
        self._relayed = who
        if who.role == ROUTES:
            self.identity, self._principal = f"routes of node {who.node}", None
        elif who.principal is None:  # an ANONYMOUS client's
            self.identity, self._principal = "anonymous", None
        else:
            self.identity = self._principal = who.principal
        return OK

    def _on_open(self, event: sp.Open) -> None:
        if self.identity is None:
            self._close()
            return
        if event.virtual_host not in self.factory.settings.virtual_hosts:
            self._send(
                sp.OpenResponse(
                    correlation_id=event.correlation_id,
                    code=VIRTUAL_HOST_ACCESS_FAILURE,
                )
            )
            self.flush()
            self._close()
            return
        self._state = "open"
        self._codec.set_frame_max(self._frame_max)
        if self._relays is not None:
            self._relays.virtual_host = event.virtual_host
        host, port = self.factory.advertised()
        self._send(
            sp.OpenResponse(
                correlation_id=event.correlation_id,
                code=OK,
                properties={"advertised_host": host, "advertised_port": str(port)},
            )
        )


def _claimed_identity(mechanism: str, data: bytes) -> str | None:
    """The identity a SaslAuthenticate claims: PLAIN's user, EXTERNAL's name; else none."""
    if mechanism == "PLAIN":
        parts = data.split(b"\0")
        return parts[1].decode("utf-8", "replace") if len(parts) == 3 else None
    if mechanism == "EXTERNAL" and data:
        return data.decode("utf-8", "replace")
    return None
