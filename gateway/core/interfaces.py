"""The seams the service assembly plugs together.

Every interface a layer offers to another is declared here, so there is one
place to look (after klein's ``_interfaces``). Implementations say
``@implementer(...)`` and their tests call ``verifyObject``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

    from twisted.internet.defer import Deferred

    from gateway.core.message import Message, Outcome

__all__ = [
    "IBackbone",
    "IDeduplicatingDestination",
    "IDestination",
    "IFleetLock",
    "IRouteDelivery",
]


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
    as the producer and each message's log offset plus one as its id. What a
    consumer read is delivered with its reader's offsets instead
    (`gateway.core.origins`), by direct and durable routes alike.
    """

    fleet_wide = Attribute(
        "Whether other gateway processes deliver into it too (a RabbitMQ stream), so that"
        " a reader's ids reach it from whichever node reads; False for this process's own"
        " log."
    )

    def deliver_once(
        messages: Sequence[Message],
        producer: str,
        ids: Sequence[int],
        reader: str | None = None,
    ) -> Deferred[list[Outcome]]:
        """Deliver as `IDestination.deliver` does, storing each message at most once.

        Args:
            messages: The batch.
            producer: Who delivers: a route's name. Each destination derives
                its own publisher reference from it; one that other gateway
                processes write to as well (a RabbitMQ stream) puts this
                process's node id in it, since each process numbers its
                ids on its own.
            ids: One publishing id per message, each above 0 and rising
                from one call to the next. A message whose id is not above
                the last one the destination stored for ``producer`` is
                accepted without being stored again.
            reader: The consumer that read the messages (`Origin.reader`),
                when ``ids`` are its offsets plus one rather than the
                producer's own: the reference is then derived from the
                reader and the producer, with no node id, the same on every
                node (one node at a time reads, under its fleet lock).
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


class IBackbone(Interface):
    """A fleet node's one connection to RabbitMQ, as its users see it (`gateway.fleet`).

    Provided by `gateway.fleet.backbone.Backbone` (pika, a real broker) and
    by the tests' in-memory broker. What users register (exchanges,
    consumers, bindings) is declared again after every reconnection; what
    they publish is one AMQP message per batch of their own events.
    """

    node = Attribute("This node's id; every message it publishes carries it as its origin.")
    ready = Attribute("Whether the connection is up with everything declared.")
    lost_since = Attribute("When the node last lost (or had not yet) its connection; None: up.")
    congestion = Attribute(
        "A `gateway.core.flow.Congestion`: congested while the confirm window is full or the"
        " broker blocked publishing; users hold their local producers on it."
    )
    receiving = Attribute(
        "A `gateway.core.flow.Throttle`: while held (by local consumers that are congested),"
        " no further delivery is handled and none acknowledged."
    )

    def declare_exchange(name: str, kind: str = "direct", *, others_only: bool = False) -> None:
        """Declare an exchange (durable) now and after every reconnection.

        With ``others_only``, what this node publishes there never reaches its
        own queue, and a mandatory message comes back (unroutable) when no
        other node's queue is bound for it. Declare it so before binding to it.
        """

    def consume(exchange: str, handler: Callable[[Any], None]) -> None:
        """Hand each delivery on this node's queue from ``exchange`` to ``handler``."""

    def replay(stream: str, handler: Callable[[Any], None], arguments: Mapping[str, Any]) -> None:
        """Read the durable stream ``stream`` from its first message, after every connection.

        Declared with ``arguments`` on every connection; ``handler`` gets each
        of its messages (``exchange`` being the stream's name), the whole
        stream again after each reconnection. Publish to it through the
        default exchange (``""``, the stream's name as the key).
        """

    def on_connected(callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every (re)connection, once everything is declared."""

    def on_lost(callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the connection is lost (this node's queue is gone)."""

    def bind(exchange: str, key: str) -> None:
        """Bind this node's queue to ``exchange`` with ``key``, now and after reconnections."""

    def unbind(exchange: str, key: str) -> None:
        """Undo `bind`."""

    def when_bound(callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every binding change asked for so far took effect."""

    def publish(
        exchange: str,
        key: str,
        body: bytes,
        *,
        kind: str,
        headers: Mapping[str, Any] | None = None,
        cc: Sequence[str] = (),
        mandatory: bool = False,
        on_result: Callable[[Any], None] | None = None,
    ) -> bool:
        """Publish one message; False when there is no connection (then it is dropped).

        ``on_result`` gets one `gateway.fleet.backbone.Published` value: routed,
        unroutable (mandatory, nobody bound), nacked, or lost.
        """

    def claim(queue: str) -> Deferred[bool]:
        """Declare the queue ``queue`` exclusive to this connection (the fleet's locks).

        Fires with True once this connection holds it (declared now, or
        held already: claiming again confirms the hold), False when another
        connection holds it, or when there is no connection or it ends
        first. RabbitMQ deletes the queue with the connection that holds it.
        """

    def release(queue: str) -> Deferred[None]:
        """Delete the queue ``queue`` this connection holds; fires once it is gone."""


class IFleetLock(Interface):
    """Work that must run on one node of the fleet at a time (`gateway.fleet.locks`).

    Every node asks for the lock of the same name; one holds it. The holder
    does the work while it holds the lock, and stops it the moment it is
    told the lock is lost; another node then takes it over.
    """

    name = Attribute("The lock's name, the same on every node (``upstream.<name>``).")
    held = Attribute("Whether this node holds the lock now.")

    def start(
        acquired: Callable[[], None],
        lost: Callable[[], None],
        refused: Callable[[], None] | None = None,
    ) -> None:
        """Ask for the lock, now and until `stop`.

        ``acquired()`` is called each time this node gets it; ``lost()``
        the moment this node can no longer be sure it holds it (its
        connection to RabbitMQ is gone or unconfirmed): the work must stop
        then, before ``lost`` returns, as another node may take over.
        ``refused()``, if given, each time another node is found holding it.
        """

    def stop(finished: Deferred[Any] | None = None) -> Deferred[None]:
        """Stop asking: no more calls of ``acquired`` or ``lost`` from now on.

        A held lock is released once ``finished`` fires (the holder's work
        is over and what it must leave for the next holder, such as stored
        offsets, is out), at once without it. Fires once released.
        """
