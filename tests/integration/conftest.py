"""Fixtures for integration tests: a private RabbitMQ node and fresh stream names.

`rabbitmq` is one `tests.rabbitmq.RabbitMQNode` for the whole session,
started the first time a test asks for it (tests that do not ask never pay
for it) and stopped at the end of the session. ``./dev test`` installs
Debian's ``rabbitmq-server`` beforehand when it is missing; this fixture
never installs anything.

When RabbitMQ cannot be run here at all (`RabbitMQUnavailable`: not
installed and not installable, e.g. not root), tests that need it are
skipped with the reason on a developer's machine, and fail under
``CI=true``, where a skip would hide that they never ran. A node that is
installed but does not start (`RabbitMQStartError`) always fails, with the
tail of its log.

Nothing here imports txzmq or a reactor: test modules choose their reactor.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.harness import start_rabbitmq
from tests.rabbitmq import RabbitMQNode

__all__ = ["rabbitmq", "stream_name"]

MAX_TEST_NAME_CHARS = 60
"""How much of the test's name goes into a stream name (RabbitMQ allows 255 bytes)."""


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[RabbitMQNode]:
    """A running private RabbitMQ node with the stream plugin, on loopback.

    The node (its name, ports and data directory) lasts the whole session.
    A test may call ``restart()`` or ``stop_broker()`` then ``start()``; it
    must leave the broker running. Streams are not deleted between tests:
    use `stream_name` for names of your own.
    """
    node = RabbitMQNode()
    start_rabbitmq(node.start, "RabbitMQ", "RabbitMQ is installed but did not start")
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def stream_name(request: pytest.FixtureRequest) -> str:
    """A stream name no other test (or run) uses: the test's name and a random suffix."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:MAX_TEST_NAME_CHARS]
    return f"{readable.strip('-')}-{uuid.uuid4().hex[:12]}"
