"""Memory and descriptors of idle connections on all five protocols, in one gateway (issue 18).

One gateway under twistd with a listener of each protocol, its
``max_connections``, login, handshake, idle and ping time-outs raised so that
idle peers stay. The run:

1. one valid exchange per protocol (then closed), so that what a first
   connection loads once is not charged to the idle ones; the gateway's RSS
   (``/proc/PID/status`` VmRSS) and open descriptors then are the baseline;
2. ``--connections`` connections spread evenly over the five protocols, each
   brought to its idle state and left silent: SSMP logged in (``LOGIN idN
   open``), QMQP connected, stream through Open (guest, heartbeats off), DMP
   through its dialog (a sink writer's lease), MTL a session of a control REQ
   socket (Open, Profile, a Writer lease) and a data DEALER that presented the
   lease (two TCP connections each, both counted in its figure); RSS and
   descriptors are sampled after each protocol's share;
3. with all of them open, one valid exchange per protocol again: SSMP MCAST to
   a subscriber, QMQP a block answered K (a route to the hub), a stream Publish
   confirmed, DMP sink to feed, MTL test profile writer to reader;
4. everything closed, and the gateway's figures once its descriptors are back.

Printed: one table, protocol / connections / RSS delta / KiB per connection /
descriptors, the total against the baseline, and whether the gateway stays
under the goal of 500 MB of RSS in all.

Bounded: every read has a time-out and the whole run ``--limit-seconds``;
the gateway and the scratch directory are removed on exit, SIGTERM or
Ctrl-C. This process raises its own open-file limit to the hard limit (its
clients need about as many descriptors as the gateway), and refuses a count
that would not fit under it. Run::

    .venv/bin/python -m bench.idle                      # 10,000 connections
    .venv/bin/python -m bench.idle --quick              # 500, a smoke run
    .venv/bin/python -m bench.idle --connections 20000  # needs a hard limit of 30,000 or so
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bridges import ssmp_subscriber  # noqa: E402
from bench.dmp_sink_to_feed import envelope, opened, take_envelopes  # noqa: E402
from bench.gateway_proc import (  # noqa: E402
    DMP_LISTENER,
    GATEWAY_TABLE,
    MTL_LISTENER,
    QMQP_LISTENER,
    SSMP_LISTENER,
    STREAM_LISTENER,
    MTLSession,
    StreamClient,
    gateway_config,
    log_problems,
    open_fds,
    open_sockets,
    raise_open_file_limit,
    rss_kib,
    stop_on_signals,
    wait_until,
)
from bench.mtl_flow import EMPTY_TABLE, U64, short  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from gateway.codecs import stream as sp  # noqa: E402
from gateway.codecs.errors import ProtocolError  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

GOAL_MB: Final = 500
"""Issue 18: ten thousand idle connections in less than this much gateway RSS."""
PROTOCOLS: Final = ("ssmp", "qmqp", "stream", "dmp", "mtl")
TCP_PER_CONNECTION: Final = {"ssmp": 1, "qmqp": 1, "stream": 1, "dmp": 1, "mtl": 2}
"""TCP connections (a descriptor each, at both ends) per counted connection."""
CLIENT_FDS_PER_CONNECTION: Final = {"ssmp": 1, "qmqp": 1, "stream": 1, "dmp": 1, "mtl": 4}
"""Descriptors this process holds per counted connection: an MTL socket has a mailbox too."""
SPARE_FDS: Final = 200
SETTLE_SECONDS: Final = 30.0
"""The most to wait for the gateway's descriptor count to catch up with ours."""
SLOW_SECONDS: Final = 3600
"""Time-outs of the idle state: longer than any run."""

ROUTES: Final = {
    "mail": 'from = "qmqp"\nmatch = "#"\nto = "ssmp"\naddress = "mail"\nbody = "subject"\n',
    "loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n',
}


def config(max_connections: int) -> str:
    """The gateway's main file: admin off, each listener taking ``max_connections``, never idle."""
    taking = (f"max_connections = {max_connections}", "backlog = 4096")
    slow = SLOW_SECONDS
    return gateway_config(
        {
            "gateway": GATEWAY_TABLE,
            "admin": ("enabled = false",),
            "listeners.ssmp": (
                *SSMP_LISTENER,
                *taking,
                f"login_timeout_seconds = {slow}",
                f"ping_interval_seconds = {slow}",
                f"pong_timeout_seconds = {slow}",
            ),
            "listeners.qmqp": (*QMQP_LISTENER, *taking, f"idle_timeout_seconds = {slow}"),
            "listeners.stream": (*STREAM_LISTENER, *taking, f"handshake_timeout_seconds = {slow}"),
            "listeners.dmp": (*DMP_LISTENER, *taking, f"handshake_timeout_seconds = {slow}"),
            "listeners.mtl": (
                *MTL_LISTENER,
                f"ping_interval_seconds = {slow}",
                f"dead_after_seconds = {slow}",
            ),
        }
    )


@dataclass
class Sample:
    """The gateway's resident memory and open descriptors at one moment."""

    rss_kib: int
    fds: int

    @classmethod
    def of(cls, pid: int) -> Sample:
        """Sample process ``pid`` now."""
        return cls(rss_kib(pid), open_fds(pid))


@dataclass
class Peers:
    """The idle clients: plain sockets, stream clients and MTL sessions, to close at the end."""

    context: zmq.Context[zmq.Socket[bytes]]
    sockets: list[socket.socket] = field(default_factory=list)
    sessions: list[MTLSession] = field(default_factory=list)

    def close(self) -> None:
        """Close every client."""
        for sock in self.sockets:
            sock.close()
        for session in self.sessions:
            session.close()
        self.sockets.clear()
        self.sessions.clear()


# --- reaching the idle state -------------------------------------------------------------


def idle_ssmp(gateway: GatewayProcess, peers: Peers, number: int) -> None:
    """An SSMP connection logged in (``open`` scheme, its own identity), then silent."""
    sock = socket.create_connection(gateway.address("ssmp"), timeout=30)
    peers.sockets.append(sock)
    sock.sendall(b"LOGIN idle%d open\n" % number)
    answer = b""
    while not answer.endswith(b"\n"):
        data = sock.recv(4096)
        if not data:
            raise RuntimeError(f"the hub closed idle{number}'s login: {answer!r}")
        answer += data
    if not answer.startswith(b"200"):
        raise RuntimeError(f"LOGIN idle{number} answered {answer!r}")


def idle_qmqp(gateway: GatewayProcess, peers: Peers, number: int) -> None:
    """A QMQP connection: connected, nothing sent (the protocol has no greeting)."""
    peers.sockets.append(socket.create_connection(gateway.address("qmqp"), timeout=30))


def idle_stream(gateway: GatewayProcess, peers: Peers, number: int) -> None:
    """A stream connection through Open as guest, heartbeats off."""
    client = StreamClient(gateway.address("stream"))
    peers.sockets.append(client.sock)
    client.open()


def idle_dmp(gateway: GatewayProcess, peers: Peers, number: int) -> None:
    """A DMP sink writer past its dialog (the lease accepted)."""
    peers.sockets.append(opened(gateway.address("dmp"), b"w"))


def idle_mtl(gateway: GatewayProcess, peers: Peers, number: int) -> None:
    """An MTL session: control socket open and leased, data socket past its Lease."""
    peers.sessions.append(MTLSession(peers.context, gateway.address("mtl")[1]))


IDLE: Final[dict[str, Callable[[GatewayProcess, Peers, int], None]]] = {
    "ssmp": idle_ssmp,
    "qmqp": idle_qmqp,
    "stream": idle_stream,
    "dmp": idle_dmp,
    "mtl": idle_mtl,
}

# --- one valid exchange per protocol -----------------------------------------------------


def check_ssmp(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> str:
    """MCAST from one connection reaches a subscriber on another."""
    address = gateway.address("ssmp")
    watcher = ssmp_subscriber(address, b"check")
    sender = socket.create_connection(address, timeout=30)
    try:
        sender.sendall(b"LOGIN checker open\nMCAST check hello\n")
        answers = b""
        while answers.count(b"\n") < 2:
            data = sender.recv(4096)
            if not data:
                raise RuntimeError(f"the hub closed the sender: {answers!r}")
            answers += data
        if not all(line.startswith(b"200") for line in answers.split(b"\n")[:2]):
            raise RuntimeError(f"LOGIN and MCAST answered {answers!r}")
        seen = b""
        while b"MCAST check hello" not in seen:
            data = watcher.recv(4096)
            if not data:
                raise RuntimeError(f"the hub closed the subscriber: {seen!r}")
            seen += data
    finally:
        sender.close()
        watcher.close()
    return "MCAST delivered"


def check_qmqp(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> str:
    """A message block routed to the hub is answered K, then the done block ends the session."""
    block = qmqp.MessageBlock(
        id=b"check",
        message=b"From: bench@example.org\nSubject: check\n\nhello\n",
        sender=b"bench@example.org",
        recipients=(b"ops@example.org",),
    )
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    with socket.create_connection(gateway.address("qmqp"), timeout=30) as sock:
        sock.sendall(qmqp.encode(block) + qmqp.DONE_BYTES)
        replies: list[Any] = []
        while not any(isinstance(reply, qmqp.DoneBlock) for reply in replies):
            data = sock.recv(4096)
            if not data:
                break
            replies.extend(codec.receive_data(data))
    statuses = [bytes(r.status) for r in replies if isinstance(r, qmqp.ReplyBlock)]
    if statuses[:1] != [b"K"]:
        raise RuntimeError(f"the block was answered {statuses!r}")
    return "block answered K"


def check_stream(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> str:
    """One message published to a stream is confirmed."""
    client = StreamClient(gateway.address("stream")).open()
    try:
        client.create("check")
        client.declare_publisher(1, "check")
        client.send(sp.Publish(publisher_id=1, publishing_ids=[1], messages=[b"hello"]))
        event = client.read()
        if not isinstance(event, sp.PublishConfirm) or list(event.publishing_ids) != [1]:
            raise RuntimeError(f"Publish answered {event!r}")
    finally:
        client.close()
    return "Publish confirmed"


def check_dmp(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> str:
    """An envelope written to the sink arrives at the feed's reader."""
    address = gateway.address("dmp")
    reader = opened(address, b"r")
    writer = opened(address, b"w")
    try:
        writer.sendall(envelope(b"hello"))
        buffer = bytearray()
        while True:
            data = reader.recv(4096)
            if not data:
                raise RuntimeError("the feed closed")
            buffer += data
            if any(bytes(found[-5:]) == b"hello" for found in take_envelopes(buffer)):
                return "sink to feed"
    finally:
        reader.close()
        writer.close()


def check_mtl(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> str:
    """Test profile: a writer's Content reaches a reader that summoned the resource."""
    port = gateway.address("mtl")[1]
    reader = MTLSession(context, port, kind="Reader", resources=("resource",))
    writer = MTLSession(context, port)
    try:
        reader.summon("resource")
        assert writer.data is not None
        writer.data.send_multipart([b"\x05" + U64.pack(2) + short("") + EMPTY_TABLE, b"hello"])
        kind, _, body = reader.next_command()
        if kind != 0x05 or body != b"hello":
            raise RuntimeError(f"the reader got {kind:#x} {body!r}")
    finally:
        reader.close()
        writer.close()
    return "writer to reader"


CHECKS: Final[dict[str, Callable[[GatewayProcess, zmq.Context[zmq.Socket[bytes]]], str]]] = {
    "ssmp": check_ssmp,
    "qmqp": check_qmqp,
    "stream": check_stream,
    "dmp": check_dmp,
    "mtl": check_mtl,
}


def check_all(gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]) -> dict[str, str]:
    """One exchange per protocol; what happened to each (``failed: ...`` when it did not work)."""
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(gateway, context)
        except (OSError, RuntimeError, EOFError, ProtocolError, zmq.ZMQError) as exc:
            results[name] = f"failed: {type(exc).__name__}: {exc}"
    return results


# --- the run -----------------------------------------------------------------------------


def shares(total: int) -> dict[str, int]:
    """``total`` connections spread evenly over the protocols (the first ones take the rest)."""
    base, rest = divmod(total, len(PROTOCOLS))
    return {name: base + (index < rest) for index, name in enumerate(PROTOCOLS)}


def open_share(
    gateway: GatewayProcess, peers: Peers, name: str, count: int, deadline: float
) -> Sample:
    """Bring ``count`` connections of protocol ``name`` to idle; the gateway's figures after.

    Waits (bounded) until the gateway holds a descriptor for each: a QMQP
    connection has no handshake to say it was accepted.
    """
    before = open_fds(gateway.pid)
    opener = IDLE[name]
    for number in range(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"--limit-seconds spent while opening {name} connections")
        opener(gateway, peers, number)
    expected = before + count * TCP_PER_CONNECTION[name]
    if not wait_until(lambda: open_fds(gateway.pid) >= expected, SETTLE_SECONDS):
        raise RuntimeError(
            f"{name}: the gateway holds {open_fds(gateway.pid) - before} new descriptors,"
            f" {expected - before} expected"
        )
    return Sample.of(gateway.pid)


def table(
    counts: dict[str, int], samples: dict[str, tuple[Sample, Sample]], baseline: Sample
) -> list[str]:
    """The aligned result table."""
    header = ["protocol", "connections", "RSS delta MB", "KiB/connection", "fds delta"]
    rows = [header]
    for name in PROTOCOLS:
        before, after = samples[name]
        delta = after.rss_kib - before.rss_kib
        count = counts[name]
        label = name + (" (2 TCP each)" if TCP_PER_CONNECTION[name] > 1 else "")
        rows.append([
            label, f"{count:,}", f"{delta / 1024:.1f}",
            f"{delta / count:.2f}" if count else "-", f"{after.fds - before.fds:,}",
        ])  # fmt: skip
    last = samples[PROTOCOLS[-1]][1]
    total = sum(counts.values())
    grown = last.rss_kib - baseline.rss_kib
    rows.append([
        "total", f"{total:,}", f"{grown / 1024:.1f}", f"{grown / total:.2f}" if total else "-",
        f"{last.fds - baseline.fds:,}",
    ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


@dataclass
class Run:
    """What one measurement found, for `report`."""

    counts: dict[str, int]
    started: Sample
    baseline: Sample | None = None
    samples: dict[str, tuple[Sample, Sample]] = field(default_factory=dict)
    loaded: dict[str, str] = field(default_factory=dict)
    closed: Sample | None = None
    problems: list[str] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)


def measure(args: argparse.Namespace, scratch: Path) -> int:
    """Run the measurement in ``scratch``; print the table; the exit status."""
    deadline = time.monotonic() + args.limit_seconds
    counts = shares(args.connections)
    limit = raise_open_file_limit()
    needed = sum(counts[n] * CLIENT_FDS_PER_CONNECTION[n] for n in PROTOCOLS) + SPARE_FDS
    if needed > limit:
        print(
            f"{args.connections:,} connections need about {needed:,} descriptors here;"
            f" the open-file limit is {limit:,} (raise the hard limit, ulimit -Hn)",
            file=sys.stderr,
        )
        return 2
    gateway = GatewayProcess(
        scratch / "gateway", config(max(1024, 2 * args.connections)), routes=ROUTES
    ).start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 2 * counts["mtl"] + 64)
    peers = Peers(context)
    run = Run(counts, Sample.of(gateway.pid))
    try:
        started_sockets = open_sockets(gateway.pid)
        warm = check_all(gateway, context)
        run.problems += [f"before: {k}: {v}" for k, v in warm.items() if "failed" in v]
        # The probes' connections are closed; wait until the gateway has let them go.
        wait_until(lambda: open_sockets(gateway.pid) <= started_sockets, SETTLE_SECONDS)
        run.baseline = previous = Sample.of(gateway.pid)
        print(
            f"gateway pid {gateway.pid}: RSS {run.started.rss_kib / 1024:.1f} MB and"
            f" {run.started.fds} fds at start, {previous.rss_kib / 1024:.1f} MB and"
            f" {previous.fds} fds after one exchange per protocol (the baseline)",
            file=sys.stderr,
        )
        for name in PROTOCOLS:
            opened_at = time.monotonic()
            after = open_share(gateway, peers, name, counts[name], deadline)
            run.samples[name] = (previous, after)
            print(
                f"  {name:6} {counts[name]:6,} idle in {time.monotonic() - opened_at:5.1f} s:"
                f" RSS {after.rss_kib / 1024:.1f} MB, {after.fds:,} fds",
                file=sys.stderr,
            )
            previous = after
        run.loaded = check_all(gateway, context)
        run.problems += [f"loaded: {k}: {v}" for k, v in run.loaded.items() if "failed" in v]
        peers.close()
        context.destroy(linger=0)
        settled = wait_until(lambda: open_sockets(gateway.pid) <= started_sockets, SETTLE_SECONDS)
        run.closed = Sample.of(gateway.pid)
        if not settled:
            left = open_sockets(gateway.pid) - started_sockets
            run.problems.append(f"{left} sockets still open after closing")
    finally:
        peers.close()
        context.destroy(linger=0)
        status = gateway.stop()
    run.problems += [f"gateway log: {line[:200]}" for line in log_problems(gateway.output())]
    if status not in (0, -signal.SIGTERM):
        run.problems.append(f"the gateway exited with {status}")
    return report(run)


def report(run: Run) -> int:
    """Print the table and what goes with it; the exit status (0: all well, goal met)."""
    assert run.baseline is not None and run.closed is not None
    baseline, closed = run.baseline, run.closed
    total = sum(run.counts.values())
    peak = run.samples[PROTOCOLS[-1]][1]
    print()
    for line in table(run.counts, run.samples, baseline):
        print(line)
    print()
    print(
        f"baseline (0 connections, after one exchange per protocol): {baseline.rss_kib / 1024:.1f}"
        f" MB, {baseline.fds} fds; at start {run.started.rss_kib / 1024:.1f} MB"
    )
    met = peak.rss_kib < GOAL_MB * 1024
    print(
        f"with {total:,} idle connections: {peak.rss_kib / 1024:.1f} MB RSS, {peak.fds:,} fds;"
        f" goal < {GOAL_MB} MB in all: {'met' if met else 'NOT met'}"
    )
    print(
        f"after closing them all: {closed.rss_kib / 1024:.1f} MB RSS, {closed.fds} fds"
        " (freed memory is not always given back to the system)"
    )
    exchanges = "; ".join(f"{name} {text}" for name, text in run.loaded.items())
    print(f"exchanges with all connections open: {exchanges}")
    print("problems: " + ("none" if not run.problems else ""))
    for problem in run.problems:
        print(f"  {problem}")
    print(
        f"one gateway, {len(PROTOCOLS)} listeners; MTL sessions hold a control and a data"
        f" connection each; the run took {time.monotonic() - run.began:.0f} s"
    )
    return 0 if not run.problems and met else 1


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--connections", type=int, default=10_000, help="idle connections in all (default 10,000)"
    )
    parser.add_argument("--quick", action="store_true", help="500 connections, a smoke run")
    parser.add_argument(
        "--limit-seconds", type=float, default=600.0, help="give up after this long (default 600)"
    )
    args = parser.parse_args()
    if args.quick:
        args.connections = min(args.connections, 500)
    if args.connections < len(PROTOCOLS):
        parser.error(f"--connections: at least {len(PROTOCOLS)}, one per protocol")
    return args


def main() -> None:
    """Measure and print the table."""
    args = arguments()
    stop_on_signals()
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as scratch:
        status = measure(args, Path(scratch))
    sys.exit(status)


if __name__ == "__main__":
    main()
