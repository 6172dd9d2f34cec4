"""Benchmark MTL data flows through the gateway with raw pyzmq peers.

Starts the gateway (``twistd msggateway``) with an MTL listener and drives it
with pyzmq peers written from the spec (not our client):

* test profile: one writer, one reader, content fanned out (deliveries/s);
* gateway profile: a confirm=full writer whose content a route takes to a
  confirm=full reader of another MTL listener; the reader confirms each
  Content, the writer counts Confirms (confirmed round trips/s).

Every run is bounded by a message count and a time limit. Run it with
``python bench/mtl_flow.py [--count N]``. Besides the rates (which on a busy
machine say as much about the machine as about the gateway), each line gives
the gateway process's CPU time per message (Linux: ``/proc/PID/stat``).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import GatewayProcess  # noqa: E402

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mtl2]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
"""
ROUTES = {"across": 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n'}
LIMIT_SECONDS = 60.0
WINDOW = 1000
U64 = struct.Struct(">Q")
EMPTY_TABLE = b"\0\0\0\0"


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) a process has used so far, if /proc says."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_message(pid: int, before: float | None, count: int) -> str:
    """The gateway's CPU microseconds per message since ``before``."""
    after = cpu_seconds(pid)
    if before is None or after is None or not count:
        return ""
    return f", gateway CPU {(after - before) / count * 1e6:,.1f} us/message"


def short(text: str) -> bytes:
    """An MTL short string."""
    return bytes((len(text),)) + text.encode()


def lease(context: zmq.Context[zmq.Socket[bytes]], port: int, profile: str, kind: str,
          resources: list[str], confirm: str,
          receive_hwm: int | None = 0) -> zmq.Socket[bytes]:  # fmt: skip
    """Open, select the profile, lease; a DEALER that sent Lease and got 200.

    ``receive_hwm`` is the DEALER's ZMQ_RCVHWM: 0 (the default here) queues
    all that comes, so that a bench measures the server; None keeps ZeroMQ's
    own limit, so that a client that stops reading pushes back.
    """
    control = context.socket(zmq.REQ)
    control.connect(f"tcp://127.0.0.1:{port}")
    reply: dict[str, object] = {}
    for command, body in (
        ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
        ("Connection.Profile", {"profile": profile}),
        (f"Connection.{kind}", {"resources": resources, "confirm": confirm}),
    ):
        control.send_multipart([command.encode(), json.dumps(body).encode()])
        _, raw = control.recv_multipart()
        reply = json.loads(raw)
    control.close(linger=0)
    data = context.socket(zmq.DEALER)
    if receive_hwm is not None:
        data.setsockopt(zmq.RCVHWM, receive_hwm)
    data.connect(f"tcp://127.0.0.1:{reply['port']}")
    data.send_multipart([b"\x01" + U64.pack(1) + short(str(reply["lease"])), b""])
    assert data.recv_multipart()[1] == b"200"
    return data


def summon(data: zmq.Socket[bytes], resource: str) -> None:
    """Summon a resource and wait for 200."""
    data.send_multipart([b"\x03" + U64.pack(2) + short(resource), b""])
    assert data.recv_multipart()[1] == b"200"


def settle(unsettled: dict[int, Any], header: bytes) -> int:
    """Remove what a Confirm or Reject covers (one sequence, or all up to it); how many.

    Spec, "Content Confirmation": with ``multiple`` it covers every
    unsettled Content up to its sequence (the gateway confirms a run of
    accepted ones so).
    """
    (sequence,) = U64.unpack_from(header, 1)
    if len(header) > 9 and header[9]:  # multiple
        covered = [s for s in unsettled if s <= sequence]
    else:
        covered = [sequence] if sequence in unsettled else []
    for key in covered:
        del unsettled[key]
    return len(covered)


def write(data: zmq.Socket[bytes], count: int, resource: str, pace: threading.Semaphore | None
          ) -> None:  # fmt: skip
    """Send ``count`` Contents of 100 bytes (waiting on ``pace`` before each, if given)."""
    head = short(resource) + EMPTY_TABLE
    body = b"x" * 100
    for sequence in range(1, count + 1):
        if pace is not None:
            pace.acquire()
        data.send_multipart([b"\x05" + U64.pack(sequence) + head, body])


def test_profile(context: zmq.Context[zmq.Socket[bytes]], port: int, count: int) -> tuple[str, int]:
    """One writer to one reader through the test profile; the figures and the count delivered."""
    reader = lease(context, port, "test", "Reader", ["resource"], "none")
    summon(reader, "resource")
    writer = lease(context, port, "test", "Writer", [], "none")
    window = threading.Semaphore(2000)  # keep the listener's queue to the reader bounded
    started = time.perf_counter()
    thread = threading.Thread(target=write, args=(writer, count, "", window), daemon=True)
    thread.start()
    got = 0
    while got < count and reader.poll(2000) and time.perf_counter() - started < LIMIT_SECONDS:
        header, _ = reader.recv_multipart()
        if header[0] == 0x05:
            got += 1
            window.release()
        elif header[0] == 0x08:
            reader.send_multipart([b"\x09", b""])
    elapsed = time.perf_counter() - started
    return f"test profile 1->1: {got}/{count} delivered, {got / elapsed:,.0f} deliveries/s", got


def gateway_profile(
    context: zmq.Context[zmq.Socket[bytes]], port: int, port2: int, count: int
) -> tuple[str, int]:
    """A confirm=full writer, a route, a confirm=full reader; the figures, the count confirmed."""
    reader = lease(context, port2, "gateway", "Reader", ["out"], "full")
    summon(reader, "out")
    writer = lease(context, port, "gateway", "Writer", ["in"], "full")
    head = short("") + EMPTY_TABLE
    body = b"x" * 100
    poller = zmq.Poller()
    poller.register(reader, zmq.POLLIN)
    poller.register(writer, zmq.POLLIN)
    sent = confirmed = 0
    unsettled: dict[int, None] = {}
    started = time.perf_counter()
    # One thread for both sockets (ZeroMQ sockets are not thread-safe); at most
    # WINDOW unconfirmed.
    while confirmed < count and time.perf_counter() - started < LIMIT_SECONDS:
        while sent < count and sent - confirmed < WINDOW:
            sent += 1
            unsettled[sent] = None
            writer.send_multipart([b"\x05" + U64.pack(sent) + head, body])
        events = poller.poll(2000)
        if not events:
            break
        for socket, _ in events:
            while socket.poll(0):
                header, _ = socket.recv_multipart()
                if socket is reader and header[0] == 0x05:
                    socket.send_multipart([b"\x06" + header[1:9] + b"\x00", b""])
                elif socket is writer and header[0] == 0x06:
                    confirmed += settle(unsettled, header)
                elif header[0] == 0x08:
                    socket.send_multipart([b"\x09", b""])
    elapsed = time.perf_counter() - started
    return (
        f"gateway profile, confirm=full both ends, via a route: {confirmed}/{count} confirmed, "
        f"{confirmed / elapsed:,.0f} confirmed round trips/s"
    ), confirmed


def main() -> None:
    """Run both scenarios once and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        gateway = GatewayProcess(Path(directory), CONFIG, routes=ROUTES).start()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            port = gateway.address("mtl")[1]
            before = cpu_seconds(gateway.pid)
            line, done = test_profile(context, port, args.count)
            print(line + cpu_per_message(gateway.pid, before, done))
            before = cpu_seconds(gateway.pid)
            line, done = gateway_profile(context, port, gateway.address("mtl2")[1], args.count // 2)
            print(line + cpu_per_message(gateway.pid, before, done))
        finally:
            context.destroy(linger=0)
            gateway.stop()


if __name__ == "__main__":
    main()
