"""Tests for `gateway.core.auth`: checking login secrets and upstream credentials."""

from __future__ import annotations

import pytest

from gateway.core.auth import ANY_IDENTITY, Secrets


def test_each_identity_has_its_own_secret() -> None:
    """An identity logs in with its own secret, and not with someone else's."""
    secrets = Secrets(logins={"alice": b"a-secret", "bob": b"b-secret"})
    assert secrets.verify("alice", b"a-secret")
    assert secrets.verify("bob", b"b-secret")
    assert not secrets.verify("alice", b"b-secret")
    assert not secrets.verify("bob", b"a-secret")


@pytest.mark.parametrize("attempt", [b"", b"a-secre", b"a-secret2", b"A-SECRET", b" a-secret"])
def test_near_misses_are_refused(attempt: bytes) -> None:
    """Only the exact secret works: no prefixes, extensions or case changes."""
    assert not Secrets(logins={"alice": b"a-secret"}).verify("alice", attempt)


def test_shared_secret_for_any_identity() -> None:
    """The ``*`` secret lets any identity without its own secret log in."""
    secrets = Secrets(logins={ANY_IDENTITY: b"shared", "alice": b"a-secret"})
    assert ANY_IDENTITY == "*"
    assert secrets.verify("carol", b"shared")
    assert secrets.verify("dave", b"shared")
    assert not secrets.verify("carol", b"a-secret")


def test_own_secret_takes_precedence_over_shared() -> None:
    """An identity with its own secret cannot use the shared one instead."""
    secrets = Secrets(logins={ANY_IDENTITY: b"shared", "alice": b"a-secret"})
    assert secrets.verify("alice", b"a-secret")
    assert not secrets.verify("alice", b"shared")


def test_identity_without_secret_is_refused() -> None:
    """Without its own secret or a shared one, an identity cannot log in."""
    secrets = Secrets(logins={"alice": b"a-secret"})
    assert not secrets.verify("mallory", b"a-secret")
    assert not secrets.verify("mallory", b"")
    assert not Secrets().verify("alice", b"a-secret")


def test_no_credential_is_refused() -> None:
    """A login without any secret (None) never succeeds, shared secret or not."""
    secrets = Secrets(logins={"alice": b"a-secret", ANY_IDENTITY: b"shared"})
    assert not secrets.verify("alice", None)
    assert not secrets.verify("carol", None)


def test_credential_for_upstreams() -> None:
    """The gateway presents the upstream's own secret; None when it has none."""
    secrets = Secrets(logins={"central": b"login-side"}, upstreams={"central": b"gw-secret"})
    assert secrets.credential_for("central") == b"gw-secret"
    assert secrets.credential_for("elsewhere") is None
    assert Secrets().credential_for("central") is None


def test_secrets_are_a_read_only_copy() -> None:
    """The mappings are copied on the way in and cannot be changed afterwards."""
    logins = {"alice": b"a-secret"}
    secrets = Secrets(logins=logins)
    logins["alice"] = b"changed"
    assert secrets.verify("alice", b"a-secret")
    with pytest.raises(TypeError):
        secrets.logins["alice"] = b"changed"  # type: ignore[index]
