"""Back-pressure before loss: fast producers against one healthy, one slowed and one stuck consumer.

Each row runs on a fresh gateway (``twistd msggateway``, default limits, a
configuration written to a temporary directory, every listener on a port the
system picks) whose resident memory (``/proc/PID/status`` VmRSS) is sampled
all along.

Healthy consumers (one thread each, 4 MiB reads, reading as fast as they can):

* SSMP hub, MCAST 1->1 (the baseline of the run), 2->1, 4->4 and 4->1 with
  ``-window 1000``, all driven by the independent ``../shared/tools/ssmpload``
  (its publishers pipeline without limit unless ``-window``; its subscribers
  count deliveries, order and duplicates);
* QMQP -> SSMP: QMQP senders stream mail into a listener whose route publishes
  each Subject on a hub topic, one SSMP subscriber counts the MCAST lines; and
  the same while ssmpload publishers share the topic;
* DMP sink -> feed: writers into a sink routed to a feed, one reader; also
  with a slowed reader (4 KiB reads, a millisecond's pause after each: a
  fraction of what the writers send, so a backlog must build and drain);
* MTL test profile (writers to a reader of the same resource) and gateway
  profile (confirm=full writers, a route to a second MTL listener, a
  confirm=none reader);
* stream listener: publishers with confirms, one consumer from the first
  offset (it reads the log, so it should lose nothing).

Columns: ``sent``; ``acked``, what the producers were told was taken (SSMP
200, QMQP K, MTL Confirm, stream PublishConfirm; ``n/a`` where the protocol
has no answer: DMP writers, MTL test profile); ``delivered`` (for SSMP the
deliveries, one per subscriber); ``lost``, deliveries acknowledged and never
delivered (sent and never delivered where there is no answer); ``msg/s``,
what the producers got acknowledged a second (where nothing is answered:
sent, until the consumer had the last); ``wait s``, the longest a producer
went without an answer (or a write taken): how much it was slowed; ``RSS``
start and peak, MiB.

Stuck consumers (SSMP subscriber, DMP feed reader, MTL reader that never
read): how long until the gateway cut them (its
``msggateway_slow_consumer_disconnects_total``, the socket leaving
ESTABLISHED, or for MTL the dead-peer count), the gateway's RSS growth, and
what the producers were told (acknowledged, refused, their longest wait).

The targets (issue 22) are checked at the end: 0 lost for every healthy
consumer; the hub 4->4 delivering at least 1.5x the 1->1 rate of the same
run; producers slowed, never refused nor stopped, while a consumer drains;
RSS growth under 100 MB with a stuck consumer.

Bounded: every row has a message count and a time limit, every wait a
deadline. Run with ``python -m bench.burst [--quick] [--messages N]
[--ssmpload PATH] [--only ssmp,qmqp,dmp,mtl,stream,stuck]
[--set LISTENER.KEY=VALUE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bridges import settle  # noqa: E402
from bench.dmp_sink_to_feed import envelope, opened, take_envelopes  # noqa: E402
from bench.gateway_proc import StreamClient, log_problems, metric, stop_on_signals  # noqa: E402
from bench.mtl_flow import EMPTY_TABLE, U64, lease, short, summon  # noqa: E402
from bench.qmqp_stream import block  # noqa: E402
from bench.slow_consumers import RSSSampler, ssmp_login  # noqa: E402
from bench.ssmp_hub import build_ssmpload, load_figures  # noqa: E402
from gateway.codecs import qmqp  # noqa: E402
from gateway.codecs import stream as sp  # noqa: E402
from tests.integration.harness import GatewayProcess, GatewayStartError  # noqa: E402

CONFIG: Final = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[log]
fsync = "never"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
{hub}

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
{mail}

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
heartbeat_seconds = 0
{streams}

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["in"]
feeds = ["out"]
{dmp}

[listeners.dmp.leases]
writer = {{ sink = "in", text = "w" }}
reader = {{ feed = "out", text = "r" }}

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
{mtl}

[listeners.mtl2]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
profiles = ["gateway"]
{mtl2}
"""
LISTENERS: Final = ("hub", "mail", "streams", "dmp", "mtl", "mtl2")
TOPIC: Final = "burst"
"""The hub topic of every SSMP row (ssmpload's ``-topic``), and the stream's name."""
ROUTES: Final = {
    "mail-to-hub": f'from = "mail"\nmatch = "#"\nto = "hub"\naddress = "{TOPIC}"\n'
    'body = "subject"\n',
    "dmp-loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n',
    "mtl-across": 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n',
}
READ_BYTES: Final = 4 << 20
"""A healthy consumer's read size and receive buffer."""
SLOWED_READ_BYTES: Final = 4096
SLOWED_PAUSE_SECONDS: Final = 0.001
"""The slowed reader reads this much, then pauses this long: at most 4 MB/s (some 20,000
100-byte envelopes a second here), a fraction of what the writers send."""
IDLE_SECONDS: Final = 3.0
"""A consumer whose producers are done is drained when nothing came for this long."""
BATCH: Final = 1000
"""Messages per write for the Python producers (DMP, QMQP); stream Publish frames hold 100."""
MTL_WINDOW: Final = 5000
"""Unconfirmed Contents a confirm=full MTL writer keeps, at most."""
STUCK_GROWTH_LIMIT_MIB: Final = 100 * 1e6 / (1 << 20)
"""The issue's 100 MB, in MiB."""
HUB_RATIO_TARGET: Final = 1.5
TCP_ESTABLISHED: Final = 1
"""``tcpi_state`` of an established connection (linux/tcp_states.h)."""


# --- rows ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of a table: a scenario's figures."""

    path: str
    shape: str
    consumer: str = "healthy"
    sent: int | None = None
    acked: int | None = None
    refused: int = 0
    delivered: int | None = None
    lost: int | None = None
    rate: float | None = None
    delivery_rate: float | None = None
    rss_start: float = 0.0
    rss_peak: float = 0.0
    cut_after: float | None = None
    watched: float = 0.0
    stall: float | None = None
    told: str = "-"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    """What every row is run with."""

    messages: int
    stuck_messages: int
    size: int
    seconds: float
    stuck_seconds: float
    ssmpload: Path | None
    listener_settings: dict[str, str]


class Skipped(Exception):  # noqa: N818 (a state, reported in the table)
    """A row that could not run; the message says why."""


def config(settings: dict[str, str]) -> str:
    """The gateway's main file, with ``LISTENER.KEY`` = TOML value settings added."""
    extra: dict[str, list[str]] = {name: [] for name in LISTENERS}
    for dotted, value in settings.items():
        listener, _, key = dotted.partition(".")
        extra[listener].append(f"{key} = {value}")
    return CONFIG.format(**{name: "\n".join(lines) for name, lines in extra.items()})


@contextlib.contextmanager
def measured(row: Row, settings: Settings) -> Iterator[GatewayProcess]:
    """A fresh gateway whose RSS is sampled for ``row``; its log's problems become notes."""
    with tempfile.TemporaryDirectory() as directory:
        gateway = GatewayProcess(
            Path(directory), config(settings.listener_settings), routes=dict(ROUTES)
        )
        try:
            gateway.start()
        except GatewayStartError as exc:
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise Skipped(f"the gateway did not start: {lines[0]} {lines[-1]}") from exc
        try:
            with RSSSampler(gateway.pid) as sampler:
                yield gateway
        finally:
            row.rss_start = sampler.samples[0][1]
            row.rss_peak = sampler.peak()
            row.notes.extend(f"gateway log: {line}" for line in log_problems(gateway.output(), 3))
            gateway.stop()


def outcomes(gateway: GatewayProcess, route: str) -> dict[str, int]:
    """A route's outcome counts from ``/metrics``."""
    text = gateway.metrics()
    return {
        outcome: int(metric(text, "msggateway_route_outcomes_total", route=route, outcome=outcome))
        for outcome in ("accepted", "retry", "rejected")
    }


def disconnects(gateway: GatewayProcess, endpoint: str) -> int:
    """Slow consumers the listener cut, and for MTL the data peers it forgot as dead."""
    text = gateway.metrics()
    cut = metric(text, "msggateway_slow_consumer_disconnects_total", endpoint=endpoint)
    dead = metric(text, "msggateway_protocol_errors_total", endpoint=endpoint, kind="dead-peer")
    return int(cut + dead)


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of a connection (without reading it)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def join_all(threads: list[threading.Thread], deadline: float) -> bool:
    """Join threads until ``deadline``; whether all ended."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def started(target: Callable[[], None]) -> threading.Thread:
    """A daemon thread running ``target``, started."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


# --- consumers -----------------------------------------------------------------------------


class SocketReader:
    """Reads a socket on its own thread, counting messages with ``tally``.

    Args:
        sock: The consumer's connection, past its handshake.
        tally: Given each chunk read, returns how many messages it completed.
        slowed: `SLOWED_READ_BYTES` reads, each followed by a `SLOWED_PAUSE_SECONDS` pause.
    """

    def __init__(
        self, sock: socket.socket, tally: Callable[[bytes], int], slowed: bool = False
    ) -> None:
        self.sock = sock
        self.messages = 0
        self.first: float | None = None
        self.last = time.monotonic()
        self.ended: str | None = None
        self._tally = tally
        self._slowed = slowed
        self._stop = threading.Event()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READ_BYTES)
        sock.settimeout(0.2)
        self._thread = started(self._run)

    def _run(self) -> None:
        size = SLOWED_READ_BYTES if self._slowed else READ_BYTES
        while not self._stop.is_set():
            try:
                data = self.sock.recv(size)
            except TimeoutError:
                continue
            except OSError as exc:
                self.ended = f"reset ({exc.__class__.__name__})"
                break
            if not data:
                self.ended = "closed by the gateway"
                break
            counted = self._tally(data)
            if counted:
                self.messages += counted
                self.last = time.monotonic()
                if self.first is None:
                    self.first = self.last
            if self._slowed:
                time.sleep(SLOWED_PAUSE_SECONDS)

    def drain(
        self, expected: Callable[[], int], producing: Callable[[], bool], deadline: float
    ) -> None:
        """Wait until ``expected()`` arrived, or the producers are done and it went quiet."""
        while time.monotonic() < deadline and self.ended is None:
            if self.messages >= expected():
                break
            if not producing() and time.monotonic() - self.last > IDLE_SECONDS:
                break
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def notes(self) -> list[str]:
        """What ended the reading early; the slowed reader's rate."""
        notes = [f"consumer {self.ended}"] if self.ended else []
        if self._slowed and self.first is not None and self.last > self.first:
            notes.append(f"reader {self.messages / (self.last - self.first):,.0f} msg/s")
        return notes


class LineTally:
    """Counts the MCAST lines an SSMP subscriber gets, those from ssmpload's ``pubN`` apart."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = b""
        self.from_ssmpload = 0

    def __call__(self, data: bytes) -> int:
        """Count the MCAST lines ``data`` completes (answering a PING)."""
        data = self._pending + data
        end = data.rfind(b"\n") + 1
        whole, self._pending = data[:end], data[end:]
        if b"000 . PING" in whole:
            with contextlib.suppress(OSError):
                self._sock.sendall(b"PONG\n")
        self.from_ssmpload += whole.count(b"000 pub")
        return whole.count(b" MCAST ")


class EnvelopeTally:
    """Counts a DMP feed's envelopes (not its null heartbeats)."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def __call__(self, data: bytes) -> int:
        """Count the envelopes ``data`` completes."""
        self._pending.extend(data)
        return len(take_envelopes(self._pending))


class DeliverTally:
    """Counts the messages of a stream consumer's Delivers, granting a credit for each."""

    def __init__(self, client: StreamClient) -> None:
        self._client = client
        self._credit = client.codec.send(sp.Credit(subscription_id=1, credit=1))

    def __call__(self, data: bytes) -> int:
        """Count the messages in the Delivers ``data`` completes; grant their credits."""
        count = 0
        credits = 0
        for event in self._client.codec.receive_data(data):
            if isinstance(event, sp.Deliver):
                count += int.from_bytes(bytes(event.chunk[4:8]), "big")  # records
                credits += 1
        if credits:
            with contextlib.suppress(OSError):
                self._client.sock.sendall(self._credit * credits)
        return count


class MTLReader:
    """A confirm=none MTL reader that reads on its own thread, or never reads.

    Args:
        context: The ZeroMQ context.
        port: The listener's control port.
        profile: ``test`` or ``gateway``.
        resource: What it leases and summons.
        reads: False for a reader that never reads (ZeroMQ's default receive limit).
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int, profile: str,
                 resource: str, reads: bool = True) -> None:  # fmt: skip
        self.sock = lease(
            context, port, profile, "Reader", [resource], "none", receive_hwm=0 if reads else None
        )
        summon(self.sock, resource)
        self.messages = 0
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = started(self._run) if reads else None

    def _run(self) -> None:
        sock = self.sock
        while not self._stop.is_set():
            if not sock.poll(200):
                continue
            while True:
                try:
                    header, _ = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if header[0] == 0x05:
                    self.messages += 1
                    self.last = time.monotonic()
                elif header[0] == 0x08:
                    sock.send_multipart([b"\x09", b""])

    def drain(
        self, expected: Callable[[], int], producing: Callable[[], bool], deadline: float
    ) -> None:
        """Wait until ``expected()`` arrived, or the producers are done and it went quiet."""
        while time.monotonic() < deadline:
            if self.messages >= expected():
                break
            if not producing() and time.monotonic() - self.last > IDLE_SECONDS:
                break
            time.sleep(0.02)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


# --- producers -----------------------------------------------------------------------------


class Producer:
    """What every producer counts: sent, acknowledged, refused, when, and its longest wait."""

    def __init__(self) -> None:
        self.sent = 0
        self.acked = 0
        self.refused: Counter[str] = Counter()
        self.began = self.last = time.monotonic()
        self.stall = 0.0
        self.problem: str | None = None
        self._thread: threading.Thread | None = None

    def progress(self, now: float) -> None:
        """Something went through at ``now``: the wait since the last is a stall candidate."""
        self.stall = max(self.stall, now - self.last)
        self.last = now

    def start(self, run: Callable[[], None]) -> None:
        """Run ``run`` on a thread."""
        self.began = self.last = time.monotonic()
        self._thread = started(run)

    @property
    def alive(self) -> bool:
        """Whether its thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        """Its thread."""
        assert self._thread is not None
        return self._thread


def batches(count: int) -> list[int]:
    """``count`` as runs of `BATCH` and what is left."""
    full, rest = divmod(count, BATCH)
    return [BATCH] * full + ([rest] if rest else [])


class QMQPSender(Producer):
    """One QMQP connection streaming ``count`` of ``blocks`` (`BATCH` a write), replies counted."""

    def __init__(self, address: tuple[str, int], count: int, blocks: list[bytes], deadline: float):
        super().__init__()
        self._sock = socket.create_connection(address, timeout=10)
        self._count = count
        self._blocks = blocks
        self._deadline = deadline
        self.start(self._run)

    def _write(self) -> None:
        writer = self._sock.dup()
        writer.settimeout(max(0.1, self._deadline - time.monotonic()))
        chunk = b"".join(self._blocks)
        try:
            for n in batches(self._count):
                writer.sendall(chunk if n == BATCH else b"".join(self._blocks[:n]))
                self.sent += n
            writer.sendall(qmqp.DONE_BYTES)
        except OSError as exc:
            self.problem = f"sending: {exc.__class__.__name__}"
        finally:
            writer.close()

    def _run(self) -> None:
        sender = started(self._write)
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        self._sock.settimeout(0.2)
        answered = 0
        try:
            while time.monotonic() < self._deadline and answered < self._count:
                try:
                    data = self._sock.recv(READ_BYTES)
                except TimeoutError:
                    if not sender.is_alive() and answered >= self.sent:
                        break
                    continue
                if not data:
                    break
                for reply in codec.receive_data(data):
                    if isinstance(reply, qmqp.ReplyBlock):
                        answered += 1
                        if reply.status == qmqp.K:
                            self.acked += 1
                        else:
                            self.refused[reply.status.decode()] += 1
                self.progress(time.monotonic())
        except OSError as exc:
            self.problem = f"receiving: {exc.__class__.__name__}"
        finally:
            sender.join(1)
            self._sock.close()


class DMPWriter(Producer):
    """One DMP sink connection writing ``count`` copies of an envelope, `BATCH` a write."""

    def __init__(self, address: tuple[str, int], count: int, one: bytes, deadline: float):
        super().__init__()
        self._sock = opened(address, b"w")
        self._count = count
        self._one = one
        self._deadline = deadline
        self.start(self._run)

    def _run(self) -> None:
        self._sock.settimeout(max(0.1, self._deadline - time.monotonic()))
        chunk = self._one * BATCH
        try:
            for n in batches(self._count):
                self._sock.sendall(chunk if n == BATCH else self._one * n)
                self.sent += n
                self.progress(time.monotonic())
        except OSError as exc:
            self.problem = f"writing: {exc.__class__.__name__}"
        finally:
            self._sock.close()


class MTLWriter(Producer):
    """One MTL writer sending ``count`` Contents; with confirm=full at most `MTL_WINDOW` open."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int, profile: str,
                 resources: list[str], confirm: bool, count: int, size: int,
                 deadline: float) -> None:  # fmt: skip
        super().__init__()
        self._sock = lease(
            context, port, profile, "Writer", resources, "full" if confirm else "none"
        )
        self._confirm = confirm
        self._count = count
        self._body = b"x" * size
        self._deadline = deadline
        self.start(self._run)

    def _send_some(self, unsettled: dict[int, None]) -> None:
        head = short("") + EMPTY_TABLE
        while self.sent < self._count and (not self._confirm or len(unsettled) < MTL_WINDOW):
            sequence = self.sent + 1
            try:
                self._sock.send_multipart(
                    [b"\x05" + U64.pack(sequence) + head, self._body], zmq.NOBLOCK
                )
            except zmq.Again:
                return
            self.sent = sequence
            if self._confirm:
                unsettled[sequence] = None
            else:
                self.progress(time.monotonic())

    def _receive_all(self, unsettled: dict[int, None]) -> None:
        while True:
            try:
                header, _ = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if header[0] in (0x06, 0x07):
                covered = settle(unsettled, header)
                if header[0] == 0x06:
                    self.acked += covered
                else:
                    recycle = len(header) > 10 and header[10]
                    self.refused["Reject recycle" if recycle else "Reject"] += covered
                self.progress(time.monotonic())
            elif header[0] == 0x08:
                self._sock.send_multipart([b"\x09", b""])

    def _run(self) -> None:
        unsettled: dict[int, None] = {}
        try:
            while time.monotonic() < self._deadline:
                self._send_some(unsettled)
                self._receive_all(unsettled)
                if self.sent >= self._count and not unsettled:
                    break
                flags = zmq.POLLIN
                if self.sent < self._count:
                    flags |= zmq.POLLOUT
                self._sock.poll(100, flags)
            if unsettled:
                self.problem = f"{len(unsettled):,} unanswered"
        finally:
            self._sock.close(linger=0)


class StreamPublisher(Producer):
    """One stream publisher: Publish frames of 100 messages, confirms counted."""

    def __init__(self, address: tuple[str, int], count: int, size: int, deadline: float):
        super().__init__()
        self._client = StreamClient(address, timeout=10).open()
        self._client.create(TOPIC)
        self._client.declare_publisher(1, TOPIC)
        self._count = count
        self._body = b"x" * size
        self._deadline = deadline
        self.start(self._run)

    def _write(self) -> None:
        writer = self._client.sock.dup()
        writer.settimeout(max(0.1, self._deadline - time.monotonic()))
        try:
            for first in range(0, self._count, 100):
                n = min(100, self._count - first)
                ids = list(range(first + 1, first + n + 1))
                frame = sp.Publish(publisher_id=1, publishing_ids=ids, messages=[self._body] * n)
                writer.sendall(self._client.codec.send(frame))
                self.sent += n
        except OSError as exc:
            self.problem = f"publishing: {exc.__class__.__name__}"
        finally:
            writer.close()

    def _run(self) -> None:
        sender = started(self._write)
        self._client.sock.settimeout(0.2)
        try:
            while time.monotonic() < self._deadline and self.acked + self.refused.total() < (
                self._count
            ):
                try:
                    events = self._client.receive()
                except TimeoutError:
                    if not sender.is_alive() and self.problem:
                        break
                    continue
                for event in events:
                    if isinstance(event, sp.PublishConfirm):
                        self.acked += len(event.publishing_ids)
                    elif isinstance(event, sp.PublishError):
                        self.refused["PublishError"] += len(event.publishing_ids)
                self.progress(time.monotonic())
        except (OSError, EOFError) as exc:
            self.problem = f"confirms: {exc.__class__.__name__}"
        finally:
            sender.join(1)
            self._client.close()


def fill_producers(
    row: Row, producers: list[Producer], seconds: float, arrived: float | None = None
) -> None:
    """Sent, acknowledged, refused, rate, longest wait and problems of ``producers``.

    The rate is of what was acknowledged, or, given ``arrived`` (where the
    protocol answers nothing: when the consumer got its last message), of
    what was sent until then or until the last write, whichever is later.
    """
    row.sent = sum(p.sent for p in producers)
    refused = sum((p.refused for p in producers), Counter[str]())
    row.refused = refused.total()
    if refused:
        row.notes.append("refused: " + ", ".join(f"{k} x{v:,}" for k, v in refused.items()))
    row.stall = max((p.stall for p in producers), default=0.0)
    began = min((p.began for p in producers), default=0.0)
    end = max((p.last for p in producers), default=0.0)
    if arrived is None:
        done = sum(p.acked for p in producers)
    else:
        done, end = row.sent, max(end, arrived)
    row.rate = done / (end - began) if end > began else None
    for number, producer in enumerate(producers):
        if producer.problem:
            row.notes.append(f"producer {number}: {producer.problem}")
        if producer.alive:
            row.notes.append(f"producer {number} still running after {seconds:.0f} s")


def split(total: int, parts: int) -> list[int]:
    """Each of ``parts`` producers' share of ``total``."""
    return [total // parts + (number < total % parts) for number in range(parts)]


# --- SSMP through ssmpload -----------------------------------------------------------------


def ssmpload(settings: Settings, gateway: GatewayProcess, args: list[str]) -> dict[str, float]:
    """Run ssmpload (MCAST on `TOPIC`) against the gateway's hub; its RESULT figures."""
    if settings.ssmpload is None:
        raise Skipped("no ssmpload (install Go, or pass --ssmpload)")
    port = gateway.address("hub")[1]
    base = ["-mode", "mcast", "-topic", TOPIC, "-drain", f"{IDLE_SECONDS:.0f}s"]
    try:
        figures, _ = load_figures(
            settings.ssmpload, port, gateway.pid, [*base, *args], timeout=settings.seconds + 60
        )
    except subprocess.CalledProcessError as exc:
        raise Skipped(f"ssmpload exited with {exc.returncode}: {exc.stderr.strip()[:200]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Skipped("ssmpload did not finish in time") from exc
    return figures


def ssmpload_args(pubs: int, subs: int, messages: int, seconds: float) -> list[str]:
    """Publishers, subscribers, the message count and the time bound."""
    return [
        "-pubs", str(pubs), "-subs", str(subs), "-max", str(messages),
        "-duration", f"{seconds:.0f}s",
    ]  # fmt: skip


def hub_row(settings: Settings, pubs: int, subs: int, window: int = 0) -> Row:
    """Publishers to subscribers on one topic, both ssmpload's."""
    shape = f"{pubs}->{subs}" + (f" -window {window}" if window else "")
    row = Row("SSMP hub", shape)
    with measured(row, settings) as gateway:
        args = ssmpload_args(pubs, subs, settings.messages, settings.seconds)
        figures = ssmpload(settings, gateway, [*args, "-window", str(window)])
        cut = disconnects(gateway, "hub")
    acked, delivered = int(figures["acked"]), int(figures["delivered"])
    row.sent, row.acked, row.delivered = int(figures["sent"]), acked, delivered
    row.lost = max(0, acked * subs - delivered)
    row.rate, row.delivery_rate = figures["ack_rate"], figures["deliv_rate"]
    row.refused = int(figures["errs"])
    row.notes.append(
        f"{delivered:,} of {acked * subs:,} deliveries, {figures['deliv_rate']:,.0f}/s"
    )
    if row.refused:
        row.notes.append(f"{row.refused:,} answered other than 200")
    unanswered = row.sent - acked - row.refused
    if unanswered:
        row.notes.append(f"{unanswered:,} unanswered")
    if figures["ooo"] or figures["dups"]:
        row.notes.append(f"out of order {figures['ooo']:.0f}, duplicates {figures['dups']:.0f}")
    if cut:
        row.notes.append(f"{cut} subscriber(s) cut as slow")
    return row


# --- QMQP -> SSMP --------------------------------------------------------------------------


def qmqp_row(settings: Settings, senders: int, ssmp_pubs: int = 0) -> Row:
    """QMQP senders through the route to the hub, one Python subscriber counting.

    With ``ssmp_pubs``, ssmpload publishers share the topic meanwhile (no
    subscribers of their own); their 200s count as acknowledged too.
    """
    shape = f"{senders}->1" + (f" +{ssmp_pubs} SSMP pubs" if ssmp_pubs else "")
    row = Row("QMQP -> SSMP", shape)
    blocks = [block(i, settings.size) for i in range(BATCH)]
    with measured(row, settings) as gateway:
        subscriber = ssmp_login(gateway, "reader", (TOPIC,))
        tally = LineTally(subscriber)
        reader = SocketReader(subscriber, tally)
        deadline = time.monotonic() + settings.seconds
        side: dict[str, float] = {}
        side_thread = None
        if ssmp_pubs:
            args = ssmpload_args(ssmp_pubs, 0, settings.messages, settings.seconds)

            def run_side() -> None:
                with contextlib.suppress(Skipped):
                    side.update(ssmpload(settings, gateway, args))

            side_thread = started(run_side)
        producers: list[Producer] = [
            QMQPSender(gateway.address("mail"), count, blocks, deadline)
            for count in split(settings.messages, senders)
        ]
        threads = [p.thread for p in producers] + ([side_thread] if side_thread else [])
        join_all(threads, deadline + 5)
        side_acked = int(side.get("acked", 0))

        def expected() -> int:
            return sum(p.acked for p in producers) + side_acked

        reader.drain(expected, lambda: any(t.is_alive() for t in threads), deadline + 10)
    fill_producers(row, producers, settings.seconds)
    acked = sum(p.acked for p in producers)
    row.acked = acked + side_acked
    row.delivered = reader.messages
    row.lost = max(0, row.acked - reader.messages)
    from_qmqp = reader.messages - tally.from_ssmpload
    row.notes.append(f"K x{acked:,}, delivered from QMQP {from_qmqp:,}")
    if ssmp_pubs:
        if not side:
            row.notes.append("ssmpload failed")
        else:
            row.sent = (row.sent or 0) + int(side["sent"])
            row.notes.append(
                f"SSMP 200 x{side_acked:,} of {side['sent']:,.0f} sent, "
                f"delivered {tally.from_ssmpload:,}"
            )
    row.notes.extend(reader.notes())
    return row


# --- DMP sink -> feed ----------------------------------------------------------------------


def dmp_row(settings: Settings, writers: int, slowed: bool = False) -> Row:
    """DMP writers into the sink, routed to the feed, one reader."""
    row = Row("DMP sink -> feed", f"{writers}->1", "slowed, 4 KiB a ms" if slowed else "healthy")
    one = envelope(b"x" * settings.size)
    with measured(row, settings) as gateway:
        address = gateway.address("dmp")
        reader = SocketReader(opened(address, b"r"), EnvelopeTally(), slowed=slowed)
        deadline = time.monotonic() + settings.seconds
        counts = split(settings.messages, writers)
        producers: list[Producer] = [DMPWriter(address, n, one, deadline) for n in counts]
        total = sum(counts)
        join_all([p.thread for p in producers], deadline)
        reader.drain(lambda: total, lambda: any(p.alive for p in producers), deadline + 10)
        counted = outcomes(gateway, "dmp-loop")
        cut = disconnects(gateway, "dmp")
    fill_producers(row, producers, settings.seconds, arrived=reader.last)
    row.delivered = reader.messages
    row.lost = (row.sent or 0) - reader.messages
    row.notes.append(
        "no answer in DMP; route outcomes: "
        + ", ".join(f"{k} {v:,}" for k, v in counted.items() if v)
    )
    if cut:
        row.notes.append(f"reader cut as slow x{cut}")
    row.notes.extend(reader.notes())
    return row


# --- MTL -----------------------------------------------------------------------------------


def mtl_row(settings: Settings, writers: int, profile: str) -> Row:
    """MTL writers to one reader: the test profile, or confirm=full writers through a route."""
    row = Row(f"MTL {profile} profile", f"{writers}->1")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with measured(row, settings) as gateway:
            port = gateway.address("mtl")[1]
            gateway_profile = profile == "gateway"
            if gateway_profile:
                reader = MTLReader(context, gateway.address("mtl2")[1], profile, "out")
            else:
                reader = MTLReader(context, port, profile, "resource")
            deadline = time.monotonic() + settings.seconds
            resources = ["in"] if gateway_profile else []
            producers: list[Producer] = [
                MTLWriter(
                    context, port, profile, resources, gateway_profile, n, settings.size, deadline
                )
                for n in split(settings.messages, writers)
            ]
            join_all([p.thread for p in producers], deadline + 1)

            def expected() -> int:
                return sum((p.acked if gateway_profile else p.sent) for p in producers)

            reader.drain(expected, lambda: any(p.alive for p in producers), deadline + 10)
            reader.sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    arrived = None if gateway_profile else reader.last
    fill_producers(row, producers, settings.seconds, arrived=arrived)
    row.delivered = reader.messages
    if gateway_profile:
        row.acked = sum(p.acked for p in producers)
        row.lost = max(0, row.acked - reader.messages)
    else:
        row.lost = (row.sent or 0) - reader.messages
        row.notes.append("no answer in the test profile")
    return row


# --- stream --------------------------------------------------------------------------------


def stream_row(settings: Settings, publishers: int) -> Row:
    """Stream publishers with confirms, one consumer from the first offset."""
    row = Row("stream listener", f"{publishers}->1", "healthy, from first")
    with measured(row, settings) as gateway:
        address = gateway.address("streams")
        setup = StreamClient(address, timeout=10).open()
        setup.create(TOPIC)
        consumer = StreamClient(address, timeout=10).open()
        consumer.send(
            sp.Subscribe(
                correlation_id=7,
                subscription_id=1,
                stream=TOPIC,
                offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
                credit=10,
            )
        )
        answer = consumer.read()
        if not isinstance(answer, sp.Response) or answer.code != 1:
            raise Skipped(f"Subscribe answered {answer!r}")
        reader = SocketReader(consumer.sock, DeliverTally(consumer))
        deadline = time.monotonic() + settings.seconds
        producers: list[Producer] = [
            StreamPublisher(address, n, settings.size, deadline)
            for n in split(settings.messages, publishers)
        ]
        join_all([p.thread for p in producers], deadline + 1)
        reader.drain(
            lambda: sum(p.acked for p in producers),
            lambda: any(p.alive for p in producers),
            deadline + 10,
        )
        setup.close()
    fill_producers(row, producers, settings.seconds)
    row.acked = sum(p.acked for p in producers)
    row.delivered = reader.messages
    row.lost = max(0, row.acked - reader.messages)
    row.notes.extend(reader.notes())
    return row


# --- stuck consumers -----------------------------------------------------------------------


def watch_cut(
    row: Row,
    gateway: GatewayProcess,
    endpoint: str,
    sock: socket.socket | None,
    producing: Callable[[], bool],
    deadline: float,
) -> None:
    """Put the seconds until the gateway cut the stuck consumer in ``row.cut_after``.

    It stays None when that did not happen before ``deadline``; ``row.watched``
    says how long it was watched. Cut means: counted in the listener's
    slow-consumer disconnects (or MTL dead peers), or the connection no longer
    ESTABLISHED. Watches until the producers are done and the consumer was
    cut, or the deadline.
    """
    began = time.monotonic()
    base = disconnects(gateway, endpoint)
    cut_at = None
    scrape_at = 0.0
    while time.monotonic() < deadline:
        now = time.monotonic()
        if cut_at is None and sock is not None and tcp_state(sock) != TCP_ESTABLISHED:
            cut_at = now
        if cut_at is None and now >= scrape_at:
            scrape_at = now + 0.25
            with contextlib.suppress(OSError):
                if disconnects(gateway, endpoint) > base:
                    cut_at = time.monotonic()
        if cut_at is not None and not producing():
            break
        time.sleep(0.05)
    row.watched = time.monotonic() - began
    row.cut_after = None if cut_at is None else cut_at - began


def stuck_ssmp(settings: Settings, pubs: int) -> Row:
    """The ssmpload publishers on a topic whose only subscriber never reads."""
    row = Row("SSMP hub", f"{pubs}->1", "stuck")
    if settings.ssmpload is None:
        raise Skipped("no ssmpload (install Go, or pass --ssmpload)")
    with measured(row, settings) as gateway:
        stuck = ssmp_login(gateway, "stuck", (TOPIC,))
        result: dict[str, float] = {}
        failure: list[str] = []
        args = ssmpload_args(pubs, 0, settings.stuck_messages, settings.stuck_seconds)

        def run() -> None:
            try:
                result.update(ssmpload(settings, gateway, args))
            except Skipped as exc:
                failure.append(str(exc))

        load = started(run)
        deadline = time.monotonic() + settings.stuck_seconds + 10
        watch_cut(row, gateway, "hub", stuck, load.is_alive, deadline)
        load.join(max(0.0, deadline + 60 - time.monotonic()))
        stuck.close()
    if failure:
        raise Skipped(failure[0])
    row.sent, row.acked, row.refused = (
        int(result["sent"]), int(result["acked"]), int(result["errs"])
    )  # fmt: skip
    row.rate = result["ack_rate"]
    row.told = f"200 x{row.acked:,}" + (f", errors x{row.refused:,}" if row.refused else "")
    unanswered = row.sent - row.acked - row.refused
    if unanswered:
        row.told += f", no answer x{unanswered:,}"
    row.notes.append(f"acks over {result['ack_s']:.1f} s, sending over {result['send_s']:.1f} s")
    return row


def stuck_dmp(settings: Settings, writers: int) -> Row:
    """DMP writers into the sink whose feed's reader never reads."""
    row = Row("DMP sink -> feed", f"{writers}->1", "stuck")
    one = envelope(b"x" * settings.size)
    with measured(row, settings) as gateway:
        address = gateway.address("dmp")
        stuck = opened(address, b"r")
        deadline = time.monotonic() + settings.stuck_seconds
        producers: list[Producer] = [
            DMPWriter(address, n, one, deadline) for n in split(settings.stuck_messages, writers)
        ]
        watch_cut(row, gateway, "dmp", stuck, lambda: any(p.alive for p in producers), deadline)
        join_all([p.thread for p in producers], deadline + 1)
        counted = outcomes(gateway, "dmp-loop")
        stuck.close()
    fill_producers(row, producers, settings.stuck_seconds, arrived=0.0)
    row.told = "nothing (DMP); route: " + ", ".join(f"{k} {v:,}" for k, v in counted.items() if v)
    return row


def stuck_mtl(settings: Settings, writers: int) -> Row:
    """confirm=full MTL writers routed to a reader that never reads."""
    row = Row("MTL gateway profile", f"{writers}->1", "stuck")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with measured(row, settings) as gateway:
            stuck = MTLReader(context, gateway.address("mtl2")[1], "gateway", "out", reads=False)
            deadline = time.monotonic() + settings.stuck_seconds
            port = gateway.address("mtl")[1]
            producers: list[Producer] = [
                MTLWriter(context, port, "gateway", ["in"], True, n, settings.size, deadline)
                for n in split(settings.stuck_messages, writers)
            ]
            watch_cut(row, gateway, "mtl2", None, lambda: any(p.alive for p in producers), deadline)
            join_all([p.thread for p in producers], deadline + 1)
            stuck.sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    fill_producers(row, producers, settings.stuck_seconds)
    row.acked = sum(p.acked for p in producers)
    refused = ", ".join(n for n in row.notes if n.startswith("refused: "))
    row.told = f"Confirm x{row.acked:,}" + (f"; {refused}" if refused else "")
    return row


# --- the run -------------------------------------------------------------------------------


def scenarios(settings: Settings, only: set[str]) -> list[tuple[str, str, Callable[[], Row]]]:
    """Every row to run: (group, label, how)."""
    s = settings
    rows: list[tuple[str, str, Callable[[], Row]]] = [
        ("ssmp", "SSMP 1->1", lambda: hub_row(s, 1, 1)),
        ("ssmp", "SSMP 2->1", lambda: hub_row(s, 2, 1)),
        ("ssmp", "SSMP 4->4", lambda: hub_row(s, 4, 4)),
        ("ssmp", "SSMP 4->1 -window 1000", lambda: hub_row(s, 4, 1, 1000)),
        ("qmqp", "QMQP 2->1", lambda: qmqp_row(s, 2)),
        ("qmqp", "QMQP 2 + SSMP 2 -> 1", lambda: qmqp_row(s, 2, 2)),
        ("dmp", "DMP 2->1", lambda: dmp_row(s, 2)),
        ("dmp", "DMP 4->1", lambda: dmp_row(s, 4)),
        ("dmp", "DMP 2->1 slowed", lambda: dmp_row(s, 2, slowed=True)),
        ("mtl", "MTL test 2->1", lambda: mtl_row(s, 2, "test")),
        ("mtl", "MTL gateway 2->1", lambda: mtl_row(s, 2, "gateway")),
        ("stream", "stream 2->1", lambda: stream_row(s, 2)),
        ("stuck", "SSMP stuck", lambda: stuck_ssmp(s, 2)),
        ("stuck", "DMP stuck", lambda: stuck_dmp(s, 2)),
        ("stuck", "MTL stuck", lambda: stuck_mtl(s, 2)),
    ]
    return [row for row in rows if row[0] in only]


def number(value: float | None, digits: int = 0) -> str:
    """A figure with thousands separators, or ``-``."""
    return "-" if value is None else f"{value:,.{digits}f}"


def healthy_table(rows: list[Row]) -> str:
    """The healthy and slowed consumers' table."""
    head = (
        f"{'path':20} {'prod->cons':19} {'consumer':19} {'sent':>10} {'acked':>10}"
        f" {'delivered':>10} {'lost':>9} {'msg/s':>8} {'wait s':>6} {'RSS start':>9} {'peak':>6}"
        "  notes"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        acked = "n/a" if row.acked is None and row.sent is not None else number(row.acked)
        lines.append(
            f"{row.path:20} {row.shape:19} {row.consumer:19} {number(row.sent):>10}"
            f" {acked:>10} {number(row.delivered):>10} {number(row.lost):>9}"
            f" {number(row.rate):>8} {number(row.stall, 1):>6}"
            f" {row.rss_start:>9.1f} {row.rss_peak:>6.1f}"
            f"  {'; '.join(row.notes)}"
        )
    return "\n".join(lines)


def stuck_table(rows: list[Row]) -> str:
    """The stuck consumers' table."""
    head = (
        f"{'path':20} {'prod->cons':10} {'sent':>10} {'acked':>10} {'cut after s':>11}"
        f" {'msg/s':>8} {'longest wait s':>14} {'RSS start':>9} {'peak':>6} {'growth':>6}"
        "  producers were told; notes"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cut = number(row.cut_after, 1)
        if row.cut_after is None and row.watched:
            cut = f"not in {row.watched:.0f}"
        notes = [n for n in row.notes if not n.startswith("refused: ")]
        lines.append(
            f"{row.path:20} {row.shape:10} {number(row.sent):>10} {number(row.acked):>10}"
            f" {cut:>11} {number(row.rate):>8} {number(row.stall, 1):>14}"
            f" {row.rss_start:>9.1f} {row.rss_peak:>6.1f} {row.rss_peak - row.rss_start:>6.1f}"
            f"  {'; '.join([row.told, *notes])}"
        )
    return "\n".join(lines)


def verdicts(healthy: list[Row], stuck: list[Row]) -> list[str]:
    """The issue's targets, each with its figures and whether it is met."""
    lines = []
    ran = [row for row in healthy if row.lost is not None]
    if ran:
        lossy = [f"{r.path} {r.shape} {r.consumer} ({r.lost:,})" for r in ran if r.lost]
        lines.append("0 lost for every healthy consumer: " + met(lossy))
    rates = {row.shape: row.delivery_rate for row in healthy if row.path == "SSMP hub"}
    one, four = rates.get("1->1"), rates.get("4->4")
    if one and four:
        ratio = four / one
        verdict = "yes" if ratio >= HUB_RATIO_TARGET else "NO"
        lines.append(
            f"hub 4->4 delivers {four:,.0f}/s = {ratio:.2f}x the 1->1 {one:,.0f}/s of this run"
            f" (target >= {HUB_RATIO_TARGET}x): {verdict}"
        )
    if ran:
        failed = [
            f"{r.path} {r.shape} {r.consumer} ({r.refused:,} refused{', stopped' * stopped(r)})"
            for r in ran
            if r.refused or stopped(r)
        ]
        lines.append(
            "producers slowed, never refused or stopped, while a consumer drains: " + met(failed)
        )
    grown = [
        f"{r.path} ({r.rss_peak - r.rss_start:.0f} MiB)"
        for r in stuck
        if r.rss_peak - r.rss_start >= STUCK_GROWTH_LIMIT_MIB
    ]
    if stuck:
        lines.append("RSS growth < 100 MB with a stuck consumer: " + met(grown))
    return lines


def stopped(row: Row) -> bool:
    """Whether a producer of ``row`` failed or ran out of time."""
    return any(note.startswith("producer ") for note in row.notes)


def met(failures: list[str]) -> str:
    """``yes``, or ``NO:`` and what failed."""
    return "NO: " + "; ".join(failures) if failures else "yes"


def main() -> None:
    """Run the rows and print both tables with the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, help="per row, all producers (default 200,000)")
    parser.add_argument("--stuck-messages", type=int, help="per stuck row (default 1,000,000)")
    parser.add_argument("--size", type=int, default=100, help="body bytes (>= 32 for ssmpload)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time bound of a row")
    parser.add_argument("--stuck-seconds", type=float, default=35.0, help="of a stuck row")
    parser.add_argument("--quick", action="store_true", help="50,000 messages, stuck 200,000/20 s")
    parser.add_argument("--ssmpload", type=Path, help="ssmpload binary (default: build it)")
    parser.add_argument("--only", default="ssmp,qmqp,dmp,mtl,stream,stuck", help="row groups")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="LISTENER.KEY=VALUE",
        help="a listener setting (TOML value), e.g. hub.max_backlog_bytes=65536",
    )
    args = parser.parse_args()
    stop_on_signals()
    tool = args.ssmpload
    if tool is None:
        try:
            tool = build_ssmpload()
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"no ssmpload, SSMP rows skipped: {exc}", file=sys.stderr)
    settings = Settings(
        messages=args.messages or (50_000 if args.quick else 200_000),
        stuck_messages=args.stuck_messages or (200_000 if args.quick else 1_000_000),
        size=args.size,
        seconds=args.seconds,
        stuck_seconds=20.0 if args.quick and args.stuck_seconds == 35.0 else args.stuck_seconds,
        ssmpload=tool,
        listener_settings=dict(item.split("=", 1) for item in args.set),
    )
    healthy: list[Row] = []
    stuck: list[Row] = []
    for group, label, run in scenarios(settings, set(args.only.split(","))):
        began = time.monotonic()
        try:
            row = run()
        except Skipped as exc:
            row = Row(label, "", "stuck" if group == "stuck" else "skipped", notes=[str(exc)])
        (stuck if group == "stuck" else healthy).append(row)
        print(f"{label}: {time.monotonic() - began:.1f} s", file=sys.stderr)
    print(
        f"{settings.messages:,} messages of {settings.size} bytes a row"
        f" ({settings.stuck_messages:,} or {settings.stuck_seconds:.0f} s with a stuck consumer);"
        " RSS in MiB"
    )
    if healthy:
        print(healthy_table(healthy))
    if stuck:
        print()
        print("Stuck consumers (never read):")
        print(stuck_table(stuck))
    print()
    for line in verdicts(healthy, stuck):
        print(line)


if __name__ == "__main__":
    main()
