"""The clients of ``bench.burst``: producers that write as fast as they can, and consumers.

Each runs on its own daemon thread and counts as it goes, so that a row can
read its figures while it runs:

* consumers (a `Consumer`): `SocketReader` reads a socket (healthy: 4 MiB
  reads; slowed: 4 KiB and a millisecond's pause), its ``tally`` counting the
  messages of the protocol (`LineTally` SSMP MCAST lines, `EnvelopeTally`
  DMP envelopes, `DeliverTally` stream Delivers, granting their credit);
  `MTLReader` is a confirm=none MTL reader, or one that never reads;
* producers (a `Producer`: sent, acknowledged, refused, the longest wait):
  `QMQPSender`, `DMPWriter`, `MTLWriter` and `StreamPublisher`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

import zmq

from bench.dmp_sink_to_feed import opened, take_envelopes
from bench.gateway_proc import StreamClient
from bench.mtl_flow import EMPTY_TABLE, U64, lease, settle, short, summon
from gateway.codecs import qmqp
from gateway.codecs import stream as sp

__all__ = [
    "BATCH",
    "IDLE_SECONDS",
    "READ_BYTES",
    "Consumer",
    "DMPWriter",
    "DeliverTally",
    "EnvelopeTally",
    "LineTally",
    "MTLReader",
    "MTLWriter",
    "Producer",
    "QMQPSender",
    "SocketReader",
    "StreamPublisher",
    "started",
]

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


def started(target: Callable[[], None]) -> threading.Thread:
    """A daemon thread running ``target``, started."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


# --- consumers -----------------------------------------------------------------------------


class Consumer:
    """What every consumer counts: messages, when the last came, and what ended its reading."""

    def __init__(self) -> None:
        self.messages = 0
        self.last = time.monotonic()
        self.ended: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        if self._thread is not None:
            self._thread.join(5)


class SocketReader(Consumer):
    """Reads a socket on its own thread, counting messages with ``tally``.

    Args:
        sock: The consumer's connection, past its handshake.
        tally: Given each chunk read, returns how many messages it completed.
        slowed: `SLOWED_READ_BYTES` reads, each followed by a `SLOWED_PAUSE_SECONDS` pause.
    """

    def __init__(
        self, sock: socket.socket, tally: Callable[[bytes], int], slowed: bool = False
    ) -> None:
        super().__init__()
        self.sock = sock
        self.first: float | None = None
        self._tally = tally
        self._slowed = slowed
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
        """As `Consumer.drain`, then close the socket."""
        super().drain(expected, producing, deadline)
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


class MTLReader(Consumer):
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
        super().__init__()
        if reads:
            self._thread = started(self._run)

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
            # Without confirms, what ZeroMQ still queues here is sent while the socket
            # lingers (the gateway holds writers back by not reading them): linger=0
            # would drop it on our side, a loss no gateway could prevent.
            linger = 0 if self._confirm else max(0, int((self._deadline - time.monotonic()) * 1000))
            self._sock.close(linger=linger)


class StreamPublisher(Producer):
    """One stream publisher to ``stream``: Publish frames of 100 messages, confirms counted."""

    def __init__(
        self, address: tuple[str, int], stream: str, count: int, size: int, deadline: float
    ) -> None:
        super().__init__()
        self._client = StreamClient(address, timeout=10).open()
        self._client.create(stream)
        self._client.declare_publisher(1, stream)
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
