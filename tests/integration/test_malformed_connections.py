"""Hundreds of malformed connections per protocol leave the gateway alive, serving and quiet.

Issue 18: 80,000 malformed connections over SSMP, QMQP, stream and DMP left
the gateway alive, without a traceback, its memory 67 -> 74.5 MB; this keeps
it that way, bounded. One gateway under twistd (`GATEWAY_CONFIG`: SSMP,
QMQP, stream, DMP and MTL listeners) takes `CONNECTIONS` malformed
connections per protocol from `tests.fuzzing.connections` (random bytes,
half frames, oversized lengths, bad handshakes, valid handshakes followed
by mutated sessions; MTL over ZeroMQ with malformed multipart messages and
raw TCP garbage to its ports). After each protocol's flood:

- the process is running;
- every half-closed connection was closed by the gateway (none waited for
  the read time-out), and every MTL peer's last request was answered after
  its junk;
- a valid exchange of every protocol still succeeds;
- the log holds no traceback and no unhandled error;
- resident memory grew by less than `MAX_GROWTH_KIB`.

bench/fuzz.py runs the same floods with 10,000 connections per protocol.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.fuzzing.connections import (
    GATEWAY_CONFIG,
    HANDSHAKE_ANSWERED,
    PROTOCOLS,
    TRACEBACK_MARKERS,
    FloodResult,
    alive,
    flood,
    mtl_flood,
    payload_pools,
    payloads,
    rss_kib,
    serves,
)
from tests.fuzzing.samples import Input
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONNECTIONS = 300
"""Malformed connections per protocol."""

MAX_GROWTH_KIB = 16 * 1024
"""Most the gateway's resident memory may grow during one protocol's flood."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway with a listener of every protocol."""
    process = GatewayProcess(tmp_path_factory.mktemp("malformed"), GATEWAY_CONFIG).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def pools() -> dict[str, list[Input]]:
    """Valid client sessions of each TCP protocol, for the floods to mutate."""
    return payload_pools(60, seed_value=18)


def _flood(protocol: str, gateway: GatewayProcess, pools: dict[str, list[Input]]) -> FloodResult:
    rng = random.Random(f"malformed-{protocol}")
    address = gateway.address(protocol)
    if protocol == "mtl":
        return mtl_flood(address, CONNECTIONS, rng=rng, concurrency=16)
    return flood(
        address,
        payloads(protocol, rng, pools[protocol], CONNECTIONS),
        answered_when=HANDSHAKE_ANSWERED[protocol],
        concurrency=16,
        seed_value=rng.randrange(2**32),
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_malformed_connections_leave_the_gateway_serving(
    gateway: GatewayProcess, pools: dict[str, list[Input]], protocol: str
) -> None:
    """A flood of malformed connections: alive, every protocol served, no traceback, bounded RSS."""
    before = rss_kib(gateway.pid)
    result = _flood(protocol, gateway, pools)
    assert result.connections == CONNECTIONS
    assert result.unclosed == 0, f"{protocol}: {result}"
    assert alive(gateway.pid), f"the gateway exited:\n{gateway.output()}"
    served = {name: serves(name, gateway.address(name)) for name in PROTOCOLS}
    assert all(served.values()), f"after the {protocol} flood: {served}"
    log = gateway.output()
    for marker in TRACEBACK_MARKERS:
        assert marker not in log, f"{marker!r} in the log after the {protocol} flood:\n{log}"
    grown = rss_kib(gateway.pid) - before
    assert grown < MAX_GROWTH_KIB, f"the gateway grew by {grown} KiB during the {protocol} flood"
