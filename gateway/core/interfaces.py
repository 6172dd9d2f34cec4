"""The seams the service assembly plugs together.

Every interface a layer offers to another is declared here, so there is one
place to look (after klein's ``_interfaces``). Implementations say
``@implementer(...)`` and their tests call ``verifyObject``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred

    from gateway.core.message import Message, Outcome

__all__ = ["IDestination", "IRouteDelivery"]


class IDestination(Interface):
    """Something a route delivers to: a listener's own peers or an upstream.

    Each configured listener and upstream provides one, under its config name.
    """

    name = Attribute("The listener or upstream name this destination belongs to.")

    def deliver(message: Message) -> Deferred[Outcome]:
        """Deliver one message; the Deferred fires with its `Outcome`.

        Must never errback for an ordinary failure (peer gone, refused, too
        large): those are `Outcome` values. The message's ``address`` is the
        destination-side address (already translated by the route).
        """


class IRouteDelivery(Interface):
    """How a route hands a message on: directly, or through the durable log.

    A direct delivery answers with the destination's own outcome; a durable
    one (issue 4) answers once the message is committed to the log and
    forwards it from there. The router does not know which it has.
    """

    def deliver(message: Message) -> Deferred[Outcome]:
        """Hand on one (translated) message; the Deferred fires with its `Outcome`."""
