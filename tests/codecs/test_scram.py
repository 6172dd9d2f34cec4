"""SCRAM-SHA-256 (RFC 5802, RFC 7677): the RFC's example, both roles; bad input."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.codecs.scram import ScramClient, ScramError, ScramServer

# RFC 7677 section 3: user "user", password "pencil".
CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
SERVER_FIRST = (
    b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
)
CLIENT_FINAL = (
    b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)
SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def rfc_server(password: bytes = b"pencil") -> ScramServer:
    """A server for the RFC's user with the RFC's nonce and salt."""
    return ScramServer({"user": password}.get, nonce=SERVER_NONCE, salt=SALT)


def test_rfc7677_example_server_side() -> None:
    """The server answers the RFC's client messages with the RFC's, and learns the user."""
    server = rfc_server()
    assert server.first(CLIENT_FIRST) == SERVER_FIRST
    assert server.secret is None
    assert server.final(CLIENT_FINAL) == SERVER_FINAL
    assert (server.user, server.secret) == ("user", b"pencil")


def test_rfc7677_example_client_side() -> None:
    """The client sends the RFC's messages and accepts the RFC's server signature."""
    client = ScramClient("user", b"pencil", nonce=CLIENT_NONCE)
    assert client.first() == CLIENT_FIRST
    assert client.final(SERVER_FIRST) == CLIENT_FINAL
    client.verify(SERVER_FINAL)


def test_wrong_password_and_unknown_user_fail_at_the_proof() -> None:
    """A wrong password or an unknown user gets a server-first, then fails the same way."""
    for server in (rfc_server(b"crayon"), ScramServer({}.get, nonce=SERVER_NONCE, salt=SALT)):
        assert server.first(CLIENT_FIRST) == SERVER_FIRST
        with pytest.raises(ScramError, match="does not verify"):
            server.final(CLIENT_FINAL)
        assert server.secret is None


def test_a_secret_saslprep_refuses_fails_like_an_unknown_user() -> None:
    """A stored secret SASLprep refuses still gets the server-first, then fails at the proof."""
    server = rfc_server(b"pen\x07cil")
    assert server.first(CLIENT_FIRST) == SERVER_FIRST
    with pytest.raises(ScramError, match="does not verify"):
        server.final(CLIENT_FINAL)


def test_client_refuses_a_forged_server_signature() -> None:
    """A server that does not know the password cannot produce the signature."""
    client = ScramClient("user", b"pencil", nonce=CLIENT_NONCE)
    client.first()
    client.final(SERVER_FIRST)
    with pytest.raises(ScramError, match="signature"):
        client.verify(b"v=" + base64.b64encode(b"\0" * 32))


def test_client_refuses_bad_server_first() -> None:
    """A nonce not extending ours, or a silly iteration count, is refused."""
    for server_first in (
        b"r=other,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
        b"r=rOprNGfwEbeRWgbNEkqOx,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=1",
        b"r=rOprNGfwEbeRWgbNEkqOx,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=999999999",
        b"r=rOprNGfwEbeRWgbNEkqOx,s=***,i=4096",
    ):
        client = ScramClient("user", b"pencil", nonce=CLIENT_NONCE)
        client.first()
        with pytest.raises(ScramError):
            client.final(server_first)


def test_client_bounds_iterations_below_scramps_own_limit() -> None:
    """Two million iterations are refused: our bound, tighter than scramp's ten million."""
    client = ScramClient("user", b"pencil", nonce=CLIENT_NONCE)
    client.first()
    with pytest.raises(ScramError, match="out of bounds"):
        client.final(b"r=rOprNGfwEbeRWgbNEkqOx,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=2000000")


def test_client_refuses_a_name_or_password_saslprep_refuses() -> None:
    """An empty user name or a password with a control character is a ScramError at once."""
    for user, password in (("", b"pencil"), ("user", b"pen\x07cil"), ("user", b"\xff")):
        with pytest.raises(ScramError):
            ScramClient(user, password)


@pytest.mark.parametrize(
    "client_first",
    [
        b"p=tls-unique,,n=user,r=abc",  # channel binding asked for
        b"n,,r=abc,n=user",  # attributes out of order
        b"n,,n=,r=abc",  # no user
        b"n,,n=us=er,r=abc",  # bad escape
        b"n,,n=user,r=abc,m=ext",  # mandatory extension
        b"\xff\xfe",
        b"n,," + b"x" * 2000,
    ],
)
def test_server_refuses_bad_client_first(client_first: bytes) -> None:
    """Malformed client-first messages raise ScramError, nothing else."""
    with pytest.raises(ScramError):
        rfc_server().first(client_first)


def test_out_of_turn_and_replayed_messages() -> None:
    """A final before a first, a first twice, or a final for another exchange are refused."""
    with pytest.raises(ScramError, match="out of turn"):
        rfc_server().final(CLIENT_FINAL)
    server = rfc_server()
    server.first(CLIENT_FIRST)
    with pytest.raises(ScramError, match="out of turn"):
        server.first(CLIENT_FIRST)
    other = ScramServer({"user": b"pencil"}.get, salt=SALT)  # a fresh server nonce
    other.first(CLIENT_FIRST)
    with pytest.raises(ScramError, match="does not continue"):
        other.final(CLIENT_FINAL)


def test_escaped_user_names_round_trip() -> None:
    """A user with ',' and '=' is escaped by the client and unescaped by the server."""
    client = ScramClient("a,b=c", b"pw")
    server = ScramServer({"a,b=c": b"pw"}.get)
    client.verify(server.final(client.final(server.first(client.first()))))
    assert server.user == "a,b=c"


@settings(max_examples=200, deadline=None)
@given(first=st.binary(max_size=200), final=st.binary(max_size=200))
def test_garbage_gives_scram_error_only(first: bytes, final: bytes) -> None:
    """Arbitrary bytes either pass a step or raise ScramError, nothing else."""
    server = ScramServer({"user": b"pencil"}.get, iterations=4096)
    try:
        server.first(first)
        server.final(final)
    except ScramError:
        pass
    assert server.secret is None or server.user == "user"
