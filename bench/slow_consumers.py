"""Slow consumers: one consumer that stops reading while a publisher sends a million messages.

For each of SSMP, the stream protocol, a DMP feed and an MTL reader, one
gateway process (``twistd msggateway``, default limits) gets one consumer
that subscribes and then never reads its socket again, and one publisher
that sends ``--messages`` messages of ``--size`` bytes as fast as the
gateway takes them. The gateway's resident memory (``/proc/PID/status``
VmRSS) is sampled all along. The baseline row of each protocol is the same
publisher in the same run with no consumer at all, on a fresh gateway.

Columns:

* ``sent``: messages the publisher wrote;
* ``acked``: what the publisher was told was delivered (SSMP ``200``, stream
  PublishConfirm, MTL Confirm; DMP has no acknowledgement: ``-``);
* ``refused``: what the publisher (or, for DMP, the route's outcome count)
  was told was not delivered (MTL Reject with recycle, DMP retry later);
* ``delivered``: what the slow consumer finds on its socket when it finally
  reads (until the gateway closes it or it is idle for a second);
* ``answer``: what the gateway did about the slow consumer (``disconnect``
  counted in ``msggateway_slow_consumer_disconnects_total``; ``paused at
  N``: the stream sent N messages, then nothing more until the consumer
  read, the rest waiting in the log; ``retry`` or ``reject``: deliveries
  answered retry later, for MTL a Reject with recycle to the writer;
  ``forgotten``: the MTL reader, silent, was dropped after
  ``dead_after_seconds``);
* ``RSS start/peak/end``: MiB, before the publisher starts, the highest
  sample until the publisher is done and answered, and then, before the
  consumer reads (its reading at the end, the gateway then sending what it
  held back, is normal traffic and not counted);
* ``bounded``: the peak over the second half of the publishing is within
  16 MiB of the peak over the first half, and within 64 MiB of the
  baseline's growth (an unbounded buffer of a million 100-byte messages
  grows well past both).

Bounded in count and time: every wait has a deadline. Run with
``python -m bench.slow_consumers [--messages 1000000] [--quick]``.
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dmp_sink_to_feed import envelope, opened, take_envelopes  # noqa: E402
from bench.gateway_proc import (  # noqa: E402
    ADMIN_TABLE,
    DMP_LISTENER,
    GATEWAY_TABLE,
    MTL_LISTENER,
    SSMP_LISTENER,
    STREAM_LISTENER,
    StreamClient,
    add_set_option,
    gateway_config,
    metric,
    rss_kib,
    wait_until,
)
from bench.mtl_flow import EMPTY_TABLE, U64, lease, settle, short  # noqa: E402
from gateway.codecs import stream as sp  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

TABLES: Final[dict[str, tuple[str, ...]]] = {
    "gateway": GATEWAY_TABLE,
    "admin": ADMIN_TABLE,
    "log": ('fsync = "never"',),
    "listeners.hub": SSMP_LISTENER,
    "listeners.streams": (*STREAM_LISTENER, "heartbeat_seconds = 0"),
    "listeners.dmp": DMP_LISTENER,
    "listeners.mtl": (*MTL_LISTENER, 'profiles = ["gateway"]'),
    "listeners.mtl2": (*MTL_LISTENER, 'profiles = ["gateway"]'),
}
"""The gateway's main file, table by table (`gateway_config`)."""
ROUTES: Final = {
    "dmp-loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n',
    "mtl-across": 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n',
}
PROTOCOLS: Final = ("ssmp", "stream", "dmp", "mtl")
SAMPLE_SECONDS: Final = 0.05
IDLE_SECONDS: Final = 1.0
"""A consumer that finally reads stops when nothing came for this long."""
WINDOW: Final = 5000
"""Messages a publisher that is answered keeps unanswered, at most."""
PLATEAU_MIB: Final = 16.0
BASELINE_SLACK_MIB: Final = 64.0


# --- measuring -----------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """The resident memory of a process, in MiB (0 when it is gone)."""
    try:
        return rss_kib(pid) / 1024
    except (OSError, RuntimeError):  # gone, or a zombie without VmRSS
        return 0.0


class RSSSampler:
    """Samples a process's RSS every `SAMPLE_SECONDS` on a thread, with the phase it is in."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.samples: list[tuple[str, float]] = []
        self.phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.samples.append((self.phase, rss_mib(self._pid)))

    def __enter__(self) -> RSSSampler:
        self.samples.append(("start", rss_mib(self._pid)))
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(("end", rss_mib(self._pid)))

    def peak(self, *phases: str) -> float:
        """The highest sample in the phases named (all when none is named)."""
        values = [rss for phase, rss in self.samples if not phases or phase in phases]
        return max(values, default=0.0)


@dataclass
class Row:
    """One line of the table."""

    protocol: str
    mode: str
    sent: int = 0
    acked: int | None = None
    refused: int = 0
    delivered: int | None = None
    answer: str = "-"
    rss_start: float = 0.0
    rss_peak: float = 0.0
    rss_end: float = 0.0
    growth_first_half: float = 0.0
    growth_second_half: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    metrics_before_read: str = field(default="", repr=False)
    """The gateway's /metrics once the publisher is done, before the consumer reads."""
    metrics_end: str = field(default="", repr=False)
    """The gateway's /metrics at the end."""


def drain(sock: socket.socket, count: Callable[[bytes], None]) -> None:
    """Read a socket until it closes, resets, or is idle for `IDLE_SECONDS`."""
    sock.settimeout(IDLE_SECONDS)
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return
            count(data)
    except (TimeoutError, ConnectionResetError):
        return


class Counted:
    """A count shared between threads (only one writes)."""

    def __init__(self) -> None:
        self.value = 0
        self.other = 0
        self.done = threading.Event()


def send_in_batches(
    messages: int, batch: int, sampler: RSSSampler, row: Row, send: Callable[[int, int], None]
) -> None:
    """Send ``messages`` as ``send(first, count)`` batches, counted in ``row.sent``.

    The sampler's phase is ``first`` for the first half, then ``second``.
    """
    sampler.phase = "first"
    for start in range(0, messages, batch):
        if start >= messages // 2:
            sampler.phase = "second"
        n = min(batch, messages - start)
        send(start, n)
        row.sent += n


# --- SSMP ----------------------------------------------------------------------------------


def ssmp_login(gateway: GatewayProcess, name: str, topics: tuple[str, ...] = ()) -> socket.socket:
    """An SSMP connection logged in (open scheme) and subscribed, the 200s read."""
    sock = socket.create_connection(gateway.address("hub"), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lines = [f"LOGIN {name} open", *(f"SUBSCRIBE {topic}" for topic in topics)]
    sock.sendall("".join(line + "\n" for line in lines).encode())
    got = b""
    while got.count(b"\n") < len(lines):
        data = sock.recv(4096)
        if not data:
            raise SystemExit(f"SSMP: the hub closed the login of {name}: {got!r}")
        got += data
    assert got.split(b"\n")[: len(lines)] == [b"200"] * len(lines), got
    return sock


def run_ssmp(gateway: GatewayProcess, messages: int, size: int, slow: bool, row: Row,
             sampler: RSSSampler) -> None:  # fmt: skip
    """MCAST to a topic; the slow consumer is subscribed to it."""
    consumer = ssmp_login(gateway, "slow", ("flood",)) if slow else None
    publisher = ssmp_login(gateway, "pub")
    acked = Counted()

    def replies() -> None:
        pending = b""
        try:
            while acked.value + acked.other < messages:
                data = publisher.recv(1 << 20)
                if not data:
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line == b"200":
                        acked.value += 1
                    else:
                        acked.other += 1
        except OSError:
            pass
        acked.done.set()

    reader = threading.Thread(target=replies, daemon=True)
    reader.start()
    line = b"MCAST flood " + b"x" * size + b"\n"
    send_in_batches(messages, 1000, sampler, row, lambda _, n: publisher.sendall(line * n))
    acked.done.wait(300)
    sampler.phase = "after"
    row.acked = acked.value
    publisher.close()
    row.metrics_before_read = gateway.metrics()
    sampler.phase = "reading"
    if consumer is not None:
        got = Counted()

        def count(data: bytes) -> None:
            got.value += data.count(b" MCAST flood ")

        drain(consumer, count)
        consumer.close()
        row.delivered = got.value
    text = gateway.metrics()
    disconnects = metric(text, "msggateway_slow_consumer_disconnects_total", endpoint="hub")
    row.answer = f"disconnect x{disconnects:.0f}" if disconnects else "-"


# --- stream --------------------------------------------------------------------------------


def run_stream(gateway: GatewayProcess, messages: int, size: int, slow: bool, row: Row,
               sampler: RSSSampler) -> None:  # fmt: skip
    """Publish with confirms; the slow consumer keeps granting credit and never reads."""
    publisher = StreamClient(gateway.address("streams")).open()
    publisher.create("flood")
    publisher.declare_publisher(1, "flood")
    consumer: StreamClient | None = None
    stop_granting = threading.Event()
    granter: threading.Thread | None = None
    if slow:
        consumer = StreamClient(gateway.address("streams")).open()
        consumer.send(
            sp.Subscribe(
                correlation_id=7,
                subscription_id=1,
                stream="flood",
                offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
                credit=100,
            )
        )
        answer = consumer.read()
        assert isinstance(answer, sp.Response) and answer.code == 1, answer
        credit = consumer.codec.send(sp.Credit(subscription_id=1, credit=1000))
        sock = consumer.sock

        def grant() -> None:
            # Generous credit, again and again, never reading: sent only while
            # the socket takes it (the gateway stops reading a congested peer).
            while not stop_granting.wait(0.02):
                if select.select([], [sock], [], 0)[1]:
                    with suppress(BlockingIOError, OSError):
                        sock.send(credit, socket.MSG_DONTWAIT)

        granter = threading.Thread(target=grant, daemon=True)
        granter.start()
    acked = Counted()

    def confirms() -> None:
        try:
            while acked.value + acked.other < messages:
                event = publisher.read()
                if isinstance(event, sp.PublishConfirm):
                    acked.value += len(event.publishing_ids)
                elif isinstance(event, sp.PublishError):
                    acked.other += len(event.publishing_ids)
        except (OSError, EOFError):
            pass
        acked.done.set()

    reader = threading.Thread(target=confirms, daemon=True)
    reader.start()
    body = b"x" * size

    def publish(start: int, n: int) -> None:
        ids = list(range(start + 1, start + n + 1))
        publisher.send(sp.Publish(publisher_id=1, publishing_ids=ids, messages=[body] * n))

    send_in_batches(messages, 100, sampler, row, publish)
    acked.done.wait(300)
    sampler.phase = "after"
    row.acked = acked.value
    row.refused = acked.other
    stop_granting.set()
    if granter is not None:
        granter.join()
    publisher.sock.close()
    row.metrics_before_read = gateway.metrics()
    sampler.phase = "reading"
    if consumer is not None:
        got = Counted()

        def count(data: bytes) -> None:
            for event in consumer.codec.receive_data(data):
                if isinstance(event, sp.Deliver):
                    got.value += int.from_bytes(bytes(event.chunk[4:8]), "big")

        drain(consumer.sock, count)
        consumer.sock.close()
        row.delivered = got.value
        sent = "msggateway_messages_sent_total"
        before = metric(row.metrics_before_read, sent, endpoint="streams")
        if before < messages:  # the rest waited in the log until the consumer read
            row.answer = f"paused at {before:,.0f}"
    text = gateway.metrics()
    disconnects = metric(text, "msggateway_slow_consumer_disconnects_total", endpoint="streams")
    if disconnects:
        row.answer = f"disconnect x{disconnects:.0f}"


# --- DMP -----------------------------------------------------------------------------------


def run_dmp(gateway: GatewayProcess, messages: int, size: int, slow: bool, row: Row,
            sampler: RSSSampler) -> None:  # fmt: skip
    """Write into a sink routed to a feed; the slow consumer is the feed's reader."""
    consumer = opened(gateway.address("dmp"), b"r") if slow else None
    writer = opened(gateway.address("dmp"), b"w")
    one = envelope(b"x" * size)
    send_in_batches(messages, 1000, sampler, row, lambda _, n: writer.sendall(one * n))

    def settled() -> bool:
        text = gateway.metrics()
        done = sum(
            metric(text, "msggateway_route_outcomes_total", route="dmp-loop", outcome=outcome)
            for outcome in ("accepted", "retry", "rejected")
        )
        return done >= messages

    if not wait_until(settled, 300, 0.2):
        row.notes.append("not every message had its outcome in 300 s")
    sampler.phase = "after"
    text = gateway.metrics()
    row.refused = int(
        metric(text, "msggateway_route_outcomes_total", route="dmp-loop", outcome="retry")
    )
    writer.close()
    row.metrics_before_read = gateway.metrics()
    sampler.phase = "reading"
    if consumer is not None:
        got = Counted()
        pending = bytearray()

        def count(data: bytes) -> None:
            pending.extend(data)
            got.value += len(take_envelopes(pending))

        drain(consumer, count)
        consumer.close()
        row.delivered = got.value
    text = gateway.metrics()
    disconnects = metric(text, "msggateway_slow_consumer_disconnects_total", endpoint="dmp")
    answers = []
    if row.refused:
        answers.append("retry")
    if disconnects:
        answers.append(f"disconnect x{disconnects:.0f}")
    row.answer = " + ".join(answers) or "-"


# --- MTL -----------------------------------------------------------------------------------


def run_mtl(gateway: GatewayProcess, messages: int, size: int, slow: bool, row: Row,
            sampler: RSSSampler) -> None:  # fmt: skip
    """A confirm=full writer to ``in``, routed to ``out`` of ``mtl2`` (the slow consumer's)."""
    context = zmq.Context()
    try:
        port = gateway.address("mtl")[1]
        consumer = None
        if slow:
            port2 = gateway.address("mtl2")[1]
            consumer = lease(context, port2, "gateway", "Reader", ["out"], "none", receive_hwm=None)
            consumer.send_multipart([b"\x03" + U64.pack(2) + short("out"), b""])
            assert consumer.recv_multipart()[1] == b"200"
        writer = lease(context, port, "gateway", "Writer", ["in"], "full", receive_hwm=None)
        head = short("") + EMPTY_TABLE
        body = b"x" * size
        confirmed = rejected = sent = 0
        unsettled: dict[int, None] = {}
        deadline = time.monotonic() + 600
        sampler.phase = "first"
        while confirmed + rejected < messages and time.monotonic() < deadline:
            while sent < messages and sent - confirmed - rejected < WINDOW:
                sent += 1
                unsettled[sent] = None
                writer.send_multipart([b"\x05" + U64.pack(sent) + head, body])
            if sent >= messages // 2:
                sampler.phase = "second"
            if not writer.poll(10_000):
                row.notes.append("the writer heard nothing for 10 s")
                break
            while writer.poll(0):
                header, _ = writer.recv_multipart()
                if header[0] == 0x06:
                    confirmed += settle(unsettled, header)
                elif header[0] == 0x07:
                    rejected += settle(unsettled, header)
                elif header[0] == 0x08:
                    writer.send_multipart([b"\x09", b""])
        sampler.phase = "after"
        row.sent, row.acked, row.refused = sent, confirmed, rejected
        writer.close(linger=0)
        row.metrics_before_read = gateway.metrics()
        sampler.phase = "reading"
        if consumer is not None:
            got = 0
            while consumer.poll(int(IDLE_SECONDS * 1000)):
                header, _ = consumer.recv_multipart()
                got += header[0] == 0x05
            consumer.close(linger=0)
            row.delivered = got
        text = gateway.metrics()
        dead = metric(text, "msggateway_protocol_errors_total", endpoint="mtl2", kind="dead-peer")
        answers = ["reject"] if rejected else []
        if dead:
            answers.append(f"forgotten x{dead:.0f}")
        row.answer = " + ".join(answers) or "-"
    finally:
        context.destroy(linger=0)


# --- the run -------------------------------------------------------------------------------

RUNS: Final = {"ssmp": run_ssmp, "stream": run_stream, "dmp": run_dmp, "mtl": run_mtl}


@contextmanager
def gateway_process(settings: dict[str, str] | None = None) -> Iterator[GatewayProcess]:
    """A fresh gateway with the five listeners and the two routes."""
    with tempfile.TemporaryDirectory() as directory:
        config = gateway_config(TABLES, settings)
        process = GatewayProcess(Path(directory), config, routes=dict(ROUTES)).start()
        try:
            yield process
        finally:
            process.stop()


def measure(
    protocol: str, messages: int, size: int, slow: bool, settings: dict[str, str] | None = None
) -> Row:
    """One row: a fresh gateway, the publisher, and the slow consumer if ``slow``.

    Args:
        protocol: ``ssmp``, ``stream``, ``dmp`` or ``mtl``.
        messages: How many the publisher sends.
        size: Body bytes of each.
        slow: Whether there is a consumer that stops reading.
        settings: ``LISTENER.KEY`` to a TOML value, added to the configuration.
    """
    row = Row(protocol, "slow consumer" if slow else "baseline (none)")
    with gateway_process(settings) as gateway:
        started = time.monotonic()
        with RSSSampler(gateway.pid) as sampler:
            RUNS[protocol](gateway, messages, size, slow, row, sampler)
        row.metrics_end = gateway.metrics()
        row.seconds = time.monotonic() - started
    publishing = [rss for phase, rss in sampler.samples if phase != "reading" and phase != "end"]
    row.rss_start = publishing[0]
    row.rss_end = publishing[-1]
    row.rss_peak = max(publishing)
    first = sampler.peak("start", "first")
    row.growth_first_half = first - row.rss_start
    row.growth_second_half = sampler.peak("second", "after") - first
    return row


def bounded(row: Row, baseline: Row | None) -> bool:
    """Whether a row's memory plateaued, and stayed near its baseline's."""
    if row.growth_second_half > PLATEAU_MIB:
        return False
    if baseline is None:
        return True
    growth = row.rss_peak - row.rss_start
    return growth <= (baseline.rss_peak - baseline.rss_start) + BASELINE_SLACK_MIB


def table(rows: list[Row]) -> str:
    """The results as a fixed-width table."""
    head = (
        f"{'protocol':8} {'mode':16} {'sent':>9} {'acked':>9} {'refused':>9} {'delivered':>9}"
        f" {'answer':22} {'RSS start':>9} {'peak':>7} {'end':>7} {'bounded':>7} {'secs':>6}"
    )
    lines = [head, "-" * len(head)]
    baselines = {row.protocol: row for row in rows if row.mode.startswith("baseline")}
    for row in rows:
        baseline = baselines.get(row.protocol) if row.mode == "slow consumer" else None
        yes = "yes" if bounded(row, baseline) else "NO"
        acked = "-" if row.acked is None else f"{row.acked:,}"
        delivered = "-" if row.delivered is None else f"{row.delivered:,}"
        lines.append(
            f"{row.protocol:8} {row.mode:16} {row.sent:>9,} {acked:>9} {row.refused:>9,}"
            f" {delivered:>9} {row.answer:22} {row.rss_start:>9.1f} {row.rss_peak:>7.1f}"
            f" {row.rss_end:>7.1f} {yes:>7} {row.seconds:>6.1f}"
        )
        lines.extend(f"    note: {note}" for note in row.notes)
    return "\n".join(lines)


def main() -> None:
    """Run every protocol's baseline and slow consumer; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=None, help="default 1,000,000")
    parser.add_argument("--size", type=int, default=100, help="message body bytes")
    parser.add_argument("--quick", action="store_true", help="50,000 messages")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--no-baseline", action="store_true")
    add_set_option(parser)
    args = parser.parse_args()
    messages = args.messages or (50_000 if args.quick else 1_000_000)
    settings = dict(args.set)
    rows: list[Row] = []
    for protocol in args.protocols.split(","):
        modes = (True,) if args.no_baseline else (False, True)
        for slow in modes:
            row = measure(protocol, messages, args.size, slow, settings)
            print(f"{protocol} {row.mode}: done in {row.seconds:.1f} s", file=sys.stderr)
            rows.append(row)
    print(f"{messages:,} messages of {args.size} bytes; RSS in MiB")
    print(table(rows))


if __name__ == "__main__":
    main()
