"""Who may connect to an MTL listener: the ZAP decision, and the listener enforcing it."""

from __future__ import annotations

import ipaddress
from collections.abc import Generator
from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import threads
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, globalLogPublisher
from zmq.utils import z85

from gateway.core.auth import Secrets
from gateway.core.router import Router, RouteTable
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.handshakes import RefusalLog, handshake_failure
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings
from gateway.protocols.mtl.zap import ZAPPolicy, zap_peer, zap_reply
from tests.protocols.test_mtl_curve import SILENCE_MS, raw_dialogue
from tests.protocols.test_mtl_upstream_scram import wait_for

ALICE = zmq.curve_keypair()
MALLORY = zmq.curve_keypair()
SERVED = [201, 200, 202, (1, 200), (2, 200)]


def request(address: bytes, mechanism: bytes = b"NULL", *credentials: bytes) -> list[bytes]:
    """A ZAP 1.0 request (RFC 27) without its envelope."""
    return [b"1.0", b"7", b"msggateway", address, b"", mechanism, *credentials]


def test_empty_policy_allows_everyone() -> None:
    """No lists: every request gets 200 with its request id."""
    reply, refused = zap_reply(request(b"192.0.2.1"), ZAPPolicy())
    assert (reply, refused) == ([b"1.0", b"7", b"200", b"OK", b"", b""], None)


@pytest.mark.parametrize(
    ("address", "allowed"),
    [(b"127.0.0.1", True), (b"10.1.2.3", True), (b"192.0.2.1", False), (b"::1", True)],
)
def test_addresses(address: bytes, allowed: bool) -> None:
    """Only addresses in the allowed networks (IPv4 and IPv6) get 200."""
    policy = ZAPPolicy.from_settings(["127.0.0.0/8", "10.0.0.0/8", "::1/128"], [])
    reply, refused = zap_reply(request(address), policy)
    assert reply[2] == (b"200" if allowed else b"400")
    assert (refused is None) == allowed


def test_curve_keys() -> None:
    """With client keys, only CURVE peers holding one of them get 200."""
    policy = ZAPPolicy.from_settings([], [ALICE[0]])
    assert zap_reply(request(b"127.0.0.1", b"CURVE", z85.decode(ALICE[0])), policy)[1] is None
    _, refused = zap_reply(request(b"127.0.0.1", b"CURVE", z85.decode(MALLORY[0])), policy)
    assert refused == "CURVE key not allowed"
    _, refused = zap_reply(request(b"127.0.0.1", b"NULL"), policy)
    assert refused == "mechanism NULL where CURVE is required"


@pytest.mark.parametrize(
    "frames", [[], [b"2.0", b"1", b"d", b"127.0.0.1", b"", b"NULL"], [b"1.0", b"1"]]
)
def test_not_zap_gets_500(frames: list[bytes]) -> None:
    """A request that is not ZAP 1.0 is answered 500, never a crash."""
    reply, refused = zap_reply(frames, ZAPPolicy.from_settings(["127.0.0.1/32"], []))
    assert reply[2] == b"500" and refused == "not a ZAP 1.0 request"


def test_not_an_ip_address() -> None:
    """An address libzmq could not give as an IP (it always does) is refused, not a crash."""
    policy = ZAPPolicy(networks=(ipaddress.ip_network("127.0.0.0/8"),))
    assert zap_reply(request(b"\xff"), policy)[1] == "address b'\\xff' is not an IP address"


def listener(metrics: GatewayMetrics | None = None, **settings: Any) -> MTLServer:
    """An MTL listener on the test's reactor."""
    from twisted.internet import reactor

    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(ping_interval_seconds=0, **settings),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
        metrics=metrics,
    )
    server.start()
    return server


@pytest_twisted.inlineCallbacks
def test_listener_lets_in_only_allowed_curve_keys() -> Generator[Any, Any, None]:
    """Alice's key gets the whole dialogue on both sockets; Mallory's gets silence."""
    public_key, secret_key = zmq.curve_keypair()
    metrics = GatewayMetrics()
    server = listener(metrics, curve_secret_key=secret_key, curve_client_keys=(ALICE[0],))
    try:
        seen = yield threads.deferToThread(raw_dialogue, server.port, public_key, 10_000, ALICE)
        assert seen == SERVED
        seen = yield threads.deferToThread(
            raw_dialogue, server.port, public_key, SILENCE_MS, MALLORY
        )
        assert seen == ["silence"]
        # Counted by the listener (ZeroMQ may retry the handshake: at least once).
        yield wait_for(
            lambda: bool(
                metrics.registry.get_sample_value(
                    "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": "peer-refused"}
                )
            )
        )
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("networks", "served"), [(("127.0.0.0/8",), True), (("10.0.0.0/8",), False)]
)
@pytest_twisted.inlineCallbacks
def test_listener_lets_in_only_allowed_addresses(
    networks: tuple[str, ...], served: bool
) -> Generator[Any, Any, None]:
    """A plaintext listener serves a loopback peer only if loopback is allowed."""
    server = listener(allow_addresses=networks)
    try:
        seen = yield threads.deferToThread(
            raw_dialogue, server.port, None, 10_000 if served else SILENCE_MS
        )
        assert seen == (SERVED if served else ["silence"])
    finally:
        server.stop()


def test_an_allowed_peer_gets_its_connection_number() -> None:
    """With a number, the 200 reply's metadata carries it as X-Connection (ZMTP properties)."""
    reply, refused = zap_reply(request(b"192.0.2.1"), ZAPPolicy(), 42)
    assert refused is None
    assert reply[5] == b"\x0cX-Connection" + b"\x00\x00\x00\x02" + b"42"
    reply, _ = zap_reply(request(b"192.0.2.1"), ZAPPolicy.from_settings(["10.0.0.0/8"], []), 43)
    assert reply[2] == b"400" and reply[5] == b""


def test_zap_peer_names_the_address_and_the_curve_key() -> None:
    """The address as text; a CURVE key in Z85, none for NULL."""
    raw = z85.decode(MALLORY[0])
    assert zap_peer(request(b"192.0.2.1", b"CURVE", raw)) == ("192.0.2.1", MALLORY[0].decode())
    assert zap_peer(request(b"192.0.2.1")) == ("192.0.2.1", None)


def test_refusals_are_logged_once_a_minute_per_peer_and_reason() -> None:
    """Repeats within the minute are only counted; the next line says how many there were."""
    clock = Clock()
    refusals = RefusalLog(clock)
    with capturedLogs() as events:
        for _ in range(5):
            refusals.warn(("peer", "x"), "refused{repeated}")
            clock.advance(1)
        refusals.warn(("other", "x"), "refused{repeated}")
        clock.advance(60)
        refusals.warn(("peer", "x"), "refused{repeated}")
    assert [e["repeated"] for e in events] == ["", "", " (4 more like it since the last such line)"]


@pytest.mark.parametrize(
    ("event", "value", "curve", "kind", "words"),
    [
        (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH,
            True,
            "plaintext-peer",
            "does not use CURVE",
        ),
        (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH,
            False,
            "mechanism-mismatch",
            "this plaintext listener does not",
        ),
        (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
            True,
            "curve-handshake-failed",
            "another server public key",
        ),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, True, "handshake-failed", "plaintext client"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, False, "handshake-failed", "broke off"),
    ],
)
def test_handshake_failures_have_a_kind_and_a_reason(
    event: int, value: int, curve: bool, kind: str, words: str
) -> None:
    """What libzmq's monitor reports becomes a protocol error kind and a readable reason."""
    found, why = handshake_failure(event, value, curve)
    assert found == kind and words in why


def counted(metrics: GatewayMetrics, kind: str) -> float:
    """A protocol error count of the listener ``mtl``."""
    value = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": kind}
    )
    return value or 0.0


@pytest_twisted.inlineCallbacks
def test_refused_peers_are_named_logged_and_counted() -> Generator[Any, Any, None]:
    """A key not allowed: its address and Z85 key; plaintext and a wrong server key: counted.

    The last two never reach ZAP (libzmq ends their handshakes itself); the
    listener hears of them from libzmq's socket monitor.
    """
    public_key, secret_key = zmq.curve_keypair()
    metrics = GatewayMetrics()
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    server = listener(metrics, curve_secret_key=secret_key, curve_client_keys=(ALICE[0],))
    try:
        seen = yield threads.deferToThread(
            raw_dialogue, server.port, public_key, SILENCE_MS, MALLORY
        )
        assert seen == ["silence"]
        yield wait_for(lambda: counted(metrics, "peer-refused") > 0)
        [line] = [e for e in events if "refused a peer from" in e.get("log_format", "")]
        assert (line["address"], line["key"]) == (
            "127.0.0.1",
            f" with CURVE key {MALLORY[0].decode()}",
        )
        assert line["reason"] == "CURVE key not allowed"
        seen = yield threads.deferToThread(raw_dialogue, server.port, None, SILENCE_MS)
        assert seen == ["silence"]
        # Which side notices the mismatch first is a race inside libzmq: the listener
        # reads the plaintext greeting (plaintext-peer), or the client, seeing CURVE's,
        # breaks off first (handshake-failed, whose reason names that case).
        yield wait_for(
            lambda: counted(metrics, "plaintext-peer") + counted(metrics, "handshake-failed") > 0
        )
        wrong, _ = zmq.curve_keypair()
        seen = yield threads.deferToThread(raw_dialogue, server.port, wrong, SILENCE_MS, ALICE)
        assert seen == ["silence"]
        yield wait_for(lambda: counted(metrics, "curve-handshake-failed") > 0)
        handshakes = [e for e in events if "at its ZeroMQ handshake" in e.get("log_format", "")]
        assert {e["which"] for e in handshakes} == {"control"}
        assert any(
            "does not use CURVE" in e["why"] or "as a plaintext client often does" in e["why"]
            for e in handshakes
        )
        assert any("another server public key" in e["why"] for e in handshakes)
    finally:
        globalLogPublisher.removeObserver(events.append)
        server.stop()
