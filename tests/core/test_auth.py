"""Tests for `gateway.core.auth`: checking login secrets and upstream credentials."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from gateway.core.auth import ANY_IDENTITY, LoginFailurePolicy, LoginThrottle, Secrets


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


# --- LoginThrottle ---------------------------------------------------------------------

POLICY = LoginFailurePolicy(
    delay_seconds=1.0, max_delay_seconds=8.0, per_connection=3, reset_seconds=100.0
)


def _throttle(
    policy: LoginFailurePolicy = POLICY, max_tracked: int = 100
) -> tuple[LoginThrottle, Clock]:
    clock = Clock()
    return LoginThrottle(policy, clock, max_tracked=max_tracked), clock


def test_delays_double_from_the_first_up_to_the_cap() -> None:
    """The n-th refusal in a row waits delay * 2**(n-1), never more than the cap."""
    assert [POLICY.delay_after(n) for n in range(7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert POLICY.delay_after(10_000) == 8.0
    assert LoginFailurePolicy(delay_seconds=0).delay_after(5) == 0.0


def test_refusals_in_a_row_wait_longer_each_time() -> None:
    """Each refusal, answered when its wait is over, makes the next one wait twice as long."""
    throttle, clock = _throttle()
    waits = []
    for _ in range(6):
        assert throttle.wait_seconds("192.0.2.1", "alice") == 0.0
        waits.append(throttle.failed("192.0.2.1", "alice"))
        clock.advance(waits[-1])
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert throttle.failures("192.0.2.1", "alice") == 6


def test_parallel_guesses_are_answered_one_wait_after_another() -> None:
    """Refusals counted at the same moment are answered one delay after the other."""
    throttle, _clock = _throttle()
    assert [throttle.failed("192.0.2.1", None) for _ in range(4)] == [1.0, 3.0, 7.0, 15.0]
    assert throttle.wait_seconds("192.0.2.1", "anyone") == 15.0


def test_the_address_and_the_identity_each_hold_logins_back() -> None:
    """A refusal holds back logins from its address (any identity) and for its identity."""
    throttle, clock = _throttle()
    throttle.failed("192.0.2.1", "alice")
    assert throttle.wait_seconds("192.0.2.1", "bob") == 1.0
    assert throttle.wait_seconds("198.51.100.7", "alice") == 1.0
    assert throttle.wait_seconds("198.51.100.7", "bob") == 0.0
    clock.advance(0.25)
    assert throttle.wait_seconds("192.0.2.1", None) == 0.75


def test_the_worse_count_sets_the_delay() -> None:
    """A new address guessing an identity with refusals waits as long as that identity's count."""
    throttle, clock = _throttle()
    for _ in range(3):
        clock.advance(throttle.failed("192.0.2.1", "alice"))
    assert throttle.failed("198.51.100.7", "alice") == 8.0


def test_success_resets_the_identity_but_not_the_address() -> None:
    """An accepted login forgets its identity's refusals; its address keeps counting."""
    throttle, clock = _throttle()
    for identity in ("alice", "bob", "alice"):
        clock.advance(throttle.failed("192.0.2.1", identity))
    throttle.succeeded("alice")
    assert throttle.failures(None, "alice") == 0
    assert throttle.failures("192.0.2.1", None) == 3
    assert throttle.failed("192.0.2.1", "alice") == 8.0  # the address's fourth


def test_counts_are_forgotten_after_a_quiet_period() -> None:
    """No refusal for reset_seconds: the next one waits the first delay again."""
    throttle, clock = _throttle()
    for _ in range(3):
        clock.advance(throttle.failed("192.0.2.1", "alice"))
    # The last refusal was counted at 3 s (answered at 7 s): forgotten at 103 s.
    clock.advance(95.5)
    assert throttle.failures("192.0.2.1", "alice") == 3
    clock.advance(0.5)
    assert throttle.failures("192.0.2.1", "alice") == 0
    assert len(throttle) == 0
    assert throttle.failed("192.0.2.1", "alice") == 1.0


def test_memory_is_bounded() -> None:
    """Past max_tracked addresses and identities, the least recently refused are forgotten."""
    throttle, _clock = _throttle(max_tracked=10)
    for number in range(100):
        throttle.failed(f"10.0.0.{number}", f"user{number}" * 1000)
    assert len(throttle) == 10
    assert throttle.failures("10.0.0.99", None) == 1
    assert throttle.failures("10.0.0.0", None) == 0


def test_an_unknown_peer_and_identity_are_not_tracked() -> None:
    """Without an address or an identity there is nothing to count against: no wait."""
    throttle, _clock = _throttle()
    assert throttle.failed(None, None) == 0.0
    assert len(throttle) == 0
