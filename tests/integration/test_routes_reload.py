"""Routes between two local listeners, and SIGHUP reloading them live.

One gateway with two SSMP hubs, ``east`` and ``west``. Routes are files in
the routes directory; after SIGHUP the gateway re-reads them without
dropping connections, and refuses (keeping the old routes) a broken set.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, GatewayStartError, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.east]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.west]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""

EAST_TO_WEST = """
from = "east"
match = "orders.*"
to = "west"
address = "east.{1}"
"""


def login(address: tuple[str, int], identity: str) -> LineClient:
    """Connect and log in with the open scheme."""
    client = LineClient(address)
    client.send(f"LOGIN {identity} open")
    client.expect("200")
    return client


def test_route_between_listeners_and_reload(tmp_path: Path) -> None:
    """A route appears on SIGHUP, rewrites addresses, and a bad reload keeps it."""
    process = GatewayProcess(tmp_path, CONFIG).start()
    try:
        with (
            login(process.address("east"), "seller") as seller,
            login(process.address("west"), "buyer") as buyer,
        ):
            buyer.send("SUBSCRIBE east.books")
            buyer.expect("200")
            seller.send("MCAST orders.books one")
            seller.expect("200")
            buyer.sync()  # no route yet: nothing crossed

            (tmp_path / "routes" / "east-to-west.toml").write_text(EAST_TO_WEST)
            process.signal(signal.SIGHUP)
            process.wait_for_log(r"reload: 1 route\(s\) in effect")
            seller.send("MCAST orders.books two")
            seller.expect("200")
            buyer.expect("000 seller MCAST east.books two")

            (tmp_path / "routes" / "broken.toml").write_text('from = "east"\nto = "nowhere"\n')
            process.signal(signal.SIGHUP)
            line = process.wait_for_log("reload refused")
            assert "keeping the old routes" in line
            process.wait_for_log("broken.toml: match: is required")
            seller.send("MCAST orders.books three")
            seller.expect("200")
            buyer.expect("000 seller MCAST east.books three")
    finally:
        process.stop()


def test_port_in_use_stops_startup(tmp_path: Path) -> None:
    """A listener that cannot listen makes twistd exit 1, saying why in one line, no traceback."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    config = CONFIG.replace(
        'endpoint = "tcp:0:interface=127.0.0.1"', f'endpoint = "tcp:{port}:interface=127.0.0.1"', 1
    )
    try:
        with pytest.raises(GatewayStartError, match=r"exited with 1") as caught:
            GatewayProcess(tmp_path, config).start()
        output = str(caught.value)
        assert f"msggateway cannot start: listener east: Couldn't listen on 127.0.0.1:{port}" in (
            output
        )
        assert "Traceback" not in output and "CannotListenError" not in output
    finally:
        taken.close()
