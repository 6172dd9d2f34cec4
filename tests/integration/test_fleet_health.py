"""A fleet node's health and its configuration check, with real gateways and RabbitMQ.

Two ``twistd msggateway`` nodes on the session's RabbitMQ node, on a
virtual host of this module's own. Node ``gw-a`` reaches RabbitMQ through
a TCP relay of the test's (`Cuttable`), which can cut it off (close its
connections, and every new one at once) and let it back. Node ``gw-b``
runs another configuration (one listener setting differs).

Checked: each node logs the other's other configuration once and counts
it (``msggateway_fleet_config_mismatch``), with ``msggateway_fleet_nodes``
and the node id in ``msggateway_node_info``; ``/healthz`` of the node cut
off stays 200 up to ``unhealthy_after_seconds`` and turns 503, with the
reason, after it; and 200 again once RabbitMQ is back.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Final

import pytest

from tests.integration.harness import GatewayProcess
from tests.rabbitmq import RabbitMQNode

pytestmark = pytest.mark.integration

UNHEALTHY_AFTER_SECONDS: Final = 2.0
CONFIG: Final = """
[gateway]
data_dir = "data"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[fleet]
node = "{node}"
amqp = "tcp:host=127.0.0.1:port={amqp_port}"
vhost = "{vhost}"
heartbeat_seconds = 2
unhealthy_after_seconds = {unhealthy_after}

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
max_unconfirmed = {max_unconfirmed}
"""


class Cuttable:
    """A TCP relay to ``target`` on 127.0.0.1 that the test can cut and restore.

    Cut, it closes the connections it relays and every new one as soon as
    it is accepted: the gateway behind it has lost RabbitMQ, and cannot
    reconnect, until it is restored.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = True
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(source, sink)

    def _drop(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def cut(self) -> None:
        """Close every relayed connection, and each new one from now on."""
        self._open = False
        with self._lock:
            sockets = list(self._sockets)
        self._drop(*sockets)

    def restore(self) -> None:
        """Relay new connections again."""
        self._open = True

    def close(self) -> None:
        """Stop listening and cut."""
        self._listener.close()
        self.cut()


@pytest.fixture(scope="module")
def fleet(
    rabbitmq: RabbitMQNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess, Cuttable]]:
    """``gw-a`` through a `Cuttable`, ``gw-b`` with another configuration, on their own vhost."""
    vhost = f"fleet-health-{secrets.token_hex(4)}"
    rabbitmq.rabbitmqctl("add_vhost", vhost)
    rabbitmq.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    relay = Cuttable(("127.0.0.1", rabbitmq.amqp_port))
    directory = tmp_path_factory.mktemp("fleet-health")
    started: list[GatewayProcess] = []
    try:
        for node, port, max_unconfirmed in (
            ("gw-a", relay.port, 50_000),
            ("gw-b", rabbitmq.amqp_port, 10_000),
        ):
            config = CONFIG.format(
                node=node,
                amqp_port=port,
                vhost=vhost,
                unhealthy_after=UNHEALTHY_AFTER_SECONDS,
                max_unconfirmed=max_unconfirmed,
            )
            started.append(GatewayProcess(directory / node, config).start())
        a, b = started
        a.wait_for_log("fleet: node gw-b joined")
        b.wait_for_log("fleet: node gw-a joined")
        yield a, b, relay
    finally:
        for process in started:
            process.stop()
        relay.close()
        rabbitmq.rabbitmqctl("delete_vhost", vhost)


def healthz(process: GatewayProcess) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the node's ``/healthz``."""
    host, port = process.address("admin")
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metric(process: GatewayProcess, pattern: str) -> float:
    """The value of the one sample whose line matches ``pattern`` (a regex)."""
    lines = [line for line in process.metrics().splitlines() if re.match(pattern, line)]
    assert len(lines) == 1, (pattern, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_another_configuration_is_logged_once_and_counted(
    fleet: tuple[GatewayProcess, GatewayProcess, Cuttable],
) -> None:
    """Each node names the other's other configuration, once; the gauges say so."""
    a, b, _ = fleet
    for process, other in ((a, "gw-b"), (b, "gw-a")):
        process.wait_for_log(f"fleet: node {other} runs another configuration than node")
        time.sleep(2.5)  # another announcement: not logged again
        assert process.output().count(f"fleet: node {other} runs another configuration") == 1
        assert metric(process, r"msggateway_fleet_config_mismatch ") == 1
        assert metric(process, r"msggateway_fleet_nodes ") == 2
    assert metric(a, r'msggateway_node_info\{node="gw-a"\}') == 1
    status, body = healthz(a)
    assert status == 200
    assert body["fleet"]["config_mismatch"] == ["gw-b"]
    assert body["fleet"]["nodes"] == ["gw-a", "gw-b"]


def test_healthz_turns_503_after_the_configured_time_without_rabbitmq(
    fleet: tuple[GatewayProcess, GatewayProcess, Cuttable],
) -> None:
    """Cut off: 200 for ``unhealthy_after_seconds``, then 503 with the reason; back: 200."""
    a, _, relay = fleet
    status, body = healthz(a)
    assert status == 200 and body["fleet"]["connected"] is True
    relay.cut()
    cut_at = time.monotonic()
    a.wait_for_log("fleet: node gw-a lost RabbitMQ")
    while True:
        status, body = healthz(a)
        elapsed = time.monotonic() - cut_at
        if status == 503:
            break
        assert status == 200, body
        assert elapsed < UNHEALTHY_AFTER_SECONDS + 3, "still healthy long after the threshold"
        time.sleep(0.1)
    assert elapsed >= UNHEALTHY_AFTER_SECONDS - 0.05  # the log line came a little after the cut
    assert body["status"] == "unavailable"
    assert body["reason"].startswith("no connection to RabbitMQ for ")
    assert body["reason"].endswith(f"unhealthy_after_seconds = {UNHEALTHY_AFTER_SECONDS:g})")
    assert body["fleet"]["connected"] is False
    relay.restore()
    deadline = time.monotonic() + 10
    while healthz(a)[0] != 200:
        assert time.monotonic() < deadline, "not healthy again 10 s after RabbitMQ came back"
        time.sleep(0.1)
    a.wait_for_log("fleet: node gw-a reconnected to RabbitMQ")
