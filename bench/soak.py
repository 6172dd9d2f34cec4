"""A soak: mixed traffic on all five protocols through one gateway, for a bounded time (issue 18).

One gateway under twistd with a listener of each protocol (two for MTL) and
routes between them; the embedded log keeps small segments (2 MiB) and 8 MiB
per stream, so that segments roll and retention deletes old ones during the
run. Five load threads each send ``--rate`` messages a second, paced, and
time each message from its sending to its acknowledgement:

======  ===========================================  ==============================
load    path                                         acknowledgement timed
======  ===========================================  ==============================
ssmp    MCAST ``soak.ssmp`` on the hub, a direct     the ``200`` (after the append)
        route into the local stream ``ssmp-log``
qmqp    sessions of 10 s of 1 KB mail blocks, a      the ``K`` (after the fsync); a
        durable route to the hub's topic ``mail``    subscriber there counts arrivals
dmp     sink ``in`` routed to feed ``out`` of the    the feed's reader reading it (DMP
        same listener                                has no acknowledgement)
mtl     confirm=full writer -> route -> confirm=     the writer's Confirm; the reader
        full reader of a second MTL listener         confirms each Content
stream  Publish to the stream ``soak``, one          the PublishConfirm; a consumer
        connection publishing, one consuming         from ``next`` counts deliveries
======  ===========================================  ==============================

Every ``--interval`` seconds (60) one line: elapsed minutes, the gateway's
RSS (``/proc/PID/status``) and open descriptors, the machine's load average
(the machine may be shared: latencies follow it), then per load the messages
sent and acknowledged so far and the p99 latency in milliseconds over that
interval, and the errors: the loads' own (refusals, disconnections; a load
reconnects after one) and the gateway's ``msggateway_protocol_errors_total``.
At the end: the first and the last line side by side (RSS and descriptor
growth) and per load what was delivered and what went wrong.

Bounded by ``--minutes`` (10); stops by itself, then waits at most 10 s for
what is outstanding. Exits non-zero if the gateway died or logged a
traceback. The gateway and its scratch directory are removed on exit,
SIGTERM or Ctrl-C. Run::

    .venv/bin/python -m bench.soak                         # 10 minutes, 200 msg/s per load
    .venv/bin/python -m bench.soak --minutes 2 --rate 500
    nice .venv/bin/python -m bench.soak --minutes 30 > /tmp/soak30.txt
"""

from __future__ import annotations

import argparse
import math
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Final

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bridges import MESSAGE_BYTES, percentiles, ssmp_subscriber  # noqa: E402
from bench.dmp_sink_to_feed import envelope, opened, take_envelopes  # noqa: E402
from bench.gateway_proc import (  # noqa: E402
    ADMIN_TABLE,
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
    rss_kib,
    scrape,
    stop_on_signals,
)
from bench.mtl_flow import EMPTY_TABLE, U64, short  # noqa: E402
from gateway.codecs import osiris, qmqp  # noqa: E402
from gateway.codecs import stream as sp  # noqa: E402
from gateway.codecs.errors import ProtocolError  # noqa: E402
from tests.integration.harness import GatewayProcess  # noqa: E402

DRAIN_SECONDS: Final = 10.0
"""After the run: the most each load waits for what it has not had acknowledged."""
RECONNECT_SECONDS: Final = 1.0
QMQP_SESSION_SECONDS: Final = 10.0
"""A QMQP session sends this long, then its done block (mail injectors work in batches)."""
QMQP_BODY_BYTES: Final = 1000
STREAM_CREDIT: Final = 10
FAILURES: Final = (OSError, EOFError, RuntimeError, ProtocolError, zmq.ZMQError)
"""What ends a load's connection: it counts an error and connects again."""

CONFIG: Final = gateway_config(
    {
        "gateway": GATEWAY_TABLE,
        "admin": ADMIN_TABLE,
        "log": ('fsync = "always"', "segment_bytes = 2097152", "max_bytes = 8388608"),
        "listeners.hub": SSMP_LISTENER,
        "listeners.mail": QMQP_LISTENER,
        "listeners.streams": STREAM_LISTENER,
        "listeners.dmp": (*DMP_LISTENER, "heartbeat_seconds = 5"),
        "listeners.mtl": MTL_LISTENER,
        "listeners.mtl2": MTL_LISTENER,
    }
)
ROUTES: Final = {
    "ssmp-keep": 'from = "hub"\nmatch = "soak.ssmp"\nto = "streams"\naddress = "ssmp-log"\n',
    "mail": 'from = "mail"\nmatch = "#@soak.example"\nto = "hub"\naddress = "mail"\n'
    'body = "subject"\ndurable = true\n',
    "dmp-loop": 'from = "dmp"\nmatch = "#"\nto = "dmp"\naddress = "out"\n',
    "mtl-across": 'from = "mtl"\nmatch = "in"\nto = "mtl2"\naddress = "out"\n',
}
STREAMS: Final = ("ssmp-log", "soak")


def stamp() -> bytes:
    """A 100-byte body: 8 bytes of perf_counter_ns, then padding."""
    return struct.pack(">Q", time.perf_counter_ns()) + b"x" * (MESSAGE_BYTES - 8)


def stamped_at(body: bytes | memoryview) -> float:
    """When a `stamp` body was made (perf_counter seconds)."""
    return float(struct.unpack_from(">Q", body)[0]) / 1e9


class Load(threading.Thread):
    """One protocol's traffic: a paced sender, its acknowledgements, its figures.

    Subclasses implement `session`: connect, send what `due` says, read what
    comes back, and return once `running` is False. A failure ends the
    session; the load counts it and connects again after a second.

    Args:
        name: The protocol, as printed.
        gateway: The gateway to talk to.
        rate: Messages a second.
        stop: Set when the run is over.
    """

    def __init__(
        self, name: str, gateway: GatewayProcess, rate: float, stop: threading.Event
    ) -> None:
        super().__init__(name=f"load-{name}", daemon=True)
        self.label = name
        self.gateway = gateway
        self.interval = 1.0 / rate
        self.stop = stop
        self.sent = 0
        self.acked = 0
        self.delivered: int | None = None
        self.errors = 0
        self.last_error = ""
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._next_at = time.perf_counter()
        self._drain_until: float | None = None

    def run(self) -> None:
        """Sessions until the run is over, each failure counted."""
        while not self.stop.is_set():
            try:
                self.session()
            except FAILURES as exc:
                self.error(f"{type(exc).__name__}: {exc}")
                self.stop.wait(RECONNECT_SECONDS)
                self._next_at = time.perf_counter()  # what fell due meanwhile is not sent

    def session(self) -> None:
        """One connection's life (see the class)."""
        raise NotImplementedError

    def due(self) -> int:
        """How many messages to send now (none once the run is over).

        Paced at the rate from the load's start; a sender more than a second
        behind skips ahead instead of sending a burst.
        """
        if self.stop.is_set():
            return 0
        now = time.perf_counter()
        if now < self._next_at:
            return 0
        if now - self._next_at > 1.0:
            self._next_at = now
        count = int((now - self._next_at) / self.interval) + 1
        self._next_at += count * self.interval
        return count

    def wait(self) -> float:
        """Seconds until the next message is due (a short poll once the run is over)."""
        if self.stop.is_set():
            return 0.05
        return max(0.0, self._next_at - time.perf_counter())

    def running(self, outstanding: int) -> bool:
        """Whether to go on: until the run is over, then while acknowledgements are due."""
        if not self.stop.is_set():
            return True
        if self._drain_until is None:
            self._drain_until = time.monotonic() + DRAIN_SECONDS
        return outstanding > 0 and time.monotonic() < self._drain_until

    def count_sent(self, count: int) -> None:
        """``count`` messages went out."""
        with self._lock:
            self.sent += count

    def ack(self, latency: float) -> None:
        """One message was acknowledged ``latency`` seconds after it was sent."""
        with self._lock:
            self.acked += 1
            self._samples.append(latency)

    def deliver(self, count: int = 1) -> None:
        """A reader got ``count`` messages."""
        with self._lock:
            self.delivered = (self.delivered or 0) + count

    def error(self, text: str) -> None:
        """Something went wrong (a refusal, a lost connection)."""
        with self._lock:
            self.errors += 1
            self.last_error = text[:200]

    def take(self) -> dict[str, Any]:
        """The figures so far, and the p99 of the latencies since the last call."""
        with self._lock:
            samples, self._samples = self._samples, []
            figures: dict[str, Any] = {
                "sent": self.sent,
                "acked": self.acked,
                "delivered": self.delivered,
                "errors": self.errors,
                "last_error": self.last_error,
            }
        figures["p99_ms"] = percentiles(samples)["p99_us"] / 1000 if samples else None
        return figures


def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Which of ``socks`` have something to read, waiting at most ``timeout``."""
    ready, _, _ = select.select(socks, [], [], timeout)
    return ready


def read_lines(sock: socket.socket, pending: bytearray) -> list[bytes]:
    """Read once; the complete lines (``pending`` keeps the rest).

    Raises:
        EOFError: The peer closed.
    """
    data = sock.recv(1 << 16)
    if not data:
        raise EOFError("the gateway closed the connection")
    pending += data
    *lines, rest = bytes(pending).split(b"\n")
    pending[:] = rest
    return lines


class SSMPLoad(Load):
    """MCAST on the hub into a route to a local stream; the ``200`` is timed."""

    def session(self) -> None:
        """Log in, then MCAST at the rate; answers come in request order."""
        with socket.create_connection(self.gateway.address("hub"), timeout=30) as sock:
            sock.sendall(b"LOGIN soakssmp open\n")
            pending = bytearray()
            while not (lines := read_lines(sock, pending)):
                pass
            if not lines[0].startswith(b"200"):
                raise RuntimeError(f"LOGIN answered {lines[0]!r}")
            sent_at: deque[float] = deque()
            padding = b"x" * (MESSAGE_BYTES - 16)
            while self.running(len(sent_at)):
                count = self.due()
                if count:
                    now = time.perf_counter()
                    first = self.sent
                    sock.sendall(
                        b"".join(
                            b"MCAST soak.ssmp %016x%s\n" % (first + n, padding)
                            for n in range(count)
                        )
                    )
                    sent_at.extend([now] * count)
                    self.count_sent(count)
                if not readable([sock], self.wait()):
                    continue
                lines = read_lines(sock, pending)
                now = time.perf_counter()
                for line in lines:
                    if line.startswith(b"000 "):  # an event, not an answer
                        if line == b"000 . PING":
                            sock.sendall(b"PONG\n")
                        continue
                    at = sent_at.popleft()
                    if line.startswith(b"200"):
                        self.ack(now - at)
                    else:
                        self.error(f"MCAST answered {line[:80]!r}")


class QMQPLoad(Load):
    """Mail blocks through a durable route to the hub; K timed, arrivals counted there."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.delivered = 0
        self._watcher: socket.socket | None = None
        self._watcher_pending = bytearray()
        self._number = 0

    def run(self) -> None:
        """Sessions until the run is over; the hub subscriber is closed at the end."""
        try:
            super().run()
        finally:
            if self._watcher is not None:
                self._watcher.close()

    def _watch(self) -> None:
        """Count what arrived at the hub's ``mail`` topic."""
        assert self._watcher is not None
        for line in read_lines(self._watcher, self._watcher_pending):
            if line == b"000 . PING":
                self._watcher.sendall(b"PONG\n")
            elif line.startswith(b"000 ") and b" MCAST mail soak " in line:
                self.deliver()

    def session(self) -> None:
        """One QMQP session: blocks for `QMQP_SESSION_SECONDS`, the done block, the replies."""
        if self._watcher is None:
            self._watcher = ssmp_subscriber(self.gateway.address("hub"), b"mail")
            self._watcher.settimeout(30)
        codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        sent_at: dict[bytes, float] = {}
        padding = b"x" * QMQP_BODY_BYTES + b"\n"
        ends_at = time.monotonic() + QMQP_SESSION_SECONDS
        done_sent = False
        with socket.create_connection(self.gateway.address("mail"), timeout=30) as sock:
            try:
                while self.running(len(sent_at)) or not done_sent:
                    if not done_sent and (time.monotonic() >= ends_at or self.stop.is_set()):
                        sock.sendall(qmqp.DONE_BYTES)
                        done_sent = True
                    count = 0 if done_sent else self.due()
                    if count:
                        blocks = []
                        for _ in range(count):
                            self._number += 1
                            ident = b"%d" % self._number
                            block = qmqp.MessageBlock(
                                id=ident,
                                message=b"From: soak@example.org\nSubject: soak %s\n\n%s"
                                % (ident, padding),
                                sender=b"soak@example.org",
                                recipients=(b"ops@soak.example",),
                            )
                            blocks.append(qmqp.encode(block))
                            sent_at[ident] = time.perf_counter()
                        sock.sendall(b"".join(blocks))
                        self.count_sent(count)
                    ready = readable([sock, self._watcher], self.wait())
                    if self._watcher in ready:
                        self._watch()
                    if sock not in ready:
                        continue
                    data = sock.recv(1 << 16)
                    if not data:
                        if sent_at:
                            raise EOFError(f"closed with {len(sent_at)} blocks unanswered")
                        return
                    now = time.perf_counter()
                    for reply in codec.receive_data(data):
                        if isinstance(reply, qmqp.DoneBlock):
                            if sent_at:
                                raise RuntimeError(f"done with {len(sent_at)} blocks unanswered")
                            return
                        if not isinstance(reply, qmqp.ReplyBlock):
                            continue
                        at = sent_at.pop(bytes(reply.id), None)
                        if reply.status == b"K" and at is not None:
                            self.ack(now - at)
                        else:
                            self.error(f"block {reply.id!r} answered {reply.status!r}")
            finally:
                if self.stop.is_set():  # the last arrivals at the hub
                    while self._watcher is not None and readable([self._watcher], 1.0):
                        self._watch()


class DMPLoad(Load):
    """Sink writer to feed reader on one DMP listener; the time to the reader is timed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.delivered = 0

    def session(self) -> None:
        """Open a reader and a writer; write stamped envelopes; read them from the feed."""
        address = self.gateway.address("dmp")
        reader = opened(address, b"r")
        writer = opened(address, b"w")
        outstanding = 0
        buffer = bytearray()
        heartbeat = time.monotonic()
        try:
            while self.running(outstanding):
                count = self.due()
                if count:
                    writer.sendall(b"".join(envelope(stamp()) for _ in range(count)))
                    outstanding += count
                    self.count_sent(count)
                if time.monotonic() - heartbeat > 1:
                    reader.sendall(b"\0\0\0\0")  # a null message: this reader is alive
                    heartbeat = time.monotonic()
                if not readable([reader], self.wait()):
                    continue
                data = reader.recv(1 << 16)
                if not data:
                    raise EOFError("the feed closed")
                now = time.perf_counter()
                buffer += data
                for found in take_envelopes(buffer):  # the body ends the envelope
                    self.ack(now - stamped_at(bytes(found[-MESSAGE_BYTES:])))
                    self.deliver()
                    outstanding -= 1
        finally:
            reader.close()
            writer.close()


class MTLLoad(Load):
    """confirm=full writer -> route -> confirm=full reader; the writer's Confirm is timed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.delivered = 0
        self._sequence = 0

    def session(self) -> None:
        """Lease a writer and a reader (summoned), send Contents, confirm and count."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            writer = MTLSession(
                context, self.gateway.address("mtl")[1], "gateway", "Writer", ("in",), "full"
            )
            reader = MTLSession(
                context, self.gateway.address("mtl2")[1], "gateway", "Reader", ("out",), "full"
            )
            reader.summon("out")
            assert writer.data is not None and reader.data is not None
            for sock in (writer.data, reader.data):
                sock.setsockopt(zmq.SNDTIMEO, 10_000)
            poller = zmq.Poller()
            poller.register(writer.data, zmq.POLLIN)
            poller.register(reader.data, zmq.POLLIN)
            unsettled: dict[int, float] = {}
            head = short("in") + EMPTY_TABLE
            while self.running(len(unsettled)):
                for _ in range(self.due()):
                    self._sequence += 1
                    unsettled[self._sequence] = time.perf_counter()
                    writer.data.send_multipart([b"\x05" + U64.pack(self._sequence) + head, stamp()])
                    self.count_sent(1)
                if not poller.poll(math.ceil(self.wait() * 1000)):
                    continue
                self._read_reader(reader.data)
                self._read_writer(writer.data, unsettled)
        finally:
            context.destroy(linger=0)

    def _read_reader(self, data: zmq.Socket[bytes]) -> None:
        """Confirm each Content; answer Pings."""
        while data.poll(0):
            header, _ = data.recv_multipart()
            if header[0] == 0x05:
                self.deliver()
                data.send_multipart([b"\x06" + header[1:9] + b"\x00", b""])
            elif header[0] == 0x08:
                data.send_multipart([b"\x09", b""])

    def _read_writer(self, data: zmq.Socket[bytes], unsettled: dict[int, float]) -> None:
        """Settle what Confirms and Rejects cover; answer Pings."""
        while data.poll(0):
            header, _ = data.recv_multipart()
            kind = header[0]
            if kind == 0x08:
                data.send_multipart([b"\x09", b""])
                continue
            if kind not in (0x06, 0x07):
                continue
            now = time.perf_counter()
            (sequence,) = U64.unpack_from(header, 1)
            multiple = len(header) > 9 and header[9]
            covered = [s for s in unsettled if s <= sequence] if multiple else [sequence]
            for key in covered:
                at = unsettled.pop(key, None)
                if at is None:
                    continue
                if kind == 0x06:
                    self.ack(now - at)
                else:
                    self.error(f"Content {key} rejected")


class StreamLoad(Load):
    """Publish to the stream ``soak`` with confirms; a consumer from ``next`` counts deliveries."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.delivered = 0
        self._publishing_id = 0

    def session(self) -> None:
        """A publishing and a consuming connection; one Publish frame per due batch."""
        address = self.gateway.address("streams")
        publisher = StreamClient(address).open()
        consumer = StreamClient(address).open()
        try:
            publisher.create("soak")
            publisher.declare_publisher(1, "soak")
            consumer.send(
                sp.Subscribe(
                    correlation_id=7,
                    subscription_id=1,
                    stream="soak",
                    offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.NEXT),
                    credit=STREAM_CREDIT,
                )
            )
            answer = consumer.expect(sp.Response)
            if answer.code != 1:
                raise RuntimeError(f"Subscribe answered {answer.code}")
            sent_at: dict[int, float] = {}
            while self.running(len(sent_at) + max(0, self.acked - (self.delivered or 0))):
                count = self.due()
                if count:
                    now = time.perf_counter()
                    ids = list(range(self._publishing_id + 1, self._publishing_id + count + 1))
                    self._publishing_id += count
                    sent_at.update(dict.fromkeys(ids, now))
                    publisher.send(
                        sp.Publish(
                            publisher_id=1,
                            publishing_ids=ids,
                            messages=[stamp() for _ in ids],
                        )
                    )
                    self.count_sent(count)
                ready = readable([publisher.sock, consumer.sock], self.wait())
                if publisher.sock in ready:
                    self._confirms(publisher.receive(), sent_at)
                if consumer.sock in ready:
                    self._deliveries(consumer)
        finally:
            publisher.close()
            consumer.close()

    def _confirms(self, events: list[Any], sent_at: dict[int, float]) -> None:
        now = time.perf_counter()
        for event in events:
            if isinstance(event, sp.PublishConfirm):
                for publishing_id in event.publishing_ids:
                    at = sent_at.pop(publishing_id, None)
                    if at is not None:
                        self.ack(now - at)
            elif isinstance(event, sp.PublishError):
                for publishing_id, code in zip(event.publishing_ids, event.codes, strict=True):
                    sent_at.pop(publishing_id, None)
                    self.error(f"publishing id {publishing_id}: PublishError {code}")

    def _deliveries(self, consumer: StreamClient) -> None:
        credits = 0
        for event in consumer.receive():
            if isinstance(event, sp.Deliver):
                header = osiris.ChunkHeader.unpack(event.chunk)
                if header.chunk_type == osiris.USER:
                    self.deliver(header.num_records)
                credits += 1
        if credits:
            consumer.send(sp.Credit(subscription_id=1, credit=credits))


LOADS: Final[dict[str, type[Load]]] = {
    "ssmp": SSMPLoad,
    "qmqp": QMQPLoad,
    "dmp": DMPLoad,
    "mtl": MTLLoad,
    "stream": StreamLoad,
}

# --- the run -----------------------------------------------------------------------------


def gateway_errors(gateway: GatewayProcess) -> int | None:
    """The gateway's ``msggateway_protocol_errors_total``, all kinds (None: unreadable)."""
    try:
        figures = scrape(gateway)
    except OSError:
        return None
    return int(
        sum(v for k, v in figures.items() if k.startswith("msggateway_protocol_errors_total"))
    )


def header() -> str:
    """The column heads of the progress lines."""
    cells = "".join(f"  {name + ' sent/acked p99ms':>29}" for name in LOADS)
    return f"{'min':>6}  {'RSS MB':>7}  {'fds':>5}  {'load':>5}{cells}  errors (gateway)"


def line(gateway: GatewayProcess, loads: list[Load], elapsed: float) -> dict[str, Any]:
    """One progress line's figures and text."""
    rss, fds = rss_kib(gateway.pid), open_fds(gateway.pid)
    gateway_count = gateway_errors(gateway)
    taken = {load.label: load.take() for load in loads}
    cells = ""
    for figures in taken.values():
        p99 = "-" if figures["p99_ms"] is None else f"{figures['p99_ms']:.2f}"
        cells += f"  {figures['sent']:>10}/{figures['acked']:<10} {p99:>7}"
    errors = sum(figures["errors"] for figures in taken.values())
    shown = "?" if gateway_count is None else str(gateway_count)
    load = os.getloadavg()[0]
    text = (
        f"{elapsed / 60:6.1f}  {rss / 1024:7.1f}  {fds:5}  {load:5.2f}{cells}  {errors} ({shown})"
    )
    return {"rss_kib": rss, "fds": fds, "loads": taken, "text": text}


def alive(gateway: GatewayProcess) -> bool:
    """Whether the gateway process is still running."""
    try:
        gateway.wait(0)
    except subprocess.TimeoutExpired:
        return True
    return False


class Sample:
    """RSS and descriptors of a process at one moment."""

    def __init__(self, pid: int) -> None:
        self.rss_kib = rss_kib(pid)
        self.fds = open_fds(pid)


def soak(args: argparse.Namespace, scratch: Path) -> int:
    """Run the soak in ``scratch``; print its lines; the exit status."""
    gateway = GatewayProcess(scratch / "gateway", CONFIG, routes=ROUTES).start()
    stop = threading.Event()
    loads: list[Load] = []
    lines: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    start: Sample | None = None
    died = False
    try:
        for stream in STREAMS:  # before the first message routed into one
            client = StreamClient(gateway.address("streams")).open()
            client.create(stream)
            client.close()
        start = Sample(gateway.pid)
        print(
            f"soak: {args.minutes:g} min, {args.rate:g} msg/s per load ({len(LOADS)} loads),"
            f" gateway pid {gateway.pid}: RSS {start.rss_kib / 1024:.1f} MB, {start.fds} fds"
            " before traffic",
            flush=True,
        )
        print(header(), flush=True)
        loads = [kind(name, gateway, args.rate, stop) for name, kind in LOADS.items()]
        began = time.monotonic()
        for load in loads:
            load.start()
        ends_at = began + args.minutes * 60
        next_line = began + args.interval
        while time.monotonic() < ends_at:
            if not alive(gateway):
                died = True
                break
            time.sleep(min(1.0, max(0.0, min(next_line, ends_at) - time.monotonic())))
            if time.monotonic() >= next_line:
                lines.append(line(gateway, loads, time.monotonic() - began))
                print(lines[-1]["text"], flush=True)
                next_line += args.interval
        stop.set()
        for load in loads:
            load.join(DRAIN_SECONDS + 5)
        if not died and alive(gateway):
            end = line(gateway, loads, time.monotonic() - began)
            print(end["text"] + "  (after the drain, the loads' connections closed)", flush=True)
        else:
            died = True
    finally:
        stop.set()
        status = gateway.stop()
    return report(gateway, loads, (start, lines, end), died, status)


def report(
    gateway: GatewayProcess,
    loads: list[Load],
    samples: tuple[Sample | None, list[dict[str, Any]], dict[str, Any] | None],
    died: bool,
    status: int | None,
) -> int:
    """Print the first and last lines compared and each load's totals; the exit status.

    Args:
        gateway: The stopped gateway (its log is searched for tracebacks).
        loads: The finished loads.
        samples: The gateway before traffic, the progress lines, and the line
            after the drain (None if the run did not get that far).
        died: Whether the gateway exited during the run.
        status: Its exit status.
    """
    start, lines, end = samples
    print()
    if len(lines) >= 2:
        first, last = lines[0], lines[-1]
        print(f"first: {first['text']}")
        print(f"last:  {last['text']}")
        grown = (last["rss_kib"] - first["rss_kib"]) / 1024
        print(
            f"from the first line to the last, under the same traffic: RSS {grown:+.1f} MB"
            f" ({100 * grown * 1024 / first['rss_kib']:+.1f}%), fds {last['fds'] - first['fds']:+d}"
        )
    if start is not None and end is not None:
        print(
            f"with no traffic: before it {start.rss_kib / 1024:.1f} MB and {start.fds} fds,"
            f" after it {end['rss_kib'] / 1024:.1f} MB and {end['fds']} fds"
        )
    for load in loads:
        outstanding = load.sent - load.acked
        delivered = "" if load.delivered is None else f", {load.delivered} delivered"
        text = (
            f"  {load.label:6} {load.sent} sent, {load.acked} acknowledged"
            f" ({outstanding} not){delivered}, {load.errors} errors"
        )
        if load.last_error:
            text += f"; last: {load.last_error}"
        print(text)
    problems = log_problems(gateway.output())
    for problem in problems:
        print(f"gateway log: {problem[:200]}")
    if died:
        print(f"the gateway died (exit status {status})")
    return 1 if died or problems else 0


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="how long traffic runs (default 10)"
    )
    parser.add_argument(
        "--rate", type=float, default=200.0, help="messages a second per load (default 200)"
    )
    parser.add_argument(
        "--interval", type=float, default=60.0, help="seconds between lines (default 60)"
    )
    args = parser.parse_args()
    if args.minutes <= 0 or args.rate <= 0 or args.interval <= 0:
        parser.error("--minutes, --rate and --interval must be positive")
    return args


def main() -> None:
    """Run the soak."""
    args = arguments()
    stop_on_signals()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as scratch:
        status = soak(args, Path(scratch))
    sys.exit(status)


if __name__ == "__main__":
    main()
