"""A real gateway's admin endpoint: bounded bodies, the Host check, leases bound to identities.

The probes, each over a raw socket or `http.client` against ``twistd
msggateway``:

- a 100 MB body declared on ``GET /metrics`` is refused with 413 once the
  headers are in, before the body is read (nothing spooled to a temporary
  file), and so is a POST past its limit and a chunked body that keeps
  coming;
- a request naming a foreign Host (a DNS-rebinding page) gets 421 on
  ``/metrics`` and ``/routes``; the loopback names are served, and an
  HTTP/1.0 request without Host too;
- ``POST /leases`` with ``"identity"`` makes a lease that a DMP client
  without a certificate, or with another identity's, cannot use (402), and
  alice's certificate can; an identity that names no one is 400.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.certs import Pki, issue_client_certificate, make_pki, mtls_endpoint, write_pem
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

TOKEN = "adm1n-t0ken"
READ_SECONDS = 5.0
"""How long a probe waits for an answer: a gateway that reads the body first never gives one."""

CONFIG = """
[gateway]
secrets = "secrets.toml"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.dmp]
protocol = "dmp"
endpoint = "{tls}"
sinks = ["orders"]
feeds = ["alerts"]
"""
SECRETS = f'admin_token = "{TOKEN}"\n'
ROUTES = {"orders": 'from = "dmp"\nmatch = "#"\nto = "hub"\naddress = "orders"\n'}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI, with a certificate for bob too."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    write_pem(pki.directory, "bob", issue_client_certificate(pki.ca, "bob"))
    return pki


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with the admin endpoint on loopback and a DMP listener on mtls (optional)."""
    process = GatewayProcess(
        tmp_path_factory.mktemp("admin-http"),
        CONFIG.format(tls=mtls_endpoint(pki, "optional")),
        routes=ROUTES,
        secrets=SECRETS,
    ).start()
    yield process
    process.stop()


def _connect(gateway: GatewayProcess) -> socket.socket:
    sock = socket.create_connection(gateway.address("admin"), timeout=READ_SECONDS)
    sock.settimeout(READ_SECONDS)
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response (headers and a Content-Length body) from a raw socket.

    Raises:
        TimeoutError: No whole answer within `READ_SECONDS`.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, _, value in (f.partition(": ") for f in fields)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status.split()[1]), headers, body


def _closed(sock: socket.socket) -> bool:
    """Whether the gateway ends the connection (EOF or reset) within `READ_SECONDS`."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _spooled_files(pid: int) -> list[str]:
    """The deleted temporary files the process holds open (twisted.web spools bodies there)."""
    fds = Path(f"/proc/{pid}/fd")
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(tempfile.gettempdir()) and target.endswith("(deleted)"):
            found.append(target)
    return found


def _admin_host(gateway: GatewayProcess) -> str:
    host, port = gateway.address("admin")
    return f"{host}:{port}"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_100_mb_body_on_get_metrics_is_413_before_it_is_read(gateway: GatewayProcess) -> None:
    """The 413 comes once the headers are in; no temporary file is opened for the body."""
    with _connect(gateway) as sock:
        sock.sendall(
            f"GET /metrics HTTP/1.1\r\nHost: {_admin_host(gateway)}\r\n"
            f"Content-Length: {100 * 1024 * 1024}\r\n\r\n".encode()
        )
        with contextlib.suppress(OSError):  # refused already: it may close meanwhile
            sock.sendall(b"x" * 65536)
        assert _spooled_files(gateway.pid) == []
        status, headers, body = _response(sock)
        assert status == 413
        assert headers["connection"] == "close"
        assert "too large" in json.loads(body)["error"]
        assert _closed(sock)


def test_post_body_past_its_limit_is_413(gateway: GatewayProcess) -> None:
    """``POST /leases`` declaring a megabyte is refused without reading it."""
    with _connect(gateway) as sock:
        sock.sendall(
            f"POST /leases HTTP/1.1\r\nHost: {_admin_host(gateway)}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1024 * 1024}\r\n\r\n".encode()
        )
        status, _, body = _response(sock)
    assert status == 413
    assert "at most" in json.loads(body)["error"]


def test_chunked_body_that_keeps_coming_is_413(gateway: GatewayProcess) -> None:
    """A chunked body is counted as it comes: 64 KiB into a GET, it is refused and closed."""
    with _connect(gateway) as sock:
        sock.sendall(
            f"GET /metrics HTTP/1.1\r\nHost: {_admin_host(gateway)}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"%x\r\n%s\r\n" % (4096, b"y" * 4096)
        with contextlib.suppress(OSError):  # refused already: it may close meanwhile
            for _ in range(16):
                sock.sendall(chunk)
        status, _, body = _response(sock)
        assert status == 413
        assert "too large" in json.loads(body)["error"]
        assert _closed(sock)


def _get(gateway: GatewayProcess, path: str, host: str) -> tuple[int, Any]:
    """GET ``path`` naming ``host`` in the Host header; the status and JSON (or text)."""
    address, port = gateway.address("admin")
    connection = http.client.HTTPConnection(address, port, timeout=READ_SECONDS)
    try:
        connection.request("GET", path, headers={"Host": host})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.getheader("Content-Type") == "application/json":
        return response.status, json.loads(body)
    return response.status, body.decode()


@pytest.mark.parametrize("path", ["/metrics", "/routes", "/healthz"])
@pytest.mark.parametrize("host", ["rebound.example", "rebound.example:{port}", "10.1.2.3:{port}"])
def test_a_foreign_host_is_421(gateway: GatewayProcess, path: str, host: str) -> None:
    """A Host naming anything but the endpoint (a rebound name) is 421, with a JSON reason."""
    port = gateway.address("admin")[1]
    status, answer = _get(gateway, path, host.format(port=port))
    assert status == 421, answer
    assert "does not answer for host" in answer["error"]


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "127.0.0.1", "localhost:{port}"])
def test_the_loopback_names_are_served(gateway: GatewayProcess, host: str) -> None:
    """The address it listens on and ``localhost`` are served, with the port or without."""
    port = gateway.address("admin")[1]
    status, text = _get(gateway, "/metrics", host.format(port=port))
    assert status == 200
    assert "msggateway_" in text
    assert gateway.metrics().startswith("# HELP")  # as the harness and bench scrape it


def test_without_host_http_1_1_is_400_and_http_1_0_is_served(gateway: GatewayProcess) -> None:
    """HTTP/1.1 must name its Host (RFC 9112); HTTP/1.0 may not, and no browser omits it."""
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        status, _, body = _response(sock)
    assert status == 400 and "needs a Host" in json.loads(body)["error"]
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        status, _, body = _response(sock)
    assert status == 200 and json.loads(body)["status"] == "ok"


def _post_lease(gateway: GatewayProcess, asked: dict[str, object]) -> tuple[int, Any]:
    address, port = gateway.address("admin")
    connection = http.client.HTTPConnection(address, port, timeout=READ_SECONDS)
    try:
        connection.request(
            "POST",
            "/leases",
            body=json.dumps(asked),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _dmp_open(gateway: GatewayProcess, pki: Pki, lease: str, who: str | None) -> bytes:
    """Open the DMP listener over TLS (with ``who``'s certificate, or none); the lease answer."""
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    if who is not None:
        context.load_cert_chain(
            str(pki.directory / f"{who}.pem"), str(pki.directory / f"{who}.key")
        )
    raw = socket.create_connection(gateway.address("dmp"), timeout=READ_SECONDS)
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        text = lease.encode()
        tls.sendall(b"AMQP\x0a\x01\x00\x01" + bytes((len(text),)) + text)
        data = b""
        deadline = time.monotonic() + READ_SECONDS
        while time.monotonic() < deadline:
            if data and len(data) > data[0] + 1 and len(data) >= 2 + data[0] + data[1 + data[0]]:
                break
            more = tls.recv(4096)
            if not more:
                break
            data += more
    rest = data[1 + data[0] :]
    return rest[1 : 1 + rest[0]]


def test_a_lease_asked_for_an_identity_is_bound_to_it(gateway: GatewayProcess, pki: Pki) -> None:
    """Without a certificate, or with bob's, the lease is 402; alice's opens the sink."""
    status, made = _post_lease(gateway, {"listener": "dmp", "sink": "orders", "identity": "alice"})
    assert status == 201, made
    assert made["identity"] == "alice"
    lease = str(made["lease"])
    assert _dmp_open(gateway, pki, lease, None).startswith(b"402 BAD-LEASE")
    assert _dmp_open(gateway, pki, lease, "bob").startswith(b"402 BAD-LEASE")
    assert _dmp_open(gateway, pki, lease, "alice").startswith(b'200 OK Ready to write to "orders"')


@pytest.mark.parametrize(
    "asked",
    [
        {"listener": "dmp", "sink": "orders", "identity": ""},
        {"listener": "dmp", "sink": "orders", "identity": "*"},
        {"listener": "dmp", "sink": "orders", "identity": None},
        {"listener": "dmp", "sink": "orders", "identiy": "alice"},
    ],
)
def test_a_lease_asked_for_no_usable_identity_is_400(
    gateway: GatewayProcess, asked: dict[str, object]
) -> None:
    """An identity naming no one, or a misspelt key, is refused: no unbound lease comes back."""
    status, answer = _post_lease(gateway, asked)
    assert status == 400, answer
    assert "lease" not in answer
