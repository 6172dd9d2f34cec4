"""``[fleet] processes = 2`` under twistd: one supervisor, two workers sharing one port.

One real ``twistd msggateway`` with an SSMP listener on port 0 and the
admin endpoint on port 0 (each worker picks its own). The supervisor holds
the SSMP port; both workers listen on it with SO_REUSEPORT, so the kernel
spreads connections over them: each worker's ``/metrics`` counts some. A
worker killed with SIGKILL is restarted and takes connections again; SIGHUP
reaches both (a route file added is in each worker's ``/routes``); SIGTERM
stops them all within the grace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Final

import pytest

from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

GRACE_SECONDS: Final = 2.0
CONNECTIONS: Final = 64
"""Connections opened at once: all on one worker by chance has a chance of 2 in 2**64."""
RESTART_SECONDS: Final = 10.0
"""A killed worker is ready again well within this (its first back-off is 0.5 s to 1.5 s)."""

CONFIG: Final = f"""
[gateway]
data_dir = "data"
routes = "routes"
shutdown_grace_seconds = {GRACE_SECONDS}

[fleet]
processes = 2

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.other]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""
ROUTE: Final = 'from = "hub"\nmatch = "weather.#"\nto = "other"\n'
_CONNECTIONS: Final = re.compile(r'msggateway_connections\{endpoint="hub",protocol="ssmp"\} (\S+)')


def _connections(gateway: GatewayProcess, worker: int) -> int:
    """The hub connections worker ``worker`` has open, by its own ``/metrics``."""
    found = _CONNECTIONS.search(gateway.metrics(worker=worker))
    return int(float(found.group(1))) if found else 0


def _spread(gateway: GatewayProcess) -> dict[int, int]:
    """Log `CONNECTIONS` clients in on the one hub port; how many each worker counts.

    A login answered means the connection was accepted and counted, so the
    workers' counts add up to `CONNECTIONS` at least when they are read
    (more while those of an earlier call are still closing).
    """
    with ExitStack() as stack:
        for number in range(CONNECTIONS):
            client = LineClient(gateway.address("hub"))
            stack.callback(client.close)
            client.send(f"LOGIN user{number} open")
            client.expect("200")
        counts = {index: _connections(gateway, index) for index in sorted(gateway.workers)}
    assert sum(counts.values()) >= CONNECTIONS, counts
    return counts


def _routes(gateway: GatewayProcess, worker: int) -> list[str]:
    """The route names worker ``worker``'s ``/routes`` lists."""
    host, port = gateway.workers[worker].addresses["admin"]
    with urllib.request.urlopen(f"http://{host}:{port}/routes", timeout=5) as response:
        return [route["name"] for route in json.loads(response.read())]


def _gone(pid: int) -> bool:
    """Whether no process has this id any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_workers_share_a_port_restart_reload_and_stop(tmp_path: Path) -> None:
    """Both workers share one port; a killed one comes back; SIGHUP and SIGTERM reach both."""
    gateway = GatewayProcess(tmp_path, CONFIG, supervised=True).start()
    try:
        workers = dict(gateway.workers)
        assert sorted(workers) == [0, 1]
        node = (tmp_path / "data" / "node-id").read_text().strip()
        assert [workers[index].node for index in (0, 1)] == [f"{node}-0", f"{node}-1"]
        assert workers[0].addresses["hub"] == workers[1].addresses["hub"]
        assert workers[0].addresses["admin"] != workers[1].addresses["admin"]
        assert (tmp_path / "data" / "worker-0").is_dir()
        assert (tmp_path / "data" / "worker-1").is_dir()

        counts = _spread(gateway)
        assert all(count > 0 for count in counts.values()), counts

        killed = workers[1].pid
        os.kill(killed, signal.SIGKILL)
        gateway.wait_for_log(rf"worker 1 \(node {node}-1, pid {killed}\) ended by signal 9")
        again = gateway.wait_for_worker(1, not_pid=killed, timeout=RESTART_SECONDS)
        assert again.addresses["hub"] == workers[0].addresses["hub"]
        counts = _spread(gateway)
        assert all(count > 0 for count in counts.values()), counts

        (tmp_path / "routes" / "weather.toml").write_text(ROUTE)
        gateway.signal(signal.SIGHUP)
        gateway.wait_for_log(r"reload: SIGHUP passed on to 2 worker\(s\)")
        gateway.wait_for_log_count("reload: 1 route(s) in effect", 2, timeout=10)
        assert _routes(gateway, 0) == ["weather"]
        assert _routes(gateway, 1) == ["weather"]

        pids = [gateway.workers[index].pid for index in (0, 1)]
        gateway.signal(signal.SIGTERM)
        status = gateway.wait(GRACE_SECONDS + 10)
    finally:
        gateway.stop()
    output = gateway.output()
    assert status in (0, -signal.SIGTERM), output
    assert "msggateway supervisor stopped in" in output
    assert "killing" not in output, output
    assert "#critical]" not in output, output
    assert all(_gone(pid) for pid in pids), output
