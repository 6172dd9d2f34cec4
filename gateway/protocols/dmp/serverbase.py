"""What the DMP listener's parts share: the connection's state, closing, timers; the listener.

`gateway.protocols.dmp.server.DMPServerProtocol` is put together from the
handshake (`gateway.protocols.dmp.serverlease`: the protocol header, the
lease and the answer to it) and the connection's life, reading and data
path, which `gateway.protocols.dmp.server` keeps. Each is a
`DMPServerBase`: the connection state they share is declared here (the
protocol sets it up), with what both call: `_close_with` (which frees the
connection's feed first, `_leave_feed`) and `_schedule`. No call goes
through here that did not before. The listener itself, `DMPListenerFactory`
(leases, feeds and their readers, the fleet), is here too; its subclass in
`gateway.protocols.dmp.server` builds the connections.
"""

from __future__ import annotations

import hmac
import secrets as random_texts
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from zope.interface import implementer

from gateway.codecs import dmp
from gateway.core.inbox import Inbox
from gateway.core.interfaces import IDestination
from gateway.core.message import Message, Outcome
from gateway.core.router import Router
from gateway.protocols.dmp.feeds import FeedDeliveries
from gateway.protocols.dmp.fleet import FleetLink, LeaseCheck
from gateway.protocols.dmp.principal import PrincipalConnection
from gateway.protocols.dmp.settings import DMPListenerSettings, LeaseGrant
from gateway.protocols.dmp.sinks import SinkOutcomes
from gateway.protocols.listener import ListenerArgs, ListenerConnection, ListenerFactory

__all__ = ["DMPListenerFactory", "DMPServerBase"]


class DMPServerBase(ListenerConnection["DMPListenerFactory"]):
    """What every part of a DMP listener's connection uses (`DMPServerProtocol`)."""

    factory: DMPListenerFactory
    kind: str | None
    identity: str | None
    target: str
    _timer: IDelayedCall | None
    _outcomes: SinkOutcomes
    _prefix: bytes | None
    _principal: PrincipalConnection | None
    _inbox: Inbox[Message]
    _login_wait: IDelayedCall | None
    _held: list[dmp.Event]
    _suspended: Deferred[Any] | None
    _claiming: str | None

    if TYPE_CHECKING:  # the connection's own (`DMPServerProtocol`)

        def _handle_all(self, events: list[dmp.Event]) -> None:
            """Handle a read's events."""

        def _check_idle(self) -> None:
            """Close a sink writer silent for too long."""

        def _beat(self) -> None:
            """Write a feed reader its null message."""

        def deliver(self, messages: Sequence[Message]) -> list[Outcome]:
            """Write routed messages to this feed reader."""

        def write_envelopes(self, data: bytes, count: int) -> bool:
            """Write encoded envelopes to this feed reader."""

    # --- closing ---------------------------------------------------------------------------

    def _leave_feed(self) -> None:
        factory = self.factory
        claiming, self._claiming = self._claiming, None
        if claiming is not None:
            if factory.claiming.get(claiming) is self:
                del factory.claiming[claiming]
            waiting, self._suspended = self._suspended, None
            if waiting is not None:
                waiting.cancel()  # the claim is given up
        if self.kind == "feed" and factory.readers.get(self.target) is self:
            del factory.readers[self.target]
            if factory.fleet is not None:
                factory.fleet.release(self.target)

    def _close_with(
        self, why: str, response: dmp.Response | None = None, *, abort: bool = False
    ) -> None:
        """Say why in the log (and to the peer, if there is a response), then close or abort."""
        if self._closing:
            return
        self._leave_feed()  # free for the next reader at once
        if response is not None:
            self._write(dmp.encode_response(response))
        self._log.info(
            "{listener}: {action} a DMP connection: {why}",
            listener=self.factory.name,
            action="aborting" if abort else "closing",
            why=why,
        )
        if abort:
            self._abort()
        else:
            self._close()

    # --- helpers -------------------------------------------------------------------------

    def _schedule(self, seconds: float, call: Callable[[], None]) -> None:
        if seconds > 0:
            self._timer = self._call_later(seconds, call)


@implementer(IDestination)
class DMPListenerFactory(ListenerFactory[DMPServerBase, DMPListenerSettings]):
    """One DMP listener: its leases, feeds and readers; the destination of routes to its feeds.

    Its subclass in `gateway.protocols.dmp.server` builds the connections.

    Args:
        name: The listener's name (source of sink messages, destination of feeds).
        settings: Its validated settings.
        router: Where sink messages go.
        secrets: The lease texts (``[leases]`` under each lease's name).
        clock: Timers and timestamps.
        metrics: Counters, or None.
    """

    kind = "dmp"

    def __init__(
        self, *, router: Router, **common: Unpack[ListenerArgs[DMPListenerSettings]]
    ) -> None:
        super().__init__(**common)
        self.router = router
        self.readers: dict[str, DMPServerBase] = {}
        self.feeds = FeedDeliveries(self.name, self.settings.feeds, self.readers)
        """Routes' deliveries to the feeds, here or (in a fleet) on the node reading them."""
        self.granted: dict[str, LeaseGrant] = {}
        """Leases made at run time (admin API) outside a fleet: lease text to grant."""
        self.fleet: FleetLink | None = None
        """The seam to the other nodes of a fleet (`join_fleet`), if any."""
        self.claiming: dict[str, DMPServerBase] = {}
        """Feeds whose fleet lock a connection is claiming, and that connection."""

    def join_fleet(self, link: FleetLink) -> None:
        """Run as one node of a fleet: run-time leases, feed readers and deliveries cross nodes."""
        self.fleet = self.feeds.fleet = link

    # --- leases ---------------------------------------------------------------------------

    def grant_for(self, lease: str) -> LeaseGrant | LeaseCheck | None:
        """The grant a lease text opens, if it is known and not expired.

        Returns:
            The grant, None, or (in a fleet) `LeaseCheck.REVOCATIONS_UNKNOWN`
            for a run-time lease of the fleet this node cannot check now.
        """
        now = self.clock.seconds()
        presented = lease.encode("utf-8")
        found: LeaseGrant | None = None
        for name, grant in self.settings.leases.items():
            secret = grant.text if grant.text is not None else self.secrets.leases.get(name)
            # Every grant is compared (in constant time), found or not.
            if secret is not None and hmac.compare_digest(secret, presented):
                found = grant
        if found is None:
            found = self.granted.get(lease)
        if found is None and self.fleet is not None:
            return self.fleet.check(lease)
        if found is None or (found.expires is not None and found.expires <= now):
            return None
        return found

    def issue_lease(
        self, kind: str, target: str, expires: float, identity: str | None, *, certified: bool
    ) -> str:
        """Make a run-time lease (the admin API's, a principal's) and return its text.

        Outside a fleet it is a random text kept here; in one, a signed text
        that every node checks (`FleetLink.issue`).

        Raises:
            ValueError: In a fleet, it cannot be made (too long for a DMP lease).
        """
        grant = LeaseGrant(
            kind=kind, target=target, expires=expires, identity=identity, certified=certified
        )
        if self.fleet is not None:
            return self.fleet.issue(grant)
        text = random_texts.token_urlsafe(24)
        self.granted[text] = grant
        self.forget_expired_leases()
        return text

    def revoke_lease(self, text: str) -> bool | Deferred[bool] | None:
        """Revoke a run-time lease; open connections stay.

        Returns:
            None when ``text`` is no run-time lease of this listener; True
            when revoked here (outside a fleet); in a fleet, a Deferred that
            fires with whether RabbitMQ took the revocation for every node.
        """
        if self.granted.pop(text, None) is not None:
            return True
        if self.fleet is not None:
            return self.fleet.revoke(text)
        return None

    def forget_expired_leases(self) -> None:
        """Drop run-time leases whose time is over."""
        now = self.clock.seconds()
        expired = [t for t, g in self.granted.items() if g.expires is not None and g.expires <= now]
        for text in expired:
            del self.granted[text]

    def feed_lost(self, feed: str, why: str) -> None:
        """The fleet lock of ``feed`` is lost (another node may take it): its reader goes."""
        reader = self.readers.get(feed)
        if reader is not None:
            self.count_error("feed-lock-lost")
            reader._close_with(f"the reader of feed {feed!r} goes: {why}")

    # --- feeds ----------------------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Write routed messages to their feeds' readers, here or elsewhere (`FeedDeliveries`).

        Returns:
            A Deferred with one outcome per message, in order.
        """
        return self.feeds.deliver(messages)
