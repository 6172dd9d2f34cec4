"""Refused logins wait, growing, and are counted and logged with the peer (issue 26).

`gateway.protocols.logins` and each listener that checks a secret, on a
`Clock` and `StringTransport`s: every connection here comes from the
transport's one peer address (192.168.1.1), so refusals on one connection
make the next connection wait as well. MTL has its own harness
(test_mtl_logins.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs import dmp, qmqp
from gateway.codecs import stream as sp
from gateway.codecs.amqp091 import PROTOCOL_HEADER, FrameCodec, Method
from gateway.core.auth import LoginFailurePolicy
from gateway.core.log import FsyncPolicy, LogStore
from gateway.core.log.values import ILogReactor
from gateway.metrics import GatewayMetrics
from gateway.protocols.logins import LoginRefusals, peer_address, peer_text
from gateway.protocols.qmqp.settings import QMQPListenerSettings
from gateway.protocols.stream.server import StreamServerFactory
from gateway.protocols.stream.settings import StreamListenerSettings
from tests.protocols.test_dmp_principal import OPEN, TUNE_OK, start_ok, take
from tests.protocols.test_dmp_principal import Listener as PrincipalListener
from tests.protocols.test_dmp_server import Listener as DMPListener
from tests.protocols.test_dmp_server import read
from tests.protocols.test_qmqp_server import AUTH_REQUEST, WRONG_AUTH_REQUEST, mail
from tests.protocols.test_qmqp_server import ListenerWorld as QMQPWorld
from tests.protocols.test_ssmp_server import HubWorld
from tests.protocols.test_stream_server import SECRETS as STREAM_SECRETS
from tests.protocols.test_stream_server import Peer as StreamPeer
from tests.protocols.test_stream_server import plain

POLICY = LoginFailurePolicy(
    delay_seconds=1.0, max_delay_seconds=4.0, per_connection=3, reset_seconds=600.0
)
PEER = "192.168.1.1:54321"
"""Where a `StringTransport` says its peer is."""


def login_failures(metrics: GatewayMetrics, listener: str) -> float:
    """``msggateway_login_failures_total`` of one listener."""
    value = metrics.registry.get_sample_value(
        "msggateway_login_failures_total", {"endpoint": listener}
    )
    return value or 0.0


def refusals(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The login refusals among captured log events."""
    return [event for event in events if "login refused" in str(event.get("log_format", ""))]


# --- LoginRefusals ---------------------------------------------------------------------


def test_peer_addresses_count_by_host_and_log_with_the_port() -> None:
    """Refusals count against the host (a new port is the same peer); the log shows both."""

    class Address:
        host = "198.51.100.4"
        port = 4242

    assert peer_address(Address()) == "198.51.100.4"
    assert peer_text(Address()) == "198.51.100.4:4242"
    assert peer_address("10.1.2.3") == peer_text("10.1.2.3") == "10.1.2.3"
    assert peer_address(None) is None
    assert peer_text(None) == "an unknown peer"


def test_refusals_are_counted_logged_and_make_the_next_wait() -> None:
    """Each refusal: one counter step, one warning with listener, peer, identity and why."""
    clock, metrics = Clock(), GatewayMetrics()
    desk = LoginRefusals("hub", POLICY, clock, metrics)
    with capturedLogs() as events:
        first = desk.refused(peer="10.1.2.3", identity="alice", mechanism="LOGIN secret", why="x")
    assert first == 1.0
    assert desk.wait_seconds("10.1.2.3", "bob") == 1.0
    assert desk.wait_seconds("10.9.9.9", "alice") == 1.0
    assert login_failures(metrics, "hub") == 1
    (event,) = refusals(events)
    assert (event["listener"], event["peer"], event["identity"]) == ("hub", "10.1.2.3", "alice")
    assert (event["mechanism"], event["why"], event["delay"]) == ("LOGIN secret", "x", 1.0)
    assert event["log_level"].name == "warn"
    assert not desk.spent(2) and desk.spent(3)


# --- SSMP ----------------------------------------------------------------------------------


def ssmp_world() -> HubWorld:
    """The hub of test_ssmp_server (sam's secret is ``sesame``), with the policy above."""
    world = HubWorld()
    world.factory.login_failures = POLICY
    return world


def test_ssmp_refusals_wait_longer_each_time_and_close() -> None:
    """Wrong secrets: 401 after 1 s, then 2 s, then 4 s, 4 s; nothing is read meanwhile."""
    world = ssmp_world()
    for wait in (1.0, 2.0, 4.0, 4.0):
        peer = world.connect()
        peer.send(b"LOGIN sam secret wrong\nSUBSCRIBE news\n")
        assert peer.transport.producerState == "paused"
        world.clock.advance(wait - 0.001)
        assert peer.received() == b""
        assert not peer.transport.disconnecting
        world.clock.advance(0.001)
        assert peer.received() == b"401 open secret\n"
        assert peer.transport.disconnecting
    assert world.sample("msggateway_login_failures_total") == 4


def test_ssmp_the_right_secret_waits_for_a_refusal_still_owed_then_logs_in() -> None:
    """A refusal is due at 1 s: a right LOGIN at 0.5 s is checked, and answered 200, at 1 s."""
    world = ssmp_world()
    guesser = world.connect()
    guesser.send(b"LOGIN sam secret wrong\n")
    world.clock.advance(0.5)
    owner = world.connect()
    owner.send(b"LOGIN sam secret sesame\nSUBSCRIBE news\n")
    assert owner.received() == b""
    world.clock.advance(0.5)
    assert guesser.received() == b"401 open secret\n"
    assert owner.received() == b"200\n200\n"  # the LOGIN, and the SUBSCRIBE held with it
    assert owner.transport.producerState == "producing"
    # Accepted: sam's refusals are forgotten; the address's still count.
    assert world.factory.logins.throttle.failures(None, "sam") == 0
    assert world.factory.logins.throttle.failures("192.168.1.1", None) == 1


def test_ssmp_a_login_waits_once_then_is_refused_unchecked_if_another_was_checked() -> None:
    """Two LOGINs wait for the same refusal: the first then is checked, the other refused.

    The second is refused without its secret being checked (the right one
    here), at once, and its refusal does not lengthen anyone's wait; asked
    again once the wait is over, it logs in. No connection waits longer
    than two of the longest delays, however many guess in parallel.
    """
    world = ssmp_world()
    world.connect().send(b"LOGIN sam secret wrong\n")  # refused at 1 s
    world.clock.advance(0.5)
    guesser, owner = world.connect(), world.connect()
    guesser.send(b"LOGIN sam secret wrong-again\n")
    owner.send(b"LOGIN sam secret sesame\n")
    with capturedLogs() as events:
        world.clock.advance(0.5)  # both waited: the guesser's is checked (refused at 3 s)
    assert owner.received() == b"401 open secret\n" and owner.transport.disconnecting
    assert guesser.received() == b""
    (checked, unchecked) = refusals(events)
    assert (checked["why"], checked["delay"]) == ("wrong or missing secret", 2.0)
    assert str(unchecked["why"]).startswith("not checked") and unchecked["delay"] == 0.0
    world.clock.advance(2.0)
    assert guesser.received() == b"401 open secret\n"
    assert world.sample("msggateway_login_failures_total") == 3
    assert world.login("sam", "secret sesame").transport.producerState == "producing"


def test_ssmp_refusal_is_logged_with_the_peer() -> None:
    """The refusal's log line names the peer's address and port, the identity and why."""
    world = ssmp_world()
    with capturedLogs() as events:
        world.connect().send(b"LOGIN mallory secret guess\n")
    (event,) = refusals(events)
    assert (event["peer"], event["identity"], event["mechanism"]) == (
        PEER,
        "mallory",
        "LOGIN secret",
    )


# --- the stream protocol ---------------------------------------------------------------


def stream_factory(tmp_path: Path) -> tuple[StreamServerFactory, Clock, GatewayMetrics]:
    """A stream listener (alice's password is ``wonderland``) with the policy above.

    Its log is never opened: logging in does not touch it.
    """
    clock, metrics = Clock(), GatewayMetrics()
    never_opened = cast(ILogReactor, clock)  # the reactor is only used once the log opens
    store = LogStore(tmp_path / "log", never_opened, fsync=FsyncPolicy.NEVER, clock=clock)
    factory = StreamServerFactory(
        name="streams",
        settings=StreamListenerSettings(),
        store=store,
        secrets=STREAM_SECRETS,
        clock=clock,
        metrics=metrics,
    )
    factory.login_failures = POLICY
    return factory, clock, metrics


def sasl_plain(peer: StreamPeer, password: bytes, *after: sp.Event) -> None:
    """Alice's SaslAuthenticate PLAIN, and more frames, in one read."""
    peer.send(
        sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=plain(b"alice", password)),
        *after,
    )


def test_stream_refusals_wait_longer_each_time_and_close(tmp_path: Path) -> None:
    """Wrong passwords: code 8 after 1 s, then 2 s, then 4 s; closed; nothing read meanwhile."""
    factory, clock, metrics = stream_factory(tmp_path)
    for wait in (1.0, 2.0, 4.0):
        peer = StreamPeer(factory, "10.1.2.3")
        sasl_plain(peer, b"guess", sp.Tune(frame_max=0, heartbeat=0))
        assert peer.transport.producerState == "paused"
        clock.advance(wait - 0.001)
        assert peer.frames() == []
        assert not peer.closed
        clock.advance(0.001)
        assert peer.frames() == [sp.SaslAuthenticateResponse(correlation_id=3, code=8)]
        assert peer.closed
    assert login_failures(metrics, "streams") == 3


def test_stream_the_right_password_waits_for_a_refusal_still_owed(tmp_path: Path) -> None:
    """A refusal due at 1 s holds a right PLAIN sent at 0.5 s, and what follows it, till then."""
    factory, clock, _metrics = stream_factory(tmp_path)
    guesser = StreamPeer(factory, "10.1.2.3")
    sasl_plain(guesser, b"guess")
    clock.advance(0.5)
    owner = StreamPeer(factory, "10.1.2.3")
    sasl_plain(
        owner,
        b"wonderland",
        sp.Tune(frame_max=0, heartbeat=0),
        sp.Open(correlation_id=4, virtual_host="/"),
    )
    assert owner.frames() == []
    clock.advance(0.5)
    frames = owner.frames()
    assert frames[0] == sp.SaslAuthenticateResponse(correlation_id=3, code=1)
    assert isinstance(frames[1], sp.Tune)
    assert isinstance(frames[2], sp.OpenResponse) and frames[2].code == 1
    assert owner.protocol.identity == "alice"
    assert owner.transport.producerState == "producing"


def test_stream_refusal_is_logged_with_the_peer(tmp_path: Path) -> None:
    """The refusal's log line names the peer (address and port), the user and the mechanism."""
    factory, _clock, _metrics = stream_factory(tmp_path)
    with capturedLogs() as events:
        sasl_plain(StreamPeer(factory, "10.1.2.3"), b"guess")
    (event,) = refusals(events)
    assert (event["peer"], event["identity"], event["mechanism"]) == (
        "10.1.2.3:40404",
        "alice",
        "SASL PLAIN",
    )


# --- QMQP --------------------------------------------------------------------------------


def qmqp_world() -> QMQPWorld:
    """The listener of test_qmqp_server requiring ``A`` blocks, with the policy above."""
    world = QMQPWorld(settings=QMQPListenerSettings(require_auth=True))
    world.factory.login_failures = POLICY
    return world


def test_qmqp_a_refused_a_block_holds_the_blocks_after_it() -> None:
    """A wrong ``A`` block is answered after 1 s; the blocks read after it wait for that."""
    world = qmqp_world()
    client = world.connect()
    client.send(
        mail("early", "a@ok.example")
        + WRONG_AUTH_REQUEST
        + mail("refused", "a@ok.example")
        + AUTH_REQUEST
        + mail("late", "a@ok.example")
    )
    (early,) = client.blocks()
    assert isinstance(early, qmqp.ReplyBlock) and early.status == qmqp.D
    assert client.transport.producerState == "paused"
    world.clock.advance(0.999)
    assert client.blocks() == []
    world.clock.advance(0.001)
    refused_auth, refused, auth, late = client.blocks()
    assert refused_auth == qmqp.AuthReplyBlock(success=False)
    assert isinstance(refused, qmqp.ReplyBlock) and refused.status == qmqp.D
    assert auth == qmqp.AuthReplyBlock(success=True)  # its wait was over: checked at once
    assert late == qmqp.ReplyBlock(id=b"late", status=qmqp.K, description=b"", pending=0)
    assert client.transport.producerState == "producing"
    assert world.sample("msggateway_login_failures_total") == 1


def test_qmqp_a_hundred_wrong_a_blocks_get_three_answers_then_a_close() -> None:
    """The issue's 100 wrong ``A`` blocks in one write: refused at 1 s, 3 s and 7 s, then closed."""
    world = qmqp_world()
    client = world.connect()
    client.send(WRONG_AUTH_REQUEST * 100 + mail("after", "a@ok.example"))
    answered = []
    for at in (1.0, 3.0, 7.0):
        world.clock.advance(at - world.clock.seconds() - 0.001)
        assert client.blocks() == []
        world.clock.advance(0.001)
        answered.append(client.blocks())
    assert answered == [[qmqp.AuthReplyBlock(success=False)]] * 3
    assert client.transport.disconnecting
    assert world.sample("msggateway_login_failures_total") == 3
    world.clock.advance(60)
    assert client.blocks() == []  # nothing more: not even the message block after them


def test_qmqp_the_right_password_on_another_connection_waits_its_turn() -> None:
    """A refusal due at 1 s: the right ``A`` block on a second connection is answered then."""
    world = qmqp_world()
    guesser, owner = world.connect(), world.connect()
    guesser.send(WRONG_AUTH_REQUEST)
    world.clock.advance(0.5)
    owner.send(AUTH_REQUEST + mail("m", "a@ok.example"))
    assert owner.blocks() == []
    world.clock.advance(0.5)
    assert guesser.blocks() == [qmqp.AuthReplyBlock(success=False)]
    assert owner.blocks() == [
        qmqp.AuthReplyBlock(success=True),
        qmqp.ReplyBlock(id=b"m", status=qmqp.K, description=b"", pending=0),
    ]


# --- DMP: leases and principal logins ----------------------------------------------------


def dmp_listener() -> DMPListener:
    """The listener of test_dmp_server (lease ``W-1`` writes to sink orders), the policy above."""
    listener = DMPListener()
    listener.factory.login_failures = POLICY
    return listener


def codes(answers: list[object]) -> list[object]:
    """The status codes of DMP dialog responses."""
    return [getattr(answer, "code", None) for answer in answers]


def test_dmp_bad_leases_are_answered_late_and_a_good_one_waits_its_turn() -> None:
    """402 for a bad lease after 1 s (then 2 s); a good lease sent meanwhile opens at 1 s."""
    listener = dmp_listener()
    _protocol, bad, answers = listener.opened(b"guess")
    assert codes(answers) == [200]  # the header's; the lease waits
    assert bad.producerState == "paused"
    listener.clock.advance(0.5)
    _protocol, good, answers = listener.opened(b"W-1")
    assert codes(answers) == [200]
    listener.clock.advance(0.5)
    assert codes(read(bad)) == [402] and bad.disconnecting
    assert read(good) == [dmp.Response(200, 'Ready to write to "orders"', "OK")]
    _protocol, again, answers = listener.opened(b"guess-again")
    listener.clock.advance(1.999)
    assert read(again) == []
    listener.clock.advance(0.001)
    assert codes(read(again)) == [402]
    assert listener.sample("msggateway_login_failures_total") == 2


def test_dmp_principal_refusal_waits_and_says_nothing_of_which_check_failed() -> None:
    """A wrong secret: Connection.Close 403 after 1 s; the log has the peer and the identity."""
    listener = PrincipalListener()
    listener.factory.login_failures = POLICY
    protocol, transport = listener.connect()
    with capturedLogs() as events:
        protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"wrong") + TUNE_OK)
    take(transport)  # Connection.Start
    assert transport.producerState == "paused"
    listener.clock.advance(0.999)
    assert take(transport) == b""
    listener.clock.advance(0.001)
    (close,) = FrameCodec().receive_data(take(transport))
    assert isinstance(close, Method)
    assert (close.name, close.arguments["reply_code"]) == ("connection.close", 403)
    assert close.arguments["reply_text"] == "login refused for 'alice'"
    assert transport.disconnecting
    (event,) = refusals(events)
    assert (event["peer"], event["identity"], event["mechanism"]) == (
        PEER,
        "alice",
        "AMQP PLAIN",
    )


def test_dmp_principal_right_secret_waits_for_a_refusal_still_owed() -> None:
    """A refusal due at 1 s holds alice's right Start-Ok (and her Tune-Ok) till then."""
    listener = PrincipalListener()
    listener.factory.login_failures = POLICY
    guesser, guesser_transport = listener.connect()
    guesser.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"wrong"))
    listener.clock.advance(0.5)
    owner, transport = listener.connect()
    owner.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + TUNE_OK + OPEN)
    take(transport)  # Connection.Start
    assert take(transport) == b""
    listener.clock.advance(0.5)
    names = [m.name for m in FrameCodec().receive_data(take(transport)) if isinstance(m, Method)]
    assert names == ["connection.tune", "connection.open-ok"]
    assert not transport.disconnecting and guesser_transport.disconnecting
