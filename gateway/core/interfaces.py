"""The seams the service assembly plugs together.

Every interface a layer offers to another is declared here, so there is one
place to look (after klein's ``_interfaces``). Implementations say
``@implementer(...)`` and their tests call ``verifyObject``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from collections.abc import Sequence

    from twisted.internet.defer import Deferred

    from gateway.core.message import Message, Outcome

__all__ = ["IDeduplicatingDestination", "IDestination", "IRouteDelivery"]


class IDestination(Interface):
    """Something a route delivers to: a listener's own peers or an upstream.

    Each configured listener and upstream provides one, under its config name.
    """

    name = Attribute("The listener or upstream name this destination belongs to.")

    def deliver(messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Deliver a batch; the Deferred fires with one `Outcome` per message, in order.

        Must never errback for an ordinary failure (peer gone, refused, too
        large): those are `Outcome` values. The messages' ``address`` is the
        destination-side address (already translated by the route). The
        router cancels the Deferred at the route's deadline: a destination
        that already knows some outcomes answers them from its canceller
        (see `gateway.core.batch.Answers`), the rest becoming retry later.
        A single message is a batch of one.
        """


class IDeduplicatingDestination(IDestination):
    """A destination that can store each message once however often it is delivered.

    Durable routes deliver at least once (a forwarder resumes from its last
    stored offset after a crash, one chunk back at most). A destination that
    keeps a last publishing id per producer, as a stream does, turns that
    into exactly once: the route's forwarder delivers with its route's name
    as the producer and each message's log offset plus one as its id.
    """

    def deliver_once(
        messages: Sequence[Message], producer: str, ids: Sequence[int]
    ) -> Deferred[list[Outcome]]:
        """Deliver as `IDestination.deliver` does, storing each message at most once.

        Args:
            messages: The batch.
            producer: Who delivers: a durable route's name. Each destination
                derives its own publisher reference from it; one that other
                gateway processes write to as well (a RabbitMQ stream) puts
                this process's node id in it, since each process numbers
                its ids on its own.
            ids: One publishing id per message, each above 0 and rising
                from one call to the next. A message whose id is not above
                the last one the destination stored for ``producer`` is
                accepted without being stored again.
        """


class IRouteDelivery(Interface):
    """How a route hands messages on: directly, or through the durable log.

    A direct delivery answers with the destination's own outcome; a durable
    one (issue 4) answers once the message is committed to the log and
    forwards it from there. The router does not know which it has.
    """

    def deliver(messages: Sequence[Message]) -> Deferred[list[Outcome]]:
        """Hand on a batch of (translated) messages; one `Outcome` per message, in order.

        A durable delivery commits the batch as one chunk (one fsync) and
        answers every message after that commit.
        """
