"""Unverified TLS upstreams and passwords in clear are refused or said out loud (issue 26, 11, 13e).

* Defect 11: Twisted's ``ssl:`` client endpoint verifies neither the server's
  host name nor, without ``caCertsDir``, its certificate. ``check-config``
  refuses it for an upstream, pointing to ``tls:``, and so does the gateway
  at start; with ``allow_unverified_tls = true`` it starts, and logs a
  warning naming the upstream.
* Defect 13e: a plaintext listener other hosts can reach that takes passwords
  (stream SASL PLAIN, SSMP ``secret``) is logged as a warning at start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import GatewayProcess, GatewayStartError

pytestmark = pytest.mark.integration

SSL_UPSTREAM = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.in]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.legacy]
protocol = "qmqp"
endpoint = "ssl:host=127.0.0.1:port=9"
{opt_out}
"""

EXPOSED = """
[gateway]
data_dir = "data"

[admin]
enabled = false

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=0.0.0.0"
schemes = ["secret", "open"]

[listeners.local]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"
"""


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_refuses_an_ssl_upstream(tmp_path: Path) -> None:
    """``check-config`` exits 1 and says to use tls: (or the loud opt-out)."""
    path = tmp_path / "gateway.toml"
    path.write_text(SSL_UPSTREAM.format(opt_out=""))
    checked = _check_config(path)
    assert checked.returncode == 1, checked.stdout
    assert "upstreams.legacy.endpoint: ssl: does not verify the server" in checked.stderr
    assert "use tls:host=HOST:port=PORT:trustRoots=CA-DIRECTORY" in checked.stderr


def test_the_gateway_does_not_start_with_an_ssl_upstream(tmp_path: Path) -> None:
    """The gateway (twistd) exits before anything listens, with the same reason."""
    with pytest.raises(GatewayStartError, match="ssl: does not verify the server"):
        GatewayProcess(tmp_path, SSL_UPSTREAM.format(opt_out="")).start()


def test_the_opt_out_starts_and_is_logged_loudly(tmp_path: Path) -> None:
    """With ``allow_unverified_tls = true``: check-config warns, and every start logs it."""
    path = tmp_path / "check.toml"
    config = SSL_UPSTREAM.format(opt_out="allow_unverified_tls = true")
    path.write_text(config)
    checked = _check_config(path)
    assert checked.returncode == 0, checked.stderr
    assert "warning: upstream legacy: ssl: does not verify" in checked.stderr
    gateway = GatewayProcess(tmp_path / "run", config).start()
    try:
        line = gateway.wait_for_log("INSECURE: upstream legacy")
    finally:
        gateway.stop()
    assert "does not verify the server's certificate or host name" in line
    assert "use tls:" in line


def test_reachable_plaintext_listeners_taking_passwords_are_logged(tmp_path: Path) -> None:
    """Stream PLAIN on every interface and SSMP secret on 0.0.0.0 are warned; loopback is not."""
    gateway = GatewayProcess(tmp_path, EXPOSED).start()
    try:
        streams = gateway.wait_for_log("INSECURE: listener streams")
        hub = gateway.wait_for_log("INSECURE: listener hub")
        output = gateway.output()
    finally:
        gateway.stop()
    assert "SASL PLAIN passwords in clear on 0.0.0.0" in streams
    assert "SSMP secret logins in clear on 0.0.0.0" in hub
    assert "listener local" not in output
