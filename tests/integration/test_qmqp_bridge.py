"""Two gateways joined by a QMQP upstream route, and SSMP topics as mail.

Gateway A (far) answers K, Z or D by recipient domain: ``ok.example`` goes
to its SSMP hub (K), ``down.example`` to an SSMP server that is not there
(Z), anything else has no route (D). Gateway B (near) streams everything it
receives over QMQP to A, and turns MCASTs on its ``mail.out`` topic into
mail to ``ops@ok.example``. B's clients see A's answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

FAR = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.nowhere]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port=1"
identity = "far"
scheme = "open"
"""

FAR_ROUTES = {
    "ok": 'from = "qmqp"\nmatch = "#@ok.example"\nto = "hub"\naddress = "mail.{1}"\n'
    'body = "subject"\n',
    "down": 'from = "qmqp"\nmatch = "#@down.example"\nto = "nowhere"\nbody = "subject"\n',
}

NEAR = """
[gateway]
routes = "routes"

[admin]
enabled = false

[listeners.qmqp]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[upstreams.far]
protocol = "qmqp"
endpoint = "tcp:host=127.0.0.1:port={port}"
retry_initial_seconds = 0.05
max_attempts = 2
"""

NEAR_ROUTES = {
    "all-to-far": 'from = "qmqp"\nmatch = "#"\nto = "far"\n',
    "topic-to-mail": 'from = "hub"\nmatch = "mail.out"\nto = "far"\n'
    'recipients = ["ops@ok.example"]\nenvelope_sender = "gateway@near.example"\n'
    'body = "rfc822"\n',
}


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """The far gateway, and the near one connected to it over QMQP."""
    far = GatewayProcess(tmp_path / "far", FAR, routes=FAR_ROUTES).start()
    try:
        _, port = far.address("qmqp")
        near = GatewayProcess(tmp_path / "near", NEAR.format(port=port), routes=NEAR_ROUTES).start()
        try:
            near.wait_for_log("upstream far: connected")
            yield far, near
        finally:
            near.stop()
    finally:
        far.stop()


def test_near_client_sees_the_far_answers(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """K, Z and D from the far gateway reach the near gateway's QMQP client."""
    far, near = gateways
    client = QMQPSession(near.address("qmqp"))
    try:
        with LineClient(far.address("hub")) as watcher:
            watcher.send("LOGIN watcher open", "SUBSCRIBE mail.ops")
            watcher.expect("200")
            watcher.expect("200")
            client.send(
                mail("ok", "ops@ok.example", subject="all good")
                + mail("down", "ops@down.example")
                + mail("nowhere", "ops@nowhere.example")
                + b"1:D,"
            )
            blocks = client.read_blocks(4)
            watcher.expect("000 app@example.org MCAST mail.ops all good")
    finally:
        client.close()
    replies = {block.id: block for block in blocks if isinstance(block, qmqp.ReplyBlock)}
    assert blocks[-1] == qmqp.DoneBlock()
    assert replies[b"ok"].status == qmqp.K
    assert replies[b"down"].status == qmqp.Z
    assert replies[b"down"].description.startswith(b"far answered Z: ")
    assert b"nowhere is not connected" in replies[b"down"].description
    assert replies[b"nowhere"].status == qmqp.D
    assert replies[b"nowhere"].description == (
        b"far answered D: no route for recipient ops@nowhere.example"
    )


def test_topic_to_mail(gateways: tuple[GatewayProcess, GatewayProcess]) -> None:
    """An MCAST on the near hub becomes mail on the far side; its 200 waits for the K."""
    far, near = gateways
    with (
        LineClient(far.address("hub")) as watcher,
        LineClient(near.address("hub")) as publisher,
    ):
        watcher.send("LOGIN watcher2 open", "SUBSCRIBE mail.ops")
        watcher.expect("200")
        watcher.expect("200")
        publisher.send("LOGIN monitor open", "MCAST mail.out disk full on db1")
        publisher.expect("200")
        publisher.expect("200")  # after the far gateway answered K
        # The far hub publishes the mail's Subject, which rfc822 set to the
        # source topic, from the route's envelope sender.
        watcher.expect("000 gateway@near.example MCAST mail.ops mail.out")
