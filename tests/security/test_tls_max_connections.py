"""Past ``max_connections``, TLS listeners close new connections at once (issue 26, defect 8).

One gateway under twistd with an SSMP listener on ``mtls:`` (client
certificates required) and one on Twisted's ``ssl:``, each limited to five
connections. Five clients log in to each; then a crowd of connections that
never send a byte, and some that start a TLS handshake, arrive. Every one of
them must be closed promptly by the gateway (not left to the client), without
an "Unhandled Error" in the log, each counted as ``too-many-connections``;
the gateway's file descriptors stay bounded and the five logged-in clients
keep working.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess, LineClient

pytestmark = pytest.mark.integration

MAX_CONNECTIONS = 5
SILENT_CONNECTIONS = 200
"""Connections past the limit that never send a byte (the cheapest attack)."""
HANDSHAKING_CONNECTIONS = 20
"""Connections past the limit that start a TLS handshake."""
CLOSE_DEADLINE_SECONDS = 10.0
"""How long all of them together may stay open (each is closed when accepted)."""
FD_SLACK = 40
"""File descriptors the gateway may hold beyond what it held before the crowd."""

CONFIG = """
[gateway]
data_dir = "data"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.mtls]
protocol = "ssmp"
endpoint = "{mtls}"
schemes = ["cert"]
max_connections = {limit}

[listeners.ssl]
protocol = "ssmp"
endpoint = "ssl:0:interface=127.0.0.1:certKey={cert}:privateKey={key}"
schemes = ["open"]
max_connections = {limit}
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Two TLS listeners of five connections each."""
    config = CONFIG.format(
        mtls=mtls_endpoint(pki),
        cert=pki.server_cert,
        key=pki.server_key,
        limit=MAX_CONNECTIONS,
    )
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), config).start()
    yield process
    process.stop()


def _context(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
    return ctx


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _too_many(gateway: GatewayProcess, listener: str) -> float:
    pattern = re.compile(
        r'^msggateway_protocol_errors_total\{endpoint="'
        + re.escape(listener)
        + r'",kind="too-many-connections"\} (\S+)$',
        re.MULTILINE,
    )
    found = pattern.search(gateway.metrics())
    return float(found.group(1)) if found else 0.0


def _all_closed_by_peer(sockets: list[socket.socket], deadline: float) -> list[socket.socket]:
    """Wait until the gateway closed every socket; return those still open at the deadline."""
    open_ = set(sockets)
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while open_:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (ConnectionResetError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    data = b""
                if not data:  # closed (a TLS alert before the close is read as data)
                    selector.unregister(sock)
                    open_.discard(sock)
    return list(open_)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to count fds")
@pytest.mark.parametrize("listener", ["mtls", "ssl"])
def test_connections_past_the_limit_are_closed_at_once(
    gateway: GatewayProcess, pki: Pki, listener: str
) -> None:
    """Silent and handshaking connections past the limit are closed promptly; nothing leaks."""
    address = gateway.address(listener)
    before = _too_many(gateway, listener)
    with ExitStack() as stack:
        clients = []
        for number in range(MAX_CONNECTIONS):
            client = stack.enter_context(LineClient(address, _context(pki)))
            scheme = "cert" if listener == "mtls" else "open"
            client.send(f"LOGIN alice/{number} {scheme}")
            client.expect("200")
            clients.append(client)
        fds_before = _open_fds(gateway.pid)
        crowd = []
        for _ in range(SILENT_CONNECTIONS):
            # A connection reset before connect() even returned is closed already.
            with contextlib.suppress(ConnectionResetError):
                crowd.append(stack.enter_context(socket.create_connection(address, timeout=10)))
        refused = 0
        for _ in range(HANDSHAKING_CONNECTIONS):
            try:
                raw = stack.enter_context(socket.create_connection(address, timeout=10))
                with _context(pki).wrap_socket(raw, server_hostname="localhost"):
                    pass  # a completed handshake would be a connection let in
            except (ssl.SSLError, OSError):  # reset, broken pipe, EOF in the handshake
                refused += 1
        assert refused == HANDSHAKING_CONNECTIONS
        still_open = _all_closed_by_peer(crowd, time.monotonic() + CLOSE_DEADLINE_SECONDS)
        assert not still_open, f"{len(still_open)} of {SILENT_CONNECTIONS} stayed open"
        assert _open_fds(gateway.pid) <= fds_before + FD_SLACK
        for client in clients:  # the five are still served
            client.send("PING")
            client.expect("000 . PONG")
    assert _too_many(gateway, listener) - before >= SILENT_CONNECTIONS + HANDSHAKING_CONNECTIONS
    assert "Unhandled Error" not in gateway.output()
    assert "makeConnection" not in gateway.output()
