"""The DMP listener's seam to the other nodes of a fleet (`gateway.fleet.dmp` provides it).

Without ``[fleet] amqp`` a listener has no link and behaves as a single
gateway. With one (`FleetLink`):

- leases made at run time are signed lease texts every node checks
  (`gateway.fleet.leases`), revoked on every node through RabbitMQ;
- a feed's reader holds the fleet lock ``dmp.<listener>.<feed>`` while it
  reads: a second reader on any node is refused;
- a route's delivery to a feed read on another node is forwarded there
  through RabbitMQ, and answered as that node's reader took it.

`FeedListener` and `FeedReader` are what the fleet's side needs of the
listener (`gateway.protocols.dmp.server.DMPServerFactory` and its
connections are those).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol

from twisted.internet.defer import Deferred

from gateway.core.flow import Congestion
from gateway.core.message import Outcome
from gateway.protocols.dmp.settings import LeaseGrant

__all__ = ["FeedListener", "FeedReader", "FleetLink", "LeaseCheck"]


class LeaseCheck(enum.Enum):
    """A lease text that is the fleet's own, but cannot be checked yet."""

    REVOCATIONS_UNKNOWN = "revocations unknown"
    """Its signature checks out; this node does not know the fleet's revocations now."""


class FleetLink(Protocol):
    """What a DMP listener asks of the fleet."""

    def issue(self, grant: LeaseGrant) -> str:
        """A lease text for ``grant`` that every node accepts.

        Raises:
            ValueError: It cannot be made (no lease secret; too long for a
                DMP lease, a short string).
        """

    def check(self, text: str) -> LeaseGrant | LeaseCheck | None:
        """What a run-time lease of the fleet opens here; None: it is none (or revoked, expired)."""

    def when_known(self) -> Deferred[None]:
        """Fires once the node knows the fleet's revocations, or after a bounded wait."""

    def revoke(self, text: str) -> Deferred[bool] | None:
        """Revoke a run-time lease on every node; None: ``text`` is no lease in force.

        The Deferred fires with whether RabbitMQ took the revocation.
        """

    def claim(self, feed: str) -> Deferred[tuple[int, str] | None]:
        """Take ``feed``'s fleet-wide reader lock.

        Fires with None once this node holds it (and other nodes' deliveries
        to the feed come here), or with the DMP code and why not (403:
        another node's reader; 541: no answer from RabbitMQ in time).
        Cancelling gives the claim up.
        """

    def release(self, feed: str) -> None:
        """The feed's reader here is gone: let other nodes have the feed."""

    def forward(self, feed: str, parts: Sequence[bytes]) -> Deferred[list[Outcome]]:
        """Write encoded envelopes to ``feed``'s reader on another node.

        Args:
            feed: The feed.
            parts: One encoded envelope per message.

        Returns:
            One outcome per part: accepted once the reader took it (written
            under its limit), retry later when no node has a reader, when
            the reader went first, or when RabbitMQ is not reachable.
        """


class FeedReader(Protocol):
    """A feed's reader, as the fleet writes to it."""

    @property
    def congestion(self) -> Congestion:
        """Congested while the reader is behind (`gateway.core.flow`)."""

    def write_envelopes(self, data: bytes, count: int) -> bool:
        """Write ``count`` encoded envelopes; False when the reader is leaving."""


class FeedListener(Protocol):
    """A DMP listener, as the fleet sees it."""

    @property
    def name(self) -> str:
        """The listener's name (the same on every node)."""

    @property
    def readers(self) -> Mapping[str, FeedReader]:
        """The feeds read on this node, and their readers."""

    def feed_lost(self, feed: str, why: str) -> None:
        """This node can no longer be sure it holds ``feed``: its reader must go now."""
