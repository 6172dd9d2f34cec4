"""Two gateway processes bridged by an SSMP upstream route, end to end.

Gateway A is a plain hub. Gateway B has its own hub and an SSMP upstream to
A, logging in with a secret, with routes in both directions:

* ``news`` published on B's hub goes to A's ``news`` (B's publisher gets its
  200 only once A answered);
* ``alerts`` on A arrives on B's hub as ``remote.alerts``, from its original
  sender;
* a UCAST on B to ``<peer>@a`` (not connected to B) is a UCAST to ``<peer>``
  on A, whose 404 reaches B's sender; a UCAST on A to B's identity ``gw-b``
  reaches ``bob`` on B;
* a BCAST on either side is a BCAST on the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

HUB_A = """
[gateway]
secrets = "secrets.toml"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["secret", "open"]
"""

SECRETS_A = """
[logins]
gw-b = "bridge-secret"
"""

HUB_B = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
enabled = false

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.a]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port={port}"
identity = "gw-b"
scheme = "secret"
ping_interval_seconds = 5
"""

SECRETS_B = """
[upstreams]
a = "bridge-secret"
"""

ROUTES_B = {
    "news-to-a": 'from = "hub"\nmatch = "news"\nto = "a"\n',
    "alerts-from-a": 'from = "a"\nmatch = "alerts"\nto = "hub"\naddress = "remote.alerts"\n',
    "ucast-to-a": 'from = "hub"\nmatch = "!ucast.*@a"\nto = "a"\naddress = "!ucast.{1}"\n',
    "ucast-from-a": 'from = "a"\nmatch = "!ucast.gw-b"\nto = "hub"\naddress = "!ucast.bob"\n',
    "bcast-to-a": 'from = "hub"\nmatch = "!bcast"\nto = "a"\n',
    "bcast-from-a": 'from = "a"\nmatch = "!bcast"\nto = "hub"\n',
}


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Gateway A, and gateway B logged in to A through its SSMP upstream."""
    a = GatewayProcess(tmp_path / "a", HUB_A, secrets=SECRETS_A).start()
    try:
        _, port = a.address("hub")
        b = GatewayProcess(
            tmp_path / "b", HUB_B.format(port=port), routes=ROUTES_B, secrets=SECRETS_B
        ).start()
        try:
            b.wait_for_log("upstream a: logged in as gw-b")
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


def login(address: tuple[str, int], identity: str) -> LineClient:
    """Connect and log in with the open scheme."""
    client = LineClient(address)
    client.send(f"LOGIN {identity} open")
    client.expect("200")
    return client


def test_bridge_both_ways(bridge: tuple[GatewayProcess, GatewayProcess]) -> None:
    """MCAST crosses the bridge in each direction along its route."""
    a, b = bridge
    with login(a.address("hub"), "alice") as alice, login(b.address("hub"), "bob") as bob:
        # A -> B: wait until B's upstream subscribed to `alerts` on A (presence).
        alice.send("SUBSCRIBE alerts PRESENCE")
        alice.expect("200")
        alice.expect("000 gw-b SUBSCRIBE alerts")
        bob.send("SUBSCRIBE remote.alerts")
        bob.expect("200")
        alice.send("MCAST alerts disk full")
        alice.expect("200")
        bob.expect("000 alice MCAST remote.alerts disk full")

        # B -> A: bob's 200 comes after A accepted the MCAST.
        alice.send("SUBSCRIBE news")
        alice.expect("200")
        bob.send("MCAST news hello from b")
        bob.expect("200")
        alice.expect("000 gw-b MCAST news hello from b")

        # Topics without a route stay local.
        bob.send("MCAST local.only x")
        bob.expect("200")
        alice.sync()


def test_ucast_and_bcast_cross_the_bridge(bridge: tuple[GatewayProcess, GatewayProcess]) -> None:
    """UCAST and BCAST cross the bridge both ways; A's 404 reaches B's sender as 404."""
    a, b = bridge
    with login(a.address("hub"), "alice") as alice, login(b.address("hub"), "bob") as bob:
        # B's upstream subscribes to `alerts` on A, so alice shares a topic with gw-b.
        alice.send("SUBSCRIBE alerts PRESENCE")
        alice.expect("200")
        alice.expect("000 gw-b SUBSCRIBE alerts")

        # B -> A: a UCAST to alice@a is a UCAST to alice on A; bob's 200 follows A's.
        bob.send("UCAST alice@a hi alice", "UCAST nobody@a anyone", "UCAST nobody hm")
        bob.expect("200")
        bob.expect("404 a answered 404 no such peer")
        bob.expect("404 no such peer")  # no route for it: B's own 404
        alice.expect("000 gw-b UCAST alice hi alice")

        # A -> B: a UCAST to gw-b reaches bob on B, from alice.
        alice.send("UCAST gw-b hi bob")
        alice.expect("200")
        bob.expect("000 alice UCAST bob hi bob")

        # BCAST both ways: bob's reaches alice (sharing `alerts` with gw-b), and back.
        bob.send("BCAST from b")
        bob.expect("200")
        alice.expect("000 gw-b BCAST from b")
        alice.send("BCAST from a")
        alice.expect("200")
        bob.expect("000 alice BCAST from a")
        alice.sync()
        bob.sync()


def test_upstream_down_means_retry(bridge: tuple[GatewayProcess, GatewayProcess]) -> None:
    """With A gone, B's publisher is told to retry instead of getting a false 200."""
    a, b = bridge
    a.stop()
    b.wait_for_log("upstream a: connection lost")
    with login(b.address("hub"), "carol") as carol:
        carol.send("MCAST news anyone there")
        line = carol.expect_code(400)
        assert line.startswith(b"400 retry: upstream a is not connected")
