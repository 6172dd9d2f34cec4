"""Tests for `gateway.protocols.mtl.server` without sockets: timers on a `Clock`.

The listener's two ZeroMQ sockets are replaced by recorders of the
multipart messages it sends (ZeroMQ itself is exercised end to end in
tests/integration/test_mtl.py); requests are handed to its receive
functions as ZeroMQ would, identity frame first.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from gateway.codecs import mtl
from gateway.core.addressing import AddressPattern
from gateway.core.auth import Secrets
from gateway.core.message import Message, Outcome, Status
from gateway.core.router import Route, Router, bind_routes
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings


@attrs.define
class Sent:
    """Records what the listener sends on one socket."""

    messages: list[list[bytes]] = attrs.Factory(list)

    def send(self, frames: list[bytes]) -> bool:
        """Record; ZeroMQ took it."""
        self.messages.append(frames)
        return True


def server() -> tuple[MTLServer, Clock, Sent, Sent]:
    """A listener with recorded sockets, pings every 5 s, dead after 12 s."""
    clock = Clock()
    router = Router(bind_routes([], {}), clock)
    listener = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(ping_interval_seconds=5.0, dead_after_seconds=12.0),
        host="127.0.0.1",
        port=0,
        router=router,
        secrets=Secrets(),
        clock=clock,
        reactor=clock,
    )
    control, data = Sent(), Sent()
    listener._control, listener._data = control, data
    listener._timer = clock.callLater(5.0, listener._tick)
    route = Route(name="in", source="app", pattern=AddressPattern("#"), destination="mtl")
    router.replace_table(bind_routes([route], {"mtl": listener}))
    return listener, clock, control, data


def lease(listener: MTLServer, control: Sent, kind: str, confirm: str) -> str:
    """Walk a REQ peer through Open, Profile and Reader/Writer; the lease."""
    for command, body in (
        ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}}),
        ("Connection.Profile", {"profile": "gateway"}),
        (f"Connection.{kind}", {"resources": ["news"], "confirm": confirm}),
    ):
        listener._on_control([b"peer", b"", *mtl.request(command, body)])
    status, body_bytes = control.messages[-1][2:]
    assert status == b"202"
    return str(json.loads(body_bytes)["lease"])


def data(listener: MTLServer, identity: bytes, command: mtl.DataCommand) -> None:
    """One data command from a DEALER peer."""
    listener._on_data([identity, *mtl.encode_data(command)])


def test_pings_and_a_dead_reader_gives_back_its_unconfirmed() -> None:
    """Idle peers are pinged; a silent one is forgotten and what it held is retried."""
    listener, clock, control, sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", mtl.Summon(2, "news"))
    outcome = listener.deliver_one(Message(address="news", body=b"x"))
    assert isinstance(outcome, Deferred)
    results: list[Outcome] = []
    outcome.addCallback(results.append)
    clock.advance(5)
    assert mtl.decode_data(sent.messages[-1][1:]) == mtl.Ping()
    data(listener, b"r", mtl.Pong())  # heard at 5 s
    clock.advance(5)
    clock.advance(5)
    assert results == []
    clock.advance(5)  # 15 s of silence: dead
    assert results[0].status is Status.RETRY and "went away" in results[0].reason
    retry = listener.deliver_one(Message(address="news", body=b"y"))
    retry.addCallback(results.append)
    assert results[1].status is Status.RETRY and "no MTL reader" in results[1].reason


def test_multiple_and_recycle() -> None:
    """Confirm multiple settles everything up to it; Reject recycle asks for a retry."""
    listener, _clock, control, _sent = server()
    data(listener, b"r", mtl.Lease(1, lease(listener, control, "Reader", "full")))
    data(listener, b"r", mtl.Summon(2, "news"))
    results: list[Outcome] = []
    for body in (b"a", b"b", b"c"):
        listener.deliver_one(Message(address="news", body=body)).addCallback(results.append)
    data(listener, b"r", mtl.Confirm(2, True))
    assert [r.status for r in results] == [Status.ACCEPTED, Status.ACCEPTED]
    data(listener, b"r", mtl.Reject(3, False, True))
    assert results[2].status is Status.RETRY
    data(listener, b"r", mtl.Confirm(99, True))  # invalid: ignored silently
    assert len(results) == 3
