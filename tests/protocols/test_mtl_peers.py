"""Tests for `gateway.protocols.mtl.peers.DataPeer.summon`: a data peer's Summon and Dismiss."""

from __future__ import annotations

from gateway.codecs import mtl
from gateway.protocols.mtl.control import DataLease
from gateway.protocols.mtl.peers import DataPeer


def reader(*resources: str, kind: str = "reader") -> DataPeer:
    """A peer holding a gateway-profile lease of ``kind`` for ``resources`` (none: any)."""
    return DataPeer(b"p", lease=DataLease("gateway", kind, resources, "full", "alice"))


def test_without_a_lease_403() -> None:
    """Neither Summon nor Dismiss is taken from a peer without a lease."""
    peer = DataPeer(b"p")
    assert peer.summon(mtl.Summon(1, "news"), lambda: True) == 403
    assert peer.summon(mtl.Dismiss(2, "news"), lambda: True) == 403
    assert peer.summoned == set()


def test_summon_once_dismiss_once() -> None:
    """A resource of the lease is summoned once and dismissed once; a second time is 400."""
    peer = reader("news", "sport")
    assert peer.summon(mtl.Summon(1, "news"), lambda: True) == 200
    assert peer.summon(mtl.Summon(2, "news"), lambda: True) == 400
    assert peer.summoned == {"news"}
    assert peer.summon(mtl.Dismiss(3, "sport"), lambda: True) == 400
    assert peer.summon(mtl.Dismiss(4, "news"), lambda: True) == 200
    assert peer.summon(mtl.Dismiss(5, "news"), lambda: True) == 400
    assert peer.summoned == set()


def test_outside_the_lease_or_a_writer_400() -> None:
    """A resource the lease does not name, or a writer's Summon: 400, nothing summoned."""
    assert reader("news").summon(mtl.Summon(1, "sport"), lambda: True) == 400
    writer = reader("news", kind="writer")
    assert writer.summon(mtl.Summon(1, "news"), lambda: True) == 400
    assert writer.summoned == set()


def test_a_lease_for_any_resource_asks_authorization() -> None:
    """Under a lease for "any and all", each Summon asks; refused is 403. A named lease does not."""
    asked: list[None] = []

    def refuse() -> bool:
        asked.append(None)
        return False

    peer = reader()
    assert peer.summon(mtl.Summon(1, "news"), refuse) == 403
    assert peer.summoned == set()
    assert peer.summon(mtl.Summon(2, "news"), lambda: True) == 200
    assert peer.summoned == {"news"}
    assert reader("news").summon(mtl.Summon(1, "news"), refuse) == 200
    assert len(asked) == 1
