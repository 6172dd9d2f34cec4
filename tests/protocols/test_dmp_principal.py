"""Tests for `gateway.protocols.dmp.principal`: leases over a principal AMQP 0-9-1 connection.

The client side is written from the AMQP 0-9-1 grammar with `struct` (frame
type, channel, size, class and method ids, strings), not with our encoder;
what the listener writes is read with the frame codec. The lease obtained
then opens a DMP connection on the same listener.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.test import iosim
from zope.interface import implementer

from gateway.codecs import dmp
from gateway.codecs.amqp091 import PROTOCOL_HEADER, FrameCodec, HeartbeatFrame, Method
from gateway.core.auth import Secrets
from gateway.core.router import Router, bind_routes
from gateway.metrics import GatewayMetrics
from gateway.protocols.dmp.client import DMPClientProtocol, DMPUpstream
from gateway.protocols.dmp.lease_request import LeaseRequest, LeaseRequestError
from gateway.protocols.dmp.server import DMPServerFactory, DMPServerProtocol
from gateway.protocols.dmp.settings import DMPListenerSettings, DMPUpstreamSettings
from tests.doubles import NO_LOGIN_WAIT

SETTINGS = DMPListenerSettings(
    sinks=frozenset({"orders"}),
    feeds=frozenset({"alerts"}),
    principals=frozenset({"alice"}),
    principal_lease_seconds=30.0,
)
SECRETS = Secrets(logins={"alice": b"pw-a", "bob": b"pw-b"})


def short(text: bytes) -> bytes:
    """An AMQP short string."""
    return bytes((len(text),)) + text


def frame(channel: int, class_id: int, method_id: int, arguments: bytes = b"") -> bytes:
    """A method frame, from the 0-9-1 grammar."""
    payload = struct.pack(">HH", class_id, method_id) + arguments
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def start_ok(identity: bytes, password: bytes, mechanism: bytes = b"PLAIN") -> bytes:
    """Connection.Start-Ok: empty client properties, the mechanism, the PLAIN response."""
    response = b"\0" + identity + b"\0" + password
    arguments = b"\0\0\0\0" + short(mechanism) + struct.pack(">I", len(response)) + response
    return frame(0, 10, 11, arguments + short(b"en_US"))


TUNE_OK = frame(0, 10, 31, struct.pack(">HIH", 16, 4096, 0))
OPEN = frame(0, 10, 40, short(b"/") + short(b"") + b"\0")
CHANNEL_OPEN = frame(1, 20, 10, short(b""))


def put(name: bytes, channel: int = 1) -> bytes:
    """Direct.Put."""
    return frame(channel, 61500, 10, short(name))


def get(name: bytes, channel: int = 1) -> bytes:
    """Direct.Get."""
    return frame(channel, 61500, 20, short(name))


class Listener:
    """A DMP listener with principals, on in-memory connections."""

    def __init__(self, settings: DMPListenerSettings = SETTINGS) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.metrics = GatewayMetrics()
        self.factory = DMPServerFactory(
            name="dmp",
            settings=settings,
            router=Router(bind_routes([], {}), self.clock, self.metrics),
            secrets=SECRETS,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.factory.login_failures = NO_LOGIN_WAIT  # test_logins.py tests the waits

    def connect(self) -> tuple[DMPServerProtocol, StringTransport]:
        """A new connection."""
        protocol = self.factory.buildProtocol(None)
        assert protocol is not None
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def logged_in(self) -> tuple[DMPServerProtocol, StringTransport, FrameCodec]:
        """A principal connection logged in as alice with channel 1 open."""
        protocol, transport = self.connect()
        protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + TUNE_OK + OPEN)
        protocol.dataReceived(CHANNEL_OPEN)
        codec = FrameCodec()
        names = [m.name for m in codec.receive_data(take(transport))]  # type: ignore[union-attr]
        assert names == [
            "connection.start",
            "connection.tune",
            "connection.open-ok",
            "channel.open-ok",
        ]
        return protocol, transport, codec

    def dmp_open(self, lease: str) -> tuple[StringTransport, list[dmp.Response]]:
        """Open a DMP connection with a lease; return the responses."""
        protocol, transport = self.connect()
        raw = lease.encode("ascii")
        protocol.dataReceived(dmp.PROTOCOL_HEADER + short(raw))
        codec = dmp.DMPCodec(dmp.Role.CLIENT)
        data = take(transport)
        first = 1 + data[0]
        responses = codec.receive_data(data[:first]) + codec.receive_data(data[first:])
        return transport, [r for r in responses if isinstance(r, dmp.Response)]


def take(transport: StringTransport) -> bytes:
    """What was written since the last call."""
    data = transport.value()
    transport.clear()
    return data


def replies(codec: FrameCodec, transport: StringTransport) -> list[Method]:
    """Decode what the listener wrote since the last read."""
    return [m for m in codec.receive_data(take(transport)) if isinstance(m, Method)]


def test_start_announces_direct_and_plain() -> None:
    """Connection.Start: version 0-9, ``direct = 1`` in server-properties, PLAIN."""
    listener = Listener()
    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER)
    [start] = FrameCodec().receive_data(take(transport))
    assert isinstance(start, Method)
    assert start.name == "connection.start"
    assert start.arguments["version_major"] == 0 and start.arguments["version_minor"] == 9
    assert start.arguments["server_properties"]["direct"] == 1
    assert start.arguments["mechanisms"] == b"PLAIN"


def test_put_lease_opens_a_sink_and_get_lease_a_feed() -> None:
    """Put-Ok and Get-Ok carry leases that the DMP dialog accepts for that sink and feed."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(put(b"orders") + get(b"alerts"))
    put_ok, get_ok = replies(codec, transport)
    assert (put_ok.name, put_ok.channel, get_ok.name) == ("direct.put-ok", 1, "direct.get-ok")
    assert put_ok.arguments["lease"] != get_ok.arguments["lease"]
    _, answers = listener.dmp_open(put_ok.arguments["lease"])
    assert answers[-1] == dmp.Response(200, 'Ready to write to "orders"', "OK")
    _, answers = listener.dmp_open(get_ok.arguments["lease"])
    assert answers[-1] == dmp.Response(200, 'Ready to read from "alerts"', "OK")
    assert not transport.disconnecting  # the principal connection stays


def test_whole_dialog_one_byte_at_a_time() -> None:
    """The client's dialog fed one octet at a time gets the same answers."""
    listener = Listener()
    protocol, transport = listener.connect()
    wire = PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + TUNE_OK + OPEN + CHANNEL_OPEN
    for index in range(len(wire + put(b"orders"))):
        protocol.dataReceived((wire + put(b"orders"))[index : index + 1])
    names = [m.name for m in FrameCodec().receive_data(take(transport))]  # type: ignore[union-attr]
    assert names[-1] == "direct.put-ok"


def test_unknown_sink_closes_the_channel_with_404() -> None:
    """Direct.Put of a sink the listener lacks: Channel.Close 404; the connection goes on."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(put(b"nope"))
    [close] = replies(codec, transport)
    assert close.name == "channel.close"
    assert (close.arguments["reply_code"], close.arguments["class_id"]) == (404, 61500)
    assert "nope" in close.arguments["reply_text"]
    protocol.dataReceived(frame(1, 20, 41) + CHANNEL_OPEN + get(b"alerts"))
    assert [m.name for m in replies(codec, transport)] == ["channel.open-ok", "direct.get-ok"]


def test_feed_with_a_reader_is_locked() -> None:
    """Direct.Get of a feed whose reader is connected: Channel.Close 405."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(get(b"alerts"))
    [get_ok] = replies(codec, transport)
    listener.dmp_open(get_ok.arguments["lease"])
    protocol.dataReceived(get(b"alerts"))
    [close] = replies(codec, transport)
    assert (close.name, close.arguments["reply_code"]) == ("channel.close", 405)


def test_lease_expires() -> None:
    """A principal lease is refused with 402 after principal_lease_seconds."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(put(b"orders"))
    [put_ok] = replies(codec, transport)
    listener.clock.advance(31)
    dmp_transport, answers = listener.dmp_open(put_ok.arguments["lease"])
    assert answers[-1].code == 402
    assert dmp_transport.disconnecting


def test_wrong_password_and_unlisted_identity_are_refused() -> None:
    """A bad secret, or an identity not in ``principals``: Connection.Close 403, then closed."""
    for identity, password in ((b"alice", b"wrong"), (b"bob", b"pw-b"), (b"eve", b"")):
        listener = Listener()
        protocol, transport = listener.connect()
        protocol.dataReceived(PROTOCOL_HEADER + start_ok(identity, password))
        _, close = FrameCodec().receive_data(take(transport))
        assert isinstance(close, Method)
        assert (close.name, close.arguments["reply_code"]) == ("connection.close", 403)
        assert transport.disconnecting


def test_other_mechanism_is_refused() -> None:
    """Only PLAIN is offered; AMQPLAIN gets 403."""
    listener = Listener()
    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a", b"AMQPLAIN"))
    _, close = FrameCodec().receive_data(take(transport))
    assert isinstance(close, Method) and close.arguments["reply_code"] == 403


def test_out_of_order_and_garbage() -> None:
    """Put before Open is 503; a broken frame is 501; each closes the connection."""
    listener = Listener()
    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER + put(b"orders"))
    _, close = FrameCodec().receive_data(take(transport))
    assert isinstance(close, Method) and close.arguments["reply_code"] == 503
    assert transport.disconnecting

    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER + b"\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00")
    _, close = FrameCodec().receive_data(take(transport))
    assert isinstance(close, Method) and close.arguments["reply_code"] == 501
    assert transport.disconnecting


def test_unopened_channel_and_unknown_method() -> None:
    """Put on a channel never opened: 504; a method we do not implement: 540."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(put(b"orders", channel=2))
    [close] = replies(codec, transport)
    assert close.arguments["reply_code"] == 504
    listener2 = Listener()
    protocol, transport, codec = listener2.logged_in()
    protocol.dataReceived(frame(1, 60, 40, b""))  # Basic.Publish
    [close] = replies(codec, transport)
    assert (close.arguments["reply_code"], close.arguments["class_id"]) == (540, 60)


def test_connection_close_is_answered() -> None:
    """Connection.Close from the client gets Close-Ok and the socket closes."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(frame(0, 10, 50, struct.pack(">H", 200) + short(b"bye") + b"\0" * 4))
    assert [m.name for m in replies(codec, transport)] == ["connection.close-ok"]
    assert transport.disconnecting


def test_handshake_timeout_until_open_then_none() -> None:
    """A principal connection that never logs in is closed; an open one is not."""
    listener = Listener()
    _, slow = listener.connect()
    _, opened, _ = listener.logged_in()
    listener.clock.advance(SETTINGS.handshake_timeout_seconds + 1)
    assert slow.disconnecting
    assert not opened.disconnecting


def test_without_principals_a_091_header_is_a_bad_dmp_header() -> None:
    """With no ``principals`` configured, AMQP 0-9-1 gets DMP's 503 INVALID."""
    listener = Listener(DMPListenerSettings(sinks=frozenset({"orders"})))
    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER)
    assert take(transport)[1:4] == b"503"
    assert transport.disconnecting


def test_other_amqp_header_gets_ours() -> None:
    """An AMQP header that is neither 0-9-1 nor DMP gets the 0-9-1 header back, then close."""
    listener = Listener()
    protocol, transport = listener.connect()
    protocol.dataReceived(b"AMQP\x00\x00\x08")
    protocol.dataReceived(b"\x00")
    assert take(transport) == PROTOCOL_HEADER
    assert transport.disconnecting


def test_dmp_still_works_split_in_the_header() -> None:
    """A DMP header cut inside its first five octets still reaches the DMP dialog."""
    listener = Listener()
    protocol, transport = listener.connect()
    for octet in dmp.PROTOCOL_HEADER:
        protocol.dataReceived(bytes((octet,)))
    assert take(transport)[1:] == b"200 OK DMP/0.1"


def test_heartbeats_when_the_client_asks_for_them() -> None:
    """Tune-Ok heartbeat 5: a heartbeat frame every 5 s; closed 2 intervals after the last frame."""
    listener = Listener()
    protocol, transport = listener.connect()
    tune_ok = frame(0, 10, 31, struct.pack(">HIH", 16, 4096, 5))
    protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + tune_ok + OPEN)
    codec = FrameCodec()
    codec.receive_data(take(transport))
    listener.clock.advance(5)
    assert codec.receive_data(take(transport)) == [HeartbeatFrame()]
    protocol.dataReceived(b"\x08\x00\x00\x00\x00\x00\x00\xce")  # the client's heartbeat, at 5 s
    listener.clock.advance(5)
    listener.clock.advance(4.9)
    assert codec.receive_data(take(transport)) == [HeartbeatFrame()]
    assert not transport.disconnecting
    listener.clock.advance(0.1)  # two intervals after the client's last frame, to the second
    assert transport.disconnecting
    assert take(transport) == b""  # closed without Connection.Close (section 4.2.7)
    protocol.connectionLost()
    assert not listener.clock.getDelayedCalls()


def test_no_timers_left_after_the_connection_is_lost() -> None:
    """A principal connection with heartbeats, lost, leaves no delayed call behind."""
    listener = Listener()
    protocol, _ = listener.connect()
    tune_ok = frame(0, 10, 31, struct.pack(">HIH", 16, 4096, 3))
    protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + tune_ok + OPEN)
    assert listener.clock.getDelayedCalls()
    protocol.connectionLost()
    assert not listener.clock.getDelayedCalls()


# --- our lease request (client role) against our listener, through iosim -------------------


def ask(listener: Listener, identity: str, secret: bytes, mode: str, target: str) -> object:
    """Run one `LeaseRequest` against the listener; the lease or the failure's message."""
    server = listener.factory.buildProtocol(None)
    assert server is not None
    request = LeaseRequest(identity, secret, mode, target, clock=listener.clock)
    outcomes: list[object] = []
    request.result.addCallbacks(outcomes.append, lambda f: outcomes.append(f.value))
    pump = iosim.connect(
        server,
        iosim.FakeTransport(server, isServer=True),
        request,
        iosim.FakeTransport(request, isServer=False),
        clock=listener.clock,
    )
    pump.flush()
    [outcome] = outcomes
    return outcome


def test_lease_request_gets_leases_that_open_sink_and_feed() -> None:
    """Our LeaseRequest gets Put-Ok and Get-Ok leases that the listener's DMP dialog accepts."""
    listener = Listener()
    sink_lease = ask(listener, "alice", b"pw-a", "put", "orders")
    feed_lease = ask(listener, "alice", b"pw-a", "get", "alerts")
    assert isinstance(sink_lease, str) and isinstance(feed_lease, str)
    assert listener.dmp_open(sink_lease)[1][-1].text == 'Ready to write to "orders"'
    assert listener.dmp_open(feed_lease)[1][-1].text == 'Ready to read from "alerts"'


def test_lease_request_failures_say_why() -> None:
    """A refused login, an unknown sink and a locked feed fail with the server's code and text."""
    listener = Listener()
    refused = ask(listener, "alice", b"nope", "put", "orders")
    assert isinstance(refused, LeaseRequestError)
    assert "connection.close 403" in str(refused)
    missing = ask(listener, "alice", b"pw-a", "put", "nope")
    assert isinstance(missing, LeaseRequestError)
    assert "channel.close 404" in str(missing) and "nope" in str(missing)
    feed_lease = ask(listener, "alice", b"pw-a", "get", "alerts")
    assert isinstance(feed_lease, str)
    listener.dmp_open(feed_lease)
    locked = ask(listener, "alice", b"pw-a", "get", "alerts")
    assert isinstance(locked, LeaseRequestError) and "405" in str(locked)


def test_lease_request_against_a_listener_without_principals() -> None:
    """A DMP listener that takes no principals answers DMP's 503: the request fails, clearly."""
    listener = Listener(DMPListenerSettings(sinks=frozenset({"orders"})))
    failed = ask(listener, "alice", b"pw-a", "put", "orders")
    assert isinstance(failed, LeaseRequestError)
    assert "takes no principal connections" in str(failed) and "503 INVALID" in str(failed)


@implementer(IStreamClientEndpoint)
class InMemoryEndpoint:
    """Connects to a listener's factory in memory (iosim), pumping at once."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.pumps: list[iosim.IOPump] = []

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        """Build both ends, connect them and flush what they say."""
        client = factory.buildProtocol(None)
        server = self.listener.factory.buildProtocol(None)
        assert client is not None and server is not None
        pump = iosim.connect(
            server,
            iosim.FakeTransport(server, isServer=True),
            client,
            iosim.FakeTransport(client, isServer=False),
            clock=self.listener.clock,
        )
        self.pumps.append(pump)
        return succeed(client)


def upstream_with_principal(
    listener: Listener, secret: bytes
) -> tuple[DMPUpstream, InMemoryEndpoint, GatewayMetrics]:
    """A put upstream logging in as alice for sink ``orders`` through the in-memory endpoint."""
    endpoint = InMemoryEndpoint(listener)
    metrics = GatewayMetrics()
    made = DMPUpstream(
        name="remote",
        settings=DMPUpstreamSettings(mode="put", principal="alice", target="orders"),
        endpoint=endpoint,
        router=Router(bind_routes([], {}), listener.clock, metrics),
        secrets=Secrets(upstreams={"remote": secret}),
        clock=listener.clock,
        metrics=metrics,
    )
    return made, endpoint, metrics


def test_upstream_presents_the_lease_it_was_granted() -> None:
    """The DMP connection waits for the principal's lease, then presents exactly it."""
    listener = Listener()
    up, endpoint, _ = upstream_with_principal(listener, b"pw-a")
    connection = DMPClientProtocol(up)
    transport = StringTransport()
    connection.makeConnection(transport)
    assert transport.value() == dmp.PROTOCOL_HEADER
    for pump in endpoint.pumps:
        pump.flush()
    [granted] = listener.factory.granted
    transport.clear()
    connection.dataReceived(dmp.encode_response(dmp.Response(200, "DMP/0.1")))
    assert transport.value() == short(granted.encode("ascii"))
    connection.dataReceived(dmp.encode_response(dmp.Response(200, 'Ready to write to "orders"')))
    assert up.connected


def test_upstream_without_a_lease_closes_and_counts() -> None:
    """A refused principal login closes the DMP connection (to retry later) and is counted."""
    listener = Listener()
    up, endpoint, metrics = upstream_with_principal(listener, b"wrong")
    connection = DMPClientProtocol(up)
    transport = StringTransport()
    connection.makeConnection(transport)
    connection.dataReceived(dmp.encode_response(dmp.Response(200, "DMP/0.1")))
    for pump in endpoint.pumps:
        pump.flush()
    assert transport.disconnecting
    assert not up.connected
    count = metrics.registry.get_sample_value(
        "msggateway_protocol_errors_total", {"endpoint": "remote", "kind": "no-lease"}
    )
    assert count == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=5), st.booleans())
def test_garbage_never_escapes(chunks: list[bytes], logged_in: bool) -> None:
    """Arbitrary bytes after the header (logged in or not) are answered or closed, never raised."""
    listener = Listener()
    if logged_in:
        protocol, transport, _ = listener.logged_in()
    else:
        protocol, transport = listener.connect()
        protocol.dataReceived(PROTOCOL_HEADER)
    for chunk in chunks:
        protocol.dataReceived(chunk)
    written = transport.value()
    if transport.disconnecting:
        # What was written is whole frames; the last closes the connection.
        last = FrameCodec().receive_data(written)[-1]
        assert isinstance(last, Method)
        assert last.name in ("connection.close", "connection.close-ok")


def test_handshake_methods_only_in_their_place() -> None:
    """A second Start-Ok after Open is 503 (no second login); Open before Tune-Ok is 503."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(start_ok(b"alice", b"pw-a"))
    [close] = replies(codec, transport)
    assert (close.name, close.arguments["reply_code"]) == ("connection.close", 503)
    assert "expected no connection method" in close.arguments["reply_text"]
    protocol, transport = listener.connect()
    protocol.dataReceived(PROTOCOL_HEADER + start_ok(b"alice", b"pw-a") + OPEN)
    *_, close = FrameCodec().receive_data(take(transport))
    assert isinstance(close, Method) and close.arguments["reply_code"] == 503
    assert "expected connection.tune-ok" in close.arguments["reply_text"]


def test_channel_zero_and_crossing_closes() -> None:
    """Direct.Put on channel 0 is 504; a Channel.Close crossing ours is answered with Close-Ok."""
    listener = Listener()
    protocol, transport, codec = listener.logged_in()
    protocol.dataReceived(put(b"nope"))
    assert [m.name for m in replies(codec, transport)] == ["channel.close"]
    protocol.dataReceived(frame(1, 20, 40, struct.pack(">H", 200) + short(b"") + b"\0" * 4))
    assert [m.name for m in replies(codec, transport)] == ["channel.close-ok"]
    protocol.dataReceived(CHANNEL_OPEN)
    assert [m.name for m in replies(codec, transport)] == ["channel.open-ok"]
    protocol.dataReceived(put(b"orders", channel=0))
    [close] = replies(codec, transport)
    assert (close.name, close.arguments["reply_code"]) == ("connection.close", 504)
