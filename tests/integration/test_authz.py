"""Certificate identities and allow-lists end to end, under twistd.

One gateway serves QMQP, the stream protocol, SSMP and DMP on ``mtls:`` endpoints that
require a client certificate from the test CA, each listener with an
``authorize`` table for alice (the certificate's Common Name). Over QMQP her
certificate stands in for the ``A`` block (``require_auth`` is on) and a
recipient outside her domains is answered ``D``; over the stream protocol
she logs in with SASL EXTERNAL and may publish to ``orders`` but her
Subscribe is answered 16, Access refused; over SSMP she logs in with
``cert`` and may MCAST but her SUBSCRIBE gets 405; over DMP a lease bound to
her opens the sink, one bound to bob is 402 and the feed she may not
consume is 403. The refusals show in /metrics.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import pytest

from gateway.codecs import qmqp
from gateway.codecs import stream as sp
from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mail]
protocol = "qmqp"
endpoint = "{tls}"
require_auth = true

[listeners.mail.authorize.alice]
publish = ["example.org"]

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.streams]
protocol = "stream"
endpoint = "{tls}"

[listeners.streams.authorize.alice]
publish = ["orders"]

[listeners.chat]
protocol = "ssmp"
endpoint = "{tls}"

[listeners.chat.authorize.alice]
publish = ["news.*"]

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["orders"]
feeds = ["alerts"]

[listeners.dmp.leases.alice-writer]
sink = "orders"
text = "AW"
identity = "alice"

[listeners.dmp.leases.bob-writer]
sink = "orders"
text = "BW"
identity = "bob"

[listeners.dmp.leases.reader]
feed = "alerts"
text = "R"

[listeners.dmp.authorize.alice]
publish = ["orders"]
"""

ROUTES = {
    # Both domains have a route, so a D for other.org comes from the allow-list.
    "mail": 'from = "mail"\nmatch = "#"\nto = "hub"\naddress = "mail"\nbody = "subject"\n',
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """QMQP and stream listeners over TLS with allow-lists for alice."""
    tls = mtls_endpoint(pki, "required")
    process = GatewayProcess(
        tmp_path_factory.mktemp("authz"), CONFIG.format(tls=tls), routes=ROUTES
    ).start()
    yield process
    process.stop()


def _alice(gateway: GatewayProcess, pki: Pki, listener: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    raw = socket.create_connection(gateway.address(listener), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="localhost")


def _errors(gateway: GatewayProcess, listener: str, kind: str) -> float:
    text = gateway.metrics()
    wanted = f'msggateway_protocol_errors_total{{endpoint="{listener}",kind="{kind}"}} '
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line[len(wanted) :])
    return 0.0


def test_qmqp_certificate_stands_in_for_a_and_other_domains_get_d(
    gateway: GatewayProcess, pki: Pki
) -> None:
    """Alice's certificate is her login; example.org is hers (K), other.org is not (D)."""
    blocks = [
        qmqp.MessageBlock(
            id=i, message=b"Subject: hi\n\nx\n", sender=b"a@example.org", recipients=(r,)
        )
        for i, r in ((b"mine", b"bob@example.org"), (b"theirs", b"carol@other.org"))
    ]
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    replies: dict[bytes, qmqp.ReplyBlock] = {}
    with _alice(gateway, pki, "mail") as tls:
        tls.sendall(b"".join(map(qmqp.encode, blocks)) + qmqp.encode(qmqp.DoneBlock()))
        while True:
            data = tls.recv(65536)
            if not data:
                break
            for block in codec.receive_data(data):
                if isinstance(block, qmqp.ReplyBlock):
                    replies[block.id] = block
    assert replies[b"mine"].status == qmqp.K, replies
    assert replies[b"theirs"].status == qmqp.D
    assert replies[b"theirs"].description == b"alice may not send to recipient domain other.org"
    assert _errors(gateway, "mail", "forbidden-publish") == 1


def test_stream_external_identity_publishes_but_subscribe_is_refused(
    gateway: GatewayProcess, pki: Pki
) -> None:
    """EXTERNAL logs alice in; Create and DeclarePublisher on orders are OK, Subscribe is 16."""
    codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
    events: list[sp.Event] = []
    with _alice(gateway, pki, "streams") as tls:

        def ask(event: sp.Event) -> sp.Event:
            tls.sendall(codec.send(event))
            while not events:
                data = tls.recv(65536)
                assert data, "closed"
                events.extend(codec.receive_data(data))
            return events.pop(0)

        ask(sp.PeerProperties(correlation_id=1, properties={}))
        ask(sp.SaslHandshake(correlation_id=2))
        login = ask(sp.SaslAuthenticate(correlation_id=3, mechanism="EXTERNAL", data=b""))
        assert isinstance(login, sp.SaslAuthenticateResponse) and login.code == 1
        tune = events.pop(0) if events else ask(sp.Tune(frame_max=0, heartbeat=0))
        assert isinstance(tune, sp.Tune)
        tls.sendall(codec.send(sp.Tune(frame_max=0, heartbeat=0)))
        opened = ask(sp.Open(correlation_id=4, virtual_host="/"))
        assert isinstance(opened, sp.OpenResponse) and opened.code == 1
        created = ask(sp.Create(correlation_id=5, stream="orders"))
        assert isinstance(created, sp.Response) and created.code == 1
        declared = ask(
            sp.DeclarePublisher(correlation_id=6, publisher_id=1, reference="", stream="orders")
        )
        assert isinstance(declared, sp.Response) and declared.code == 1
        refused = ask(
            sp.Subscribe(
                correlation_id=7,
                subscription_id=1,
                stream="orders",
                offset_spec=sp.OffsetSpec(kind=sp.OffsetKind.FIRST),
                credit=10,
                properties={},
            )
        )
        assert isinstance(refused, sp.Response)
        assert refused.code == sp.ResponseCode.ACCESS_REFUSED == 16
    assert _errors(gateway, "streams", "forbidden-consume") == 1


def test_ssmp_cert_login_may_publish_but_subscribe_is_405(
    gateway: GatewayProcess, pki: Pki
) -> None:
    """LOGIN alice cert; MCAST to news.paris is 200, SUBSCRIBE news.paris is 405."""
    with _alice(gateway, pki, "chat") as tls:
        tls.sendall(b"LOGIN alice cert\nMCAST news.paris hi\nSUBSCRIBE news.paris\n")
        answers = b""
        while answers.count(b"\n") < 3:
            data = tls.recv(4096)
            assert data, answers
            answers += data
    assert answers == b"200\n200\n405 not allowed to consume news.paris\n"
    assert _errors(gateway, "chat", "forbidden-consume") == 1


def _dmp(gateway: GatewayProcess, pki: Pki, lease: bytes) -> list[bytes]:
    """Open a DMP connection with alice's certificate and a lease: the two responses."""
    with _alice(gateway, pki, "dmp") as tls:
        tls.sendall(b"AMQP\x0a\x01\x00\x01" + bytes((len(lease),)) + lease)
        data = b""
        while True:
            # The second response may come later than the first (a refused lease waits).
            if data and len(data) > 1 + data[0] and len(data) >= 2 + data[0] + data[1 + data[0]]:
                break
            more = tls.recv(4096)
            if not more:
                break
            data += more
    first = data[1 : 1 + data[0]]
    rest = data[1 + data[0] :]
    return [first, rest[1 : 1 + rest[0]]]


def test_dmp_leases_bound_to_the_certificate_identity(gateway: GatewayProcess, pki: Pki) -> None:
    """Alice's lease opens the sink; bob's is 402 BAD-LEASE; the feed is 403 NO-ACCESS."""
    assert _dmp(gateway, pki, b"AW")[1].startswith(b"200 OK Ready to write")
    assert _dmp(gateway, pki, b"BW")[1].startswith(b"402 BAD-LEASE")
    assert _dmp(gateway, pki, b"R")[1].startswith(b"403 NO-ACCESS")
    assert _errors(gateway, "dmp", "forbidden-consume") == 1
