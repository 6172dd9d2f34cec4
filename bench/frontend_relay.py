"""Benchmark the TLS front-end: what TLS termination and the relay cost, and memory when stalled.

Two gateways under twistd: a plaintext backend with a QMQP listener routed to
its SSMP hub (``body = "subject"``, every message answered K), and a
front-end with a QMQP ``frontend`` listener (``mtls:``, client certificates
required) relaying to it.

1. Throughput: ``--count`` messages of about 1 KB streamed by one client,
   once straight to the backend (plaintext) and once through the front-end
   over TLS with a client certificate; seconds to the last reply.
2. Memory with a stalled backend: a second front-end listener relays to a
   TCP server that accepts and never reads. The client writes as fast as the
   front-end lets it for ``--stall-seconds``; the front-end's resident memory
   is sampled. Flow control (the backend's full buffer pauses reading from
   the client) keeps it bounded.

Bounded: a fixed message count and a time limit on every phase. Run with
``python bench/frontend_relay.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_proc import rss_kib  # noqa: E402
from bench.qmqp_stream import block  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from tests.certs import make_pki  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

BACKEND = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
"""

ROUTES = {"to-hub": 'from = "qmqp"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n'}

FRONT = """
[admin]
enabled = false

[listeners.qmqp]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={backend}"

[listeners.stalled]
protocol = "frontend"
speaks = "qmqp"
endpoint = "{tls}"
backend = "tcp:host=127.0.0.1:port={tarpit}"
"""


def stream(connect: Callable[[], socket.socket], count: int, limit_seconds: float) -> float:
    """Stream ``count`` messages on a new connection; return the seconds to the last reply.

    One thread writes and reads with a selector: an `ssl.SSLSocket` must not
    be written and read from two threads at once.
    """
    sock = connect()
    payload = memoryview(b"".join(block(i) for i in range(count)) + qmqp.DONE_BYTES)
    sock.setblocking(False)
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    replies = sent = 0
    started = time.monotonic()
    deadline = started + limit_seconds
    while replies < count and time.monotonic() < deadline:
        selector.select(1.0)
        with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            while data := sock.recv(1 << 20):
                for reply in codec.receive_data(data):
                    if isinstance(reply, qmqp.ReplyBlock):
                        assert reply.status == qmqp.K, reply
                        replies += 1
            break  # closed by the server
        if sent < len(payload):
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                sent += sock.send(payload[sent : sent + 256 * 1024])
        else:
            selector.modify(sock, selectors.EVENT_READ)
    elapsed = time.monotonic() - started
    selector.close()
    sock.close()
    assert replies == count, f"{replies} replies of {count}"
    return elapsed


def stalled_memory(
    process: GatewayProcess, connect: Callable[[], socket.socket], seconds: float
) -> tuple[int, int, int]:
    """Write into the stalled relay for ``seconds``; return idle and peak RSS and bytes sent."""
    idle = rss_kib(process.pid)
    sock = connect()
    sock.settimeout(0.2)
    sent = 0
    peak = idle
    deadline = time.monotonic() + seconds
    chunk = b"".join(block(i) for i in range(64))
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError, ssl.SSLWantWriteError):  # not read: measured
            sent += sock.send(chunk)
        peak = max(peak, rss_kib(process.pid))
    sock.close()
    return idle, peak, sent


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--stall-seconds", type=float, default=10.0)
    args = parser.parse_args()
    tarpit = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(tarpit.accept()[0]), daemon=True).start()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        (root / "pki").mkdir()
        pki = make_pki(root / "pki")
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
        backend = GatewayProcess(root / "backend", BACKEND, routes=ROUTES).start()
        try:
            tls = (
                f"mtls:0:certKey={pki.server_cert}:privateKey={pki.server_key}"
                f":caCerts={pki.ca_cert}"
            )
            config = FRONT.format(
                tls=tls, backend=backend.address("qmqp")[1], tarpit=tarpit.getsockname()[1]
            )
            front = GatewayProcess(root / "front", config).start()
            try:

                def through(name: str) -> Callable[[], socket.socket]:
                    def connect() -> socket.socket:
                        raw = socket.create_connection(front.address(name))
                        return context.wrap_socket(raw, server_hostname="localhost")

                    return connect

                direct_s = stream(
                    lambda: socket.create_connection(backend.address("qmqp")), args.count, 120
                )
                front_s = stream(through("qmqp"), args.count, 120)
                idle, peak, sent = stalled_memory(front, through("stalled"), args.stall_seconds)
            finally:
                front.stop()
        finally:
            backend.stop()
    tarpit.close()
    print(f"messages            {args.count} of about 1 KB, one client connection, all K")
    print(f"straight (plain)    {direct_s:6.2f} s  {args.count / direct_s:9.0f} msg/s")
    print(
        f"through the TLS front-end {front_s:6.2f} s  {args.count / front_s:9.0f} msg/s"
        f"  ({direct_s / front_s:.2f}x)"
    )
    print(
        f"stalled backend {args.stall_seconds:.0f} s: {sent / 1e6:.1f} MB taken from the client;"
        f" front-end RSS {idle / 1024:.0f} MiB idle, {peak / 1024:.0f} MiB peak"
    )


if __name__ == "__main__":
    main()
