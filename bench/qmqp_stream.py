"""Benchmark QMQP streaming through the gateway, and its memory when stalled.

1. Throughput: 100,000 messages of about 1 KB streamed by one client to the
   gateway's QMQP listener, routed to its SSMP hub (``body = "subject"``),
   all answered K. The baseline, in the same run, is the same stream to a
   listener without routes (every message answered D at once): the
   difference is the cost of routing and delivery.
2. Through a QMQP upstream: the same stream to a listener routed to a QMQP
   upstream, a second gateway ("far") whose QMQP listener routes to its own
   SSMP hub; reported against the direct figure of step 1 (the far gateway
   does what the routed listener does, so the ratio is the upstream's cost).
   Durable: the same stream to a listener whose route to the SSMP hub is
   durable (each read committed to the embedded log as one chunk, fsync
   always, K after the commit; the forwarder delivers from the log), against
   the same baseline.
3. Memory while a destination is stalled: the route goes to a QMQP upstream
   whose server accepts the connection and never reads. The client streams
   as fast as the gateway lets it for a bounded time while the gateway's
   resident memory is sampled; reported against its memory when idle.

Bounded: a fixed message count and a time limit on every phase. Run with
``python bench/qmqp_stream.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_proc import rss_kib  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

CONFIG = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.routed]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.unrouted]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.stalled]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.relayed]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.durable]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.tarpit]
protocol = "qmqp"
endpoint = "tcp:host=127.0.0.1:port={tarpit}"

[upstreams.far]
protocol = "qmqp"
endpoint = "tcp:host=127.0.0.1:port={far}"
window = 1000
"""

FAR_CONFIG = """
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
FAR_ROUTES = {
    "to-hub": 'from = "qmqp"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n',
}

ROUTES = {
    "to-hub": 'from = "routed"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n',
    "to-tarpit": 'from = "stalled"\nmatch = "#"\nto = "tarpit"\ntimeout_seconds = 5\n',
    "to-far": 'from = "relayed"\nmatch = "#"\nto = "far"\n',
    "to-hub-durable": 'from = "durable"\nmatch = "#"\nto = "hub"\naddress = "mail"\n'
    'body = "subject"\ndurable = true\n',
}


def block(index: int, size: int = 1000) -> bytes:
    """One message block of about ``size`` body bytes."""
    body = b"From: bench@example.org\nSubject: message %d\n\n" % index + b"x" * size + b"\n"
    return qmqp.encode(
        qmqp.MessageBlock(
            id=b"m%d" % index,
            message=body,
            sender=b"bench@example.org",
            recipients=(b"ops@example.org",),
        )
    )


def stream(
    address: tuple[str, int], count: int, limit_seconds: float
) -> tuple[float, dict[bytes, int]]:
    """Stream ``count`` messages; return the seconds to the last reply and status counts."""
    sock = socket.create_connection(address)
    payload = b"".join(block(i) for i in range(count)) + qmqp.DONE_BYTES
    started = time.monotonic()
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    statuses: dict[bytes, int] = {}
    replies = 0
    sock.settimeout(limit_seconds)
    while replies < count:
        data = sock.recv(1 << 20)
        if not data:
            break
        for reply in codec.receive_data(data):
            if isinstance(reply, qmqp.ReplyBlock):
                replies += 1
                statuses[reply.status] = statuses.get(reply.status, 0) + 1
    elapsed = time.monotonic() - started
    sock.close()
    return elapsed, statuses


def stalled_memory(process: GatewayProcess, seconds: float) -> tuple[int, int, int]:
    """Stream into the stalled route for ``seconds``; return idle and peak RSS and bytes sent."""
    idle = rss_kib(process.pid)
    sock = socket.create_connection(process.address("stalled"))
    sock.settimeout(0.2)
    sent = 0
    peak = idle
    deadline = time.monotonic() + seconds
    chunk = b"".join(block(i) for i in range(1000))
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):  # the gateway stopped reading: measured
            sent += sock.send(chunk)
        with contextlib.suppress(TimeoutError):  # replies (Z after the route time-out)
            sock.recv(1 << 20)
        peak = max(peak, rss_kib(process.pid))
    sock.close()
    return idle, peak, sent


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--stall-seconds", type=float, default=20.0)
    parser.add_argument(
        "--durable-only", action="store_true", help="only the baseline and the durable route"
    )
    args = parser.parse_args()
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen()
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(tarpit.accept()[0]), daemon=True).start()
    with tempfile.TemporaryDirectory() as directory, tempfile.TemporaryDirectory() as far_dir:
        far = GatewayProcess(Path(far_dir), FAR_CONFIG, routes=FAR_ROUTES).start()
        try:
            config = CONFIG.format(tarpit=tarpit.getsockname()[1], far=far.address("qmqp")[1])
            process = GatewayProcess(Path(directory), config, routes=ROUTES).start()
            try:
                base_s, base_status = stream(process.address("unrouted"), args.count, 120)
                durable_s, durable_status = stream(process.address("durable"), args.count, 120)
                if args.durable_only:
                    _print_durable(args.count, base_s, base_status, durable_s, durable_status)
                    return
                routed_s, routed_status = stream(process.address("routed"), args.count, 120)
                relayed_s, relayed_status = stream(process.address("relayed"), args.count, 120)
                idle, peak, sent = stalled_memory(process, args.stall_seconds)
            finally:
                process.stop()
        finally:
            far.stop()
    rate = args.count / routed_s
    base_rate = args.count / base_s
    relayed_rate = args.count / relayed_s
    print(f"messages            {args.count} of about 1 KB, one client connection")
    print(f"routed to SSMP      {routed_s:6.2f} s  {rate:9.0f} msg/s  {routed_status}")
    print(f"no route (baseline) {base_s:6.2f} s  {base_rate:9.0f} msg/s  {base_status}")
    print(f"ratio               {rate / base_rate:6.2f}x of the baseline rate")
    print(
        f"durable to SSMP     {durable_s:6.2f} s  {args.count / durable_s:9.0f} msg/s"
        f"  {durable_status}  {base_s / durable_s:.2f}x of the baseline rate"
    )
    print(
        f"via QMQP upstream   {relayed_s:6.2f} s  {relayed_rate:9.0f} msg/s  {relayed_status}"
        f"  {relayed_rate / rate:.2f}x of routed to SSMP"
    )
    print(
        f"stalled destination {args.stall_seconds:.0f} s: {sent / 1e6:.1f} MB accepted from the"
        f" client; gateway RSS {idle / 1024:.0f} MiB idle, {peak / 1024:.0f} MiB peak"
        f" ({peak / idle:.2f}x)"
    )


def _print_durable(
    count: int,
    base_s: float,
    base_status: dict[bytes, int],
    durable_s: float,
    durable_status: dict[bytes, int],
) -> None:
    """The durable route's line and its baseline's, for ``--durable-only``."""
    print(f"messages            {count} of about 1 KB, one client connection")
    print(f"no route (baseline) {base_s:6.2f} s  {count / base_s:9.0f} msg/s  {base_status}")
    print(
        f"durable to SSMP     {durable_s:6.2f} s  {count / durable_s:9.0f} msg/s"
        f"  {durable_status}  {base_s / durable_s:.2f}x of the baseline rate"
    )


if __name__ == "__main__":
    main()
