"""Tests of `gateway.protocols.stream.blocking`: the blocking stream-protocol client.

The client talks over one end of a socket pair; the test plays the server
at the other end with the codec in the server role. Correlation ids are
the client's count from 1, so a test writes the server's answers before
the call that awaits them and reads what the client sent afterwards: no
threads. Time-outs and heartbeats use intervals of a few hundredths of a
second.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import __version__
from gateway.codecs import osiris
from gateway.codecs import stream as sp
from gateway.protocols.stream.blocking import (
    BlockingStreamClient,
    Endpoint,
    StreamClientError,
    code_name,
    connect,
)

SHORT_SECONDS = 0.05
"""A time-out that expires quickly."""


class FakeServer:
    """The server's end of the pair: writes frames with a server codec, reads the client's."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.codec = sp.StreamCodec(sp.Role.SERVER, frame_max=0)

    def say(self, *events: sp.Event) -> None:
        """Send frames to the client."""
        self.sock.sendall(b"".join(self.codec.send(event) for event in events))

    def heard(self) -> list[sp.Event]:
        """Every frame the client has sent so far."""
        self.sock.setblocking(False)
        events: list[sp.Event] = []
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return events
            if not data:
                return events
            events += self.codec.receive_data(data)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, FakeServer]]:
    """A connected socket pair: the client's end, and the fake server on the other."""
    client_end, server_end = socket.socketpair()
    yield client_end, FakeServer(server_end)
    client_end.close()
    server_end.close()


def opening(
    *, frame_max: int = 131_072, heartbeat: int = 60, login: int = sp.ResponseCode.OK
) -> list[sp.Event]:
    """The server's side of a successful opening (correlation ids 1 to 4)."""
    return [
        sp.PeerPropertiesResponse(correlation_id=1, code=1, properties={"product": "test"}),
        sp.SaslHandshakeResponse(correlation_id=2, code=1, mechanisms=("AMQPLAIN", "PLAIN")),
        sp.SaslAuthenticateResponse(correlation_id=3, code=login),
        sp.Tune(frame_max=frame_max, heartbeat=heartbeat),
        sp.OpenResponse(correlation_id=4, code=1, properties={}),
    ]


def opened(
    pair: tuple[socket.socket, FakeServer], timeout: float | None = 5.0, **callbacks: object
) -> tuple[BlockingStreamClient, FakeServer]:
    """A client past its opening; what it sent meanwhile is read and dropped."""
    sock, server = pair
    client = BlockingStreamClient(sock, timeout=timeout, **callbacks)  # type: ignore[arg-type]
    server.say(*opening())
    client.open(username="guest", password="guest", virtual_host="/")
    server.heard()
    return client, server


def deliver(first_offset: int) -> sp.Deliver:
    """A Deliver of one chunk with one entry."""
    chunk = osiris.encode_chunk([b"entry"], first_offset=first_offset, timestamp_ms=0)
    return sp.Deliver(subscription_id=1, chunk=chunk)


# --- opening ----------------------------------------------------------------------------------


def test_open_speaks_the_handshake_and_takes_the_tighter_frame_max(
    pair: tuple[socket.socket, FakeServer],
) -> None:
    """PeerProperties (ours over the defaults), PLAIN, Tune echoed within 1 MiB, Open."""
    sock, server = pair
    client = BlockingStreamClient(sock, timeout=5.0)
    server.say(*opening(frame_max=0, heartbeat=30))
    client.open(
        username="me",
        password="secret",
        virtual_host="vh",
        properties={"connection_name": "test"},
    )
    assert server.heard() == [
        sp.PeerProperties(
            correlation_id=1,
            properties={"product": "msggateway", "version": __version__, "connection_name": "test"},
        ),
        sp.SaslHandshake(correlation_id=2),
        sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0me\0secret"),
        sp.Tune(frame_max=sp.DEFAULT_FRAME_MAX_BYTES, heartbeat=30),
        sp.Open(correlation_id=4, virtual_host="vh"),
    ]
    assert (client.frame_max, client.heartbeat_seconds) == (sp.DEFAULT_FRAME_MAX_BYTES, 30.0)


def test_open_without_heartbeats_asks_for_none(pair: tuple[socket.socket, FakeServer]) -> None:
    """Heartbeats off: our Tune asks for none; a frame max under 1 MiB is taken as it is."""
    sock, server = pair
    client = BlockingStreamClient(sock, timeout=5.0)
    server.say(*opening(frame_max=65_536, heartbeat=60))
    client.open(username="u", password="p", virtual_host="/", heartbeats=False)
    assert sp.Tune(frame_max=65_536, heartbeat=0) in server.heard()
    assert (client.frame_max, client.heartbeat_seconds) == (65_536, 0.0)


def test_a_refused_login_ends_the_opening(pair: tuple[socket.socket, FakeServer]) -> None:
    """A SaslAuthenticate answered with code 8 is an error naming the user and the code."""
    sock, server = pair
    client = BlockingStreamClient(sock, timeout=5.0)
    server.say(*opening(login=sp.ResponseCode.AUTHENTICATION_FAILURE)[:3])
    with pytest.raises(StreamClientError, match=r"login as 'me' refused \(authentication failure"):
        client.open(username="me", password="wrong", virtual_host="/")


def test_no_plain_mechanism(pair: tuple[socket.socket, FakeServer]) -> None:
    """A server that offers no PLAIN is refused before any credentials are sent."""
    sock, server = pair
    client = BlockingStreamClient(sock, timeout=5.0)
    server.say(
        sp.PeerPropertiesResponse(correlation_id=1, code=1, properties={}),
        sp.SaslHandshakeResponse(correlation_id=2, code=1, mechanisms=("EXTERNAL",)),
    )
    with pytest.raises(StreamClientError, match=r"offers no PLAIN login \(\['EXTERNAL'\]\)"):
        client.open(username="me", password="pw", virtual_host="/")
    assert not any(isinstance(event, sp.SaslAuthenticate) for event in server.heard())


# --- requests and frames that come unasked ---------------------------------------------------


def test_request_returns_its_response_and_queues_the_rest(
    pair: tuple[socket.socket, FakeServer],
) -> None:
    """Frames before the response are kept in order for next; Heartbeats are dropped."""
    client, server = opened(pair)
    create = sp.Response(key=sp.Key.CREATE, correlation_id=5, code=1)
    server.say(deliver(0), sp.HEARTBEAT, sp.PublishConfirm(publisher_id=1, publishing_ids=[1]))
    server.say(create, deliver(1))
    assert client.request(lambda c: sp.Create(correlation_id=c, stream="s")) == create
    assert server.heard() == [sp.Create(correlation_id=5, stream="s")]
    first, confirm, second = (client.next("frames") for _ in range(3))
    assert isinstance(first, sp.Deliver) and isinstance(second, sp.Deliver)
    assert confirm == sp.PublishConfirm(publisher_id=1, publishing_ids=[1])


def test_callbacks_take_confirms_and_errors(pair: tuple[socket.socket, FakeServer]) -> None:
    """With callbacks, PublishConfirm and PublishError go to them, whichever call reads them."""
    taken: list[object] = []
    client, server = opened(pair, on_confirm=taken.append, on_error=taken.append)
    client.publish(1, [1, 2, 3], [b"a", b"b", b"c"])
    assert server.heard() == [
        sp.Publish(publisher_id=1, publishing_ids=[1, 2, 3], messages=[b"a", b"b", b"c"])
    ]
    confirm = sp.PublishConfirm(publisher_id=1, publishing_ids=[1, 3])
    error = sp.PublishError(publisher_id=1, publishing_ids=[2], codes=[6])
    server.say(confirm)
    client.wait("confirms")
    server.say(error, sp.Response(key=sp.Key.DELETE_PUBLISHER, correlation_id=5, code=1))
    client.request(lambda c: sp.DeletePublisher(correlation_id=c, publisher_id=1))
    assert taken == [confirm, error]


def test_poll_handles_what_has_come_without_waiting(
    pair: tuple[socket.socket, FakeServer],
) -> None:
    """Polling takes what is there and returns; with nothing there it returns at once."""
    taken: list[object] = []
    client, server = opened(pair, timeout=None, on_confirm=taken.append)
    client.poll()
    assert taken == []
    server.say(*(sp.PublishConfirm(publisher_id=0, publishing_ids=[i]) for i in (1, 2)))
    client.poll()
    assert [list(confirm.publishing_ids) for confirm in taken] == [[1], [2]]  # type: ignore[attr-defined]


# --- endings ------------------------------------------------------------------------------------


def test_a_close_from_the_server_is_answered_and_ends_the_session(
    pair: tuple[socket.socket, FakeServer],
) -> None:
    """Close: a CloseResponse with its correlation id, then an error with the server's reason."""
    client, server = opened(pair)
    server.say(sp.Close(correlation_id=9, code=sp.ResponseCode.INTERNAL_ERROR, reason="bye"))
    with pytest.raises(StreamClientError, match=r"closed the connection: bye \(internal error\)"):
        client.next("messages")
    assert server.heard() == [sp.CloseResponse(correlation_id=9, code=1)]


def test_a_stream_that_goes_away_ends_the_session(pair: tuple[socket.socket, FakeServer]) -> None:
    """MetadataUpdate: the stream and the code say why."""
    client, server = opened(pair)
    server.say(sp.MetadataUpdate(code=sp.ResponseCode.STREAM_NOT_AVAILABLE, stream="s"))
    with pytest.raises(StreamClientError, match=r"stream s is no longer .* \(stream not available"):
        client.next("messages")


def test_garbage_from_the_server(pair: tuple[socket.socket, FakeServer]) -> None:
    """A frame the client role does not read is bad data."""
    client, server = opened(pair)
    server.sock.sendall(b"\0\0\0\4\x7f\x7f\0\1")  # an unknown key
    with pytest.raises(StreamClientError, match="bad data from the server"):
        client.next("messages")


def test_the_server_hanging_up(pair: tuple[socket.socket, FakeServer]) -> None:
    """The end of the connection is an error saying what the client waited for."""
    client, server = opened(pair)
    server.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(StreamClientError, match="closed the connection; we waited for messages"):
        client.next("messages")


def test_time_out_and_heartbeats(pair: tuple[socket.socket, FakeServer]) -> None:
    """Waiting sends a Heartbeat each silent interval; the server's Heartbeats are no progress."""
    client, server = opened(pair, timeout=SHORT_SECONDS * 4)
    client.heartbeat_seconds = SHORT_SECONDS
    server.say(sp.HEARTBEAT)
    with pytest.raises(StreamClientError, match="timed out waiting for messages"):
        client.next("messages")
    beats = server.heard()
    assert len(beats) >= 2 and set(beats) == {sp.HEARTBEAT}


def test_close_asks_then_closes_the_socket(pair: tuple[socket.socket, FakeServer]) -> None:
    """Closing sends Close and takes its answer; unanswered, it gives up after its time-out."""
    client, server = opened(pair)
    server.say(sp.CloseResponse(correlation_id=5, code=1))
    client.close()
    assert server.heard() == [sp.Close(correlation_id=5, code=1, reason="done")]
    assert pair[0].fileno() == -1
    near, far = socket.socketpair()
    with near, far:
        BlockingStreamClient(near, timeout=None).close(SHORT_SECONDS)
        assert near.fileno() == -1


def test_code_names() -> None:
    """Known codes in words, others by number."""
    assert (code_name(2), code_name(99)) == ("stream does not exist", "code 99")


# --- connecting ---------------------------------------------------------------------------------


def test_connect_over_tcp_without_nagle() -> None:
    """A tcp: endpoint gives a connected socket with TCP_NODELAY set."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        with connect(Endpoint(host, port, timeout=5.0)) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert not isinstance(sock, ssl.SSLSocket)


def test_connect_with_a_trust_root_directory_without_certificates(tmp_path: Path) -> None:
    """A trustRoots directory without a .pem file is refused before the handshake."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        endpoint = Endpoint(host, port, tls=True, timeout=5.0, trust_roots=str(tmp_path))
        with pytest.raises(ValueError, match=r"no \.pem certificate"):
            connect(endpoint)
