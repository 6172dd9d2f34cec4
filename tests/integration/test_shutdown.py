"""A clean stop: real twistd, SIGTERM and SIGINT.

Messages are routed over QMQP to the SSMP hub and answered ``K``; the
gateway is stopped at once, the way an operator stops it. Its outcome
records (`gateway.core.outcomes`) of the last moments must still reach the
log before it closes: the log is then read from its files, as the Spark
report reads it, and holds one route record per message.

Under load: QMQP senders stream mails into a durable route and the gateway
is stopped mid-stream. It stops reading, answers what it read, closes the
connections and the log within ``shutdown_grace_seconds``, and logs no
critical line and no traceback; every mail a sender was told ``K`` for is
in the route's stream when the log's files are read afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Final

import pytest

from gateway.codecs import qmqp
from gateway.core.outcomes import KIND_ROUTE, OUTCOME_STREAM, decode_records
from gateway.spark.logfiles import plan_slices, read_slice
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

MESSAGES = 300
CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[log]
fsync = "always"

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

# A stream listener: the embedded log is open, and with it the outcome record.
[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
"""
ROUTES = {
    "mail": 'from = "mail"\nmatch = "#@example.org"\nto = "hub"\naddress = "mail"\n'
    'body = "subject"\n'
}


def _block(index: int) -> bytes:
    return qmqp.encode(
        qmqp.MessageBlock(
            id=f"m{index}".encode(),
            message=b"Subject: x\n\nhello\n",
            sender=b"a@example.org",
            recipients=(b"ops@example.org",),
        )
    )


def _send_all(address: tuple[str, int]) -> int:
    """Stream every message; return how many were answered K."""
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    accepted = 0
    answered = 0
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(b"".join(_block(i) for i in range(MESSAGES)))
        while answered < MESSAGES:
            data = sock.recv(65536)
            assert data, "the gateway closed before answering every message"
            for block in codec.receive_data(data):
                assert isinstance(block, qmqp.ReplyBlock)
                answered += 1
                accepted += block.status == qmqp.K
    return accepted


def _route_records(log: Path) -> int:
    count = 0
    for piece in plan_slices(log, streams=[OUTCOME_STREAM]):
        for chunk in read_slice(piece):
            for entry in chunk.records:
                count += sum(r["kind"] == KIND_ROUTE for r in decode_records(entry))
    return count


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_records_of_the_last_moments_survive_a_clean_stop(tmp_path: Path, signum: int) -> None:
    """Stopped right after its last K, the gateway still records every message's outcome."""
    gateway = GatewayProcess(tmp_path, CONFIG, ROUTES).start()
    try:
        assert _send_all(gateway.address("mail")) == MESSAGES
        gateway.signal(signum)
        status = gateway.wait()
    finally:
        gateway.stop()
    output = gateway.output()
    assert "open files: " in output  # the limit it runs with, raised to the hard limit
    assert "dropped" not in output, output
    assert status in (0, -signum), output  # twistd ends with the signal it stopped on
    assert _route_records(tmp_path / "data" / "log") == MESSAGES


# --- under load: SIGTERM while QMQP senders stream into a durable route ----------------------

GRACE_SECONDS: Final = 5.0
STOP_MARGIN_SECONDS: Final = 3.0
"""What a stop may take past the grace: the log's last commit, the process's exit."""
SENDERS: Final = 4
MAILS_PER_SENDER: Final = 50_000
"""More than the gateway takes before the signal: the senders are mid-stream when it comes."""
SIGNAL_AFTER_ACCEPTED: Final = 2_000
CHUNK: Final = 250
"""Message blocks per socket write."""
IO_TIMEOUT_SECONDS: Final = 30.0
ROUTE_STREAM: Final = "msggateway.route.mail-to-stream"
SUBJECT: Final = re.compile(rb"Subject: (s\d+-\d{7})")

DURABLE_CONFIG: Final = f"""
[gateway]
data_dir = "data"
routes = "routes"
shutdown_grace_seconds = {GRACE_SECONDS}

[admin]
enabled = false

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
"""
DURABLE_ROUTES: Final = {
    "mail-to-stream": 'from = "mail"\nmatch = "#"\nto = "streams"\naddress = "mail"\n'
    "durable = true\n"
}


def _mail(sender: int, number: int) -> bytes:
    name = b"s%d-%07d" % (sender, number)
    return qmqp.encode(
        qmqp.MessageBlock(
            id=name,
            message=b"From: load@example.org\nSubject: " + name + b"\n\n" + b"x" * 200 + b"\n",
            sender=b"load@example.org",
            recipients=(b"ops@example.org",),
        )
    )


class _Sender:
    """One QMQP client streaming mails without waiting for replies, as a real one would.

    A thread writes until every mail is sent or the connection fails; another
    reads replies until the gateway closes, then closes its side (which ends
    the writer too). Each batch of replies notifies ``progress``.
    """

    def __init__(
        self, address: tuple[str, int], number: int, progress: threading.Condition
    ) -> None:
        self.sock = socket.create_connection(address, timeout=IO_TIMEOUT_SECONDS)
        self.number = number
        self.accepted: list[bytes] = []
        self.other: collections.Counter[bytes] = collections.Counter()
        self.ended_by = ""
        self._progress = progress
        self._codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
        self._writer = threading.Thread(target=self._write, daemon=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._writer.start()
        self._reader.start()

    def _write(self) -> None:
        with contextlib.suppress(OSError):  # the gateway closed, or we did
            for first in range(0, MAILS_PER_SENDER, CHUNK):
                count = min(CHUNK, MAILS_PER_SENDER - first)
                self.sock.sendall(b"".join(_mail(self.number, first + i) for i in range(count)))
            self.sock.sendall(qmqp.DONE_BYTES)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                self.ended_by = type(exc).__name__
                break
            if not data:
                self.ended_by = "EOF"
                break
            with self._progress:
                for reply in self._codec.receive_data(data):
                    if isinstance(reply, qmqp.ReplyBlock):
                        if reply.status == qmqp.K:
                            self.accepted.append(bytes(reply.id))
                        else:
                            self.other[bytes(reply.status)] += 1
                self._progress.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # as a client does at the end: the writer stops

    def close(self) -> None:
        """Close the connection and wait for both threads."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(IO_TIMEOUT_SECONDS)
        self._writer.join(IO_TIMEOUT_SECONDS)
        self.sock.close()

    def wait_ended(self, timeout: float) -> None:
        """Wait for the gateway to close the connection (the reader sees its end)."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), f"sender {self.number}: the gateway did not close"


def _wait_accepted(senders: list[_Sender], progress: threading.Condition, count: int) -> None:
    """Wait until the senders together were told K ``count`` times."""
    deadline = time.monotonic() + IO_TIMEOUT_SECONDS
    with progress:
        while sum(len(sender.accepted) for sender in senders) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"fewer than {count} mails accepted in {IO_TIMEOUT_SECONDS} s"
            progress.wait(left)


def _stored_names(log: Path, stream: str) -> collections.Counter[bytes]:
    names: collections.Counter[bytes] = collections.Counter()
    for piece in plan_slices(log, streams=[stream]):
        for chunk in read_slice(piece):
            for entry in chunk.records:
                found = SUBJECT.search(bytes(entry))
                if found:
                    names[found.group(1)] += 1
    return names


def test_sigterm_under_load_answers_what_was_read_and_stops_quietly(tmp_path: Path) -> None:
    """SIGTERM mid-stream: every mail read is answered, within the grace, without a critical line.

    Each K names a mail in the durable route's stream; the stop logs its
    drain and no critical line or traceback (the log closing under routes
    still committing was one per batch).
    """
    gateway = GatewayProcess(tmp_path, DURABLE_CONFIG, DURABLE_ROUTES).start()
    progress = threading.Condition()
    senders: list[_Sender] = []
    try:
        senders = [_Sender(gateway.address("mail"), n, progress) for n in range(SENDERS)]
        _wait_accepted(senders, progress, SIGNAL_AFTER_ACCEPTED)
        signalled = time.monotonic()
        gateway.signal(signal.SIGTERM)
        status = gateway.wait(GRACE_SECONDS + STOP_MARGIN_SECONDS + IO_TIMEOUT_SECONDS)
        took = time.monotonic() - signalled
        for sender in senders:
            sender.wait_ended(IO_TIMEOUT_SECONDS)
    finally:
        for sender in senders:
            sender.close()
        gateway.stop()
    output = gateway.output()
    assert status in (0, -signal.SIGTERM), output
    assert "#critical" not in output, output
    assert "Traceback" not in output, output
    assert "msggateway drained in" in output, output
    assert took < GRACE_SECONDS + STOP_MARGIN_SECONDS, (took, output)
    accepted = [name for sender in senders for name in sender.accepted]
    stored = _stored_names(tmp_path / "data" / "log", ROUTE_STREAM)
    missing = [name for name in accepted if name not in stored]
    assert not missing, (len(missing), missing[:5])
    print(  # noqa: T201  (with -s: what a stop under load answered)
        {
            "stop_seconds": round(took, 2),
            "accepted": len(accepted),
            "other": dict(sum((sender.other for sender in senders), collections.Counter())),
            "stored": sum(stored.values()),
            "ended_by": [sender.ended_by for sender in senders],
        }
    )
