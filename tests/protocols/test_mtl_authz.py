"""MTL allow-lists: `gateway.protocols.mtl.server` with an ``authorize`` table.

The listener of `tests.protocols.test_mtl_server` with recorded sockets. The
identity is the session's SASL login; a Connection.Writer naming a resource
the identity may not publish to, or a Connection.Reader one it may not
consume from, is answered ``403 Forbidden``; a lease for "any and all
resources" is checked at each Summon (Response 403) and Content (Reject).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.internet.task import Clock

from gateway.codecs import mtl
from gateway.core.auth import Secrets
from gateway.core.authorization import Authorization
from gateway.core.router import Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.mtl.server import MTLServer
from gateway.protocols.mtl.settings import MTLListenerSettings
from tests.protocols.test_mtl_server import Sent, data

AUTHZ = Authorization.from_lists({"app": (("news", "news.#"), ())})


def _server(metrics: GatewayMetrics | None = None) -> tuple[MTLServer, Sent, Sent]:
    clock = Clock()
    listener = MTLServer(
        name="mtl",
        settings=MTLListenerSettings(require_auth=True),
        host="127.0.0.1",
        port=0,
        router=Router(bind_routes([], {}), clock),
        secrets=Secrets(logins={"app": b"pw"}),
        clock=clock,
        reactor=clock,
        metrics=metrics,
    )
    listener.authorization = AUTHZ
    control, sent = Sent(), Sent()
    listener._control, listener._data = control, sent
    return listener, control, sent


def _ask(listener: MTLServer, control: Sent, command: str, body: dict[str, Any]) -> tuple[int, Any]:
    listener._on_control([b"peer", b"", *mtl.request(command, body)])
    status, answer = control.messages[-1][2:]
    return int(status), json.loads(answer)


def _logged_in(listener: MTLServer, control: Sent) -> None:
    _ask(listener, control, "Connection.Open", {"protocol": {"name": "MTL", "version": 1}})
    response = base64.b64encode(b"\0app\0pw").decode()
    status, _ = _ask(
        listener, control, "Connection.Authorize", {"mechanism": "PLAIN", "response": response}
    )
    assert status == 201
    assert _ask(listener, control, "Connection.Profile", {"profile": "gateway"})[0] == 200


def test_writer_allowed_reader_forbidden() -> None:
    """``app`` gets a writer lease for news, and 403 Forbidden for a reader of news."""
    metrics = GatewayMetrics()
    listener, control, _ = _server(metrics)
    _logged_in(listener, control)
    status, _ = _ask(listener, control, "Connection.Writer", {"resources": ["news"]})
    assert status == 202
    status, body = _ask(listener, control, "Connection.Reader", {"resources": ["news"]})
    assert (status, body) == (403, {"status": "Forbidden", "reason": "app may not consume 'news'"})
    status, _ = _ask(listener, control, "Connection.Writer", {"resources": ["weather"]})
    assert status == 403
    errors = {
        kind: metrics.registry.get_sample_value(
            "msggateway_protocol_errors_total", {"endpoint": "mtl", "kind": kind}
        )
        for kind in ("forbidden-consume", "forbidden-publish")
    }
    assert errors == {"forbidden-consume": 1, "forbidden-publish": 1}


def test_lease_for_any_resource_is_checked_per_summon_and_content() -> None:
    """A reader lease for all resources: Summon news gets 403; writer content elsewhere a Reject."""
    listener, control, sent = _server()
    _logged_in(listener, control)
    _, reader = _ask(listener, control, "Connection.Reader", {"resources": []})
    _, writer = _ask(listener, control, "Connection.Writer", {"resources": [], "confirm": "full"})
    data(listener, b"r", mtl.Lease(1, reader["lease"]))
    data(listener, b"r", mtl.Summon(2, "news"))
    data(listener, b"w", mtl.Lease(1, writer["lease"]))
    data(listener, b"w", mtl.Content(2, "weather", {}, b"x"))
    answers = [(frames[0], mtl.decode_data(frames[1:])) for frames in sent.messages]
    assert answers == [
        (b"r", mtl.Response(1, 200)),
        (b"r", mtl.Response(2, 403)),
        (b"w", mtl.Response(1, 200)),
        (b"w", mtl.Reject(2, False, False)),
    ]


def test_unauthenticated_session_gets_nothing() -> None:
    """Without a login (require_auth off) the session has no identity: 403."""
    listener, control, _ = _server()
    listener.settings = MTLListenerSettings(require_auth=False)
    _ask(listener, control, "Connection.Open", {"protocol": {"name": "MTL", "version": 1}})
    _ask(listener, control, "Connection.Profile", {"profile": "gateway"})
    status, body = _ask(listener, control, "Connection.Writer", {"resources": ["news"]})
    assert status == 403
    assert body["reason"] == "an unauthenticated client may not publish 'news'"
