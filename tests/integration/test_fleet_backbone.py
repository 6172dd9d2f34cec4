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
