"""The MTL listener's memory stays bounded whatever peers send: sessions and leases.

In this process, on the test's reactor, with real pyzmq peers in a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest_twisted
import zmq
from twisted.internet import threads

from gateway.codecs import mtl
from gateway.core.auth import Secrets
from gateway.core.router import Router, RouteTable
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings

TIMEOUT_MS = 10_000
OPEN = {"protocol": {"name": "MTL", "version": 1}}


def ask(socket: zmq.Socket[bytes], command: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One control request; its status and JSON reply."""
    socket.send_multipart([command.encode(), json.dumps(body).encode()])
    assert socket.poll(TIMEOUT_MS), f"no answer to {command}"
    status, reply = socket.recv_multipart()
    return int(status), json.loads(reply)


def bounded_server(**limits: int) -> MTLServer:
    """A listener with small limits."""
    from twisted.internet import reactor

    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(ping_interval_seconds=0, **limits),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
    )
    server.start()
    return server


@pytest_twisted.inlineCallbacks
def test_least_recently_used_session_is_forgotten() -> Generator[Any, Any, None]:
    """Room for two sessions: a third makes the quietest Open again; refusing it keeps nothing."""
    server = bounded_server(max_sessions=2)

    def steps() -> list[Any]:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            peers = [context.socket(zmq.REQ) for _ in range(3)]
            for peer in peers:
                peer.connect(f"tcp://127.0.0.1:{server.port}")
            seen: list[Any] = [ask(peers[0], "Connection.Open", OPEN)[0]]
            seen.append(ask(peers[1], "Connection.Open", OPEN)[0])
            seen.append(ask(peers[0], "Connection.Profile", {"profile": "test"})[0])  # recent
            seen.append(ask(peers[2], "Connection.Open", OPEN)[0])  # peers[1] goes
            status, reply = ask(peers[1], "Connection.Profile", {"profile": "test"})
            seen.append((status, reply["reason"]))
            seen.append(ask(peers[0], "Connection.Reader", {"resources": []})[0])
            return seen
        finally:
            context.destroy(linger=0)

    try:
        seen = yield threads.deferToThread(steps)
        assert seen == [201, 201, 200, 201, (400, "send Connection.Open first"), 202]
    finally:
        server.stop()


@pytest_twisted.inlineCallbacks
def test_oldest_lease_token_stops_working() -> Generator[Any, Any, None]:
    """With room for two leases, a third makes the first token 403; the others work."""
    server = bounded_server(max_leases=2)

    def steps() -> list[int]:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            control = context.socket(zmq.REQ)
            control.connect(f"tcp://127.0.0.1:{server.port}")
            ask(control, "Connection.Open", OPEN)
            ask(control, "Connection.Profile", {"profile": "test"})
            leases = [
                ask(control, "Connection.Writer", {"resources": [], "confirm": "none"})[1]
                for _ in range(3)
            ]
            codes = []
            for number, lease in enumerate(leases, start=1):
                data = context.socket(zmq.DEALER)
                data.connect(f"tcp://127.0.0.1:{lease['port']}")
                data.send_multipart(mtl.encode_data(mtl.Lease(number, lease["lease"])))
                assert data.poll(TIMEOUT_MS), "no Response"
                response = mtl.decode_data(data.recv_multipart())
                assert isinstance(response, mtl.Response) and response.sequence == number
                codes.append(response.code)
                data.close(linger=0)
            return codes
        finally:
            context.destroy(linger=0)

    try:
        codes = yield threads.deferToThread(steps)
        assert codes == [403, 200, 200]
    finally:
        server.stop()
