"""``[fleet] processes`` and what each worker makes of the configuration.

The key and its checks (`gateway.config.fleet`), the endpoint-string ports
they read and rewrite (`gateway.config.endpoints`), a worker's node id, data
dir and ports (`gateway.fleet.worker.worker_config`), its options
(``--worker``, ``--shared-port``), and its two pipes to the supervisor: the
ready report, and the watch on standard input.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.endpoints import serverFromString
from twisted.internet.main import CONNECTION_DONE
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor, MemoryReactorClock
from twisted.python import usage
from twisted.python.failure import Failure

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config.endpoints import endpoint_port, endpoint_with_port
from gateway.config.fleet import MAX_PROCESSES, FleetConfig, node_id, worker_node
from gateway.fleet.worker import (
    WORKER_PORT_SUFFIX,
    SupervisorWatch,
    report,
    worker_config,
    worker_data_dir,
)
from gateway.service import Options, build_gateway

HUB = """
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
"""


def _main(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(textwrap.dedent(text))
    return path


def _problems(tmp_path: Path, text: str) -> list[str]:
    """The problems of a main file, as ``key: reason``."""
    with pytest.raises(ConfigError) as raised:
        load_config(_main(tmp_path, text))
    return [f"{problem.key}: {problem.reason}" for problem in raised.value.problems]


# --- the key --------------------------------------------------------------------------------


def test_one_process_by_default(tmp_path: Path) -> None:
    """Without the key, or without ``[fleet]``, the gateway is one process."""
    assert load_config(_main(tmp_path, HUB)).fleet.processes == 1
    assert load_config(_main(tmp_path, '[fleet]\nnode = "a"\n' + HUB)).fleet.processes == 1


def test_processes_is_read(tmp_path: Path) -> None:
    """``processes = 4`` is four workers."""
    config = load_config(_main(tmp_path, "[fleet]\nprocesses = 4\n" + HUB))
    assert config.fleet == FleetConfig(processes=4)
    assert config.summary().endswith(", 4 processes")  # what check-config says


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("0", "fleet.processes: must be at least 1, not 0"),
        (str(MAX_PROCESSES + 1), f"fleet.processes: must be at most {MAX_PROCESSES}"),
        ('"2"', "fleet.processes: must be a whole number"),
    ],
)
def test_a_bad_number_of_processes_is_refused(tmp_path: Path, value: str, reason: str) -> None:
    """At least 1, at most `MAX_PROCESSES`, a whole number."""
    [problem] = _problems(tmp_path, f"[fleet]\nprocesses = {value}\n" + HUB)
    assert problem.startswith(reason)


def test_the_workers_node_ids_must_fit(tmp_path: Path) -> None:
    """``<node>-<i>`` must be a node id too: at most 64 characters for the last worker."""
    fits = "n" * 62
    config = load_config(_main(tmp_path, f'[fleet]\nnode = "{fits}"\nprocesses = 10\n' + HUB))
    assert len(worker_node(fits, 9)) == 64
    assert config.fleet.node == fits
    [problem] = _problems(tmp_path, f'[fleet]\nnode = "{fits}"\nprocesses = 11\n' + HUB)
    assert problem.startswith("fleet.node: with processes = 11 the workers are nodes")


def test_a_kept_node_id_must_fit_the_workers_too(tmp_path: Path) -> None:
    """A node id kept in the data dir is checked when it is read."""
    (tmp_path / "node-id").write_text("k" * 62 + "\n")
    assert node_id(FleetConfig(processes=10), tmp_path) == "k" * 62
    with pytest.raises(ConfigError) as raised:
        node_id(FleetConfig(processes=11), tmp_path)
    assert "at most 64 characters" in str(raised.value)


def test_a_listener_the_workers_cannot_share_is_refused(tmp_path: Path) -> None:
    """Every listener but MTL is shared through SO_REUSEPORT: a TCP endpoint with a port."""
    text = """
        [fleet]
        processes = 2
        [listeners.local]
        protocol = "qmqp"
        endpoint = "unix:q.sock"
        """
    [problem] = _problems(tmp_path, text)
    assert problem.startswith("listeners.local.endpoint: with [fleet] processes = 2 every worker")


def test_the_admin_endpoint_needs_a_port(tmp_path: Path) -> None:
    """Worker i's admin endpoint is on port + i: a unix socket cannot be."""
    text = '[fleet]\nprocesses = 2\n[admin]\nendpoint = "unix:admin.sock"\n' + HUB
    [problem] = _problems(tmp_path, text)
    assert problem.startswith("admin.endpoint: with [fleet] processes = 2 worker i listens on")
    disabled = '[fleet]\nprocesses = 2\n[admin]\nendpoint = "unix:a.sock"\nenabled = false\n'
    assert load_config(_main(tmp_path, disabled + HUB)).admin.endpoint is None


def test_ports_of_later_workers_must_not_run_into_others(tmp_path: Path) -> None:
    """MTL's port + i and data_port + i, and the admin's, must miss every other port."""
    text = """
        [fleet]
        processes = 3
        [admin]
        endpoint = "tcp:8790:interface=127.0.0.1"
        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:8792:interface=127.0.0.1"
        [listeners.m]
        protocol = "mtl"
        endpoint = "tcp:5555"
        data_port = 5556
        """
    assert sorted(_problems(tmp_path, text)) == [
        "admin.endpoint: with [fleet] processes = 3 worker i takes port + i, and port 8792 is"
        " also listeners.hub.endpoint's: leave 3 ports free from each such port",
        "listeners.m.data_port: with [fleet] processes = 3 worker i takes port + i, and port"
        " 5557 is also listeners.m.endpoint's: leave 3 ports free from each such port",
        "listeners.m.endpoint: with [fleet] processes = 3 worker i takes port + i, and port"
        " 5556 is also listeners.m.data_port's: leave 3 ports free from each such port",
    ]
    apart = text.replace("8792", "8800").replace("5556", "5560")
    assert load_config(_main(tmp_path, apart)).fleet.processes == 3


def test_port_zero_and_one_process_are_never_in_the_way(tmp_path: Path) -> None:
    """Port 0 gives each worker its own; one process adds no port at all."""
    text = """
        [fleet]
        processes = {processes}
        [admin]
        endpoint = "tcp:{admin}:interface=127.0.0.1"
        [listeners.m]
        protocol = "mtl"
        endpoint = "tcp:0"
        data_port = 0
        """
    assert load_config(_main(tmp_path, text.format(processes=8, admin=0)))
    assert load_config(_main(tmp_path, text.format(processes=1, admin=65535)))
    [problem] = _problems(tmp_path, text.format(processes=2, admin=65535))
    assert problem.startswith("admin.endpoint: with [fleet] processes = 2 the last worker's port")


def test_stream_worker_ports_must_not_run_into_others(tmp_path: Path) -> None:
    """Each worker's own stream port (port + 1 + i, or worker_ports + i) must miss the others."""
    text = """
        [fleet]
        processes = 3
        [listeners.streams]
        protocol = "stream"
        endpoint = "tcp:5552:interface=127.0.0.1"
        {worker_ports}
        [listeners.hub]
        protocol = "ssmp"
        endpoint = "tcp:5554:interface=127.0.0.1"
        """
    note = " (worker_ports: each worker's own stream port; by default the listener's port + 1 + i)"
    assert _problems(tmp_path, text.format(worker_ports="")) == [
        "listeners.streams.worker_ports: with [fleet] processes = 3 worker i takes port + i,"
        " and port 5554 is also listeners.hub.endpoint's: leave 3 ports free from each such"
        f" port{note}"
    ]
    assert load_config(_main(tmp_path, text.format(worker_ports="worker_ports = 6000")))
    [onto_itself] = _problems(tmp_path, text.format(worker_ports="worker_ports = 5551"))
    assert "port 5552 is also listeners.streams.endpoint's" in onto_itself
    [past] = _problems(tmp_path, text.format(worker_ports="worker_ports = 65534"))
    assert "the last worker's port would be 65536, past 65535" in past
    not_a_port = _problems(tmp_path, text.format(worker_ports="worker_ports = 70000"))
    assert "listeners.streams.worker_ports: must be a TCP port, at most 65535, not 70000" in (
        not_a_port
    )


# --- endpoint ports ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "description",
    [
        "tcp:8080",
        "tcp:8080:interface=127.0.0.1",
        "tcp:port=8080:interface=\\:\\:1",
        "tcp6:interface=\\:\\:1:port=8080",
        "ssl:8080:privateKey=/a\\:b.pem",
        "tcp:8080:interface=127.0.0.1:backlog=9",
    ],
)
def test_the_port_is_the_one_twisted_reads(description: str) -> None:
    """`endpoint_port` and `endpoint_with_port` agree with Twisted's own parser."""

    def listened_port(text: str) -> int:
        reactor = MemoryReactor()
        serverFromString(reactor, text).listen(Factory())
        return int(reactor.tcpServers[0][0])

    assert endpoint_port(description) == 8080
    moved = endpoint_with_port(description, 9090)
    assert endpoint_port(moved) == 9090
    assert moved.replace("9090", "8080") == description
    if not description.startswith("ssl:"):
        assert listened_port(moved) == 9090


@pytest.mark.parametrize("description", ["unix:/run/gw.sock", "tcp:interface=127.0.0.1", "x:1"])
def test_endpoints_without_a_port(description: str) -> None:
    """No port to read or change."""
    assert endpoint_port(description) is None
    with pytest.raises(ValueError, match="names no port"):
        endpoint_with_port(description, 1)


# --- what a worker makes of the configuration -----------------------------------------------

WORKERS = """
[gateway]
data_dir = "data"
[fleet]
processes = 3
[admin]
endpoint = "tcp:8790:interface=127.0.0.1"
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
[listeners.fixed]
protocol = "qmqp"
endpoint = "tcp:6280:interface=127.0.0.1"
[listeners.m]
protocol = "mtl"
endpoint = "tcp:5555:interface=127.0.0.1"
data_port = 5565
[listeners.any]
protocol = "mtl"
endpoint = "tcp:0"
"""


@pytest.fixture
def shared(tmp_path: Path) -> GatewayConfig:
    """The configuration every worker shares."""
    return load_config(_main(tmp_path, WORKERS))


def test_a_worker_has_its_own_data_dir(shared: GatewayConfig, tmp_path: Path) -> None:
    """Worker i keeps its state in ``<data_dir>/worker-<i>``; its node is ``<node>-<i>``."""
    assert worker_data_dir(tmp_path / "data", 2) == tmp_path / "data" / "worker-2"
    assert worker_config(shared, 2, {}).data_dir == tmp_path / "data" / "worker-2"
    assert worker_node("gw-abc", 2) == "gw-abc-2"


def test_shared_listeners_listen_on_the_held_ports(shared: GatewayConfig) -> None:
    """A shared listener takes the port the supervisor holds for it; the rest stays."""
    config = worker_config(shared, 1, {"hub": 40001, "fixed": 6280})
    endpoints = {listener.name: listener.endpoint for listener in config.listeners}
    assert endpoints["hub"] == "tcp:40001:interface=127.0.0.1"
    assert endpoints["fixed"] == "tcp:6280:interface=127.0.0.1"


def test_mtl_and_admin_take_port_plus_i(shared: GatewayConfig) -> None:
    """ZeroMQ cannot share a port, nor should metrics: port + i; port 0 stays 0."""
    for index in range(3):
        config = worker_config(shared, index, {})
        listeners = {listener.name: listener for listener in config.listeners}
        assert listeners["m"].endpoint == f"tcp:{5555 + index}:interface=127.0.0.1"
        assert listeners["m"].settings.data_port == 5565 + index
        assert listeners["any"].endpoint == "tcp:0"
        assert listeners["any"].settings.data_port == 0
        assert config.admin.endpoint == f"tcp:{8790 + index}:interface=127.0.0.1"
        assert config.routes == shared.routes


@pytest.mark.parametrize(
    ("keys", "own", "advertised"),
    [
        ("", [5553, 5554, 5555], [None, None, None]),
        ("worker_ports = 6000", [6000, 6001, 6002], [None, None, None]),
        ("advertised_port = 7000", [5553, 5554, 5555], [7000, 7001, 7002]),
    ],
)
def test_a_stream_listener_has_a_port_of_each_workers_own(
    tmp_path: Path, keys: str, own: list[int], advertised: list[int | None]
) -> None:
    """Worker i listens on port + 1 + i (or worker_ports + i) too, and advertises it (or + i)."""
    config = load_config(
        _main(
            tmp_path,
            f"""
            [fleet]
            processes = 3
            [listeners.streams]
            protocol = "stream"
            endpoint = "tcp:5552:interface=127.0.0.1"
            {keys}
            """,
        )
    )
    assert config.listeners[0].settings.worker_port is None  # the supervisor's: no own port
    for index in range(3):
        [listener] = worker_config(config, index, {"streams": 5552}).listeners
        assert listener.endpoint == "tcp:5552:interface=127.0.0.1"
        assert listener.settings.worker_port == own[index]
        assert listener.settings.advertised_port == advertised[index]


def test_a_stream_listener_on_port_zero_gives_each_worker_a_free_port(tmp_path: Path) -> None:
    """Port 0: the shared port is the supervisor's pick, each worker's own port 0 (its pick)."""
    config = load_config(
        _main(
            tmp_path,
            """
            [fleet]
            processes = 2
            [listeners.streams]
            protocol = "stream"
            endpoint = "tcp:0:interface=127.0.0.1"
            """,
        )
    )
    [listener] = worker_config(config, 1, {"streams": 40001}).listeners
    assert listener.endpoint == "tcp:40001:interface=127.0.0.1"
    assert listener.settings.worker_port == 0


class _ThreadedMemoryReactor(MemoryReactorClock):
    """A memory reactor the log's writer thread can hand its results to.

    They are kept, not run: the test looks at listeners, not at the log.
    """

    def __init__(self) -> None:
        super().__init__()
        self.from_threads: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N802
        """Keep the call (list.append is safe from another thread)."""
        self.from_threads.append((f, args, kwargs))


def test_a_worker_serves_and_advertises_its_own_stream_port(tmp_path: Path) -> None:
    """Built for a worker: the listener listens on both ports, and names its own in Open."""
    config = load_config(
        _main(
            tmp_path,
            """
            [gateway]
            data_dir = "data"
            [fleet]
            processes = 2
            [admin]
            enabled = false
            [listeners.streams]
            protocol = "stream"
            endpoint = "tcp:5552:interface=127.0.0.1"
            """,
        )
    )
    reactor = _ThreadedMemoryReactor()
    gateway = build_gateway(worker_config(config, 1, {"streams": 5552}), reactor, node="gw-1")
    gateway.startService()
    try:
        listeners = gateway.listeners()
        assert sorted(listeners) == ["streams", f"streams{WORKER_PORT_SUFFIX}"]
        assert sorted(port for port, *_ in reactor.tcpServers) == [5552, 5554]
        factory = listeners["streams"].factory
        assert factory is listeners[f"streams{WORKER_PORT_SUFFIX}"].factory
        assert factory.advertised() == ("127.0.0.1", 5554)
    finally:
        gateway.stopService()


# --- options -------------------------------------------------------------------------------


def test_worker_options(shared: GatewayConfig, tmp_path: Path) -> None:
    """``--worker I --shared-port NAME=PORT``; the worker's data dir is made."""
    options = Options()
    options.parseOptions(["--config", shared.source, "--worker", "2", "--shared-port", "hub=40001"])
    assert options["worker"] == 2
    assert options.shared_ports == {"hub": 40001}
    assert (tmp_path / "data" / "worker-2").is_dir()


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        (["--worker", "3"], "--worker 3: [fleet] processes = 3 has workers 0 to 2"),
        (["--shared-port", "hub"], "--shared-port hub: expected NAME=PORT"),
        (["--shared-port", "hub=70000"], "expected NAME=PORT"),
    ],
)
def test_bad_worker_options(shared: GatewayConfig, arguments: list[str], complaint: str) -> None:
    """A worker index past the configured processes, or a malformed port, is a usage error."""
    with pytest.raises(usage.UsageError, match=complaint.replace("[", "\\[").replace("]", "\\]")):
        Options().parseOptions(["--config", shared.source, *arguments])


# --- the pipes to the supervisor -----------------------------------------------------------


def test_the_ready_report_is_one_json_line() -> None:
    """What the supervisor reads on descriptor 3."""
    read, write = os.pipe()
    try:
        assert report({"ready": {"hub": "127.0.0.1:1"}}, fd=write)
        assert json.loads(os.read(read, 4096)) == {"ready": {"hub": "127.0.0.1:1"}}
    finally:
        os.close(read)
        os.close(write)
    assert not report({"ready": {}}, fd=write)  # closed: no supervisor to tell


def test_the_watch_ends_when_the_supervisor_is_gone() -> None:
    """Data is read and dropped; the end of the pipe ends the watch and says so once."""
    read, write = os.pipe()
    gone: list[bool] = []
    try:
        watch = SupervisorWatch(lambda: gone.append(True), fd=read)
        assert watch.doRead() is None  # nothing yet
        os.write(write, b"x")
        assert watch.doRead() is None
        os.close(write)
        assert watch.doRead() is CONNECTION_DONE
        watch.connectionLost(Failure(CONNECTION_DONE))
        assert gone == [True]
    finally:
        os.close(read)
