"""Our MTL upstream logs in to our MTL listener with SCRAM-SHA-256, in this process.

Both run on the test's reactor over real ZeroMQ sockets on loopback. A
wrong secret ends in the upstream starting over (with its backoff), not in
a loop of Authorize requests.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest_twisted
from twisted.internet import task
from twisted.logger import globalLogPublisher

from gateway.core.auth import Secrets
from gateway.core.router import Router, RouteTable
from gateway.protocols.mtl.client import MTLUpstream
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings, MTLUpstreamSettings

DEADLINE_SECONDS = 10.0


@pytest_twisted.inlineCallbacks
def wait_for(condition: Callable[[], bool]) -> Generator[Any, Any, None]:
    """Poll ``condition`` every 10 ms until it holds; fail after the deadline."""
    from twisted.internet import reactor

    waited = 0.0
    while not condition():
        assert waited < DEADLINE_SECONDS, "condition not met in time"
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


def pair(server_secret: bytes, client_secret: bytes) -> tuple[MTLServer, MTLUpstream]:
    """A SCRAM-only listener and an upstream (reader, test profile) logging in to it."""
    from twisted.internet import reactor

    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(
            require_auth=True, mechanisms=("SCRAM-SHA-256",), ping_interval_seconds=0
        ),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(logins={"gw": server_secret}),
        clock=reactor,
        reactor=reactor,
    )
    port = server.start()
    upstream = MTLUpstream(
        name="remote",
        settings=MTLUpstreamSettings(
            mode="reader",
            profile="test",
            resources=("resource",),
            confirm="none",
            username="gw",
            mechanism="SCRAM-SHA-256",
        ),
        host="127.0.0.1",
        port=port,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(upstreams={"remote": client_secret}),
        clock=reactor,
        reactor=reactor,
    )
    return server, upstream


@pytest_twisted.inlineCallbacks
def test_upstream_logs_in_with_scram_and_leases() -> Generator[Any, Any, None]:
    """With the right secret the upstream gets through 402 rounds to a lease and a summon."""
    summoned: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if "summoned" in event.get("log_format", ""):
            summoned.append(event["resource"])

    globalLogPublisher.addObserver(observe)
    server, upstream = pair(b"s3cret", b"s3cret")
    upstream.start()
    try:
        yield wait_for(lambda: upstream.connected and summoned == ["resource"])
        # Open, three Authorize (client-first, client-final, the empty acknowledgement),
        # Profile, Reader; then Lease and Summon on the data flow.
        assert server.traffic.messages_in == 8
    finally:
        globalLogPublisher.removeObserver(observe)
        upstream.stop()
        server.stop()


@pytest_twisted.inlineCallbacks
def test_wrong_secret_starts_over_instead_of_looping() -> Generator[Any, Any, None]:
    """A refused SCRAM login is logged once per attempt and retried with backoff."""
    events: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace", "").endswith("MTLUpstream"):
            events.append(event)

    globalLogPublisher.addObserver(observe)
    server, upstream = pair(b"s3cret", b"wrong")
    upstream.start()
    try:
        yield wait_for(lambda: any("refused the login" in e.get("why", "") for e in events))
        assert not upstream.connected
        refused = [e for e in events if "refused the login" in e.get("why", "")]
        assert refused[0]["why"].endswith("SCRAM-SHA-256: the proof does not verify")
        # Three requests (Open, client-first, client-final) then a pause: no tight loop.
        assert server.traffic.messages_in == 3
    finally:
        globalLogPublisher.removeObserver(observe)
        upstream.stop()
        server.stop()
