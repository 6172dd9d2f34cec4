"""Which node owns each stream (`gateway.fleet.streams`): rendezvous hashing and pins.

The rule is checked alone (stable, balanced, moving little when nodes come
and go, the same in every process and version: fixed owners of a few names)
and as `StreamOwnership` over a `Membership` of in-memory nodes
(tests/fleet/test_members.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from gateway.fleet.streams import StreamOwnership, rendezvous_owner
from tests.fleet.test_members import World

NODES = [f"edge-{index}" for index in range(1, 6)]
STREAMS = [f"stream-{index}" for index in range(10_000)]


def test_the_rule_is_fixed_across_processes_and_versions() -> None:
    """Known owners: a change of the rule would move streams in a fleet of mixed versions."""
    three = ["edge-1", "edge-2", "edge-3"]
    assert [rendezvous_owner(name, three) for name in ("orders", "ticks", "audit", "s-1")] == [
        "edge-1",
        "edge-1",
        "edge-2",
        "edge-2",
    ]
    code = (
        "from gateway.fleet.streams import rendezvous_owner as r;"
        " print(r('audit', ['edge-1', 'edge-2', 'edge-3']))"
    )
    for seed in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parents[2],
        )
        assert run.stdout.strip() == "edge-2"


def test_the_rule_ignores_the_order_of_nodes() -> None:
    """Every node computes the same owner whatever order it lists the fleet in."""
    for name in STREAMS[:200]:
        assert rendezvous_owner(name, NODES) == rendezvous_owner(name, list(reversed(NODES)))
    assert rendezvous_owner("x", []) is None


def test_the_rule_is_balanced() -> None:
    """Each of five nodes owns a fifth of 10,000 streams, within 10 %."""
    owned = Counter(rendezvous_owner(name, NODES) for name in STREAMS)
    assert set(owned) == set(NODES)
    for count in owned.values():
        assert abs(count - 2_000) < 200, owned


def test_a_join_or_a_leave_moves_only_what_it_must() -> None:
    """A sixth node takes about a sixth, from everyone; a leaver's streams alone move."""
    before = {name: rendezvous_owner(name, NODES) for name in STREAMS}
    joined = {name: rendezvous_owner(name, [*NODES, "edge-6"]) for name in STREAMS}
    moved = [name for name in STREAMS if joined[name] != before[name]]
    assert all(joined[name] == "edge-6" for name in moved)
    assert abs(len(moved) - len(STREAMS) / 6) < 250
    left = {name: rendezvous_owner(name, NODES[1:]) for name in STREAMS}
    assert all(left[name] == before[name] for name in STREAMS if before[name] != "edge-1")


def test_ownership_over_the_live_nodes() -> None:
    """Owners come from the live nodes with a stream listener, pins and own streams first."""
    world = World()
    a = world.node("a")
    b = world.node("b")
    c = world.node("c")
    c.addresses = {"hub": ("127.0.0.1", 7000)}  # no stream listener there
    world.wait(3)
    ownership = StreamOwnership(a.members, ["streams"], {"pinned": "b"})
    moved: list[None] = []
    ownership.on_change(lambda: moved.append(None))
    owners = {ownership.owner(name) for name in STREAMS[:100]}
    assert owners == {"a", "b"}
    assert ownership.owner("msggateway.outcomes") == "a"  # each node's own
    assert ownership.owner("pinned") == "b"
    assert ownership.address("b", "streams") == ("127.0.0.1", 5000)
    b.members.stop()
    world.settle()
    assert moved == [None]
    assert ownership.owner("pinned") is None  # pinned to a node that is down: no owner
    assert {ownership.owner(name) for name in STREAMS[:100]} == {"a"}
