"""`gateway.fleet.leases`: signed run-time DMP leases, and revocations every node replays.

The lease texts are checked on their own (round trips, tampering, another
secret, the short-string limit); the revocations run on nodes over the
in-memory broker (tests/fleet/broker.py), whose stream each node reads
from its first message.
"""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from gateway.core.auth import Secrets
from gateway.fleet.leases import (
    REVOCATIONS_STREAM,
    REVOCATIONS_WAIT_SECONDS,
    FleetLeases,
    LeaseTooLongError,
    Revocations,
    decode_token,
    encode_token,
)
from gateway.protocols.dmp.fleet import LeaseCheck
from gateway.protocols.dmp.settings import LeaseGrant
from tests.fleet.broker import MemoryBackbone, MemoryBroker

SECRET = b"s" * 32
ID = bytes(range(12))
NOW = 1000.0
STALE_SECONDS = 10.0

# Three names of 10 four-octet characters fit a lease (255 characters of base64 hold 191
# octets: 54 of head and MAC, 3 length octets, 120 of names); longer is refused (below).
names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=10)
grants = st.builds(
    LeaseGrant,
    kind=st.sampled_from(["sink", "feed"]),
    target=names,
    expires=st.integers(min_value=1, max_value=2**40).map(lambda ms: ms / 1000),
    identity=st.none() | names,
    certified=st.booleans(),
)


@given(listener=names, grant=grants)
def test_a_lease_text_round_trips(listener: str, grant: LeaseGrant) -> None:
    """Any grant, signed, reads back as itself with its id."""
    token = decode_token(SECRET, encode_token(SECRET, listener, grant, ID))
    assert token is not None
    assert (token.listener, token.grant, token.id) == (listener, grant, ID.hex())


@given(grant=grants, position=st.integers(min_value=0), data=st.data())
def test_any_change_to_a_lease_text_is_refused(
    grant: LeaseGrant, position: int, data: st.DataObject
) -> None:
    """One character changed anywhere (payload or MAC): not a lease of the fleet."""
    text = encode_token(SECRET, "dmp", grant, ID)
    index = position % len(text)
    other = data.draw(st.sampled_from("AQgw-_09").filter(lambda c: c != text[index]))
    changed = text[:index] + other + text[index + 1 :]
    token = decode_token(SECRET, changed)
    # Base64's last character may carry unused bits: the same octets are the same lease.
    assert token is None or base64.urlsafe_b64decode(
        changed + "=" * (-len(changed) % 4)
    ) == base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@given(text=st.text(max_size=300))
def test_garbage_is_no_lease(text: str) -> None:
    """Arbitrary text is no lease of the fleet, and never raises."""
    assert decode_token(SECRET, text) is None


def test_another_secret_or_a_cut_text_is_refused() -> None:
    """A lease signed under another secret, or cut short, is refused."""
    grant = LeaseGrant(kind="sink", target="orders", expires=NOW + 60)
    text = encode_token(SECRET, "dmp", grant, ID)
    assert decode_token(b"t" * 32, text) is None
    assert decode_token(SECRET, text[:-4]) is None
    assert decode_token(SECRET, "") is None


def test_a_lease_must_fit_a_short_string() -> None:
    """Long names and identity: refused with why, not made too long for DMP."""
    grant = LeaseGrant(kind="feed", target="f" * 60, expires=NOW, identity="i" * 80)
    with pytest.raises(LeaseTooLongError, match="at most 255"):
        encode_token(SECRET, "dmp", grant, ID)
    fits = LeaseGrant(kind="feed", target="f" * 40, expires=NOW, identity="i" * 60)
    assert len(encode_token(SECRET, "dmp", fits, ID)) <= 255


class Node:
    """A node's revocations and leases over the in-memory broker."""

    def __init__(self, broker: MemoryBroker, name: str, secret: bytes = SECRET) -> None:
        self.clock = broker.clock
        self.backbone = MemoryBackbone(broker, name)
        self.revocations = Revocations(self.backbone, self.clock, stale_after_seconds=STALE_SECONDS)
        self.leases = FleetLeases(Secrets(fleet_lease_secret=secret), self.revocations, self.clock)


@pytest.fixture
def broker() -> MemoryBroker:
    """An in-memory broker on a clock at `NOW`."""
    clock = Clock()
    clock.advance(NOW)
    return MemoryBroker(clock)


def grant(seconds: float = 60.0, kind: str = "sink") -> LeaseGrant:
    """A lease of ``orders`` (or feed ``alerts``) for ``seconds`` from `NOW`."""
    return LeaseGrant(
        kind=kind, target="orders" if kind == "sink" else "alerts", expires=NOW + seconds
    )


def test_a_lease_made_on_one_node_is_checked_on_another(broker: MemoryBroker) -> None:
    """Node b accepts a's lease for the listener it names, not for another listener."""
    a, b = Node(broker, "a"), Node(broker, "b")
    broker.clock.advance(0)
    text = a.leases.issue("dmp", grant())
    assert b.leases.check("dmp", text) == grant()
    assert b.leases.check("other", text) is None
    assert Node(broker, "c", secret=b"x" * 32).leases.check("dmp", text) is None
    broker.clock.advance(61)
    assert b.leases.check("dmp", text) is None  # expired


def test_revoked_on_every_node_through_the_stream(broker: MemoryBroker) -> None:
    """A revocation on a reaches b within a broker round trip, and a node that starts later."""
    a, b = Node(broker, "a"), Node(broker, "b")
    broker.clock.advance(0)
    text = a.leases.issue("dmp", grant())
    other = a.leases.issue("dmp", grant())
    revoked: list[bool] = []
    revoking = a.leases.revoke("dmp", text)
    assert revoking is not None
    revoking.addCallback(revoked.append)
    assert a.leases.check("dmp", text) is None  # on the revoking node at once
    broker.clock.advance(0)
    assert revoked == [True]
    assert b.leases.check("dmp", text) is None
    assert b.leases.check("dmp", other) == grant()
    late = Node(broker, "late")
    assert late.leases.check("dmp", text) is LeaseCheck.REVOCATIONS_UNKNOWN  # not read yet
    broker.clock.advance(0)
    assert late.leases.check("dmp", text) is None
    assert late.leases.check("dmp", other) == grant()
    assert a.leases.revoke("dmp", "no lease") is None


def test_revocations_are_forgotten_when_their_lease_expires(broker: MemoryBroker) -> None:
    """A revocation is kept until its lease's expiry, no longer; one of a lease gone is not kept."""
    a = Node(broker, "a")
    broker.clock.advance(0)
    a.revocations.revoke("1" * 24, NOW + 5)
    a.revocations.revoke("2" * 24, NOW - 5)
    assert a.revocations.revoked("1" * 24)
    assert not a.revocations.revoked("2" * 24)
    broker.clock.advance(6)
    assert not a.revocations.revoked("1" * 24)
    assert len(broker.streams[REVOCATIONS_STREAM]) == 3  # two revocations, a's marker


def test_a_node_cut_off_trusts_what_it_read_for_a_while(broker: MemoryBroker) -> None:
    """Without RabbitMQ: known for stale_after_seconds, then unknown until it read the stream."""
    a = Node(broker, "a")
    broker.clock.advance(0)
    text = a.leases.issue("dmp", grant(600))
    a.backbone.kill()
    broker.clock.advance(STALE_SECONDS)
    assert a.leases.check("dmp", text) == grant(600)
    broker.clock.advance(0.5)
    assert a.leases.check("dmp", text) is LeaseCheck.REVOCATIONS_UNKNOWN
    waited: list[None] = []
    a.revocations.when_known().addCallback(waited.append)
    a.backbone.reconnect()
    broker.clock.advance(0)
    assert waited == [None]
    assert a.leases.check("dmp", text) == grant(600)


def test_waiting_for_the_revocations_is_bounded(broker: MemoryBroker) -> None:
    """A node that never read the stream: `when_known` fires after the wait, still unknown."""
    a = Node(broker, "a")
    a.backbone.kill()
    waited: list[None] = []
    a.revocations.when_known().addCallback(waited.append)
    broker.clock.advance(REVOCATIONS_WAIT_SECONDS - 0.1)
    assert waited == []
    broker.clock.advance(0.1)
    assert waited == [None] and not a.revocations.known


def test_a_revocation_without_rabbitmq_says_so(broker: MemoryBroker) -> None:
    """No connection: revoked on this node only, and the answer says False."""
    a = Node(broker, "a")
    broker.clock.advance(0)
    text = a.leases.issue("dmp", grant())
    a.backbone.kill()
    answered: list[bool] = []
    revoking = a.leases.revoke("dmp", text)
    assert revoking is not None
    revoking.addCallback(answered.append)
    assert answered == [False]
    assert a.leases.check("dmp", text) is None


def test_without_a_secret_no_lease_is_made_or_accepted(broker: MemoryBroker) -> None:
    """A node without ``[fleet] lease_secret`` makes none and takes none."""
    a, b = Node(broker, "a"), Node(broker, "b")
    b.leases = FleetLeases(Secrets(), b.revocations, broker.clock)
    with pytest.raises(ValueError, match="lease_secret"):
        b.leases.issue("dmp", grant())
    assert b.leases.check("dmp", a.leases.issue("dmp", grant())) is None


def test_unreadable_records_are_ignored(broker: MemoryBroker) -> None:
    """Garbage on the stream is logged once and changes nothing."""
    a = Node(broker, "a")
    broker.clock.advance(0)
    a.backbone.publish("", REVOCATIONS_STREAM, b"not json", kind="x")
    a.backbone.publish("", REVOCATIONS_STREAM, b'{"revoke": 1}', kind="x")
    broker.clock.advance(0)
    assert a.revocations.known
