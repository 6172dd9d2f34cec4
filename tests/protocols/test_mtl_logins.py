"""Refused MTL logins wait, and a session that keeps guessing is closed (issue 26).

The listener's control socket is replaced by a recorder that also says
which address the request being handled came from (ZeroMQ's Peer-Address);
time is a `Clock`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs import mtl
from gateway.codecs.scram import ScramClient
from gateway.core.auth import LoginFailurePolicy, Secrets
from gateway.core.router import Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings

POLICY = LoginFailurePolicy(
    delay_seconds=1.0, max_delay_seconds=4.0, per_connection=3, reset_seconds=600.0
)
OPEN = ("Connection.Open", {"protocol": {"name": "MTL", "version": 1}})


class Control:
    """Records the control socket's sends; ``peer_address`` is the requester's address."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self.peer_address: str | None = "192.0.2.9"

    def send(self, frames: list[bytes]) -> bool:
        """Record one reply."""
        self.sent.append(frames)
        return True

    def replies(self, peer: bytes) -> list[tuple[int, dict[str, Any]]]:
        """The replies sent to one peer, decoded."""
        return [
            (int(frames[2]), json.loads(frames[3])) for frames in self.sent if frames[0] == peer
        ]


def listener(
    mechanisms: tuple[str, ...] = ("PLAIN",),
) -> tuple[MTLServer, Clock, Control, GatewayMetrics]:
    """An MTL listener requiring SASL, alice's secret ``right``, the policy above."""
    clock = Clock()
    metrics = GatewayMetrics()
    server = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(
            require_auth=True, mechanisms=mechanisms, ping_interval_seconds=0
        ),
        host="127.0.0.1",
        port=0,
        router=Router(bind_routes([], {}), clock),
        secrets=Secrets(logins={"alice": b"right"}),
        clock=clock,
        reactor=clock,
        metrics=metrics,
    )
    server.login_failures = POLICY
    control = Control()
    server._control = control
    server._zmq = object()  # started, as far as the delayed answers are concerned
    return server, clock, control, metrics


def ask(server: MTLServer, peer: bytes, command: str, body: dict[str, Any]) -> None:
    """One request from a REQ peer."""
    server._on_control([peer, b"", *mtl.request(command, body)])


def plain(password: bytes, user: bytes = b"alice") -> tuple[str, dict[str, Any]]:
    """A PLAIN Connection.Authorize."""
    response = base64.b64encode(b"\0" + user + b"\0" + password).decode()
    return "Connection.Authorize", {"mechanism": "PLAIN", "response": response}


def failures(metrics: GatewayMetrics) -> float:
    """``msggateway_login_failures_total`` of the listener."""
    value = metrics.registry.get_sample_value(
        "msggateway_login_failures_total", {"endpoint": "mtl"}
    )
    return value or 0.0


def test_refusals_wait_longer_each_time_and_the_third_closes_the_session() -> None:
    """401 after 1 s, then 2 s, then 4 s; the third ends the session; each counted and logged."""
    server, clock, control, metrics = listener()
    ask(server, b"p", *OPEN)
    seen = []
    with capturedLogs() as events:
        for expected_wait in (1.0, 2.0, 4.0):
            ask(server, b"p", *plain(b"wrong"))
            before = len(control.replies(b"p"))
            clock.advance(expected_wait - 0.01)
            assert len(control.replies(b"p")) == before  # not yet
            clock.advance(0.01)
            seen.append(control.replies(b"p")[-1])
    assert [status for status, _ in seen] == [401, 401, 401]
    assert "send Connection.Open" in seen[-1][1]["reason"]
    assert failures(metrics) == 3
    refusals = [e for e in events if "login refused" in e.get("log_format", "")]
    assert [e["peer"] for e in refusals] == ["192.0.2.9"] * 3
    assert [e["identity"] for e in refusals] == ["alice"] * 3
    ask(server, b"p", *plain(b"right"))  # the session is closed: Open first
    assert control.replies(b"p")[-1][1]["reason"] == "send Connection.Open first"


def test_a_login_while_a_refusal_is_owed_is_refused_unchecked_then_passes() -> None:
    """A refusal is owed to the address: another session's right password is refused then.

    It is not checked (401 once the owed wait is over, counted, logged as
    unchecked); asked again after that answer, it is checked and accepted.
    """
    server, clock, control, metrics = listener()
    for peer in (b"guesser", b"owner"):
        ask(server, peer, *OPEN)
    ask(server, b"guesser", *plain(b"wrong"))
    clock.advance(0.5)
    with capturedLogs() as events:
        ask(server, b"owner", *plain(b"right"))
    assert [status for status, _ in control.replies(b"owner")] == [401]  # Open's only
    clock.advance(0.5)
    status, reply = control.replies(b"owner")[-1]
    assert status == 401 and "not checked" in reply["reason"]
    assert [status for status, _ in control.replies(b"guesser")] == [401, 401]
    (event,) = [e for e in events if "login refused" in e.get("log_format", "")]
    assert event["why"].startswith("not checked")
    assert failures(metrics) == 2
    ask(server, b"owner", *plain(b"right"))
    assert control.replies(b"owner")[-1][0] == 201


def test_requests_while_an_answer_waits_are_dropped() -> None:
    """A peer that does not wait for its answer (no REQ socket does) gets nothing for it."""
    server, clock, control, _metrics = listener()
    ask(server, b"p", *OPEN)
    ask(server, b"p", *plain(b"wrong"))
    for _ in range(50):
        ask(server, b"p", *plain(b"right"))
    clock.advance(1.0)
    assert [status for status, _ in control.replies(b"p")] == [401, 401]


def test_a_wrong_scram_proof_waits_too() -> None:
    """SCRAM-SHA-256: the 401 for a wrong proof comes after the delay; the challenges do not."""
    server, clock, control, metrics = listener(("SCRAM-SHA-256",))
    ask(server, b"p", *OPEN)
    client = ScramClient("alice", b"wrong")
    first = base64.b64encode(client.first()).decode()
    ask(server, b"p", "Connection.Authorize", {"mechanism": "SCRAM-SHA-256", "response": first})
    status, reply = control.replies(b"p")[-1]
    assert status == 402
    final = client.final(base64.b64decode(reply["challenge"]))
    ask(
        server,
        b"p",
        "Connection.Authorize",
        {"mechanism": "SCRAM-SHA-256", "response": base64.b64encode(final).decode()},
    )
    assert len(control.replies(b"p")) == 2
    clock.advance(1.0)
    assert control.replies(b"p")[-1][0] == 401
    assert failures(metrics) == 1
