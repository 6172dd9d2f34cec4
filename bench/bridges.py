"""Every bridge against its endpoints, in one run and one table.

For each path below, the bridge and its baseline(s) are measured in the same
run, each on a fresh gateway (``twistd msggateway``), with independent
clients where they exist (the Go ``ssmpload`` for SSMP, rstream for RabbitMQ
streams, raw pyzmq for MTL) and plain sockets otherwise:

=================  ==========================================  =============================
path               bridge                                      baseline
=================  ==========================================  =============================
ssmp-rabbitmq      SSMP MCAST -> stream upstream -> RabbitMQ,  rstream straight into the
                   ``200`` after RabbitMQ's confirm (ssmpload,  same RabbitMQ (send_batch of
                   1 -> 1, window 5,000, 100 B)                 1,000, 20,000 unconfirmed)
qmqp-durable       QMQP 1 KB -> hub on a durable route,        QMQP listener without routes
                   ``fsync = "always"`` (K after commit)       (every message answered D)
qmqp-hub           QMQP 1 KB -> hub on a direct route          the same unrouted listener
dmp-feed-1         DMP sink -> feed, 1 writer, 100 B           SSMP hub MCAST 1 -> 1 (ssmpload)
dmp-feed           DMP sink -> feed, 4 writers, 100 B          the same
mtl-routed         MTL confirm=full writer -> route ->         MTL test profile, 1 writer to
                   confirm=full reader (window 1,000)          1 reader
ssmp-hub           the gateway's SSMP hub, MCAST 1 -> 1        bench/naive_hub.py, same load
stream-publish     the gateway's stream listener (fsync        RabbitMQ, same rstream client
                   never, as RabbitMQ), rstream publish with   (bench/stream_vs_rabbitmq.py's)
                   confirms
stream-consume     the same, consuming from the first offset   RabbitMQ, same rstream client
=================  ==========================================  =============================

The last three are the single-protocol regression checks. Each round
measures every selected scenario once (baselines shared by several rows are
measured once per round), in the opposite order from the round before; the
table gives the median of the rounds and their spread (min-max). Rates are
messages per second over the time to the last acknowledgement (or delivery),
of a load that sends for ``--seconds``.

Then latency passes (as many as ``--rounds``, alternating order) at a fixed
10,000 messages a second (one connection, 100-byte bodies, 1 KB for QMQP;
the paced clients first send half a second at that rate that is not
counted): the bridge's p50/p99 and the p99 of its slower endpoint measured
the same way (medians over the passes, with the spread of p99), and the
difference between the bridge's p99 and the slower endpoint's within each
pass (median). What is timed, per path: ssmp-rabbitmq, MCAST to its
``200`` (a paced SSMP client) against rstream's publish to confirm (paced,
one message a frame) and the hub's MCAST to delivery (ssmpload ``-rate``);
qmqp-hub and qmqp-durable, a block to its K against the unrouted listener's
block to D (and the hub, for the direct route; a subscriber on the hub
checks that each K'd message arrives once); dmp-feed, sink write to feed
read against the hub; mtl-routed, writer Content to reader Content against
the test profile (the writer's Confirm round trip is in the notes);
ssmp-hub and stream-publish, the gateway against the baseline. The
SSMP -> RabbitMQ runs read the stream back and check that every
acknowledged payload is there once.

With ``--before-tree TREE`` (a checkout of earlier code, such as ``git
worktree add /tmp/before HEAD~3``), each round also measures every selected
row's bridge on a gateway running that tree's code, against the same round's
baseline: the *before* column then comes from the same run.

The machine is shared: each measurement records how many cores other
processes kept busy meanwhile, and a table cell that rests on a disturbed
measurement is marked ``*``; ``--quiet-seconds N`` waits (at most N
seconds) for the machine to calm down before each measurement. The gateway's
route metrics (outcomes other than accepted, messages left in flight) and
error lines in its log are listed under the table with the clients' own
checks (loss, duplicates and disorder seen by ssmpload, replies other than
expected, counts that do not add up).

Bounded: every load sends for ``--seconds`` (and at most a fixed count),
waits a bounded time for what is outstanding, and every child process has
a time limit; ``--budget-seconds`` stops starting new measurements. Child
processes (gateways, ssmpload, rstream clients, the naive hub, the private
RabbitMQ node) are stopped on exit, SIGTERM and Ctrl-C, and the temporary
directory is removed.

Run (RabbitMQ is installed if missing, as root; Go is needed for ssmpload,
``apt-get install -y golang-go``)::

    .venv/bin/python bench/bridges.py                    # 3 rounds, 5 s each
    .venv/bin/python bench/bridges.py --quick            # a smoke run
    .venv/bin/python bench/bridges.py --only qmqp-hub --only dmp-feed --json out.json
    .venv/bin/python bench/bridges.py --compare out.json # ratios against an earlier run

Other options: ``--rounds N``, ``--latency-seconds S``, ``--no-latency``,
``--latency-rounds N``, ``--quiet-seconds N``, ``--budget-seconds S``,
``--ssmpload PATH``, ``--before OLD.json`` (an earlier run's ratio and gateway
CPU per message in a column of their own), ``--before-tree TREE`` (above).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import select
import selectors
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stream_vs_rabbitmq  # noqa: E402
from bench.dmp_sink_to_feed import envelope, opened, take_envelopes  # noqa: E402
from bench.gateway_proc import scrape, stop_on_signals  # noqa: E402
from bench.mtl_flow import EMPTY_TABLE, U64, lease, settle, short, summon  # noqa: E402
from bench.profiles import Recording, top  # noqa: E402
from bench.ssmp_hub import build_ssmpload, load_figures, naive_server  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402
from tests.rabbitmq import RabbitMQError, RabbitMQNode  # noqa: E402

LATENCY_RATE: Final = 10_000
"""Messages a second in the latency passes."""
MESSAGE_BYTES: Final = 100
QMQP_BODY_BYTES: Final = 1000
QMQP_CHUNK: Final = 1000
"""QMQP blocks per write of the throughput client."""
DMP_WRITERS: Final = 4
DMP_BATCH: Final = 1000
DMP_WINDOW: Final = 200_000
"""Envelopes written and not yet read, at most (about 22 MB; the feed's backlog limit is 64 MiB)."""
SSMP_WINDOW: Final = 5000
"""ssmpload's unanswered requests on the path into RabbitMQ (as bench/ssmp_to_rabbitmq.py)."""
MTL_ROUTED_WINDOW: Final = 1000
MTL_TEST_WINDOW: Final = 2000
DRAIN_SECONDS: Final = 60.0
"""After a load stops sending: the most it may wait for what is outstanding."""
WARMUP_SECONDS: Final = 0.5
"""Each paced load first sends this long at the same rate, not counted."""
DELTA_P99_TARGET_MS: Final = 0.3
REGRESSION_TOLERANCE: Final = 0.05
BUSY_CORES: Final = 0.3
"""Other processes busier than this during a measurement: it is marked * in the table."""
TREE_TWISTD: Final = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from twisted.scripts.twistd import run; run()"
)
"""twistd with the source tree named by its first argument ahead of this checkout."""
BEFORE: Final = " @before"
"""Appended to a scenario's name when it runs on the ``--before-tree`` code."""
LOG_PROBLEM: Final = re.compile(r"Traceback|Unhandled|CRITICAL|\berror\b|\bfailed\b", re.IGNORECASE)

# --- gateway configurations (each scenario gets a fresh gateway) -----------------------------

HEAD = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"
"""

HUB = """
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
max_pending_replies = 100000
"""

SSMP_RABBIT = (
    HEAD
    + HUB
    + """
[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
create_streams = true
"""
)
SSMP_RABBIT_ROUTE = 'from = "hub"\nmatch = "bench"\nto = "rabbit"\naddress = "{stream}"\n'

STREAM_SERVER = (
    HEAD
    + """
[log]
fsync = "never"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""
)

QMQP = (
    HEAD
    + HUB
    + """
[log]
fsync = "always"

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""
)
QMQP_ROUTE = 'from = "mail"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n'

DMP = (
    HEAD
    + """
[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["in"]
feeds = ["out"]
heartbeat_seconds = 5
max_backlog_bytes = 67108864

[listeners.dmp.leases]
writer = { sink = "in", text = "w" }
reader = { feed = "out", text = "r" }
"""
)
DMP_ROUTE = 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n'

MTL = (
    HEAD
    + """
[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mtl2]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
"""
)
MTL_ROUTE = 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n'

# --- the run's state ---------------------------------------------------------------------


class Skipped(Exception):  # noqa: N818 (a state, reported in the table)
    """A measurement that cannot run here (no RabbitMQ, no time left)."""


@dataclass
class Bench:
    """What the measurements share: options, the scratch directory, tools, RabbitMQ."""

    args: argparse.Namespace
    scratch: Path
    stack: contextlib.ExitStack
    ssmpload: Path | None = None
    node: RabbitMQNode | None = None
    node_error: str | None = None
    started: float = field(default_factory=time.monotonic)
    notes: list[str] = field(default_factory=list)
    tree: Path | None = None
    """Run gateways from this source tree instead of this checkout (``--before-tree``)."""
    _gateways: int = 0

    @property
    def seconds(self) -> float:
        """How long each throughput load sends."""
        return float(self.args.seconds)

    @property
    def max_count(self) -> int:
        """The most messages any throughput load sends."""
        return 30_000 if self.args.quick else 20_000_000

    def tool(self) -> Path:
        """The ssmpload binary (built into the scratch directory on first use)."""
        if self.ssmpload is None:
            if self.args.ssmpload:
                self.ssmpload = Path(self.args.ssmpload)
            elif shutil.which("go") is None:
                raise Skipped("no ssmpload: Go is missing (apt-get install -y golang-go)")
            else:
                self.ssmpload = build_ssmpload(self.scratch / "ssmpload")
        return self.ssmpload

    def rabbit(self) -> RabbitMQNode:
        """The run's private RabbitMQ node, started on first use."""
        if self.node_error:
            raise Skipped(self.node_error)
        if self.node is None:
            try:
                self.node = self.stack.enter_context(RabbitMQNode())
            except RabbitMQError as exc:
                self.node_error = f"RabbitMQ: {str(exc).splitlines()[0]}"
                raise Skipped(self.node_error) from None
            self.notes.append(f"RabbitMQ {self.node.version()} (private node, whole run)")
        return self.node

    @contextlib.contextmanager
    def gateway(
        self, config: str, routes: dict[str, str] | None, record: dict[str, Any]
    ) -> Iterator[GatewayProcess]:
        """A fresh gateway; afterwards its route metrics and log problems go into ``record``."""
        self._gateways += 1
        directory = self.scratch / f"gateway-{self._gateways}"
        launcher = None
        if self.tree is not None:  # that tree's gateway package first on the path
            launcher = [sys.executable, "-c", TREE_TWISTD, str(self.tree),
                        "--nodaemon", "--pidfile=", "--logfile=-", "msggateway"]  # fmt: skip
        process = GatewayProcess(directory, config, routes=routes, launcher=launcher).start()
        recording = None
        try:
            if self.args.profile is not None:
                output = self.args.profile / f"gateway-{self._gateways}.txt"
                recording = Recording(process.pid, output)
                record.setdefault("profiles", []).append(str(output))
            yield process
        finally:
            if recording is not None:
                recording.stop()
            with contextlib.suppress(Exception):
                record["metrics"] = scrape(process)
            process.stop()
            problems = [line.strip() for line in process.output().splitlines()]
            record["log_problems"] = [line for line in problems if LOG_PROBLEM.search(line)][:20]
            shutil.rmtree(directory, ignore_errors=True)


def metric_problems(figures: dict[str, float]) -> list[str]:
    """Route outcomes other than accepted, messages still in flight, protocol errors."""
    found = []
    for name, value in figures.items():
        bad = (
            ('outcome="retry"' in name or 'outcome="rejected"' in name)
            or name.startswith("msggateway_route_in_flight")
            or name.startswith(("msggateway_protocol_errors", "msggateway_slow_consumer"))
        )
        if bad and value and not name.endswith("_created"):
            found.append(f"{name} = {value:g}")
    return found


# --- small helpers -----------------------------------------------------------------------


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50, p99 and max of latencies in seconds, as microseconds."""
    if not samples:
        return {}
    ordered = sorted(samples)

    def at(share: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))] * 1e6

    return {"p50_us": at(0.50), "p99_us": at(0.99), "max_us": ordered[-1] * 1e6}


def timestamped(size: int = MESSAGE_BYTES) -> Callable[[], bytes]:
    """A body maker: 8 bytes of perf_counter_ns, then padding up to ``size``."""
    padding = b"x" * (size - 8)
    return lambda: struct.pack(">Q", time.perf_counter_ns()) + padding


def rstream_child(spec: dict[str, Any], limit: float) -> dict[str, Any]:
    """Run bench/stream_vs_rabbitmq.py's rstream client in a child process; its figures."""
    script = stream_vs_rabbitmq.__file__
    done = subprocess.run(
        [sys.executable, script, "--client", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=limit,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"rstream client exited with {done.returncode}: {done.stderr[-1000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def phase_rate(phase: dict[str, Any]) -> float | None:
    """Messages a second of a finished rstream phase."""
    if phase.get("status") != "ok" or not phase.get("seconds"):
        return None
    return float(phase["messages"]) / float(phase["seconds"])


# --- throughput loads --------------------------------------------------------------------


def ssmpload_rate(bench: Bench, port: int, pid: int, extra: list[str], key: str) -> dict[str, Any]:
    """Run ssmpload MCAST 1 -> 1 for ``--seconds``; its figure ``key`` is the rate."""
    figures, problem = load_figures(
        bench.tool(),
        port,
        pid,
        ["-mode", "mcast", "-pubs", "1", "-subs", "1", "-max", str(bench.max_count),
         "-duration", f"{bench.seconds:g}s", *extra],
        timeout=bench.seconds + DRAIN_SECONDS,
    )  # fmt: skip
    problems = [problem] if problem else []
    if figures.get("errs"):
        problems.append(f"{figures['errs']:.0f} requests answered other than 200")
    handled = figures["acked"] if key == "ack_rate" else figures["delivered"]
    return {
        "rates": {"rate": figures[key]},
        "messages": {"rate": handled},
        "server_cpu": figures["srv_cpu_pct"] / 100 * figures["wall_s"],  # during the load
        "figures": figures,
        "problems": problems,
    }


def rstream_rates(bench: Bench, connection: dict[str, Any], pid: int | None) -> dict[str, Any]:
    """Publish with rstream for ``--seconds`` with confirms, then consume it all; both rates."""
    spec = {
        "connection": connection,
        "server_pid": pid,
        "count": bench.max_count,
        "seconds": bench.seconds,
        "size": stream_vs_rabbitmq.MESSAGE_BYTES,
        "batch": stream_vs_rabbitmq.BATCH_MESSAGES,
        "max_unconfirmed": stream_vs_rabbitmq.MAX_UNCONFIRMED,
        "phase_timeout": bench.seconds + DRAIN_SECONDS,
        "confirms": "frames",
    }
    result = rstream_child(spec, 2 * (bench.seconds + DRAIN_SECONDS) + 30)
    publish, consume = result["publish"], result["consume"]
    problems = [
        f"{name}: {phase.get('status')}"
        for name, phase in (("publish", publish), ("consume", consume))
        if phase.get("status") != "ok"
    ]
    if publish.get("failed"):
        problems.append(f"publish: {publish['failed']} PublishErrors")
    if consume.get("status") == "ok" and consume.get("offsets_backwards"):
        problems.append(f"consume: {consume['offsets_backwards']} offsets went backwards")
    rates = {"publish": phase_rate(publish), "consume": phase_rate(consume)}
    figures = {
        "stream": result["stream"],
        "confirmed": publish.get("confirmed"),
        "received": consume.get("received"),
        "server_cpu_publish": publish.get("server_cpu"),
        "server_cpu_consume": consume.get("server_cpu"),
    }
    cpu_us = {
        phase: float(figures[f"server_cpu_{phase}"]) * 1e6 / float(count)
        for phase, count in (("publish", figures["confirmed"]), ("consume", figures["received"]))
        if figures[f"server_cpu_{phase}"] is not None and count
    }
    return {"rates": rates, "cpu_us": cpu_us, "figures": figures, "problems": problems}


def qmqp_chunk_template() -> bytes:
    """``QMQP_CHUNK`` message blocks of about 1 KB, ids ``cXXXXXX-0000`` and up."""
    blocks = []
    for index in range(QMQP_CHUNK):
        body = (
            b"From: bench@example.org\nSubject: message %d\n\n" % index
            + b"x" * QMQP_BODY_BYTES
            + b"\n"
        )
        block = qmqp.MessageBlock(
            id=b"cXXXXXX-%04d" % index,
            message=body,
            sender=b"bench@example.org",
            recipients=(b"ops@example.org",),
        )
        blocks.append(qmqp.encode(block))
    return b"".join(blocks)


def qmqp_flood(address: tuple[str, int], seconds: float, max_count: int) -> dict[str, Any]:
    """Stream 1 KB blocks on one connection for ``seconds``; count the replies.

    A sender thread writes chunks of `QMQP_CHUNK` blocks (unique ids) as fast
    as the gateway reads them, then the done block; this thread decodes the
    replies until the gateway's done block, or ``DRAIN_SECONDS`` after sending
    stopped.
    """
    template = qmqp_chunk_template()
    sock = socket.create_connection(address)
    sock.settimeout(seconds + DRAIN_SECONDS)
    sent = [0]
    failure: list[str] = []

    def send() -> None:
        stop_at = time.monotonic() + seconds
        try:
            chunk = 0
            while sent[0] + QMQP_CHUNK <= max_count and time.monotonic() < stop_at:
                sock.sendall(template.replace(b"cXXXXXX", b"c%06d" % chunk))
                chunk += 1
                sent[0] += QMQP_CHUNK
            sock.sendall(qmqp.DONE_BYTES)
        except OSError as exc:
            failure.append(f"sending: {exc}")

    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    statuses: dict[str, int] = {}
    replies = 0
    started = last = time.monotonic()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    deadline = started + seconds + DRAIN_SECONDS
    done = False
    try:
        while not done and time.monotonic() < deadline:
            data = sock.recv(1 << 20)
            if not data:
                break
            now = time.monotonic()
            for reply in codec.receive_data(data):
                if isinstance(reply, qmqp.ReplyBlock):
                    replies += 1
                    status = reply.status.decode()
                    statuses[status] = statuses.get(status, 0) + 1
                    last = now
                else:
                    done = True
    except OSError as exc:
        failure.append(f"receiving: {exc}")
    finally:
        sock.close()
    sender.join(5)
    problems = list(failure)
    if replies != sent[0]:
        problems.append(f"{sent[0]} sent, {replies} answered")
    elapsed = last - started
    return {
        "rates": {"rate": replies / elapsed if elapsed > 0 else None},
        "messages": {"rate": replies},
        "figures": {"sent": sent[0], "statuses": statuses, "seconds": elapsed},
        "problems": problems,
    }


def qmqp_status_problems(result: dict[str, Any], expected: str) -> None:
    """Add a problem when replies other than ``expected`` came back."""
    others = {k: v for k, v in result["figures"]["statuses"].items() if k != expected}
    if others:
        result["problems"].append(f"replies other than {expected}: {others}")


def dmp_flood(
    address: tuple[str, int], seconds: float, max_count: int, writers_count: int = DMP_WRITERS
) -> dict[str, Any]:
    """``writers_count`` writers write 100-byte envelopes for ``seconds``; one reader counts them.

    DMP has no acknowledgement, so the writers keep at most `DMP_WINDOW`
    envelopes written and not yet read: past ``max_backlog_bytes`` the
    gateway drops what a feed's reader is behind on (as designed), and a
    measurement of that would count the drops, not the bridge.
    """
    reader = opened(address, b"r")
    writers = [opened(address, b"w") for _ in range(writers_count)]
    batch = envelope(b"x" * MESSAGE_BYTES) * DMP_BATCH
    per_writer = max_count // writers_count
    written = [0] * writers_count
    failure: list[str] = []
    stop_at = time.monotonic() + seconds

    seen = 0

    def write(number: int, sock: socket.socket) -> None:
        try:
            while written[number] + DMP_BATCH <= per_writer and time.monotonic() < stop_at:
                if sum(written) - seen > DMP_WINDOW:
                    time.sleep(0.001)
                    continue
                sock.sendall(batch)
                written[number] += DMP_BATCH
        except OSError as exc:
            failure.append(f"writer {number}: {exc}")

    threads = [
        threading.Thread(target=write, args=(n, s), daemon=True) for n, s in enumerate(writers)
    ]
    started = last = time.monotonic()
    for thread in threads:
        thread.start()
    deadline = started + seconds + DRAIN_SECONDS
    buffer = bytearray()
    reader.settimeout(0.5)
    heartbeat = started
    try:
        while time.monotonic() < deadline:
            if not any(t.is_alive() for t in threads) and seen >= sum(written):
                break
            if time.monotonic() - heartbeat > 1:
                reader.sendall(b"\0\0\0\0")  # a null message: this reader is alive
                heartbeat = time.monotonic()
            try:
                chunk = reader.recv(1 << 20)
            except TimeoutError:
                if not any(t.is_alive() for t in threads):
                    idle = time.monotonic() - last
                    if idle > 5:  # everything written, nothing more arriving
                        break
                continue
            if not chunk:
                failure.append("the feed closed")
                break
            buffer += chunk
            arrived = len(take_envelopes(buffer))
            if arrived:
                seen += arrived
                last = time.monotonic()
    finally:
        for sock in (reader, *writers):
            sock.close()
        for thread in threads:
            thread.join(5)
    total = sum(written)
    problems = list(failure)
    if seen != total:
        problems.append(f"{total} written, {seen} read")
    elapsed = last - started
    return {
        "rates": {"rate": seen / elapsed if elapsed > 0 else None},
        "messages": {"rate": seen},
        "figures": {"written": total, "read": seen, "seconds": elapsed},
        "problems": problems,
    }


def mtl_test_flood(port: int, seconds: float, max_count: int) -> dict[str, Any]:
    """MTL test profile, one writer (thread, window 2,000) to one reader, for ``seconds``."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        reader = lease(context, port, "test", "Reader", ["resource"], "none")
        summon(reader, "resource")
        writer = lease(context, port, "test", "Writer", [], "none")
        window = threading.Semaphore(MTL_TEST_WINDOW)
        stop = threading.Event()
        sent = [0]
        stop_at = time.monotonic() + seconds

        def write() -> None:
            head = short("") + EMPTY_TABLE
            body = b"x" * MESSAGE_BYTES
            while sent[0] < max_count and time.monotonic() < stop_at and not stop.is_set():
                if not window.acquire(timeout=1):
                    continue
                sent[0] += 1
                writer.send_multipart([b"\x05" + U64.pack(sent[0]) + head, body])

        thread = threading.Thread(target=write, daemon=True)
        started = last = time.monotonic()
        thread.start()
        got = 0
        deadline = started + seconds + DRAIN_SECONDS
        while time.monotonic() < deadline:
            if not thread.is_alive() and got >= sent[0]:
                break
            if not reader.poll(1000):
                if not thread.is_alive() and time.monotonic() - last > 5:
                    break
                continue
            header, _ = reader.recv_multipart()
            if header[0] == 0x05:
                got += 1
                last = time.monotonic()
                window.release()
            elif header[0] == 0x08:
                reader.send_multipart([b"\x09", b""])
        stop.set()
        thread.join(5)
    finally:
        context.destroy(linger=0)
    problems = [] if got == sent[0] else [f"{sent[0]} sent, {got} delivered"]
    elapsed = last - started
    return {
        "rates": {"rate": got / elapsed if elapsed > 0 else None},
        "messages": {"rate": got},
        "figures": {"sent": sent[0], "delivered": got, "seconds": elapsed},
        "problems": problems,
    }


def mtl_routed_flood(port: int, port2: int, seconds: float, max_count: int) -> dict[str, Any]:
    """confirm=full writer -> route -> confirm=full reader; Confirms counted, for ``seconds``."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    confirmed = rejected = delivered = sent = 0
    try:
        reader = lease(context, port2, "gateway", "Reader", ["out"], "full")
        summon(reader, "out")
        writer = lease(context, port, "gateway", "Writer", ["in"], "full")
        head = short("") + EMPTY_TABLE
        body = b"x" * MESSAGE_BYTES
        poller = zmq.Poller()
        poller.register(reader, zmq.POLLIN)
        poller.register(writer, zmq.POLLIN)
        unsettled: dict[int, None] = {}
        started = last = time.monotonic()
        stop_at = started + seconds
        deadline = stop_at + DRAIN_SECONDS
        while time.monotonic() < deadline:
            sending = sent < max_count and time.monotonic() < stop_at
            if not sending and not unsettled:
                break
            while sending and len(unsettled) < MTL_ROUTED_WINDOW:
                sent += 1
                unsettled[sent] = None
                writer.send_multipart([b"\x05" + U64.pack(sent) + head, body])
            if not poller.poll(1000):
                if not sending and time.monotonic() - last > 5:
                    break
                continue
            for sock in (reader, writer):
                while sock.poll(0):
                    header, _ = sock.recv_multipart()
                    kind = header[0]
                    if sock is reader and kind == 0x05:
                        delivered += 1
                        sock.send_multipart([b"\x06" + header[1:9] + b"\x00", b""])
                    elif sock is writer and kind in (0x06, 0x07):
                        settled = settle(unsettled, header)
                        if kind == 0x06:
                            confirmed += settled
                        else:
                            rejected += settled
                        last = time.monotonic()
                    elif kind == 0x08:
                        sock.send_multipart([b"\x09", b""])
    finally:
        context.destroy(linger=0)
    problems = []
    if rejected:
        problems.append(f"{rejected} Rejects")
    if confirmed != sent:
        problems.append(f"{sent} sent, {confirmed} confirmed, {delivered} delivered")
    elapsed = last - started
    return {
        "rates": {"rate": confirmed / elapsed if elapsed > 0 else None},
        "messages": {"rate": confirmed},
        "figures": {"sent": sent, "confirmed": confirmed, "delivered": delivered},
        "problems": problems,
    }


PAYLOAD_SEQUENCE: Final = re.compile(rb"([0-9a-f]{16})(?:[0-9a-f]{16})?xxxxxxxx")
"""Where an entry's payload starts: ssmpload's 16 hex digits of sequence and 16 of time
then padding, or the paced client's sequence then padding."""


async def _read_stream(
    connection: dict[str, Any], stream: str, expected: int, limit: float
) -> dict[str, int]:
    """The asyncio side of `check_stream`."""
    import rstream

    sequences: dict[bytes | None, int] = {}
    received = 0
    enough = asyncio.Event()

    def on_message(body: bytes, _context: Any) -> None:
        nonlocal received
        received += 1
        found = PAYLOAD_SEQUENCE.search(body)
        key = found.group(1) if found else None
        sequences[key] = sequences.get(key, 0) + 1
        if received >= expected:
            enough.set()

    consumer = rstream.Consumer(**connection)
    await consumer.start()
    runner = None
    try:
        first = rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST)
        await consumer.subscribe(stream, on_message, offset_specification=first)
        runner = asyncio.create_task(consumer.run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), limit)
        await asyncio.sleep(0.5)  # anything past what was expected: duplicates
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer.close(), 10)
        if runner is not None:
            runner.cancel()
    unreadable = sequences.pop(None, 0)
    return {"read": received, "distinct": len(sequences), "unreadable": unreadable}


def check_stream(
    connection: dict[str, Any], stream: str, acked: int, result: dict[str, Any]
) -> list[str]:
    """Read back what the gateway put in a RabbitMQ stream: each acknowledged payload once?

    Puts the counts into ``result["figures"]["in_rabbitmq"]``; returns the problems.
    """
    counts = asyncio.run(_read_stream(connection, stream, acked, 30))
    result["figures"]["in_rabbitmq"] = counts
    duplicates = counts["read"] - counts["distinct"] - counts["unreadable"]
    problems = []
    if counts["distinct"] < acked or duplicates or counts["unreadable"]:
        problems.append(
            f"{acked} acknowledged 200, RabbitMQ has {counts['read']} ({counts['distinct']}"
            f" distinct, {duplicates} duplicates, {counts['unreadable']} unreadable)"
        )
    return problems


# --- throughput scenarios ----------------------------------------------------------------


@contextlib.contextmanager
def cpu_window(pid: int, record: dict[str, Any]) -> Iterator[None]:
    """Put the CPU seconds process ``pid`` used during the block into ``record["server_cpu"]``."""
    started = stream_vs_rabbitmq._cpu_seconds(pid)
    try:
        yield
    finally:
        ended = stream_vs_rabbitmq._cpu_seconds(pid)
        if started is not None and ended is not None:
            record["server_cpu"] = ended - started


def t_ssmp_rabbitmq(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """SSMP MCAST through a direct route into RabbitMQ, acknowledged after the confirm."""
    node = bench.rabbit()
    stream = f"bridge-{uuid.uuid4().hex[:10]}"
    config = SSMP_RABBIT.format(port=node.stream_connection()["port"])
    routes = {"bench": SSMP_RABBIT_ROUTE.format(stream=stream)}
    try:
        with bench.gateway(config, routes, record) as gateway:
            gateway.wait_for_log("upstream rabbit: connected", 30)
            result = ssmpload_rate(
                bench, gateway.address("hub")[1], gateway.pid,
                ["-window", str(SSMP_WINDOW), "-topic", "bench"], "ack_rate",
            )  # fmt: skip
        acked = int(result["figures"]["acked"])
        result["problems"] += check_stream(node.stream_connection(), stream, acked, result)
        return result
    finally:
        with contextlib.suppress(Exception):
            node.delete_stream(stream)


def t_rabbitmq(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """Straight into RabbitMQ with rstream: publish with confirms, then consume."""
    node = bench.rabbit()
    result = rstream_rates(bench, node.stream_connection(), node.server_pid)
    with contextlib.suppress(Exception):
        node.delete_stream(result["figures"]["stream"])
    return result


def t_stream_server(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """The gateway's stream listener (fsync never, as a single RabbitMQ node) with rstream."""
    with bench.gateway(STREAM_SERVER, None, record) as gateway:
        host, port = gateway.address("streams")
        connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
        return rstream_rates(bench, connection, gateway.pid)


def t_qmqp(route: str | None, expected: str) -> Callable[[Bench, dict[str, Any]], dict[str, Any]]:
    """A QMQP scenario: the listener with ``route`` (None: no route), replies ``expected``."""

    def run(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
        routes = {"to-hub": route} if route else None
        with bench.gateway(QMQP, routes, record) as gateway, cpu_window(gateway.pid, record):
            result = qmqp_flood(gateway.address("mail"), bench.seconds, bench.max_count)
        qmqp_status_problems(result, expected)
        return result

    run.__doc__ = f"QMQP 1 KB blocks, answered {expected}."
    return run


def t_dmp(writers: int) -> Callable[[Bench, dict[str, Any]], dict[str, Any]]:
    """DMP sink routed (direct) to a feed of the same listener, ``writers`` writers."""

    def run(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
        with (
            bench.gateway(DMP, {"loop": DMP_ROUTE}, record) as gateway,
            cpu_window(gateway.pid, record),
        ):
            return dmp_flood(gateway.address("dmp"), bench.seconds, bench.max_count, writers)

    run.__doc__ = f"DMP sink routed (direct) to a feed of the same listener, {writers} writer(s)."
    return run


def t_hub(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """The gateway's SSMP hub, MCAST 1 -> 1 as fast as possible (deliveries/s)."""
    with bench.gateway(HEAD + HUB, None, record) as gateway:
        return ssmpload_rate(bench, gateway.address("hub")[1], gateway.pid, [], "deliv_rate")


def t_naive_hub(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """bench/naive_hub.py, MCAST 1 -> 1 as fast as possible (deliveries/s)."""
    bench.tool()  # built before the server starts
    with naive_server() as (port, pid):
        return ssmpload_rate(bench, port, pid, [], "deliv_rate")


def t_mtl_routed(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """MTL confirm=full through a route to a confirm=full reader."""
    with bench.gateway(MTL, {"across": MTL_ROUTE}, record) as gateway:
        ports = gateway.address("mtl")[1], gateway.address("mtl2")[1]
        with cpu_window(gateway.pid, record):
            return mtl_routed_flood(*ports, bench.seconds, bench.max_count)


def t_mtl_test(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """MTL test profile, one writer to one reader."""
    with bench.gateway(MTL, None, record) as gateway, cpu_window(gateway.pid, record):
        return mtl_test_flood(gateway.address("mtl")[1], bench.seconds, bench.max_count)


DURABLE_ROUTE = QMQP_ROUTE + "durable = true\n"

THROUGHPUT: Final[dict[str, Callable[[Bench, dict[str, Any]], dict[str, Any]]]] = {
    "ssmp->rabbitmq": t_ssmp_rabbitmq,
    "rabbitmq (rstream)": t_rabbitmq,
    "qmqp durable": t_qmqp(DURABLE_ROUTE, "K"),
    "qmqp direct": t_qmqp(QMQP_ROUTE, "K"),
    "qmqp unrouted": t_qmqp(None, "D"),
    "dmp sink->feed 1": t_dmp(1),
    "dmp sink->feed": t_dmp(DMP_WRITERS),
    "hub mcast 1->1": t_hub,
    "naive hub 1->1": t_naive_hub,
    "mtl routed": t_mtl_routed,
    "mtl test 1->1": t_mtl_test,
    "stream server": t_stream_server,
}

# --- paced latency clients ---------------------------------------------------------------


class Pacer:
    """When the messages of a paced load are due; which of them are the warm-up.

    ``count`` messages at ``rate`` a second, after `WARMUP_SECONDS` of
    warm-up at the same rate (first connection, first publisher, a fresh
    stream: their latencies are not counted). `samples` keeps the latencies
    of what was sent after the warm-up.
    """

    def __init__(self, rate: float, count: int) -> None:
        self.rate = rate
        self.warmup = int(rate * WARMUP_SECONDS)
        self.count = count + self.warmup
        self.next = 0
        self.start = time.perf_counter()
        self.measured_from = self.start + WARMUP_SECONDS
        self.samples: list[float] = []

    def due(self) -> int:
        """How many messages are due now and not yet sent (moves past them)."""
        now = time.perf_counter()
        due = min(self.count, int((now - self.start) * self.rate) + 1)
        ready = max(0, due - self.next)
        self.next += ready
        return ready

    def wait(self, idle: float = 0.05) -> float:
        """Seconds until the next message is due (``idle`` once all are sent)."""
        if self.next >= self.count:
            return idle
        return max(0.0, self.start + self.next / self.rate - time.perf_counter())

    def deadline(self) -> float:
        """When the load gives up on what is outstanding."""
        return self.start + self.count / self.rate + DRAIN_SECONDS

    def sample(self, sent_at: float, now: float) -> None:
        """One message's latency (perf_counter seconds), unless it was sent in the warm-up."""
        if sent_at >= self.measured_from:
            self.samples.append(now - sent_at)

    def sample_body(self, body: bytes, now: float) -> None:
        """The latency of a body made by `timestamped`."""
        self.sample(struct.unpack_from(">Q", body)[0] / 1e9, now)

    def result(
        self, sent: int, answered: int, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A latency measurement's record."""
        problems = [] if answered == sent else [f"{sent} sent, {answered} answered"]
        figures = {"sent": sent, "answered": answered, "warmup": self.warmup, **(extra or {})}
        return {"latency": percentiles(self.samples), "figures": figures, "problems": problems}


def ssmp_paced(address: tuple[str, int], topic: bytes, count: int) -> dict[str, Any]:
    """MCASTs at `LATENCY_RATE` on one connection; the time from each to its 200."""
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"LOGIN pacer open\n")
    buffer = b""
    while b"\n" not in buffer:
        buffer += sock.recv(4096)
    line, _, buffer = buffer.partition(b"\n")
    if not line.startswith(b"200"):
        raise RuntimeError(f"LOGIN answered {line!r}")
    prefix, padding = b"MCAST " + topic + b" ", b"x" * (MESSAGE_BYTES - 16) + b"\n"
    sent_at: list[float] = []
    answered = errors = 0
    pacer = Pacer(LATENCY_RATE, count)
    deadline = pacer.deadline()
    try:
        while answered < pacer.count and time.perf_counter() < deadline:
            ready = pacer.due()
            if ready:
                first = len(sent_at)  # payloads: 16 hex digits of the sequence, then x
                sent_at.extend([time.perf_counter()] * ready)
                sock.sendall(
                    b"".join(
                        b"%s%016x%s" % (prefix, n, padding) for n in range(first, first + ready)
                    )
                )
            readable, _, _ = select.select([sock], [], [], pacer.wait())
            if not readable:
                continue
            data = sock.recv(1 << 20)
            now = time.perf_counter()
            if not data:
                break
            *lines, buffer = (buffer + data).split(b"\n")
            for line in lines:
                if line.startswith(b"000 "):  # an event, not an answer
                    if line == b"000 . PING":
                        sock.sendall(b"PONG\n")
                    continue
                if line.startswith(b"200"):  # answers come in request order
                    pacer.sample(sent_at[answered], now)
                else:
                    errors += 1
                answered += 1
    finally:
        sock.close()
    result = pacer.result(len(sent_at), answered, {"errors": errors})
    if errors:
        result["problems"].append(f"{errors} MCASTs answered other than 200")
    return result


def ssmp_subscriber(address: tuple[str, int], topic: bytes) -> socket.socket:
    """An SSMP connection logged in (open) and subscribed to ``topic``."""
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(b"LOGIN watcher open\nSUBSCRIBE " + topic + b"\n")
    buffer = b""
    while buffer.count(b"\n") < 2:
        data = sock.recv(4096)
        if not data:
            raise RuntimeError(f"the hub closed the subscriber: {buffer!r}")
        buffer += data
    answers = buffer.split(b"\n")[:2]
    if not all(answer.startswith(b"200") for answer in answers):
        raise RuntimeError(f"LOGIN and SUBSCRIBE answered {answers!r}")
    return sock


def qmqp_paced(
    address: tuple[str, int], count: int, hub: tuple[str, int] | None = None
) -> dict[str, Any]:
    """1 KB blocks at `LATENCY_RATE` on one connection; the time from each to its reply.

    With ``hub`` (the route takes the Subject to the hub's topic ``mail``), a
    subscriber there checks that every message answered K arrives exactly
    once, and times its delivery (in the figures).
    """
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    watcher = ssmp_subscriber(hub, b"mail") if hub else None
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    sent_at: dict[bytes, float] = {}
    sent_times: list[float] = []
    statuses: dict[str, int] = {}
    pacer = Pacer(LATENCY_RATE, count)
    deliveries = Pacer(LATENCY_RATE, 0)  # only its samples: send to delivery
    deliveries.measured_from = pacer.measured_from
    seen: set[int] = set()
    duplicates = 0
    deadline = pacer.deadline()
    answered = sent = 0
    pending = b""
    sockets = [sock] if watcher is None else [sock, watcher]
    try:
        while time.perf_counter() < deadline:
            if answered >= pacer.count and (watcher is None or len(seen) >= statuses.get("K", 0)):
                break
            ready = pacer.due()
            if ready:
                blocks = []
                for _ in range(ready):
                    ident = b"%d" % sent
                    sent += 1
                    body = (
                        b"From: bench@example.org\nSubject: paced %s\n\n" % ident
                        + b"x" * QMQP_BODY_BYTES
                        + b"\n"
                    )
                    block = qmqp.MessageBlock(
                        id=ident,
                        message=body,
                        sender=b"bench@example.org",
                        recipients=(b"ops@example.org",),
                    )
                    blocks.append(qmqp.encode(block))
                    sent_at[ident] = time.perf_counter()
                    sent_times.append(sent_at[ident])
                sock.sendall(b"".join(blocks))
            readable, _, _ = select.select(sockets, [], [], pacer.wait())
            now = time.perf_counter()
            if watcher is not None and watcher in readable:
                data = watcher.recv(1 << 20)
                if not data:
                    raise RuntimeError("the hub closed the subscriber")
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line == b"000 . PING":
                        watcher.sendall(b"PONG\n")
                    elif line.startswith(b"000 ") and b" MCAST mail paced " in line:
                        number = int(line.rsplit(b" ", 1)[1])
                        duplicates += number in seen
                        seen.add(number)
                        deliveries.sample(sent_times[number], now)
            if sock not in readable:
                continue
            data = sock.recv(1 << 20)
            if not data:
                break
            for reply in codec.receive_data(data):
                if isinstance(reply, qmqp.ReplyBlock):
                    answered += 1
                    status = reply.status.decode()
                    statuses[status] = statuses.get(status, 0) + 1
                    at = sent_at.pop(reply.id, None)
                    if at is not None:
                        pacer.sample(at, now)
        with contextlib.suppress(OSError):
            sock.sendall(qmqp.DONE_BYTES)
    finally:
        sock.close()
        if watcher is not None:
            watcher.close()
    extra: dict[str, Any] = {"statuses": statuses}
    if watcher is not None:
        extra.update(delivered=len(seen), duplicates=duplicates)
        extra["delivery"] = percentiles(deliveries.samples)
    result = pacer.result(sent, answered, extra)
    if watcher is not None and (len(seen) != statuses.get("K", 0) or duplicates):
        result["problems"].append(
            f"{statuses.get('K', 0)} answered K, {len(seen)} delivered to the hub,"
            f" {duplicates} duplicates"
        )
    return result


def dmp_paced(address: tuple[str, int], count: int) -> dict[str, Any]:
    """100-byte envelopes at `LATENCY_RATE` into the sink; the time until the feed has each."""
    reader = opened(address, b"r")
    writer = opened(address, b"w")
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    make = timestamped()
    pacer = Pacer(LATENCY_RATE, count)
    deadline = pacer.deadline()
    buffer = bytearray()
    seen = sent = 0
    heartbeat = time.perf_counter()
    try:
        while seen < pacer.count and time.perf_counter() < deadline:
            ready = pacer.due()
            if ready:
                writer.sendall(b"".join(envelope(make()) for _ in range(ready)))
                sent += ready
            if time.perf_counter() - heartbeat > 1:
                reader.sendall(b"\0\0\0\0")  # a null message: this reader is alive
                heartbeat = time.perf_counter()
            readable, _, _ = select.select([reader], [], [], pacer.wait())
            if not readable:
                continue
            data = reader.recv(1 << 20)
            now = time.perf_counter()
            if not data:
                break
            buffer += data
            for found in take_envelopes(buffer):  # the body ends the envelope
                pacer.sample_body(bytes(found[-MESSAGE_BYTES:]), now)
                seen += 1
    finally:
        reader.close()
        writer.close()
    return pacer.result(sent, seen)


def zmq_drain(
    socks: list[zmq.Socket[bytes]], handle: Callable[[zmq.Socket[bytes], list[bytes]], None]
) -> None:
    """Hand every message waiting on the sockets to ``handle`` (edge-triggered FDs need it)."""
    for sock in socks:
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            handle(sock, sock.recv_multipart(zmq.NOBLOCK))


def mtl_paced(port: int, port2: int | None, count: int) -> dict[str, Any]:
    """Contents at `LATENCY_RATE`; the time from writer to reader.

    With ``port2`` (the routed case): gateway profile, confirm=full at both
    ends, a route from ``port``'s listener to ``port2``'s; the reader confirms
    each Content and the writer's Confirm round trip is timed too. Without:
    the test profile on ``port``. One thread: it waits on the sockets' file
    descriptors with ``select`` (microsecond time-outs; ``zmq.poll`` takes
    milliseconds) and drains them after every wake-up.
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    make = timestamped()
    pacer = Pacer(LATENCY_RATE, count)
    confirms = Pacer(LATENCY_RATE, 0)  # only its samples: the Confirm round trips
    confirms.measured_from = pacer.measured_from
    unsettled: dict[int, float] = {}
    counts = {"delivered": 0, "confirmed": 0, "rejected": 0}
    sent = 0
    try:
        if port2 is None:
            reader = lease(context, port, "test", "Reader", ["resource"], "none")
            summon(reader, "resource")
            writer = lease(context, port, "test", "Writer", [], "none")
        else:
            reader = lease(context, port2, "gateway", "Reader", ["out"], "full")
            summon(reader, "out")
            writer = lease(context, port, "gateway", "Writer", ["in"], "full")
        for sock in (reader, writer):
            sock.setsockopt(zmq.SNDTIMEO, 10_000)
        head = short("") + EMPTY_TABLE

        def handle(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
            header = frames[0]
            kind = header[0]
            if sock is reader and kind == 0x05:
                pacer.sample_body(frames[1], time.perf_counter())
                counts["delivered"] += 1
                if port2 is not None:
                    sock.send_multipart([b"\x06" + header[1:9] + b"\x00", b""])
            elif sock is writer and kind in (0x06, 0x07):
                now = time.perf_counter()
                (sequence,) = U64.unpack_from(header, 1)
                multiple = len(header) > 9 and header[9]
                covered = [s for s in unsettled if s <= sequence] if multiple else [sequence]
                for key in covered:
                    at = unsettled.pop(key, None)
                    if at is not None:
                        confirms.sample(at, now)
                        counts["confirmed" if kind == 0x06 else "rejected"] += 1
            elif kind == 0x08:
                sock.send_multipart([b"\x09", b""])

        socks = [reader, writer]
        fds = [int(sock.getsockopt(zmq.FD)) for sock in socks]
        deadline = pacer.deadline()
        while time.perf_counter() < deadline:
            if counts["delivered"] >= pacer.count and (port2 is None or not unsettled):
                break
            for _ in range(pacer.due()):
                sent += 1
                if port2 is not None:
                    unsettled[sent] = time.perf_counter()
                writer.send_multipart([b"\x05" + U64.pack(sent) + head, make()])
            zmq_drain(socks, handle)
            select.select(fds, [], [], pacer.wait(0.01))
            zmq_drain(socks, handle)
    finally:
        context.destroy(linger=0)
    extra: dict[str, Any] = dict(counts)
    if port2 is not None:
        extra["confirm"] = percentiles(confirms.samples)
    result = pacer.result(sent, counts["delivered"], extra)
    if counts["rejected"]:
        result["problems"].append(f"{counts['rejected']} Rejects")
    return result


async def _rstream_paced(connection: dict[str, Any], stream: str, count: int) -> dict[str, Any]:
    """The asyncio side of `rstream_paced`."""
    import rstream

    sent_at: dict[int, float] = {}
    settled = failed = 0
    finished = asyncio.Event()
    pacer = Pacer(LATENCY_RATE, count)

    def on_confirm(status: Any) -> None:
        nonlocal settled, failed
        at = sent_at.pop(status.message_id, None)
        settled += 1
        if not status.is_confirmed:
            failed += 1
        elif at is not None:
            pacer.sample(at, time.perf_counter())
        if settled >= pacer.count:
            finished.set()

    body = b"x" * MESSAGE_BYTES
    producer = rstream.Producer(**connection)
    await producer.start()
    sent = 0
    try:
        await producer.create_stream(stream, exists_ok=True)
        pacer.start = time.perf_counter()
        pacer.measured_from = pacer.start + WARMUP_SECONDS
        while pacer.next < pacer.count:
            for _ in range(pacer.due()):
                sent += 1
                message = rstream.RawMessage(body, publishing_id=sent)
                sent_at[sent] = time.perf_counter()
                await producer.send_batch(
                    stream, [message], publisher_name="pacer", on_publish_confirm=on_confirm
                )
            # Always yield, even when behind: rstream reads confirms in a task of this loop.
            await asyncio.sleep(pacer.wait())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), DRAIN_SECONDS)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.close(), 10)
    result = pacer.result(sent, settled, {"failed": failed})
    if failed:
        result["problems"].append(f"{failed} PublishErrors")
    return result


def rstream_paced(connection: dict[str, Any], stream: str, count: int) -> dict[str, Any]:
    """One message a Publish frame at `LATENCY_RATE` with rstream; the time to each confirm.

    Runs on an asyncio loop over ``select`` (microsecond time-outs; epoll's
    are rounded up to milliseconds, which would bunch the pacing).
    """
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        return loop.run_until_complete(_rstream_paced(connection, stream, count))
    finally:
        loop.close()


# --- latency scenarios -------------------------------------------------------------------


def latency_count(bench: Bench) -> int:
    """Messages in each latency measurement."""
    return int(LATENCY_RATE * bench.args.latency_seconds)


def l_ssmp_rabbitmq(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """MCAST to its 200 through the direct route into RabbitMQ."""
    node = bench.rabbit()
    stream = f"paced-{uuid.uuid4().hex[:10]}"
    config = SSMP_RABBIT.format(port=node.stream_connection()["port"])
    routes = {"bench": SSMP_RABBIT_ROUTE.format(stream=stream)}
    try:
        with bench.gateway(config, routes, record) as gateway:
            gateway.wait_for_log("upstream rabbit: connected", 30)
            result = ssmp_paced(gateway.address("hub"), b"bench", latency_count(bench))
        acked = int(result["figures"]["answered"]) - int(result["figures"]["errors"])
        result["problems"] += check_stream(node.stream_connection(), stream, acked, result)
        return result
    finally:
        with contextlib.suppress(Exception):
            node.delete_stream(stream)


def l_rabbitmq(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """Publish to confirm with rstream, straight into RabbitMQ."""
    node = bench.rabbit()
    stream = f"paced-{uuid.uuid4().hex[:10]}"
    try:
        return rstream_paced(node.stream_connection(), stream, latency_count(bench))
    finally:
        with contextlib.suppress(Exception):
            node.delete_stream(stream)


def l_stream_server(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """Publish to confirm with rstream against the gateway's stream listener (fsync never)."""
    with bench.gateway(STREAM_SERVER, None, record) as gateway:
        host, port = gateway.address("streams")
        connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
        return rstream_paced(connection, "paced", latency_count(bench))


def ssmpload_latency(bench: Bench, port: int, pid: int) -> dict[str, Any]:
    """Run ssmpload MCAST 1 -> 1 at `LATENCY_RATE`: its delivery latency percentiles."""
    count = latency_count(bench)
    figures, problem = load_figures(
        bench.tool(),
        port,
        pid,
        ["-mode", "mcast", "-pubs", "1", "-subs", "1", "-rate", str(LATENCY_RATE),
         "-max", str(count), "-duration", f"{count / LATENCY_RATE + 10:g}s"],
        timeout=count / LATENCY_RATE + DRAIN_SECONDS,
    )  # fmt: skip
    latency = {key: figures[key] for key in ("p50_us", "p99_us", "max_us")}
    return {"latency": latency, "figures": figures, "problems": [problem] if problem else []}


def l_hub(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """The gateway's hub, MCAST to delivery (ssmpload -rate)."""
    with bench.gateway(HEAD + HUB, None, record) as gateway:
        return ssmpload_latency(bench, gateway.address("hub")[1], gateway.pid)


def l_naive_hub(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """The naive hub, MCAST to delivery (ssmpload -rate)."""
    bench.tool()
    with naive_server() as (port, pid):
        return ssmpload_latency(bench, port, pid)


def l_qmqp(route: str | None) -> Callable[[Bench, dict[str, Any]], dict[str, Any]]:
    """A paced QMQP scenario on a listener with ``route`` (None: no route)."""

    def run(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
        routes = {"to-hub": route} if route else None
        with bench.gateway(QMQP, routes, record) as gateway:
            hub = gateway.address("hub") if route else None
            return qmqp_paced(gateway.address("mail"), latency_count(bench), hub)

    run.__doc__ = "QMQP block to reply, " + ("routed to the hub" if route else "no route (D)")
    return run


def l_dmp(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """DMP sink write to feed read, direct route."""
    with bench.gateway(DMP, {"loop": DMP_ROUTE}, record) as gateway:
        return dmp_paced(gateway.address("dmp"), latency_count(bench))


def l_mtl_routed(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """MTL writer to reader through the route, confirm=full both ends."""
    with bench.gateway(MTL, {"across": MTL_ROUTE}, record) as gateway:
        return mtl_paced(
            gateway.address("mtl")[1], gateway.address("mtl2")[1], latency_count(bench)
        )


def l_mtl_test(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
    """MTL test profile, writer to reader."""
    with bench.gateway(MTL, None, record) as gateway:
        return mtl_paced(gateway.address("mtl")[1], None, latency_count(bench))


LATENCY: Final[dict[str, Callable[[Bench, dict[str, Any]], dict[str, Any]]]] = {
    "ssmp->rabbitmq 200": l_ssmp_rabbitmq,
    "rabbitmq confirm": l_rabbitmq,
    "hub mcast 1->1": l_hub,
    "naive hub 1->1": l_naive_hub,
    "qmqp direct K": l_qmqp(QMQP_ROUTE),
    "qmqp durable K": l_qmqp(DURABLE_ROUTE),
    "qmqp unrouted D": l_qmqp(None),
    "dmp sink->feed": l_dmp,
    "mtl routed": l_mtl_routed,
    "mtl test 1->1": l_mtl_test,
    "stream server confirm": l_stream_server,
}

RABBITMQ_SCENARIOS: Final = frozenset(
    {"ssmp->rabbitmq", "rabbitmq (rstream)", "ssmp->rabbitmq 200", "rabbitmq confirm"}
)

# --- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: a bridge, its baseline, what is hoped of them."""

    path: str
    title: str
    bridge: str
    baseline: str
    target: float | None = None
    """The ratio asked for (None: a regression row, compared with ``--compare``)."""
    bridge_key: str = "rate"
    baseline_key: str = "rate"
    latency: str | None = None
    endpoints: tuple[str, ...] = ()
    direct: bool = False
    """A direct bridge: its p99 may be at most 0.3 ms above its endpoints'."""
    cpu_target: float | None = None
    """The gateway's CPU per message over the baseline's asked for (at most)."""
    latency_target_ms: tuple[float, float] | None = None
    """The bridge's p50 and p99 at 10k/s asked for (at most), in ms."""


ROWS: Final = (
    Row("ssmp-rabbitmq", "SSMP MCAST -> RabbitMQ stream, 200 after confirm", "ssmp->rabbitmq",
        "rabbitmq (rstream)", 0.4, "rate", "publish", "ssmp->rabbitmq 200",
        ("rabbitmq confirm", "hub mcast 1->1"), True),
    Row("qmqp-durable", "QMQP 1 KB -> hub, durable, fsync always", "qmqp durable",
        "qmqp unrouted", 0.75, latency="qmqp durable K", endpoints=("qmqp unrouted D",),
        latency_target_ms=(1.0, 3.0)),
    Row("qmqp-hub", "QMQP 1 KB -> hub, direct", "qmqp direct", "qmqp unrouted", 0.85,
        latency="qmqp direct K", endpoints=("qmqp unrouted D", "hub mcast 1->1"), direct=True),
    Row("dmp-feed-1", "DMP sink -> feed, 1 writer, 100 B", "dmp sink->feed 1", "hub mcast 1->1",
        0.5, latency="dmp sink->feed", endpoints=("hub mcast 1->1",), direct=True),
    Row("dmp-feed", "DMP sink -> feed, 4 writers, 100 B", "dmp sink->feed", "hub mcast 1->1",
        0.35),
    Row("mtl-routed", "MTL routed, confirm=full", "mtl routed", "mtl test 1->1", 0.75,
        latency="mtl routed", endpoints=("mtl test 1->1",), direct=True),
    Row("ssmp-hub", "SSMP hub vs naive hub (ssmpload)", "hub mcast 1->1", "naive hub 1->1",
        latency="hub mcast 1->1", endpoints=("naive hub 1->1",)),
    Row("stream-publish", "stream server (fsync never) vs RabbitMQ, publish", "stream server",
        "rabbitmq (rstream)", None, "publish", "publish", "stream server confirm",
        ("rabbitmq confirm",), cpu_target=0.67),
    Row("stream-consume", "stream server (fsync never) vs RabbitMQ, consume", "stream server",
        "rabbitmq (rstream)", None, "consume", "consume", cpu_target=0.67),
)  # fmt: skip
DIRECT_PATHS: Final = frozenset(row.path for row in ROWS if row.direct)


def rate_of(entry: dict[str, Any] | None, key: str) -> float | None:
    """A measurement's rate under ``key``, or None when it failed."""
    if not entry or entry.get("error"):
        return None
    value = entry.get("rates", {}).get(key)
    return float(value) if value else None


def cpu_of(entry: dict[str, Any] | None, key: str) -> float | None:
    """The server's CPU microseconds per message in a measurement, or None."""
    if not entry or entry.get("error"):
        return None
    value = entry.get("cpu_us", {}).get(key)
    return float(value) if value else None


def median_known(values: list[float | None]) -> float | None:
    """The median of the values that are known, or None."""
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def disturbed(entry: dict[str, Any] | None) -> bool:
    """Whether other processes were busy during a measurement."""
    return entry is not None and float(entry.get("other_cores", 0)) > BUSY_CORES


def k(value: float | None) -> str:
    """A rate in thousands: 44.7k, 566k."""
    if value is None:
        return "-"
    return f"{value / 1000:.1f}k" if value < 100_000 else f"{value / 1000:.0f}k"


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """``median (min-max)`` of the known values, or ``-``."""
    if not values:
        return "-"
    middle = fmt(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({fmt(min(values)).rstrip('kx')}-{fmt(max(values))})"


def summarize(
    row: Row, rounds: list[dict[str, dict[str, Any]]], passes: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """The row's figures: per-round rates and ratios, medians, latencies."""
    bridge = [rate_of(r.get(row.bridge), row.bridge_key) for r in rounds]
    base = [rate_of(r.get(row.baseline), row.baseline_key) for r in rounds]
    ratios = [b / a for b, a in zip(bridge, base, strict=True) if b and a]
    summary: dict[str, Any] = {
        "path": row.path,
        "title": row.title,
        "bridge": row.bridge,
        "baseline": row.baseline,
        "bridge_rates": bridge,
        "baseline_rates": base,
        "ratios": ratios,
        "bridge_rate": statistics.median([b for b in bridge if b]) if any(bridge) else None,
        "baseline_rate": statistics.median([a for a in base if a]) if any(base) else None,
        "ratio": statistics.median(ratios) if ratios else None,
        "target": row.target,
        "cpu_target": row.cpu_target,
        "cpu_ratios": cpu_ratios(row, rounds),
        "latency_target_ms": row.latency_target_ms,
        "bridge_cpus": [cpu_of(r.get(row.bridge), row.bridge_key) for r in rounds],
        "bridge_cpu_us": median_known([cpu_of(r.get(row.bridge), row.bridge_key) for r in rounds]),
        "baseline_cpu_us": median_known(
            [cpu_of(r.get(row.baseline), row.baseline_key) for r in rounds]
        ),
        "bridge_disturbed": any(disturbed(r.get(row.bridge)) for r in rounds),
        "baseline_disturbed": any(disturbed(r.get(row.baseline)) for r in rounds),
    }
    if row.latency:
        summary["latency"] = latency_summary(row, passes)
        summary["latency_disturbed"] = any(
            disturbed(measured.get(name))
            for measured in passes
            for name in (row.latency, *row.endpoints)
        )
    return summary


def profile_lines(rows: list[Row], rounds: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Each bridge's top five functions by self time, over its rounds (``--profile``)."""
    lines = ["profiles: the bridge's gateway, functions by self time (share of samples)"]
    for row in rows:
        files = [Path(name) for r in rounds for name in r.get(row.bridge, {}).get("profiles", [])]
        samples, found = top(files)
        lines.append(f"  {row.path} ({samples:,} samples)")
        lines += [f"    {share:6.1%}  {name}" for name, share in found]
    return lines


def cpu_ratios(row: Row, rounds: list[dict[str, Any]]) -> list[float]:
    """Per round: the bridge's gateway CPU per message over the baseline server's."""
    ratios = []
    for measured in rounds:
        bridge = cpu_of(measured.get(row.bridge), row.bridge_key)
        base = cpu_of(measured.get(row.baseline), row.baseline_key)
        if bridge and base:
            ratios.append(bridge / base)
    return ratios


def latency_summary(row: Row, passes: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The bridge's and its endpoints' latencies, medians over the passes.

    The difference is taken in each pass (the bridge's p99 less the slowest
    endpoint's p99 of the same pass), then its median.
    """

    def figures(name: str) -> list[dict[str, float]]:
        found = [measured.get(name, {}).get("latency") for measured in passes]
        return [f for f in found if f]

    def medians(samples: list[dict[str, float]]) -> dict[str, float]:
        if not samples:
            return {}
        keys = ("p50_us", "p99_us", "max_us")
        result = {key: statistics.median(f[key] for f in samples) for key in keys}
        p99s = [f["p99_us"] for f in samples]
        result.update(p99_min_us=min(p99s), p99_max_us=max(p99s), passes=len(samples))
        return result

    assert row.latency is not None
    summary: dict[str, Any] = {
        "bridge": medians(figures(row.latency)),
        "endpoints": {name: medians(figures(name)) for name in row.endpoints},
    }
    known = {name: f["p99_us"] for name, f in summary["endpoints"].items() if f}
    deltas = []
    for measured in passes:
        own = measured.get(row.latency, {}).get("latency")
        ends = [measured.get(name, {}).get("latency") for name in row.endpoints]
        p99s = [end["p99_us"] for end in ends if end]
        if own and p99s and len(p99s) == len(ends):
            deltas.append((own["p99_us"] - max(p99s)) / 1000)
    if summary["bridge"] and known:
        summary["slowest_endpoint"] = max(known, key=lambda name: known[name])
    if deltas:
        summary["delta_p99_ms"] = statistics.median(deltas)
        summary["delta_p99_ms_per_pass"] = deltas
    return summary


def p99_cell(figures: dict[str, float]) -> str:
    """A p99 in ms, with its spread over the passes when there were several."""
    text = f"{figures['p99_us'] / 1000:.2f}"
    if figures.get("passes", 1) > 1:
        text += f" ({figures['p99_min_us'] / 1000:.2f}-{figures['p99_max_us'] / 1000:.2f})"
    return text


def before_cell(earlier: dict[str, Any] | None) -> str:
    """An earlier run's ratio and gateway CPU per message for a row (``--before``), or ``-``."""
    if not earlier or earlier.get("ratio") is None:
        return "-"
    cpu = earlier.get("bridge_cpu_us")
    return f"{earlier['ratio']:.2f}x" + ("" if cpu is None else f" {cpu:.1f}us")


def table(
    summaries: list[dict[str, Any]],
    previous: dict[str, dict[str, Any]] | None,
    before: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """The aligned text table."""
    header = ["path", "bridge msg/s", "baseline msg/s", "ratio", "before", "target",
              "gateway us/msg", "baseline us/msg", "p50/p99 ms", "endpoint p99 ms",
              "d p99 ms"]  # fmt: skip
    lines = [header]
    for s in summaries:
        ratio = spread(s["ratios"], lambda x: f"{x:.2f}x")
        if s["target"] is not None:
            met = "" if s["ratio"] is None else (" ok" if s["ratio"] >= s["target"] else " NO")
            target = f">={s['target']:.2f}x{met}"
        elif previous and previous.get(s["path"], {}).get("ratio") and s["ratio"]:
            change = s["ratio"] / previous[s["path"]]["ratio"]
            verdict = "ok" if change >= 1 - REGRESSION_TOLERANCE else "NO"
            target = f"{change:.2f} of prev {verdict}"
        else:
            target = "regression"
        if s.get("cpu_target") is not None and s.get("cpu_ratios"):
            cpu = statistics.median(s["cpu_ratios"])
            met = "ok" if cpu <= s["cpu_target"] else "NO"
            target += f"; cpu {cpu:.2f}x <={s['cpu_target']:.2f}x {met}"
        own = end = delta = "-"
        lat = s.get("latency")
        if lat and lat["bridge"]:
            own = f"{lat['bridge']['p50_us'] / 1000:.2f}/{p99_cell(lat['bridge'])}"
            if s.get("latency_target_ms"):
                p50, p99 = s["latency_target_ms"]
                mine = lat["bridge"]
                met = mine["p50_us"] <= p50 * 1000 and mine["p99_us"] <= p99 * 1000
                own += f" (<={p50:g}/{p99:g} {'ok' if met else 'NO'})"
        if lat and lat.get("slowest_endpoint"):
            slowest = lat["slowest_endpoint"]
            end = f"{p99_cell(lat['endpoints'][slowest])} ({slowest})"
        if lat and "delta_p99_ms" in lat:
            delta = f"{lat['delta_p99_ms']:+.2f}"
            if s["path"] in DIRECT_PATHS:
                delta += " ok" if lat["delta_p99_ms"] <= DELTA_P99_TARGET_MS else " NO"
        bridge_rates = [x for x in s["bridge_rates"] if x]
        base_rates = [x for x in s["baseline_rates"] if x]
        mark = {True: "*", False: " "}
        gateway_cpu = spread([x for x in s.get("bridge_cpus", []) if x], lambda x: f"{x:.1f}")
        base_cpu = "-" if s["baseline_cpu_us"] is None else f"{s['baseline_cpu_us']:.1f}"
        lines.append([
            s["path"], spread(bridge_rates, k) + mark[s["bridge_disturbed"]],
            spread(base_rates, k) + mark[s["baseline_disturbed"]], ratio,
            before_cell((before or {}).get(s["path"])), target, gateway_cpu, base_cpu,
            own + mark[bool(s.get("latency_disturbed"))], end, delta,
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if i in (0, 9) else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    ]


# --- running -----------------------------------------------------------------------------


def run_one(
    bench: Bench, name: str, scenario: Callable[[Bench, dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """Run one measurement; failures become a record with ``error`` (the run goes on).

    The record also says how many cores other processes kept busy meanwhile
    (the whole machine's busy time less this process, its children and the
    RabbitMQ node): the machine is shared.
    """
    record: dict[str, Any] = {}
    if time.monotonic() - bench.started > bench.args.budget_seconds:
        return {"error": "skipped: --budget-seconds spent", "problems": []}
    if bench.args.quiet_seconds > 0:
        record["busy_before"] = stream_vs_rabbitmq.wait_for_quiet(bench.args.quiet_seconds)
    before = ours(bench), stream_vs_rabbitmq._machine_busy_seconds(), time.monotonic()
    try:
        record.update(scenario(bench, record))
    except Skipped as exc:
        record["error"] = f"skipped: {exc}"
    except Exception as exc:  # reported in the notes, not hidden: the run goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
    own, busy, wall = (
        ours(bench) - before[0],
        stream_vs_rabbitmq._machine_busy_seconds() - before[1],
        time.monotonic() - before[2],
    )
    record["wall_seconds"] = round(wall, 2)
    record["other_cores"] = round(max(0.0, busy - own) / wall, 2) if wall > 0 else 0.0
    record.setdefault("problems", [])
    record["problems"] += metric_problems(record.get("metrics", {}))
    cpu = record.get("server_cpu")
    if "cpu_us" not in record and cpu and record.get("messages"):
        record["cpu_us"] = {k: cpu * 1e6 / n for k, n in record["messages"].items() if n}
    shown = record.get("rates") or record.get("latency") or brief(record.get("error", ""))
    if isinstance(shown, dict):
        shown = ", ".join(f"{key} {value:,.0f}" for key, value in shown.items() if value)
    print(
        f"  {name:24} {wall:6.1f} s  others {record['other_cores']:.1f} cores  {shown}",
        file=sys.stderr,
    )
    return record


def ours(bench: Bench) -> float:
    """CPU seconds of this process, its finished children and the RabbitMQ node."""
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    if bench.node is not None:
        total += stream_vs_rabbitmq._cpu_seconds(bench.node.server_pid) or 0.0
    return total


def brief(error: str) -> str:
    """An error in one line: its first line, and its last when that says more (a traceback)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    last = re.sub(r"^\S+ \[[^]]*\] ", "", lines[-1])  # a gateway log line's time and source
    return f"{lines[0].rstrip(':')}: ... {last}"[:400]


def notes(
    rounds: list[dict[str, dict[str, Any]]], passes: list[dict[str, dict[str, Any]]]
) -> list[str]:
    """Everything that went wrong; the same text from several measurements once, with where."""
    where: dict[str, list[str]] = {}
    labelled = [(f"round {n}", r) for n, r in enumerate(rounds, 1)]
    labelled += [(f"latency pass {n}", r) for n, r in enumerate(passes, 1)]
    for label, measured in labelled:
        for name, record in measured.items():
            errors = [brief(record["error"])] if record.get("error") else []
            logged = [f"gateway log: {line[:200]}" for line in record.get("log_problems", [])[:3]]
            for problem in errors + record.get("problems", []) + logged:
                where.setdefault(problem, []).append(f"{label}, {name}")
    found = []
    for problem, places in where.items():
        if len(places) == 1:
            found.append(f"{places[0]}: {problem}")
        else:
            shown = "; ".join(places[:4]) + (
                f"; and {len(places) - 4} more" if len(places) > 4 else ""
            )
            found.append(f"{problem} [{len(places)} measurements: {shown}]")
    busy = [
        float(record.get("other_cores", 0))
        for _, measured in labelled
        for record in measured.values()
    ]
    if any(cores > BUSY_CORES for cores in busy):
        found.append(
            f"other processes kept more than {BUSY_CORES} cores busy during"
            f" {sum(cores > BUSY_CORES for cores in busy)} of {len(busy)} measurements"
            f" (median {statistics.median(busy):.1f}, max {max(busy):.1f} cores)"
        )
    return found


def machine() -> str:
    """A line about the machine and how busy it was."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()};"
        f" load average at the end {load}"
    )


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, help="throughput rounds, median reported (default 3; --quick: 1)"
    )
    parser.add_argument(
        "--only", action="append", choices=[row.path for row in ROWS], metavar="PATH",
        help="measure only this path (repeatable): " + ", ".join(row.path for row in ROWS),
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="each throughput load sends this long"
    )
    parser.add_argument(
        "--latency-seconds", type=float, default=None,
        help="each latency measurement at 10k msg/s lasts this long (default: --seconds)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    parser.add_argument(
        "--quiet-seconds", type=float, default=0.0,
        help="before each measurement, wait at most this long for other load to stop",
    )  # fmt: skip
    parser.add_argument(
        "--latency-rounds", type=int, help="latency passes, medians reported (default: --rounds)"
    )
    parser.add_argument("--no-latency", action="store_true", help="skip the latency passes")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--compare", type=Path, help="an earlier --json: regression rows against it"
    )
    parser.add_argument(
        "--before", type=Path,
        help="an earlier --json (before a change): its ratio and gateway us/msg per row"
        " in the before column (default: --compare's)",
    )  # fmt: skip
    parser.add_argument(
        "--before-tree", type=Path,
        help="a checkout of earlier code: each round also measures every row's bridge on it"
        " (the before column, from the same run)",
    )  # fmt: skip
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    parser.add_argument(
        "--profile", type=Path,
        help="sample every gateway with py-spy into this directory; the table is followed"
        " by each bridge's top five functions by self time (its rates are not for comparing)",
    )  # fmt: skip
    parser.add_argument(
        "--budget-seconds", type=float, default=3600.0,
        help="start no measurement after this many seconds",
    )  # fmt: skip
    args = parser.parse_args()
    if args.profile is not None:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.quick:
        args.seconds = min(args.seconds, 1.0)
    if args.latency_seconds is None:
        args.latency_seconds = args.seconds
    if args.latency_rounds is None:
        args.latency_rounds = 0 if args.no_latency else args.rounds
    return args


def on_tree(
    tree: Path, scenario: Callable[[Bench, dict[str, Any]], dict[str, Any]]
) -> Callable[[Bench, dict[str, Any]], dict[str, Any]]:
    """``scenario`` with its gateways running the code of ``tree`` (``--before-tree``)."""

    def run(bench: Bench, record: dict[str, Any]) -> dict[str, Any]:
        bench.tree = tree
        try:
            return scenario(bench, record)
        finally:
            bench.tree = None

    return run


def before_row(row: Row) -> Row:
    """The row with its bridge (and the bridge's latency) measured on the ``--before-tree``."""
    latency = row.latency + BEFORE if row.latency else None
    return dataclasses.replace(row, bridge=row.bridge + BEFORE, latency=latency)


def main() -> None:
    """Measure the selected paths and print the table."""
    args = arguments()
    stop_on_signals()
    rows = [row for row in ROWS if not args.only or row.path in args.only]
    throughput = list(dict.fromkeys(name for row in rows for name in (row.bridge, row.baseline)))
    latencies = list(
        dict.fromkeys(name for row in rows if row.latency for name in (row.latency, *row.endpoints))
    )
    scenarios, timed = dict(THROUGHPUT), dict(LATENCY)
    if args.before_tree:  # each bridge again, on the earlier code, right after its own
        tree = args.before_tree.resolve()
        for names, known in ((throughput, scenarios), (latencies, timed)):
            bridges = {row.bridge for row in rows} | {row.latency for row in rows}
            for name in [name for name in names if name in bridges]:
                known[name + BEFORE] = on_tree(tree, known[name])
                names.insert(names.index(name) + 1, name + BEFORE)
    previous = None
    if args.compare:
        previous = {s["path"]: s for s in json.loads(args.compare.read_text())["rows"]}
    before = previous
    if args.before:
        before = {s["path"]: s for s in json.loads(args.before.read_text())["rows"]}
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-bridges-")))
        bench = Bench(args, scratch, stack)
        if RABBITMQ_SCENARIOS & {*throughput, *latencies}:
            with contextlib.suppress(Skipped):  # then those measurements say why
                bench.rabbit()
        rounds: list[dict[str, dict[str, Any]]] = []
        for number in range(args.rounds):
            order = throughput if number % 2 == 0 else throughput[::-1]
            print(f"round {number + 1} of {args.rounds}", file=sys.stderr)
            rounds.append({name: run_one(bench, name, scenarios[name]) for name in order})
        passes: list[dict[str, dict[str, Any]]] = []
        for number in range(args.latency_rounds if latencies and not args.no_latency else 0):
            order = latencies if number % 2 == 0 else latencies[::-1]
            print(
                f"latency pass {number + 1} of {args.latency_rounds} at {LATENCY_RATE:,} msg/s",
                file=sys.stderr,
            )
            passes.append({name: run_one(bench, name, timed[name]) for name in order})
        run_notes = list(bench.notes)
    elapsed = time.monotonic() - began
    summaries = [summarize(row, rounds, passes) for row in rows]
    if args.before_tree:
        before = {row.path: summarize(before_row(row), rounds, passes) for row in rows}
    print()
    for line in table(summaries, previous, before):
        print(line)
    print()
    if args.profile is not None:
        for line in profile_lines(rows, rounds):
            print(line)
        print()
    print(
        f"median of {args.rounds} round(s), (min-max) over rounds; each load sent for"
        f" {args.seconds:g} s; ratio = bridge / baseline in the same round; a fresh gateway"
        " per measurement"
    )
    print(
        "latency: not measured (--no-latency)"
        if not passes
        else f"latency: median of {len(passes)} pass(es) at {LATENCY_RATE:,} msg/s,"
        f" {args.latency_seconds:g} s each, (min-max) of p99 over passes;"
        " d p99 = bridge p99 - the slower endpoint's p99 in the same pass, median"
        f" (direct bridges: target <= {DELTA_P99_TARGET_MS} ms)"
    )
    print(
        "gateway us/msg: CPU microseconds per message of the bridge's gateway, median"
        " (min-max) over rounds; baseline us/msg: the baseline's server (RabbitMQ's VM for"
        " RabbitMQ), median; steadier than rates on a busy machine"
    )
    if args.before_tree and before:
        print(
            f"before: the ratio and gateway us/msg of the bridge on {args.before_tree}'s code"
            " in the same rounds, medians"
        )
        for path, earlier in before.items():
            lat = (earlier.get("latency") or {}).get("bridge")
            if lat:
                print(
                    f"  {path} before: p50 {lat['p50_us'] / 1000:.2f} ms,"
                    f" p99 {p99_cell(lat)} ms at {LATENCY_RATE:,} msg/s"
                )
    elif before:
        print(
            "before: the ratio and gateway us/msg of the earlier run"
            f" ({args.before or args.compare}), medians"
        )
    print(
        f"*: other processes kept more than {BUSY_CORES} cores busy during at least one of"
        " the measurements behind the cell (the machine is shared)"
    )
    print("rows:")
    for row in rows:
        ends = f"; latency vs {', '.join(row.endpoints)}" if row.endpoints else ""
        print(f"  {row.path:15} {row.title}: {row.bridge} / {row.baseline}{ends}")
    also = {"confirm": "the writer's Confirm round trip", "delivery": "send to hub delivery"}
    for name in latencies:
        for key, what in also.items():
            seen = [m.get(name, {}).get("figures", {}).get(key) for m in passes]
            known = [figures for figures in seen if figures]
            if known:
                p50 = statistics.median(f["p50_us"] for f in known) / 1000
                p99 = statistics.median(f["p99_us"] for f in known) / 1000
                print(
                    f"  {name}: {what} at {LATENCY_RATE:,} msg/s: p50 {p50:.2f} ms,"
                    f" p99 {p99:.2f} ms (median of {len(known)})"
                )
    found = notes(rounds, passes)
    print("problems seen:" if found else "problems seen: none")
    for line in found:
        print(f"  {line}")
    for line in run_notes:
        print(f"note: {line}")
    print(f"machine: {machine()}; the run took {elapsed:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "rows": summaries,
                    "before_tree": before if args.before_tree else None,
                    "rounds": rounds,
                    "latency_passes": passes,
                    "notes": run_notes,
                    "machine": machine(),
                    "seconds": elapsed,
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
