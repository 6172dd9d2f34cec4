"""An MTL session, login and lease belong to the connection that made them (issue 26, defect 10).

ZeroMQ names a peer by a routing id the peer may choose; once a connection
is gone another may take its routing id. The listener's sockets are
recorders here that also say which connection (the ZAP handler's number)
and file descriptor the message being handled came on, as the real ones
do; requests are handed to the listener as ZeroMQ would.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import attrs
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs import mtl
from gateway.core.auth import LoginFailurePolicy, Secrets
from gateway.core.message import Message, Outcome, Status
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.peers import DataPeer
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings
from tests.protocols.test_mtl_server import Sent, server

OPEN = ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})
ROUTING_ID = b"app-node-1"


@attrs.define
class Connected(Sent):
    """A recorded socket that knows the connection of the message being handled."""

    connection: str | None = None
    fd: int | None = None
    peer_address: str | None = "192.0.2.7"

    def source_fd(self) -> int | None:
        """The file descriptor of that connection."""
        return self.fd


def guarded() -> tuple[MTLServer, Connected, Connected, GatewayMetrics]:
    """A listener requiring PLAIN logins (alice's secret is ``pw``), its recorded sockets."""
    listener, _clock, _control, _data = server()
    listener.settings = MTLListenerSettings(
        require_auth=True, ping_interval_seconds=5.0, dead_after_seconds=12.0
    )
    listener.secrets = Secrets(logins={"alice": b"pw"})
    metrics = listener._metrics = GatewayMetrics()
    control, data = Connected(), Connected()
    listener._control, listener._data = control, data
    return listener, control, data, metrics


def ask(
    listener: MTLServer,
    control: Connected,
    connection: str,
    fd: int,
    command: str,
    body: dict[str, Any],
) -> tuple[int, dict[str, Any]]:
    """One request under ``ROUTING_ID`` on a connection; the reply."""
    control.connection, control.fd = connection, fd
    listener._on_control([ROUTING_ID, b"", *mtl.request(command, body)])
    routing_id, _empty, status, reply = control.messages[-1]
    assert routing_id == ROUTING_ID
    return int(status), json.loads(reply)


def log_in(listener: MTLServer, control: Connected, connection: str, fd: int) -> str:
    """Alice: Open, Authorize PLAIN, Profile, Writer on connection ``connection``; the lease."""
    plain = base64.b64encode(b"\0alice\0pw").decode()
    steps = [
        (*OPEN, 401),
        ("Connection.Authorize", {"mechanism": "PLAIN", "response": plain}, 201),
        ("Connection.Profile", {"profile": "gateway"}, 200),
        ("Connection.Writer", {"resources": ["news"], "confirm": "full"}, 202),
    ]
    reply: dict[str, Any] = {}
    for command, body, expected in steps:
        status, reply = ask(listener, control, connection, fd, command, body)
        assert status == expected, (command, status, reply)
    return str(reply["lease"])


def test_another_connection_under_the_same_routing_id_inherits_no_session() -> None:
    """Alice logs in on connection 1; connection 2 under her routing id gets 400, not her login."""
    listener, control, _data, _metrics = guarded()
    log_in(listener, control, "1", 11)
    with capturedLogs() as events:
        status, reply = ask(listener, control, "2", 12, "Connection.Profile", {"profile": "test"})
    assert (status, reply["reason"]) == (400, "send Connection.Open first")
    [taken] = [e for e in events if "now comes from another connection" in e["log_format"]]
    assert taken["routing_id"] == ROUTING_ID and taken["who"] == "logged in as alice"
    assert taken["peer"] == "192.0.2.7"
    writer = ("Connection.Writer", {"resources": ["news"], "confirm": "full"})
    assert ask(listener, control, "2", 12, *writer)[0] == 400
    # The new connection's own session starts from nothing: Open, then a login of its own.
    assert ask(listener, control, "2", 12, *OPEN)[0] == 401
    assert ask(listener, control, "2", 12, "Connection.Profile", {"profile": "test"})[0] == 401


def test_a_session_ends_when_its_connection_closes() -> None:
    """ZeroMQ says connection 1 (descriptor 11) closed: its session is gone."""
    listener, control, _data, _metrics = guarded()
    log_in(listener, control, "1", 11)
    assert ROUTING_ID in listener.control._sessions
    listener.control.closed(99)  # another connection: nothing of this one
    assert ROUTING_ID in listener.control._sessions
    listener.control.closed(11)
    assert listener.control._sessions == {}
    assert listener.control._by_fd == {}


def test_a_closed_descriptor_reused_later_ends_only_the_newer_session_once() -> None:
    """Descriptor 11 closes; a later connection on descriptor 11 keeps its session until it does."""
    listener, control, _data, _metrics = guarded()
    log_in(listener, control, "1", 11)
    listener.control.closed(11)
    assert ask(listener, control, "3", 11, *OPEN)[0] == 401
    assert ROUTING_ID in listener.control._sessions
    listener.control.closed(11)
    assert listener.control._sessions == {}


def leased_writer(listener: MTLServer, control: Connected, data: Connected) -> DataPeer:
    """Alice's writer leased on data connection 4 (descriptor 21), its burst over; its peer."""
    token = log_in(listener, control, "1", 11)
    data.connection, data.fd = "4", 21
    listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Lease(1, token))])
    listener._drained()
    return listener._peers[ROUTING_ID]


def test_a_data_peer_under_a_taken_routing_id_has_no_lease() -> None:
    """Alice's writer on data connection 1; connection 2 under her routing id is refused."""
    listener, control, data, metrics = guarded()
    assert leased_writer(listener, control, data).lease is not None
    data.connection, data.fd = "5", 22
    with capturedLogs() as events:
        listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Content(2, "news", {}, b"x"))])
        listener._drained()
    assert data.commands(ROUTING_ID)[-1] == mtl.Reject(2, False, False)
    peer = listener._peers[ROUTING_ID]
    assert peer.lease is None and peer.connection == "5"
    assert any("now comes from another connection" in e["log_format"] for e in events)
    gone = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": "gone-peer"}
    )
    assert gone == 1


def test_a_routing_id_taken_within_one_read_burst_is_not_the_old_peer() -> None:
    """Connection 4's Content, then connection 5's under the same routing id, in one burst."""
    listener, control, data, _metrics = guarded()
    old = leased_writer(listener, control, data)
    listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Content(2, "news", {}, b"x"))])
    data.connection, data.fd = "5", 22
    listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Content(3, "news", {}, b"y"))])
    listener._drained()
    peer = listener._peers[ROUTING_ID]
    assert peer is not old and old.forgotten
    assert peer.lease is None and peer.connection == "5"
    assert mtl.Reject(3, False, False) in data.commands(ROUTING_ID)


def test_a_peer_forgotten_within_a_read_burst_is_not_heard_again() -> None:
    """A peer forgotten between two of its Contents in one burst: the second starts a new one."""
    listener, control, data, _metrics = guarded()
    old = leased_writer(listener, control, data)
    listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Content(2, "news", {}, b"x"))])
    listener.peers.forget(old, "a slow consumer")
    listener._on_data([ROUTING_ID, *mtl.encode_data(mtl.Content(3, "news", {}, b"y"))])
    listener._drained()
    peer = listener._peers[ROUTING_ID]
    assert peer is not old and peer.lease is None
    assert data.commands(ROUTING_ID)[-1] == mtl.Reject(3, False, False)


def test_a_data_peer_is_forgotten_when_its_connection_closes() -> None:
    """A reader whose data connection closed is forgotten at once: what it held is retry later."""
    listener, control, data, _metrics = guarded()
    log_in(listener, control, "1", 11)
    status, reply = ask(
        listener, control, "1", 11, "Connection.Reader", {"resources": ["news"], "confirm": "full"}
    )
    assert status == 202
    data.connection, data.fd = "4", 21
    listener._on_data([b"reader", *mtl.encode_data(mtl.Lease(1, reply["lease"]))])
    listener._on_data([b"reader", *mtl.encode_data(mtl.Summon(2, "news"))])
    listener._drained()
    results: list[list[Outcome]] = []
    listener.deliver([Message(address="news", body=b"x")]).addCallback(results.append)
    assert results == []
    listener.peers.closed(21)
    assert listener._peers[b"reader"].departed and listener.peers._by_fd == {}
    [[outcome]] = results
    assert outcome.status is Status.RETRY and "went away" in outcome.reason


def test_a_closed_connection_is_taken_in_before_a_data_peer_not_known_yet() -> None:
    """The reader's connection (descriptor 21) closed unseen; a new one reuses descriptor 21.

    The listener takes in the connections that closed before it makes the
    new connection's peer (not before each read burst): the old reader is
    gone and the new peer keeps descriptor 21. A peer already known on its
    connection does not look.
    """
    listener, control, data, _metrics = guarded()
    log_in(listener, control, "1", 11)
    status, reply = ask(
        listener, control, "1", 11, "Connection.Reader", {"resources": ["news"], "confirm": "full"}
    )
    assert status == 202
    closed: list[int] = []
    looks: list[int] = []

    def look() -> None:  # what the watches report when asked
        looks.append(len(closed))
        while closed:
            listener.peers.closed(closed.pop())

    listener.peers.look_first = look
    data.connection, data.fd = "4", 21
    listener._on_data([b"reader", *mtl.encode_data(mtl.Lease(1, reply["lease"]))])
    listener._drained()
    listener._on_data([b"reader", *mtl.encode_data(mtl.Summon(2, "news"))])
    listener._drained()
    assert looks == [0]  # once, for the new connection
    reader = listener._peers[b"reader"]
    closed.append(21)
    data.connection = "6"
    listener._on_data([b"other", *mtl.encode_data(mtl.Ping())])
    listener._drained()
    assert looks == [0, 1] and reader.departed
    newer = listener._peers[b"other"]
    assert listener.peers._by_fd == {21: newer}
    listener.peers.closed(21)
    assert newer.departed


def test_a_held_back_answer_is_not_sent_once_its_connection_is_gone() -> None:
    """A refused login's answer waits; its connection closes meanwhile: nothing is sent."""
    listener, control, _data, _metrics = guarded()
    listener.login_failures = LoginFailurePolicy(
        delay_seconds=1.0, max_delay_seconds=4.0, per_connection=3, reset_seconds=600.0
    )
    listener._zmq = object()  # running, as far as held-back answers are concerned
    assert ask(listener, control, "1", 11, *OPEN)[0] == 401
    sent = len(control.messages)
    wrong = base64.b64encode(b"\0alice\0guess").decode()
    control.connection, control.fd = "1", 11
    listener._on_control(
        [
            ROUTING_ID,
            b"",
            *mtl.request("Connection.Authorize", {"mechanism": "PLAIN", "response": wrong}),
        ]
    )
    assert len(control.messages) == sent  # held back
    listener.control.closed(11)
    clock = listener.clock
    assert isinstance(clock, Clock)
    clock.advance(10)
    assert len(control.messages) == sent


def test_a_held_back_answer_still_goes_to_a_session_forgotten_for_room() -> None:
    """Forgotten as the least recently used while its answer waits: its connection still gets it."""
    listener, control, _data, _metrics = guarded()
    listener.settings = MTLListenerSettings(require_auth=True, max_sessions=1)
    listener.login_failures = LoginFailurePolicy(
        delay_seconds=1.0, max_delay_seconds=4.0, per_connection=3, reset_seconds=600.0
    )
    listener._zmq = object()  # running, as far as held-back answers are concerned
    assert ask(listener, control, "1", 11, *OPEN)[0] == 401
    wrong = base64.b64encode(b"\0alice\0guess").decode()
    authorize = mtl.request("Connection.Authorize", {"mechanism": "PLAIN", "response": wrong})
    listener._on_control([ROUTING_ID, b"", *authorize])
    sent = len(control.messages)
    control.connection, control.fd = "2", 12
    listener._on_control([b"someone-else", b"", *mtl.request(*OPEN)])  # takes the only room
    assert ROUTING_ID not in listener.control._sessions
    clock = listener.clock
    assert isinstance(clock, Clock)
    clock.advance(10)
    late = [frames for frames in control.messages[sent:] if frames[0] == ROUTING_ID]
    assert [frames[2] for frames in late] == [b"401"]
