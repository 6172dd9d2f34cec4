"""SASL SCRAM-SHA-256 (RFC 5802, RFC 7677) for MTL: a thin adapter over ``scramp``.

MTL authenticates with SASL's challenge-response model (mtl.txt, "Client
Authentication"); PLAIN takes one round, SCRAM takes several, which is what
MTL's ``402 Challenged`` is for. The messages are the RFC's, byte for byte::

    client-first   n,,n=user,r=cnonce
    server-first   r=cnonce+snonce,s=base64(salt),i=iterations
    client-final   c=biws,r=cnonce+snonce,p=base64(ClientProof)
    server-final   v=base64(ServerSignature)

``scramp`` (both roles, RFC 5802/7677) does the algorithm: message syntax,
the gs2 header (``n,,`` or ``y,,``; ``p=`` is refused, there is no channel
binding), nonce checks, SASLprep of user names and passwords, the
``=2C`` / ``=3D`` escapes, the keys, proof and signature, and the 4,096
iteration floor. Like our codecs it does no I/O. What stays here, and why:

- Bytes at the edge: MTL carries base64 blobs, scramp takes ``str``; a
  message is capped (`MAX_MESSAGE_BYTES`) and decoded as UTF-8 here.
- Turn order: one state per exchange, so a message out of turn is refused
  the same way in both roles and an exchange that failed stays spent.
- The credential: the secrets file keeps plain secrets (no new file
  format), and the MTL server re-checks a session's secret against it, so
  the server derives scramp's stored key and server key per login with
  ``make_auth_info`` and hands the secret back once the proof verified.
- Unknown users: scramp stops at the client-first; we go on with a made-up
  secret at the same cost and fail at the proof, so that unknown users
  cannot be told from wrong passwords.
- A client refuses more than `MAX_ITERATIONS` (scramp allows 10,000,000):
  a hostile server must not hold the reactor for seconds.
- One error, `ScramError`, whose text says which message was refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Final

import scramp  # type: ignore[import-untyped]

__all__ = [
    "DEFAULT_ITERATIONS",
    "MECHANISM",
    "MIN_ITERATIONS",
    "ScramClient",
    "ScramError",
    "ScramServer",
]

MECHANISM: Final = "SCRAM-SHA-256"
DEFAULT_ITERATIONS: Final = 4096
"""RFC 7677 section 4: at least 4,096 iterations."""
MIN_ITERATIONS: Final = 4096
MAX_ITERATIONS: Final = 1_000_000
"""A client refuses more: a hostile server must not make it spin for seconds."""
MAX_MESSAGE_BYTES: Final = 1024
"""No SCRAM message of ours or of an honest peer comes near it."""
_INVALID_PROOF: Final = "invalid-proof"
"""RFC 5802's server-error-value for a proof that does not verify."""
_MECHANISM: Final = scramp.ScramMechanism(MECHANISM)


class ScramError(Exception):
    """A SCRAM message that is malformed, out of turn, or fails verification."""


def _text(message: bytes) -> str:
    if len(message) > MAX_MESSAGE_BYTES:
        raise ScramError(f"a SCRAM message is at most {MAX_MESSAGE_BYTES} bytes")
    try:
        return message.decode("utf-8")
    except UnicodeDecodeError:
        raise ScramError("a SCRAM message is UTF-8") from None


class _Turns:
    """Which message an exchange takes next; anything else is out of turn."""

    def __init__(self) -> None:
        self.state = "first"

    def expect(self, state: str, then: str) -> None:
        if self.state != state:
            raise ScramError(f"a SCRAM message out of turn (the exchange is at {self.state!r})")
        self.state = then


class ScramServer:
    """The server side of one SCRAM-SHA-256 exchange.

    Args:
        lookup: The secret a user logs in with, or None for an unknown user
            (the exchange then goes on with a made-up secret and fails at the
            proof, so that unknown users cannot be told from wrong passwords).
        iterations: PBKDF2 iterations announced to the client.
        nonce: The server's nonce part (tests give the RFC's); random if None.
        salt: The salt (tests give the RFC's); random if None.
    """

    def __init__(
        self,
        lookup: Callable[[str], bytes | None],
        *,
        iterations: int = DEFAULT_ITERATIONS,
        nonce: str | None = None,
        salt: bytes | None = None,
    ) -> None:
        self._lookup = lookup
        self._iterations = iterations
        self._salt = salt
        self._exchange = _MECHANISM.make_server(self._auth_info, s_nonce=nonce)
        self._turns = _Turns()
        self._user = ""
        self._candidate: bytes | None = None
        self._secret: bytes | None = None

    @property
    def user(self) -> str:
        """The user named in the client-first message (SASLprep-ed)."""
        return self._user

    @property
    def secret(self) -> bytes | None:
        """The user's secret, once the proof verified; None before."""
        return self._secret

    def first(self, client_first: bytes) -> bytes:
        """Take the client-first message; return the server-first one.

        Raises:
            ScramError: Malformed, out of turn, or asking for channel binding.
        """
        self._turns.expect("first", "spent")
        try:
            self._exchange.set_client_first(_text(client_first))
            server_first = str(self._exchange.get_server_first())
        except scramp.ScramException as exc:
            raise ScramError(f"client-first refused: {exc}") from None
        self._turns.state = "final"
        return server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        """Take the client-final message; return the server-final one.

        Raises:
            ScramError: Malformed, out of turn, or a proof that does not verify.
        """
        self._turns.expect("final", "spent")
        try:
            self._exchange.set_client_final(_text(client_final))
            server_final = str(self._exchange.get_server_final())
        except scramp.ScramException as exc:
            error = exc.server_error
            if error is not None and error.value == _INVALID_PROOF:
                raise ScramError("the proof does not verify") from None
            raise ScramError(f"client-final does not continue this exchange: {exc}") from None
        if self._candidate is None:  # pragma: no cover - a proof for a random secret
            raise ScramError("the proof does not verify")
        self._secret = self._candidate
        return server_final.encode()

    def _auth_info(self, user: str) -> tuple[bytes, bytes, bytes, int]:
        """Scramp's credential for ``user``: salt, StoredKey, ServerKey, iterations."""
        self._user = user
        secret = self._lookup(user)
        try:
            if secret is not None:
                info = self._derive(secret.decode("utf-8"))
                self._candidate = secret
                return info
        except (UnicodeDecodeError, scramp.ScramException):
            pass  # a secret SASLprep refuses cannot log in; fail like an unknown user
        # An unknown user gets a secret no proof can match, at the same cost.
        return self._derive(secrets.token_hex(32))

    def _derive(self, password: str) -> tuple[bytes, bytes, bytes, int]:
        salt, stored_key, server_key, iterations = _MECHANISM.make_auth_info(
            password, iteration_count=self._iterations, salt=self._salt
        )
        return bytes(salt), bytes(stored_key), bytes(server_key), int(iterations)


class ScramClient:
    """The client side of one SCRAM-SHA-256 exchange.

    Args:
        user: Who logs in.
        password: Its secret (UTF-8).
        nonce: The client nonce (tests give the RFC's); random if None.

    Raises:
        ScramError: A user name or password SASLprep refuses.
    """

    def __init__(self, user: str, password: bytes, *, nonce: str | None = None) -> None:
        try:
            self._exchange = scramp.ScramClient(
                [MECHANISM], user, password.decode("utf-8"), c_nonce=nonce
            )
        except UnicodeDecodeError:
            raise ScramError("a SCRAM password is UTF-8") from None
        except scramp.ScramException as exc:
            raise ScramError(f"cannot log in as {user!r}: {exc}") from None
        self._turns = _Turns()

    def first(self) -> bytes:
        """Return the client-first message."""
        self._turns.expect("first", "final")
        return str(self._exchange.get_client_first()).encode()

    def final(self, server_first: bytes) -> bytes:
        """Take the server-first message; return the client-final one.

        Raises:
            ScramError: Malformed, a nonce that does not extend ours, or an
                iteration count out of bounds.
        """
        self._turns.expect("final", "spent")
        try:
            self._exchange.set_server_first(_text(server_first))
        except scramp.ScramException as exc:
            raise ScramError(f"server-first refused: {exc}") from None
        count = int(self._exchange.iterations)
        if count > MAX_ITERATIONS:
            raise ScramError(f"iteration count {count} out of bounds (at most {MAX_ITERATIONS})")
        client_final = str(self._exchange.get_client_final())
        self._turns.state = "verify"
        return client_final.encode()

    def verify(self, server_final: bytes) -> None:
        """Check the server-final message: the server knew the secret too.

        Raises:
            ScramError: Malformed, an ``e=`` error, or a wrong signature.
        """
        self._turns.expect("verify", "spent")
        try:
            self._exchange.set_server_final(_text(server_final))
        except scramp.ScramException as exc:
            raise ScramError(f"server-final refused: {exc}") from None
