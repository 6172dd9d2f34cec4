"""SASL SCRAM-SHA-256 (RFC 5802, RFC 7677): both roles, sans-IO.

MTL authenticates with SASL's challenge-response model (mtl.txt, "Client
Authentication"); PLAIN takes one round, SCRAM takes several, which is what
MTL's ``402 Challenged`` is for. The messages are the RFC's, byte for byte::

    client-first   n,,n=user,r=cnonce
    server-first   r=cnonce+snonce,s=base64(salt),i=iterations
    client-final   c=biws,r=cnonce+snonce,p=base64(ClientProof)
    server-final   v=base64(ServerSignature)

No channel binding (the gs2 header is ``n,,`` or ``y,,``; ``p=`` is
refused) and no authorization identity other than the user itself.
User names are not SASLprep-ed: they are compared as given, after the
RFC's ``=2C`` / ``=3D`` unescaping. The server derives the salted password
from the secret in the secrets file (which holds secrets, not verifiers), so
it needs no new file format.

Both classes raise `ScramError` for anything the RFC does not allow,
including a wrong proof or signature; after that they are spent.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Final

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
"""A client refuses more: a hostile server must not make it spin for minutes."""
MAX_MESSAGE_BYTES: Final = 1024
"""No SCRAM message of ours or of an honest peer comes near it."""
NONCE_BYTES: Final = 24
SALT_BYTES: Final = 16


class ScramError(Exception):
    """A SCRAM message that is malformed, out of turn, or fails verification."""


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")


def _salted(password: bytes, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password, salt, iterations)


def _keys(salted: bytes) -> tuple[bytes, bytes, bytes]:
    """ClientKey, StoredKey and ServerKey of a salted password."""
    client_key = _hmac(salted, b"Client Key")
    return client_key, hashlib.sha256(client_key).digest(), _hmac(salted, b"Server Key")


def _xor(left: bytes, right: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(left, right, strict=True))


def _nonce() -> str:
    # Printable ASCII without ",": base64 of random bytes, "+" and "/" included.
    return base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()


def _attributes(message: bytes, names: str) -> list[str]:
    """The values of ``message``'s comma-separated attributes, which must be ``names`` in order.

    Extra attributes after them are refused (RFC 5802 reserves ``m=`` and
    lets no other extension through without negotiation).
    """
    if len(message) > MAX_MESSAGE_BYTES:
        raise ScramError(f"a SCRAM message is at most {MAX_MESSAGE_BYTES} bytes")
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        raise ScramError("a SCRAM message is UTF-8") from None
    parts = text.split(",")
    if len(parts) != len(names):
        raise ScramError(f"expected attributes {', '.join(names)}, got {text!r}")
    values = []
    for name, part in zip(names, parts, strict=True):
        if part[:2] != f"{name}=":
            raise ScramError(f"expected attribute {name}=, got {part[:2]!r}")
        values.append(part[2:])
    return values


def _b64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ScramError(f"{what} is not base64") from None


def _escape(user: str) -> str:
    return user.replace("=", "=3D").replace(",", "=2C")


def _unescape(name: str) -> str:
    # RFC 5802 section 5.1: "=" only as "=2C" or "=3D".
    if name.replace("=2C", "").replace("=3D", "").count("="):
        raise ScramError("a user name escapes '=' and ',' as =3D and =2C only")
    return name.replace("=2C", ",").replace("=3D", "=")


class ScramServer:
    """The server side of one SCRAM-SHA-256 exchange.

    Args:
        lookup: The secret a user logs in with, or None for an unknown user
            (the exchange then goes on with a made-up salt and fails at the
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
        self._server_nonce = nonce if nonce is not None else _nonce()
        self._salt = salt if salt is not None else secrets.token_bytes(SALT_BYTES)
        self._state = "first"
        self._user = ""
        self._secret: bytes | None = None
        self._nonce = ""
        self._client_first_bare = ""
        self._server_first = ""

    @property
    def user(self) -> str:
        """The user named in the client-first message."""
        return self._user

    @property
    def secret(self) -> bytes | None:
        """The user's secret, once the proof verified; None before."""
        return self._secret if self._state == "done" else None

    def first(self, client_first: bytes) -> bytes:
        """Take the client-first message; return the server-first one.

        Raises:
            ScramError: Malformed, out of turn, or asking for channel binding.
        """
        self._expect("first")
        header, _, bare = client_first.partition(b",,")
        if header not in (b"n", b"y"):
            raise ScramError("no channel binding here: the gs2 header is 'n,,' or 'y,,'")
        name, client_nonce = _attributes(bare, "nr")
        if not client_nonce or not name:
            raise ScramError("client-first needs a user name and a nonce")
        self._user = _unescape(name)
        self._client_first_bare = bare.decode()
        self._nonce = client_nonce + self._server_nonce
        salt = base64.b64encode(self._salt).decode()
        self._server_first = f"r={self._nonce},s={salt},i={self._iterations}"
        self._state = "final"
        return self._server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        """Take the client-final message; return the server-final one.

        Raises:
            ScramError: Malformed, out of turn, or a proof that does not verify.
        """
        self._expect("final")
        self._state = "spent"
        binding, nonce, proof_text = _attributes(client_final, "crp")
        if _b64(binding, "c=") not in (b"n,,", b"y,,") or nonce != self._nonce:
            raise ScramError("client-final does not continue this exchange")
        proof = _b64(proof_text, "the proof")
        secret = self._lookup(self._user)
        # An unknown user gets a secret no proof can match, at the same cost.
        password = secret if secret is not None else secrets.token_bytes(32)
        _, stored_key, server_key = _keys(_salted(password, self._salt, self._iterations))
        message = self._auth_message(client_final)
        signature = _hmac(stored_key, message)
        if len(proof) != len(signature):
            raise ScramError("the proof does not verify")
        client_key = _xor(proof, signature)
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), stored_key):
            raise ScramError("the proof does not verify")
        if secret is None:  # pragma: no cover - a proof for a random secret
            raise ScramError("the proof does not verify")
        self._secret = secret
        self._state = "done"
        server_signature = base64.b64encode(_hmac(server_key, message)).decode()
        return f"v={server_signature}".encode()

    def _auth_message(self, client_final: bytes) -> bytes:
        without_proof = client_final.rsplit(b",p=", 1)[0].decode()
        return f"{self._client_first_bare},{self._server_first},{without_proof}".encode()

    def _expect(self, state: str) -> None:
        if self._state != state:
            raise ScramError(f"a SCRAM message out of turn (the exchange is at {self._state!r})")


class ScramClient:
    """The client side of one SCRAM-SHA-256 exchange.

    Args:
        user: Who logs in.
        password: Its secret.
        nonce: The client nonce (tests give the RFC's); random if None.
    """

    def __init__(self, user: str, password: bytes, *, nonce: str | None = None) -> None:
        self._password = password
        self._nonce = nonce if nonce is not None else _nonce()
        self._client_first_bare = f"n={_escape(user)},r={self._nonce}"
        self._server_signature = b""
        self._state = "first"

    def first(self) -> bytes:
        """Return the client-first message."""
        self._expect("first")
        self._state = "final"
        return f"n,,{self._client_first_bare}".encode()

    def final(self, server_first: bytes) -> bytes:
        """Take the server-first message; return the client-final one.

        Raises:
            ScramError: Malformed, a nonce that does not extend ours, or an
                iteration count out of bounds.
        """
        self._expect("final")
        self._state = "verify"
        nonce, salt_text, count = _attributes(server_first, "rsi")
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise ScramError("the server's nonce does not extend ours")
        if not count.isdigit() or not MIN_ITERATIONS <= int(count) <= MAX_ITERATIONS:
            raise ScramError(f"iteration count {count!r} out of bounds")
        salt = _b64(salt_text, "the salt")
        client_key, stored_key, server_key = _keys(_salted(self._password, salt, int(count)))
        without_proof = f"c=biws,r={nonce}"
        message = f"{self._client_first_bare},{server_first.decode()},{without_proof}".encode()
        proof = base64.b64encode(_xor(client_key, _hmac(stored_key, message))).decode()
        self._server_signature = _hmac(server_key, message)
        return f"{without_proof},p={proof}".encode()

    def verify(self, server_final: bytes) -> None:
        """Check the server-final message: the server knew the secret too.

        Raises:
            ScramError: Malformed, an ``e=`` error, or a wrong signature.
        """
        self._expect("verify")
        self._state = "spent"
        if server_final.startswith(b"e="):
            raise ScramError(f"the server refused: {server_final[2:].decode(errors='replace')}")
        (signature,) = _attributes(server_final, "v")
        if not hmac.compare_digest(_b64(signature, "v="), self._server_signature):
            raise ScramError("the server's signature does not verify")

    def _expect(self, state: str) -> None:
        if self._state != state:
            raise ScramError(f"a SCRAM message out of turn (the exchange is at {self._state!r})")
