"""The SSMP hub across gateway nodes, on a real three-node RabbitMQ cluster (issue 23, part 3).

Three ``twistd msggateway`` processes (`GatewayProcess`), each a node of one
fleet whose ``[fleet] amqp`` lists the cluster's three AMQP endpoints, each
starting at another one, so that the gateways sit on different RabbitMQ
nodes and what crosses them crosses the cluster too. Clients are plain
sockets (`LineClient`). Checked: MCAST, BCAST, UCAST and 404, presence order
and LOGIN takeover across nodes; a hypothesis property on random
subscribe/unsubscribe/publish interleavings (per-sender order, at most
once); ``kill -9`` of a gateway (its bindings go: UCAST to its peers is 404
within 1 s); and ``kill -9`` of the RabbitMQ node a gateway is connected to
(it reconnects to another within 5 s, declares its queue and bindings
again, and the gap is logged and counted).

Bindings take effect a broker round trip after a SUBSCRIBE's 200: tests
wait for them by probing (`until_bound`), never by sleeping.

The cluster costs 15-20 s to form: one per module, shared (the test that
kills a RabbitMQ node starts it again).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import GatewayProcess, LineClient, start_rabbitmq
from tests.rabbitmq import RabbitMQCluster

pytestmark = pytest.mark.integration

CONFIG: Final = """
[gateway]
data_dir = "data"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[fleet]
node = "{node}"
amqp = [{endpoints}]
heartbeat_seconds = 2

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
anonymous = true
"""
CONNECTED: Final = r"fleet: node {node} connected to RabbitMQ"
BOUND_SECONDS: Final = 5.0
"""How long a binding may take to work (a broker round trip; seconds only when broken)."""
PROBE_SECONDS: Final = 0.1


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitMQCluster]:
    """Three private RabbitMQ nodes on loopback in one cluster, for the whole module."""
    cluster = RabbitMQCluster(3)
    start_rabbitmq(cluster.start, "a RabbitMQ cluster", "the RabbitMQ cluster did not form")
    try:
        yield cluster
    finally:
        cluster.stop()


def start_gateway(cluster: RabbitMQCluster, directory: Path, index: int) -> GatewayProcess:
    """Gateway node ``gw<index>``, its endpoint list starting at cluster node ``index``."""
    nodes = cluster.nodes[index:] + cluster.nodes[:index]
    endpoints = ", ".join(f'"tcp:host=127.0.0.1:port={node.amqp_port}"' for node in nodes)
    node = f"gw{index}"
    process = GatewayProcess(
        directory / node, CONFIG.format(node=node, endpoints=endpoints)
    ).start()
    process.wait_for_log(CONNECTED.format(node=node))
    return process


@pytest.fixture
def gateways(cluster: RabbitMQCluster, tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    """Three gateway nodes of one fleet, each on another RabbitMQ node; stopped after the test."""
    cluster.start_stopped()
    started: list[GatewayProcess] = []
    try:
        for index in range(3):
            started.append(start_gateway(cluster, tmp_path, index))
        yield started
    finally:
        for process in started:
            process.stop()


@contextlib.contextmanager
def client(process: GatewayProcess, identity: str) -> Iterator[LineClient]:
    """A client logged in (``open``) to a gateway's hub; closed after the block."""
    with LineClient(process.address("hub")) as line_client:
        line_client.send(f"LOGIN {identity} open")
        line_client.expect("200")
        yield line_client


def read_line_within(peer: LineClient, seconds: float) -> bytes | None:
    """The next line if one comes within ``seconds``, else None."""
    peer.sock.settimeout(seconds)
    try:
        return peer.read_line()
    except TimeoutError:
        return None
    finally:
        peer.sock.settimeout(10.0)


_probes = itertools.count()


def until_bound(sender: LineClient, receiver: LineClient, topic: str) -> None:
    """Send probes to ``topic`` until ``receiver`` gets one; then drop the probes still coming.

    A probe's 200 is read by the sender; the receiver's probe lines are
    consumed, up to a last marker that is sent once one arrived.
    """
    deadline = time.monotonic() + BOUND_SECONDS
    while True:
        assert time.monotonic() < deadline, f"{topic} not bound within {BOUND_SECONDS} s"
        sender.send(f"MCAST {topic} probe-{next(_probes)}")
        sender.expect("200")
        line = read_line_within(receiver, PROBE_SECONDS)
        if line is not None:
            assert b" probe-" in line, line
            break
    marker = f"probe-end-{next(_probes)}"
    sender.send(f"MCAST {topic} {marker}")
    sender.expect("200")
    while not receiver.read_line().endswith(marker.encode()):
        pass


def test_mcast_bcast_ucast_across_nodes(gateways: list[GatewayProcess]) -> None:
    """MCAST and BCAST reach each peer of the fleet once; UCAST is 200 there, 404 nowhere."""
    a, b, c = gateways
    with (
        client(a, "alice") as alice,
        client(b, "bob") as bob,
        client(c, "carol") as carol,
    ):
        alice.send("SUBSCRIBE news", "SUBSCRIBE chat")
        alice.expect("200")
        alice.expect("200")
        carol.send("SUBSCRIBE chat")
        carol.expect("200")
        bob.send("SUBSCRIBE news", "SUBSCRIBE chat")
        bob.expect("200")
        bob.expect("200")
        until_bound(bob, alice, "news")
        until_bound(bob, carol, "chat")
        until_bound(carol, alice, "chat")
        until_bound(alice, bob, "news")
        bob.send("MCAST news one", "MCAST news two", "BCAST all of you", "UCAST alice psst")
        for _ in range(4):
            bob.expect("200")
        alice.expect("000 bob MCAST news one")
        alice.expect("000 bob MCAST news two")
        alice.expect("000 bob BCAST all of you")  # once, though alice shares two topics
        alice.expect("000 bob UCAST alice psst")
        carol.expect("000 bob BCAST all of you")
        bob.send("UCAST nobody hello")
        bob.expect_code(404)
        carol.sync()
        alice.sync()  # nothing else came


def test_presence_order_across_nodes(gateways: list[GatewayProcess]) -> None:
    """The initial batch names subscribers on other nodes; later events keep the spec's order."""
    a, b, c = gateways
    with client(a, "watcher") as watcher, client(b, "bob") as bob, client(c, "carol") as carol:
        bob.send("SUBSCRIBE room")
        bob.expect("200")
        until_bound(carol, bob, "room")
        watcher.send("SUBSCRIBE room PRESENCE")
        watcher.expect("200")
        watcher.expect("000 bob SUBSCRIBE room")
        carol.send("SUBSCRIBE room")
        carol.expect("200")
        watcher.expect("000 carol SUBSCRIBE room")
        bob.send("UNSUBSCRIBE room")
        bob.expect("200")
        watcher.expect("000 bob UNSUBSCRIBE room")
        carol.send("CLOSE")
        carol.expect("200")
        watcher.expect("000 carol UNSUBSCRIBE room")


def test_login_elsewhere_closes_the_older_connection(gateways: list[GatewayProcess]) -> None:
    """A LOGIN on one node closes the identity's older connection on another (spec)."""
    a, b, c = gateways
    with client(a, "alice") as old, client(c, "bob") as bob:
        old.sync()
        with client(b, "alice") as new:
            old.expect_closed()
            deadline = time.monotonic() + BOUND_SECONDS
            while True:  # the new login's binding, then the old one's removal
                bob.send("UCAST alice hi")
                answer = bob.read_line()
                line = read_line_within(new, PROBE_SECONDS) if answer == b"200" else None
                if line == b"000 bob UCAST alice hi":
                    break
                assert time.monotonic() < deadline, answer
            assert a.wait_for_log(r"alice logged in on node gw1; closing its older connection")


def test_kill_9_of_a_gateway_takes_its_bindings(gateways: list[GatewayProcess]) -> None:
    """A gateway killed with SIGKILL: UCAST to its peers answers 404 within 1 s."""
    a, b, _ = gateways
    with client(a, "alice") as alice, client(b, "bob") as bob:
        alice.sync()
        deadline = time.monotonic() + BOUND_SECONDS
        while True:
            bob.send("UCAST alice ping")
            if bob.read_line() == b"200":
                break
            assert time.monotonic() < deadline
        alice.read_line()
        a.kill()
        killed = time.monotonic()
        while True:
            bob.send("UCAST alice anyone")
            answer = bob.read_line()
            if answer.startswith(b"404"):
                break
            assert answer == b"200", answer
            assert time.monotonic() - killed < 1.0, "still routed 1 s after the kill"
        assert time.monotonic() - killed < 1.0


def _metric(process: GatewayProcess, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", process.metrics(), re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_kill_9_of_the_rabbitmq_node_a_gateway_uses(
    cluster: RabbitMQCluster, gateways: list[GatewayProcess]
) -> None:
    """The gateway reconnects to another RabbitMQ node within 5 s and is reachable again."""
    a, b, _ = gateways
    with client(a, "alice") as alice, client(b, "bob") as bob:
        alice.send("SUBSCRIBE news")
        alice.expect("200")
        until_bound(bob, alice, "news")
        cluster.nodes[0].stop_broker(graceful=False)  # a's RabbitMQ node
        killed = time.monotonic()
        a.wait_for_log(r"fleet: node gw0 reconnected to RabbitMQ .* after a gap of", timeout=5.0)
        assert time.monotonic() - killed < 5.0
        until_bound(bob, alice, "news")  # its queue and bindings are declared again
        assert time.monotonic() - killed < 5.0 + BOUND_SECONDS
        bob.send("UCAST alice back")
        bob.expect("200")
        alice.expect("000 bob UCAST alice back")
        assert _metric(a, "msggateway_fleet_backbone_reconnects_total") == 1
        assert _metric(a, "msggateway_fleet_backbone_gap_seconds_total") > 0
        assert _metric(a, "msggateway_fleet_backbone_connected") == 1
    cluster.start_stopped()


# --- the property: random interleavings over three real nodes -------------------------------

_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["sub", "unsub", "pub", "pub", "pub"]),
        st.integers(0, 5),
        st.sampled_from(["x", "y"]),
    ),
    min_size=5,
    max_size=40,
)


@pytest.mark.timeout(300)
def test_random_interleavings_across_nodes(cluster: RabbitMQCluster, tmp_path: Path) -> None:
    """Random SUBSCRIBE/UNSUBSCRIBE/MCAST over three nodes: per-sender order, at most once."""
    cluster.start_stopped()
    processes = [start_gateway(cluster, tmp_path, index) for index in range(3)]
    try:
        _interleavings(processes)
    finally:
        for process in processes:
            process.stop()


def _interleavings(processes: list[GatewayProcess]) -> None:
    run = itertools.count()

    @settings(
        max_examples=8,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(actions=_ACTIONS)
    def check(actions: list[tuple[str, int, str]]) -> None:
        prefix = f"r{next(run)}"
        with contextlib.ExitStack() as stack:
            peers = [
                stack.enter_context(client(processes[index % 3], f"{prefix}p{index}"))
                for index in range(6)
            ]
            subscribed: list[set[str]] = [set() for _ in peers]
            answers = [0] * len(peers)
            sent = 0
            for action, index, topic in actions:
                name = f"{prefix}{topic}"
                if action == "sub" and topic not in subscribed[index]:
                    peers[index].send(f"SUBSCRIBE {name}")
                    subscribed[index].add(topic)
                elif action == "unsub" and topic in subscribed[index]:
                    peers[index].send(f"UNSUBSCRIBE {name}")
                    subscribed[index].discard(topic)
                elif action.startswith("pub"):
                    peers[index].send(f"MCAST {name} {index}.{sent}")
                    sent += 1
                else:
                    continue
                answers[index] += 1
            got: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
            for who, peer in enumerate(peers):
                peer.send("PING")
                left = answers[who]
                pong = False
                # Its answers (a SUBSCRIBE's once its node's binding is in
                # place), the PONG (an event: at once), what came meanwhile.
                while not pong or left > 0:
                    line = peer.read_line()
                    if line == b"000 . PONG":
                        pong = True
                    elif not line.startswith(b"000 "):  # a response, not an event
                        left -= 1
                    else:
                        _record(got[who], line)
                assert left == 0
            for who, peer in enumerate(peers):  # what is still on its way
                while (late := read_line_within(peer, 0.3)) is not None:
                    _record(got[who], late)
            for per_sender in got.values():
                for sequence in per_sender.values():
                    assert sequence == sorted(sequence), "per-sender order"
                    assert len(sequence) == len(set(sequence)), "at most once"

    check()


def _record(got: dict[int, list[int]], line: bytes) -> None:
    """Note an MCAST event ``000 <id> MCAST <topic> <sender>.<seq>`` by sender."""
    if b" MCAST " not in line:
        return
    sender, seq = (int(part) for part in line.rsplit(b" ", 1)[1].split(b"."))
    got[sender].append(seq)
