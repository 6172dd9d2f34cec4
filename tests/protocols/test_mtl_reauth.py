"""The MTL listener in this process, on the test's reactor, with a real pyzmq REQ peer.

What the end-to-end tests cannot reach: the secrets the listener verifies
against change under a logged-in session (the spec: "The server MAY issue a
401 response at any time, e.g. if a client's authentication information
changed"), so its next request is answered 401 and it logs in again.
The peer's blocking pyzmq calls run in a worker thread; the listener's
sockets stay on the reactor.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Generator
from typing import Any

import pytest_twisted
import zmq
from twisted.internet import threads

from gateway.core.auth import Secrets
from gateway.core.router import Router, RouteTable
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings

TIMEOUT_MS = 10_000


class Peer:
    """A REQ socket; `ask` blocks, so it runs in a worker thread (one call at a time)."""

    def __init__(self, port: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, requests: list[tuple[str, dict[str, Any]]]) -> list[int]:
        """Send each request in turn; the statuses."""
        statuses = []
        for command, body in requests:
            self.socket.send_multipart([command.encode(), json.dumps(body).encode()])
            assert self.socket.poll(TIMEOUT_MS), f"no answer to {command}"
            status, _ = self.socket.recv_multipart()
            statuses.append(int(status))
        return statuses

    def close(self) -> None:
        """Close the socket and its context."""
        self.context.destroy(linger=0)


def plain(user: str, password: str) -> dict[str, Any]:
    """A Connection.Authorize body for PLAIN."""
    blob = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
    return {"mechanism": "PLAIN", "response": blob}


@pytest_twisted.inlineCallbacks
def test_changed_secrets_ask_for_a_new_login() -> Generator[Any, Any, None]:
    """201 with the old password; after the secrets change, 401, then 201 with the new one."""
    from twisted.internet import reactor

    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(require_auth=True, ping_interval_seconds=0),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(logins={"alice": b"old"}),
        clock=reactor,
        reactor=reactor,
    )
    port = server.start()
    peer = Peer(port)
    try:
        opened = {"protocol": {"name": "MTL", "version": 1}}
        statuses = yield threads.deferToThread(
            peer.ask,
            [
                ("Connection.Open", opened),
                ("Connection.Authorize", plain("alice", "old")),
                ("Connection.Profile", {"profile": "test"}),
            ],
        )
        assert statuses == [401, 201, 200]
        # The secrets change (as a new secrets file would): this session's next
        # request is answered 401, whatever it is; it logs in again and goes on.
        server.secrets = Secrets(logins={"alice": b"new"})
        statuses = yield threads.deferToThread(
            peer.ask,
            [
                ("Connection.Reader", {"resources": [], "confirm": "none"}),
                ("Connection.Authorize", plain("alice", "old")),
                ("Connection.Authorize", plain("alice", "new")),
                ("Connection.Reader", {"resources": [], "confirm": "none"}),
            ],
        )
        assert statuses == [401, 401, 201, 202]
    finally:
        peer.close()
        server.stop()
