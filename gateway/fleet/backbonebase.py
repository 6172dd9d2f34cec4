"""What the backbone's parts share: its limits, the values its users see, its state.

`gateway.fleet.backbone.Backbone` (its module docstring says what the
backbone does) is put together from classes of one concern each, in a
chain: the node's bindings (`gateway.fleet.backbonebinding`), publishing
and receiving (`gateway.fleet.backbonetraffic`) and the connection's life
(`gateway.fleet.backbonelink`). The state they share is declared here, on
`BackboneBase`, and set up by `Backbone.__init__`. No call goes through a
part that did not go through the one class before.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import pika
import pika.channel
import pika.spec
from pika.adapters.twisted_connection import TwistedProtocolConnection
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from gateway.core.flow import Congestion, Throttle
from gateway.fleet.exclusive import ExclusiveQueues
from gateway.metrics import BackboneStats

__all__ = [
    "ACK_DELAY_SECONDS",
    "BIND_BATCH",
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_MAX_UNCONFIRMED",
    "DEFAULT_MAX_UNCONFIRMED_BYTES",
    "DEFAULT_PREFETCH",
    "ORIGIN_HEADER",
    "VOID_EXCHANGE",
    "BackboneBase",
    "Delivery",
    "OnResult",
    "Published",
    "delivery_from",
    "filter_exchange",
    "heartbeat_interval",
    "reason_text",
    "reconnect_delay",
]

BIND_BATCH: Final = 512
"""Binding changes sent per round trip: publishing on the channel waits behind at most
this many (RabbitMQ serialises a channel's methods)."""
CONNECT_TIMEOUT_SECONDS: Final = 3.0
"""An attempt that is not ready (TCP, TLS, AMQP handshake) in this time is given up for
the next endpoint: a black-holed broker must not eat the fleet's reconnection budget."""
DEFAULT_PREFETCH: Final = 64
"""Unacknowledged deliveries RabbitMQ sends this node at most: each is a batch (many SSMP
events), so this keeps the pipe full at a loopback round trip without holding much."""
ACK_DELAY_SECONDS: Final = 0.005
"""Deliveries are acknowledged (one ``multiple`` ack) once half the prefetch window was
handled, or this long after the first one not acknowledged yet: one ack per delivery at a
paced 10,000 a second cost a socket write and a reactor timer each."""
DEFAULT_MAX_UNCONFIRMED: Final = 1024
"""Published messages awaiting their confirm past which local publishers are held."""
DEFAULT_MAX_UNCONFIRMED_BYTES: Final = 8 * 1024 * 1024
"""Published bytes awaiting their confirm past which local publishers are held."""
ORIGIN_HEADER: Final = "o"
"""The header with the publishing node's id, which its filter matches (``others_only``)."""
VOID_EXCHANGE: Final = "msggateway.void"
"""A fanout exchange bound to nothing: where a node's filter sends the node's own messages."""
_FIRST_BACKOFF_SECONDS: Final = 0.25
_MAX_BACKOFF_SECONDS: Final = 5.0
STOP_SECONDS: Final = 5.0
"""How long a clean stop waits for RabbitMQ to close the connection before aborting it."""


def heartbeat_interval(heartbeat_seconds: float) -> int:
    """The AMQP heartbeat the backbone asks for: whole seconds, at least one."""
    return max(1, round(heartbeat_seconds))


def filter_exchange(node: str) -> str:
    """The headers exchange through which ``node`` is bound to ``others_only`` exchanges."""
    return f"msggateway.node.{node}"


def reconnect_delay(attempt: int, endpoints: int) -> float:
    """Seconds before reconnection attempt ``attempt`` (from 0) over ``endpoints`` endpoints.

    Every endpoint is tried once at once (another cluster node is usually
    up when one died); then each further round waits twice as long as the
    one before, from 0.25 s up to 5 s.
    """
    rounds = attempt // max(endpoints, 1)
    if rounds == 0:
        return 0.0
    return float(min(_MAX_BACKOFF_SECONDS, _FIRST_BACKOFF_SECONDS * 2 ** (rounds - 1)))


class Published(enum.Enum):
    """What became of one published message (its publisher confirm)."""

    ROUTED = "routed"
    """The broker took it (and, mandatory, routed it to at least one queue)."""
    UNROUTABLE = "unroutable"
    """Mandatory, and no queue was bound for it: it came back."""
    NACKED = "nacked"
    """The broker refused it (an internal error)."""
    LOST = "lost"
    """The connection ended before the broker answered, or there was none."""


@attrs.frozen(slots=True)
class Delivery:
    """A message that arrived on this node's queue.

    Attributes:
        exchange: The exchange it was published to (which user it is for).
        routing_key: Its routing key.
        origin: The node that published it (its ``app_id``).
        kind: Its ``type`` property (what the user made of it).
        headers: Its headers.
        body: Its body.
    """

    exchange: str
    routing_key: str
    origin: str
    kind: str
    headers: Mapping[str, Any]
    body: bytes


OnResult = Callable[[Published], None]
Unconfirmed = tuple[int, OnResult | None]
"""A published message awaiting its confirm: its size, and who wants its result."""


def delivery_from(
    exchange: str,
    method: pika.spec.Basic.Deliver,
    properties: pika.spec.BasicProperties,
    body: bytes,
) -> Delivery:
    """The `Delivery` of a message pika delivered from ``exchange`` (or a stream's name)."""
    return Delivery(
        exchange=exchange,
        routing_key=method.routing_key,
        origin=properties.app_id or "",
        kind=properties.type or "",
        headers=properties.headers or {},
        body=body,
    )


def reason_text(reason: object) -> str:
    """A connection's loss, as the log says it."""
    if isinstance(reason, Failure):
        reason = reason.value
    text = str(reason) if reason is not None else ""
    return text or type(reason).__name__


class BackboneBase:
    """The state `Backbone`'s parts share: declared here, set up by `Backbone.__init__`."""

    _log = Logger()

    node: str
    stats: BackboneStats
    congestion: Congestion
    receiving: Throttle
    queue: str
    endpoint: str | None
    ready: bool
    lost_since: float | None

    _endpoints: list[tuple[str, IStreamClientEndpoint]]
    _parameters: pika.ConnectionParameters
    _clock: IReactorTime
    _prefetch: int
    _max_unconfirmed: int
    _max_unconfirmed_bytes: int
    _exchanges: dict[str, str]
    _others_only: set[str]
    _filter: str
    _filter_queue: str
    _filter_declared: bool
    _streams: dict[str, dict[str, Any]]
    _handlers: dict[str, Callable[[Delivery], None]]
    _on_connected: list[Callable[[], None]]
    _on_lost: list[Callable[[], None]]
    _wanted: dict[tuple[str, str], None]
    _applied: set[tuple[str, str]]
    _changed: dict[tuple[str, str], None]
    _bind_call: IDelayedCall | None
    _binding: bool
    _bound_waiters: list[Callable[[], None]]
    _batch_waiters: list[Callable[[], None]]
    _protocol: TwistedProtocolConnection | None
    _channel: pika.channel.Channel | None
    _blocked: bool
    _sequence: int
    _unconfirmed: dict[int, Unconfirmed]
    _unconfirmed_bytes: int
    _returned: set[int]
    _backlog: deque[tuple[int, Delivery]]
    _ack_upto: int
    _unacked: int
    _ack_call: IDelayedCall | None
    _held_tag: int
    _exclusive: ExclusiveQueues
    _running: bool
    _attempt: int
    _next: int
    _attempt_call: IDelayedCall | None
    _connecting: Deferred[Any] | None
    _timeout_call: IDelayedCall | None
    _dropped_in_gap: int
