"""Benchmark the gateway's stream listener against RabbitMQ 3.10, with rstream.

In one run, three targets are measured with the same client code:

* RabbitMQ (Debian's 3.10 with ``rabbitmq_stream``), a private node on
  loopback started by `tests.rabbitmq.RabbitMQNode` (installed if missing;
  skipped, with the reason, if it cannot be installed or started);
* the gateway with ``[log] fsync = "always"`` (every commit fsynced before
  its messages are confirmed);
* the gateway with ``fsync = "never"``: the policy that matches a single
  RabbitMQ node, which does not fsync chunks either.

For each, a child process (its CPU apart from this driver's; it shares the
machine's cores with the server, as clients do in the issue) runs rstream:

1. publish: create a fresh stream, publish ``--count`` messages of 100
   bytes as raw ``bytes`` with ``Producer.send_batch`` in batches of 1,000,
   never more than 20,000 unconfirmed (it waits for confirms first), and
   time until the last confirm;
2. consume: subscribe from the first offset (rstream's default decoder, no
   AMQP decoding) and time until every message has arrived.

Every phase is bounded by ``--phase-timeout`` seconds; a phase that runs out
is reported as a timeout with what it managed. Before each target the
driver waits (at most ``--quiet-timeout`` seconds) for the machine to be
idle, and each phase records the CPU seconds of the server, the client and
everything else, so a phase disturbed by other work is marked. The table
gives messages per second (the median of ``--rounds``), the ratio
gateway/RabbitMQ, and the server's CPU microseconds per message, which does
not depend on how fast the client is (rstream is the bottleneck on 2 cores).

Batch sizes are measured on the client side, because the gateway's
`CommitStats` are not exposed (the admin ``/metrics`` endpoint does not
carry them): the gateway confirms every Publish frame with a PublishConfirm
of its own, so confirm frames per publish frame is 1 by construction and says
nothing about group commit. But one commit of one stream is one chunk (at
most 65,535 entries, more than the 20,000 that can be unconfirmed), and a
Deliver frame carries exactly one chunk, so messages per Deliver frame is
messages per commit, and under ``always`` messages per fsync. For RabbitMQ
the same figure is the osiris writer's batch (it does not fsync), and the
confirm frames show how it coalesces confirms.

Run it with ``.venv/bin/python bench/stream_vs_rabbitmq.py`` (``--count``,
``--rounds``, ``--phase-timeout``, ``--confirms``, ``--no-rabbitmq``,
``--no-install``; ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import GatewayProcess  # noqa: E402
from tests.rabbitmq import RabbitMQError, RabbitMQNode  # noqa: E402

MESSAGE_BYTES: Final = 100
BATCH_MESSAGES: Final = 1_000
MAX_UNCONFIRMED: Final = 20_000
CLOSE_TIMEOUT_SECONDS: Final = 10.0
CLIENT_SLACK_SECONDS: Final = 60.0
"""On top of the two phases: interpreter start, connections, closing."""

GATEWAY_CONFIG: Final = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[log]
fsync = "{fsync}"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
"""

RABBITMQ: Final = "rabbitmq"
QUIET_BUSY_CORES: Final = 0.3
"""Below this many busy cores (everything on the machine) a target may start."""
FSYNC_PROBE_WRITES: Final = 50
DISTURBED_SHARE: Final = 0.2
DISTURBED_MIN_SECONDS: Final = 0.1
"""A phase is marked when other processes used more than this share of a core
(and more CPU seconds than the minimum, which /proc/stat's ticks blur)."""

# --- the client (runs in a child process) --------------------------------------------------


def _cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU seconds of a process (all its threads), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class _PhaseClock:
    """Wall time and CPU (server, client, whole machine) of one phase."""

    def __init__(self, server_pid: int | None) -> None:
        self._server_pid = server_pid
        self._start = (
            time.monotonic(),
            _cpu_seconds(server_pid),
            time.process_time(),
            _machine_busy_seconds(),
        )

    def finish(self) -> dict[str, Any]:
        """The phase's figures so far."""
        wall, server, client, machine = self._start
        server_now = _cpu_seconds(self._server_pid)
        server_cpu = server_now - server if server is not None and server_now is not None else None
        client_cpu = time.process_time() - client
        machine_cpu = _machine_busy_seconds() - machine
        return {
            "seconds": time.monotonic() - wall,
            "server_cpu": server_cpu,
            "client_cpu": client_cpu,
            "other_cpu": machine_cpu - client_cpu - (server_cpu or 0.0),
        }


def _counting_classes() -> tuple[type, type]:
    """The rstream Producer and Consumer, counting confirm and Deliver frames.

    Imported here so that the driver never imports rstream itself. The
    overridden methods are the handlers rstream registers for PublishConfirm,
    PublishError and Deliver frames; each counts, then does rstream's work.
    """
    import rstream

    class CountingProducer(rstream.Producer):
        """Records every PublishConfirm frame's size and tells ``on_frame`` what settled."""

        confirm_frames: list[int]
        on_frame: Callable[[int, int], None]

        async def _on_publish_confirm(self, frame: Any, publisher: Any) -> None:
            self.confirm_frames.append(len(frame.publishing_ids))
            self.on_frame(len(frame.publishing_ids), 0)
            await super()._on_publish_confirm(frame, publisher)

        async def _on_publish_error(self, frame: Any, publisher: Any) -> None:
            self.on_frame(0, len(frame.errors))
            await super()._on_publish_error(frame, publisher)

    class CountingConsumer(rstream.Consumer):
        """Records the message count of every Deliver frame (one chunk each)."""

        chunks: list[int]

        async def _on_deliver(self, frame: Any, subscriber: Any, filter_value: Any) -> None:
            self.chunks.append(frame.num_records)
            await super()._on_deliver(frame, subscriber, filter_value)

    return CountingProducer, CountingConsumer


async def _publish(spec: dict[str, Any], stream: str, result: dict[str, Any]) -> None:
    """Publish phase: fills ``result`` as it goes, so a timeout keeps what was done.

    Confirms are counted from the PublishConfirm frames (``confirms =
    "frames"``), or through rstream's per-message ``on_publish_confirm``
    callback (``"callback"``), which costs the client about a microsecond
    more per message. With ``seconds`` in the spec, no batch is sent after
    that many seconds: the phase ends with the last confirm of what was sent.
    """
    producer_class, _ = _counting_classes()
    count, batch, limit = spec["count"], spec["batch"], spec["max_unconfirmed"]
    bodies = [b"%09d " % i + bytes(spec["size"] - 10) for i in range(batch)]
    producer = producer_class(**spec["connection"])
    producer.confirm_frames = []
    result.update(confirmed=0, failed=0, publish_frames=0)
    sent = settled = 0
    target = count  # what must settle: all of it, or what was sent by the time bound
    room = asyncio.Event()
    finished = asyncio.Event()

    def on_settled(confirmed: int, failed: int) -> None:
        nonlocal settled
        settled += confirmed + failed
        result["confirmed"] += confirmed
        result["failed"] += failed
        if sent - settled + batch <= limit:
            room.set()
        if settled >= target:
            finished.set()

    def on_confirm(status: Any) -> None:
        if status.is_confirmed:
            on_settled(1, 0)
        else:
            on_settled(0, 1)

    by_callback = spec["confirms"] == "callback"
    producer.on_frame = (lambda _confirmed, _failed: None) if by_callback else on_settled
    callback = on_confirm if by_callback else None
    try:
        await producer.start()
        await producer.create_stream(stream)
        clock = _PhaseClock(spec["server_pid"])
        result["clock"] = clock
        stop_at = time.monotonic() + spec["seconds"] if spec.get("seconds") else None
        for start in range(0, count, batch):
            if stop_at is not None and time.monotonic() >= stop_at:
                target = sent
                if settled >= target:
                    finished.set()
                break
            size = min(batch, count - start)
            while sent - settled + size > limit:
                room.clear()
                await room.wait()
            sent += size  # before the send: a confirm may come back before it returns
            await producer.send_batch(stream, bodies[:size], on_publish_confirm=callback)
            result["publish_frames"] += 1
        await finished.wait()
        result.update(clock.finish(), status="ok")
    finally:
        result["messages"] = result["confirmed"]
        result["confirm_frames"] = producer.confirm_frames
        with suppress(Exception):
            await asyncio.wait_for(producer.close(), CLOSE_TIMEOUT_SECONDS)


async def _consume(spec: dict[str, Any], stream: str, result: dict[str, Any]) -> None:
    """Consume phase: reads every message from the first offset."""
    import rstream

    _, consumer_class = _counting_classes()
    count = spec["count"]
    consumer = consumer_class(**spec["connection"])
    consumer.chunks = []
    received = gaps = backwards = expected = 0
    finished = asyncio.Event()

    def on_message(_body: bytes, context: Any) -> None:
        nonlocal received, gaps, backwards, expected
        if context.offset != expected:
            # A gap is normal where a chunk that is not delivered (a tracking
            # snapshot at a segment roll) takes an offset; backwards is not.
            if context.offset > expected:
                gaps += 1
            else:
                backwards += 1
        expected = context.offset + 1
        received += 1
        if received >= count:
            finished.set()

    runner: asyncio.Task[None] | None = None
    try:
        await consumer.start()
        clock = _PhaseClock(spec["server_pid"])
        result["clock"] = clock
        await consumer.subscribe(
            stream,
            on_message,
            offset_specification=rstream.ConsumerOffsetSpecification(rstream.OffsetType.FIRST),
        )
        runner = asyncio.create_task(consumer.run())
        await finished.wait()
        result.update(clock.finish(), status="ok")
    finally:
        result.update(
            received=received,
            messages=received,
            offset_gaps=gaps,
            offsets_backwards=backwards,
            chunks=consumer.chunks,
        )
        with suppress(Exception):
            await asyncio.wait_for(consumer.close(), CLOSE_TIMEOUT_SECONDS)
        if runner is not None:
            runner.cancel()


async def _bounded(phase: Any, spec: dict[str, Any], stream: str, result: dict[str, Any]) -> None:
    """Run one phase within the phase time-out; record a time-out or an error as such."""
    try:
        await asyncio.wait_for(phase(spec, stream, result), spec["phase_timeout"])
    except TimeoutError:
        result["status"] = f"timeout after {spec['phase_timeout']:g} s"
    except Exception as exc:  # reported in the table, not hidden: the run goes on
        result["status"] = f"error: {type(exc).__name__}: {exc}"
    clock = result.pop("clock", None)
    if result.get("status") != "ok" and clock is not None:
        result.update(clock.finish())


def run_client(spec: dict[str, Any]) -> dict[str, Any]:
    """Publish then consume against one target; return the figures (JSON-able)."""
    stream = f"bench-{uuid.uuid4().hex[:12]}"
    publish: dict[str, Any] = {"status": "not started"}
    consume: dict[str, Any] = {"status": "not started"}
    asyncio.run(_bounded(_publish, spec, stream, publish))
    if publish["status"] == "ok":
        # Under a time bound, what was confirmed is what there is to read.
        bounded = dict(spec, count=publish["confirmed"]) if spec.get("seconds") else spec
        asyncio.run(_bounded(_consume, bounded, stream, consume))
    else:
        consume["status"] = "skipped (publish did not finish)"
    return {"publish": publish, "consume": consume, "stream": stream}


# --- the driver ------------------------------------------------------------------------


def wait_for_quiet(limit_seconds: float) -> float | None:
    """Wait until the machine is nearly idle (other benchmarks share it); bounded.

    Samples /proc/stat over one-second windows until less than
    `QUIET_BUSY_CORES` cores were busy in one, or ``limit_seconds`` pass.

    Returns:
        The busy cores of the last window if it never got quiet, else None.
    """
    deadline = time.monotonic() + limit_seconds
    while True:
        before = _machine_busy_seconds()
        time.sleep(1.0)
        busy = _machine_busy_seconds() - before
        if busy < QUIET_BUSY_CORES:
            return None
        if time.monotonic() >= deadline:
            return busy


def measure(
    args: argparse.Namespace, connection: dict[str, Any], server_pid: int | None
) -> dict[str, Any]:
    """Run the client in a child process against one server; return its figures."""
    spec = {
        "connection": connection,
        "server_pid": server_pid,
        "count": args.count,
        "size": MESSAGE_BYTES,
        "batch": BATCH_MESSAGES,
        "max_unconfirmed": MAX_UNCONFIRMED,
        "phase_timeout": args.phase_timeout,
        "confirms": args.confirms,
    }
    busy = wait_for_quiet(args.quiet_timeout)
    limit = 2 * args.phase_timeout + CLIENT_SLACK_SECONDS
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--client", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=limit,
            check=False,
        )
    except subprocess.TimeoutExpired:
        failed = {"status": f"client killed after {limit:.0f} s"}
        return {"publish": failed, "consume": failed, "busy_before": busy}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        failed = {"status": f"client exited with {done.returncode}: {done.stderr[-2000:]}"}
        return {"publish": failed, "consume": failed, "busy_before": busy}
    figures: dict[str, Any] = json.loads(lines[-1])
    figures["busy_before"] = busy
    return figures


@contextmanager
def gateway(fsync: str) -> Iterator[tuple[dict[str, Any], int]]:
    """A gateway with one stream listener and the given fsync policy."""
    with tempfile.TemporaryDirectory(prefix=f"msggw-bench-{fsync}-") as directory:
        process = GatewayProcess(Path(directory), GATEWAY_CONFIG.format(fsync=fsync)).start()
        try:
            host, port = process.address("streams")
            connection = {"host": host, "port": port, "username": "guest", "password": "guest"}
            yield connection, process.pid
        finally:
            process.stop()


def _rate(phase: dict[str, Any]) -> float | None:
    """Messages per second of a finished phase."""
    if phase.get("status") != "ok" or not phase.get("seconds"):
        return None
    return float(phase["messages"]) / float(phase["seconds"])


def _server_us(phase: dict[str, Any]) -> float | None:
    """Server CPU microseconds per message of a finished phase."""
    if phase.get("status") != "ok" or phase.get("server_cpu") is None or not phase["messages"]:
        return None
    return float(phase["server_cpu"]) * 1e6 / float(phase["messages"])


def _disturbed(phase: dict[str, Any]) -> bool:
    """Whether other processes used a noticeable share of the machine during a phase."""
    seconds = phase.get("seconds") or 0.0
    other = phase.get("other_cpu") or 0.0
    return bool(seconds) and other > max(DISTURBED_SHARE * seconds, DISTURBED_MIN_SECONDS)


def _median(values: list[float | None]) -> float | None:
    """The median of the known values, or None."""
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _sizes(sizes: list[int]) -> str:
    """A one-line summary of batch sizes."""
    if not sizes:
        return "none"
    ordered = sorted(sizes)
    return (
        f"{len(sizes):,} frames, mean {statistics.fmean(sizes):,.0f},"
        f" median {statistics.median(ordered):,.0f}, p10 {ordered[len(ordered) // 10]:,},"
        f" p90 {ordered[len(ordered) * 9 // 10]:,}, max {ordered[-1]:,}"
    )


def _phase_line(phase: dict[str, Any]) -> str:
    """One round of one phase: status, rate, wall time and CPU seconds."""
    rate = _rate(phase)
    parts = [f"{rate:,.0f} msg/s" if rate is not None else str(phase.get("status"))]
    parts.append(f"{phase.get('seconds', 0):.2f} s")
    for key, label in (("server_cpu", "server"), ("client_cpu", "client"), ("other_cpu", "other")):
        value = phase.get(key)
        parts.append(f"{label} {value:.1f} CPU s" if value is not None else f"{label} ?")
    return ", ".join(parts)


def _batch_label(target: str) -> str:
    """What a Deliver frame's message count means for a target."""
    if target == RABBITMQ:
        return "per chunk (osiris write batch; RabbitMQ does not fsync)"
    if target.endswith("always"):
        return "per commit = per fsync"
    return "per commit (no fsync)"


def report(rounds: dict[str, list[dict[str, Any]]], notes: list[str]) -> None:
    """Print the table (medians over rounds) and the notes."""
    table: dict[str, dict[str, Any]] = {}
    for target, results in rounds.items():
        row: dict[str, Any] = {}
        for phase in ("publish", "consume"):
            phases = [result[phase] for result in results]
            failed = next((p["status"] for p in phases if p.get("status") != "ok"), "?")
            row[phase] = (
                _median([_rate(p) for p in phases]),
                _median([_server_us(p) for p in phases]),
                any(_disturbed(p) for p in phases),
                failed,
            )
        table[target] = row
    base = table.get(RABBITMQ)

    def cell(target: str, phase: str) -> str:
        rate, _us, disturbed, failed = table[target][phase]
        mark = "*" if disturbed else " "
        text = f"{rate:>13,.0f}" if rate is not None else f"{failed[:13]:>13}"
        base_rate = base[phase][0] if base else None
        ratio = f"{rate / base_rate:>7.2f}x" if rate and base_rate else f"{'n/a':>8}"
        return f"{text}{mark} {ratio}"

    def cpu(target: str, phase: str) -> str:
        us = table[target][phase][1]
        return f"{us:>6.2f}" if us is not None else f"{'?':>6}"

    print()
    print(
        f"{'target':22} {'publish msg/s':>14} {'vs RMQ':>8} {'consume msg/s':>14} {'vs RMQ':>8}"
        f"  server CPU us/msg (pub, con)"
    )
    for target in table:
        print(
            f"{target:22} {cell(target, 'publish')} {cell(target, 'consume')}"
            f"  {cpu(target, 'publish')} {cpu(target, 'consume')}"
        )
    count = max(len(results) for results in rounds.values()) if rounds else 0
    print(
        f"median of {count} round(s); vs RMQ: rate over RabbitMQ's in the same run (> 1: faster);"
        f"\n*: other processes used over {DISTURBED_SHARE:.0%} of a core during a phase"
    )
    print()
    print("notes:")
    for target, results in rounds.items():
        print(f"  {target}:")
        for number, result in enumerate(results, 1):
            if result.get("busy_before") is not None:
                print(f"    round {number}: machine still busy ({result['busy_before']:.1f} cores)")
            print(f"    round {number} publish: {_phase_line(result['publish'])}")
            print(f"    round {number} consume: {_phase_line(result['consume'])}")
        publishes = [result["publish"] for result in results]
        consumes = [result["consume"] for result in results]
        confirms = [size for p in publishes for size in p.get("confirm_frames", [])]
        frames = sum(p.get("publish_frames", 0) for p in publishes)
        print(
            f"    confirmed {sum(p.get('confirmed', 0) for p in publishes):,},"
            f" failed {sum(p.get('failed', 0) for p in publishes):,}, in {frames:,} publish"
            f" frames; confirm frames per publish frame {len(confirms) / max(1, frames):.2f}"
        )
        print(f"    messages per confirm frame: {_sizes(confirms)}")
        print(
            f"    received {sum(c.get('received', 0) for c in consumes):,};"
            f" offset gaps {sum(c.get('offset_gaps', 0) for c in consumes):,},"
            f" backwards {sum(c.get('offsets_backwards', 0) for c in consumes):,}"
        )
        chunks = [size for c in consumes for size in c.get("chunks", [])]
        print(f"    messages {_batch_label(target)}: {_sizes(chunks)}")
    for note in notes:
        print(f"  {note}")


def fsync_probe(directory: Path, writes: int = FSYNC_PROBE_WRITES) -> str:
    """Time appends of one 1,000-message chunk (about 113 KB), each fsynced, in ``directory``."""
    block = bytes(113_000)
    times = []
    with tempfile.NamedTemporaryFile(dir=directory) as probe:
        for _ in range(writes):
            started = time.perf_counter()
            probe.write(block)
            probe.flush()
            os.fsync(probe.fileno())
            times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return (
        f"append + fsync of 113 KB there: median {statistics.median(times):.2f} ms,"
        f" p90 {times[len(times) * 9 // 10]:.2f} ms ({writes} writes)"
    )


def _machine() -> str:
    """A line about the machine."""
    model = "?"
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"machine: {os.cpu_count()} CPUs ({model}), {platform.platform()},"
        f" Python {platform.python_version()}, load average {load} at the end"
    )


def _filesystem(path: Path) -> str:
    """The file system type and device a path is on, from /proc/mounts."""
    best = ("?", "?", "")
    resolved = path.resolve()
    with suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if resolved.is_relative_to(mount) and len(mount) >= len(best[2]):
                best = (device, kind, mount)
    return f"{best[1]} on {best[0]}"


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000, help="messages per target")
    parser.add_argument(
        "--phase-timeout", type=float, default=120.0, help="seconds each phase may take"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every target this many times (median)"
    )
    parser.add_argument(
        "--confirms",
        choices=("frames", "callback"),
        default="frames",
        help="count confirms from PublishConfirm frames (default) or rstream's callback",
    )
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for other load to stop before each target",
    )
    parser.add_argument("--no-rabbitmq", action="store_true", help="measure the gateway only")
    parser.add_argument(
        "--no-install", action="store_true", help="skip RabbitMQ if it is not installed"
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the child process's mode
    return parser.parse_args()


def _measure_rabbitmq(args: argparse.Namespace, notes: list[str]) -> dict[str, Any] | None:
    """One round against a fresh RabbitMQ node; None (and a note) if it cannot run."""
    try:
        with RabbitMQNode(install=not args.no_install) as node:
            version = node.version()
            print(f"RabbitMQ {version} ready on port {node.stream_port}", file=sys.stderr)
            result = measure(args, node.stream_connection(), node.server_pid)
            done = "; ".join(node.setup_notes or ["already installed"])
            note = (
                f"RabbitMQ {version} (Debian package), a private node per round,"
                f" default stream settings; {done}"
            )
            if note not in notes:
                notes.append(note)
            return result
    except RabbitMQError as exc:
        print(f"RabbitMQ skipped: {exc}", file=sys.stderr)
        notes.append(f"RabbitMQ: skipped, {str(exc).splitlines()[0]}")
        return None


def main() -> None:
    """Measure every target and print the comparison."""
    args = _arguments()
    if args.client:
        print(json.dumps(run_client(json.loads(args.client))))
        return
    notes = [
        f"rstream {metadata.version('rstream')}; {args.count:,} messages of {MESSAGE_BYTES}"
        f" bytes per target and round, send_batch of {BATCH_MESSAGES:,}, at most"
        f" {MAX_UNCONFIRMED:,} unconfirmed, confirms counted by {args.confirms}; consumer from"
        " the first offset, default decoder and credit",
        "client: one child process per target, sharing the cores with the server"
        " (CPU 'other': everything else on the machine during the phase)",
    ]
    rounds: dict[str, list[dict[str, Any]]] = {}
    rabbitmq = not args.no_rabbitmq
    if not rabbitmq:
        notes.append("RabbitMQ: skipped (--no-rabbitmq)")
    for _round in range(args.rounds):
        if rabbitmq:
            result = _measure_rabbitmq(args, notes)
            if result is None:
                rabbitmq = False
            else:
                rounds.setdefault(RABBITMQ, []).append(result)
        for fsync in ("always", "never"):
            with gateway(fsync) as (connection, pid):
                print(f"gateway fsync={fsync} ready on port {connection['port']}", file=sys.stderr)
                rounds.setdefault(f"gateway fsync={fsync}", []).append(
                    measure(args, connection, pid)
                )
    data_dir = Path(tempfile.gettempdir())
    notes += [
        f"gateway data under {data_dir} ({_filesystem(data_dir)}); {fsync_probe(data_dir)}",
        "gateway: 64 MiB segments; a roll adds a tracking snapshot chunk, whose offset"
        " consumers skip (one gap per roll)",
        "batch sizes are seen by the client (the gateway's CommitStats are not exposed by"
        " /metrics); the gateway sends one PublishConfirm per Publish frame",
        _machine(),
    ]
    report(rounds, notes)


if __name__ == "__main__":
    main()
