"""DMP across nodes, on a real RabbitMQ node (the session's `rabbitmq`; issue 23, part 6).

Two ``twistd msggateway`` nodes of one fleet, gw0 and gw1, each with the
DMP listener ``dmp`` (sink ``orders`` routed to feed ``alerts``), the admin
endpoint, a principal ``app``, and the fleet's lease secret. The DMP peers
are the raw-socket ones of test_dmp.py (plain sockets and struct, from the
spec); the principal connection is a raw AMQP 0-9-1 client from the
grammar (the frames of tests/protocols/test_dmp_principal.py on a socket).

Checked: a lease made on one node (``POST /leases``, a principal's
Direct.Get) opens a sink and a feed on the other; a lease revoked on one
node is refused on both within `REVOKED_SECONDS`; a second reader on the
other node is refused while the first reads, and gets the feed once it
left; a sink writer on gw1 whose route goes to the feed read on gw0: every
message delivered once, none lost (DMP has no acknowledgement: counted at
the reader).
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from gateway.codecs.amqp091 import PROTOCOL_HEADER, FrameCodec, Method
from tests.integration.harness import GatewayProcess
from tests.integration.test_dmp import Peer, admin
from tests.protocols.test_dmp_principal import CHANNEL_OPEN, OPEN, TUNE_OK, get, start_ok
from tests.rabbitmq import RabbitMQNode

pytestmark = pytest.mark.integration

CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[fleet]
node = "{node}"
amqp = ["tcp:host=127.0.0.1:port={amqp}"]
heartbeat_seconds = 2

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]
feeds = ["alerts"]
heartbeat_seconds = 1
principals = ["app"]
"""
SECRETS: Final = (
    'admin_token = "t0ken"\n[logins]\napp = "app-pw"\n'
    '[fleet]\nlease_secret = "a-fleet-lease-secret-for-the-tests-0123"\n'
)
ROUTES: Final = {"to-feed": 'from = "dmp"\nmatch = "orders.#"\nto = "dmp"\naddress = "alerts"\n'}
REVOKED_SECONDS: Final = 5.0
"""The bound for a revocation to reach both nodes: a broker round trip, with room."""
FEED_FREE_SECONDS: Final = 5.0
"""The bound for a feed left on one node to be free on the other (unbind, release)."""
MESSAGES: Final = 2000


def start(rabbitmq: RabbitMQNode, directory: Path, node: str) -> GatewayProcess:
    """Node ``node``, once it is connected and has read the fleet's revocations."""
    process = GatewayProcess(
        directory / node,
        CONFIG.format(node=node, amqp=rabbitmq.amqp_port),
        routes=ROUTES,
        secrets=SECRETS,
    ).start()
    process.wait_for_log(f"fleet: node {node} read the fleet's lease revocations")
    return process


@pytest.fixture(scope="module")
def nodes(
    rabbitmq: RabbitMQNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """gw0 and gw1, for the whole module."""
    directory = tmp_path_factory.mktemp("fleet-dmp")
    started: list[GatewayProcess] = []
    try:
        started.append(start(rabbitmq, directory, "gw0"))
        started.append(start(rabbitmq, directory, "gw1"))
        yield started[0], started[1]
    finally:
        for process in started:
            process.stop()


def lease(node: GatewayProcess, kind: str) -> bytes:
    """A lease made with the node's admin API: sink ``orders`` or feed ``alerts``."""
    target = "orders" if kind == "sink" else "alerts"
    status, made = admin(node, "POST", "/leases", {"listener": "dmp", kind: target})
    assert status == 201, made
    return str(made["lease"]).encode("ascii")


def opened(node: GatewayProcess, text: bytes) -> tuple[Peer, bytes]:
    """A DMP connection to the node with ``text``; the lease's answer."""
    peer = Peer(node.address("dmp"))
    answers = peer.open(text)
    assert answers[0] == b"200 OK DMP/0.1"
    return peer, answers[1]


def until(condition: Callable[[], bool], seconds: float) -> float:
    """Poll ``condition`` until it holds; how long that took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - started


def refused(node: GatewayProcess, text: bytes) -> bool:
    """Whether the node answers ``text`` with 402."""
    peer, answer = opened(node, text)
    peer.close()
    return answer.startswith(b"402")


def only_heartbeats(peer: Peer, seconds: float) -> bool:
    """Whether the reader gets nothing but null messages (heartbeats) for ``seconds``."""
    deadline = time.monotonic() + seconds
    data = peer.buffer
    peer.buffer = b""
    while (left := deadline - time.monotonic()) > 0:
        peer.sock.settimeout(left)
        try:
            chunk = peer.sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return False
        data += chunk
    peer.sock.settimeout(10)
    return data.count(0) == len(data) and len(data) % 4 == 0


def principal_lease(node: GatewayProcess, feed: bytes) -> str:
    """A lease for ``feed`` from the node's principal connection: Direct.Get as ``app``."""
    with socket.create_connection(node.address("dmp"), timeout=10) as sock:
        sock.sendall(PROTOCOL_HEADER)
        codec = FrameCodec()
        sent = False
        while True:
            data = sock.recv(65536)
            assert data, "the principal connection closed"
            for event in codec.receive_data(data):
                if not isinstance(event, Method):
                    continue
                if event.name == "connection.start" and not sent:
                    sent = True
                    sock.sendall(
                        start_ok(b"app", b"app-pw") + TUNE_OK + OPEN + CHANNEL_OPEN + get(feed)
                    )
                elif event.name == "direct.get-ok":
                    return str(event.arguments["lease"])
                elif event.name.endswith(".close"):
                    raise AssertionError(f"refused: {event.arguments}")


def test_a_lease_made_on_one_node_opens_the_sink_and_the_feed_on_the_other(
    nodes: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """``POST /leases`` on gw0: gw1 opens the sink and the feed with it; so does a principal's."""
    gw0, gw1 = nodes
    writer, answer = opened(gw1, lease(gw0, "sink"))
    assert answer == b'200 OK Ready to write to "orders"'
    writer.close()
    reader, answer = opened(gw1, lease(gw0, "feed"))
    assert answer == b'200 OK Ready to read from "alerts"'
    reader.close()
    text = principal_lease(gw1, b"alerts").encode("ascii")
    answers: list[bytes] = []

    def free() -> bool:
        answers.append(opened_and_closed(gw0, text))
        return not answers[-1].startswith(b"403")

    # The feed is free on gw0 once gw1 let its lock go (a broker round trip).
    until(free, FEED_FREE_SECONDS)
    assert answers[-1] == b'200 OK Ready to read from "alerts"'


def opened_and_closed(node: GatewayProcess, text: bytes) -> bytes:
    """Open with ``text``, close; the lease's answer."""
    peer, answer = opened(node, text)
    peer.close()
    return answer


def test_a_revoked_lease_is_refused_on_both_nodes(
    nodes: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """``DELETE /leases/TEXT`` on gw1: 402 on gw1 at once, on gw0 within REVOKED_SECONDS."""
    gw0, gw1 = nodes
    text = lease(gw0, "sink")
    assert opened_and_closed(gw1, text) == b'200 OK Ready to write to "orders"'
    status, answer = admin(gw1, "DELETE", f"/leases/{text.decode()}")
    assert status == 200 and answer == {"revoked": True}
    assert refused(gw1, text)
    took = until(lambda: refused(gw0, text), REVOKED_SECONDS)
    assert took < REVOKED_SECONDS
    assert admin(gw0, "DELETE", "/leases/not-a-lease")[0] == 404


def test_a_second_reader_on_the_other_node_is_refused(
    nodes: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """gw0 reads alerts: a reader on gw1 gets 403; once gw0's left, gw1's next reader reads."""
    gw0, gw1 = nodes
    first, answer = opened(gw0, lease(gw0, "feed"))
    assert answer == b'200 OK Ready to read from "alerts"'
    second, answer = opened(gw1, lease(gw1, "feed"))
    assert answer.startswith(b"403 NO-ACCESS") and b"already has a reader" in answer
    assert second.closed()
    second.close()
    first.close()
    text = lease(gw1, "feed")
    answers: list[bytes] = []

    def reads() -> bool:
        peer, answer = opened(gw1, text)
        answers.append(answer)
        if answer.startswith(b"200"):
            peer.close()
            return True
        peer.close()
        return False

    until(reads, FEED_FREE_SECONDS)
    assert answers[-1] == b'200 OK Ready to read from "alerts"'


@pytest.mark.timeout(120)
def test_a_sink_writer_on_one_node_feeds_the_reader_on_the_other(
    nodes: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """A writer on gw1, the route to alerts read on gw0: every message once, none lost."""
    gw0, gw1 = nodes
    feed = lease(gw0, "feed")
    reader: Peer | None = None

    def reading() -> bool:
        nonlocal reader
        peer, answer = opened(gw0, feed)
        if answer.startswith(b"200"):
            reader = peer
            return True
        peer.close()
        return False

    until(reading, FEED_FREE_SECONDS)
    assert reader is not None
    writer, answer = opened(gw1, lease(gw1, "sink"))
    assert answer == b'200 OK Ready to write to "orders"'
    try:
        for number in range(MESSAGES):
            writer.write(b"eu", b"message %d" % number, message_id=b"m%d" % number)
        seen: Counter[str] = Counter()
        order: list[int] = []
        for _ in range(MESSAGES):
            envelope = reader.envelope()
            seen[str(envelope["message_id"])] += 1
            body = envelope["body"]
            assert isinstance(body, bytes)
            order.append(int(body.split()[1]))
        assert seen == Counter(f"m{number}" for number in range(MESSAGES))
        assert order == list(range(MESSAGES))  # one writer, one node: in order
        assert only_heartbeats(reader, 1.5)  # nothing more: no copy came twice
    finally:
        writer.close()
        reader.close()
    metrics = gw1.metrics()
    assert 'msggateway_protocol_errors_total{endpoint="dmp",kind="not-delivered"}' not in metrics
