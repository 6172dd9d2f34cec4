"""MTL to and from streams through ordinary routes, end to end.

One gateway (twistd) with an MTL listener and a stream listener: a raw
pyzmq MTL writer (gateway profile, confirm=full) puts content on a route to
a stream and gets Confirm once the stream stored it, which rstream (a
RabbitMQ Stream client we did not write) then reads; what rstream publishes
to another stream is routed to a raw MTL reader that summoned it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import zmq

from tests.integration.harness import GatewayProcess
from tests.integration.test_mtl import Data, recv, short, u64
from tests.integration.test_stream_rstream import consume, publish, run, spec

rstream = pytest.importorskip("rstream", reason="rstream is installed by ./dev test")

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
enabled = false

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"
profiles = ["gateway"]
"""

ROUTES = {
    "mtl-to-stream": 'from = "mtl"\nmatch = "orders"\nto = "streams"\n',
    "stream-to-mtl": 'from = "streams"\nmatch = "ticks"\nto = "mtl"\naddress = "prices"\n',
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with a stream listener and an MTL listener offering the gateway profile."""
    process = GatewayProcess(tmp_path_factory.mktemp("mtl-streams"), CONFIG, routes=ROUTES)
    yield process.start()
    process.stop()


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZeroMQ context, closed after the test."""
    made: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield made
    made.destroy(linger=0)


def lease(
    context: zmq.Context[zmq.Socket[bytes]], port: int, kind: str, resources: list[str]
) -> Data:
    """Open (no login needed), pick the gateway profile, lease with confirm=full, send Lease."""
    control = context.socket(zmq.REQ)
    control.connect(f"tcp://127.0.0.1:{port}")
    replies = []
    for command, body in (
        ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
        ("Connection.Profile", {"profile": "gateway"}),
        (f"Connection.{kind}", {"resources": resources, "confirm": "full"}),
    ):
        control.send_multipart([command.encode(), json.dumps(body).encode()])
        status, reply = recv(control)
        replies.append((int(status), json.loads(reply)))
    assert [status for status, _ in replies] == [201, 200, 202], replies
    data = Data(context, int(replies[-1][1]["port"]))
    assert data.lease(replies[-1][1]["lease"]) == 200
    return data


def test_mtl_writer_into_a_stream(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Content to "orders" is confirmed once stored; rstream reads exactly those bodies."""
    writer = lease(context, gateway.address("mtl")[1], "Writer", ["orders"])
    bodies = [b"order %d" % index for index in range(20)]
    for sequence, body in enumerate(bodies, start=1):
        writer.content(sequence, "", body)  # one resource leased: the name may be empty
    answers: dict[int, tuple[int, bytes]] = {}
    while len(answers) < len(bodies):
        kind, fields, _ = writer.next()
        writer.learn(answers, kind, fields, range(1, len(bodies) + 1))
    assert answers == {sequence: (0x06, b"\x00") for sequence in range(1, len(bodies) + 1)}
    got = run(consume(gateway, "orders", spec("FIRST"), lambda got: len(got) >= len(bodies)))
    assert [body for _, _, body in got] == bodies


def test_stream_into_an_mtl_reader(
    gateway: GatewayProcess, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """What rstream publishes to "ticks" reaches the reader of "prices"; its Confirms settle it."""
    reader = lease(context, gateway.address("mtl")[1], "Reader", ["prices"])
    reader.command(b"\x03" + u64(2) + short("prices"))
    assert reader.response(2) == 200
    bodies = [b"tick %d" % index for index in range(5)]
    assert run(publish(gateway, "ticks", bodies)) == len(bodies)
    received = []
    while len(received) < len(bodies):
        kind, fields, body = reader.next()
        assert kind == 0x05 and fields[8:].startswith(short("prices")), (kind, fields)
        received.append(body)
        reader.command(b"\x06" + fields[:8] + b"\x00")  # Confirm: the forwarder moves on
    assert received == bodies
