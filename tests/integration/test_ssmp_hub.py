"""The SSMP hub end to end: a real twistd process driven with plain sockets.

One gateway process serves the whole module (identities and topics are
unique per test); tests that need other settings start their own.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.gateway_proc import metric
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["secret", "open"]
anonymous = true
login_timeout_seconds = 1
"""

SECRETS = """
[logins]
sam = "sesame"
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with an open/secret/anonymous SSMP hub, for the whole module."""
    process = GatewayProcess(tmp_path_factory.mktemp("hub"), CONFIG, secrets=SECRETS).start()
    yield process
    process.stop()


def login(gateway: GatewayProcess, identity: str, scheme: str = "open") -> LineClient:
    """Connect and log in; return the client after its 200."""
    client = LineClient(gateway.address("hub"))
    client.send(f"LOGIN {identity} {scheme}")
    client.expect("200")
    return client


# --- login ---------------------------------------------------------------------


def test_open_login_gets_200_without_payload(gateway: GatewayProcess) -> None:
    """LOGIN with the open scheme succeeds with a bare 200 (spec: no payload)."""
    with LineClient(gateway.address("hub")) as client:
        client.send("LOGIN olga open ignored credential")
        assert client.read_line() == b"200"


def test_secret_login(gateway: GatewayProcess) -> None:
    """The secret scheme checks the secrets file."""
    with LineClient(gateway.address("hub")) as client:
        client.send("LOGIN sam secret sesame")
        client.expect("200")


def test_wrong_secret_gets_401_with_schemes_and_close(gateway: GatewayProcess) -> None:
    """A failed login gets 401 listing the supported schemes, then the close."""
    with LineClient(gateway.address("hub")) as client:
        client.send("LOGIN sam secret wrong")
        assert client.read_line() == b"401 open secret"
        assert client.expect_closed() == b""


def test_unsupported_scheme_gets_401(gateway: GatewayProcess) -> None:
    """The cert scheme is not offered on a plain TCP listener: 401 and close."""
    with LineClient(gateway.address("hub")) as client:
        client.send("LOGIN sam cert")
        assert client.read_line() == b"401 open secret"
        client.expect_closed()


def test_first_request_must_be_login(gateway: GatewayProcess) -> None:
    """Anything before LOGIN gets 400 and the connection is closed."""
    with LineClient(gateway.address("hub")) as client:
        client.send("SUBSCRIBE news")
        client.expect_code(400)
        assert client.expect_closed() == b""


def test_second_login_gets_405(gateway: GatewayProcess) -> None:
    """After a successful LOGIN, another LOGIN is refused with 405."""
    with login(gateway, "twice") as client:
        client.send("LOGIN twice open")
        client.expect_code(405)
        client.sync()


def test_login_timeout_closes_without_response(gateway: GatewayProcess) -> None:
    """No request within the login time-out: closed without any response."""
    with LineClient(gateway.address("hub")) as client:
        client.send_raw(b"LOGIN slow")  # never completed
        assert client.expect_closed() == b""


def test_same_identity_closes_the_older_connection(gateway: GatewayProcess) -> None:
    """A second login with an identity closes the first, with UNSUBSCRIBE events."""
    with login(gateway, "watcher1") as watcher, login(gateway, "dup") as first:
        watcher.send("SUBSCRIBE dup.topic PRESENCE")
        watcher.expect("200")
        first.send("SUBSCRIBE dup.topic")
        first.expect("200")
        watcher.expect("000 dup SUBSCRIBE dup.topic")
        with login(gateway, "dup") as second:
            assert first.expect_closed() == b""
            watcher.expect("000 dup UNSUBSCRIBE dup.topic")
            second.sync()


# --- subscriptions and presence ---------------------------------------------------


def test_subscribe_twice_409_and_unsubscribe_unknown_404(gateway: GatewayProcess) -> None:
    """SUBSCRIBE twice gets 409; UNSUBSCRIBE of a topic not subscribed gets 404."""
    with login(gateway, "subber") as client:
        client.send("SUBSCRIBE s.t", "SUBSCRIBE s.t", "UNSUBSCRIBE s.t", "UNSUBSCRIBE s.t")
        client.expect("200")
        client.expect_code(409)
        client.expect("200")
        client.expect_code(404)


def test_presence_initial_batch_and_changes(gateway: GatewayProcess) -> None:
    """PRESENCE gives the current subscribers, then SUBSCRIBE/UNSUBSCRIBE events."""
    with login(gateway, "p1") as p1, login(gateway, "p2") as p2:
        p1.send("SUBSCRIBE room PRESENCE")
        p1.expect("200")
        p2.send("SUBSCRIBE room")
        p2.expect("200")
        p1.expect("000 p2 SUBSCRIBE room")
        with login(gateway, "p3") as p3:
            p3.send("SUBSCRIBE room PRESENCE")
            p3.expect("200")
            batch = sorted(p3.read_lines(2))
            assert batch == [b"000 p1 SUBSCRIBE room PRESENCE", b"000 p2 SUBSCRIBE room"]
            p1.expect("000 p3 SUBSCRIBE room PRESENCE")
        # p3 went away: the others with PRESENCE learn it.
        p1.expect("000 p3 UNSUBSCRIBE room")
        p2.send("UNSUBSCRIBE room")
        p2.expect("200")
        p1.expect("000 p2 UNSUBSCRIBE room")


# --- messages ----------------------------------------------------------------------


def test_mcast_fans_out_and_is_not_echoed(gateway: GatewayProcess) -> None:
    """MCAST reaches every subscriber but its sender; no 404 without subscribers."""
    with login(gateway, "m1") as m1, login(gateway, "m2") as m2, login(gateway, "m3") as m3:
        for client in (m1, m2):
            client.send("SUBSCRIBE news")
            client.expect("200")
        m1.send("MCAST news hello  world \r\x00\xff".encode("latin-1"))
        m1.expect("200")
        m2.expect("000 m1 MCAST news hello  world \r\x00\xff".encode("latin-1"))
        m3.send("MCAST nobody.listens x")
        m3.expect("200")
        m1.sync()  # an echo would have come before the PONG


def test_anonymous_may_publish_only(gateway: GatewayProcess) -> None:
    """Anonymous peers publish but get 405 for SUBSCRIBE, UNSUBSCRIBE, BCAST, UCAST to '.'."""
    with login(gateway, "listener.a") as listener, login(gateway, ".") as anon:
        listener.send("SUBSCRIBE anon.news")
        listener.expect("200")
        anon.send("MCAST anon.news from nobody")
        anon.expect("200")
        listener.expect("000 . MCAST anon.news from nobody")
        anon.send("SUBSCRIBE t", "UNSUBSCRIBE t", "BCAST hi")
        for _ in range(3):
            anon.expect_code(405)
        listener.send("UCAST . hi")
        listener.expect_code(405)
        with login(gateway, ".") as anon2:  # several anonymous peers at once
            anon2.sync()
        anon.sync()


def test_ucast(gateway: GatewayProcess) -> None:
    """UCAST reaches the named peer; an unknown peer gets 404."""
    with login(gateway, "u1") as u1, login(gateway, "u2") as u2:
        u1.send("UCAST u2 psst", "UCAST nobody-here psst")
        u1.expect("200")
        u1.expect_code(404)
        u2.expect("000 u1 UCAST u2 psst")


def test_bcast_reaches_each_peer_once(gateway: GatewayProcess) -> None:
    """BCAST goes once to every peer sharing at least one topic, not to the sender."""
    with login(gateway, "b1") as b1, login(gateway, "b2") as b2, login(gateway, "b3") as b3:
        b1.send("SUBSCRIBE bt1", "SUBSCRIBE bt2")
        b2.send("SUBSCRIBE bt1", "SUBSCRIBE bt2")
        b3.send("SUBSCRIBE bt3")
        for client in (b1, b1, b2, b2, b3):
            client.expect("200")
        b1.send("BCAST hi all")
        b1.expect("200")
        b2.expect("000 b1 BCAST hi all")
        b2.sync()  # a duplicate would have come before the PONG
        b3.sync()  # b3 shares no topic: nothing came before the PONG
        b1.sync()


def test_ping_close_and_unknown_verb(gateway: GatewayProcess) -> None:
    """PING gets 000 . PONG, an unknown verb 501, CLOSE 200 and the close."""
    with login(gateway, "pc") as client:
        client.send("PING", "FROBNICATE x y z", "PONG", "CLOSE")
        client.expect("000 . PONG")
        client.expect_code(501)
        client.expect("200")
        assert client.expect_closed() == b""


def test_order_and_at_most_once(gateway: GatewayProcess) -> None:
    """Many pipelined MCASTs from one sender arrive once each, in order."""
    count = 2000
    with login(gateway, "o1") as sender, login(gateway, "o2") as receiver:
        receiver.send("SUBSCRIBE ordered")
        receiver.expect("200")
        sender.send(*(f"MCAST ordered {i}" for i in range(count)))
        assert sender.read_lines(count) == [b"200"] * count
        got = receiver.read_lines(count)
        assert got == [b"000 o1 MCAST ordered %d" % i for i in range(count)]
        receiver.sync()


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"SUBSCRIBE bad#topic\n",
        b"\x00\xff\xfe\x80 binary\n",
        b"\n",
        b"subscribe lower\n",
        b"MCAST topic-without-payload\n",
        b"MCAST news " + b"x" * 1100 + b"\n",
    ],
    ids=["bad-id", "binary", "empty", "lower-case", "no-payload", "too-long"],
)
def test_bad_input_gets_400_and_close_others_unaffected(
    gateway: GatewayProcess, garbage: bytes
) -> None:
    """Malformed requests get 400 and a close; other connections keep working."""
    with login(gateway, "bystander") as bystander, login(gateway, "culprit") as culprit:
        culprit.send_raw(garbage)
        culprit.expect_code(400)
        assert culprit.expect_closed() == b""
        bystander.sync()


def test_line_limit_counts_the_lf(gateway: GatewayProcess) -> None:
    """A 1,024-byte line (LF included) is fine; a 1,025-byte one is refused."""
    with login(gateway, "limit") as client:
        topic = "t" * (1024 - len("SUBSCRIBE ") - 1)
        client.send(f"SUBSCRIBE {topic}")
        client.expect("200")
        client.send(f"SUBSCRIBE {topic}x")
        client.expect_code(400)
        client.expect_closed()


def test_oversized_line_refused_before_its_end(gateway: GatewayProcess) -> None:
    """An over-long line is refused as soon as it passes the limit, LF or not."""
    with login(gateway, "endless") as client:
        client.send_raw(b"MCAST news " + b"y" * 2000)  # no LF, ever
        client.expect_code(400)
        client.expect_closed()


# --- operations ----------------------------------------------------------------------------


def test_admin_health_and_metrics(gateway: GatewayProcess) -> None:
    """The admin endpoint reports health and Prometheus metrics of the hub."""
    host, port = gateway.address("admin")
    with login(gateway, "metered") as client:
        client.send("SUBSCRIBE meter")
        client.expect("200")
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10) as response:
            health = json.load(response)
        assert health["status"] == "ok"
        assert health["listeners"]["hub"] == {"listening": True}
        text = gateway.metrics()
    assert 'msggateway_connections{endpoint="hub",protocol="ssmp"}' in text
    assert 'msggateway_protocol_errors_total{endpoint="hub",kind="unauthorized"}' in text


def test_server_pings_and_closes_without_pong(tmp_path: Path) -> None:
    """The hub PINGs an idle peer and closes it when no PONG comes."""
    config = CONFIG.replace(
        "login_timeout_seconds = 1",
        "ping_interval_seconds = 0.3\npong_timeout_seconds = 0.3",
    )
    process = GatewayProcess(tmp_path, config, secrets=SECRETS).start()
    try:
        with login(process, "idle") as client:
            client.expect("000 . PING")
            client.send("PONG")
            client.expect("000 . PING")  # answered: still connected, pinged again
            assert client.expect_closed() == b""  # not answered: closed
    finally:
        process.stop()


BURST_MESSAGES = 40_000
"""Per publisher: two of them, unpaced, 100-byte payloads (8 MB through one subscriber)."""


def _publish(gateway: GatewayProcess, name: str, count: int, answers: list[int]) -> None:
    """MCAST ``count`` 100-byte messages on ``burst`` unpaced, then count the 200s."""
    client = login(gateway, name)
    sender = threading.Thread(
        target=client.send_raw, args=((b"MCAST burst " + b"p" * 100 + b"\n") * count,)
    )
    sender.start()
    answers.append(sum(line == b"200" for line in client.read_lines(count)))
    sender.join()
    client.sock.close()


def test_a_healthy_subscriber_misses_nothing_of_a_burst(tmp_path: Path) -> None:
    """Two unpaced publishers, one subscriber reading as fast as it can: every 200 is delivered.

    The publishers are faster than the subscriber; the hub holds them while
    it is congested instead of cutting it off (the loss of the slow-consumer
    cap: issue 22 measured 3% delivered).
    """
    process = GatewayProcess(tmp_path, CONFIG, secrets=SECRETS).start()
    try:
        subscriber = login(process, "sub")
        subscriber.send("SUBSCRIBE burst")
        subscriber.expect("200")
        answers: list[int] = []
        publishers = [
            threading.Thread(target=_publish, args=(process, f"pub{n}", BURST_MESSAGES, answers))
            for n in range(2)
        ]
        for publisher in publishers:
            publisher.start()
        received = 0
        while received < 2 * BURST_MESSAGES:
            line = subscriber.read_line()
            assert line.startswith((b"000 pub0 MCAST burst ", b"000 pub1 MCAST burst ")), line
            received += 1
        for publisher in publishers:
            publisher.join(60)
        assert answers == [BURST_MESSAGES, BURST_MESSAGES]
        disconnects = "msggateway_slow_consumer_disconnects_total"
        assert metric(process.metrics(), disconnects, endpoint="hub") == 0
    finally:
        process.stop()


def test_a_stuck_subscriber_holds_its_publisher_briefly_then_is_cut(tmp_path: Path) -> None:
    """A subscriber that never reads: its publisher waits about ``slow_consumer_seconds``."""
    config = CONFIG.replace("login_timeout_seconds = 1", "slow_consumer_seconds = 1")
    process = GatewayProcess(tmp_path, config, secrets=SECRETS).start()
    try:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(process.address("hub"))
        stuck.sendall(b"LOGIN stuck open\nSUBSCRIBE burst\n")
        publisher = login(process, "pub")
        publisher.send("SUBSCRIBE sync")  # its 200 comes after the stuck one's SUBSCRIBE
        publisher.expect("200")
        answers: list[int] = []
        _publish(process, "pub2", 20_000, answers)  # 2 MB: far past every buffer on the way
        assert answers == [20_000]
        process.wait_for_log("slow consumer")
        disconnects = "msggateway_slow_consumer_disconnects_total"
        assert metric(process.metrics(), disconnects, endpoint="hub") == 1
        publisher.sock.close()
        stuck.close()
    finally:
        process.stop()


def test_slow_subscriber_is_disconnected(tmp_path: Path) -> None:
    """``disconnect``: a subscriber that stops reading is cut off; the publisher is unaffected."""
    config = CONFIG.replace(
        "login_timeout_seconds = 1",
        'max_backlog_bytes = 65536\nslow_consumer_policy = "disconnect"',
    )
    process = GatewayProcess(tmp_path, config, secrets=SECRETS).start()
    try:
        with login(process, "watcher") as watcher, login(process, "flooder") as flooder:
            watcher.send("SUBSCRIBE flood PRESENCE")
            watcher.expect("200")
            slow = socket.socket()
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow.connect(process.address("hub"))
            slow.sendall(b"LOGIN slow open\nSUBSCRIBE flood\n")
            watcher.expect("000 slow SUBSCRIBE flood")  # the slow peer is in
            watcher.send("UNSUBSCRIBE flood")
            watcher.expect("200")
            payload = "z" * 900
            disconnected = False
            for _ in range(40):  # at most 40 x 250 x 900 B = 9 MB
                flooder.send(*(f"MCAST flood {payload}" for _ in range(250)))
                assert flooder.read_lines(250) == [b"200"] * 250
                gone = 'msggateway_slow_consumer_disconnects_total{endpoint="hub"} 1.0'
                if gone in process.metrics():
                    disconnected = True
                    break
            assert disconnected, "the slow subscriber is still connected after 10,000 messages"
            flooder.sync()
        slow.settimeout(10)
        try:  # drain what the kernel buffered; then EOF or reset, never a time-out
            while slow.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
        slow.close()
        process.wait_for_log("slow consumer")
    finally:
        process.stop()
