"""A fleet on RabbitMQ: connection spread, SSMP across nodes, scaling and failover.

Every figure is taken in the same run as its baseline, in ``--rounds``
rounds (3 by default), each bounded in messages and time; the table shows
the minimum, median and maximum over the rounds. ``ssmpload`` (the
independent Go load generator, ``../shared/tools/ssmpload``) drives the
SSMP rows; 100-byte payloads. RabbitMQ is private: one node for the
throughput rows, a three-node cluster for the failover rows.

Throughput, per round:

* **connection spread**: ``[fleet] processes = 2`` (with ``[fleet] amqp``),
  1,000 clients log in to its one SSMP port; each worker's ``/metrics``
  counts its connections: the busiest over the least busy.
* **MCAST 1 to 1, one process**: a gateway without ``[fleet]``, ssmpload
  1 publisher and 1 subscriber: deliveries a second, the gateway's CPU time
  per delivery, ssmpload's own CPU.
* **MCAST 1 to 1 across workers**: the ``processes = 2`` gateway, the
  publisher on one worker and the subscriber on the other, so every
  message crosses RabbitMQ. ssmpload connects both to the one port and the
  kernel picks the worker: the run is repeated (at most 10 times) until
  the workers' ``/metrics`` show one received the MCASTs and the other
  delivered them. CPU: both workers; RabbitMQ's CPU per delivery beside it.
* **p99 at 10k/s**: ssmpload paced at 10,000 MCASTs a second (50,000 of
  them), one process and across workers: what the hop adds to p99.
* **scaling**: one fleet node (``processes = 1`` with ``amqp``) with one
  ssmpload pair (publisher and subscriber on that node), against two fleet
  nodes on one RabbitMQ, each with a pair of its own, run at the same time:
  the aggregate deliveries a second. Two single-process nodes on ports of
  their own stand for ``processes = 2``, because ssmpload cannot choose
  the worker a connection lands on (a pair each on one worker of a shared
  port is 1 chance in 8); the work per process is the same. ssmpload's CPU
  is shown too: on 2 cores it competes with the gateways. The same is done
  with two gateways without ``[fleet]`` (nothing shared, RabbitMQ unused):
  their two over one is what this machine allows any two processes, and
  the fleet's ratio is shown against it.

Failover, per round, on the three-node cluster, with two gateway nodes
(``gw0``, ``gw1``: backbones on RabbitMQ node 1 first) that consume a
stream through a durable route into another (both streams on node 2 alone:
the node's death is the backbones', not the streams'), while rstream
publishes 1,000 messages a second into the first (20,000), an SSMP
publisher on ``gw0`` sends 1,000 MCASTs a second to a subscriber on
``gw1``, and each gateway's hub has a peer the other one UCASTs every 2 ms:

1. RabbitMQ node 1 is killed (SIGKILL): **the SSMP gap** is the longest
   time the subscriber went without an MCAST, with the MCASTs lost.
2. The gateway holding the consumer's lock is killed (``kill -9``): **time
   to 404** is how long the other's UCASTs to a peer of the dead one are
   still answered 200; **takeover** how long until the other holds the lock,
   and until it routes again. (The node's death in step 1 takes the lock
   away too: whoever holds it afterwards is the one killed.)
3. Once the producer is done and the survivor's stored offset reached the
   input's end, rstream reads the output: **lost** and **duplicates** on the
   durable route through all of it; **read again** is what the killed node
   had published under the shared reference past the offset it had stored
   (``QueryPublisherSequence`` and ``QueryOffset`` right after the kill),
   which the survivor read and published again, and RabbitMQ stored once.

Run: ``.venv/bin/python bench/fleet.py`` (about 12 minutes),
``--quick`` for one short round, ``--json FILE`` to keep the figures,
``--only throughput``, ``--only latency`` (the p99 rows) or ``--only failover``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_proc import metric, raise_open_file_limit, stop_on_signals  # noqa: E402
from bench.ssmp_hub import build_ssmpload, load_figures  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402
from tests.rabbitmq import RabbitMQCluster, RabbitMQNode  # noqa: E402

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
CONNECTIONS: Final = 1000
PLACEMENT_ATTEMPTS: Final = 10
"""Runs of one cross-worker measurement before the bench gives up on the kernel's choice."""
LOCK: Final = "upstream.rabbit"
CONSUMER: Final = "msggateway.rabbit"

HUB: Final = """
[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
# ssmpload pipelines without a window: keep a subscriber that falls behind
# for a moment (as the naive baseline of bench/ssmp_hub.py would).
max_backlog_bytes = 1073741824
"""
GATEWAY: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"
"""
FLEET: Final = """
[fleet]
node = "{node}"
amqp = [{endpoints}]
heartbeat_seconds = 2
{processes}
"""
FAILOVER_UPSTREAMS: Final = """
[upstreams.rabbit]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
subscribe = ["{inbound}"]
offset = "first"

[upstreams.out]
protocol = "stream"
endpoint = "tcp:host=127.0.0.1:port={port}"
stream = "{outbound}"
"""
DURABLE_ROUTE: Final = 'from = "rabbit"\nmatch = "{inbound}"\nto = "out"\ndurable = true\n'


def note(text: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU time of the processes ``pids`` (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def endpoints(nodes: Sequence[RabbitMQNode]) -> str:
    """``[fleet] amqp``'s list for these RabbitMQ nodes, in order."""
    return ", ".join(f'"tcp:host=127.0.0.1:port={node.amqp_port}"' for node in nodes)


# --- results -----------------------------------------------------------------------------------


@dataclass
class Row:
    """One figure of the table: its values over the rounds, and what it should be."""

    name: str
    unit: str
    target: str = ""
    met: Callable[[float], bool] | None = None
    values: list[float] = field(default_factory=list)
    scale: float = 1.0
    digits: int = 0

    def cells(self) -> list[str]:
        """Name, min, median, max, target (with whether the median meets it)."""
        if not self.values:
            return [self.name, "-", "-", "-", self.target]
        shown = [self._shown(v) for v in (min(self.values), self.median, max(self.values))]
        target = self.target
        if self.met is not None:
            target += " (met)" if self.met(self.median) else " (missed)"
        return [self.name, *shown, target]

    @property
    def median(self) -> float:
        """The median over the rounds."""
        return statistics.median(self.values)

    def _shown(self, value: float) -> str:
        scaled = value / self.scale
        text = f"{scaled:,.{self.digits}f}"
        return f"{text}{self.unit}"


class Table:
    """The bench's rows, in order."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def row(self, key: str, name: str, unit: str = "", **options: Any) -> Row:
        """The row ``key``, made the first time."""
        if key not in self.rows:
            self.rows[key] = Row(name, unit, **options)
        return self.rows[key]

    def add(self, key: str, value: float) -> None:
        """One round's value of row ``key``."""
        self.rows[key].values.append(value)

    def render(self) -> str:
        """The table as reStructuredText."""
        header = ["figure", "min", "median", "max", "target"]
        lines = [header, *(row.cells() for row in self.rows.values())]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        rule = "  ".join("=" * width for width in widths)
        text = [rule, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), rule]
        text += [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            for line in lines[1:]
        ]
        text.append(rule)
        return "\n".join(line.rstrip() for line in text)


def declare_rows(table: Table) -> None:
    """Every row, in the table's order."""
    row = table.row
    row("spread", "connection spread, 1,000 on one port, processes = 2 (busiest/least)", "x",
        target="<= 1.3", met=lambda v: v <= 1.3, digits=2)  # fmt: skip
    row("one_rate", "MCAST 1->1, one process: msg/s", scale=1000, unit="k")
    row("one_cpu", "  gateway CPU per message", " µs", digits=2)
    row("one_gen", "  ssmpload CPU (of one core)", "%")
    row("cross_rate", "MCAST 1->1 across workers (processes = 2): msg/s", "k", scale=1000,
        target=">= 150k", met=lambda v: v >= 150_000)  # fmt: skip
    row("cross_ratio", "  against one process", "x", digits=2)
    row("cross_cpu", "  gateway CPU per message (both workers)", " µs", digits=2)
    row("cross_rabbit", "  RabbitMQ CPU per message", " µs", digits=2)
    row("cross_gen", "  ssmpload CPU (of one core)", "%")
    row("cross_tries", "  runs until the two were on different workers", "")
    row("p99_one", "p99 at 10k MCAST/s, one process", " ms", scale=1000, digits=2)
    row("p99_cross", "p99 at 10k MCAST/s across workers", " ms", scale=1000, digits=2)
    row("p99_added", "  added by the hop", " ms", scale=1000, digits=2,
        target="<= 2 ms", met=lambda v: v <= 2000)  # fmt: skip
    row("scale_one", "scaling: one fleet node, one pair: msg/s", "k", scale=1000)
    row("scale_two", "scaling: two fleet nodes, a pair each: msg/s", "k", scale=1000)
    row("scale_ratio", "  two over one", "x", digits=2, target=">= 1.6",
        met=lambda v: v >= 1.6)  # fmt: skip
    row("scale_gen", "  ssmpload CPU, two pairs (of one core each)", "%")
    row("plain_one", "scaling without a fleet: one gateway, one pair: msg/s", "k", scale=1000)
    row("plain_two", "scaling without a fleet: two gateways, a pair each: msg/s", "k",
        scale=1000)  # fmt: skip
    row("plain_ratio", "  two over one: what this machine allows", "x", digits=2)
    row("scale_share", "  the fleet's two over one against that", "x", digits=2)
    row("gap", "SSMP gap when a RabbitMQ node dies", " s", digits=2)
    row("gap_lost", "  MCASTs lost in it (of 1,000/s)", "")
    row("to_404", "time to 404 after a gateway is killed", " s", digits=3)
    row("takeover", "takeover of the once-per-fleet consumer: lock held", " s", digits=2)
    row("takeover_routed", "  and routing again", " s", digits=2)
    row("durable_lost", "durable route, through all of it: lost", "", target="0",
        met=lambda v: v == 0)  # fmt: skip
    row("durable_dups", "  stored twice", "", target="0", met=lambda v: v == 0)
    row("durable_again", "  read again by the next holder (stored once)", "")


# --- SSMP with ssmpload --------------------------------------------------------------------


def ssmp(ssmpload: Path, port: int, pid: int, *args: str) -> dict[str, float]:
    """One ssmpload run against ``port``; its RESULT figures (exit on loss, disorder, copies)."""
    figures, problem = load_figures(ssmpload, port, pid, list(args), timeout=180)
    if problem:
        raise SystemExit(problem)
    return figures


def hub_counts(gateway: GatewayProcess, worker: int) -> tuple[float, float]:
    """A worker's hub: SSMP messages received and sent so far."""
    text = gateway.metrics(worker=worker)
    labels = {"endpoint": "hub"}
    return (
        metric(text, "msggateway_messages_received_total", **labels),
        metric(text, "msggateway_messages_sent_total", **labels),
    )


def across_workers(
    ssmpload: Path, gateway: GatewayProcess, *args: str
) -> tuple[dict[str, float], float, int]:
    """An ssmpload 1 to 1 run with publisher and subscriber on different workers.

    Returns:
        Its figures, the CPU seconds of the gateway's processes during it,
        and the runs it took.
    """
    workers = sorted(gateway.workers)
    pids = [gateway.pid, *(gateway.workers[w].pid for w in workers)]
    for attempt in range(1, PLACEMENT_ATTEMPTS + 1):
        before = {w: hub_counts(gateway, w) for w in workers}
        used = cpu_seconds(pids)
        figures = ssmp(ssmpload, gateway.address("hub")[1], gateway.workers[0].pid, *args)
        used = cpu_seconds(pids) - used
        after = {w: hub_counts(gateway, w) for w in workers}
        received = {w: after[w][0] - before[w][0] for w in workers}
        sent = {w: after[w][1] - before[w][1] for w in workers}
        # The publisher's worker received the MCASTs and answered each (200);
        # if it also delivered them, it sent twice as many lines.
        publisher = max(workers, key=lambda w: received[w])
        if sent[publisher] < 1.5 * figures["sent"]:
            return figures, used, attempt
        note(f"  publisher and subscriber both on worker {publisher}: again")
    raise SystemExit(f"not on different workers in {PLACEMENT_ATTEMPTS} runs")


def spread(gateway: GatewayProcess) -> float:
    """Log 1,000 clients in on the shared port; the busiest worker's count over the least's."""
    host, port = gateway.address("hub")
    clients = []
    try:
        for number in range(CONNECTIONS):
            sock = socket.create_connection((host, port), timeout=10)
            clients.append(sock)
            sock.sendall(b"LOGIN spread%d open\n" % number)
        for sock in clients:
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = sock.recv(256)
                if not chunk:
                    raise SystemExit("a login was not answered")
                answer += chunk
            if not answer.startswith(b"200"):
                raise SystemExit(f"login refused: {answer!r}")
        counts = []
        for worker in sorted(gateway.workers):
            text = gateway.metrics(worker=worker)
            counts.append(metric(text, "msggateway_connections", endpoint="hub", protocol="ssmp"))
        note(f"  connections per worker: {counts}")
        return max(counts) / max(min(counts), 1)
    finally:
        for sock in clients:
            sock.close()


@contextlib.contextmanager
def gateway(directory: Path, config: str, **options: Any) -> Iterator[GatewayProcess]:
    """A gateway under twistd, stopped afterwards."""
    process = GatewayProcess(directory, config, **options).start()
    try:
        yield process
    finally:
        process.stop()


def throughput_round(
    table: Table,
    ssmpload: Path,
    rabbitmq: RabbitMQNode,
    directory: Path,
    quick: bool,
    latency_only: bool = False,
) -> None:
    """One round of the throughput rows (each against its baseline, in this round).

    With ``latency_only``, the p99 rows alone (``--only latency``).
    """
    count = "200000" if quick else "1000000"
    flood = ("-mode", "mcast", "-pubs", "1", "-subs", "1", "-max", count, "-duration", "8s")
    paced = ("-mode", "mcast", "-pubs", "1", "-subs", "1", "-rate", "10000",
             "-max", "20000" if quick else "50000")  # fmt: skip
    amqp = endpoints([rabbitmq])
    rabbit_pid = rabbitmq.server_pid or 0

    note("one process")
    with gateway(directory / "one", GATEWAY + HUB) as one:
        port = one.address("hub")[1]
        if not latency_only:
            used = cpu_seconds([one.pid])
            figures = ssmp(ssmpload, port, one.pid, *flood)
            used = cpu_seconds([one.pid]) - used
            table.add("one_rate", figures["deliv_rate"])
            table.add("one_cpu", used / figures["delivered"] * 1e6)
            table.add("one_gen", figures["gen_cpu_pct"])
        paced_one = ssmp(ssmpload, port, one.pid, *paced)
        table.add("p99_one", paced_one["p99_us"])

    note("processes = 2")
    config = GATEWAY + FLEET.format(node="bench", endpoints=amqp, processes="processes = 2") + HUB
    with gateway(directory / "two", config, supervised=True) as two:
        for index in sorted(two.workers):
            two.wait_for_log(f"fleet: node bench-{index} connected to RabbitMQ")
        if not latency_only:
            rabbit_used = cpu_seconds([rabbit_pid])
            figures, used, tries = across_workers(ssmpload, two, *flood)
            rabbit_used = cpu_seconds([rabbit_pid]) - rabbit_used
            table.add("cross_rate", figures["deliv_rate"])
            table.add("cross_ratio", figures["deliv_rate"] / table.rows["one_rate"].values[-1])
            table.add("cross_cpu", used / figures["delivered"] * 1e6)
            table.add("cross_rabbit", rabbit_used / figures["delivered"] * 1e6)
            table.add("cross_gen", figures["gen_cpu_pct"])
            table.add("cross_tries", tries)
        paced_cross, _used, _tries = across_workers(ssmpload, two, *paced)
        table.add("p99_cross", paced_cross["p99_us"])
        table.add("p99_added", paced_cross["p99_us"] - paced_one["p99_us"])
        if latency_only:
            return
        # Last: a thousand logins and logouts are as many bindings to change.
        table.add("spread", spread(two))

    note("scaling")
    fleet = scaling(ssmpload, directory / "scale", flood, amqp)
    table.add("scale_one", fleet[0])
    table.add("scale_two", fleet[1])
    table.add("scale_ratio", fleet[1] / fleet[0])
    table.add("scale_gen", fleet[2])
    note("scaling without a fleet")
    plain = scaling(ssmpload, directory / "plain", flood, None)
    table.add("plain_one", plain[0])
    table.add("plain_two", plain[1])
    table.add("plain_ratio", plain[1] / plain[0])
    table.add("scale_share", (fleet[1] / fleet[0]) / (plain[1] / plain[0]))


def scaling(
    ssmpload: Path, directory: Path, flood: Sequence[str], amqp: str | None
) -> tuple[float, float, float]:
    """One node with one pair, then two nodes with a pair each at once: msg/s, and ssmpload's CPU.

    Fleet nodes on ``amqp``, or gateways without ``[fleet]`` when it is None.
    """
    fleets = ["" if amqp is None else FLEET.format(node=f"scale{index}", endpoints=amqp,
                                                   processes="") for index in range(2)]  # fmt: skip
    nodes = [
        GatewayProcess(directory / str(index), GATEWAY + fleet + HUB)
        for index, fleet in enumerate(fleets)
    ]
    try:
        for node in nodes:
            node.start()
            if amqp is not None:
                node.wait_for_log("connected to RabbitMQ")
        alone = ssmp(ssmpload, nodes[0].address("hub")[1], nodes[0].pid, *flood, "-topic", "a")
        together = pairs(ssmpload, nodes, flood)
        return (
            alone["deliv_rate"],
            sum(f["deliv_rate"] for f in together),
            sum(f["gen_cpu_pct"] for f in together),
        )
    finally:
        for node in nodes:
            node.stop()


def pairs(
    ssmpload: Path, nodes: Sequence[GatewayProcess], flood: Sequence[str]
) -> list[dict[str, float]]:
    """One ssmpload pair per node, at the same time, each on a topic of its own."""
    results: list[dict[str, float]] = [{} for _ in nodes]
    failures: list[BaseException] = []

    def run(index: int) -> None:
        node = nodes[index]
        try:
            results[index] = ssmp(
                ssmpload, node.address("hub")[1], node.pid, *flood,
                "-topic", f"t{index}", "-idprefix", f"n{index}",
            )  # fmt: skip
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results


# --- failover -----------------------------------------------------------------------------------


class Peer:
    """A blocking SSMP client logged in to a hub, read by a thread of its own.

    Args:
        address: The hub.
        identity: Its login.
        on_line: Told each line it reads, with the time it came.
    """

    def __init__(
        self, address: tuple[str, int], identity: str, on_line: Callable[[bytes, float], None]
    ) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._on_line = on_line
        self.closed = False
        self.sock.sendall(f"LOGIN {identity} open\n".encode())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def send(self, line: str) -> None:
        """Send one line (ignored once the connection is gone)."""
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError:
            self.closed = True

    def _read(self) -> None:
        pending = b""
        self.sock.settimeout(None)
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            now = time.monotonic()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._on_line(line, now)
        self.closed = True

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(OSError):
            self.sock.close()


class Failover:
    """The failover round's gateways, clients and what they saw (see the module docstring)."""

    def __init__(self, cluster: RabbitMQCluster, directory: Path, number: int) -> None:
        self.cluster = cluster
        self.directory = directory
        self.inbound = f"fleet-bench-in-{number}-{os.getpid()}"
        self.outbound = f"fleet-bench-out-{number}-{os.getpid()}"
        self.reference = f"{CONSUMER}@{self.inbound}.route.copy"
        """Where every node publishes what the consumer read (no node id in it)."""
        self.gateways: dict[str, GatewayProcess] = {}
        self.peers: list[Peer] = []
        self.arrivals: list[tuple[float, int]] = []
        self.crossed = False
        """An MCAST from gw0 reached the subscriber on gw1."""
        self.answers: dict[str, list[tuple[float, bytes]]] = {"gw0": [], "gw1": []}
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.published: list[bytes] = []
        self.producer_retries = 0
        self.last_lines: dict[str, bytes] = {}

    def start(self) -> None:
        """Streams, gateways (gw0 first: it holds the lock), clients, traffic."""
        two = self.cluster.nodes[1]
        # Both streams on node 2 alone: RabbitMQ 3.10's stream listener on a
        # node can stop for good while another node's members are re-elected
        # (the connections that declare publishers meanwhile crash); the
        # streams are not what the node's death measures here.
        with two.stream_client() as client:
            for stream in (self.inbound, self.outbound):
                code = client.create_stream(
                    stream, {"initial-cluster-size": "1", "queue-leader-locator": "client-local"}
                )
                if code != 1:
                    raise SystemExit(f"cannot create stream {stream}: code {code}")
        for stream in (self.inbound, self.outbound):
            self.cluster.await_stream(stream, replicas=0)
        for name in ("gw0", "gw1"):
            config = (
                GATEWAY
                + FLEET.format(node=name, endpoints=endpoints(self.cluster.nodes), processes="")
                + HUB
                + FAILOVER_UPSTREAMS.format(
                    port=two.stream_port, inbound=self.inbound, outbound=self.outbound
                )
            )
            process = GatewayProcess(
                self.directory / name,
                config,
                routes={"copy": DURABLE_ROUTE.format(inbound=self.inbound)},
            ).start()
            self.gateways[name] = process
            process.wait_for_log(f"fleet: node {name} connected to RabbitMQ")
            if name == "gw0":
                process.wait_for_log(f"fleet: node gw0 holds lock {LOCK}")
        self._clients()
        self._thread(self._produce)

    def _clients(self) -> None:
        gw0, gw1 = self.gateways["gw0"], self.gateways["gw1"]
        self.peers.append(Peer(gw1.address("hub"), "listener", self._heard))
        self.peers[-1].send("SUBSCRIBE gap")
        for name, process in self.gateways.items():
            self.peers.append(Peer(process.address("hub"), f"target-{name}", lambda *_: None))
        for name, process in self.gateways.items():
            other = "gw1" if name == "gw0" else "gw0"
            prober = Peer(process.address("hub"), f"prober-{name}", self._answer(name))
            self.peers.append(prober)
            self._thread(self._probe, prober, f"target-{other}")
        talker = Peer(gw0.address("hub"), "talker", lambda *_: None)
        self.peers.append(talker)
        # Until the subscriber's binding is in effect, nothing crosses.
        deadline = time.monotonic() + 10
        probe = itertools.count()
        while not self.crossed and time.monotonic() < deadline:
            talker.send(f"MCAST gap -{next(probe)}")
            time.sleep(0.05)
        if not self.crossed:
            raise SystemExit("MCASTs from gw0 never reached gw1")
        self._thread(self._talk, talker)

    def _thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _heard(self, line: bytes, when: float) -> None:
        parts = line.split(b" ")
        if len(parts) >= 5 and parts[2] == b"MCAST":
            self.crossed = True
            if not parts[4].startswith(b"-"):  # not a probe
                self.arrivals.append((when, int(parts[4])))

    def _answer(self, name: str) -> Callable[[bytes, float], None]:
        def heard(line: bytes, when: float) -> None:
            self.last_lines[name] = line
            if line[:3] in (b"200", b"404", b"400"):
                self.answers[name].append((when, line[:3]))

        return heard

    def _talk(self, talker: Peer) -> None:
        """1,000 MCASTs a second, numbered, until stopped."""
        number = 0
        started = time.monotonic()
        while not self.stop.is_set() and not talker.closed:
            due = int((time.monotonic() - started) * 1000)
            while number < due:
                talker.send(f"MCAST gap {number}")
                number += 1
            time.sleep(0.001)

    def _probe(self, prober: Peer, target: str) -> None:
        while not self.stop.is_set() and not prober.closed:
            prober.send(f"UCAST {target} ping")
            time.sleep(0.002)

    def _produce(self) -> None:
        """rstream: 1,000 messages a second into the input stream for 20 s, confirmed."""
        asyncio.run(self._publish(20_000))

    async def _publish(self, total: int) -> None:
        """Confirmed batches of 50, paced; a batch that fails goes again on a new connection.

        Under one publisher name with ids of its own, so that RabbitMQ stores a
        batch sent again once: the input holds each body once.
        """
        import rstream
        from rstream.utils import RawMessage

        two = self.cluster.nodes[1]
        started = time.monotonic()
        first = 0
        producer: Any = None
        try:
            while first < total:
                if producer is None:
                    producer = rstream.Producer(
                        "127.0.0.1", port=two.stream_port, username="guest", password="guest"
                    )
                    await producer.start()
                bodies = [b"m%d" % index for index in range(first, first + 50)]
                batch = [
                    RawMessage(body, publishing_id=first + offset + 1)
                    for offset, body in enumerate(bodies)
                ]
                try:
                    await producer.send_batch(self.inbound, batch, publisher_name="fleet-bench")
                except Exception as exc:  # a RabbitMQ node went away: again, elsewhere
                    self.producer_retries += 1
                    note(f"  producer: {type(exc).__name__}: {exc}; sending again")
                    with contextlib.suppress(Exception):
                        await producer.close()
                    producer = None
                    await asyncio.sleep(0.5)
                    continue
                self.published.extend(bodies)
                first += 50
                ahead = started + first / 1000 - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
        finally:
            if producer is not None:
                with contextlib.suppress(Exception):
                    await producer.close()

    def holder(self) -> str:
        """The gateway that holds the consumer's lock now."""
        for name, process in self.gateways.items():
            text = process.metrics()
            if metric(text, "msggateway_fleet_lock_held", lock=LOCK) == 1:
                return name
        raise SystemExit("nobody holds the lock")

    def close(self) -> None:
        """Stop the traffic, the clients and the gateways still running."""
        self.stop.set()
        for peer in self.peers:
            peer.close()
        for process in self.gateways.values():
            process.stop()


def failover_round(table: Table, cluster: RabbitMQCluster, directory: Path, number: int) -> None:
    """One round of the failover rows."""
    run = Failover(cluster, directory, number)
    try:
        run.start()
        time.sleep(4)

        note("killing RabbitMQ node 1")
        killed = time.monotonic()
        cluster.nodes[0].stop_broker(graceful=False)
        for name, process in run.gateways.items():
            process.wait_for_log(rf"fleet: node {name} reconnected to RabbitMQ", 15)
        time.sleep(3)
        gap, lost = ssmp_gap(run.arrivals, killed)
        table.add("gap", gap)
        table.add("gap_lost", lost)

        holder = run.holder()
        other = "gw1" if holder == "gw0" else "gw0"
        survivor = run.gateways[other]
        note(f"killing {holder}, the lock's holder")
        routed_before = routed(survivor)
        killed = time.monotonic()
        run.gateways[holder].kill()
        # What the dead node had stored, and published past it under the shared reference.
        stored_at_kill = asyncio.run(stored(cluster, run.inbound))
        sent_at_kill = asyncio.run(sequence(cluster, run.outbound, run.reference))
        survivor.wait_for_log(rf"fleet: node {other} holds lock {LOCK} \(taken over", 15)
        table.add("takeover", time.monotonic() - killed)
        deadline = time.monotonic() + 20
        while routed(survivor) <= routed_before and time.monotonic() < deadline:
            time.sleep(0.02)
        table.add("takeover_routed", time.monotonic() - killed)
        time.sleep(2)
        table.add("to_404", first_404(run.answers[other], killed))

        note("waiting for the producer and the consumer")
        wait_for(lambda: len(run.published) >= 20_000, 60, "the producer did not finish")
        offsets = asyncio.run(message_offsets(cluster, run.inbound))
        last = max(offsets)
        wait_for(
            lambda: asyncio.run(stored(cluster, run.inbound)) >= last,
            120,
            "the consumer did not get to the end",
        )
        copies = asyncio.run(output(cluster, run.outbound))
        published = set(run.published)
        table.add("durable_lost", len(published - set(copies)))
        table.add("durable_dups", sum(copies.values()) - len(copies))
        table.add(
            "durable_again",
            sum(1 for offset in offsets if stored_at_kill < offset < sent_at_kill),
        )
    finally:
        run.close()
        for name, process in run.gateways.items():
            (directory / f"{name}.log").write_text(process.output())
        cluster.start_stopped()


def ssmp_gap(arrivals: list[tuple[float, int]], killed: float) -> tuple[float, int]:
    """The longest time without an MCAST from just before the kill on, and those lost."""
    times = [when for when, _ in arrivals if when >= killed - 1]
    longest = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    numbers = sorted(number for _, number in arrivals)
    if not numbers:
        return longest, 0
    missing = (numbers[-1] - numbers[0] + 1) - len(set(numbers))
    return longest, missing


def first_404(answers: list[tuple[float, bytes]], killed: float) -> float:
    """From the kill to the first 404 answer."""
    for when, code in answers:
        if when >= killed and code == b"404":
            return when - killed
    codes = sorted({code for when, code in answers if when >= killed})
    raise SystemExit(f"no 404 after the kill: {len(answers)} answers, after it {codes}")


def routed(process: GatewayProcess) -> float:
    """Messages the durable route took on this gateway so far."""
    return metric(process.metrics(), "msggateway_route_messages_total", route="copy")


def wait_for(condition: Callable[[], bool], seconds: float, problem: str) -> None:
    """Poll ``condition`` until it holds; exit with ``problem`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(problem)
        time.sleep(0.2)


def _client_args(cluster: RabbitMQCluster) -> dict[str, Any]:
    two = cluster.nodes[1]
    return {"host": "127.0.0.1", "port": two.stream_port, "username": "guest", "password": "guest"}


async def message_offsets(cluster: RabbitMQCluster, stream: str) -> list[int]:
    """The offsets of the input stream's messages (read to the end with rstream).

    Offset tracking takes offsets of a stream too: they are not all messages'.
    """
    import rstream

    found: list[int] = []

    async def take(message: Any, context: Any) -> None:
        found.append(context.offset)

    consumer = rstream.Consumer(**_client_args(cluster))
    await consumer.start()
    try:
        await consumer.subscribe(
            stream,
            take,
            offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
        )
        idle = 0
        seen = -1
        while idle < 10:
            await asyncio.sleep(0.2)
            idle = idle + 1 if len(found) == seen else 0
            seen = len(found)
    finally:
        await consumer.close()
    return found


async def sequence(cluster: RabbitMQCluster, stream: str, reference: str) -> int:
    """The last publishing id RabbitMQ stored under ``reference`` in ``stream`` (0: none)."""
    import rstream

    consumer = rstream.Consumer(**_client_args(cluster))
    await consumer.start()
    try:
        client = await consumer.default_client
        return int(await client.query_publisher_sequence(stream, reference))
    finally:
        await consumer.close()


async def stored(cluster: RabbitMQCluster, stream: str) -> int:
    """The offset the gateways' consumer stored (-1: none)."""
    import rstream

    consumer = rstream.Consumer(**_client_args(cluster))
    await consumer.start()
    try:
        return int(await consumer.query_offset(stream, CONSUMER))
    except rstream.exceptions.OffsetNotFound:
        return -1
    finally:
        await consumer.close()


async def output(cluster: RabbitMQCluster, stream: str) -> dict[bytes, int]:
    """Each body in the output stream, with its copies (read until nothing comes for 2 s)."""
    import rstream

    copies: dict[bytes, int] = {}
    count = 0

    async def take(message: Any, context: Any) -> None:
        nonlocal count
        body = bytes(message.body)
        copies[body] = copies.get(body, 0) + 1
        count += 1

    consumer = rstream.Consumer(**_client_args(cluster))
    await consumer.start()
    try:
        await consumer.subscribe(
            stream,
            take,
            decoder=rstream.amqp_decoder,
            offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
        )
        idle = 0
        seen = -1
        while idle < 10:
            await asyncio.sleep(0.2)
            idle = idle + 1 if count == seen else 0
            seen = count
    finally:
        await consumer.close()
    return copies


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    """Run the rounds; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--only", choices=("throughput", "latency", "failover"),
        help="latency: the p99 rows alone",
    )  # fmt: skip
    parser.add_argument("--keep", type=Path, help="keep the gateways' files and logs here")
    args = parser.parse_args()
    stop_on_signals()
    raise_open_file_limit()
    rounds = 1 if args.quick else args.rounds
    ssmpload = args.ssmpload or build_ssmpload()
    table = Table()
    declare_rows(table)
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="msggw-")))
        else:
            directory = args.keep
            directory.mkdir(parents=True, exist_ok=True)
        if args.only in (None, "throughput", "latency"):
            with RabbitMQNode(directory / "rabbitmq") as rabbitmq:
                for number in range(rounds):
                    note(f"throughput round {number + 1} of {rounds}")
                    throughput_round(
                        table,
                        ssmpload,
                        rabbitmq,
                        directory / f"t{number}",
                        args.quick,
                        latency_only=args.only == "latency",
                    )
        if args.only in (None, "failover"):
            with RabbitMQCluster(3, directory / "cluster") as cluster:
                for number in range(rounds):
                    note(f"failover round {number + 1} of {rounds}")
                    failover_round(table, cluster, directory / f"f{number}", number)
    rendered = table.render()
    print(rendered)
    if args.json:
        args.json.write_text(
            json.dumps({key: row.values for key, row in table.rows.items()}, indent=2)
        )


if __name__ == "__main__":
    main()
