"""Connection limits per listener, end to end: past ``max_connections`` a connection is closed.

One gateway under twistd with an SSMP, a QMQP, a stream and a DMP listener,
each limited to two open connections: a third connection to each is closed
before anything is read from it, the first two keep working, and once one
of them goes the next connection is served.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.ssmp]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]
max_connections = 2

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
max_connections = 2

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
max_connections = 2

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["s"]
max_connections = 2
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway whose listeners each take two connections."""
    process = GatewayProcess(tmp_path_factory.mktemp("limits"), CONFIG).start()
    yield process
    process.stop()


def closed_at_once(address: tuple[str, int]) -> bool:
    """Whether a new connection is closed by the gateway without a byte."""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


PROBES = {
    "ssmp": (b"LOGIN probe open\n", b"200"),
    # An unroutable message: answered D, and the connection stays open.
    "qmqp": (
        qmqp.encode(qmqp.MessageBlock(id=b"p", message=b"x", sender=b"a@b", recipients=(b"c@d",))),
        b"",
    ),
    "streams": (sp.encode(sp.PeerProperties(correlation_id=1, properties={})), b""),
    "dmp": (b"AMQP\x0a\x01\x00\x01", b"\x0e200 OK DMP/0.1"),
}
"""What to send each protocol to be answered, and how the answer starts."""


def served(sock: socket.socket, listener: str) -> bool:
    """Whether the listener answers this connection as its protocol says."""
    request, answer = PROBES[listener]
    sock.sendall(request)
    try:
        data = sock.recv(64)
    except ConnectionResetError:
        return False
    return bool(data) and data.startswith(answer)


@pytest.mark.parametrize("listener", ["ssmp", "qmqp", "streams", "dmp"])
def test_a_third_connection_is_closed(gateway: GatewayProcess, listener: str) -> None:
    """Two open: the third is closed at once; once one leaves, a new one is served."""
    address = gateway.address(listener)
    first = socket.create_connection(address, timeout=10)
    second = socket.create_connection(address, timeout=10)
    try:
        assert served(second, listener)  # accepted and working
        assert closed_at_once(address)
        first.close()
        # The gateway notices the close on its next reactor turn: poll, bounded.
        deadline = time.monotonic() + 10
        while True:
            with socket.create_connection(address, timeout=10) as again:
                if served(again, listener):
                    break
            assert time.monotonic() < deadline, "a freed slot was never reused"
    finally:
        first.close()
        second.close()
