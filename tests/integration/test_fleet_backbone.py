"""`gateway.fleet.backbone` against a real RabbitMQ node (the session's `rabbitmq`).

Publisher confirms with mandatory returns, many in a row (RabbitMQ acks
them with ``multiple``: each result must still be its own message's), and
bindings past one batch (`BIND_BATCH`) declared in batches; confirms on the
connection after a reconnection.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.task import deferLater

from gateway.fleet.backbone import BIND_BATCH, Backbone, Delivery, Published
from tests.rabbitmq import RabbitMQNode

pytestmark = pytest.mark.integration

_names = itertools.count()


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait, a reactor turn at a time, until ``condition()`` holds (at most ``seconds``)."""
    turns = int(seconds / 0.01)
    for _ in range(turns):
        if condition():
            return
        await deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("not within the time")


def connected(node: Backbone) -> Deferred[None]:
    """Fires once the backbone is connected with everything declared."""
    ready: Deferred[None] = Deferred()
    node.on_connected(lambda: None if ready.called else ready.callback(None))
    return ready


def bound(node: Backbone) -> Deferred[None]:
    """Fires once every binding asked for so far took effect."""
    done: Deferred[None] = Deferred()
    node.when_bound(lambda: done.callback(None))
    return done


@pytest_twisted.ensureDeferred
async def test_returns_and_confirms_in_a_row(rabbitmq: RabbitMQNode) -> None:
    """Mandatory messages alternately routed and not: each gets its own result."""
    endpoint = f"tcp:host=127.0.0.1:port={rabbitmq.amqp_port}"
    clock: Any = reactor
    node = Backbone(
        node=f"t{next(_names)}",
        endpoints=[(endpoint, clientFromString(clock, endpoint))],
        clock=clock,
    )
    exchange = f"test.backbone.{node.node}.{id(node)}"
    got: list[Delivery] = []
    node.declare_exchange(exchange)
    node.consume(exchange, got.append)
    keys = [f"k{index}" for index in range(BIND_BATCH + 10)]
    for key in keys:
        node.bind(exchange, key)
    ready = connected(node)
    node.start()
    try:
        await ready
        await bound(node)
        results: dict[int, Published] = {}
        for index in range(40):
            key = keys[-1 - index] if index % 2 else "nobody"
            node.publish(
                exchange,
                key,
                b"m%d" % index,
                kind="test",
                mandatory=True,
                on_result=functools.partial(results.__setitem__, index),
            )
        await until(lambda: len(results) == 40)
        assert results == {
            index: Published.ROUTED if index % 2 else Published.UNROUTABLE for index in range(40)
        }
        await until(lambda: len(got) == 20)  # the last keys: bound in the second batch
        assert [delivery.body for delivery in got] == [b"m%d" % i for i in range(1, 40, 2)]
        assert {delivery.origin for delivery in got} == {node.node}
        assert node.unconfirmed == 0
    finally:
        await node.stop()


@pytest_twisted.ensureDeferred
async def test_confirms_after_a_reconnection(rabbitmq: RabbitMQNode) -> None:
    """A new channel numbers its confirms from 1 again: publishes after it get their results.

    Numbered on from the first channel, no result would ever come, and the
    unconfirmed messages would hold the node's publishers.
    """
    endpoint = f"tcp:host=127.0.0.1:port={rabbitmq.amqp_port}"
    clock: Any = reactor
    node = Backbone(
        node=f"t{next(_names)}",
        endpoints=[(endpoint, clientFromString(clock, endpoint))],
        clock=clock,
    )
    exchange = f"test.backbone.{node.node}.{id(node)}"
    node.declare_exchange(exchange)
    node.bind(exchange, "here")
    ready = connected(node)
    node.start()
    try:
        await ready
        await bound(node)
        results: list[Published] = []
        for index in range(5):
            node.publish(exchange, "here", b"m%d" % index, kind="test", on_result=results.append)
        await until(lambda: len(results) == 5)
        again = connected(node)
        assert node._protocol is not None and node._protocol.transport is not None
        node._protocol.transport.abortConnection()
        await again
        await bound(node)
        results.clear()
        for index in range(5):
            node.publish(
                exchange, "here", b"n%d" % index, kind="test", mandatory=True,
                on_result=results.append,
            )  # fmt: skip
        await until(lambda: len(results) == 5)
        assert results == [Published.ROUTED] * 5
        assert node.unconfirmed == 0
    finally:
        await node.stop()


def _backbone(rabbitmq: RabbitMQNode, name: str) -> Backbone:
    endpoint = f"tcp:host=127.0.0.1:port={rabbitmq.amqp_port}"
    clock: Any = reactor
    return Backbone(
        node=name, endpoints=[(endpoint, clientFromString(clock, endpoint))], clock=clock
    )


@pytest_twisted.ensureDeferred
async def test_others_only_never_brings_a_node_its_own_messages(rabbitmq: RabbitMQNode) -> None:
    """Through the nodes' filters: what a node publishes reaches the others bound, not itself.

    A mandatory message comes back when only its publisher is bound; a
    node's bindings of an earlier connection are gone after a reconnection
    (its filter is declared anew), and it is reachable again.
    """
    base = f"t{next(_names)}"
    one, two = _backbone(rabbitmq, f"{base}a"), _backbone(rabbitmq, f"{base}b")
    exchange = f"test.others.{base}"
    got: dict[str, list[Delivery]] = {one.node: [], two.node: []}
    for node in (one, two):
        node.declare_exchange(exchange, others_only=True)
        node.consume(exchange, got[node.node].append)
        node.bind(exchange, "both")
        node.bind(exchange, f"only.{node.node}")
    ready = [connected(one), connected(two)]
    one.start()
    two.start()
    try:
        for waiting in ready:
            await waiting
        await bound(one)
        await bound(two)
        results: dict[str, Published] = {}
        for key in ("both", f"only.{one.node}", f"only.{two.node}", "nobody"):
            one.publish(
                exchange, key, key.encode(), kind="test", mandatory=True,
                on_result=functools.partial(results.__setitem__, key),
            )  # fmt: skip
        await until(lambda: len(results) == 4)
        assert results == {
            "both": Published.ROUTED,
            f"only.{one.node}": Published.UNROUTABLE,
            f"only.{two.node}": Published.ROUTED,
            "nobody": Published.UNROUTABLE,
        }
        await until(lambda: len(got[two.node]) == 2)
        assert [d.body for d in got[two.node]] == [b"both", f"only.{two.node}".encode()]
        first = got[two.node][0]
        assert (first.exchange, first.routing_key) == (exchange, "both")
        assert got[one.node] == []
        # Node two's connection goes, and "both" is unbound meanwhile: the binding stays
        # in RabbitMQ (the filter is no exclusive queue) until the next connection
        # declares the filter anew, with the bindings wanted then.
        two.on_lost(lambda: two.unbind(exchange, "both"))
        again = connected(two)
        assert two._protocol is not None and two._protocol.transport is not None
        two._protocol.transport.abortConnection()
        await again
        await bound(two)
        results.clear()
        for key in ("both", f"only.{two.node}"):
            one.publish(
                exchange, key, b"again", kind="test", mandatory=True,
                on_result=functools.partial(results.__setitem__, key),
            )  # fmt: skip
        await until(lambda: len(results) == 2)
        assert results == {"both": Published.UNROUTABLE, f"only.{two.node}": Published.ROUTED}
    finally:
        await one.stop()
        await two.stop()
