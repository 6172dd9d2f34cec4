"""Slow-loris clients are closed at the time-out, and idle floods stop at the limit.

One gateway under twistd with an SSMP, a QMQP, a stream and a DMP listener,
their login, idle and handshake time-outs set to one second:

* a client that connects and sends nothing is closed at the time-out;
* a client that sends a valid beginning one byte at a time (four a
  second) is closed at the same time-out: the clock runs from the
  connection (SSMP login, stream and DMP handshakes) or from the last
  complete block (QMQP), not from the last byte;
* a thousand idle connections to a listener limited to fifty: fifty are
  kept, every other one is closed at once, and the gateway's memory grows by
  less than a few megabytes.

MTL runs over ZeroMQ, whose handshakes libzmq handles (ZMTP's own
handshake time-out, ``handshake_ivl``); it is not a TCP listener of ours.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

TIMEOUT = 1.0
CONFIG = f"""
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
login_timeout_seconds = {TIMEOUT}

[listeners.flood]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
max_connections = 50

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
idle_timeout_seconds = {TIMEOUT}

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
handshake_timeout_seconds = {TIMEOUT}

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["s"]
handshake_timeout_seconds = {TIMEOUT}
"""

TRICKLES = {
    "ssmp": b"LOGIN " + b"s" * 30 + b" open\n",
    "qmqp": qmqp.encode(
        qmqp.MessageBlock(id=b"p", message=b"x" * 40, sender=b"a@b", recipients=(b"c@d",))
    ),
    "streams": sp.encode(sp.PeerProperties(correlation_id=1, properties={"product": "loris"})),
    # The header (answered with the greeting), then a request line that never ends.
    "dmp": b"AMQP\x0a\x01\x00\x01" + bytes([40]) + b"s" * 40,
}
"""A valid first request of each protocol, longer than a time-out's worth of bytes."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The gateway with one-second time-outs."""
    process = GatewayProcess(tmp_path_factory.mktemp("loris"), CONFIG).start()
    yield process
    process.stop()


def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the gateway closes ``sock`` (reading whatever it says first)."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


@pytest.mark.parametrize("listener", ["ssmp", "qmqp", "streams", "dmp"])
def test_silent_client_is_closed_at_the_time_out(gateway: GatewayProcess, listener: str) -> None:
    """Connect and say nothing: closed after about one second."""
    with socket.create_connection(gateway.address(listener), timeout=10) as sock:
        waited = _closed_after(sock, 10)
    assert TIMEOUT * 0.9 <= waited < TIMEOUT + 4


@pytest.mark.parametrize("listener", ["ssmp", "qmqp", "streams", "dmp"])
def test_one_byte_at_a_time_is_closed_at_the_time_out(
    gateway: GatewayProcess, listener: str
) -> None:
    """A byte every quarter second of a valid request never completes it: closed all the same."""
    request = TRICKLES[listener]
    assert len(request) > 4 * (TIMEOUT + 4)  # it cannot finish before the deadline below
    with socket.create_connection(gateway.address(listener), timeout=10) as sock:
        started = time.monotonic()
        closed = False
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.25)  # the client's pace: this is the load, not a wait
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
        waited = time.monotonic() - started
    assert closed, f"{listener}: still open after {waited:.1f} s of trickling"
    assert waited < TIMEOUT + 4


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_thousand_idle_connections_over_the_limit(gateway: GatewayProcess) -> None:
    """Fifty are kept, 950 are closed at once; memory stays within a few megabytes."""
    address = gateway.address("flood")  # ten seconds to log in: none goes meanwhile
    before = _rss_kib(gateway.pid)
    sockets = [socket.create_connection(address, timeout=10) for _ in range(1000)]
    try:
        closed = 0
        for sock in sockets[50:]:
            sock.settimeout(10)
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == 950
        grown = _rss_kib(gateway.pid) - before
        assert grown < 16 * 1024, f"the gateway grew by {grown} KiB"
    finally:
        for sock in sockets:
            sock.close()
