"""The MTL upstream trusts a server only as far as its login proves it (issue 26, 9 and 13c).

With SCRAM-SHA-256 the server proves that it knows the secret in its last
402 (the server-final's signature); an upstream that logs in that way
takes no 201 before that proof, and no reply its request cannot have. A
Connection.Open unanswered over CURVE says what the handshakes showed.

The control socket is a recorder; the server's replies are handed to the
upstream as its REQ socket would; time is a `Clock`. The server's SCRAM
messages come from the listener's own `ScramServer`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from gateway.codecs.scram import ScramServer
from gateway.core.auth import Secrets
from gateway.core.router import Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.client import MTLUpstream
from gateway.protocols.mtl.settings import MTLUpstreamSettings

SECRET = b"s3cret"
OPEN = {"protocol": {"name": "MTL", "version": 1}}


class Control:
    """Records the requests the upstream sends on its REQ socket."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send(self, frames: list[bytes]) -> bool:
        """Record one request."""
        self.sent.append(frames)
        return True

    def commands(self) -> list[str]:
        """The commands sent, in order."""
        return [frames[0].decode() for frames in self.sent]

    def response(self) -> bytes:
        """The SASL response of the last Connection.Authorize."""
        body = json.loads(self.sent[-1][1])
        return base64.b64decode(body["response"])


def upstream(
    mechanism: str = "SCRAM-SHA-256", curve_server_key: bytes | None = None
) -> tuple[MTLUpstream, Clock, Control, GatewayMetrics]:
    """A writer upstream that logs in as ``gw``, its Connection.Open sent."""
    clock = Clock()
    metrics = GatewayMetrics()
    up = MTLUpstream(
        name="far",
        settings=MTLUpstreamSettings(
            mode="writer",
            profile="test",
            confirm="none",
            username="gw",
            mechanism=mechanism,
            curve_server_key=curve_server_key,
        ),
        host="127.0.0.1",
        port=1,
        router=Router(bind_routes([], {}), clock),
        secrets=Secrets(upstreams={"far": SECRET}),
        clock=clock,
        reactor=clock,
        metrics=metrics,
    )
    control = Control()
    up._running = True
    up._control = control
    up._request("Connection.Open", OPEN)
    return up, clock, control, metrics


def reply(up: MTLUpstream, status: int, body: dict[str, Any]) -> None:
    """One reply of the server."""
    up._on_reply([b"%d" % status, json.dumps(body).encode()])


def challenge(up: MTLUpstream, blob: bytes) -> None:
    """A 402 Challenged carrying ``blob``."""
    reply(
        up,
        402,
        {
            "status": "Challenged",
            "mechanism": "SCRAM-SHA-256",
            "challenge": base64.b64encode(blob).decode(),
        },
    )


def unauthorized(up: MTLUpstream) -> None:
    """401 with SCRAM-SHA-256 offered."""
    reply(up, 401, {"status": "Unauthorized", "mechanisms": ["SCRAM-SHA-256", "PLAIN"]})


def ready(up: MTLUpstream) -> None:
    """201 Ready."""
    reply(up, 201, {"status": "Ready", "profiles": ["test"]})


def not_trusted(metrics: GatewayMetrics) -> float | None:
    """How many times the upstream refused a server that did not prove itself."""
    return metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "far", "kind": "server-not-verified"}
    )


def test_a_201_right_after_the_client_first_message_is_refused() -> None:
    """The fake server of issue 26: 201 after client-first. No Profile, no lease: start over."""
    up, clock, control, metrics = upstream()
    unauthorized(up)
    assert control.commands() == ["Connection.Open", "Connection.Authorize"]
    assert control.response().startswith(b"n,,n=gw,r=")
    with capturedLogs() as events:
        ready(up)
    assert control.commands() == ["Connection.Open", "Connection.Authorize"]
    assert not up.connected and up._data is None
    assert not_trusted(metrics) == 1
    [error] = [e for e in events if "server not trusted" in e["log_format"]]
    assert "before proving that it knows the secret" in error["why"]
    assert "nothing is sent to it" in error["why"]
    assert any("starting over" in e["log_format"] for e in events)
    assert [call.func for call in clock.getDelayedCalls()] == [up._begin]  # with backoff


def test_a_201_to_open_is_refused_when_the_login_is_scram() -> None:
    """A server that asks no login has proved nothing: with SCRAM configured, refused too."""
    up, _clock, control, metrics = upstream()
    ready(up)
    assert control.commands() == ["Connection.Open"]
    assert not_trusted(metrics) == 1


def test_a_201_after_the_client_final_without_the_server_final_is_refused() -> None:
    """The server skips its last 402 (the server-final, its proof): refused."""
    up, _clock, control, metrics = upstream()
    server = ScramServer(lambda user: SECRET)
    unauthorized(up)
    challenge(up, server.first(control.response()))
    assert control.commands()[-1] == "Connection.Authorize"
    server.final(control.response())  # the proof checks out; the server keeps its own
    ready(up)
    assert control.commands() == ["Connection.Open"] + ["Connection.Authorize"] * 2
    assert not_trusted(metrics) == 1


def test_a_server_that_proves_itself_is_trusted() -> None:
    """The whole exchange, server-final verified: the 201 leads on to Connection.Profile."""
    up, _clock, control, metrics = upstream()
    server = ScramServer(lambda user: SECRET)
    unauthorized(up)
    challenge(up, server.first(control.response()))
    challenge(up, server.final(control.response()))
    assert control.response() == b""  # the server-final acknowledged
    ready(up)
    assert control.commands()[-1] == "Connection.Profile"
    assert not_trusted(metrics) is None


def test_a_server_final_with_a_wrong_signature_starts_over() -> None:
    """A server that does not know the secret cannot sign: nothing more is sent."""
    up, _clock, control, _metrics = upstream()
    impostor = ScramServer(lambda user: b"a guess")
    unauthorized(up)
    challenge(up, impostor.first(control.response()))
    impostor_final = b"v=" + base64.b64encode(b"\0" * 32)
    with capturedLogs() as events:
        challenge(up, impostor_final)
    assert control.commands() == ["Connection.Open"] + ["Connection.Authorize"] * 2
    assert any("SCRAM-SHA-256 login failed" in e.get("why", "") for e in events)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (202, {"status": "Data Lease", "port": 5556, "lease": "x"}),
        (200, {"status": "OK"}),
    ],
)
def test_a_reply_the_request_cannot_have_starts_over(status: int, body: dict[str, Any]) -> None:
    """A 202 or 200 to Connection.Authorize is out of turn: no data socket, start over."""
    up, _clock, control, _metrics = upstream()
    unauthorized(up)
    with capturedLogs() as events:
        reply(up, status, body)
    assert up._data is None and not up.connected
    assert control.commands() == ["Connection.Open", "Connection.Authorize"]
    assert any(f"connection.authorize answered {status}" in e.get("why", "") for e in events)


def test_plain_takes_a_201_to_open() -> None:
    """PLAIN authenticates only the client: a server that asks no login is taken at its word."""
    up, _clock, control, metrics = upstream("PLAIN")
    ready(up)
    assert control.commands() == ["Connection.Open", "Connection.Profile"]
    assert not_trusted(metrics) is None


@pytest.mark.parametrize(
    ("seen", "hint"),
    [
        ({"failed": 3}, "failed 3 time(s), the server dropping it: curve_server_key is probably"),
        ({"refused": 1, "failed": 1}, "the server refused this client's CURVE key"),
        ({}, "no CURVE handshake completed"),
    ],
)
def test_an_open_unanswered_over_curve_says_the_server_key_may_be_wrong(
    seen: dict[str, int], hint: str
) -> None:
    """After the request time-out, the log says what the CURVE handshakes showed; counted."""
    up, clock, _control, metrics = upstream("PLAIN", curve_server_key=b"k" * 40)
    up._handshakes = dict(seen)
    with capturedLogs() as events:
        clock.advance(up.settings.request_timeout_seconds)
    [over] = [e for e in events if "starting over" in e["log_format"]]
    assert over["why"].startswith("no answer to Connection.Open in 10 s: ")
    assert hint in over["why"]
    counted = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "far", "kind": "no-curve-handshake"}
    )
    assert counted == 1
