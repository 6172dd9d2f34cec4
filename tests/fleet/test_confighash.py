"""The configuration's hash (`gateway.fleet.confighash`), and the fleet assembled around it.

The hash is compared across the nodes of a fleet (`gateway.fleet.members`):
it must be the same for the same configuration in every process, blind to
what legitimately differs between nodes, and see every other difference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock

from gateway.config import load_config
from gateway.core.router import Router, RouteTable, bind_routes
from gateway.fleet.confighash import config_hash, live_config_hash
from gateway.fleet.worker import worker_config
from gateway.metrics import GatewayMetrics
from gateway.protocols.stream.server import StreamServerFactory
from gateway.service import build_gateway

MAIN = """
[gateway]
data_dir = "{data_dir}"
secrets = "secrets.toml"
routes = "routes"

[fleet]
node = "{node}"
amqp = "tcp:host=127.0.0.1:port=5672"
{fleet_extra}

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
advertised_host = "{host}"
max_unconfirmed = {max_unconfirmed}

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""
ROUTE = """
from = "mail"
match = "#"
to = "streams"
address = "{address}"
"""


def write(
    directory: Path,
    *,
    node: str = "edge-1",
    data_dir: str = "data",
    host: str = "edge-1.example.org",
    max_unconfirmed: int = 50_000,
    fleet_extra: str = "",
    address: str = "mail",
    password: str = "secret",
) -> Path:
    """A main file, a route file and a secrets file; the main file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "routes").mkdir(exist_ok=True)
    main = directory / "gateway.toml"
    main.write_text(
        MAIN.format(
            node=node,
            data_dir=data_dir,
            host=host,
            max_unconfirmed=max_unconfirmed,
            fleet_extra=fleet_extra,
        )
    )
    (directory / "routes" / "mail.toml").write_text(ROUTE.format(address=address))
    (directory / "secrets.toml").write_text(f'[logins]\nalice = "{password}"\n')
    return main


def digest(main: Path) -> str:
    """The hash of the configuration in ``main``."""
    return config_hash(load_config(main))


def test_the_same_configuration_hashes_alike_in_every_process(tmp_path: Path) -> None:
    """Another process (another hash seed) computes the same hash."""
    main = write(tmp_path)
    code = (
        "import sys; from pathlib import Path; from gateway.config import load_config;"
        " from gateway.fleet.confighash import config_hash;"
        " print(config_hash(load_config(Path(sys.argv[1]))))"
    )
    hashes = {
        subprocess.run(
            [sys.executable, "-c", code, str(main)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parents[2],
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert hashes == {digest(main)}


def test_what_differs_between_nodes_is_left_out(tmp_path: Path) -> None:
    """Node id, data dir, advertised address, secrets, processes and the file's place."""
    expected = digest(write(tmp_path / "one"))
    assert digest(write(tmp_path / "two", node="edge-2")) == expected
    assert digest(write(tmp_path / "three", data_dir="elsewhere")) == expected
    assert digest(write(tmp_path / "four", host="edge-4.example.org")) == expected
    assert digest(write(tmp_path / "five", password="another")) == expected
    assert digest(write(tmp_path / "six", fleet_extra="processes = 2")) == expected
    # Comments, key order and a default written out change nothing either.
    main = write(tmp_path / "seven")
    text = main.read_text().replace(
        "max_unconfirmed = 50000", "heartbeat_seconds = 60  # the default\nmax_unconfirmed = 50000"
    )
    assert "heartbeat_seconds" in text
    main.write_text("# a comment\n" + text)
    assert digest(main) == expected


def test_every_other_difference_changes_it(tmp_path: Path) -> None:
    """A listener's setting, a route, a fleet key: another hash."""
    expected = digest(write(tmp_path / "one"))
    assert digest(write(tmp_path / "two", max_unconfirmed=10)) != expected
    assert digest(write(tmp_path / "three", address="letters")) != expected
    assert digest(write(tmp_path / "four", fleet_extra='vhost = "other"')) != expected
    pinned = '[fleet.streams]\n"orders" = "edge-2"'
    assert digest(write(tmp_path / "five", fleet_extra=f"\n{pinned}")) != expected


def test_a_worker_hashes_what_its_supervisor_read(tmp_path: Path) -> None:
    """Per-worker ports (admin, MTL) and data dirs are not the configuration's."""
    main = write(tmp_path, fleet_extra="processes = 2")
    shared = load_config(main)
    gateway = build_gateway(
        worker_config(shared, 1, {}), MemoryReactorClock(), "edge-1-1", shared=shared
    )
    gateway.router.replace_table(gateway._bind(shared.routes))  # as startService does
    assert gateway.membership is not None
    me = gateway.membership.member("edge-1-1")
    assert me is not None and me.config_hash == config_hash(shared)


def test_the_live_hash_follows_reloaded_routes(tmp_path: Path) -> None:
    """After a reload the routes in effect are hashed, once per route table."""
    config = load_config(write(tmp_path))
    router = Router(RouteTable(), Clock(), GatewayMetrics())
    current = live_config_hash(config, router)
    destinations: dict[str, Any] = {"streams": object()}
    router.replace_table(bind_routes(config.routes, destinations))
    assert current() == config_hash(config)
    other = attrs.evolve(config.routes[0], target=None)
    router.replace_table(bind_routes((other,), destinations))
    assert current() != config_hash(config)


def test_a_fleet_stream_listener_joins_the_fleet(tmp_path: Path) -> None:
    """With ``[fleet] amqp`` the stream listener relays; health reports the fleet."""
    gateway = build_gateway(load_config(write(tmp_path)), MemoryReactorClock(), "edge-1")
    factory = gateway.listeners()["streams"].factory
    assert isinstance(factory, StreamServerFactory)
    assert factory.fleet is not None and factory.fleet.relays
    assert factory.fleet.placement is gateway.streams
    report = gateway.health()
    assert report.fleet is not None and report.fleet["node"] == "edge-1"


def test_without_amqp_nothing_changes(tmp_path: Path) -> None:
    """No ``[fleet] amqp``: no membership, no placement, no fleet in the health report."""
    main = write(tmp_path)
    main.write_text(main.read_text().replace('amqp = "tcp:host=127.0.0.1:port=5672"', ""))
    gateway = build_gateway(load_config(main), MemoryReactorClock(), "edge-1")
    factory = gateway.listeners()["streams"].factory
    assert isinstance(factory, StreamServerFactory) and factory.fleet is None
    assert gateway.membership is None and gateway.health().fleet is None
