"""Who is in the fleet: every node announces itself; each keeps the set of live nodes.

DESIGN.md, "Scale: a fleet on RabbitMQ": the nodes never talk to each
other directly, and there is no gossip or election of the gateway's own;
membership is what RabbitMQ carries. Every node declares the durable
direct exchange ``msggateway.fleet`` (`FLEET_EXCHANGE`) and binds its
queue (`gateway.fleet.backbone`) there with ``all`` and ``n.<node>``.

- A node announces itself (``hello``, to ``all``) when its connection to
  RabbitMQ is ready, and every `ANNOUNCE_SECONDS` after: its id, a random
  instance id (a restart is a new instance), when it started, the hash of
  its configuration (`gateway.fleet.confighash`), its version, and the
  advertised address of each of its listeners (``{name: [host, port]}``;
  a stream listener's is what its Metadata names). The body is JSON.
- A node that hears a ``hello`` from a node it did not know (or from a new
  instance of one) answers with its own ``hello`` to ``n.<that node>`` at
  once, so that a node that starts knows the fleet within a broker round
  trip, not an announcement period.
- A node is live while it was heard within `MEMBER_TIMEOUT_SECONDS` (five
  announcements). A clean stop says ``bye`` (to ``all``), and the others
  drop it at once; a node that dies (``kill -9``, a lost host) goes silent
  and is dropped after that time. While this node itself has no connection
  to RabbitMQ it hears nobody: it keeps the members it knew, unexpired,
  and gives each a full time-out once it is back (it hears them again within
  one period).
- Each node checks the others' configuration hash against its own: a node
  with another one is logged (once per change of either hash), and counted
  in ``msggateway_fleet_config_mismatch`` (live nodes whose hash differs
  from this node's). Spec ambiguity: the issue asks for the hash "on a
  control stream"; it travels in the announcements instead, which every
  node reads anyway, so that the fleet needs no RabbitMQ stream (nor the
  stream plugin) and a node learns the others' hashes as it learns of them.

The API, for the fleet's other users (stream ownership, locks):
`Membership.nodes` (the live node ids, this node's included, sorted),
`Membership.member` (a `Member`: what it announced), `Membership.address`
(a node's advertised address of a listener), `Membership.on_change`
(called with the nodes that joined and left), and `Membership.health`
(for ``/healthz``: unhealthy once the node has had no connection to
RabbitMQ for longer than ``[fleet] unhealthy_after_seconds``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from gateway import __version__
from gateway.core.interfaces import IBackbone
from gateway.fleet.backbone import Delivery
from gateway.metrics import FleetStats

__all__ = [
    "ALL_KEY",
    "ANNOUNCE_SECONDS",
    "FLEET_EXCHANGE",
    "MEMBER_TIMEOUT_SECONDS",
    "Member",
    "Membership",
]

FLEET_EXCHANGE: Final = "msggateway.fleet"
"""The direct exchange where nodes announce themselves."""
ALL_KEY: Final = "all"
ANNOUNCE_SECONDS: Final = 2.0
"""How often a node says it is alive: a few AMQP messages a second for a fleet of ten."""
MEMBER_TIMEOUT_SECONDS: Final = 5 * ANNOUNCE_SECONDS
"""A node not heard for this long is gone: five missed announcements, so that a node whose
announcements wait behind a busy channel for a few seconds does not leave and come back
(which would move its streams twice)."""
MAX_ANNOUNCEMENT_BYTES: Final = 64 * 1024
"""An announcement larger than this is not read (a node has a few listeners)."""

_HELLO: Final = "hello"
_BYE: Final = "bye"


@attrs.frozen
class Member:
    """A live node, as it announced itself.

    Attributes:
        node: Its id.
        instance: A random id of the process (a restart is another instance).
        started: When the process started (its clock, Unix seconds).
        config_hash: The hash of its configuration (`gateway.fleet.confighash`).
        version: The gateway version it runs.
        addresses: The advertised host and port of each of its listeners, by name.
    """

    node: str
    instance: str
    started: float
    config_hash: str
    version: str = ""
    addresses: Mapping[str, tuple[str, int]] = attrs.field(factory=dict)


class Membership:
    """This node's view of the fleet: announcing itself, and hearing the others.

    Args:
        backbone: The node's connection to RabbitMQ.
        clock: Time and timers.
        config_hash: This node's configuration hash now (a reload may change it).
        addresses: This node's listeners' advertised addresses now.
        unhealthy_after_seconds: `health` reports a problem once the node has
            had no connection to RabbitMQ for longer than this.
        stats: Where the live nodes and mismatched configurations are counted.
    """

    _log = Logger()

    def __init__(
        self,
        backbone: IBackbone,
        clock: IReactorTime,
        *,
        config_hash: Callable[[], str],
        addresses: Callable[[], Mapping[str, tuple[str, int]]],
        unhealthy_after_seconds: float,
        stats: FleetStats | None = None,
    ) -> None:
        self.backbone = backbone
        self.node: str = backbone.node
        self._clock = clock
        self._config_hash = config_hash
        self._addresses = addresses
        self.unhealthy_after_seconds = unhealthy_after_seconds
        self.stats = stats if stats is not None else FleetStats()
        self.instance = secrets.token_hex(8)
        self.started = clock.seconds()
        self._members: dict[str, Member] = {}
        """The other live nodes."""
        self._heard: dict[str, float] = {}
        self._told: dict[str, tuple[str, str]] = {}
        """Nodes logged as running another configuration: (their hash, ours) when logged."""
        self._warned: set[str] = set()
        """Origins whose malformed announcement (or clash of node ids) was logged."""
        self._listeners: list[Callable[[frozenset[str], frozenset[str]], None]] = []
        self._timer: IDelayedCall | None = None
        self._running = False
        self.stats.nodes = 1
        backbone.declare_exchange(FLEET_EXCHANGE)
        backbone.consume(FLEET_EXCHANGE, self._delivered)
        backbone.bind(FLEET_EXCHANGE, ALL_KEY)
        backbone.bind(FLEET_EXCHANGE, f"n.{self.node}")
        backbone.on_connected(self._connected)

    # --- what users ask -------------------------------------------------------------------

    def nodes(self) -> tuple[str, ...]:
        """The live nodes' ids, this node's included, sorted."""
        return tuple(sorted((*self._members, self.node)))

    def member(self, node: str) -> Member | None:
        """What ``node`` announced (this node: what it announces), or None if it is not live."""
        if node == self.node:
            return self._me()
        return self._members.get(node)

    def address(self, node: str, listener: str) -> tuple[str, int] | None:
        """``node``'s advertised address of its listener ``listener``, if it is live and has it."""
        if node == self.node:
            return self._addresses().get(listener)
        member = self._members.get(node)
        return member.addresses.get(listener) if member is not None else None

    def on_change(self, callback: Callable[[frozenset[str], frozenset[str]], None]) -> None:
        """Call ``callback(joined, left)`` whenever nodes join or leave."""
        self._listeners.append(callback)

    def mismatched(self) -> tuple[str, ...]:
        """The live nodes whose configuration hash differs from this node's, sorted."""
        mine = self._config_hash()
        return tuple(sorted(n for n, m in self._members.items() if m.config_hash != mine))

    def health(self) -> tuple[dict[str, object], str | None]:
        """The node's fleet state for ``/healthz``, and why it is unhealthy (None: it is not).

        Unhealthy once the node has had no connection to RabbitMQ for longer
        than ``unhealthy_after_seconds``: nothing crosses to or from it, and
        its view of the fleet is stale, so a load balancer should send its
        clients to nodes that have one.
        """
        now = self._clock.seconds()
        lost = self.backbone.lost_since
        state: dict[str, object] = {
            "node": self.node,
            "connected": bool(self.backbone.ready),
            "nodes": list(self.nodes()),
            "config_hash": self._config_hash(),
            "config_mismatch": list(self.mismatched()),
        }
        problem = None
        if lost is not None:
            seconds = max(0.0, now - lost)
            state["lost_seconds"] = round(seconds, 3)
            if seconds > self.unhealthy_after_seconds:
                problem = (
                    f"no connection to RabbitMQ for {seconds:.1f} s (more than [fleet]"
                    f" unhealthy_after_seconds = {self.unhealthy_after_seconds:g})"
                )
        return state, problem

    # --- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Announce this node now (if connected) and every `ANNOUNCE_SECONDS`."""
        if self._running:
            return
        self._running = True
        self.started = self._clock.seconds()
        if self.backbone.ready:
            self._announce(ALL_KEY)
        self._timer = self._clock.callLater(ANNOUNCE_SECONDS, self._tick)

    def stop(self) -> None:
        """Say goodbye (the others drop this node at once) and stop announcing."""
        self._running = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.backbone.publish(FLEET_EXCHANGE, ALL_KEY, self._body(), kind=_BYE)

    def _tick(self) -> None:
        self._timer = None
        if not self._running:
            return
        self._timer = self._clock.callLater(ANNOUNCE_SECONDS, self._tick)
        self._announce(ALL_KEY)
        if not self.backbone.ready:
            return  # hearing nobody says nothing about them
        deadline = self._clock.seconds() - MEMBER_TIMEOUT_SECONDS
        silent = [node for node, heard in self._heard.items() if heard < deadline]
        if silent:
            self._leave(silent, f"not heard for {MEMBER_TIMEOUT_SECONDS:g} s")
        self._check_configs()

    def _connected(self) -> None:
        """Back on RabbitMQ: announce at once; every known node gets a full time-out."""
        now = self._clock.seconds()
        for node in self._heard:
            self._heard[node] = now
        if self._running:
            self._announce(ALL_KEY)

    # --- announcing -------------------------------------------------------------------------

    def _me(self) -> Member:
        return Member(
            node=self.node,
            instance=self.instance,
            started=self.started,
            config_hash=self._config_hash(),
            version=__version__,
            addresses=dict(self._addresses()),
        )

    def _body(self) -> bytes:
        me = self._me()
        return json.dumps(
            {
                "node": me.node,
                "instance": me.instance,
                "started": me.started,
                "config": me.config_hash,
                "version": me.version,
                "addresses": {name: [host, port] for name, (host, port) in me.addresses.items()},
            },
            separators=(",", ":"),
        ).encode("utf-8")

    def _announce(self, key: str) -> None:
        self.backbone.publish(FLEET_EXCHANGE, key, self._body(), kind=_HELLO)

    # --- hearing ----------------------------------------------------------------------------

    def _delivered(self, delivery: Delivery) -> None:
        origin = delivery.origin
        if delivery.kind == _BYE:
            if origin != self.node and origin in self._members:
                self._leave([origin], "it stopped")
            return
        if delivery.kind != _HELLO:
            return
        member = self._parse(delivery)
        if member is None:
            return
        if origin == self.node:
            if member.instance != self.instance and origin not in self._warned:
                self._warned.add(origin)
                self._log.error(
                    "fleet: another process announces itself as node {node} (started at"
                    " {started}): two processes must never share a node id (their publisher"
                    " references would clash); give each its own [fleet] node or data_dir",
                    node=origin,
                    started=member.started,
                )
            return
        known = self._members.get(origin)
        self._members[origin] = member
        self._heard[origin] = self._clock.seconds()
        new = known is None or known.instance != member.instance
        if new and delivery.routing_key == ALL_KEY:
            self._announce(f"n.{origin}")  # it learns of this node now, not in a period
        if known is None:
            self.stats.nodes = len(self._members) + 1
            self._log.info(
                "fleet: node {other} joined ({nodes} node(s) live)",
                other=origin,
                nodes=len(self._members) + 1,
            )
            self._changed(frozenset({origin}), frozenset())
        self._check_config(member)

    def _parse(self, delivery: Delivery) -> Member | None:
        """The announced member, or None (logged once per origin) if the body is not one."""
        body = delivery.body
        try:
            if len(body) > MAX_ANNOUNCEMENT_BYTES:
                raise ValueError(f"{len(body)} bytes, more than {MAX_ANNOUNCEMENT_BYTES}")
            data = json.loads(body)
            addresses = {
                str(name): (str(address[0]), int(address[1]))
                for name, address in dict(data.get("addresses", {})).items()
            }
            return Member(
                node=delivery.origin,
                instance=str(data["instance"]),
                started=float(data["started"]),
                config_hash=str(data["config"]),
                version=str(data.get("version", "")),
                addresses=addresses,
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            if delivery.origin not in self._warned:
                self._warned.add(delivery.origin)
                self._log.warn(
                    "fleet: unreadable announcement from node {other}: {reason}; ignored",
                    other=delivery.origin,
                    reason=str(exc) or type(exc).__name__,
                )
            return None

    def _leave(self, nodes: Iterable[str], why: str) -> None:
        left = frozenset(nodes)
        for node in left:
            self._members.pop(node, None)
            self._heard.pop(node, None)
            self._told.pop(node, None)
            self._log.info(
                "fleet: node {other} left: {why} ({nodes} node(s) live)",
                other=node,
                why=why,
                nodes=len(self._members) + 1,
            )
        self.stats.nodes = len(self._members) + 1
        self._check_configs()
        self._changed(frozenset(), left)

    def _changed(self, joined: frozenset[str], left: frozenset[str]) -> None:
        for callback in list(self._listeners):
            callback(joined, left)

    # --- configurations ---------------------------------------------------------------------

    def _check_configs(self) -> None:
        for member in list(self._members.values()):
            self._check_config(member)
        self.stats.config_mismatch = len(self.mismatched())

    def _check_config(self, member: Member) -> None:
        """Log a node whose hash differs from ours, once per change of either; count them."""
        mine = self._config_hash()
        theirs = member.config_hash
        node = member.node
        if theirs != mine:
            if self._told.get(node) != (theirs, mine):
                self._told[node] = (theirs, mine)
                self._log.warn(
                    "fleet: node {other} runs another configuration than node {node}: its hash"
                    " {theirs}, ours {mine}; every node of a fleet should run the same main"
                    " file and routes (docs/fleet.rst)",
                    other=node,
                    node=self.node,
                    theirs=theirs,
                    mine=mine,
                )
        elif self._told.pop(node, None) is not None:
            self._log.info(
                "fleet: node {other} runs the same configuration as node {node} again ({mine})",
                other=node,
                node=self.node,
                mine=mine,
            )
        self.stats.config_mismatch = sum(1 for m in self._members.values() if m.config_hash != mine)
