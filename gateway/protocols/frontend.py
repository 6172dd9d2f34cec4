"""The TLS-terminating front-end: a protocol over TLS in, the same protocol in plaintext out.

A ``protocol = "frontend"`` listener (issue 8) accepts connections of one
protocol (``speaks``: ``ssmp``, ``qmqp`` or ``stream``), usually on an
``mtls:`` endpoint that requires a client certificate, and gives each its
own connection to a legacy ``backend`` speaking the same protocol. Bytes
pass through unchanged both ways, with flow control (a side that cannot
keep up stops the other side's reading); when either side closes, so does
the other. The front-end parses only what it must:

* SSMP: the first line, the LOGIN. Its identifier must be one of the
  client certificate's names (CN or SANs, or ``name/suffix``, as for
  ``cert`` logins) and its scheme ``cert``; the backend, which cannot see
  the certificate, gets ``LOGIN <identifier> secret <secret>`` with the
  secret of the listener's name in the secrets file's ``[upstreams]``.
  Otherwise ``401 cert`` and the close, as the spec says; a first line that
  is not a LOGIN gets ``400``. Everything after the LOGIN is relayed as is.
* QMQP: nothing; blocks and replies pass through with their ids. A client
  without a certificate identity is closed before any byte goes to the
  backend. When the backend cannot be reached, every message block gets
  ``Z`` (temporary failure) with the reason, then the done block.
* stream: nothing; the client's own SASL exchange is the backend's to judge.
  A client without a certificate identity, or whose backend cannot be
  reached, is closed.
"""

from __future__ import annotations

from typing import Any, Final, cast

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.codecs import qmqp, ssmp
from gateway.core.auth import Secrets
from gateway.metrics import GatewayMetrics
from gateway.protocols.listener import ListenerFactory
from gateway.protocols.ssmp.server import cert_identity_matches
from gateway.protocols.tcp import disable_nagle
from gateway.tls import peer_identities

__all__ = ["SPEAKS", "FrontendFactory", "FrontendProtocol", "FrontendSettings"]

SPEAKS: Final = frozenset({"ssmp", "qmqp", "stream"})
"""The protocols a front-end relays."""
MAX_PENDING_BYTES: Final = 1 << 20
"""Client bytes held while the backend connects; past them the client is not read."""


@attrs.frozen(kw_only=True)
class FrontendSettings:
    """A front-end listener's settings (``[listeners.NAME]``).

    Attributes:
        speaks: ``ssmp``, ``qmqp`` or ``stream``.
        backend: The backend's client endpoint string (``tcp:host=...:port=...``).
        connect_timeout_seconds: How long connecting to the backend may take.
        login_timeout_seconds: SSMP: how long the client may take to send its LOGIN.
    """

    speaks: str
    backend: str
    connect_timeout_seconds: float = 10.0
    login_timeout_seconds: float = 10.0


class _Backend(Protocol):
    """The plaintext connection to the backend, one per client connection."""

    def __init__(self, front: FrontendProtocol) -> None:
        self.front = front

    def connectionMade(self) -> None:
        disable_nagle(self.transport)
        self.front.backend_connected(self)

    def dataReceived(self, data: bytes) -> None:
        self.front.from_backend(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.front.backend_lost()


class _BackendFactory(Factory):
    noisy = False

    def __init__(self, front: FrontendProtocol) -> None:
        self.front = front

    def buildProtocol(self, addr: Any) -> _Backend:
        return _Backend(self.front)


class FrontendProtocol(Protocol):
    """One client connection and, once it is accepted, its backend connection."""

    _log = Logger()

    def __init__(self, factory: FrontendFactory) -> None:
        self.factory = factory
        self.backend: _Backend | None = None
        self.identity: str | None = None
        self._pending: list[bytes] = []  # client bytes before the backend is there
        self._pending_bytes = 0
        self._paused = False
        self._closing = False
        self._client_gone = False
        self._login_done = factory.settings.speaks != "ssmp"
        self._login_timer: IDelayedCall | None = None
        self._connecting: Deferred[Any] | None = None
        self._qmqp: qmqp.QMQPCodec | None = None  # answering Z when the backend is away
        self._reason = ""
        self._names: frozenset[str] = frozenset()

    # --- the client side -------------------------------------------------------------

    @property
    def _client(self) -> Any:
        """The client's transport (TLS), untyped: Twisted's transports are many interfaces."""
        return self.transport

    def _close_client(self) -> None:
        """Close the client once written; a TLS transport closes only without a producer."""
        client = self._client
        if client is None:
            return
        if getattr(client, "producer", None) is not None:
            client.unregisterProducer()
        client.loseConnection()

    def connectionMade(self) -> None:
        """Count the connection; SSMP waits for its LOGIN, the others connect at once."""
        disable_nagle(self.transport)
        self.factory.connection_opened(self)
        if self._login_done:
            self._connect()
        else:
            self._login_timer = self.factory.clock.callLater(
                self.factory.settings.login_timeout_seconds, self._login_timed_out
            )

    def dataReceived(self, data: bytes) -> None:
        """Relay to the backend, or hold until it is there (SSMP: until the LOGIN)."""
        if self._closing:
            return
        self.factory.traffic.bytes_in += len(data)
        if self.identity is None and not self._identify():
            return
        if self._qmqp is not None:
            self._answer_unavailable(data)
            return
        if self.backend is not None and self._login_done:
            assert self.backend.transport is not None
            self.backend.transport.write(data)
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if not self._login_done:
            self._try_login()
        elif self._pending_bytes > MAX_PENDING_BYTES and not self._paused:
            self._paused = True
            self._client.pauseProducing()

    def _identify(self) -> bool:
        """Take the certificate's identity (first byte: the handshake is done); False closes."""
        names = peer_identities(self.transport)
        if not names:
            self.factory.count_error("no-certificate")
            self._log.info(
                "{listener}: a client without a certificate identity: closed",
                listener=self.factory.name,
            )
            self._refuse(b"" if self.factory.settings.speaks != "ssmp" else b"401 cert\n")
            return False
        self.identity = min(names)
        self._names = names
        return True

    def _try_login(self) -> None:
        """SSMP: check the LOGIN line, then connect to the backend with the rewritten one."""
        held = b"".join(self._pending)
        end = held.find(b"\n")
        if end < 0:
            if len(held) >= ssmp.MAX_LINE_BYTES:
                self.factory.count_error("malformed")
                self._refuse(ssmp.response_line(400, "line too long"))
            return
        line, rest = held[: end + 1], held[end + 1 :]
        try:
            [login] = ssmp.SSMPCodec(ssmp.Role.SERVER).receive_data(line)
        except ssmp.SSMPError as exc:
            self.factory.count_error("malformed")
            self._refuse(ssmp.response_line(400, str(exc)))
            return
        assert isinstance(login, ssmp.Login)
        identifier = login.identity.decode("ascii", "replace")
        if login.scheme != b"cert" or not cert_identity_matches(identifier, self._names):
            self.factory.count_error("unauthorized")
            self._log.info(
                "{listener}: LOGIN {identifier} {scheme} refused: the certificate names {names}",
                listener=self.factory.name,
                identifier=identifier,
                scheme=login.scheme.decode("ascii", "replace"),
                names=", ".join(sorted(self._names)),
            )
            self._refuse(b"401 cert\n")
            return
        secret = self.factory.secrets.credential_for(self.factory.name)
        if secret is None:
            self.factory.count_error("no-backend-secret")
            self._log.error(
                '{listener}: no secret for the backend: add {listener} = "..." under'
                " [upstreams] in the secrets file",
                listener=self.factory.name,
            )
            self._refuse(ssmp.response_line(401, "cert"))
            return
        self.identity = identifier
        self._cancel_login_timer()
        rewritten = ssmp.encode(
            ssmp.Login(identity=login.identity, scheme=b"secret", credential=secret)
        )
        self._pending, self._pending_bytes = [rewritten, rest], len(rewritten) + len(rest)
        self._login_done = True
        self._connect()

    def _login_timed_out(self) -> None:
        self._login_timer = None
        self.factory.count_error("login-timeout")
        self._refuse(b"")  # the spec: close without a response

    def _cancel_login_timer(self) -> None:
        if self._login_timer is not None and self._login_timer.active():
            self._login_timer.cancel()
        self._login_timer = None

    def _refuse(self, answer: bytes) -> None:
        self._closing = True
        self._cancel_login_timer()
        if answer:
            self._client.write(answer)
            self.factory.traffic.bytes_out += len(answer)
        self._close_client()

    # --- the backend side --------------------------------------------------------------

    def _connect(self) -> None:
        endpoint = clientFromString(self.factory.reactor, self.factory.backend_description)
        self._connecting = endpoint.connect(_BackendFactory(self))
        self._connecting.addErrback(self._backend_failed)

    def backend_connected(self, backend: _Backend) -> None:
        """Send what the client said so far; from now on bytes flow both ways."""
        self._connecting = None
        transport: Any = backend.transport
        if self._client_gone:
            # The client said everything and left while we connected: deliver it, then close.
            transport.write(b"".join(self._pending))
            self._pending = []
            transport.loseConnection()
            return
        if self._closing:
            transport.loseConnection()
            return
        self.backend = backend
        held, self._pending, self._pending_bytes = b"".join(self._pending), [], 0
        if held:
            transport.write(held)
        # Flow control: each side's reading stops while the other's sending backs up.
        transport.registerProducer(self._client, True)
        self._client.registerProducer(transport, True)
        if self._paused:
            self._paused = False
            self._client.resumeProducing()

    def _backend_failed(self, failure: Failure) -> None:
        self._connecting = None
        if self._closing:
            return
        self.factory.count_error("backend-unavailable")
        reason = f"the backend {self.factory.settings.backend} cannot be reached: " + (
            failure.getErrorMessage()
        )
        self._log.warn("{listener}: {reason}", listener=self.factory.name, reason=reason)
        speaks = self.factory.settings.speaks
        if speaks == "qmqp":
            # Answer every block with Z (try later): what was held and what comes.
            self._reason = reason
            self._qmqp = qmqp.QMQPCodec(qmqp.Role.SERVER)
            held, self._pending = b"".join(self._pending), []
            if self._paused:
                self._paused = False
                self._client.resumeProducing()
            self._answer_unavailable(held)
        elif speaks == "ssmp":
            self._refuse(ssmp.response_line(400, "retry: " + reason))
        else:
            self._refuse(b"")

    def _answer_unavailable(self, data: bytes) -> None:
        assert self._qmqp is not None
        out: list[bytes] = []
        try:
            blocks = self._qmqp.receive_data(data)
        except qmqp.QMQPError:
            self._refuse(b"")
            return
        for block in blocks:
            if isinstance(block, qmqp.MessageBlock):
                reply = qmqp.ReplyBlock(
                    id=block.id,
                    status=qmqp.Z,
                    description=self._reason.encode("utf-8", "replace"),
                    pending=0,
                )
                out.append(qmqp.encode(reply))
            elif isinstance(block, qmqp.DoneBlock):
                out.append(qmqp.DONE_BYTES)
                self._refuse(b"".join(out))
                return
        if out:
            self._client.write(b"".join(out))

    def from_backend(self, data: bytes) -> None:
        """Relay the backend's bytes to the client."""
        self.factory.traffic.bytes_out += len(data)
        self._client.write(data)

    def backend_lost(self) -> None:
        """The backend closed: close the client once what it sent is written."""
        self.backend = None
        if not self._closing:
            self._closing = True
            self._close_client()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """The client went: close the backend (or stop connecting to it)."""
        self._closing = True
        self._client_gone = True
        self._cancel_login_timer()
        self.factory.connection_closed(self)
        if self._connecting is not None and not (self._pending and self._login_done):
            self._connecting.cancel()  # nothing to deliver: stop connecting
        backend = self.backend.transport if self.backend is not None else None
        if backend is not None:
            if getattr(backend, "producer", None) is not None:
                cast(IConsumer, backend).unregisterProducer()
            backend.loseConnection()


class FrontendFactory(ListenerFactory[FrontendProtocol]):
    """A front-end listener: its settings, secrets and connections.

    Args:
        name: The listener's name (also the key of its backend secret).
        settings: What it speaks and where its backend is.
        secrets: The secrets file (``[upstreams] NAME`` for SSMP).
        reactor: Connects to the backend and keeps the login time-out.
        metrics: Counters.
    """

    kind = "frontend"
    protocol = FrontendProtocol

    def __init__(
        self,
        *,
        name: str,
        settings: FrontendSettings,
        secrets: Secrets,
        reactor: Any,
        metrics: GatewayMetrics | None,
    ) -> None:
        super().__init__(name, metrics)
        self.settings = settings
        self.secrets = secrets
        self.reactor = reactor
        self.clock: IReactorTime = reactor
        timeout = settings.connect_timeout_seconds
        description = settings.backend
        if "timeout=" not in description:
            description = f"{description}:timeout={timeout:g}"
        self.backend_description = description
