"""Which node of the fleet owns each stream of the embedded log.

DESIGN.md, "Scale": an embedded stream has one owner node; Metadata from
any node names it, as RabbitMQ names a stream's leader. The embedded log
is each node's own and is not replicated: a stream's messages are in the
log of the node that owned it when they were published.

The owner of a stream is, in this order:

1. this node, for the gateway's own streams (``msggateway.*``: each node's
   durable routes, outcomes and dead letters are its own);
2. the node ``[fleet.streams]`` pins it to, while that node is live; while
   it is not, the stream has no owner (Metadata and publishers get code 6,
   stream not available, as RabbitMQ answers for a stream whose leader is
   down and has no replica): a pinned stream's history stays on one node;
3. otherwise the live node that rendezvous hashing picks among those with
   a stream listener: the node with the highest ``hash(stream, node)``
   (`rendezvous_owner`). Every node computes the same owner from the same
   live set, without asking anyone; and when a node joins or leaves, only
   the streams it wins or held move (about one in N), not a reshuffle.

When the owner of a stream changes, the new owner goes on from its own log:
what the old owner stored stays there (readable again if ownership comes
back, or with the Spark source from that node's data dir), and a consumer
resuming from a stored offset at the new owner finds another history. The
nodes tell their clients of a move as RabbitMQ tells of a leader change
(MetadataUpdate, code 6), and the clients ask Metadata again. Pin the
streams whose history must stay in one place, or keep them in RabbitMQ
(a stream upstream) where they are replicated.

`StreamOwnership` is the stream listener's placement
(`gateway.protocols.stream.relay.StreamPlacement`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from gateway.core.internal import is_internal
from gateway.fleet.members import Membership

__all__ = ["StreamOwnership", "rendezvous_owner", "weight"]

_WEIGHT_BYTES: Final = 8


def weight(stream: str, node: str) -> int:
    """The rendezvous weight of ``node`` for ``stream``: 64 bits of BLAKE2b of both."""
    digest = hashlib.blake2b(
        stream.encode("utf-8") + b"\0" + node.encode("utf-8"), digest_size=_WEIGHT_BYTES
    ).digest()
    return int.from_bytes(digest, "big")


def rendezvous_owner(stream: str, nodes: Iterable[str]) -> str | None:
    """The node of ``nodes`` with the highest weight for ``stream`` (None: no nodes)."""
    best: str | None = None
    best_weight = -1
    for node in nodes:
        node_weight = weight(stream, node)
        if node_weight > best_weight or (node_weight == best_weight and node < (best or node)):
            best, best_weight = node, node_weight
    return best


class StreamOwnership:
    """The owner of each stream, over the fleet's live nodes (the module docstring).

    Args:
        membership: The fleet as this node sees it.
        listeners: The names of this node's stream listeners: a node that
            announces none of them owns no streams.
        pins: Stream name to the node that owns it (``[fleet.streams]``).
    """

    def __init__(
        self, membership: Membership, listeners: Iterable[str], pins: Mapping[str, str]
    ) -> None:
        self.membership = membership
        self.node: str = membership.node
        self._listeners = frozenset(listeners)
        self._pins = dict(pins)
        self._callbacks: list[Callable[[], None]] = []
        membership.on_change(self._membership_changed)

    def owner(self, stream: str) -> str | None:
        """The node that owns ``stream`` now; None while it has none (a pinned node is down)."""
        if is_internal(stream):
            return self.node
        pinned = self._pins.get(stream)
        if pinned is not None:
            return pinned if pinned in self.membership.nodes() else None
        return rendezvous_owner(stream, self._eligible())

    def address(self, node: str, listener: str) -> tuple[str, int] | None:
        """Where ``node``'s listener ``listener`` is advertised, if it is live and has it."""
        return self.membership.address(node, listener)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when owners may have changed (nodes joined or left)."""
        self._callbacks.append(callback)

    def _eligible(self) -> list[str]:
        membership = self.membership
        eligible = []
        for node in membership.nodes():
            member = membership.member(node)
            if member is not None and not self._listeners.isdisjoint(member.addresses):
                eligible.append(node)
        return eligible

    def _membership_changed(self, joined: frozenset[str], left: frozenset[str]) -> None:
        for callback in list(self._callbacks):
            callback()
