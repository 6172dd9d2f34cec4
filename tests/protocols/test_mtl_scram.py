"""The MTL listener's SCRAM-SHA-256 login, in this process, with a real pyzmq REQ peer.

The spec's SASL model (mtl.txt, "Client Authentication"): Connection.Authorize
rounds answered ``402 Challenged`` until the cycle finishes with ``201``.
The peer's side of SCRAM is `ScramClient`, checked against RFC 7677's
example in tests/codecs/test_scram.py; the MTL dialogue around it is raw
pyzmq. Blocking pyzmq calls run in a worker thread; the listener's sockets
stay on the reactor.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Generator
from typing import Any

import pytest_twisted
import zmq
from twisted.internet import threads

from gateway.codecs.scram import ScramClient
from gateway.core.auth import LoginFailurePolicy, Secrets
from gateway.core.router import Router, RouteTable
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings

TIMEOUT_MS = 10_000
OPEN = ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})


class Peer:
    """A REQ socket; `ask` blocks, so it runs in a worker thread (one call at a time)."""

    def __init__(self, port: int) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, command: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Send one request; its status and JSON body."""
        self.socket.send_multipart([command.encode(), json.dumps(body).encode()])
        assert self.socket.poll(TIMEOUT_MS), f"no answer to {command}"
        status, reply = self.socket.recv_multipart()
        return int(status), json.loads(reply)

    def close(self) -> None:
        """Close the socket and its context."""
        self.context.destroy(linger=0)


def authorize(response: bytes, mechanism: str = "SCRAM-SHA-256") -> tuple[str, dict[str, Any]]:
    """A Connection.Authorize request carrying ``response``."""
    return "Connection.Authorize", {
        "mechanism": mechanism,
        "response": base64.b64encode(response).decode(),
    }


def challenge(reply: dict[str, Any]) -> bytes:
    """The decoded challenge of a 402 reply."""
    assert reply["status"] == "Challenged" and reply["mechanism"] == "SCRAM-SHA-256"
    return base64.b64decode(reply["challenge"])


def scram_login(peer: Peer, user: str, password: bytes) -> list[int]:
    """Log in with SCRAM-SHA-256 the way the spec's SASL cycle goes; the statuses seen."""
    client = ScramClient(user, password)
    statuses = [peer.ask(*OPEN)[0]]
    status, reply = peer.ask(*authorize(b""))  # no initial response: an empty challenge
    statuses.append(status)
    assert challenge(reply) == b""
    status, reply = peer.ask(*authorize(client.first()))
    statuses.append(status)
    status, reply = peer.ask(*authorize(client.final(challenge(reply))))
    statuses.append(status)
    if status != 402:
        return statuses
    client.verify(challenge(reply))  # the server knows the password too
    status, reply = peer.ask(*authorize(b""))
    statuses.append(status)
    if status == 201:
        assert reply["profiles"] == ["test", "gateway"]
    return statuses


def new_server(secrets: Secrets, mechanisms: tuple[str, ...]) -> MTLServer:
    """An MTL listener on the global reactor requiring SASL."""
    from twisted.internet import reactor

    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(
            require_auth=True, mechanisms=mechanisms, ping_interval_seconds=0
        ),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=secrets,
        clock=reactor,
        reactor=reactor,
    )
    # SCRAM's rounds are under test here, not the wait after a refusal (test_mtl_logins.py).
    server.login_failures = LoginFailurePolicy(delay_seconds=0, per_connection=100)
    server.start()
    return server


def dialogue(port: int, steps: Any) -> Any:
    """Run ``steps(peer)`` against a fresh peer, then close it."""
    peer = Peer(port)
    try:
        return steps(peer)
    finally:
        peer.close()


@pytest_twisted.inlineCallbacks
def test_scram_login_then_profile_and_lease() -> Generator[Any, Any, None]:
    """Open 401 (both mechanisms), 402 x3, 201; then the profile and a lease work."""
    server = new_server(Secrets(logins={"alice": b"s3cret"}), ("SCRAM-SHA-256", "PLAIN"))

    def steps(peer: Peer) -> list[Any]:
        status, reply = peer.ask(*OPEN)
        assert (status, reply["mechanisms"]) == (401, ["SCRAM-SHA-256", "PLAIN"])
        seen: list[Any] = scram_login(peer, "alice", b"s3cret")
        seen.append(peer.ask("Connection.Profile", {"profile": "test"})[0])
        seen.append(peer.ask("Connection.Reader", {"resources": [], "confirm": "none"})[0])
        return seen

    try:
        seen = yield threads.deferToThread(dialogue, server.port, steps)
        assert seen == [401, 402, 402, 402, 201, 200, 202]
    finally:
        server.stop()


@pytest_twisted.inlineCallbacks
def test_scram_wrong_password_unknown_user_and_bad_messages() -> Generator[Any, Any, None]:
    """A wrong proof, an unknown user, garbage and an unacknowledged final all end in 401."""
    server = new_server(Secrets(logins={"alice": b"s3cret"}), ("SCRAM-SHA-256",))

    def steps(peer: Peer) -> list[Any]:
        seen: list[Any] = [
            scram_login(peer, "alice", b"wrong"),
            scram_login(peer, "mallory", b"s3cret"),
        ]
        status, reply = peer.ask(*authorize(b"p=tls-unique,,n=alice,r=x"))
        seen.append((status, "channel binding" in reply["reason"]))
        seen.append(peer.ask(*authorize(b"\0alice\0s3cret", mechanism="PLAIN"))[0])
        # A verified exchange must be acknowledged with an empty response.
        client = ScramClient("alice", b"s3cret")
        _, reply = peer.ask(*authorize(client.first()))
        status, reply = peer.ask(*authorize(client.final(challenge(reply))))
        seen.append(status)
        seen.append(peer.ask(*authorize(b"more"))[0])
        # Nothing but Authorize and Open is served meanwhile.
        seen.append(peer.ask("Connection.Profile", {"profile": "test"})[0])
        return seen

    try:
        seen = yield threads.deferToThread(dialogue, server.port, steps)
        assert seen == [
            [401, 402, 402, 401],
            [401, 402, 402, 401],
            (401, True),
            401,  # PLAIN is not offered on this listener
            402,
            401,
            401,
        ]
    finally:
        server.stop()


@pytest_twisted.inlineCallbacks
def test_scram_with_the_shared_secret_and_a_changed_secret() -> Generator[Any, Any, None]:
    """The ``*`` secret serves any user; when it changes, the next request is 401."""
    server = new_server(Secrets(logins={"*": b"shared"}), ("SCRAM-SHA-256",))

    def first(peer: Peer) -> list[Any]:
        seen = scram_login(peer, "bob", b"shared")
        seen.append(peer.ask("Connection.Profile", {"profile": "gateway"})[0])
        return seen

    def second(peer: Peer) -> list[Any]:
        return [peer.ask("Connection.Reader", {"resources": [], "confirm": "none"})[0]]

    try:
        peer = Peer(server.port)
        try:
            seen = yield threads.deferToThread(first, peer)
            assert seen == [401, 402, 402, 402, 201, 200]
            server.secrets = Secrets(logins={"*": b"rotated"})
            seen = yield threads.deferToThread(second, peer)
            assert seen == [401]
        finally:
            peer.close()
    finally:
        server.stop()
