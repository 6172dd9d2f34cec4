"""MTL SASL EXTERNAL: the identity of the client's CURVE key, as the ZAP handler names it.

The listener runs on the test's reactor with real ZeroMQ sockets; the client
is raw pyzmq in a thread. A key listed in ``curve_identities`` logs in with
EXTERNAL as that identity (and the allow-lists apply to it); any other key
gets ``401``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Generator
from typing import Any

import pytest_twisted
import zmq
from twisted.internet import threads
from zmq.utils import z85

from gateway.core.authorization import Authorization
from gateway.protocols.mtl.zap import ZAPPolicy, zap_reply
from tests.protocols.test_mtl_zap import listener, request

ALICE = zmq.curve_keypair()
MALLORY = zmq.curve_keypair()
TIMEOUT_MS = 10_000


def test_zap_names_the_holder_of_a_known_key() -> None:
    """The ZAP reply's User-Id is the key's identity; other keys pass with none."""
    policy = ZAPPolicy.from_settings([], [], {"alice": ALICE[0]})
    assert policy.needed
    reply, refused = zap_reply(request(b"127.0.0.1", b"CURVE", z85.decode(ALICE[0])), policy)
    assert refused is None and reply[4] == b"alice"
    reply, refused = zap_reply(request(b"127.0.0.1", b"CURVE", z85.decode(MALLORY[0])), policy)
    assert refused is None and reply[4] == b""


def test_identity_keys_are_let_in_beside_client_keys() -> None:
    """With ``curve_client_keys`` too, a key of ``curve_identities`` is still let in."""
    policy = ZAPPolicy.from_settings([], [MALLORY[0]], {"alice": ALICE[0]})
    assert zap_reply(request(b"127.0.0.1", b"CURVE", z85.decode(ALICE[0])), policy)[1] is None


def dialogue(port: int, server_key: bytes, keys: tuple[bytes, bytes], authzid: bytes) -> list[Any]:
    """Open, Authorize EXTERNAL, Profile, Writer and Reader of ``news``: statuses and reasons."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        socket = context.socket(zmq.REQ)
        socket.linger = 0
        socket.curve_serverkey = server_key
        socket.curve_publickey, socket.curve_secretkey = keys
        socket.connect(f"tcp://127.0.0.1:{port}")
        seen: list[Any] = []
        for command, body in [
            ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
            (
                "Connection.Authorize",
                {"mechanism": "EXTERNAL", "response": base64.b64encode(authzid).decode()},
            ),
            ("Connection.Profile", {"profile": "gateway"}),
            ("Connection.Writer", {"resources": ["news"], "confirm": "none"}),
            ("Connection.Reader", {"resources": ["news"], "confirm": "none"}),
        ]:
            socket.send_multipart([command.encode(), json.dumps(body).encode()])
            assert socket.poll(TIMEOUT_MS), f"no answer to {command}"
            status, reply = socket.recv_multipart()
            seen.append((int(status), json.loads(reply).get("reason")))
            if int(status) == 401 and command == "Connection.Authorize":
                break
        return seen
    finally:
        context.destroy(linger=0)


@pytest_twisted.inlineCallbacks
def test_external_logs_in_as_the_key_identity() -> Generator[Any, Any, None]:
    """Alice's key: EXTERNAL is 201, Writer 202, Reader 403; Mallory's key: 401."""
    public_key, secret_key = zmq.curve_keypair()
    server = listener(
        require_auth=True,
        mechanisms=("EXTERNAL",),
        curve_secret_key=secret_key,
        curve_identities={"alice": ALICE[0]},
    )
    server.authorization = Authorization.from_lists({"alice": (("news",), ())})
    try:
        seen = yield threads.deferToThread(dialogue, server.port, public_key, ALICE, b"")
        assert seen == [
            (401, None),
            (201, None),
            (200, None),
            (202, None),
            (403, "alice may not consume 'news'"),
        ]
        seen = yield threads.deferToThread(dialogue, server.port, public_key, ALICE, b"bob")
        assert seen[1] == (401, "EXTERNAL: this CURVE key is not 'bob'")
        seen = yield threads.deferToThread(dialogue, server.port, public_key, MALLORY, b"")
        assert seen[1] == (401, "EXTERNAL: this CURVE key has no identity here")
    finally:
        server.stop()
