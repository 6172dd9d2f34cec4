"""What users install is the wheel: built, installed into a fresh virtualenv, run.

The wheel is built from this checkout with pip (as ``pip wheel .`` would on
a user's machine) and installed, not editable, into a new virtualenv that
has only what the wheel declares. From there:

* ``twistd msggateway`` (the plugin in ``twisted/plugins``) starts on the
  packaged embedded default (``gateway/default.toml`` read from the
  installed package, its ports turned to 0 so runs never collide) and
  serves: mail sent over QMQP reaches an SSMP subscriber along the default
  route;
* an ``mtls:`` endpoint (the other plugin) parses in that install: an SSMP
  listener on one takes a client certificate login;
* the ``msggateway`` console script answers ``check-config``;
* the wheel carries the example configurations: ``msggateway init`` lists
  them, prints the embedded default, and writes the starter (config,
  routes, secrets, a unit naming this install's twistd), which that twistd
  then runs.

Building and installing take about 20-30 s (the dependencies come from the
package index, or pip's cache).
"""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.certs import Pki, make_pki, mtls_endpoint
from tests.integration.harness import GatewayProcess, LineClient
from tests.integration.test_qmqp import QMQPSession, mail

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SECONDS = 600


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv with the wheel built from this checkout installed."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(where / "dist"),
            str(ROOT),
        ],
        check=True,
        timeout=INSTALL_SECONDS,
    )
    [wheel] = (where / "dist").glob("msggateway-*.whl")
    environment = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(environment)], check=True)
    subprocess.run(
        [
            str(environment / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        timeout=INSTALL_SECONDS,
    )
    yield environment


def installed(venv: Path, code: str) -> str:
    """Run Python code in the fresh virtualenv (outside this checkout); return its output."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        cwd=venv,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_the_wheel_is_not_this_checkout(venv: Path) -> None:
    """The fresh install imports its own copy, both Twisted plugins and the status page."""
    where = installed(venv, "import gateway, twisted.plugins as p; print(gateway.__file__)")
    assert str(venv) in where and str(ROOT) not in where
    plugins = installed(
        venv,
        "from twisted.plugin import getCache; import twisted.plugins as p;"
        "print(sorted(getCache(p)))",
    )
    assert "'msggateway_plugin'" in plugins and "'msggateway_endpoints'" in plugins
    files = installed(venv, "import importlib.metadata as m; print(m.files('msggateway'))")
    assert "LICENSE" in files
    for name in ("status.html", "status.js", "status.css", "favicon.svg"):
        assert f"gateway/admin/static/{name}" in files  # the admin endpoint's status page


def test_twistd_runs_the_packaged_default_and_serves(venv: Path, tmp_path: Path) -> None:
    """``twistd -n msggateway`` from the wheel, on its embedded default: QMQP mail reaches SSMP."""
    default = installed(
        venv,
        "import importlib.resources as r;"
        "print(r.files('gateway').joinpath('default.toml').read_text(), end='')",
    )
    config = re.sub(r"tcp:\d+:", "tcp:0:", default)
    config = re.sub(r"(?m)^data_port = \d+$", "data_port = 0", config)
    assert config != default and "tcp:0:interface=127.0.0.1" in config
    gateway = GatewayProcess(tmp_path, config, twistd=str(venv / "bin" / "twistd")).start()
    try:
        assert str(venv) in gateway.output()  # twistd and Python of the fresh install
        with LineClient(gateway.address("ssmp")) as watcher:
            watcher.send("LOGIN watcher open", "SUBSCRIBE mail.ops@example.org")
            watcher.expect("200")
            watcher.expect("200")
            client = QMQPSession(gateway.address("qmqp"))
            try:
                client.send(mail("w1", "ops@example.org", subject="from the wheel") + b"1:D,")
                [reply, _done] = client.read_blocks(2)
            finally:
                client.close()
            assert getattr(reply, "status", None) == b"K", reply
            line = watcher.read_line()
            assert line.startswith(b"000 ") and b"from the wheel" in line, line
        assert "Traceback" not in gateway.output()
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A fresh test PKI."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_an_mtls_endpoint_parses_in_the_installed_wheel(
    venv: Path, tmp_path: Path, pki: Pki
) -> None:
    """An SSMP listener on ``mtls:`` (the endpoints plugin) takes a certificate login."""
    config = f"""
[admin]
enabled = false

[listeners.secure]
protocol = "ssmp"
endpoint = "{mtls_endpoint(pki)}"
schemes = ["open"]
"""
    gateway = GatewayProcess(tmp_path, config, twistd=str(venv / "bin" / "twistd")).start()
    try:
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        context.load_cert_chain(str(pki.alice_cert), str(pki.alice_key))
        with LineClient(gateway.address("secure"), context) as client:
            client.send("LOGIN alice cert")
            client.expect("200")
    finally:
        gateway.stop()


def test_the_console_script_checks_a_config(venv: Path) -> None:
    """``msggateway check-config`` from the install validates the embedded default."""
    done = subprocess.run(
        [str(venv / "bin" / "msggateway"), "check-config"],
        cwd=venv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


def test_init_from_the_wheel_writes_the_starter_and_twistd_runs_it(
    venv: Path, tmp_path: Path
) -> None:
    """``msggateway init`` in the install: the examples are there, and what it writes runs."""
    msggateway = str(venv / "bin" / "msggateway")

    def run(*argv: str) -> str:
        done = subprocess.run(
            [msggateway, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = [line.split()[0] for line in run("init", "--list").splitlines()]
    assert listed == [
        "starter",
        "mtl-ssmp",
        "qmqp-to-dmp",
        "ssmp-to-rabbitmq",
        "tls-frontend",
        "default",
    ]
    packaged = installed(
        venv,
        "import importlib.resources as r;"
        "print(r.files('gateway').joinpath('default.toml').read_text(), end='')",
    )
    assert run("init", "--print") == packaged
    conf = tmp_path / "conf"
    out = run("init", "--data-dir", str(tmp_path / "state"), str(conf))
    assert f"{conf / 'gateway.toml'}: OK: 2 listener(s)" in out
    assert f"ExecStart={venv / 'bin' / 'twistd'} " in (conf / "msggateway.service").read_text()
    assert "OK" in run("check-config", str(conf / "gateway.toml"))
    config = re.sub(
        r'(?m)^endpoint = "tcp:\d+:', 'endpoint = "tcp:0:', (conf / "gateway.toml").read_text()
    )
    gateway = GatewayProcess(conf, config, twistd=str(venv / "bin" / "twistd")).start()
    try:
        assert set(gateway.addresses) == {"hub", "mail", "admin"}
        assert (tmp_path / "state" / "admin-token").exists()
    finally:
        gateway.stop()


def test_the_sdist_carries_the_plugins_and_the_default(tmp_path: Path) -> None:
    """The source distribution holds what the wheel is built from: the plugins, the configs."""
    import tarfile

    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=INSTALL_SECONDS,
    )
    [sdist] = tmp_path.glob("msggateway-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {
        "twisted/plugins/msggateway_plugin.py",
        "twisted/plugins/msggateway_endpoints.py",
        "gateway/default.toml",
        "gateway/examples/gateway.toml",
        "gateway/examples/msggateway.service",
        "gateway/examples/routes/mail-alerts.toml",
        "gateway/examples/ssmp-to-rabbitmq/gateway.toml",
    } <= names
    assert "twisted/plugins/dropin.cache" not in names
