"""MTL over CURVE: the listener encrypts both sockets; raw pyzmq and our upstream use it.

In this process on the test's reactor, real ZeroMQ sockets on loopback.
Blocking pyzmq calls run in a worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest
import pytest_twisted
import zmq
from twisted.internet import threads
from twisted.logger import globalLogPublisher

from gateway.codecs import mtl
from gateway.core.auth import Secrets
from gateway.core.router import Router, RouteTable
from gateway.protocols.mtl.client import MTLUpstream
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings, MTLUpstreamSettings
from tests.protocols.test_mtl_upstream_scram import wait_for

TIMEOUT_MS = 10_000
SILENCE_MS = 300
"""How long a plaintext peer waits to see that a CURVE listener ignores it."""


def curve_server(client_keys: tuple[bytes, ...] = ()) -> tuple[MTLServer, bytes]:
    """A listener with a fresh CURVE key pair (and these client keys only); its public key."""
    from twisted.internet import reactor

    public_key, secret_key = zmq.curve_keypair()
    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(
            curve_secret_key=secret_key, curve_client_keys=client_keys, ping_interval_seconds=0
        ),
        host="127.0.0.1",
        port=0,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
    )
    server.start()
    return server, public_key


def raw_dialogue(
    control: int,
    server_key: bytes | None,
    wait_ms: int = TIMEOUT_MS,
    client_keys: tuple[bytes, bytes] | None = None,
) -> list[Any]:
    """Open, profile, reader lease, then Lease and Summon on the data flow, raw pyzmq.

    A reply not there within ``wait_ms`` is recorded as ``"silence"`` and ends
    it. CURVE sockets use ``client_keys`` (public, secret), or fresh ones.
    """
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sockets = [context.socket(zmq.REQ), context.socket(zmq.DEALER)]
        for socket in sockets:
            socket.linger = 0
            if server_key is not None:
                public_key, secret_key = client_keys or zmq.curve_keypair()
                socket.curve_serverkey = server_key
                socket.curve_publickey = public_key
                socket.curve_secretkey = secret_key
        request, data = sockets
        request.connect(f"tcp://127.0.0.1:{control}")
        seen: list[Any] = []
        port = lease = None
        for command, body in [
            ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
            ("Connection.Profile", {"profile": "test"}),
            ("Connection.Reader", {"resources": ["resource"], "confirm": "none"}),
        ]:
            request.send_multipart([command.encode(), json.dumps(body).encode()])
            if not request.poll(wait_ms):
                seen.append("silence")
                return seen
            status, reply = request.recv_multipart()
            seen.append(int(status))
            port, lease = json.loads(reply).get("port"), json.loads(reply).get("lease")
        data.connect(f"tcp://127.0.0.1:{port}")
        data.send_multipart(mtl.encode_data(mtl.Lease(1, str(lease))))
        data.send_multipart(mtl.encode_data(mtl.Summon(2, "resource")))
        for _ in range(2):
            assert data.poll(TIMEOUT_MS), "no data Response"
            response = mtl.decode_data(data.recv_multipart())
            assert isinstance(response, mtl.Response)
            seen.append((response.sequence, response.code))
        return seen
    finally:
        context.destroy(linger=0)


@pytest_twisted.inlineCallbacks
def test_curve_peer_is_served_and_plaintext_peer_is_not() -> Generator[Any, Any, None]:
    """With the public key the whole dialogue works; without CURVE nothing is answered."""
    server, public_key = curve_server()
    try:
        seen = yield threads.deferToThread(raw_dialogue, server.port, public_key)
        assert seen == [201, 200, 202, (1, 200), (2, 200)]
        seen = yield threads.deferToThread(raw_dialogue, server.port, None, SILENCE_MS)
        assert seen == ["silence"]
        # A wrong server key fails the CURVE handshake: no answer either.
        wrong, _ = zmq.curve_keypair()
        seen = yield threads.deferToThread(raw_dialogue, server.port, wrong, SILENCE_MS)
        assert seen == ["silence"]
    finally:
        server.stop()


def curve_upstream(port: int, server_key: bytes, secret_key: bytes | None) -> MTLUpstream:
    """Our reader upstream (test profile) over CURVE, with its own secret key or none."""
    from twisted.internet import reactor

    return MTLUpstream(
        name="remote",
        settings=MTLUpstreamSettings(
            mode="reader",
            profile="test",
            resources=("resource",),
            confirm="none",
            curve_server_key=server_key,
            curve_secret_key=secret_key,
        ),
        host="127.0.0.1",
        port=port,
        router=Router(RouteTable(), reactor),
        secrets=Secrets(),
        clock=reactor,
        reactor=reactor,
    )


@pytest.mark.parametrize("own_key", [False, True])
@pytest_twisted.inlineCallbacks
def test_our_upstream_over_curve(own_key: bool) -> Generator[Any, Any, None]:
    """Our upstream leases and summons over CURVE: any key, or its own where only it is let in."""
    summoned: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if "summoned" in event.get("log_format", ""):
            summoned.append(event["resource"])

    globalLogPublisher.addObserver(observe)
    public_key, secret_key = zmq.curve_keypair()
    server, server_key = curve_server((public_key,) if own_key else ())
    upstream = curve_upstream(server.port, server_key, secret_key if own_key else None)
    upstream.start()
    try:
        yield wait_for(lambda: upstream.connected and summoned == ["resource"])
    finally:
        globalLogPublisher.removeObserver(observe)
        upstream.stop()
        server.stop()


@pytest_twisted.inlineCallbacks
def test_upstream_with_an_unknown_key_is_refused() -> Generator[Any, Any, None]:
    """A listener that knows other client keys refuses our upstream's (logged), never serves it."""
    refused: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if "refused a peer" in event.get("log_format", ""):
            refused.append(event["reason"])

    globalLogPublisher.addObserver(observe)
    other_key, _ = zmq.curve_keypair()
    server, server_key = curve_server((other_key,))
    upstream = curve_upstream(server.port, server_key, None)
    upstream.start()
    try:
        yield wait_for(lambda: bool(refused))
        assert refused[0] == "CURVE key not allowed"
        assert not upstream.connected and server.traffic.messages_in == 0
    finally:
        globalLogPublisher.removeObserver(observe)
        upstream.stop()
        server.stop()
