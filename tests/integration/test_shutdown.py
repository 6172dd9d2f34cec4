"""A clean stop keeps every outcome record: real twistd, SIGTERM and SIGINT.

Messages are routed over QMQP to the SSMP hub and answered ``K``; the
gateway is stopped at once, the way an operator stops it. Its outcome
records (`gateway.core.outcomes`) of the last moments must still reach the
log before it closes: the log is then read from its files, as the Spark
report reads it, and holds one route record per message.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

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
