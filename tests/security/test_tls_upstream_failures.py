"""Upstream TLS failures are logged with their reason and counted (issue 26, defect 12).

Three TLS servers present a certificate the gateway's upstreams do not
trust (their ``trustRoots`` hold another CA). An SSMP, a stream and a QMQP
upstream each connect to one over ``tls:``. Each failed handshake must be
logged as a warning naming the upstream, its address and OpenSSL's reason,
and counted in ``/metrics`` as ``tls-failed``; ClientService's "Scheduling
retry" lines name the upstream and its address instead of a
``_WrapperEndpoint object at 0x...``. The QMQP upstream (which sends nothing
first without ``username``) must not say "connected" before the handshake,
and its back-off must grow from one failed handshake to the next instead of
starting over.
"""

from __future__ import annotations

import re
import shutil
import socket
import ssl
import threading
from collections.abc import Iterator

import pytest

from tests.certs import Pki, make_pki
from tests.integration.harness import GatewayProcess

pytestmark = pytest.mark.integration

UPSTREAMS = ("ssmp-up", "stream-up", "qmqp-up")
PROTOCOLS = {"ssmp-up": "ssmp", "stream-up": "stream", "qmqp-up": "qmqp"}
EXTRA = {"ssmp-up": 'identity = "gw"\n', "stream-up": "", "qmqp-up": ""}
RETRIES_SEEN = 5
"""Failed QMQP handshakes after which the back-off must have grown past its start."""
GROWN_DELAY_SECONDS = 2.0
"""The fifth wait is at least 0.5 * 1.5**4 = 2.53 s; a back-off that starts over at every
handshake waits 0.5 s plus at most 1 s of jitter."""

CONFIG = """
[gateway]
data_dir = "data"
secrets = "secrets.toml"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.in]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"
"""
UPSTREAM = """
[upstreams.{name}]
protocol = "{protocol}"
endpoint = "tls:host=localhost:port={port}:trustRoots={trust}"
{extra}"""
SECRETS = """
[upstreams]
ssmp-up = "secret"
"""


class UntrustedTLSServer(threading.Thread):
    """Accepts TLS connections with a certificate the gateway does not trust; counts them."""

    def __init__(self, pki: Pki) -> None:
        super().__init__(daemon=True)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        """Accept and attempt each handshake (the client refuses it) until stopped."""
        while not self._stopping.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with raw:
                raw.settimeout(5)
                try:
                    with self.context.wrap_socket(raw, server_side=True) as tls:
                        tls.recv(1)
                except (ssl.SSLError, OSError):
                    pass

    def stop(self) -> None:
        """Stop accepting and close the listening socket."""
        self._stopping.set()
        self.join(5)
        self.listener.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(pki: Pki) -> Iterator[dict[str, UntrustedTLSServer]]:
    """One untrusted TLS server per upstream."""
    running = {name: UntrustedTLSServer(pki) for name in UPSTREAMS}
    for server in running.values():
        server.start()
    yield running
    for server in running.values():
        server.stop()


@pytest.fixture(scope="module")
def gateway(
    pki: Pki, servers: dict[str, UntrustedTLSServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """Upstreams over tls: that trust only another CA than the servers' one."""
    directory = tmp_path_factory.mktemp("gateway")
    other_trust = directory / "other-trust"
    other_trust.mkdir()
    shutil.copy(pki.wrong_ca_cert, other_trust / "ca.pem")
    config = CONFIG + "".join(
        UPSTREAM.format(
            name=name,
            protocol=PROTOCOLS[name],
            port=servers[name].port,
            trust=other_trust,
            extra=EXTRA[name],
        )
        for name in UPSTREAMS
    )
    process = GatewayProcess(directory / "run", config, secrets=SECRETS).start()
    yield process
    process.stop()


def _tls_failed(gateway: GatewayProcess, upstream: str) -> float:
    pattern = re.compile(
        r'^msggateway_protocol_errors_total\{endpoint="'
        + re.escape(upstream)
        + r'",kind="tls-failed"\} (\S+)$',
        re.MULTILINE,
    )
    found = pattern.search(gateway.metrics())
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("upstream", UPSTREAMS)
def test_a_failed_handshake_is_logged_with_upstream_address_and_reason(
    gateway: GatewayProcess, servers: dict[str, UntrustedTLSServer], upstream: str
) -> None:
    """One warning names the upstream, where it connects and OpenSSL's reason; it is counted."""
    port = servers[upstream].port
    line = gateway.wait_for_log(f"upstream {upstream}: TLS with localhost:{port} \\(TLS\\) failed")
    assert "certificate verify failed" in line
    assert _tls_failed(gateway, upstream) >= 1
    retry = gateway.wait_for_log(f"Scheduling retry .* to connect upstream {upstream} at ")
    assert f"localhost:{port} (TLS)" in retry
    assert "_WrapperEndpoint" not in gateway.output()


def test_the_qmqp_upstream_is_not_connected_and_backs_off_further(
    gateway: GatewayProcess, servers: dict[str, UntrustedTLSServer]
) -> None:
    """No "connected" before a handshake that fails; each wait is longer than the last."""
    gateway.wait_for_log_count("to connect upstream qmqp-up at", RETRIES_SEEN, timeout=30)
    delays = [
        float(found.group(1))
        for found in re.finditer(
            r"to connect upstream qmqp-up at \S+ \(TLS\) in ([0-9.]+) seconds", gateway.output()
        )
    ]
    assert len(delays) >= RETRIES_SEEN
    assert delays[RETRIES_SEEN - 1] > GROWN_DELAY_SECONDS, delays
    assert "upstream qmqp-up: connected" not in gateway.output()
    assert servers["qmqp-up"].accepted >= RETRIES_SEEN
