"""The gateway's own streams and references (the internal namespace), and route loops.

The embedded log that stream listeners serve to clients also holds what the
gateway keeps for itself:

* ``msggateway.route.<route>``: a durable route's committed messages
  (`gateway.core.durable`), with its forwarder's offset stored in it as
  ``msggateway.forwarder.<route>``;
* ``msggateway.outcomes``: the outcome records (`gateway.core.outcomes`);
* ``msggateway.dead-letter``: the default dead-letter stream;

and the gateway writes into client streams under references of its own: a
durable route's forwarder publishes as ``msggateway.route.<route>`` (its
publishing ids are its log offsets), a stream listener's routes store their
offsets as ``msggateway.routes.<listener>``.

Stream names starting with ``msggateway.`` are the internal namespace, as
``amq.`` names are RabbitMQ's: `is_internal` is the one test of it. No
client creates, deletes, publishes to or stores an offset in such a stream,
nor uses one of the gateway's references for writing (`is_internal_reference`);
reading one needs an operator's explicit grant
(`gateway.core.authorization.Authorization.may_read_internal`); and no
route delivers into one (`internal_refusal`: a rejection that no retry
fixes).

Loops: a route may still write into a stream that routes read, and so back
to itself, directly or through other routes, listeners or a broker. Every
write of a routed message into a stream (a stream listener's, or a RabbitMQ
stream through an upstream) counts one hop in the message's
``x-gateway-hops`` header; a message that has made `MAX_HOPS` of them is
rejected instead of written again (`hop_limit_refusal`), and a durable
route's forwarder dead-letters it at once, so a loop stops after at most
`MAX_HOPS` copies of each message.
"""

from __future__ import annotations

from typing import Final

from twisted.internet.interfaces import IReactorTime

from gateway.core.message import HeaderValue, Outcome

__all__ = [
    "DEAD_LETTER_STREAM",
    "FEED_REFERENCE_PREFIX",
    "FINAL_REJECTIONS",
    "FORWARDER_REFERENCE_PREFIX",
    "GATEWAY_REFERENCE",
    "HOPS_HEADER",
    "HOP_LIMIT",
    "INTERNAL_PREFIX",
    "INTERNAL_STREAM",
    "LOG_EVERY_SECONDS",
    "MAX_HOPS",
    "OUTCOME_STREAM",
    "ROUTE_STREAM_PREFIX",
    "Tally",
    "hop_limit_refusal",
    "hops",
    "internal_refusal",
    "is_internal",
    "is_internal_reference",
    "names_internal",
]

GATEWAY_REFERENCE: Final = "msggateway"
"""Whose the gateway's own streams and references are: their first word."""
INTERNAL_PREFIX: Final = GATEWAY_REFERENCE + "."
"""Every stream name in the internal namespace starts with this."""
ROUTE_STREAM_PREFIX: Final = INTERNAL_PREFIX + "route."
"""A durable route's stream; also the reference its forwarder publishes into streams under."""
OUTCOME_STREAM: Final = INTERNAL_PREFIX + "outcomes"
DEAD_LETTER_STREAM: Final = INTERNAL_PREFIX + "dead-letter"
"""The default dead-letter stream (a route's ``dead_letter`` may name another)."""
FORWARDER_REFERENCE_PREFIX: Final = INTERNAL_PREFIX + "forwarder."
"""A durable route's forwarder stores its offset in the route's stream under this and the route."""
FEED_REFERENCE_PREFIX: Final = INTERNAL_PREFIX + "routes."
"""A stream listener's routes store their offsets in client streams under this and the listener."""
_INTERNAL_REFERENCES: Final = (
    ROUTE_STREAM_PREFIX,
    FORWARDER_REFERENCE_PREFIX,
    FEED_REFERENCE_PREFIX,
)

INTERNAL_STREAM: Final = "internal-stream"
"""The code of `internal_refusal`, and the protocol error kind of a client's refused command."""
HOP_LIMIT: Final = "hop-limit"
"""The code of `hop_limit_refusal`."""
FINAL_REJECTIONS: Final = frozenset({INTERNAL_STREAM, HOP_LIMIT})
"""Outcome codes of rejections no retry can fix: a forwarder dead-letters them at once."""

HOPS_HEADER: Final = "x-gateway-hops"
"""The header that counts a message's writes into streams by routes."""
MAX_HOPS: Final = 16
"""Writes into streams by routes a message may make (a chain of 16 routes through
streams is far more than any configuration needs; a loop stops at 16 copies)."""
LOG_EVERY_SECONDS: Final = 10.0
"""A refusal that recurs per message (a loop) is logged at most once in this long."""


def is_internal(name: str) -> bool:
    """Whether ``name`` is a stream of the gateway's own (the internal namespace)."""
    return name.startswith(INTERNAL_PREFIX)


def is_internal_reference(reference: str) -> bool:
    """Whether ``reference`` is one the gateway publishes or stores offsets under.

    Only the gateway's own prefixes: ``msggateway.NAME``, a stream
    upstream's default reference, stays usable, so that one gateway's
    upstream can write to another gateway's stream listener.
    """
    return reference.startswith(_INTERNAL_REFERENCES)


def names_internal(pattern: str) -> bool:
    """Whether an address pattern names the internal namespace literally (``msggateway.#``).

    Only such a pattern grants reading internal streams: ``#`` or
    ``*.route.*`` match their names too, but do not say so.
    """
    return pattern.startswith(INTERNAL_PREFIX)


def internal_refusal(where: str, name: str) -> Outcome:
    """The rejection of a message a route would deliver into an internal stream."""
    return Outcome.rejected(
        f"{where}: stream {name!r} is the gateway's own (names starting with"
        f" {INTERNAL_PREFIX!r} are its internal namespace); routes do not deliver there",
        code=INTERNAL_STREAM,
    )


def hop_limit_refusal(where: str, name: str) -> Outcome:
    """The rejection of a message that has been written into streams `MAX_HOPS` times."""
    return Outcome.rejected(
        f"{where}: the message bound for {name!r} has been written into streams by routes"
        f" {MAX_HOPS} times already ({HOPS_HEADER}): the routes loop",
        code=HOP_LIMIT,
    )


def hops(value: HeaderValue | None) -> int:
    """The hop count a message's `HOPS_HEADER` value says (0 when absent or unreadable).

    A client may write the header itself; a negative or unreadable count
    counts as 0, so that the worst it buys is `MAX_HOPS` more copies.
    """
    if value is None:
        return 0
    if type(value) is int:
        return value if value > 0 else 0
    if isinstance(value, str | bytes) and value.isdigit() and len(value) < 8:
        return int(value)
    return 0


class Tally:
    """Counts one recurring fact and says when it is time to log it again.

    The first occurrence is logged at once; later ones are counted, and the
    next occurrence at least ``seconds`` after the last line logs them all.

    Args:
        clock: Time.
        seconds: The least time between two lines.
    """

    __slots__ = ("_clock", "_next", "_seconds", "pending", "total")

    def __init__(self, clock: IReactorTime, seconds: float = LOG_EVERY_SECONDS) -> None:
        self._clock = clock
        self._seconds = seconds
        self._next: float | None = None
        self.pending = 0
        """Counted, not logged yet."""
        self.total = 0
        """Every occurrence so far."""

    def add(self, count: int = 1) -> int:
        """Count ``count`` occurrences; return how many to log now (0: not yet)."""
        self.total += count
        self.pending += count
        now = self._clock.seconds()
        if self._next is not None and now < self._next:
            return 0
        self._next = now + self._seconds
        due, self.pending = self.pending, 0
        return due
