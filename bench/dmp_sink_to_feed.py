"""Benchmark DMP through the gateway: sink writers to one feed reader.

One gateway under twistd with a DMP listener whose sink ``in`` is routed
(direct) to its own feed ``out``. One reader opens the feed; ``--writers``
plain-socket writers each write ``--count / writers`` envelopes of
``--size`` body bytes into the sink, in batches of 1,000 per ``sendall``.
Reported: messages a second from the first write to the last envelope read,
and the same in MB/s of body. The peers here frame envelopes with struct
(empty exchange and properties), so the figure is the gateway's cost.

Bounded: a fixed message count and a time limit. Run with
``python bench/dmp_sink_to_feed.py``.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import GatewayProcess  # noqa: E402

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["in"]
feeds = ["out"]
heartbeat_seconds = 5
max_feed_backlog_bytes = 67108864

[listeners.dmp.leases]
writer = { sink = "in", text = "w" }
reader = { feed = "out", text = "r" }
"""
ROUTES = {"loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n'}
HEADER = b"AMQP\x0a\x01\x00\x01"


def opened(address: tuple[str, int], lease: bytes) -> socket.socket:
    """A DMP connection past its dialog (both responses read and checked)."""
    sock = socket.create_connection(address, timeout=30)
    sock.sendall(HEADER + bytes((len(lease),)) + lease)
    got = b""
    while True:
        got += sock.recv(4096)
        if len(got) >= 1 and len(got) >= 1 + got[0]:
            second = got[1 + got[0] :]
            if second and len(second) >= 1 + second[0]:
                assert second[1:4] == b"200", second
                return sock


def envelope(body: bytes) -> bytes:
    """Empty exchange and routing key, no properties, no options, the body."""
    rest = b"\x00\x00\x00\x00\x00" + len(body).to_bytes(3, "big") + body
    return struct.pack(">I", len(rest)) + rest


def read_count(sock: socket.socket, count: int, deadline: float, done: list[float]) -> None:
    """Read envelopes until ``count`` non-null ones have arrived (or the deadline)."""
    buffer = bytearray()
    seen = 0
    pos = 0
    while seen < count and time.monotonic() < deadline:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        buffer += chunk
        while len(buffer) - pos >= 4:
            (size,) = struct.unpack_from(">I", buffer, pos)
            if len(buffer) - pos < 4 + size:
                break
            pos += 4 + size
            seen += size > 0
        del buffer[:pos]
        pos = 0
    done.append(time.monotonic())
    done.append(seen)


def main() -> None:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--limit-seconds", type=float, default=120.0)
    args = parser.parse_args()
    per_writer = args.count // args.writers
    total = per_writer * args.writers
    batch = envelope(b"x" * args.size) * 1000
    with tempfile.TemporaryDirectory() as scratch:
        process = GatewayProcess(Path(scratch), CONFIG, routes=ROUTES).start()
        try:
            address = process.address("dmp")
            reader = opened(address, b"r")
            writers = [opened(address, b"w") for _ in range(args.writers)]
            done: list[float] = []
            deadline = time.monotonic() + args.limit_seconds
            thread = threading.Thread(target=read_count, args=(reader, total, deadline, done))
            thread.start()
            start = time.monotonic()

            def write(sock: socket.socket) -> None:
                for _ in range(per_writer // 1000):
                    sock.sendall(batch)
                sock.sendall(envelope(b"x" * args.size) * (per_writer % 1000))

            senders = [threading.Thread(target=write, args=(w,)) for w in writers]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()
            thread.join()
            end, seen = done
            seconds = end - start
            print(
                f"DMP sink -> feed, {args.writers} writers, {args.size}-byte bodies: "
                f"{int(seen):,} of {total:,} read in {seconds:.2f} s = "
                f"{seen / seconds:,.0f} msg/s, {seen * args.size / seconds / 1e6:.1f} MB/s body"
            )
            for sock in (reader, *writers):
                sock.close()
        finally:
            process.stop()


if __name__ == "__main__":
    main()
