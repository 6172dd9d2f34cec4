"""Bad frames to the stream listener of a real gateway, from plain sockets.

A frame over the tuned frame_max, an unknown key, or a frame whose fields are
cut short gets a Close with the protocol's code (14, 13, 13) after Open, and
the connection ends; before Open the connection is just closed. Other
connections are unaffected.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from gateway.codecs import stream as sp
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

CONFIG = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
guest = true
frame_max = 65536
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway whose stream listener tunes frame_max to 64 KiB."""
    process = GatewayProcess(tmp_path_factory.mktemp("bad-frames"), CONFIG).start()
    yield process
    process.stop()


class Session:
    """A plain-socket stream client that speaks through our client codec."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.sock = socket.create_connection(gateway.address("streams"), timeout=15)
        self.codec = sp.StreamCodec(sp.Role.CLIENT, frame_max=0)
        self.events: list[sp.Event] = []

    def send(self, event: sp.Event) -> None:
        """Send one frame."""
        self.sock.sendall(self.codec.send(event))

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def read(self) -> sp.Event:
        """Return the next frame from the server."""
        while not self.events:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("closed")
            self.events.extend(self.codec.receive_data(data))
        return self.events.pop(0)

    def closed(self) -> bool:
        """Wait for the server to close; True if it did (reads past any frames)."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        return True

    def open(self) -> None:
        """Do the whole handshake as guest."""
        self.send(sp.PeerProperties(correlation_id=1, properties={}))
        assert isinstance(self.read(), sp.PeerPropertiesResponse)
        self.send(sp.SaslHandshake(correlation_id=2))
        assert isinstance(self.read(), sp.SaslHandshakeResponse)
        self.send(sp.SaslAuthenticate(correlation_id=3, mechanism="PLAIN", data=b"\0guest\0guest"))
        assert self.read() == sp.SaslAuthenticateResponse(correlation_id=3, code=1)
        tune = self.read()
        assert isinstance(tune, sp.Tune) and tune.frame_max == 65536
        self.send(sp.Tune(frame_max=65536, heartbeat=0))
        self.send(sp.Open(correlation_id=4, virtual_host="/"))
        opened = self.read()
        assert isinstance(opened, sp.OpenResponse) and opened.code == 1

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def still_serving(gateway: GatewayProcess) -> None:
    """A fresh connection opens and answers Metadata."""
    other = Session(gateway)
    try:
        other.open()
        other.send(sp.Metadata(correlation_id=9, streams=("nothing-here",)))
        answer = other.read()
        assert isinstance(answer, sp.MetadataResponse)
        assert answer.streams[0].code == 2
    finally:
        other.close()


def expect_close(session: Session, code: int) -> None:
    """The server asks to close with ``code``; answering it ends the connection."""
    frame = session.read()
    assert isinstance(frame, sp.Close), frame
    assert frame.code == code
    session.send(sp.CloseResponse(correlation_id=frame.correlation_id, code=1))
    assert session.closed()


def test_frame_over_frame_max_after_open(gateway: GatewayProcess) -> None:
    """A declared size over the tuned frame_max gets Close(14), before the body is sent."""
    session = Session(gateway)
    try:
        session.open()
        session.send_raw(struct.pack(">IHH", 200_000, 0x0002, 1))  # a 200 kB Publish, no body
        expect_close(session, 14)
    finally:
        session.close()
    still_serving(gateway)


def test_unknown_key_after_open(gateway: GatewayProcess) -> None:
    """An unknown command key gets Close(13)."""
    session = Session(gateway)
    try:
        session.open()
        session.send_raw(struct.pack(">IHHI", 8, 0x0077, 1, 5))
        expect_close(session, 13)
    finally:
        session.close()
    still_serving(gateway)


def test_truncated_fields_after_open(gateway: GatewayProcess) -> None:
    """A DeclarePublisher whose stream name runs past the frame gets Close(13)."""
    session = Session(gateway)
    try:
        session.open()
        # key 1 v1, correlation 5, publisher 0, reference "", stream of declared length 40
        body = struct.pack(">HHIBhh", 0x0001, 1, 5, 0, 0, 40) + b"short"
        session.send_raw(struct.pack(">I", len(body)) + body)
        expect_close(session, 13)
    finally:
        session.close()
    still_serving(gateway)


def test_oversized_frame_before_open_just_closes(gateway: GatewayProcess) -> None:
    """Before Open, a frame over 8,192 bytes closes the connection without a word."""
    session = Session(gateway)
    try:
        session.send_raw(struct.pack(">IHH", 9000, 0x0011, 1))
        assert session.closed()
        assert session.events == []
    finally:
        session.close()
    still_serving(gateway)


def test_wrong_password_is_refused(gateway: GatewayProcess) -> None:
    """A wrong password gets code 8 and the connection closes."""
    session = Session(gateway)
    try:
        session.send(sp.PeerProperties(correlation_id=1, properties={}))
        session.read()
        session.send(sp.SaslAuthenticate(correlation_id=2, mechanism="PLAIN", data=b"\0guest\0x"))
        assert session.read() == sp.SaslAuthenticateResponse(correlation_id=2, code=8)
        assert session.closed()
    finally:
        session.close()
