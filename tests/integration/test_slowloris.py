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
  less than a few megabytes;
* after the handshake (a second set of listeners, their own time-outs left
  at their defaults, ``frame_timeout_seconds`` one second), a client that
  sends part of a frame and nothing more is aborted (a reset) at the frame
  time-out: an SSMP line, a QMQP block, a stream frame with heartbeats off, a
  DMP envelope (issue 18); one that completes its frames slowly stays.

MTL runs over ZeroMQ, whose handshakes libzmq handles (ZMTP's own
handshake time-out, ``handshake_ivl``); it is not a TCP listener of ours.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.codecs import dmp, qmqp
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

[listeners.ssmp-frames]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
frame_timeout_seconds = {TIMEOUT}

[listeners.qmqp-frames]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
frame_timeout_seconds = {TIMEOUT}

[listeners.streams-frames]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
frame_timeout_seconds = {TIMEOUT}

[listeners.dmp-frames]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["s"]
frame_timeout_seconds = {TIMEOUT}

[listeners.dmp-frames.leases]
writer = {{ sink = "s", text = "lease-w" }}
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


# --- half-sent frames after the handshake (issue 18) ----------------------------------------


def _read_until(sock: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    """Read until ``done`` says what came is enough (the socket's time-out bounds each read)."""
    data = b""
    while not done(data):
        chunk = sock.recv(65536)
        assert chunk, f"closed early after {data!r}"
        data += chunk
    return data


def _ssmp_logged_in(sock: socket.socket) -> None:
    sock.sendall(b"LOGIN loris open\n")
    assert _read_until(sock, lambda data: data.endswith(b"\n")) == b"200\n"


def _stream_events_until(sock: socket.socket, codec: sp.StreamCodec, kind: type) -> list[Any]:
    """Read and decode frames until one of ``kind`` comes; return them all."""
    events: list[Any] = []
    while not any(isinstance(event, kind) for event in events):
        chunk = sock.recv(65536)
        assert chunk, f"closed early after {events!r}"
        events.extend(codec.receive_data(chunk))
    return events


def _stream_opened(sock: socket.socket) -> None:
    """Through the stream handshake as guest, heartbeats off (0 in Tune)."""
    codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
    sock.sendall(
        codec.send(sp.PeerProperties(correlation_id=1, properties={}))
        + codec.send(sp.SaslHandshake(correlation_id=2))
        + codec.send(
            sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest")
        )
    )
    _stream_events_until(sock, codec, sp.Tune)
    sock.sendall(
        codec.send(sp.Tune(frame_max=0, heartbeat=0))
        + codec.send(sp.Open(correlation_id=4, virtual_host="/"))
    )
    events = _stream_events_until(sock, codec, sp.OpenResponse)
    assert [event.code for event in events if isinstance(event, sp.OpenResponse)] == [1]


def _dmp_opened(sock: socket.socket) -> None:
    sock.sendall(b"AMQP\x0a\x01\x00\x01" + bytes([7]) + b"lease-w")
    answers = _read_until(sock, lambda data: data.count(b"OK") >= 2)
    assert b"Ready to write" in answers


_BLOCK = qmqp.encode(
    qmqp.MessageBlock(id=b"h", message=b"x" * 1000, sender=b"a@b", recipients=(b"c@d",))
)
HANDSHAKES: dict[str, tuple[Callable[[socket.socket], None], bytes]] = {
    "ssmp-frames": (_ssmp_logged_in, b"MCAST news half a li"),
    "qmqp-frames": (lambda sock: None, _BLOCK[:20]),
    "streams-frames": (_stream_opened, sp.encode(sp.Heartbeat())[:3]),
    "dmp-frames": (
        _dmp_opened,
        dmp.encode_envelope(dmp.Envelope(routing_key="k", body=b"x" * 480))[:9],
    ),
}
"""How to get through each listener's handshake, and the start of a frame to send after it."""


@pytest.mark.parametrize("listener", sorted(HANDSHAKES))
def test_a_half_sent_frame_after_the_handshake_is_aborted(
    gateway: GatewayProcess, listener: str
) -> None:
    """Part of a frame after the handshake, then silence: reset at the frame time-out."""
    handshake, part = HANDSHAKES[listener]
    with socket.create_connection(gateway.address(listener), timeout=10) as sock:
        handshake(sock)
        sock.sendall(part)
        started = time.monotonic()
        sock.settimeout(TIMEOUT + 4)
        with pytest.raises(ConnectionResetError):  # aborted, not closed in order
            while sock.recv(4096):
                pass
        waited = time.monotonic() - started
    assert TIMEOUT * 0.9 <= waited < TIMEOUT + 4


def test_frames_completed_slowly_keep_the_connection(gateway: GatewayProcess) -> None:
    """Each line finished within the frame time-out: answered, and the connection stays."""
    with socket.create_connection(gateway.address("ssmp-frames"), timeout=10) as sock:
        _ssmp_logged_in(sock)
        for _ in range(3):
            sock.sendall(b"MCAST news sl")
            time.sleep(TIMEOUT / 2)  # the client's pace: this is the load, not a wait
            sock.sendall(b"owly\n")
            assert _read_until(sock, lambda data: data.endswith(b"\n")) == b"200\n"
