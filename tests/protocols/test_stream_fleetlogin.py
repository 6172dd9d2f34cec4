"""The fleet's relay login (`gateway.protocols.stream.fleetlogin`): proofs on the wire."""

from __future__ import annotations

import pytest

from gateway.protocols.stream.fleetlogin import (
    ANONYMOUS,
    CLIENT,
    ROUTES,
    RelayIdentity,
    channel_binding,
    check_owner_proof,
    check_relay_response,
    new_nonce,
    owner_proof,
    relay_response,
)

SECRET = b"a fleet secret of some length"
ALICE = RelayIdentity(node="gw-a", role=CLIENT, principal="alice")
NONCES = {"owner_nonce": "owner-1", "relay_nonce": "relay-1", "binding": b"\x00tls\x00"}


def test_a_good_login_states_its_identity_and_never_the_secret() -> None:
    """The owner reads node, role and identity from a proof that holds; the secret is not sent."""
    data = relay_response(SECRET, who=ALICE, **NONCES)
    assert SECRET not in data
    assert check_relay_response(SECRET, data, **NONCES) == ALICE


@pytest.mark.parametrize(
    "who",
    [RelayIdentity(node="gw-a", role=ROUTES), RelayIdentity(node="gw-a", role=ANONYMOUS)],
)
def test_routes_and_anonymous_have_no_identity(who: RelayIdentity) -> None:
    """The routes' relay and an ANONYMOUS client's state no identity."""
    data = relay_response(SECRET, who=who, **NONCES)
    assert check_relay_response(SECRET, data, **NONCES) == who


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("owner_nonce", "owner-2"),
        ("relay_nonce", "relay-2"),
        ("binding", b"another TLS session"),
    ],
)
def test_a_proof_holds_for_its_own_connection_only(field: str, value: object) -> None:
    """Another nonce or another TLS session: the proof fails (no replay, no relaying a login)."""
    data = relay_response(SECRET, who=ALICE, **NONCES)
    elsewhere = {**NONCES, field: value}
    assert check_relay_response(SECRET, data, **elsewhere) is None


def test_another_secret_or_another_identity_fails() -> None:
    """A node with another secret, or a stated identity changed on the way, is refused."""
    data = relay_response(SECRET, who=ALICE, **NONCES)
    assert check_relay_response(b"another secret entirely", data, **NONCES) is None
    forged = data.replace(b"alice", b"admin")
    assert check_relay_response(SECRET, forged, **NONCES) is None


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", b"gw-a\0client\0\0" + b"0" * 64, b"gw-a\0king\0x\0" + b"0" * 64, b"a\0b"],
)
def test_malformed_logins_are_refused(data: bytes) -> None:
    """Not UTF-8, missing fields, an unknown role, a client without identity: refused."""
    assert check_relay_response(SECRET, data, **NONCES) is None


def test_the_owner_proves_the_secret_too() -> None:
    """The owner's answer is checked by the relay: a node without the secret cannot make it."""
    proof = owner_proof(SECRET, who=ALICE, **NONCES)
    assert check_owner_proof(SECRET, proof, who=ALICE, **NONCES)
    assert not check_owner_proof(SECRET, None, who=ALICE, **NONCES)
    other = owner_proof(b"another secret entirely", who=ALICE, **NONCES)
    assert not check_owner_proof(SECRET, other, who=ALICE, **NONCES)
    relay = relay_response(SECRET, who=ALICE, **NONCES)
    assert not check_owner_proof(SECRET, relay.split(b"\0")[-1], who=ALICE, **NONCES)


def test_nonces_differ_and_plain_tcp_has_no_binding() -> None:
    """Each connection its own nonce; a transport without TLS binds nothing."""
    assert new_nonce() != new_nonce()
    assert channel_binding(object()) == b""
