"""The TLS-terminating front-end: a client over TLS, relayed byte for byte to a plaintext backend.

Each accepted connection gets its own backend connection, opened once the TLS
handshake has verified a client certificate (an ``mtls:`` endpoint with
``caCerts``; a connection without a certificate is closed). Bytes then flow
both ways unchanged, with flow control in both directions (each transport is
registered as the other's streaming producer, so a slow side stops reading
from the fast one), and either side closing closes the other once what it
sent has been written.

The protocol is preserved exactly, except where the front-end must speak for
the client:

* SSMP: the client's first line must be ``LOGIN <id> cert`` with an id its
  certificate vouches for (spec "Client certificate": the CN, a SAN, or one
  of them followed by ``/`` and a suffix). The front-end sends the backend
  ``LOGIN <id> secret <secret>`` instead, the secret taken from the secrets
  file's ``[frontends.<listener>]`` table, then relays everything after that
  line verbatim, the backend's ``200`` included; a ``401`` from the backend
  (listing its own schemes) reaches the client as ``401 cert``. A first line
  that is not a LOGIN is answered ``400`` and a refused one ``401 cert``, as
  the spec prescribes, without a backend connection.
* QMQP and the stream protocol: nothing is rewritten; a verified certificate
  is what lets a client in, and the backend does its own authentication (the
  stream protocol's SASL and QMQP's ``A`` block pass through).

A backend that cannot be reached is answered in the protocol's own way: SSMP
``401 cert`` (the spec's answer to any failed LOGIN; the log says why), QMQP a
``Z`` (temporary failure) for every message block the client sends until its
done block, the stream protocol a closed connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Unpack, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IHandshakeListener, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from gateway.codecs import qmqp, ssmp
from gateway.core.auth import ANY_IDENTITY
from gateway.protocols.frontend.settings import FrontendSettings
from gateway.protocols.listener import ListenerArgs, ListenerConnection, ListenerFactory
from gateway.protocols.ssmp.server import cert_identity_matches, cert_name_for
from gateway.protocols.tcp import disable_nagle
from gateway.tls import external_identity, peer_identities

__all__ = ["BackendProtocol", "FrontendServerFactory", "FrontendServerProtocol", "backend_secret"]

MAX_EARLY_BYTES: Final = 256 * 1024
"""Client bytes held while the backend connection opens (reading is paused meanwhile)."""

SSMP_CERT_ONLY: Final = ssmp.response_line(401, "cert")
"""Spec, "Login": a refused LOGIN gets 401 with the supported schemes; here only ``cert``."""

BACKEND_UNAVAILABLE: Final = b"backend unavailable, try again later"


def backend_secret(
    secrets: Mapping[str, bytes], identity: str, names: frozenset[str]
) -> bytes | None:
    """The secret the front-end logs in to the backend with, for an SSMP identity.

    Looked up under the identity itself, then under the certificate name it
    extends (``alice`` for ``alice/phone``; the longest such name), then under
    ``*``, the shared secret.
    """
    secret = secrets.get(identity)
    if secret is not None:
        return secret
    base = cert_name_for(identity, names)
    if base is not None and base in secrets:
        return secrets[base]
    return secrets.get(ANY_IDENTITY)


class BackendProtocol(Protocol):
    """The plaintext connection to the backend, for one front-end client."""

    def __init__(self, front: FrontendServerProtocol) -> None:
        self._front = front

    def connectionMade(self) -> None:
        """Hand the connection to the client's side."""
        disable_nagle(self.transport)
        self._front.backend_connected(self)

    def dataReceived(self, data: bytes) -> None:
        """Relay backend bytes to the client."""
        self._front.from_backend(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Close the client's side too."""
        self._front.backend_lost(reason)


class _BackendFactory(Factory):
    """Builds the one backend connection of a client (quietly: one per client)."""

    noisy = False

    def __init__(self, front: FrontendServerProtocol) -> None:
        self._front = front

    def buildProtocol(self, addr: Any) -> BackendProtocol:
        """The backend side of the client's relay."""
        return BackendProtocol(self._front)


@implementer(IHandshakeListener)
class FrontendServerProtocol(ListenerConnection["FrontendServerFactory"]):
    """One TLS client of a front-end listener, and its backend connection.

    Until the backend connection is up the client's transport has this
    connection as its producer (a client that does not read the front-end's
    own answers is not read either); then each transport becomes the other's
    producer.
    """

    def __init__(self, factory: FrontendServerFactory) -> None:
        super().__init__(factory)
        self.identity: str | None = None
        self._speaks = factory.settings.speaks
        self._names: frozenset[str] | None = None
        self._backend: BackendProtocol | None = None
        self._connecting: Deferred[Any] | None = None
        self._early: list[bytes] = []
        self._early_bytes = 0
        self._login_line = bytearray()
        self._login_done = self._speaks != "ssmp"
        self._refusing: qmqp.QMQPCodec | None = None
        self._login_reply: bytearray | None = None  # SSMP: the backend's first line, held
        self._timer: IDelayedCall | None = None
        self._awaiting_backend = False
        self._deliver_on_connect = False

    # --- the client side -----------------------------------------------------------------

    def _connection_started(self) -> None:
        """Start the handshake (and SSMP LOGIN) time-out."""
        self._timer = self._call_later(
            self.factory.settings.handshake_timeout_seconds, self._timed_out
        )

    def handshakeCompleted(self) -> None:
        """TLS is up: read the certificate's identity, and open the backend (not SSMP yet)."""
        if self._names is None:
            self._authenticate()

    def dataReceived(self, data: bytes) -> None:
        """Relay client bytes, or read the SSMP LOGIN, or hold them until the backend is up."""
        self.factory.traffic.bytes_in += len(data)
        if self._backend is not None:
            self._backend.transport.write(data)  # type: ignore[union-attr]
            return
        if self._closing or (self._names is None and not self._authenticate()):
            return
        completed = False
        if self._refusing is not None:
            completed = self._refuse_qmqp(data)
        elif not self._login_done:
            self._read_login(data)
        else:
            self._hold(data)
        self._frame_read(completed, self._partial_frame_bytes())

    def _partial_frame_bytes(self) -> int:
        refusing = self._refusing
        return len(self._login_line) + (refusing.pending_bytes if refusing is not None else 0)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Close the backend side and stop counting this connection.

        A client that leaves on its own while the backend connection is being
        made, after saying something, has it delivered first, as a direct
        connection to the backend would have.
        """
        self._deliver_on_connect = not self._closing and bool(self._early)
        super().connectionLost(reason)

    def _connection_ended(self, reason: Failure) -> None:
        if self._connecting is not None and not self._deliver_on_connect:
            connecting, self._connecting = self._connecting, None
            connecting.cancel()
        if self._backend is not None and self._backend.transport is not None:
            backend = self._backend.transport
            backend.unregisterProducer()  # type: ignore[attr-defined]
            backend.loseConnection()

    def _authenticate(self) -> bool:
        names = peer_identities(self.transport, self.factory.cert_identity)
        if not names:
            self.factory.count_error("no-client-certificate")
            self._log.warn(
                "{listener}: closing {peer}: no verified client certificate",
                listener=self.factory.name,
                peer=self._who(),
            )
            self._close()
            return False
        self._names = names
        self.identity = external_identity(
            self.transport, name_types=self.factory.cert_identity
        ) or min(names)
        if self._login_done:  # QMQP and stream: nothing to read before connecting
            if not self.factory.admit(self, self.identity):
                self._log.warn(
                    "{listener}: closing {peer}: {reason}",
                    listener=self.factory.name,
                    peer=self._who(),
                    reason=self.factory.per_identity_refusal(self.identity),
                )
                self._close()
                return False
            self._cancel_timer()
            self._connect()
        return True

    def _hold(self, data: bytes) -> None:
        self._early.append(data)
        self._early_bytes += len(data)
        if self._early_bytes > MAX_EARLY_BYTES:  # reading is paused; a safety net only
            self.factory.count_error("backlog")
            self._close()

    def _read_login(self, data: bytes) -> None:
        """Read the SSMP LOGIN line, check it against the certificate, and rewrite it."""
        self._login_line += data
        end = self._login_line.find(b"\n", 0, ssmp.MAX_LINE_BYTES)
        if end < 0:
            if len(self._login_line) >= ssmp.MAX_LINE_BYTES:
                reason = f"line is over SSMP's {ssmp.MAX_LINE_BYTES}-byte limit"
                self._refuse_ssmp(ssmp.response_line(400, reason), "line-too-long", reason)
            return
        line = bytes(self._login_line[: end + 1])
        rest = bytes(self._login_line[end + 1 :])
        self._login_line = bytearray()
        try:
            login = ssmp.SSMPCodec(ssmp.Role.SERVER).receive_data(line)[0]
        except ssmp.SSMPError as exc:
            reply = exc.reply or ssmp.response_line(400, exc.reason)
            self._refuse_ssmp(reply, exc.kind, exc.reason)
            return
        assert isinstance(login, ssmp.Login)  # the server codec insists on LOGIN first
        identity = login.identity.decode("ascii")
        names = self._names or frozenset()
        if login.scheme != b"cert":
            why = f"scheme {login.scheme.decode('ascii')!r}; only 'cert' is offered"
            self._refuse_ssmp(SSMP_CERT_ONLY, "login-refused", why)
            return
        if not cert_identity_matches(identity, names):
            why = f"certificate names {sorted(names)} do not include {identity!r}"
            self._refuse_ssmp(SSMP_CERT_ONLY, "login-refused", why)
            return
        table = self.factory.secrets.frontends.get(self.factory.name, {})
        secret = backend_secret(table, identity, names)
        if secret is None:
            why = f"no backend secret for {identity!r} in [frontends.{self.factory.name}]"
            self._refuse_ssmp(SSMP_CERT_ONLY, "no-backend-secret", why)
            return
        if not self.factory.admit(self, identity):
            why = self.factory.per_identity_refusal(identity)
            self._refuse_ssmp(SSMP_CERT_ONLY, None, why)  # admit counted it
            return
        rewritten = ssmp.Login(identity=login.identity, scheme=b"secret", credential=secret)
        self.identity = identity
        self._login_done = True
        self._login_reply = bytearray()
        self._cancel_timer()
        self._hold(ssmp.encode(rewritten))
        if rest:
            self._hold(rest)
        self._connect()

    def _refuse_ssmp(self, reply: bytes, kind: str | None, reason: str) -> None:
        if kind is not None:  # None: counted already
            self.factory.count_error(kind)
        self._log.warn(
            "{listener}: SSMP LOGIN from {peer} refused: {reason}",
            listener=self.factory.name,
            peer=self._who(),
            reason=reason,
        )
        self._write(reply)
        self._close()

    # --- the backend side ----------------------------------------------------------------

    def _connect(self) -> None:
        self._awaiting_backend = True
        self._pause_reading()
        settings = self.factory.settings
        connecting = self.factory.backend.connect(_BackendFactory(self))
        connecting.addTimeout(settings.connect_timeout_seconds, self.factory.clock)
        connecting.addErrback(self._backend_failed)
        if not connecting.called:
            self._connecting = connecting

    def backend_connected(self, backend: BackendProtocol) -> None:
        """Send what the client said so far, then relay both ways with flow control."""
        self._connecting = None
        self._awaiting_backend = False
        if self._closing:
            transport: Any = backend.transport
            if self._deliver_on_connect:
                transport.writeSequence(self._early)
                self._early = []
            transport.loseConnection()
            return
        self._backend = backend
        client, server = self.transport, backend.transport
        assert client is not None and server is not None
        early, self._early, self._early_bytes = self._early, [], 0
        if early:
            server.writeSequence(early)
        # A slow client pauses reading from the backend, and a slow backend from the client.
        client.unregisterProducer()  # type: ignore[attr-defined]
        client.registerProducer(server, True)  # type: ignore[attr-defined]
        server.registerProducer(client, True)  # type: ignore[attr-defined]
        self._resume_reading()

    def from_backend(self, data: bytes) -> None:
        """Relay backend bytes to the client, unchanged but for a refused SSMP LOGIN."""
        if self._login_reply is not None:
            data = self._read_login_reply(data)
            if not data:
                return
        self._write(data)

    def _read_login_reply(self, data: bytes) -> bytes:
        """Hold the backend's answer to the rewritten LOGIN until its line is complete.

        A ``401`` lists the backend's schemes (``secret``), which the client
        cannot use here: it becomes ``401 cert``, the front-end's own refusal,
        and the log says what the backend answered. Anything else passes.
        """
        assert self._login_reply is not None
        self._login_reply += data
        end = self._login_reply.find(b"\n", 0, ssmp.MAX_LINE_BYTES)
        if end < 0 and len(self._login_reply) < ssmp.MAX_LINE_BYTES:
            return b""
        held, self._login_reply = bytes(self._login_reply), None
        if held.startswith(b"401") and held[3:4] in (b" ", b"\n"):
            self.factory.count_error("backend-refused-login")
            self._log.warn(
                "{listener}: backend refused the login of {identity}: {answer}",
                listener=self.factory.name,
                identity=self.identity,
                answer=held[:end].decode("utf-8", "replace"),
            )
            return SSMP_CERT_ONLY + held[end + 1 :]
        return held

    def backend_lost(self, reason: Failure) -> None:
        """The backend closed: close the client once what the backend sent is written."""
        if self._closing:
            return
        self._log.debug(
            "{listener}: backend closed the connection of {identity}: {reason}",
            listener=self.factory.name,
            identity=self.identity,
            reason=reason.getErrorMessage(),
        )
        self._close()

    def _backend_failed(self, failure: Failure) -> None:
        self._connecting = None
        self._awaiting_backend = False
        if self._closing:
            return  # cancelled because the client left
        self.factory.count_error("backend-unreachable")
        self._log.warn(
            "{listener}: backend {backend} unreachable for {identity}: {reason}",
            listener=self.factory.name,
            backend=self.factory.settings.backend,
            identity=self.identity,
            reason=failure.getErrorMessage(),
        )
        if self._speaks == "ssmp":
            self._write(SSMP_CERT_ONLY)
            self._close()
        elif self._speaks == "qmqp":
            # Answer every block with Z until the client is done (or the time-out).
            self._refusing = qmqp.QMQPCodec(qmqp.Role.SERVER)
            early, self._early = self._early, []
            self._timer = self._call_later(
                self.factory.settings.handshake_timeout_seconds, self._timed_out
            )
            self._resume_reading()
            self._refuse_qmqp(b"".join(early))
        else:
            self._close()

    def _refuse_qmqp(self, data: bytes) -> bool:
        """Answer every block with Z (and the done block with done, then close).

        Returns:
            Whether a block was complete.
        """
        assert self._refusing is not None
        try:
            blocks = self._refusing.receive_data(data)
        except qmqp.QMQPError as exc:
            blocks = [*cast("list[qmqp.Block]", exc.events), qmqp.DONE]  # answer, then close
        out: list[bytes] = []
        for block in blocks:
            match block:
                case qmqp.MessageBlock(id=ident) | qmqp.InvalidBlock(id=ident):
                    reply = qmqp.ReplyBlock(
                        id=ident, status=qmqp.Z, description=BACKEND_UNAVAILABLE, pending=0
                    )
                    out.append(self._refusing.send(reply))
                case qmqp.AuthBlock():
                    out.append(self._refusing.send(qmqp.AuthReplyBlock(success=False)))
                case qmqp.DoneBlock():
                    out.append(qmqp.DONE_BYTES)
                    self._write(b"".join(out))
                    self._close()
                    return True
        if out:
            self._write(b"".join(out))
        return bool(blocks)

    # --- helpers -------------------------------------------------------------------------

    def _may_read(self) -> bool:
        return not self._awaiting_backend

    def _timed_out(self) -> None:
        self._timer = None
        if self._closing:
            return
        self.factory.count_error("handshake-timeout")
        self._log.info(
            "{listener}: closing {peer}: no TLS handshake or LOGIN within {seconds}s",
            listener=self.factory.name,
            peer=self._who(),
            seconds=self.factory.settings.handshake_timeout_seconds,
        )
        self._close()

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


class FrontendServerFactory(ListenerFactory[FrontendServerProtocol, FrontendSettings]):
    """A front-end listener: its TLS clients, each relayed to the backend.

    Args:
        name: The listener's name.
        settings: What it speaks and where the backend is.
        backend: The backend's client endpoint.
        secrets: The gateway's secrets (reloaded on SIGHUP); an SSMP login
            presents the backend the secret its ``[frontends.<name>]`` table
            holds for the certificate name.
        clock: Time-outs.
        metrics: Counters, or None.
    """

    kind = "frontend"
    protocol = FrontendServerProtocol

    def __init__(
        self,
        *,
        backend: IStreamClientEndpoint,
        **common: Unpack[ListenerArgs[FrontendSettings]],
    ) -> None:
        super().__init__(**common)
        self.backend = backend
